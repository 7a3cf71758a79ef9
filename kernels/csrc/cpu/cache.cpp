#include "cache.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace kvserve {

void write_cache(const CacheRows& cache, const float* rows, const int64_t* slots, int64_t T) {
  const int64_t row = cache.heads * cache.dim;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < cache.slots(), "slot ", slot, " is outside the cache");
    std::copy_n(rows + t * row, row, cache.slot(slot));
  }
}

void rotate_keys(const CacheRows& cache, const int64_t* blocks, int64_t n, const Rotation& rot) {
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= blocks[i] && blocks[i] < cache.blocks, "block ", blocks[i],
                " is outside the cache");
  }
  const int64_t bs = cache.bs, half = rot.half;
  const int64_t step = rot.interleaved ? 2 : 1, other = rot.interleaved ? 1 : half;
  const float *cs = rot.cos, *sn = rot.sin;
  at::parallel_for(0, n * bs, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = cache.data + blocks[r / bs] * cache.s0 + (r % bs) * cache.s1 + rot.start;
      for (int64_t h = 0; h < cache.heads; ++h) {
        float* x = row + h * cache.s2;
        for (int64_t p = 0; p < half; ++p) {
          const float x1 = x[p * step], x2 = x[p * step + other];
          x[p * step] = x1 * cs[p] - x2 * sn[p];
          x[p * step + other] = x2 * cs[p] + x1 * sn[p];
        }
      }
    }
  });
}

}  // namespace kvserve
