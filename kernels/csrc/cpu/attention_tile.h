// What paged decode (attention.cpp) and prefill (prefill_attention.cpp) share: a query's
// running softmax and the tile of rows its queries take at a time.
#pragma once

#include <algorithm>
#include <cmath>

#include "attention.h"
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


// Rows per tile of a unit: a tile's converted rows (at most 16 KiB) stay in L1 while every
// query that attends them reads them.
inline int64_t tile_rows(int64_t D) { return std::clamp<int64_t>(4096 / D / 8 * 8, 8, 32); }


// Space for a unit of n rows and `queries` queries, `counted` of which keep their weights.
inline void prepare(AttentionScratch& s, int64_t n, int64_t queries, const TileShape& t,
                    int64_t rotated, int64_t counted) {
  s.krows.resize(n);
  s.vrows.resize(n);
  s.ktile.resize(t.tile);
  s.vtile.resize(t.tile);
  s.kgroups.resize(n);
  s.kgtile.resize(t.tile);
  s.floats.resize(t.tile);
  s.scaled.resize(t.Dk);
  s.tile.resize(t.tile * std::max(t.Dk, t.Dv));
  s.scores.resize(queries * t.tile);
  s.rotated.resize(rotated);
  if (counted * n > s.kept_size)  // uninitialized: every weight read is written first
    s.kept = std::make_unique_for_overwrite<float[]>(s.kept_size = counted * n);
  s.maxima.resize(counted * ((n + t.tile - 1) / t.tile));
  s.queries.resize(queries);
}

// Query qs, the c-th counted of a unit of n rows, keeps its weights in s.
inline void keep(QueryState& qs, AttentionScratch& s, int64_t c, int64_t n,
                 const TileShape& t) {
  qs.kept = s.kept.get() + c * n;
  qs.maxima = s.maxima.data() + c * ((n + t.tile - 1) / t.tile);
}

// The query's running softmax over n more scores s (left as their exp(s - mx)).
inline void take_scores(QueryState& qs, float* s, int64_t n, int64_t Dv) {
  // Eight running maxima: one would wait on each comparison before it.
  vec8 m8 = splat8(qs.mx);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m8 = max8(m8, load8(s + i));
  float mx = hmax(m8);
  for (; i < n; ++i) mx = std::max(mx, s[i]);
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
      if constexpr (F == KvFormat::I4C) {  // the nibbles n - 8 alone: channel_scores scales
        for (int64_t d = 0; d < D; d += KV_GROUP) {
          vec8 n[4];
          load32_nibbles_minus8(rows[i] + d / 2, n);
          for (int j = 0; j < 4; ++j) store8(t + d + 8 * j, n[j]);
        }
      } else {
        load_row<F>(rows[i], D, t);
      }
      s.floats[i] = t;
    }
  }
  return s.floats.data();
}

// w [m] <- the scores of query q over m I4C key rows, times `scale`: `rows` their nibbles n - 8
// as floats (tile_floats), `groups` their groups' first rows. A key is lo8 + s (n - 8) per
// channel, so a score is q . lo8 + (q s) . (n - 8): q is scaled by a group's s once for all its
// rows, which are read with no scale per value.
inline void channel_scores(const float* q, const float* const* rows,
                           const uint8_t* const* groups, int64_t m, int64_t D, float scale,
                           float* w, AttentionScratch& s) {
  float* qs = s.scaled.data();
  for (int64_t r0 = 0, r1; r0 < m; r0 = r1) {  // the runs of rows of one group
    for (r1 = r0 + 1; r1 < m && groups[r1] == groups[r0];) ++r1;
    read_channel_codes(groups[r0], s.kstride, D, s.codes);
    for (int64_t c = 0; c < D; c += 8)
      store8(qs + c, mul8(load8(q + c), load8(s.codes.s.data() + c)));
    scores_of(qs, rows + r0, r1 - r0, D, scale, w + r0, dot(q, s.codes.lo8.data(), D) * scale);
  }
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
    if constexpr (FK == KvFormat::I4C)
      channel_scores(qs[j].q, keys + a, s.kgtile.data() + a, b - a, t.Dk, t.scale, w, s);
    else
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
inline void finish(const QueryState& qs, int64_t Dv) {
  scale_row(qs.out, Dv, qs.sum > 0.f ? 1.f / qs.sum : 0.f);
}


// dst [the unit's rows] += the probabilities that the query, its softmax done, pays its rows
// (dst = them, when not `add`): its kept weights, each tile's moved from the max of its time to
// the final one.
inline void add_probabilities(const QueryState& qs, int64_t tile, float* dst, bool add = true) {
  for (int64_t t0 = qs.lo / tile * tile; t0 < qs.hi; t0 += tile) {
    const int64_t a = std::max(qs.lo, t0), b = std::min(qs.hi, t0 + tile);
    const float f = std::exp(qs.maxima[t0 / tile] - qs.mx) / qs.sum;
    add_scaled(qs.kept + a, b - a, f, dst + a, add);
  }
}

// Requests rows into L2 ahead of their tile: `bytes` from each.
inline void request(const uint8_t* const* rows, int64_t n, int64_t bytes) {
  for (int64_t i = 0; i < n; ++i) prefetch_bytes_l2(rows[i], bytes);
}

}  // namespace kvserve
