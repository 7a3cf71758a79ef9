// Linear layers, y = x w^T (+ bias), with w in nn.Linear's own [out, in] layout, shared with
// torch. Decode multiplies a few activation rows by every weight matrix, so the work is
// reading the weights once: each thread owns runs of output features and reads their weight
// rows front to back, once. More rows (prefill chunks) are packed into panels that register
// tiles reuse, near the FMA peak. Parts stored in GGUF block formats go through qlinear.h.
#pragma once

#include <cstdint>

#include "qlinear.h"
#include "qpacked.h"
#include "threads.h"

namespace kvserve {

// Dense parts by GGML type: float32, float16 and bfloat16 rows K apart. A 16-bit part is
// widened to float in registers and multiplied like a float32 one (activations stay float32):
// half the bytes to read per decode step, the same sums.
constexpr int64_t DENSE_F32 = 0, DENSE_F16 = 1, DENSE_BF16 = 30;
constexpr bool is_dense(int64_t type) {
  return type == DENSE_F32 || type == DENSE_F16 || type == DENSE_BF16;
}
struct F16 {
  uint16_t bits;
};
struct BF16 {
  uint16_t bits;
};

// One part of a weight matrix: `rows` output features of K inputs, stored dense (is_dense) or
// in a GGUF block format (type its GGML id: rows of row_bytes bytes, see qlinear.h), and its
// bias [rows] or nullptr.
struct Part {
  const void* w;
  const float* bias;
  int64_t rows, row_bytes, type;
};

constexpr int64_t MAX_PARTS = 3;

// A weight matrix [N, K]: up to MAX_PARTS parts stacked by output rows (q|k in one format and
// v in another, say), N their rows in all.
struct Matrix {
  Part parts[MAX_PARTS]{};
  int64_t count = 0, N = 0, K = 0;

  void add(const Part& p) {
    parts[count++] = p;
    N += p.rows;
  }
  bool has_packed() const {
    for (int64_t i = 0; i < count; ++i)
      if (is_packed(parts[i].type)) return true;
    return false;
  }
  bool has(bool quantized) const {
    for (int64_t i = 0; i < count; ++i)
      if (is_dense(parts[i].type) != quantized) return true;
    return false;
  }
  bool has_half() const {
    for (int64_t i = 0; i < count; ++i)
      if (is_dense(parts[i].type) && parts[i].type != DENSE_F32) return true;
    return false;
  }
  // The activations' rounding group for the block-format parts: KGROUP where one is of a K
  // format (qlinear.h).
  int64_t group() const {
    for (int64_t i = 0; i < count; ++i)
      if (!is_dense(parts[i].type) && block_values(parts[i].type % PACKED) == 256) return KGROUP;
    return 32;
  }
};

constexpr int64_t FEW = 8;  // up to this many input rows, the weight rows go against x as is
// Weight rows a register tile of the many-row products multiplies at once (16-bit ones are
// widened to float for it first).
constexpr int64_t TILE_ROWS = 6;

// Floats of x [M, K] packed by pack_rows.
inline int64_t packed_size(int64_t M, int64_t K) { return (M + 7) / 8 * 8 * K; }

// x [M, K] as panels of 8 rows, k-major: xt[(g K + k) 8 + i] = x[8g + i][k], zero for rows
// past M.
void pack_rows(const float* x, int64_t M, int64_t K, float* xt);

// Output features per chunk that the threads claim, for M input rows of m.
int64_t chunk_rows(const Matrix& m, int64_t M);

// The input of a product, x [M, K], as its parts read it: as is, packed by pack_rows into xt
// (dense parts, more than FEW rows) and rounded into xq (block-format parts); wide: a tile's
// 16-bit weight rows as floats (more than FEW rows).
struct Rows {
  const float* x;
  const float* xt;
  float* wide;
  QRows xq;
  QPanels xp;  // xq again, in panels (repacked parts, and more than QFEW rows)
  uint8_t* scratch;  // unpacked weight rows for more than QFEW rows (unpack_bytes)
  int64_t M;
};

// Output features [n0, n1) of y [M, m.N] = x [M, m.K] m^T (+ bias): one thread's chunk, which
// may cross parts.
void linear_rows(const Matrix& m, const Rows& in, int64_t n0, int64_t n1, float* y);

// A thread's packing space for inputs of M rows of at most K values: float panels and a
// tile's widened weight rows (dense parts, 16-bit ones, above FEW rows) and rounded rows
// (block-format parts).
struct PackSpace {
  int64_t floats, wide, rows, panels, bytes;

  PackSpace(int64_t M, int64_t K, bool dense, bool half, bool quantized)
      : floats(dense && M > FEW ? (packed_size(M, K) + 15) / 16 * 16 : 0),
        wide(half && M > FEW ? (TILE_ROWS * K + 15) / 16 * 16 : 0),
        rows(quantized ? (QRows::bytes(M, K) + 63) / 64 * 64 : 0),
        panels(quantized ? (QPanels::bytes(M, K) + 63) / 64 * 64 : 0),
        bytes((floats + wide) * 4 + rows + panels +
              (quantized && M > QFEW ? unpack_bytes(K) : 0)) {}
};

// One thread's side of the products of a parallel region whose inputs have M rows; space: its
// own packing space (PackSpace). Each thread packs the input for itself: no barrier between
// the packing and the products.
struct Products {
  Team team;
  int64_t M;
  PackSpace size;
  char* space;

  Rows pack(const float* x, const Matrix& m) const {
    Rows in{x, nullptr, nullptr, {}, {}, nullptr, M};
    float* xt = reinterpret_cast<float*>(space);
    if (M > FEW && m.has(false)) {
      pack_rows(x, M, m.K, xt);
      in.xt = xt;
      if (m.has_half()) in.wide = xt + size.floats;
    }
    if (m.has(true)) {
      char* q = space + (size.floats + size.wide) * 4;
      in.xq = QRows::at(q, M, m.K);
      quantize_rows(x, M, m.group(), in.xq);
      if (M > QFEW || m.has_packed()) {
        in.xp = QPanels::at(q + size.rows, M, m.K);
        pack_panels(in.xq, M, in.xp);
      }
      if (M > QFEW) in.scratch = reinterpret_cast<uint8_t*>(q + size.rows + size.panels);
    }
    return in;
  }

  // y [M, m.N] = x m^T, the chunks this thread claims through `next` (a zeroed counter per
  // thread); after(n0, n1) once a chunk's features are written.
  template <class F>
  void multiply(const Matrix& m, const float* x, float* y, Counter* next, F&& after) const {
    const Rows in = pack(x, m);
    Chunks(m.N, chunk_rows(m, M), team.nt, next).run(team.t, [&](int64_t n0, int64_t n1) {
      linear_rows(m, in, n0, n1, y);
      after(n0, n1);
    });
  }
};

// y [M, m.N] = x [M, m.K] m^T (+ bias), on torch's threads.
void linear(const Matrix& m, const float* x, int64_t M, float* y);

}  // namespace kvserve
