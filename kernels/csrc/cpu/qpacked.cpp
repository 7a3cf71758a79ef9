// Repacking (once, at load) and the products of repacked weights (qpacked.h).
#include "qpacked.h"

#include <algorithm>
#include <cstring>

#include "qformats.h"

namespace kvserve {
namespace {

// ---- The layout, per format: values per block, bits per value, values per scale. ----

struct Shape {
  int64_t block, bits, sub;
  bool has_m;  // a second fp16 per row: q4_1/q5_1's m, q4_k/q5_k's dmin

  // Bytes of a group's values per block; its scales follow.
  int64_t value_bytes() const {
    return bits == 8 ? 8 * block : 4 * block + (bits == 5 ? block : bits == 6 ? 2 * block : 0);
  }
};

Shape shape_of(int64_t type) {
  switch (type) {
    case Q4_0::TYPE: return {32, 4, 32, false};
    case Q4_1::TYPE: return {32, 4, 32, true};
    case Q5_0::TYPE: return {32, 5, 32, false};
    case Q5_1::TYPE: return {32, 5, 32, true};
    case Q8_0::TYPE: return {32, 8, 32, false};
    case Q4_K::TYPE: return {256, 4, 32, true};
    case Q5_K::TYPE: return {256, 5, 32, true};
    case Q6_K::TYPE: return {256, 6, 16, false};
    default: return {0, 0, 0, false};
  }
}

// ---- Repacking, in plain scalar code: it runs once per matrix. ----

// One block of the file decoded: its values as bytes (q8_0's as the bits of int8), the fp16
// bits of d and m (or dmin), and the K formats' sub-scales and mins (q6_k's int8 scales).
struct FileBlock {
  uint8_t q[256];
  uint16_t d = 0, m = 0;
  uint8_t sc[16] = {}, mn[16] = {};
};

uint16_t u16_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

void nibbles_of(const uint8_t* p, uint8_t* q) {
  for (int i = 0; i < 16; ++i) q[i] = p[i] & 15, q[i + 16] = p[i] >> 4;
}

void fifth_bits_of(const uint8_t* p, uint8_t* q) {
  uint32_t h;
  std::memcpy(&h, p, 4);
  for (int i = 0; i < 32; ++i) q[i] |= ((h >> i) & 1) << 4;
}

// ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from 12 packed bytes.
void scale_min_k4(int j, const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = s[j] & 63, *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void decode(int64_t type, const uint8_t* p, FileBlock& f) {
  switch (type) {
    case Q4_0::TYPE: f.d = u16_at(p), nibbles_of(p + 2, f.q); break;
    case Q4_1::TYPE: f.d = u16_at(p), f.m = u16_at(p + 2), nibbles_of(p + 4, f.q); break;
    case Q5_0::TYPE: f.d = u16_at(p), nibbles_of(p + 6, f.q), fifth_bits_of(p + 2, f.q); break;
    case Q5_1::TYPE:
      f.d = u16_at(p), f.m = u16_at(p + 2), nibbles_of(p + 8, f.q), fifth_bits_of(p + 4, f.q);
      break;
    case Q8_0::TYPE: f.d = u16_at(p), std::memcpy(f.q, p + 2, 32); break;
    case Q4_K::TYPE:
    case Q5_K::TYPE: {
      const bool five = type == Q5_K::TYPE;
      f.d = u16_at(p), f.m = u16_at(p + 2);
      const uint8_t* qs = p + (five ? 48 : 16);
      for (int j = 0; j < 8; ++j) {
        scale_min_k4(j, p + 4, f.sc + j, f.mn + j);
        for (int l = 0; l < 32; ++l) {
          const int v = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
          f.q[32 * j + l] = static_cast<uint8_t>(v | (five ? ((p[16 + l] >> j) & 1) << 4 : 0));
        }
      }
      break;
    }
    case Q6_K::TYPE:
      f.d = u16_at(p + 208);
      for (int v = 0; v < 256; ++v) {
        const int h = v / 128, u = v % 128 / 32, l = v % 32;
        const int lo = (p[64 * h + 32 * (u % 2) + l] >> (4 * (u / 2))) & 15;
        const int hi = (p[128 + 32 * h + l] >> (2 * u)) & 3;
        f.q[v] = static_cast<uint8_t>(lo | hi << 4);
      }
      std::memcpy(f.sc, p + 192, 16);
      break;
    default: break;
  }
}

// A group's block from its 8 rows' blocks f, at o (8 file blocks' bytes).
void write_group_block(const Shape& s, const FileBlock* f, uint8_t* o) {
  const int64_t B = s.block;
  uint8_t* v = o;
  std::memset(o, 0, s.value_bytes());
  for (int64_t t = 0; t < B / 8; ++t)
    for (int r = 0; r < 8; ++r)
      for (int i = 0; i < 4; ++i) {
        const uint8_t a = f[r].q[8 * t + i], b = f[r].q[8 * t + 4 + i];
        const int p = 4 * r + i;
        if (s.bits == 8) {
          v[64 * t + p] = a, v[64 * t + 32 + p] = b;
          continue;
        }
        v[32 * t + p] = static_cast<uint8_t>((a & 15) | (b & 15) << 4);
        uint8_t* h = v + 4 * B;
        if (s.bits == 5) {
          h[8 * t + p / 8] |= static_cast<uint8_t>(((a >> 4) & 1) << (p % 8));
          h[8 * t + 4 + p / 8] |= static_cast<uint8_t>(((b >> 4) & 1) << (p % 8));
        } else if (s.bits == 6) {
          h[16 * t + p % 16] |= static_cast<uint8_t>(((a >> 4) | (b >> 4) << 2) << (p >= 16 ? 4 : 0));
        }
      }
  uint8_t* sc = o + s.value_bytes();
  for (int r = 0; r < 8; ++r) std::memcpy(sc + 2 * r, &f[r].d, 2);
  sc += 16;
  if (s.has_m) {
    for (int r = 0; r < 8; ++r) std::memcpy(sc + 2 * r, &f[r].m, 2);
    sc += 16;
  }
  if (s.block == 256 && s.bits != 6) {
    std::memset(sc, 0, 96);
    for (int j = 0; j < 8; ++j)
      for (int r = 0; r < 8; ++r) {
        const int p = 8 * j + r;
        sc[p] = static_cast<uint8_t>(f[r].sc[j] | (f[r].mn[j] & 3) << 6);
        sc[64 + p % 32] |= static_cast<uint8_t>((f[r].mn[j] >> 2) << (p >= 32 ? 4 : 0));
      }
  } else if (s.bits == 6) {
    for (int j = 0; j < 16; ++j)
      for (int r = 0; r < 8; ++r) sc[8 * j + r] = f[r].sc[j];
  }
}

float half_at(const uint8_t* p) { return fp16_at(p); }

// ---- The products. ----

// Octet t of a group's block p (values at p): the 8 rows' values 8t .. 8t + 3 in a and
// 8t + 4 .. 8t + 7 in b, 4 per row (row r in 32-bit lane r), as unsigned bytes, or for the
// signed q8_0 offset by 128 where the byte products take unsigned bytes above 127 (VNNI).
template <int BITS, int64_t BLOCK>
KVSERVE_INLINE void octet(const uint8_t* p, int64_t t, bytes32& a, bytes32& b) {
  if constexpr (BITS == 8) {
    a = load32(p + 64 * t), b = load32(p + 64 * t + 32);
    if constexpr (FULL_BYTE_DOTS) a = offset128(a), b = offset128(b);
    return;
  }
  const bytes32 v = load32(p + 32 * t), low = splat_bytes(0x0F);
  a = and32(v, low), b = and32(shift_right16(v, 4), low);
  if constexpr (BITS == 5) {
    a = add_fifth_bits(a, p + 4 * BLOCK + 8 * t);
    b = add_fifth_bits(b, p + 4 * BLOCK + 8 * t + 4);
  } else if constexpr (BITS == 6) {
    const bytes32 h = nibbles16(p + 4 * BLOCK + 16 * t);
    a = or32(a, shift_left16(and32(h, splat_bytes(3)), 4));
    b = or32(b, shift_left16(and32(h, splat_bytes(12)), 2));
  }
}

// A format's repacked block as the products read it: octets, and for sub-block j the 8 rows'
// scales and mins (the min multiplies the sum of the activations the sub-block meets).
template <int64_t TYPE_, int64_t BLOCK_, int BITS_, int64_t SUB_>
struct Packed {
  static constexpr int64_t TYPE = TYPE_, BLOCK = BLOCK_, SUB = SUB_;
  static constexpr int BITS = BITS_;
  static constexpr bool SIGNED = BITS == 8;
  static constexpr int64_t VALUE_BYTES =
      BITS == 8 ? 8 * BLOCK : 4 * BLOCK + (BITS == 5 ? BLOCK : BITS == 6 ? 2 * BLOCK : 0);

  static void octet_of(const uint8_t* p, int64_t t, bytes32& a, bytes32& b) {
    octet<BITS, BLOCK>(p, t, a, b);
  }

  static void scales(const uint8_t* p, int64_t j, vec8& sc, vec8& mn) {
    const uint8_t* s = p + VALUE_BYTES;
    const vec8 d = load8_f16(s);
    if constexpr (TYPE == Q4_0::TYPE || TYPE == Q5_0::TYPE) {
      sc = d, mn = mul8(d, splat8(TYPE == Q4_0::TYPE ? -8.f : -16.f));
    } else if constexpr (TYPE == Q4_1::TYPE || TYPE == Q5_1::TYPE) {
      sc = d, mn = load8_f16(s + 16);
    } else if constexpr (TYPE == Q8_0::TYPE) {
      sc = d, mn = FULL_BYTE_DOTS ? mul8(d, splat8(-128.f)) : zero8();
    } else if constexpr (TYPE == Q6_K::TYPE) {
      sc = mul8(d, to_float(widen8_s(s + 16 + 8 * j))), mn = mul8(sc, splat8(-32.f));
    } else {  // q4_k, q5_k
      const bytes32 lo = widen8_u(s + 32 + 8 * j);
      const bytes32 hi = and32(shift_right32(widen8_u(s + 96 + 8 * (j % 4)), j >= 4 ? 4 : 0),
                               splat_ints(15));
      sc = mul8(d, to_float(and32(lo, splat_ints(63))));
      mn = mul8(load8_f16(s + 16), to_float(or32(shift_right32(lo, 6), shift_left32(hi, 2))));
      mn = sub8(zero8(), mn);
    }
  }
};

using PQ4_0 = Packed<Q4_0::TYPE, 32, 4, 32>;
using PQ4_1 = Packed<Q4_1::TYPE, 32, 4, 32>;
using PQ5_0 = Packed<Q5_0::TYPE, 32, 5, 32>;
using PQ5_1 = Packed<Q5_1::TYPE, 32, 5, 32>;
using PQ8_0 = Packed<Q8_0::TYPE, 32, 8, 32>;
using PQ4_K = Packed<Q4_K::TYPE, 256, 4, 32>;
using PQ5_K = Packed<Q5_K::TYPE, 256, 5, 32>;
using PQ6_K = Packed<Q6_K::TYPE, 256, 6, 16>;

// acc + the byte products of weights w (a format's octet) and broadcast activation bytes x.
template <class F>
KVSERVE_INLINE bytes32 mac(bytes32 acc, bytes32 w, bytes32 x) {
  if constexpr (F::SIGNED && !FULL_BYTE_DOTS) return add_ints(acc, dot_signed(w, x));
  return dot_acc(acc, w, x);
}

// Activation rows a tile holds, and the groups of 8 weight rows it reads at once for MT rows:
// MT x NG x 3 accumulators (two digits' integer sums, the float sums) fill the registers.
constexpr int MMAX = VECTOR_REGISTERS >= 32 ? 8 : 4;
constexpr int groups_for(int MT) { return std::max(1, MMAX / MT); }

// y[m ldy + 8 g + r] = dot(x row m0 + m, row r of group g) for m < MT, g < NG, over all of K:
// groups NG apart by group_bytes from w.
template <class F, int MT, int NG>
void tile(const uint8_t* w, int64_t group_bytes, const QRows& x, int64_t m0, float* y,
          int64_t ldy) {
  constexpr int64_t OCTETS = F::SUB / 8, SUBS = F::BLOCK / F::SUB;
  const int64_t K = x.K, nu = K / 32, nb = K / F::BLOCK;
  vec8 acc[NG][MT];
  for (int g = 0; g < NG; ++g)
    for (int m = 0; m < MT; ++m) acc[g][m] = zero8();
  const int8_t *xh[MT], *xl[MT];
  for (int m = 0; m < MT; ++m) xh[m] = x.q + (m0 + m) * K, xl[m] = x.ql + (m0 + m) * K;
  const int64_t step = group_bytes / nb;  // a group's block
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk[NG];
    for (int g = 0; g < NG; ++g) {
      blk[g] = w + g * group_bytes + b * step;
      // The next tile's groups requested into L2 in step with these: the hardware prefetchers
      // alone keep up with a few streams, not with NG of them read slowly (one input row).
      prefetch_bytes_l2(blk[g] + NG * group_bytes, step);
    }
#pragma GCC unroll 1
    for (int64_t j = 0; j < SUBS; ++j) {
      bytes32 hi[NG][MT], lo[NG][MT];
      for (int g = 0; g < NG; ++g)
        for (int m = 0; m < MT; ++m) hi[g][m] = lo[g][m] = zero32();
#pragma GCC unroll 4
      for (int64_t o = 0; o < OCTETS; ++o) {
        const int64_t t = j * OCTETS + o, k = b * F::BLOCK + 8 * t;
#pragma GCC unroll 8
        for (int g = 0; g < NG; ++g) {
          bytes32 wa, wb;
          F::octet_of(blk[g], t, wa, wb);
#pragma GCC unroll 8
          for (int m = 0; m < MT; ++m) {
            hi[g][m] = mac<F>(mac<F>(hi[g][m], wa, splat4(reinterpret_cast<const uint8_t*>(xh[m] + k))),
                              wb, splat4(reinterpret_cast<const uint8_t*>(xh[m] + k + 4)));
            lo[g][m] = mac<F>(mac<F>(lo[g][m], wa, splat4(reinterpret_cast<const uint8_t*>(xl[m] + k))),
                              wb, splat4(reinterpret_cast<const uint8_t*>(xl[m] + k + 4)));
          }
        }
      }
      const int64_t k0 = b * F::BLOCK + j * F::SUB;
#pragma GCC unroll 8
      for (int g = 0; g < NG; ++g) {
        vec8 sc, mn;
        F::scales(blk[g], j, sc, mn);
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          const int64_t row = m0 + m;
          const float dx = x.d[row * nu + k0 / 32];
          const float xs = F::SUB == 16 ? x.s16[row * 2 * nu + k0 / 16] : x.s32[row * nu + k0 / 32];
          const bytes32 sum = add_ints(times_base(hi[g][m]), lo[g][m]);
          acc[g][m] = fma8(to_float(sum), mul8(sc, splat8(dx)), acc[g][m]);
          acc[g][m] = fma8(mn, splat8(xs), acc[g][m]);
        }
      }
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int m = 0; m < MT; ++m) store8(y + m * ldy + 8 * g, acc[g][m]);
}

// Input rows a tile's weights are read against while they stay in L1 and L2: more rows are
// taken in blocks of this many, each block meeting every group of the chunk.
constexpr int64_t ROW_BLOCK = 64;

template <class F, int MT>
void groups_of(const uint8_t* w, int64_t group_bytes, int64_t g0, int64_t g1, const QRows& x,
               int64_t m0, float* y, int64_t ldy) {
  constexpr int NG = groups_for(MT);
  int64_t g = g0;
  for (; g + NG <= g1; g += NG) tile<F, MT, NG>(w + g * group_bytes, group_bytes, x, m0, y + 8 * g, ldy);
  for (; g < g1; ++g) tile<F, MT, 1>(w + g * group_bytes, group_bytes, x, m0, y + 8 * g, ldy);
}

template <class F>
void packed_of(const QuantPart& p, const QRows& x, int64_t M, int64_t r0, int64_t r1, float* y,
               int64_t ldy) {
  using Fn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const QRows&, int64_t, float*,
                      int64_t);
  static constexpr Fn by_rows[8] = {groups_of<F, 1>, groups_of<F, 2>, groups_of<F, 3>,
                                    groups_of<F, 4>, groups_of<F, 5>, groups_of<F, 6>,
                                    groups_of<F, 7>, groups_of<F, 8>};
  const int64_t group_bytes = PACK_ROWS * p.row_bytes, g0 = r0 / 8, g1 = r1 / 8;
  for (int64_t mb = 0; mb < M; mb += ROW_BLOCK) {
    const int64_t me = std::min(M, mb + ROW_BLOCK);
    // Within a row block, the groups go in runs that stay in L1 across its panels of rows.
    constexpr int64_t RUN = 4;
    for (int64_t g = g0; g < g1; g += RUN) {
      const int64_t ge = std::min(g1, g + RUN);
      for (int64_t m0 = mb; m0 < me; m0 += MMAX) {
        const int64_t mt = std::min<int64_t>(MMAX, me - m0);
        by_rows[mt - 1](p.w, group_bytes, g, ge, x, m0, y + m0 * ldy, ldy);
      }
    }
  }
}

}  // namespace

