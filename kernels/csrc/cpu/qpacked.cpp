// The products of repacked block-format weights (qpacked.h; the repacking is qrepack.cpp's).
#include "qpacked.h"

#include <algorithm>

#include "qformats.h"

namespace kvserve {
namespace {

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

// acc + the byte products of weights w (a format's octet) and the 4 activation bytes at p,
// broadcast.
template <class F>
KVSERVE_INLINE bytes32 mac(bytes32 acc, bytes32 w, const int8_t* p) {
  if constexpr (F::SIGNED && !FULL_BYTE_DOTS) return add_ints(acc, dot_signed(w, splat4(p)));
  return dot_acc_splat(acc, w, p);
}

// Without VNNI, the octets whose byte products may sum in int16 lanes before they widen: a lane
// takes 4 products of an octet (two VPMADDUBSW pairs), each at most 127 times the format's
// largest value; 0 for signed q8_0, whose products widen one at a time (dot_signed).
template <class F>
constexpr int64_t int16_octets() {
  if constexpr (F::SIGNED || FULL_BYTE_DOTS) return 0;
  const int64_t largest = (1 << F::BITS) - 1;
  return std::min<int64_t>(F::SUB / 8, 32767 / (4 * 127 * largest));
}

// Activation rows a tile holds, and the groups of 8 weight rows it reads at once for MT rows:
// MT x NG x 3 accumulators (two digits' integer sums, the float sums) fill the registers.
constexpr int MMAX = VECTOR_REGISTERS >= 32 ? 8 : 4;
constexpr int groups_for(int MT) { return std::max(1, MMAX / MT); }

// hi[g][m], lo[g][m]: the two activation digits' integer sums against sub-block j of the
// groups' blocks blk (block b of the row), for the MT rows of panel digits xh, xl.
template <class F, int MT, int NG>
KVSERVE_INLINE void sub_sums(const uint8_t* const* blk, int64_t b, int64_t j, const int8_t* xh,
                             const int8_t* xl, bytes32 (&hi)[NG][MT], bytes32 (&lo)[NG][MT]) {
  constexpr int64_t OCTETS = F::SUB / 8, RUN = int16_octets<F>();
  bytes32 h16[NG][MT], l16[NG][MT];  // without VNNI, sums in int16 over RUN octets
  for (int g = 0; g < NG; ++g)
    for (int m = 0; m < MT; ++m) hi[g][m] = lo[g][m] = h16[g][m] = l16[g][m] = zero32();
#pragma GCC unroll 4
  for (int64_t o = 0; o < OCTETS; ++o) {
    const int64_t t = j * OCTETS + o, k = b * F::BLOCK + 8 * t;
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) {
      bytes32 wa, wb;
      F::octet_of(blk[g], t, wa, wb);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const int64_t a = 8 * k + 4 * m, b4 = a + 32;  // values k .. k + 3, k + 4 .. k + 7
        if constexpr (RUN > 0) {
          h16[g][m] = add16(h16[g][m], add16(pair_products(wa, splat4(xh + a)),
                                             pair_products(wb, splat4(xh + b4))));
          l16[g][m] = add16(l16[g][m], add16(pair_products(wa, splat4(xl + a)),
                                             pair_products(wb, splat4(xl + b4))));
        } else {
          hi[g][m] = mac<F>(mac<F>(hi[g][m], wa, xh + a), wb, xh + b4);
          lo[g][m] = mac<F>(mac<F>(lo[g][m], wa, xl + a), wb, xl + b4);
        }
      }
    }
    if constexpr (RUN > 0) {
      if ((o + 1) % RUN == 0)
        for (int g = 0; g < NG; ++g)
          for (int m = 0; m < MT; ++m) {
            hi[g][m] = add_ints(hi[g][m], widen_pairs(h16[g][m]));
            lo[g][m] = add_ints(lo[g][m], widen_pairs(l16[g][m]));
            h16[g][m] = l16[g][m] = zero32();
          }
    }
  }
}

// y[m ldy + 8 g + r] = dot(x row m0 + m, row r of group g) for m < MT, g < NG, over all of K:
// groups NG apart by group_bytes from w; the MT rows in one panel of x (qlinear.h: 4 values of
// each of its 8 rows side by side, so every activation the tile reads is at a constant offset
// from one pointer).
template <class F, int MT, int NG>
void tile(const uint8_t* w, int64_t group_bytes, const QPanels& x, int64_t m0, float* y,
          int64_t ldy) {
  const int64_t K = x.K, nu = K / 32, nb = K / F::BLOCK, panel = m0 / 8, i0 = m0 % 8;
  vec8 acc[NG][MT];
  for (int g = 0; g < NG; ++g)
    for (int m = 0; m < MT; ++m) acc[g][m] = zero8();
  const int8_t* xh = x.q + panel * 8 * K + 4 * i0;
  const int8_t* xl = x.ql + panel * 8 * K + 4 * i0;
  const float* xd = x.d + panel * 8 * nu + i0;
  const float* xs = (F::SUB == 16 ? x.s16 + panel * 8 * (K / 16) : x.s32 + panel * 8 * nu) + i0;
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
    for (int64_t j = 0; j < F::BLOCK / F::SUB; ++j) {
      bytes32 hi[NG][MT], lo[NG][MT];
      sub_sums<F, MT, NG>(blk, b, j, xh, xl, hi, lo);
      const int64_t k0 = b * F::BLOCK + j * F::SUB;
#pragma GCC unroll 8
      for (int g = 0; g < NG; ++g) {
        vec8 sc, mn;
        F::scales(blk[g], j, sc, mn);
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          const float dx = xd[k0 / 32 * 8 + m], sum_x = xs[k0 / F::SUB * 8 + m];
          const bytes32 sum = add_ints(times_base(hi[g][m]), lo[g][m]);
          acc[g][m] = fma8(to_float(sum), mul8(sc, splat8(dx)), acc[g][m]);
          acc[g][m] = fma8(mn, splat8(sum_x), acc[g][m]);
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
void groups_of(const uint8_t* w, int64_t group_bytes, int64_t g0, int64_t g1, const QPanels& x,
               int64_t m0, float* y, int64_t ldy) {
  constexpr int NG = groups_for(MT);
  int64_t g = g0;
  for (; g + NG <= g1; g += NG) tile<F, MT, NG>(w + g * group_bytes, group_bytes, x, m0, y + 8 * g, ldy);
  for (; g < g1; ++g) tile<F, MT, 1>(w + g * group_bytes, group_bytes, x, m0, y + 8 * g, ldy);
}

template <class F>
void packed_of(const QuantPart& p, const QPanels& x, int64_t M, int64_t r0, int64_t r1, float* y,
               int64_t ldy) {
  using Fn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const QPanels&, int64_t, float*,
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

int64_t packed_tile_rows(int64_t M) {
  return PACK_ROWS * groups_for(static_cast<int>(std::min<int64_t>(M, MMAX)));
}

void packed_products(const QuantPart& p, const QPanels& xq, int64_t M, int64_t r0, int64_t r1,
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
