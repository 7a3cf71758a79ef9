// The vector helpers of the CPU kernels: eight floats in an AVX2 register (vec8) and what the
// kernels do with them. This is the one file written for an instruction set; the kernels name
// only these helpers, so that another one (AVX-512, NEON) means another version of this file.
// The one-instruction helpers are forced inline, as the intrinsics they wrap are.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#define KVSERVE_INLINE inline __attribute__((always_inline))

namespace kvserve {

using vec8 = __m256;
using mask8 = __m256i;  // which lanes to store: all of a lane's bits set to store it

KVSERVE_INLINE vec8 zero8() { return _mm256_setzero_ps(); }
KVSERVE_INLINE vec8 splat8(float v) { return _mm256_set1_ps(v); }
KVSERVE_INLINE vec8 load8(const float* p) { return _mm256_loadu_ps(p); }
KVSERVE_INLINE void store8(float* p, vec8 v) { _mm256_storeu_ps(p, v); }
// At a 32-byte aligned address.
KVSERVE_INLINE vec8 load8_aligned(const float* p) { return _mm256_load_ps(p); }
KVSERVE_INLINE void store8_aligned(float* p, vec8 v) { _mm256_store_ps(p, v); }

KVSERVE_INLINE vec8 add8(vec8 a, vec8 b) { return _mm256_add_ps(a, b); }
KVSERVE_INLINE vec8 sub8(vec8 a, vec8 b) { return _mm256_sub_ps(a, b); }
KVSERVE_INLINE vec8 mul8(vec8 a, vec8 b) { return _mm256_mul_ps(a, b); }
KVSERVE_INLINE vec8 max8(vec8 a, vec8 b) { return _mm256_max_ps(a, b); }
KVSERVE_INLINE vec8 div8(vec8 a, vec8 b) { return _mm256_div_ps(a, b); }
// a * b + c and c - a * b, each rounded once.
KVSERVE_INLINE vec8 fma8(vec8 a, vec8 b, vec8 c) { return _mm256_fmadd_ps(a, b, c); }
KVSERVE_INLINE vec8 fnma8(vec8 a, vec8 b, vec8 c) { return _mm256_fnmadd_ps(a, b, c); }

// The mask of the first n lanes (0 <= n <= 8), for store8_masked.
KVSERVE_INLINE mask8 first_lanes(int64_t n) {
  alignas(32) static const int32_t lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                                0,  0,  0,  0,  0,  0,  0,  0};
  return _mm256_loadu_si256(reinterpret_cast<const mask8*>(lanes + 8 - n));
}
KVSERVE_INLINE void store8_masked(float* p, mask8 m, vec8 v) { _mm256_maskstore_ps(p, m, v); }

// Eight stored values of a KV-cache row (kv_format.h) as floats: float16, bfloat16 (the top
// half of a float32), int8, and float8 e4m3 (divided by 256: each byte's sign, exponent and
// mantissa moved into a float16's, whose exponent bias is 8 more).
KVSERVE_INLINE vec8 load8_f16(const void* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}
KVSERVE_INLINE vec8 load8_bf16(const void* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
// One float16 or bfloat16 value as a float.
KVSERVE_INLINE float f16_to_float(uint16_t h) { return _cvtsh_ss(h); }
KVSERVE_INLINE float bf16_to_float(uint16_t h) {
  return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128(static_cast<int32_t>(h) << 16)));
}
KVSERVE_INLINE vec8 load8_u8(const void* p) {
  const __m128i b = _mm_loadl_epi64(static_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}
KVSERVE_INLINE vec8 load8_i8(const void* p) {
  const __m128i b = _mm_loadl_epi64(static_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
KVSERVE_INLINE vec8 load8_e4m3_over_256(const void* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
  const __m128i magnitude = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
  return _mm256_cvtph_ps(_mm_or_si128(magnitude, sign));
}
// The 32 values q - 8 of 16 bytes of nibbles (byte j: q_j low, q_{j+16} high), in order.
KVSERVE_INLINE void load32_nibbles_minus8(const void* p, vec8* out) {
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
  const __m128i lo = _mm_sub_epi8(_mm_and_si128(b, low), eight);
  const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), low), eight);
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}
// Eight floats as float16, rounded to nearest even.
KVSERVE_INLINE void store8_f16(void* p, vec8 v) {
  _mm_storeu_si128(static_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// Requests the cache line of p into L1 (for the next few hundred cycles) or L2 (further ahead).
KVSERVE_INLINE void prefetch_l1(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}
KVSERVE_INLINE void prefetch_l2(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
}

// Requests the n bytes at p into L2, a cache line at a time.
inline void prefetch_bytes_l2(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < n; i += 64) _mm_prefetch(c + i, _MM_HINT_T1);
}

// The sum of v's lanes.
inline float hsum(vec8 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The largest of v's lanes.
inline float hmax(vec8 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// The sums of eight vectors, as one vector: [sum(a[0]), ..., sum(a[7])].
inline vec8 sum8(const vec8* a) {
  const vec8 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const vec8 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const vec8 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

// 8 vectors as the columns of an 8 x 8 block: r[j][i] <- r[i][j].
inline void transpose8(vec8* r) {
  vec8 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// exp of 8 floats (Cephes' polynomial: relative error ~1e-7 over the range softmax uses).
inline vec8 exp8(vec8 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)),
                    _mm256_set1_ps(-88.3762626647949f));
  vec8 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  vec8 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// dot(a, b) over n floats, two accumulators so that the FMAs do not wait on each other.
inline float dot(const float* a, const float* b, int64_t n) {
  vec8 acc0 = zero8(), acc1 = zero8();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = fma8(load8(a + i), load8(b + i), acc0);
    acc1 = fma8(load8(a + i + 8), load8(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = fma8(load8(a + i), load8(b + i), acc0);
  float s = hsum(add8(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace kvserve
