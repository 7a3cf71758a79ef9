#include "kv_format.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace kvserve {
namespace {

// v as computed, never fused with the operation that follows: the reference rounds each of
// its operations (x * inv, then + 8.5), so a fused multiply-add would round differently.
KVSERVE_INLINE float rounded(float v) {
  asm("" : "+x"(v));
  return v;
}

// x [n] <- the normalized Sylvester Hadamard matrix of order n (a power of two) times x.
void walsh_hadamard(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b, x[j + h] = a - b;
      }
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int64_t j = 0; j < n; ++j) x[j] *= norm;
}

float largest_magnitude(const float* x, int64_t D) {
  float amax = 0.f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

// I8 and FP8: the rotated row's scale amax / top, then each x * (top / amax) as `cast` stores
// it. (torch computes top / amax as reciprocal(amax) * top, which rounds twice.)
template <class Cast>
void store_scaled(const float* values, int64_t D, float top, uint8_t* row, Cast cast) {
  // A thread's scratch row, kept from write to write: a cache write is one row per new token,
  // KV head and layer.
  thread_local std::vector<float> turned;
  turned.assign(values, values + D);
  hadamard(turned.data(), D);
  const float* x = turned.data();
  const float amax = largest_magnitude(x, D);
  const float inv = amax > 0.f ? (1.f / amax) * top : 0.f;
  const float scale = amax / top;
  std::memcpy(row, &scale, KV_SCALE_BYTES);
  for (int64_t i = 0; i < D; ++i) row[KV_SCALE_BYTES + i] = cast(x[i] * inv);
}

// One group of 32 rotated values as Q4_0: d = the value of largest magnitude (the first such)
// over -8, q = min(15, floor(x / d + 8.5)) with 1 / d taken from the float32 d.
void store_group(const float* g, uint8_t* out) {
  int64_t top = 0;
  for (int64_t j = 1; j < KV_GROUP; ++j)
    if (std::fabs(g[j]) > std::fabs(g[top])) top = j;
  const float d = g[top] / -8.f;
  const float inv = d != 0.f ? 1.f / d : 0.f;
  uint8_t q[KV_GROUP];
  for (int64_t j = 0; j < KV_GROUP; ++j)
    q[j] = static_cast<uint8_t>(std::min(15.f, std::floor(rounded(g[j] * inv) + 8.5f)));
  const uint16_t half = c10::Half(d).x;
  std::memcpy(out, &half, 2);
  for (int64_t j = 0; j < KV_GROUP / 2; ++j)
    out[2 + j] = static_cast<uint8_t>(q[j] | (q[j + KV_GROUP / 2] << 4));
}

void store_int4(const float* x, int64_t D, uint8_t* row) {
  const int64_t n = hadamard_block(D);
  float block[64];
  for (int64_t b = 0; b < D; b += n) {
    std::copy_n(x + b, n, block);
    walsh_hadamard(block, n);
    for (int64_t g = 0; g < n; g += KV_GROUP, row += KV_GROUP_BYTES) store_group(block + g, row);
  }
}

// h as float16 bits, moved one step toward +inf (`up`) or -inf.
uint16_t half_step(uint16_t h, bool up) {
  const bool negative = h & 0x8000;
  if ((h & 0x7FFF) == 0) return up ? 0x0001 : 0x8001;  // from zero: the smallest subnormal
  return negative == up ? h - 1 : h + 1;
}

// x rounded to float16 toward +inf (`up`) or -inf, as a float (kv_quant._half).
float half_outward(float x, bool up) {
  uint16_t h = c10::Half(x).x;
  const float f = f16_to_float(h);
  if (up ? f < x : f > x) h = half_step(h, up);
  return f16_to_float(h);
}

}  // namespace

