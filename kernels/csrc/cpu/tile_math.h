// The arithmetic of an attention tile over float rows: softmax weights, dot products of a query
// with rows, and weighted sums of rows, eight lanes at a time (vec.h).
#pragma once

#include <cstdint>

#include "vec.h"

namespace kvserve {

// s[i] = exp(s[i] - mx) over n floats; returns their sum.
inline float exp_shifted(float* s, int64_t n, float mx) {
  const vec8 m = splat8(mx);
  vec8 acc = zero8();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const vec8 e = exp8(sub8(load8(s + i), m));
    store8(s + i, e);
    acc = add8(acc, e);
  }
  float total = hsum(acc);
  for (; i < n; ++i) total += (s[i] = std::exp(s[i] - mx));
  return total;
}

// dst[i] += f x[i] over n floats; dst[i] = f x[i] when not `add`.
inline void add_scaled(const float* x, int64_t n, float f, float* dst, bool add) {
  int64_t i = 0;
  const vec8 fv = splat8(f);
  for (; i + 8 <= n; i += 8)
    store8(dst + i, add ? fma8(load8(x + i), fv, load8(dst + i)) : mul8(load8(x + i), fv));
  for (; i < n; ++i) dst[i] = add ? dst[i] + f * x[i] : f * x[i];
}

// x[D] *= f.
inline void scale_row(float* x, int64_t D, float f) {
  int64_t c = 0;
  for (; c + 8 <= D; c += 8) store8(x + c, mul8(load8(x + c), splat8(f)));
  for (; c < D; ++c) x[c] *= f;
}

// s[i] = dot(q, rows[i]) * scale + bias for i < n, eight rows side by side so that their
// products do not wait on each other.
inline void scores_of(const float* q, const float* const* rows, int64_t n, int64_t D, float scale,
                      float* s, float bias = 0.f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    vec8 acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = zero8();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
      const vec8 qv = load8(q + d);
      for (int r = 0; r < 8; ++r) acc[r] = fma8(qv, load8(rows[i + r] + d), acc[r]);
    }
    store8(s + i, fma8(sum8(acc), splat8(scale), splat8(bias)));
    for (; d < D; ++d)
      for (int r = 0; r < 8; ++r) s[i + r] += q[d] * rows[i + r][d] * scale;
  }
  for (; i < n; ++i) s[i] = dot(q, rows[i], D) * scale + bias;
}

// out[c .. c + 8V) += sum_i p[i] rows[i][c .. c + 8V), held in V registers.
template <int V>
inline void add_weighted_cols(const float* p, const float* const* rows, int64_t n, int64_t c,
                              float* out) {
  vec8 acc[V];
  for (int j = 0; j < V; ++j) acc[j] = load8(out + c + 8 * j);
  for (int64_t i = 0; i < n; ++i) {
    const vec8 pi = splat8(p[i]);
    const float* row = rows[i] + c;
    for (int j = 0; j < V; ++j) acc[j] = fma8(pi, load8(row + 8 * j), acc[j]);
  }
  for (int j = 0; j < V; ++j) store8(out + c + 8 * j, acc[j]);
}

// out[D] += sum_i p[i] rows[i], 64 columns per pass over the rows.
inline void add_weighted(const float* p, const float* const* rows, int64_t n, int64_t D, float* out) {
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) add_weighted_cols<8>(p, rows, n, c, out);
  for (; c + 8 <= D; c += 8) add_weighted_cols<1>(p, rows, n, c, out);
  for (; c < D; ++c)  // columns past the last multiple of 8 (none in practice)
    for (int64_t i = 0; i < n; ++i) out[c] += p[i] * rows[i][c];
}

}  // namespace kvserve
