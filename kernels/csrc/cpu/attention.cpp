#include "attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "tile_math.h"
#include "vec.h"

namespace kvserve {

// A query vector of a unit and its running softmax over the unit's rows lo .. hi - 1: `out`
// holds the sum of exp(score - mx) v over the rows taken so far, `sum` that of exp(score - mx).
// A query whose row counts for the scores keeps the weight exp(score - mx) of each row i at
// kept[i], mx as it was once row i's tile was taken, at maxima[i / tile].
struct QueryState {
  const float* q;
  float* out;
  int64_t lo, hi;
  float mx, sum;
  float *kept = nullptr, *maxima = nullptr;
};

// What a tile's attention needs to know of its rows and queries.
struct TileShape {
  int64_t Dk, Dv, tile;  // tile: the most rows of a tile (scores per query)
  float scale;
};

AttentionScratch::AttentionScratch() = default;
AttentionScratch::~AttentionScratch() = default;

namespace {

// Rows per tile of a unit: a tile's converted rows (at most 16 KiB) stay in L1 while every
// query that attends them reads them.
int64_t tile_rows(int64_t D) { return std::clamp<int64_t>(4096 / D / 8 * 8, 8, 32); }


// Space for a unit of n rows and `queries` queries, `counted` of which keep their weights.
void prepare(AttentionScratch& s, int64_t n, int64_t queries, const TileShape& t, int64_t rotated,
             int64_t counted) {
  s.krows.resize(n);
  s.vrows.resize(n);
  s.ktile.resize(t.tile);
  s.vtile.resize(t.tile);
  s.floats.resize(t.tile);
  s.tile.resize(t.tile * std::max(t.Dk, t.Dv));
  s.scores.resize(queries * t.tile);
  s.rotated.resize(rotated);
  if (counted * n > s.kept_size)  // uninitialized: every weight read is written first
    s.kept = std::make_unique_for_overwrite<float[]>(s.kept_size = counted * n);
  s.maxima.resize(counted * ((n + t.tile - 1) / t.tile));
  s.queries.resize(queries);
}

// Query qs, the c-th counted of a unit of n rows, keeps its weights in s.
void keep(QueryState& qs, AttentionScratch& s, int64_t c, int64_t n, const TileShape& t) {
  qs.kept = s.kept.get() + c * n;
  qs.maxima = s.maxima.data() + c * ((n + t.tile - 1) / t.tile);
}

// The query's running softmax over n more scores s (left as their exp(s - mx)).
void take_scores(QueryState& qs, float* s, int64_t n, int64_t Dv) {
  float mx = qs.mx;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  if (mx > qs.mx) {
    if (qs.sum > 0.f) {  // what the earlier rows added, to the new maximum
      const float f = std::exp(qs.mx - mx);
      qs.sum *= f;
      scale_row(qs.out, Dv, f);
    }
    qs.mx = mx;
  }
  qs.sum += exp_shifted(s, n, qs.mx);
}

// A tile's m rows as floats: the cache's own (F32), else converted into s.tile.
template <KvFormat F>
const float* const* tile_floats(const uint8_t* const* rows, int64_t m, int64_t D,
                                AttentionScratch& s) {
  for (int64_t i = 0; i < m; ++i) {
    if constexpr (F == KvFormat::F32) {
      s.floats[i] = reinterpret_cast<const float*>(rows[i]);
    } else {
      float* t = s.tile.data() + i * D;
      load_row<F>(rows[i], D, t);
      s.floats[i] = t;
    }
  }
  return s.floats.data();
}

// Rows t0 .. t0 + m - 1 of a unit (k, v: those rows of one KV head, in formats FK and FV) taken
// by the queries qs [nq] that attend them.
template <KvFormat FK, KvFormat FV>
void attend_tile(QueryState* qs, int64_t nq, const uint8_t* const* k, const uint8_t* const* v,
                 int64_t t0, int64_t m, const TileShape& t, AttentionScratch& s) {
  const auto part = [&](const QueryState& q) {
    return std::pair<int64_t, int64_t>{std::max<int64_t>(q.lo - t0, 0), std::min(q.hi - t0, m)};
  };
  // Query j's weights of rows a .. b - 1: kept where it counts, else in the tile's scratch.
  const auto weights = [&](int64_t j, int64_t a) {
    return qs[j].kept != nullptr ? qs[j].kept + t0 + a : s.scores.data() + j * t.tile;
  };
  const float* const* keys = tile_floats<FK>(k, m, t.Dk, s);
  for (int64_t j = 0; j < nq; ++j) {
    const auto [a, b] = part(qs[j]);
    if (a >= b) continue;
    float* w = weights(j, a);
    scores_of(qs[j].q, keys + a, b - a, t.Dk, t.scale, w);
    take_scores(qs[j], w, b - a, t.Dv);
    if (qs[j].maxima != nullptr) qs[j].maxima[t0 / t.tile] = qs[j].mx;
  }
  const float* const* values = tile_floats<FV>(v, m, t.Dv, s);
  for (int64_t j = 0; j < nq; ++j) {
    const auto [a, b] = part(qs[j]);
    if (a < b) add_weighted(weights(j, a), values + a, b - a, t.Dv, qs[j].out);
  }
}

// Query q [Dk] (quantized formats: rotated into `rotated`) attending a unit's rows lo .. hi - 1,
// its output [Dv] at out.
template <KvFormat F>
QueryState query_of(const float* q, int64_t Dk, float* rotated, float* out, int64_t Dv,
                    int64_t lo, int64_t hi) {
  if constexpr (stored_rotated(F)) {
    std::copy_n(q, Dk, rotated);
    hadamard(rotated, Dk);
    q = rotated;
  }
  std::fill_n(out, Dv, 0.f);
  return {q, out, lo, hi, -INFINITY, 0.f};
}

// The queries' running outputs rotated back, once the rows of a format that stores values
// rotated (FV) are taken: the rotation is linear, so the unnormalized sums turn as the outputs
// would, and rows of another format (recent ones) may follow.
template <KvFormat FV>
void unrotate(QueryState* qs, int64_t n, int64_t Dv) {
  if constexpr (stored_rotated(FV))
    for (int64_t j = 0; j < n; ++j) hadamard(qs[j].out, Dv);
}

// The query's output normalized; zeros without rows.
void finish(const QueryState& qs, int64_t Dv) {
  scale_row(qs.out, Dv, qs.sum > 0.f ? 1.f / qs.sum : 0.f);
}


// dst [the unit's rows] += the probabilities that the query, its softmax done, pays its rows
// (dst = them, when not `add`): its kept weights, each tile's moved from the max of its time to
// the final one.
void add_probabilities(const QueryState& qs, int64_t tile, float* dst, bool add = true) {
  for (int64_t t0 = qs.lo / tile * tile; t0 < qs.hi; t0 += tile) {
    const int64_t a = std::max(qs.lo, t0), b = std::min(qs.hi, t0 + tile);
    const float f = std::exp(qs.maxima[t0 / tile] - qs.mx) / qs.sum;
    add_scaled(qs.kept + a, b - a, f, dst + a, add);
  }
}

// Requests rows into L2 ahead of their tile: `bytes` from each.
void request(const uint8_t* const* rows, int64_t n, int64_t bytes) {
  for (int64_t i = 0; i < n; ++i) prefetch_bytes_l2(rows[i], bytes);
}

}  // namespace

PagedAttention::PagedAttention(const CacheView& cache_, const Queries& q_, const int32_t* lens_,
                               int64_t B_, int64_t threads, const ScoreSink& sink_)
    : cache(cache_), q(q_), lens(lens_), B(B_), sink(sink_) {
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max<int64_t>(longest, span(b));
  const int64_t wanted = (2 * threads + B - 1) / std::max<int64_t>(1, B);
  parts = std::max<int64_t>(1, std::min(wanted, longest / MIN_PART));
  if (parts > 1) partial = at::empty({units() * q.heads * (2 + cache.v.dim)}, at::kFloat);
  if (sink.into == nullptr) return;
  TORCH_CHECK(cache.window == 0, "importance scores are kept for full attention only");
  TORCH_CHECK(cache.recent.tokens == 0, "importance scores are kept without recent rows");
  mass_at.assign(B, -1);
  const int64_t rows = cache.k.heads * rows_per_kv_head();
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b)
    if (lens[b] - 1 >= sink.from[b]) mass_at[b] = total, total += rows * span(b);
  mass = at::empty({total}, at::kFloat);
}

