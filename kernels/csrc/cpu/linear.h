// Linear layers, y = x w^T (+ bias), with w in nn.Linear's own [out, in] layout, shared with
// torch. Decode multiplies a few activation rows by every weight matrix, so the work is
// reading the weights once: each thread owns runs of output features and reads their weight
// rows front to back, once. More rows (prefill chunks) are packed into panels that register
// tiles reuse, near the FMA peak.
#pragma once

#include <cstdint>

#include "threads.h"

namespace kvserve {

// A weight matrix w [N, K] (N output features of K inputs, rows K apart) and its bias [N] or
// nullptr.
struct Matrix {
  const float* w;
  const float* bias;
  int64_t N, K;
};

constexpr int64_t FEW = 8;  // up to this many input rows, the weight rows go against x as is

// Floats of x [M, K] packed by pack_rows.
inline int64_t packed_size(int64_t M, int64_t K) { return (M + 7) / 8 * 8 * K; }

// x [M, K] as panels of 8 rows, k-major: xt[(g K + k) 8 + i] = x[8g + i][k], zero for rows
// past M.
void pack_rows(const float* x, int64_t M, int64_t K, float* xt);

// Output features per chunk that the threads claim, for M input rows of K floats.
int64_t chunk_rows(int64_t K, int64_t M);

// Output features [n0, n1) of y [M, m.N] = x [M, m.K] m.w^T (+ m.bias): one thread's chunk.
// With more than FEW rows, xt holds x packed by pack_rows.
void linear_rows(const Matrix& m, const float* x, const float* xt, int64_t M, int64_t n0,
                 int64_t n1, float* y);

// One thread's side of the products of a parallel region whose inputs have M rows; xt: its own
// packing space (packed_size(M, the largest K) floats, used above FEW rows). Each thread packs
// the input for itself: no barrier between the packing and the products.
struct Products {
  Team team;
  int64_t M;
  float* xt;

  void pack(const float* x, int64_t K) const {
    if (M > FEW) pack_rows(x, M, K, xt);
  }

  // y [M, m.N] = x m^T, the chunks this thread claims through `next` (a zeroed counter per
  // thread); after(n0, n1) once a chunk's features are written.
  template <class F>
  void multiply(const Matrix& m, const float* x, float* y, Counter* next, F&& after) const {
    pack(x, m.K);
    Chunks(m.N, chunk_rows(m.K, M), team.nt, next).run(team.t, [&](int64_t n0, int64_t n1) {
      linear_rows(m, x, xt, M, n0, n1, y);
      after(n0, n1);
    });
  }
};

// y [M, m.N] = x [M, m.K] m^T (+ bias), on torch's threads.
void linear(const Matrix& m, const float* x, int64_t M, float* y);

}  // namespace kvserve
