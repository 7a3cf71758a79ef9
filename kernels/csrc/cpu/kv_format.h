// The KV cache's storage formats, as kernels/kv_quant.py lays them out (its torch reference is
// what these match): per slot and KV head a row of D values, in
//   F32, F16, BF16  the values
//   I8, FP8         a float32 scale, then D int8 (x = scale q) or float8 e4m3 (x = scale e4m3)
//   I4              per group of 32 values a float16 scale d, then 16 bytes of nibbles (byte j:
//                   q_j low, q_{j+16} high), x = d (q - 8)
//   I4C             keys only: per 32 values 16 bytes of nibbles as I4's, then a share of the
//                   codes its group of 32 tokens keeps per channel (kv_quant.quantize_channels),
//                   x = lo_c + s_c q: a row one byte longer than I4's, read by groups
// the quantized ones (I8, FP8, I4) of the row first rotated by hadamard (not I4C: per channel,
// the outlier channels keep their own scales). A row's prefix of whole groups is itself a row
// of its first values (MLA's values).
//
// Attention reads rows through load_row, a tile of them at a time: every query head of the tile
// then shares one conversion. A quantized row's values stay rotated; attention rotates the
// query and its output instead (R q . R k = q . k, sum p R v = R sum p v).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace kvserve {

// Each a cache tensor's dtype (kernels.kv_quant.KV_DTYPES): float32, float16, bfloat16, int8,
// float8_e4m3fn, uint8.
enum class KvFormat : int64_t { F32, F16, BF16, I8, FP8, I4, I4C };

constexpr int64_t KV_SCALE_BYTES = 4;                  // I8, FP8: the row's float32 scale
constexpr int64_t KV_GROUP = 32, KV_GROUP_BYTES = 18;  // I4: values and bytes per scale
constexpr int64_t KV_CHANNEL_GROUP = 32;               // I4C: tokens per channel's codes
constexpr int64_t KV_CHANNEL_GRID_BYTES = 6;           // I4C: a group's float16 lo0, dlo, ds
constexpr int64_t KV_CHANNEL_TAIL_MAX = 17;            // I4C: a row's code bytes, D <= 256

inline int64_t kv_row_bytes(KvFormat f, int64_t D) {
  switch (f) {
    case KvFormat::F32: return 4 * D;
    case KvFormat::F16:
    case KvFormat::BF16: return 2 * D;
    case KvFormat::I8:
    case KvFormat::FP8: return KV_SCALE_BYTES + D;
    case KvFormat::I4: return D / KV_GROUP * KV_GROUP_BYTES;
    case KvFormat::I4C: return D / KV_GROUP * KV_GROUP_BYTES + 1;
  }
  return 0;
}

// The values of a row of `bytes` bytes; -1 where that is no whole row.
inline int64_t kv_values(KvFormat f, int64_t bytes) {
  int64_t D = -1;
  switch (f) {
    case KvFormat::F32: D = bytes / 4; break;
    case KvFormat::F16:
    case KvFormat::BF16: D = bytes / 2; break;
    case KvFormat::I8:
    case KvFormat::FP8: D = bytes - KV_SCALE_BYTES; break;
    case KvFormat::I4:
    case KvFormat::I4C: D = bytes / KV_GROUP_BYTES * KV_GROUP; break;
  }
  return D > 0 && kv_row_bytes(f, D) == bytes ? D : -1;
}

// Whether rows are stored rotated (kv_quant.rotated).
constexpr bool stored_rotated(KvFormat f) {
  return f == KvFormat::I8 || f == KvFormat::FP8 || f == KvFormat::I4;
}

// Values per block of the rotation (kv_quant.hadamard_block).
inline int64_t hadamard_block(int64_t D) { return D % 64 == 0 ? 64 : 32; }

// x [D] <- hadamard(D) x in place: a normalized Walsh-Hadamard transform per block.
void hadamard(float* x, int64_t D);

// The row of D values x in format f at `row`, as kv_quant.quantize writes it: byte for byte,
// except that the quantized formats' rotation may round differently from the reference's
// matrix product.
void store_row(KvFormat f, const float* x, int64_t D, uint8_t* row);