int64_t PagedAttention::first(int64_t b) const {
  return cache.window > 0 ? std::max<int64_t>(0, lens[b] - cache.window) : 0;
}

void PagedAttention::unit(int64_t u, AttentionScratch& s) const {
  with_formats(cache.k.format, cache.v.format,
               [&](auto k, auto v) { unit_in<decltype(k)::value, decltype(v)::value>(u, s); });
}

template <KvFormat FK, KvFormat FV>
void PagedAttention::unit_in(int64_t u, AttentionScratch& s) const {
  const int64_t b = u / parts, part = u % parts;
  const int64_t whole = span(b), lo = first(b) + whole * part / parts;
  const int64_t hi = first(b) + whole * (part + 1) / parts, n = hi - lo;
  const CacheRows &k = cache.k, &v = cache.v;
  const RecentRows& recent = cache.recent;
  const int64_t Hq = q.heads, G = Hq / k.heads, Dk = k.dim, Dv = v.dim;
  const TileShape shape{Dk, Dv, tile_rows(std::max(Dk, Dv)), q.scale};
  // Positions from `split` on are read from the recent rows.
  const int64_t split =
      recent.tokens > 0 ? std::clamp<int64_t>(lens[b] - recent.tokens, lo, hi) : hi;
  prepare(s, n, Hq, shape, stored_rotated(FK) ? Hq * Dk : 0, counted(b) ? Hq : 0);
  // Head 0's rows of positions lo .. hi - 1, one table lookup per block (a ring of W with a
  // window); each further head's rows are these moved by the head stride.
  for (int64_t pos = lo; pos < hi;) {
    const bool old = pos < split;
    const auto [kr, vr] = old ? cache.rows(b, pos) : recent.rows(b, pos);
    const CacheRows &kc = old ? k : recent.k, &vc = old ? v : recent.v;
    const int64_t m = std::min(kc.bs - pos % kc.bs, (old ? split : hi) - pos);
    for (int64_t j = 0; j < m; ++j) {
      s.krows[pos - lo + j] = kr + j * kc.s1;
      s.vrows[pos - lo + j] = vr + j * vc.s1;
    }
    pos += m;
  }
  const auto query = [&](int64_t hq) { return q.q + b * q.stride + hq * Dk; };
  for (int64_t hq = 0; hq < Hq; ++hq) {
    float* out = parts > 1 ? partial.data_ptr<float>() + (u * Hq + hq) * (2 + Dv) + 2
                           : q.out + (b * Hq + hq) * Dv;
    s.queries[hq] = query_of<FK>(query(hq), Dk, s.rotated.data() + hq * Dk, out, Dv, 0, n);
    if (counted(b)) keep(s.queries[hq], s, hq, n, shape);
  }
  attend_rows<FK, FV>(0, split - lo, k, v, shape, s);
  unrotate<FV>(s.queries.data(), Hq, Dv);
  if (split < hi) {
    for (int64_t hq = 0; hq < Hq; ++hq) s.queries[hq].q = query(hq);
    with_format(recent.k.format, [&](auto f) {
      constexpr KvFormat F = decltype(f)::value;
      attend_rows<F, F>(split - lo, n, recent.k, recent.v, shape, s);
    });
  }
  for (int64_t hq = 0; hq < Hq; ++hq) {
    const QueryState& qs = s.queries[hq];
    finish(qs, Dv);
    if (parts > 1) qs.out[-2] = qs.mx, qs.out[-1] = qs.sum;
  }
  if (counted(b)) keep_probabilities(b, lo - first(b), s.queries.data(), shape.tile);
}

