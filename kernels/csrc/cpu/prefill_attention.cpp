#include <ATen/ATen.h>

#include <algorithm>

#include "attention.h"
#include "attention_tile.h"

namespace kvserve {

PrefillAttention::PrefillAttention(const CacheView& cache_, const Queries& q_,
                                   const AttentionMeta& meta, const NewRows& fresh_,
                                   const ScoreSink& sink_)
    : cache(cache_), q(q_), fresh(fresh_), prefix(meta.prefix_lens), cu(meta.cu_seqlens_q),
      sink(sink_) {
  blocks_of.assign(meta.num_decodes + 1, 0);
  for (int64_t b = meta.num_decodes; b < meta.B; ++b) {
    // int4 keys: the chunk's rows read quantized keys of groups cached whole before it only
    // (the ones it completes are written after it, by their groups).
    TORCH_CHECK(cache.k.format != KvFormat::I4C ||
                    cu[b + 1] - cu[b] <= cache.recent.tokens - prefix[b] % KV_CHANNEL_GROUP,
                "a prefill chunk reads int4 keys of a group it completes");
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

// The unit's rows lo .. hi - 1 of sequence b's KV head h into s: the main cache's (the cached
// prefix, then the chunk's new rows in `fresh`), and with recent rows those of the positions
// that a query from `first` on reads from them.
void PrefillAttention::rows_of_unit(int64_t b, int64_t h, int64_t lo, int64_t hi, int64_t first,
                                    AttentionScratch& s) const {
  const CacheRows &k = cache.k, &v = cache.v;
  const RecentRows& recent = cache.recent;
  const int64_t P = prefix[b], c0 = cu[b], R = recent.tokens, n = hi - lo;
  if (R > 0) s.rkrows.resize(n), s.rvrows.resize(n);
  for (int64_t pos = lo; pos < hi; ++pos) {
    if (pos < P) {
      const auto [k0, v0] = cache.rows(b, pos);
      s.krows[pos - lo] = k0 + h * k.s2, s.vrows[pos - lo] = v0 + h * v.s2;
      // A block holds whole groups: the group's first row is in the same block.
      if (k.format == KvFormat::I4C)
        s.kgroups[pos - lo] = s.krows[pos - lo] - pos % KV_CHANNEL_GROUP * k.s1;
    } else {
      const int64_t j = c0 + pos - P;
      s.krows[pos - lo] = fresh.k + j * fresh.k_row + h * fresh.k_head;
      s.vrows[pos - lo] = fresh.v + j * fresh.v_row + h * fresh.v_head;
    }
    if (R == 0 || pos <= first - R) continue;
    if (pos < P) {
      const auto [k0, v0] = recent.rows(b, pos);
      s.rkrows[pos - lo] = k0 + h * recent.k.s2, s.rvrows[pos - lo] = v0 + h * recent.v.s2;
    } else {
      const int64_t at = (c0 + pos - P) * fresh.r_row + h * fresh.r_head;
      s.rkrows[pos - lo] = fresh.rk + at, s.rvrows[pos - lo] = fresh.rv + at;
    }
  }
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
  rows_of_unit(b, h, lo, hi, P + r0 - c0, s);
  // Query row r at position pos reads the older rows lowest(pos) .. split(pos) - 1 of the
  // main cache, the rest up to pos of the recent rows.
  const auto split = [&](int64_t pos) {
    return R > 0 ? std::max(lowest(pos), pos - R + 1) : pos + 1;
  };
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
    if constexpr (FK == KvFormat::I4C) {
      std::copy_n(s.kgroups.data() + t0, m, s.kgtile.data());
      s.kstride = k.s1;
    }
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