namespace detail {

template <class T>
KVSERVE_INLINE T bits_at(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// One e4m3 byte, divided by 256 (as load8_e4m3_over_256).
KVSERVE_INLINE float e4m3_over_256(uint8_t b) {
  return f16_to_float(static_cast<uint16_t>(((b & 0x7F) << 7) | ((b & 0x80) << 8)));
}

}  // namespace detail

// out [D] <- the values of `row` (quantized ones still rotated).
template <KvFormat F>
inline void load_row(const uint8_t* row, int64_t D, float* out) {
  using namespace detail;
  int64_t d = 0;
  if constexpr (F == KvFormat::F32) {
    std::memcpy(out, row, 4 * D);
  } else if constexpr (F == KvFormat::F16) {
    for (; d + 8 <= D; d += 8) store8(out + d, load8_f16(row + 2 * d));
    for (; d < D; ++d) out[d] = f16_to_float(bits_at<uint16_t>(row + 2 * d));
  } else if constexpr (F == KvFormat::BF16) {
    for (; d + 8 <= D; d += 8) store8(out + d, load8_bf16(row + 2 * d));
    for (; d < D; ++d) {
      const uint32_t w = static_cast<uint32_t>(bits_at<uint16_t>(row + 2 * d)) << 16;
      std::memcpy(out + d, &w, 4);
    }
  } else if constexpr (F == KvFormat::I8) {
    const float scale = bits_at<float>(row);
    const int8_t* q = reinterpret_cast<const int8_t*>(row + KV_SCALE_BYTES);
    for (; d + 8 <= D; d += 8) store8(out + d, mul8(load8_i8(q + d), splat8(scale)));
    for (; d < D; ++d) out[d] = scale * q[d];
  } else if constexpr (F == KvFormat::FP8) {
    const float scale = bits_at<float>(row) * 256.f;
    const uint8_t* q = row + KV_SCALE_BYTES;
    for (; d + 8 <= D; d += 8) store8(out + d, mul8(load8_e4m3_over_256(q + d), splat8(scale)));
    for (; d < D; ++d) out[d] = scale * e4m3_over_256(q[d]);
  } else {
    static_assert(F == KvFormat::I4);
    for (; d < D; d += KV_GROUP, row += KV_GROUP_BYTES) {
      const vec8 scale = splat8(f16_to_float(bits_at<uint16_t>(row)));
      vec8 q[4];
      load32_nibbles_minus8(row + 2, q);
      for (int j = 0; j < 4; ++j) store8(out + d + 8 * j, mul8(q[j], scale));
    }
  }
}

template <KvFormat F>
using KvFormatTag = std::integral_constant<KvFormat, F>;

// fn(KvFormatTag<f>{}): code templated on the format, chosen once per unit of work.
template <class Fn>
inline void with_format(KvFormat f, Fn&& fn) {
  switch (f) {
    case KvFormat::F32: return fn(KvFormatTag<KvFormat::F32>{});
    case KvFormat::F16: return fn(KvFormatTag<KvFormat::F16>{});
    case KvFormat::BF16: return fn(KvFormatTag<KvFormat::BF16>{});
    case KvFormat::I8: return fn(KvFormatTag<KvFormat::I8>{});
    case KvFormat::FP8: return fn(KvFormatTag<KvFormat::FP8>{});
    case KvFormat::I4: return fn(KvFormatTag<KvFormat::I4>{});
    case KvFormat::I4C: return;  // keys only: with_formats pairs them
  }
}

// Whether keys in kf and values in vf are a pair the kernels read: one format, or two quantized
// ones (models.kv_spec.kv_pair).
constexpr bool kv_pair_read(KvFormat kf, KvFormat vf) {
  return (kf == vf && kf != KvFormat::I4C) ||
         ((stored_rotated(kf) || kf == KvFormat::I4C) && stored_rotated(vf));
}

// Channel c of a group of I4C keys: x = lo[c] + s[c] q, kept as lo8 = lo + 8 s beside s so
// that a row reads as lo8 + s (q - 8), from the nibbles as I4 loads them (channel_scores).
struct ChannelCodes {
  const uint8_t* group = nullptr;  // the group's first row these are of
  std::vector<float> s, lo8;
};

// codes <- those of the group whose first row (of one head) is `first`, its rows `stride` bytes
// apart, D values each; a no-op when they are already the group's.
void read_channel_codes(const uint8_t* first, int64_t stride, int64_t D, ChannelCodes& codes);

// The 32 rows of a group of I4C keys (of one head), `out` its first and `out_stride` bytes apart
// <- the keys of those tokens, rows `in_stride` bytes apart from `in` in format `from`, as
// kv_quant.quantize_channels stores them (operation for operation, so byte for byte).
void store_channel_group(KvFormat from, const uint8_t* in, int64_t in_stride, int64_t D,
                         uint8_t* out, int64_t out_stride);

// fn(KvFormatTag<kf>{}, KvFormatTag<vf>{}) for a pair kv_pair_read takes (callers check).
template <class Fn>
inline void with_formats(KvFormat kf, KvFormat vf, Fn&& fn) {
  if (kf == vf) return with_format(kf, [&](auto f) { fn(f, f); });
  const auto value = [&](auto k) {
    switch (vf) {
      case KvFormat::I8: return fn(k, KvFormatTag<KvFormat::I8>{});
      case KvFormat::FP8: return fn(k, KvFormatTag<KvFormat::FP8>{});
      case KvFormat::I4: return fn(k, KvFormatTag<KvFormat::I4>{});
      default: return;
    }
  };
  switch (kf) {
    case KvFormat::I8: return value(KvFormatTag<KvFormat::I8>{});
    case KvFormat::FP8: return value(KvFormatTag<KvFormat::FP8>{});
    case KvFormat::I4: return value(KvFormatTag<KvFormat::I4>{});
    case KvFormat::I4C: return value(KvFormatTag<KvFormat::I4C>{});
    default: return;
  }
}

}  // namespace kvserve
