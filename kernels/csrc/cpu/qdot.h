// The integer side of the quantized products: activations rounded to 8-bit blocks, GGUF weight
// blocks unpacked into bytes, and byte dot products. Like vec.h it is written for the
// instruction set: 32 bytes in an AVX2 register, multiplied by VPDPBUSD (VPDPWSSD with the K
// formats' integer sub-scales) where the build has AVX-512 VNNI and by VPMADDUBSW + VPMADDWD
// where it has only AVX2.
//
// A weight block unpacks into units of 32 values: 32 bytes q (unsigned, but signed for q8_0)
// and the scales of the unit's two halves of 16. The value is scale * q + min, with min a
// per-unit (per-half for q6_k) constant that multiplies the sum of the activations it meets;
// the activation blocks carry those sums (QRows), so the offset of a format (q4_0's 8, q6_k's
// 32) costs one product per unit and row, not a subtraction per value.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace kvserve {

using bytes32 = __m256i;

KVSERVE_INLINE bytes32 load32(const void* p) {
  return _mm256_loadu_si256(static_cast<const bytes32*>(p));
}
KVSERVE_INLINE bytes32 splat_bytes(int8_t v) { return _mm256_set1_epi8(v); }
KVSERVE_INLINE bytes32 and32(bytes32 a, bytes32 b) { return _mm256_and_si256(a, b); }
KVSERVE_INLINE bytes32 or32(bytes32 a, bytes32 b) { return _mm256_or_si256(a, b); }
// Each 16-bit lane shifted right (the high nibbles of bytes, once masked).
KVSERVE_INLINE bytes32 shift_right16(bytes32 a, int n) { return _mm256_srli_epi16(a, n); }
KVSERVE_INLINE bytes32 shift_left16(bytes32 a, int n) { return _mm256_slli_epi16(a, n); }
KVSERVE_INLINE vec8 to_float(bytes32 i) { return _mm256_cvtepi32_ps(i); }

KVSERVE_INLINE float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_float(h);
}

// Eight int32 lanes, lane i the sum of bytes 4i..4i+3 of u (unsigned) times s (signed): lanes
// 0-3 cover the first 16 bytes. Without VNNI a pair of products must fit int16: u < 128 or
// |s| <= 127 and u <= 128 (what q8_0 gives, by dot_signed).
KVSERVE_INLINE bytes32 dot_us(bytes32 u, bytes32 s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// acc + the products of u (unsigned, < 64) and s paired into int16, times the int16 scales
// sc of their lanes: a unit's sums with its integer scales applied, for the K formats.
KVSERVE_INLINE bytes32 dot_scaled(bytes32 acc, bytes32 u, bytes32 s, bytes32 sc) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(u, s), sc);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc));
#endif
}
KVSERVE_INLINE bytes32 zero32() { return _mm256_setzero_si256(); }
// The base of two-digit activations (quantize_row): 254, so that the low digit of a value,
// its remainder (at most half a step) times the base, fits in an int8 without clamping.
constexpr int DIGIT_BASE = 254;
// Each 32-bit lane times DIGIT_BASE: 256 a - 2 a.
KVSERVE_INLINE bytes32 times_base(bytes32 a) {
  return _mm256_sub_epi32(_mm256_slli_epi32(a, 8), _mm256_slli_epi32(a, 1));
}
KVSERVE_INLINE bytes32 add_ints(bytes32 a, bytes32 b) { return _mm256_add_epi32(a, b); }
KVSERVE_INLINE void store32(void* p, bytes32 v) { _mm256_storeu_si256(static_cast<bytes32*>(p), v); }
// The 4 bytes at p in every 32-bit lane.
KVSERVE_INLINE bytes32 splat4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc + dot_us(u, s): u < 64 without VNNI.
KVSERVE_INLINE bytes32 dot_acc(bytes32 acc, bytes32 u, bytes32 s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, dot_us(u, s));
#endif
}

// acc + the byte products of u and s by one multiply instruction per 32 of them: VPDPBUSD
// with VNNI, else VPMADDUBSW into int16 lanes (which a product would widen now and then).
// Only for measuring the machine's peak rate of byte products (peak.cpp).
KVSERVE_INLINE bytes32 multiply_step(bytes32 acc, bytes32 u, bytes32 s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
#endif
}