template <KvFormat FK, KvFormat FV>
void PagedAttention::attend_rows(int64_t a, int64_t end, const CacheRows& k, const CacheRows& v,
                                 const TileShape& shape, AttentionScratch& s) const {
  const int64_t G = q.heads / k.heads;
  // A tile's rows of every head in turn: the slot's rows of all heads leave memory once.
  const int64_t ahead_k = (k.heads - 1) * k.s2 + k.row_bytes();
  const int64_t ahead_v = (v.heads - 1) * v.s2 + v.row_bytes();
  for (int64_t t0 = a; t0 < end; t0 += shape.tile) {
    const int64_t m = std::min(shape.tile, end - t0), next = std::min(shape.tile, end - t0 - m);
    request(s.krows.data() + t0 + m, next, ahead_k);
    request(s.vrows.data() + t0 + m, next, ahead_v);
    for (int64_t h = 0; h < k.heads; ++h) {
      for (int64_t i = 0; i < m; ++i) {
        s.ktile[i] = s.krows[t0 + i] + h * k.s2;
        s.vtile[i] = s.vrows[t0 + i] + h * v.s2;
      }
      attend_tile<FK, FV>(s.queries.data() + h * G, G, s.ktile.data(), s.vtile.data(), t0, m,
                          shape, s);
    }
  }
}

