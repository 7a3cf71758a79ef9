#include "pointwise.h"

#include <ATen/Parallel.h>

#include <cmath>

#include "vec.h"

namespace kvserve {

void norm_row(const float* x, const float* w, int64_t D, double eps, float offset, float* y) {
  const float inv = 1.f / std::sqrt(dot(x, x, D) / D + static_cast<float>(eps));
  for (int64_t i = 0; i < D; ++i) y[i] = x[i] * inv * (w[i] + offset);
}

void rope_row(float* x, const float* c, const float* s, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = x[j], b = x[j + half];
    x[j] = a * c[j] - b * s[j];
    x[j + half] = b * c[j + half] + a * s[j + half];
  }
}

void gate_row(const float* g, const float* u, int64_t n, int64_t act, float* y) {
  // silu(v) = v / (1 + exp(-v)); gelu_tanh(v) = v / (1 + exp(-2k(v + 0.044715 v^3))),
  // k = sqrt(2 / pi) (0.5 (1 + tanh(z)) is 1 / (1 + exp(-2z))).
  const vec8 one = splat8(1.f), c0 = splat8(-1.5957691216057308f), c1 = splat8(0.044715f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const vec8 v = load8(g + i);
    vec8 z = sub8(zero8(), v);
    if (act != SILU) z = mul8(c0, fma8(mul8(c1, v), mul8(v, v), v));
    const vec8 a = div8(v, add8(one, exp8(z)));
    store8(y + i, mul8(a, load8(u + i)));
  }
  for (; i < n; ++i) {
    const float v = g[i];
    const float z = act == SILU ? -v : -1.5957691216057308f * (v + 0.044715f * v * v * v);
    y[i] = v / (1.f + std::exp(z)) * u[i];
  }
}

void rms_norm(const float* x, const float* w, int64_t rows, int64_t D, double eps, float offset,
              float* y) {
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(x + r * D, w, D, eps, offset, y + r * D);
  });
}

void rope(float* x, const float* cos, const float* sin, int64_t T, int64_t H, int64_t D) {
  at::parallel_for(0, T * H, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) rope_row(x + i * D, cos + (i / H) * D, sin + (i / H) * D, D);
  });
}

void gated_act(const float* h, int64_t rows, int64_t I, int64_t act, float* y) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) gate_row(h + r * 2 * I, h + r * 2 * I + I, I, act, y + r * I);
  });
}

}  // namespace kvserve
