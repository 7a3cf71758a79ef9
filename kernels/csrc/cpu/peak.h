#pragma once

#include <cstdint>

namespace kvserve {

// Byte multiply-adds per second over all of torch's intra-op threads, each running
// `iterations` rounds of independent multiply instructions on registers (no memory).
double int8_peak(int64_t iterations);

}  // namespace kvserve