// Sequence b's mass from position `at` of its span on, over a unit's rows <- the probabilities
// that its query heads qs pay them.
void PagedAttention::keep_probabilities(int64_t b, int64_t at, const QueryState* qs,
                                        int64_t tile) const {
  const int64_t whole = span(b), heads_per_row = q.heads / cache.k.heads / rows_per_kv_head();
  float* m = mass.data_ptr<float>() + mass_at[b] + at;
  // Each query reads all the unit's rows: the first of a row of mass sets it.
  for (int64_t hq = 0; hq < q.heads; ++hq)
    add_probabilities(qs[hq], tile, m + hq / heads_per_row * whole, hq % heads_per_row > 0);
}

void PagedAttention::merge(int64_t row) const {
  const int64_t Hq = q.heads, Dv = cache.v.dim;
  const int64_t b = row / Hq, hq = row % Hq, stride = Hq * (2 + Dv);  // part to part
  const float* p0 = partial.data_ptr<float>() + (b * parts * Hq + hq) * (2 + Dv);
  float mx = -INFINITY, total = 0.f;
  for (int64_t i = 0; i < parts; ++i) mx = std::max(mx, p0[i * stride]);
  for (int64_t i = 0; i < parts; ++i) total += p0[i * stride + 1] * std::exp(p0[i * stride] - mx);
  float* o = q.out + row * Dv;
  std::fill_n(o, Dv, 0.f);
  const int64_t whole = span(b);
  float* m = counted(b) ? mass.data_ptr<float>() + mass_at[b] + hq * whole : nullptr;
  for (int64_t i = 0; i < parts; ++i) {
    const float* p = p0 + i * stride;
    if (p[1] == 0.f) continue;  // an empty part
    const float w = p[1] * std::exp(p[0] - mx) / total;
    for (int64_t c = 0; c < Dv; ++c) o[c] += w * p[2 + c];
    // The part's probabilities, relative to its own softmax, weighed as its output is.
    const int64_t a = whole * i / parts;
    if (m != nullptr) scale_row(m + a, whole * (i + 1) / parts - a, w);
  }
}

