// The paged KV cache's rows, as the kernels write them: a cache [blocks, bs, heads, row] whose
// flat slot s is row s % bs of block s / bs, a slot's heads adjacent in its row, each head's
// row of `dim` values stored in the cache's format (kv_format.h).
#pragma once

#include <cstdint>

#include "kv_format.h"

namespace kvserve {

struct CacheRows {
  uint8_t* data;
  KvFormat format;
  int64_t blocks, bs, heads, dim;  // its sizes; dim: the values of a head's row
  int64_t s0, s1, s2;              // its strides in bytes: block, slot, head

  int64_t slots() const { return blocks * bs; }
  int64_t row_bytes() const { return kv_row_bytes(format, dim); }
  // The row of flat slot s.
  uint8_t* slot(int64_t s) const { return data + (s / bs) * s0 + (s % bs) * s1; }
};

// The cache at flat slots [T] <- rows [T, heads * dim] of floats, in its format; slot -1
// skipped.
void write_cache(const CacheRows& cache, const float* rows, const int64_t* slots, int64_t T);

// A rotation of every head's rotary pairs by one angle per pair (its cos and sin [half]): pair
// p at (start + p, start + half + p), or at (start + 2p, start + 2p + 1) when interleaved.
struct Rotation {
  const float *cos, *sin;
  int64_t half, start;
  bool interleaved;
};

// Rotates every row of the (float32) cache's blocks [n] in place, on torch's threads.
void rotate_keys(const CacheRows& cache, const int64_t* blocks, int64_t n, const Rotation& rot);

}  // namespace kvserve
