// The GGUF block formats the quantized products read, as ggml lays them out (ggml-common.h),
// each unpacked by the helpers of qdot.h. A format is a struct made from one block's bytes:
//   q(j)            the 32 values of unit j (of UNITS), as bytes (signed when SIGNED)
//   scale_times(j, dx)  the scales of unit j's halves times the activation block's scale
//   min() / mins(s32, s16, acc)  the offset term: one float per unit for the 32-value formats
//                   (times the activation block's sum), a vector per block for the K formats
// so that a value is scale * q + min, summed against activations of known block sums. The K
// formats' units have integer scales: scale16(j), the int16 scale of each lane of unit j,
// times d for the block, which the products apply in integers over the whole block (the
// activations then have one scale per 256 values). For many rows (qtiles.cpp), a block
// unpacks whole: sub_scales(sc, mn) gives the scale and min of each SUB values.
#pragma once

#include <cstdint>

#include "qdot.h"

namespace kvserve {

// block_q4_0 {fp16 d; uint8 qs[16]}: d * (q - 8).
struct Q4_0 {
  static constexpr int64_t TYPE = 2, BLOCK = 32, BYTES = 18, UNITS = 1;
  static constexpr bool SIGNED = false, HAS_MIN = true;
  static constexpr int64_t SUB = 32;  // values per scale
  const uint8_t* b;
  float d;
  explicit Q4_0(const uint8_t* p) : b(p), d(fp16_at(p)) {}
  bytes32 q(int) const { return nibbles16(b + 2); }
  vec8 scale_times(int, float dx) const { return splat8(d * dx); }
  float min() const { return -8.f * d; }
  void sub_scales(float* sc, float* mn) const { *sc = d, *mn = min(); }
};

// block_q4_1 {fp16 d, m; uint8 qs[16]}: d * q + m.
struct Q4_1 {
  static constexpr int64_t TYPE = 3, BLOCK = 32, BYTES = 20, UNITS = 1;
  static constexpr bool SIGNED = false, HAS_MIN = true;
  static constexpr int64_t SUB = 32;  // values per scale
  const uint8_t* b;
  float d;
  explicit Q4_1(const uint8_t* p) : b(p), d(fp16_at(p)) {}
  bytes32 q(int) const { return nibbles16(b + 4); }
  vec8 scale_times(int, float dx) const { return splat8(d * dx); }
  float min() const { return fp16_at(b + 2); }
  void sub_scales(float* sc, float* mn) const { *sc = d, *mn = min(); }
};

// block_q5_0 {fp16 d; uint8 qh[4]; uint8 qs[16]}: d * (q - 16), qh holding the fifth bits.
struct Q5_0 {
  static constexpr int64_t TYPE = 6, BLOCK = 32, BYTES = 22, UNITS = 1;
  static constexpr bool SIGNED = false, HAS_MIN = true;
  static constexpr int64_t SUB = 32;  // values per scale
  const uint8_t* b;
  float d;
  explicit Q5_0(const uint8_t* p) : b(p), d(fp16_at(p)) {}
  bytes32 q(int) const { return add_fifth_bits(nibbles16(b + 6), b + 2); }
  vec8 scale_times(int, float dx) const { return splat8(d * dx); }
  float min() const { return -16.f * d; }
  void sub_scales(float* sc, float* mn) const { *sc = d, *mn = min(); }
};

// block_q5_1 {fp16 d, m; uint8 qh[4]; uint8 qs[16]}: d * q + m.
struct Q5_1 {
  static constexpr int64_t TYPE = 7, BLOCK = 32, BYTES = 24, UNITS = 1;
  static constexpr bool SIGNED = false, HAS_MIN = true;
  static constexpr int64_t SUB = 32;  // values per scale
  const uint8_t* b;
  float d;
  explicit Q5_1(const uint8_t* p) : b(p), d(fp16_at(p)) {}
  bytes32 q(int) const { return add_fifth_bits(nibbles16(b + 8), b + 4); }
  vec8 scale_times(int, float dx) const { return splat8(d * dx); }
  float min() const { return fp16_at(b + 2); }
  void sub_scales(float* sc, float* mn) const { *sc = d, *mn = min(); }
};

// block_q8_0 {fp16 d; int8 qs[32]}: d * q.
struct Q8_0 {
  static constexpr int64_t TYPE = 8, BLOCK = 32, BYTES = 34, UNITS = 1;
  static constexpr bool SIGNED = true, HAS_MIN = false;
  static constexpr int64_t SUB = 32;  // values per scale
  const uint8_t* b;
  float d;
  explicit Q8_0(const uint8_t* p) : b(p), d(fp16_at(p)) {}
  bytes32 q(int) const { return load32(b + 2); }
  vec8 scale_times(int, float dx) const { return splat8(d * dx); }
  float min() const { return 0.f; }
  // Unpacked, the values are offset to unsigned (offset128): q + 128, min -128 d.
  void sub_scales(float* sc, float* mn) const { *sc = d, *mn = -128.f * d; }
};

// block_q4_K {fp16 d, dmin; uint8 scales[12]; uint8 qs[128]}: eight units of 32, unit j
// d * sc[j] * q - dmin * mn[j] (6-bit sc, mn); units 2i and 2i + 1 are the low and high nibbles
// of qs[32 i .. 32 i + 31].
struct Q4_K {
  static constexpr int64_t TYPE = 12, BLOCK = 256, BYTES = 144, UNITS = 8;
  static constexpr bool SIGNED = false, HAS_MIN = true;
  static constexpr int64_t SUB = 32;  // values per scale
  const uint8_t* b;
  float d;
  bytes32 sc;
  vec8 mn;
  explicit Q4_K(const uint8_t* p) : b(p), d(fp16_at(p)) {
    sc = scales_mins_k4(p + 4, &mn);
    mn = mul8(mn, splat8(-fp16_at(p + 2)));
  }
  bytes32 scale16(int j) const { return kvserve::scale16(sc, j); }
  bytes32 q(int j) const {
    const bytes32 v = load32(b + 16 + 32 * (j / 2));
    return and32(j % 2 ? shift_right16(v, 4) : v, splat_bytes(0x0F));
  }
  vec8 mins(const float* s32, const float*, vec8 acc) const { return fma8(mn, load8(s32), acc); }
  void sub_scales(float* sc, float* mn) const {
    store8(sc, mul8(int16_floats(this->sc), splat8(d)));
    store8(mn, this->mn);
  }
};

// block_q5_K {fp16 d, dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]}: as q4_K with a
// fifth bit, bit j of qh[i] for value i of unit j.
struct Q5_K {
  static constexpr int64_t TYPE = 13, BLOCK = 256, BYTES = 176, UNITS = 8;
  static constexpr bool SIGNED = false, HAS_MIN = true;
  static constexpr int64_t SUB = 32;  // values per scale
  const uint8_t* b;
  float d;
  bytes32 sc;
  vec8 mn;
  explicit Q5_K(const uint8_t* p) : b(p), d(fp16_at(p)) {
    sc = scales_mins_k4(p + 4, &mn);
    mn = mul8(mn, splat8(-fp16_at(p + 2)));
  }
  bytes32 scale16(int j) const { return kvserve::scale16(sc, j); }
  bytes32 q(int j) const {
    const bytes32 v = load32(b + 48 + 32 * (j / 2)), h = load32(b + 16);
    const bytes32 fifth = j < 4 ? shift_left16(h, 4 - j) : shift_right16(h, j - 4);
    return or32(and32(j % 2 ? shift_right16(v, 4) : v, splat_bytes(0x0F)),
                and32(fifth, splat_bytes(0x10)));
  }
  vec8 mins(const float* s32, const float*, vec8 acc) const { return fma8(mn, load8(s32), acc); }
  void sub_scales(float* sc, float* mn) const {
    store8(sc, mul8(int16_floats(this->sc), splat8(d)));
    store8(mn, this->mn);
  }
};

// block_q6_K {uint8 ql[128]; uint8 qh[64]; int8 scales[16]; fp16 d}: sixteen halves of 16,
// half i d * scales[i] * (q - 32). In each 128 values (ql + 64 h, qh + 32 h) unit u takes the
// low nibbles of ql[32 (u % 2) ..] for u < 2, the high ones after, and bits 2u, 2u + 1 of qh.
struct Q6_K {
  static constexpr int64_t TYPE = 14, BLOCK = 256, BYTES = 210, UNITS = 8;
  static constexpr bool SIGNED = false, HAS_MIN = true;
  static constexpr int64_t SUB = 16;  // values per scale
  const uint8_t* b;
  float d;
  vec8 s0, s1;  // d * scales[0..7], d * scales[8..15]
  bytes32 e0, e1;  // scales[0..7], scales[8..15] as int16
  explicit Q6_K(const uint8_t* p) : b(p), d(fp16_at(p + 208)) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    s0 = mul8(int8_floats(sc), splat8(d));
    s1 = mul8(int8_floats(sc + 8), splat8(d));
    e0 = int8_scales16(sc);
    e1 = int8_scales16(sc + 8);
  }
  bytes32 scale16(int j) const { return scale16_pair(j < 4 ? e0 : e1, j % 4); }
  bytes32 q(int j) const {
    const int h = j / 4, u = j % 4;
    const bytes32 l = load32(b + 64 * h + 32 * (u % 2)), hb = load32(b + 128 + 32 * h);
    const bytes32 high = u < 2 ? shift_left16(hb, 4 - 2 * u) : shift_right16(hb, 2 * u - 4);
    return or32(and32(u < 2 ? l : shift_right16(l, 4), splat_bytes(0x0F)),
                and32(high, splat_bytes(0x30)));
  }
  vec8 mins(const float*, const float* s16, vec8 acc) const {
    const vec8 k = splat8(-32.f);
    return fma8(mul8(s0, k), load8(s16), fma8(mul8(s1, k), load8(s16 + 8), acc));
  }
  void sub_scales(float* sc, float* mn) const {
    store8(sc, s0), store8(sc + 8, s1);
    store8(mn, mul8(s0, splat8(-32.f))), store8(mn + 8, mul8(s1, splat8(-32.f)));
  }
};

}  // namespace kvserve