void PagedAttention::run() const {
  at::parallel_for(0, units(), 1, [&](int64_t u0, int64_t u1) {
    AttentionScratch scratch;
    for (int64_t u = u0; u < u1; ++u) unit(u, scratch);
  });
  at::parallel_for(0, rows_to_merge(), 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) merge(r);
  });
  if (sink.into == nullptr) return;
  const int64_t owners = score_owners(at::get_num_threads());
  at::parallel_for(0, owners, 1, [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o) add_scores(o, owners);
  });
}

PrefillAttention::PrefillAttention(const CacheView& cache_, const Queries& q_,
                                   const AttentionMeta& meta, const NewRows& fresh_,
                                   const ScoreSink& sink_)
    : cache(cache_), q(q_), fresh(fresh_), prefix(meta.prefix_lens), cu(meta.cu_seqlens_q),
      sink(sink_) {
  blocks_of.assign(meta.num_decodes + 1, 0);
  for (int64_t b = meta.num_decodes; b < meta.B; ++b) {
    TORCH_CHECK(prefix[b] >= 0 && (cache.window > 0 || prefix[b] <= cache.W * cache.k.bs),
                "a prefix is longer than its block table");
    for (int64_t r = cu[b]; r < cu[b + 1]; r += ROWS) seq.push_back(b), row0.push_back(r);
    blocks_of.push_back(seq.size());
  }
  if (sink.into == nullptr) return;
  TORCH_CHECK(cache.window == 0, "importance scores are kept for full attention only");
  TORCH_CHECK(cache.recent.tokens == 0, "importance scores are kept without recent rows");
  mass_at.assign(seq.size(), -1);
  int64_t total = 0;
  for (size_t i = 0; i < seq.size(); ++i) {
    if (first_counted(i) >= std::min<int64_t>(row0[i] + ROWS, cu[seq[i] + 1])) continue;
    TORCH_CHECK(keys(i) <= cache.W * cache.k.bs, "a chunk is longer than its block table");
    mass_at[i] = total, total += cache.k.heads * keys(i);
  }
  mass = at::empty({total}, at::kFloat);
}

int64_t PrefillAttention::keys(int64_t i) const {
  const int64_t b = seq[i], r1 = std::min<int64_t>(row0[i] + ROWS, cu[b + 1]);
  return prefix[b] + r1 - cu[b];
}

int64_t PrefillAttention::first_counted(int64_t i) const {
  const int64_t b = seq[i];
  return std::max<int64_t>(row0[i], int64_t{cu[b]} + sink.from[b] - prefix[b]);
}

int64_t PrefillAttention::lowest(int64_t pos) const {
  return cache.window > 0 ? std::max<int64_t>(0, pos - cache.window + 1) : 0;
}

void PrefillAttention::unit(int64_t u, AttentionScratch& s) const {
  with_formats(cache.k.format, cache.v.format,
               [&](auto k, auto v) { unit_in<decltype(k)::value, decltype(v)::value>(u, s); });
}

