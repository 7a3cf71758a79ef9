// Row-wise operations: RMSNorm, rotary embedding, gated activations. The *_row functions are
// the fused layer's building blocks; the others run them over a tensor's rows on torch's
// threads, for the models' modules (models.layers, their torch reference).
#pragma once

#include <cstdint>

namespace kvserve {

// An MLP's activation (kernels.cpu.ACTIVATIONS), applied to the gate.
enum Activation : int64_t { SILU = 0, GELU_TANH = 1 };

// RMSNorm of one row of D: y = x * rsqrt(mean(x^2) + eps) * (w + offset); y may be x.
void norm_row(const float* x, const float* w, int64_t D, double eps, float offset, float* y);

// Rotary embedding of one head's row of D in the half-split layout, in place; c, s [D].
void rope_row(float* x, const float* c, const float* s, int64_t D);

// y[i] = act(g[i]) * u[i] for i < n.
void gate_row(const float* g, const float* u, int64_t n, int64_t act, float* y);

// y [rows, D] = RMSNorm of x [rows, D].
void rms_norm(const float* x, const float* w, int64_t rows, int64_t D, double eps, float offset,
              float* y);

// x [T, H, D] rotated in place by position in the half-split layout; cos, sin [T, D].
void rope(float* x, const float* cos, const float* sin, int64_t T, int64_t H, int64_t D);

// y [rows, I] = act(h[:, :I]) * h[:, I:] for h [rows, 2I].
void gated_act(const float* h, int64_t rows, int64_t I, int64_t act, float* y);

}  // namespace kvserve
