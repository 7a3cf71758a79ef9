#include "attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "attention_tile.h"

namespace kvserve {

AttentionScratch::AttentionScratch() = default;
AttentionScratch::~AttentionScratch() = default;

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
      // A block holds whole groups: the group's first row is in the same block.
      if constexpr (FK == KvFormat::I4C)
        if (old) s.kgroups[pos - lo + j] = kr + (j - (pos + j) % KV_CHANNEL_GROUP) * kc.s1;
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
        if constexpr (FK == KvFormat::I4C) s.kgtile[i] = s.kgroups[t0 + i] + h * k.s2;
      }
      if constexpr (FK == KvFormat::I4C) s.kstride = k.s1;
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

}  // namespace kvserve