void repack(int64_t type, const uint8_t* src, int64_t rows, int64_t row_bytes, uint8_t* dst) {
  const Shape s = shape_of(type);
  const int64_t bytes = block_bytes(type), nb = row_bytes / bytes;
  FileBlock f[PACK_ROWS];
  for (int64_t g = 0; g < rows / PACK_ROWS; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t r = 0; r < PACK_ROWS; ++r) {
        f[r] = FileBlock{};
        decode(type, src + (g * PACK_ROWS + r) * row_bytes + b * bytes, f[r]);
      }
      write_group_block(s, f, dst + g * PACK_ROWS * row_bytes + b * PACK_ROWS * bytes);
    }
}

void dequantize_packed(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t r, float* out) {
  const Shape s = shape_of(type);
  const int64_t bytes = PACK_ROWS * block_bytes(type), nb = row_bytes / block_bytes(type);
  const int64_t rr = r % PACK_ROWS;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = w + r / PACK_ROWS * PACK_ROWS * row_bytes + b * bytes;
    const uint8_t* v = p;
    const uint8_t* sc = p + s.value_bytes();
    const float d = half_at(sc + 2 * rr), m = s.has_m ? half_at(sc + 16 + 2 * rr) : 0.f;
    for (int64_t k = 0; k < s.block; ++k) {
      const int64_t t = k / 8, i = k % 8 % 4, pos = 4 * rr + i;
      const bool second = k % 8 >= 4;
      int q;
      if (s.bits == 8) {
        q = static_cast<int8_t>(v[64 * t + 32 * second + pos]);
      } else {
        q = (v[32 * t + pos] >> (4 * second)) & 15;
        const uint8_t* h = v + 4 * s.block;
        if (s.bits == 5) q |= ((h[8 * t + 4 * second + pos / 8] >> (pos % 8)) & 1) << 4;
        if (s.bits == 6)
          q |= ((h[16 * t + pos % 16] >> (pos >= 16 ? 4 : 0) >> (2 * second)) & 3) << 4;
      }
      float x;
      const int64_t j = k / s.sub;
      switch (type) {
        case Q4_0::TYPE: x = d * static_cast<float>(q - 8); break;
        case Q5_0::TYPE: x = d * static_cast<float>(q - 16); break;
        case Q4_1::TYPE:
        case Q5_1::TYPE:
        case Q8_0::TYPE: x = d * static_cast<float>(q) + m; break;
        case Q6_K::TYPE:
          x = d * static_cast<float>(static_cast<int8_t>(sc[16 + 8 * j + rr])) *
              static_cast<float>(q - 32);
          break;
        default: {  // q4_k, q5_k
          const uint8_t lo = sc[32 + 8 * j + rr], pos6 = static_cast<uint8_t>(8 * j + rr);
          const int mn = lo >> 6 | ((sc[32 + 64 + pos6 % 32] >> (pos6 >= 32 ? 4 : 0)) & 15) << 2;
          x = d * static_cast<float>(lo & 63) * static_cast<float>(q) - m * static_cast<float>(mn);
        }
      }
      out[b * s.block + k] = x;
    }
  }
}

void packed_products(const QuantPart& p, const QRows& xq, int64_t M, int64_t r0, int64_t r1,
                     float* y, int64_t ldy) {
  switch (p.type) {
    case Q4_0::TYPE: packed_of<PQ4_0>(p, xq, M, r0, r1, y, ldy); break;
    case Q4_1::TYPE: packed_of<PQ4_1>(p, xq, M, r0, r1, y, ldy); break;
    case Q5_0::TYPE: packed_of<PQ5_0>(p, xq, M, r0, r1, y, ldy); break;
    case Q5_1::TYPE: packed_of<PQ5_1>(p, xq, M, r0, r1, y, ldy); break;
    case Q8_0::TYPE: packed_of<PQ8_0>(p, xq, M, r0, r1, y, ldy); break;
    case Q4_K::TYPE: packed_of<PQ4_K>(p, xq, M, r0, r1, y, ldy); break;
    case Q5_K::TYPE: packed_of<PQ5_K>(p, xq, M, r0, r1, y, ldy); break;
    case Q6_K::TYPE: packed_of<PQ6_K>(p, xq, M, r0, r1, y, ldy); break;
    default: break;
  }
}

}  // namespace kvserve