template <KvFormat FK, KvFormat FV>
void PrefillAttention::unit_in(int64_t u, AttentionScratch& s) const {
  const CacheRows &k = cache.k, &v = cache.v;
  const RecentRows& recent = cache.recent;
  const int64_t Hkv = k.heads, Dk = k.dim, Dv = v.dim, G = q.heads / Hkv;
  const int64_t i = u / Hkv, b = seq[i], h = u % Hkv, r0 = row0[i];
  const int64_t c0 = cu[b], r1 = std::min<int64_t>(r0 + ROWS, cu[b + 1]), P = prefix[b];
  const int64_t lo = lowest(P + r0 - c0), hi = P + r1 - c0, n = hi - lo, nq = (r1 - r0) * G;
  const TileShape shape{Dk, Dv, tile_rows(std::max(Dk, Dv)), q.scale};
  const bool scored = !mass_at.empty() && mass_at[i] >= 0;
  const int64_t counted = scored ? first_counted(i) : r1;  // rows counted .. r1 - 1 count
  const int64_t R = recent.tokens;
  prepare(s, n, nq, shape, stored_rotated(FK) ? nq * Dk : 0, (r1 - counted) * G);
  if (R > 0) s.rkrows.resize(n), s.rvrows.resize(n);
  for (int64_t pos = lo; pos < hi; ++pos) {
    if (pos < P) {
      const auto [k0, v0] = cache.rows(b, pos);
      s.krows[pos - lo] = k0 + h * k.s2, s.vrows[pos - lo] = v0 + h * v.s2;
    } else {
      const int64_t j = c0 + pos - P;
      s.krows[pos - lo] = fresh.k + j * fresh.k_row + h * fresh.k_head;
      s.vrows[pos - lo] = fresh.v + j * fresh.v_row + h * fresh.v_head;
    }
    // The recent rows hold the positions a query of the unit reads from them.
    if (R == 0 || pos <= P + r0 - c0 - R) continue;
    if (pos < P) {
      const auto [k0, v0] = recent.rows(b, pos);
      s.rkrows[pos - lo] = k0 + h * recent.k.s2, s.rvrows[pos - lo] = v0 + h * recent.v.s2;
    } else {
      const int64_t at = (c0 + pos - P) * fresh.r_row + h * fresh.r_head;
      s.rkrows[pos - lo] = fresh.rk + at, s.rvrows[pos - lo] = fresh.rv + at;
    }
  }
  // Query row r at position pos reads the older rows lowest(pos) .. split(pos) - 1 of the
  // main cache, the rest up to pos of the recent rows.
  const auto split = [&](int64_t pos) { return R > 0 ? std::max(lowest(pos), pos - R + 1) : pos + 1; };
  int64_t main_end = 0, recent_start = n;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t pos = P + r - c0;
    main_end = std::max(main_end, split(pos) - lo);
    recent_start = std::min(recent_start, split(pos) - lo);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t j = (r - r0) * G + g, hq = h * G + g;
      s.queries[j] = query_of<FK>(q.q + r * q.stride + hq * Dk, Dk, s.rotated.data() + j * Dk,
                                  q.out + (r * q.heads + hq) * Dv, Dv, lowest(pos) - lo,
                                  split(pos) - lo);
      if (r >= counted) keep(s.queries[j], s, (r - counted) * G + g, n, shape);
    }
  }
  for (int64_t t0 = 0; t0 < main_end; t0 += shape.tile) {
    const int64_t m = std::min(shape.tile, main_end - t0);
    attend_tile<FK, FV>(s.queries.data(), nq, s.krows.data() + t0, s.vrows.data() + t0, t0, m,
                        shape, s);
  }
  unrotate<FV>(s.queries.data(), nq, Dv);
  if (R > 0) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t pos = P + r - c0;
      for (int64_t g = 0; g < G; ++g) {
        QueryState& qs = s.queries[(r - r0) * G + g];
        qs.q = q.q + r * q.stride + (h * G + g) * Dk;
        qs.lo = split(pos) - lo, qs.hi = pos - lo + 1;
      }
    }
    with_format(recent.k.format, [&](auto f) {
      constexpr KvFormat F = decltype(f)::value;
      for (int64_t t0 = recent_start; t0 < n; t0 += shape.tile) {
        const int64_t m = std::min(shape.tile, n - t0);
        attend_tile<F, F>(s.queries.data(), nq, s.rkrows.data() + t0, s.rvrows.data() + t0, t0,
                          m, shape, s);
      }
    });
  }
  for (int64_t j = 0; j < nq; ++j) finish(s.queries[j], Dv);
  if (!scored) return;
  float* m = mass.data_ptr<float>() + mass_at[i] + h * n;  // full attention: lo is 0
  std::fill_n(m, n, 0.f);
  for (int64_t j = (counted - r0) * G; j < nq; ++j) add_probabilities(s.queries[j], shape.tile, m);
}

}  // namespace kvserve
