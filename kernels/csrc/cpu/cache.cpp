#include "cache.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace kvserve {

void write_cache(const CacheRows& cache, const float* rows, const int64_t* slots, int64_t T) {
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] < cache.slots(), "slot ", slots[t], " is outside the cache");
  const int64_t H = cache.heads, D = cache.dim;
  // Quantizing a row costs more than copying it: a prompt's rows are shared out.
  const int64_t grain = cache.format == KvFormat::F32 ? T : 16;
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (slots[t] < 0) continue;
      uint8_t* slot = cache.slot(slots[t]);
      for (int64_t h = 0; h < H; ++h)
        store_row(cache.format, rows + (t * H + h) * D, D, slot + h * cache.s2);
    }
  });
}

void rotate_keys(const CacheRows& cache, const int64_t* blocks, int64_t n, const Rotation& rot) {
  TORCH_CHECK(cache.format == KvFormat::F32, "keys are rotated in place in float32 caches only");
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= blocks[i] && blocks[i] < cache.blocks, "block ", blocks[i],
                " is outside the cache");
  }
  const int64_t bs = cache.bs, half = rot.half;
  const int64_t step = rot.interleaved ? 2 : 1, other = rot.interleaved ? 1 : half;
  const float *cs = rot.cos, *sn = rot.sin;
  at::parallel_for(0, n * bs, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint8_t* row = cache.data + blocks[r / bs] * cache.s0 + (r % bs) * cache.s1;
      for (int64_t h = 0; h < cache.heads; ++h) {
        float* x = reinterpret_cast<float*>(row + h * cache.s2) + rot.start;
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
