// The machine's peak rate of int8 multiply-adds with the instructions the products use
// (multiply_step), on every thread: the ceiling the quantized products are judged against.
#include <omp.h>

#include "peak.h"
#include "qdot.h"

namespace kvserve {

double int8_peak(int64_t iterations) {
  // Independent chains enough to cover the multiply's latency on two ports.
  constexpr int CHAINS = 12;
  double seconds = 0.0;
  int threads = 1;
#pragma omp parallel reduction(max : seconds)
  {
    threads = omp_get_num_threads();
    bytes32 acc[CHAINS];
    for (int c = 0; c < CHAINS; ++c) acc[c] = splat_bytes(static_cast<int8_t>(c));
    const bytes32 u = splat_bytes(3), s = splat_bytes(-2);
#pragma omp barrier
    const double start = omp_get_wtime();
    for (int64_t i = 0; i < iterations; ++i)
#pragma GCC unroll 12
      for (int c = 0; c < CHAINS; ++c) acc[c] = multiply_step(acc[c], u, s);
    seconds = omp_get_wtime() - start;
    // Kept, so that the loop is not optimized away.
    alignas(32) int32_t out[8];
    bytes32 all = acc[0];
    for (int c = 1; c < CHAINS; ++c) all = add_ints(all, acc[c]);
    store32(out, all);
    if (out[0] == 0x12345678) seconds += 1e-9;
  }
  return 32.0 * CHAINS * static_cast<double>(iterations) * threads / seconds;
}

}  // namespace kvserve