// dot_acc(acc, u, splat4(p)): with VNNI the 4 bytes at p broadcast by the multiply's own
// memory operand ({1to8}), which GCC does not fold from a separate broadcast: one instruction
// in place of two, where a tile's broadcasts were as many as its multiplies.
KVSERVE_INLINE bytes32 dot_acc_splat(bytes32 acc, bytes32 u, const void* p) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*static_cast<const int32_t*>(p)));
  return acc;
#else
  return dot_acc(acc, u, splat4(p));
#endif
}

// The products of u (unsigned) and s paired into int16 lanes (VPMADDUBSW), their sums, and
// the sums of int16 pairs into int32 lanes: byte products summed in int16 for as long as
// their sums fit, as AVX2 without VNNI does best (one widening per several multiplies).
KVSERVE_INLINE bytes32 pair_products(bytes32 u, bytes32 s) { return _mm256_maddubs_epi16(u, s); }
KVSERVE_INLINE bytes32 add16(bytes32 a, bytes32 b) { return _mm256_add_epi16(a, b); }
KVSERVE_INLINE bytes32 widen_pairs(bytes32 a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }

// Whether dot_acc takes any unsigned bytes (VNNI sums in int32; AVX2 pairs them in int16).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool FULL_BYTE_DOTS = true;
#else
constexpr bool FULL_BYTE_DOTS = false;
#endif
// Signed bytes as unsigned ones: v + 128.
KVSERVE_INLINE bytes32 offset128(bytes32 v) { return _mm256_xor_si256(v, splat_bytes(-128)); }

// Vector registers the tiles may fill: 32 with AVX-512 (VL), 16 with AVX2.
#if defined(__AVX512VL__)
constexpr int VECTOR_REGISTERS = 32;
#else
constexpr int VECTOR_REGISTERS = 16;
#endif

// As dot_us for signed w: |w| against s with w's signs.
KVSERVE_INLINE bytes32 dot_signed(bytes32 w, bytes32 s) {
  return dot_us(_mm256_sign_epi8(w, w), _mm256_sign_epi8(s, w));
}

// Eight int32 lanes of DIGIT_BASE dot(w, hi) + dot(w, lo), for weight bytes w (signed where SIGNED,
// else below 64) and the two digits of activations (quantize_row); each lane's four products
// keep it far inside 32 bits.
template <bool SIGNED>
KVSERVE_INLINE bytes32 two_digit_dot(bytes32 w, bytes32 hi, bytes32 lo) {
  if constexpr (SIGNED) return add_ints(times_base(dot_signed(w, hi)), dot_signed(w, lo));
  return dot_acc(times_base(dot_us(w, hi)), w, lo);
}

// The 32 values of 16 bytes of nibbles: low nibbles first, then high.
KVSERVE_INLINE bytes32 nibbles16(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const bytes32 both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
  return and32(both, splat_bytes(0x0F));
}

// Byte i of v plus 16 where bit i of the 32 bits at p is set (the fifth bits of q5 values).
KVSERVE_INLINE bytes32 add_fifth_bits(bytes32 v, const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_mask_add_epi8(v, bits, v, splat_bytes(16));
#else
  const bytes32 spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const bytes32 set = _mm256_cmpeq_epi8(
      or32(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
  return or32(v, and32(set, splat_bytes(0x10)));
#endif
}

// 8 bytes at p as int32 lanes: unsigned, signed.
KVSERVE_INLINE bytes32 widen8_u(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
KVSERVE_INLINE bytes32 widen8_s(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
KVSERVE_INLINE bytes32 splat_ints(int32_t v) { return _mm256_set1_epi32(v); }
// Each 32-bit lane shifted.
KVSERVE_INLINE bytes32 shift_right32(bytes32 a, int n) { return _mm256_srli_epi32(a, n); }
KVSERVE_INLINE bytes32 shift_left32(bytes32 a, int n) { return _mm256_slli_epi32(a, n); }

// 8 int8 values at p as floats.
KVSERVE_INLINE vec8 int8_floats(const int8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(v)));
}

// q4_k/q5_k's eight 6-bit scales and mins, packed in 12 bytes: the scales as int16 in both
// 128-bit halves (for scale16), the mins as floats.
inline bytes32 scales_mins_k4(const uint8_t* s, vec8* mins) {
  uint32_t u[4];
  std::memcpy(u, s, 12);
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);  // mins 4..7
  const uint32_t mins03 = u[1] & low6;
  u[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);  // scales 4..7
  u[2] = mins03;
  u[0] &= low6;  // scales 0..3
  const __m128i both = _mm_set_epi32(static_cast<int>(u[3]), static_cast<int>(u[2]),
                                     static_cast<int>(u[1]), static_cast<int>(u[0]));
  *mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(both, 8)));
  return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(both));
}