void store_channel_group(KvFormat from, const uint8_t* in, int64_t in_stride, int64_t D,
                         uint8_t* out, int64_t out_stride) {
  constexpr int64_t G = KV_CHANNEL_GROUP;
  thread_local std::vector<float> x, lo, hi, m, c;
  x.resize(G * D);
  lo.assign(D, INFINITY);
  hi.assign(D, -INFINITY);
  m.resize(D);
  c.resize(D);
  with_format(from, [&](auto f) {
    for (int64_t t = 0; t < G; ++t) load_row<decltype(f)::value>(in + t * in_stride, D, &x[t * D]);
  });
  for (int64_t t = 0; t < G; ++t)
    for (int64_t d = 0; d < D; ++d) {
      lo[d] = std::min(lo[d], x[t * D + d]);
      hi[d] = std::max(hi[d], x[t * D + d]);
    }
  const float lo0 = half_outward(*std::min_element(lo.begin(), lo.end()), false);
  float dlo = half_outward((*std::max_element(lo.begin(), lo.end()) - lo0) / 255.f, true);
  if (!(dlo > 0.f)) dlo = 1.f;
  float top = -INFINITY;
  for (int64_t d = 0; d < D; ++d) {
    m[d] = std::clamp(std::floor((lo[d] - lo0) / dlo), 0.f, 255.f);
    c[d] = (hi[d] - rounded(lo0 + rounded(m[d] * dlo))) / 15.f;  // the scale, coded below
    top = std::max(top, c[d]);
  }
  float ds = half_outward(top / 255.f, true);
  if (!(ds > 0.f)) ds = 1.f;
  for (int64_t d = 0; d < D; ++d) c[d] = std::clamp(std::ceil(c[d] / ds), 0.f, 255.f);
  // The codes: lo0, dlo, ds as float16, the minimums' codes, the scales', spread over the
  // rows' tails after their nibbles.
  const int64_t tail = kv_row_bytes(KvFormat::I4C, D) - D / 2;
  const auto code = [&](int64_t i, uint8_t b) {
    out[i / tail * out_stride + D / 2 + i % tail] = b;
  };
  for (int64_t i = 0; i < G * tail; ++i) code(i, 0);
  const float ends[3] = {lo0, dlo, ds};
  for (int e = 0; e < 3; ++e) {
    const uint16_t h = c10::Half(ends[e]).x;
    code(2 * e, h & 0xFF), code(2 * e + 1, h >> 8);
  }
  for (int64_t d = 0; d < D; ++d) {
    code(KV_CHANNEL_GRID_BYTES + d, static_cast<uint8_t>(m[d]));
    code(KV_CHANNEL_GRID_BYTES + D + d, static_cast<uint8_t>(c[d]));
  }
  for (int64_t d = 0; d < D; ++d) {
    const float low = rounded(lo0 + rounded(m[d] * dlo)), s = c[d] * ds;
    lo[d] = low, hi[d] = s > 0.f ? 1.f / s : 0.f;  // now each channel's minimum and 1 / scale
  }
  for (int64_t t = 0; t < G; ++t) {
    uint8_t* row = out + t * out_stride;
    for (int64_t g = 0; g < D; g += KV_GROUP) {
      uint8_t q[KV_GROUP];
      for (int64_t j = 0; j < KV_GROUP; ++j) {
        const int64_t d = g + j;
        q[j] = static_cast<uint8_t>(
            std::clamp(std::nearbyint(rounded(x[t * D + d] - lo[d]) * hi[d]), 0.f, 15.f));
      }
      for (int64_t j = 0; j < KV_GROUP / 2; ++j)
        row[g / 2 + j] = static_cast<uint8_t>(q[j] | (q[j + KV_GROUP / 2] << 4));
    }
  }
}

void read_channel_codes(const uint8_t* first, int64_t stride, int64_t D, ChannelCodes& codes) {
  if (codes.group == first && static_cast<int64_t>(codes.s.size()) == D) return;
  // The group's codes lie end to end over its rows' tails, a few bytes each (D / 16 + 1):
  // gathered first, byte by byte, which costs less than a call to copy each.
  const int64_t tail = kv_row_bytes(KvFormat::I4C, D) - D / 2;
  TORCH_CHECK(tail <= KV_CHANNEL_TAIL_MAX, "int4 keys of head dim ", D, " are too wide");
  uint8_t all[KV_CHANNEL_GROUP * KV_CHANNEL_TAIL_MAX + 8];  // + 8: a load of 8 codes past the end
  for (int64_t t = 0; t < KV_CHANNEL_GROUP; ++t) {
    const uint8_t* src = first + t * stride + D / 2;
    uint8_t* dst = all + t * tail;
    for (int64_t j = 0; j < tail; ++j) dst[j] = src[j];
  }
  const auto half = [&](int64_t i) {
    return f16_to_float(static_cast<uint16_t>(all[i] | all[i + 1] << 8));
  };
  const vec8 lo0 = splat8(half(0)), dlo = splat8(half(2)), ds = splat8(half(4));
  const uint8_t *mins = all + KV_CHANNEL_GRID_BYTES, *scales = mins + D;
  codes.s.resize(D);
  codes.lo8.resize(D);
  for (int64_t c = 0; c < D; c += 8) {  // D is a multiple of 32
    const vec8 s = mul8(load8_u8(scales + c), ds);
    store8(codes.s.data() + c, s);
    const vec8 lo = add8(lo0, mul8(load8_u8(mins + c), dlo));
    store8(codes.lo8.data() + c, add8(lo, mul8(splat8(8.f), s)));
  }
  codes.group = first;
}

void hadamard(float* x, int64_t D) {
  const int64_t n = hadamard_block(D);
  for (int64_t b = 0; b < D; b += n) walsh_hadamard(x + b, n);
}

void store_row(KvFormat f, const float* x, int64_t D, uint8_t* row) {
  switch (f) {
    case KvFormat::F32: std::memcpy(row, x, 4 * D); return;
    case KvFormat::F16: {
      int64_t d = 0;
      for (; d + 8 <= D; d += 8) store8_f16(row + 2 * d, load8(x + d));
      for (; d < D; ++d) {
        const uint16_t h = c10::Half(x[d]).x;
        std::memcpy(row + 2 * d, &h, 2);
      }
      return;
    }
    case KvFormat::BF16:
      for (int64_t d = 0; d < D; ++d) {
        const uint16_t h = c10::BFloat16(x[d]).x;
        std::memcpy(row + 2 * d, &h, 2);
      }
      return;
    case KvFormat::I8:
      store_scaled(x, D, 127.f, row, [](float v) {
        return static_cast<uint8_t>(static_cast<int8_t>(std::clamp(std::nearbyint(v), -127.f, 127.f)));
      });
      return;
    case KvFormat::FP8:
      store_scaled(x, D, 448.f, row, [](float v) {
        return c10::Float8_e4m3fn(std::clamp(v, -448.f, 448.f)).x;
      });
      return;
    case KvFormat::I4: store_int4(x, D, row); return;
    case KvFormat::I4C: TORCH_CHECK(false, "int4 keys are written by their groups (kv_quant)");
  }
}

}  // namespace kvserve