// The first 8 int16 lanes of s as floats.
KVSERVE_INLINE vec8 int16_floats(bytes32 s) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(s)));
}

// 8 int8 values at p as int16 in both 128-bit halves.
KVSERVE_INLINE bytes32 int8_scales16(const int8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_cvtsi64_si128(v)));
}

// From int16 s0..s7 in both halves: s[i] in every int16 lane (one scale per unit).
KVSERVE_INLINE bytes32 scale16(bytes32 s, int i) {
  return _mm256_shuffle_epi8(s, _mm256_set1_epi16(static_cast<int16_t>((2 * i + 1) << 8 | 2 * i)));
}
// From int16 s0..s7 in both halves: s[2i] in the low half, s[2i + 1] in the high (one scale
// per half unit of 16 values).
KVSERVE_INLINE bytes32 scale16_pair(bytes32 s, int i) {
  const int16_t a = static_cast<int16_t>((4 * i + 1) << 8 | 4 * i);
  const int16_t b = static_cast<int16_t>((4 * i + 3) << 8 | (4 * i + 2));
  return _mm256_shuffle_epi8(s, _mm256_setr_m128i(_mm_set1_epi16(a), _mm_set1_epi16(b)));
}

// The largest |x| of 32 values.
inline float absmax32(const float* x) {
  vec8 amax = zero8();
  for (int i = 0; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(splat8(-0.f), load8(x + 8 * i)));
  alignas(32) float lanes[8];
  store8_aligned(lanes, amax);
  float top = 0.f;
  for (float l : lanes) top = top > l ? top : l;
  return top;
}

// The 32 rounded values of four vectors as bytes, in order.
KVSERVE_INLINE bytes32 floats_to_bytes(const vec8* r) {
  const bytes32 w16 =
      _mm256_packs_epi16(_mm256_packs_epi32(_mm256_cvtps_epi32(r[0]), _mm256_cvtps_epi32(r[1])),
                         _mm256_packs_epi32(_mm256_cvtps_epi32(r[2]), _mm256_cvtps_epi32(r[3])));
  // The packs interleave the 128-bit halves: put the four runs of 8 back in order.
  return _mm256_permutevar8x32_epi32(w16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

KVSERVE_INLINE vec8 round8(vec8 v) {
  return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// One row of activations, K a multiple of group (32 or 256), rounded to two int8 digits: with
// scale = max |x| / 127 over each group, x = scale (q + ql / DIGIT_BASE) to within
// scale / (2 DIGIT_BASE), about the precision of 16-bit integers, so that the products drift
// from float32 ones by about what float32 sums do. d holds the low digit's step,
// scale / DIGIT_BASE, per block of 32 (equal within a group): x = d (DIGIT_BASE q + ql), the
// sum the byte products form. s32 and s16 hold the sums of x's rounded values per 32 and 16.
inline void quantize_row(const float* x, int64_t K, int64_t group, int8_t* q, int8_t* ql,
                         float* d, float* s32, float* s16) {
  float top = 0.f;
  for (int64_t b = 0; b < K / 32; ++b) {
    if (b % (group / 32) == 0) {
      top = 0.f;
      for (int64_t i = 0; i < group / 32; ++i) top = std::max(top, absmax32(x + 32 * (b + i)));
    }
    const float scale = top / 127.f, inv = top > 0.f ? 127.f / top : 0.f;
    vec8 hi[4], lo[4], sums[2] = {zero8(), zero8()};
    for (int i = 0; i < 4; ++i) {
      const vec8 v = mul8(load8(x + 32 * b + 8 * i), splat8(inv));
      hi[i] = round8(v);
      lo[i] = round8(mul8(sub8(v, hi[i]), splat8(DIGIT_BASE)));
      sums[i / 2] = add8(sums[i / 2], fma8(lo[i], splat8(1.f / DIGIT_BASE), hi[i]));
    }
    store32(q + 32 * b, floats_to_bytes(hi));
    store32(ql + 32 * b, floats_to_bytes(lo));
    d[b] = scale / DIGIT_BASE;
    s16[2 * b] = scale * hsum(sums[0]);
    s16[2 * b + 1] = scale * hsum(sums[1]);
    s32[b] = s16[2 * b] + s16[2 * b + 1];
  }
}

}  // namespace kvserve
