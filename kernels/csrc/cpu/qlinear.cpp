#include "qlinear.h"

#include <algorithm>

#include "qformats.h"

namespace kvserve {
namespace {

// Independent sums per row, so that few rows still have about four chains of dependent
// additions in flight (each addition waits for the last one of its chain).
constexpr int chains(int M) { return M == 1 ? 4 : M == 2 ? 2 : 1; }

// The M rows' sums from m0 against one weight row, C chains of them: block b goes to chain
// b % C (the 32-value formats), the unit pair p of a block to chain p % C (the K formats).
template <class F, int M, int C = chains(M)>
struct RowSums {
  const QRows& x;
  int64_t m0, nu;
  vec8 acc[C][M], macc[C][M];
  float facc[C][M];

  RowSums(const QRows& x_, int64_t m0_) : x(x_), m0(m0_), nu(x_.K / 32) {
    for (int c = 0; c < C; ++c)
      for (int m = 0; m < M; ++m) acc[c][m] = macc[c][m] = zero8(), facc[c][m] = 0.f;
  }

  // The loops over units and rows unroll, so that a unit's bytes and the sums stay in
  // registers.
  void add(const uint8_t* p, int64_t b, int c) {
    const F blk(p);
    const int64_t u0 = b * F::UNITS;
    if constexpr (F::UNITS == 1) {
      const bytes32 q = blk.q(0);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const int64_t u = (m0 + m) * nu + u0;
        const bytes32 dots = two_digit_dot<F::SIGNED>(q, load32(x.q + u * 32), load32(x.ql + u * 32));
        acc[c][m] = fma8(to_float(dots), blk.scale_times(0, x.d[u]), acc[c][m]);
        if constexpr (F::HAS_MIN) facc[c][m] += blk.min() * x.s32[u];
      }
    } else {
      // Units in pairs: an activation group of KGROUP values has one scale. The digits' sums
      // go to floats apart, as the sub-scales could take the high one's past 32 bits.
#pragma GCC unroll 4
      for (int pair = 0; pair < F::UNITS / 2; ++pair) {
        const int j = 2 * pair, c = pair % C;
        const bytes32 q0 = blk.q(j), q1 = blk.q(j + 1);
        const bytes32 sc0 = blk.scale16(j), sc1 = blk.scale16(j + 1);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const int64_t u = (m0 + m) * nu + u0 + j;
          const bytes32 hi = dot_scaled(dot_scaled(zero32(), q0, load32(x.q + u * 32), sc0), q1,
                                        load32(x.q + (u + 1) * 32), sc1);
          const bytes32 lo = dot_scaled(dot_scaled(zero32(), q0, load32(x.ql + u * 32), sc0), q1,
                                        load32(x.ql + (u + 1) * 32), sc1);
          const vec8 sum = fma8(to_float(hi), splat8(DIGIT_BASE), to_float(lo));
          acc[c][m] = fma8(sum, splat8(blk.d * x.d[u]), acc[c][m]);
        }
      }
      for (int m = 0; m < M; ++m) {
        const int64_t u = (m0 + m) * nu + u0;
        macc[c0(b)][m] = blk.mins(x.s32 + u, x.s16 + 2 * u, macc[c0(b)][m]);
      }
    }
  }

  static int c0(int64_t b) { return static_cast<int>(b % C); }

  void store(float* y, int64_t ldy) const {
    for (int m = 0; m < M; ++m) {
      vec8 v = add8(acc[0][m], macc[0][m]);
      float f = facc[0][m];
      for (int c = 1; c < C; ++c) v = add8(v, add8(acc[c][m], macc[c][m])), f += facc[c][m];
      y[m * ldy] = hsum(v) + f;
    }
  }
};

// y[m ldy] = dot(x[m0 + m], w) for the M rows from m0 and the weight row w of nb blocks.
template <class F, int M>
inline void one_weight_row(const uint8_t* w, int64_t nb, const QRows& x, int64_t m0, float* y,
                           int64_t ldy) {
  constexpr int C = F::UNITS == 1 ? chains(M) : 1;  // the K formats' chains are within blocks
  RowSums<F, M> sums(x, m0);
  int64_t b = 0;
  for (; b + C <= nb; b += C)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) sums.add(w + (b + c) * F::BYTES, b + c, c);
  for (; b < nb; ++b) sums.add(w + b * F::BYTES, b, 0);
  sums.store(y, ldy);
}

template <class F, int M>
void weight_rows(const QuantPart& p, const QRows& x, int64_t m0, int64_t r0, int64_t r1,
                 float* y, int64_t ldy) {
  const int64_t nb = p.row_bytes / F::BYTES;
  const int64_t ahead = std::max<int64_t>(1, PREFETCH_BYTES / p.row_bytes);
  for (int64_t n = r0; n < r1; ++n) {
    if (n + ahead < r1) prefetch_bytes_l2(p.w + (n + ahead) * p.row_bytes, p.row_bytes);
    one_weight_row<F, M>(p.w + n * p.row_bytes, nb, x, m0, y + m0 * ldy + n, ldy);
  }
}

// Rows in groups of up to 8; for more than 8 the chunk's weight rows are read once per group,
// from L2 after the first.
template <class F>
void rows_of(const QuantPart& p, const QRows& x, int64_t M, int64_t r0, int64_t r1, float* y,
             int64_t ldy) {
  using Fn = void (*)(const QuantPart&, const QRows&, int64_t, int64_t, int64_t, float*, int64_t);
  static constexpr Fn by_rows[8] = {weight_rows<F, 1>, weight_rows<F, 2>, weight_rows<F, 3>,
                                    weight_rows<F, 4>, weight_rows<F, 5>, weight_rows<F, 6>,
                                    weight_rows<F, 7>, weight_rows<F, 8>};
  for (int64_t m0 = 0; m0 < M; m0 += 8)
    by_rows[std::min<int64_t>(8, M - m0) - 1](p, x, m0, r0, r1, y, ldy);
}

template <class... Fs>
struct Formats {
  static bool known(int64_t type) { return ((type == Fs::TYPE) || ...); }
  static int64_t values(int64_t type) { return ((type == Fs::TYPE ? Fs::BLOCK : 0) + ...); }
  static int64_t bytes(int64_t type) { return ((type == Fs::TYPE ? Fs::BYTES : 0) + ...); }
  static void rows(const QuantPart& p, const QRows& x, int64_t M, int64_t r0, int64_t r1,
                   float* y, int64_t ldy) {
    ((p.type == Fs::TYPE ? rows_of<Fs>(p, x, M, r0, r1, y, ldy) : void()), ...);
  }
};

using All = Formats<Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K>;

}  // namespace

bool known_format(int64_t type) { return All::known(type); }
int64_t block_values(int64_t type) { return All::values(type); }
int64_t block_bytes(int64_t type) { return All::bytes(type); }

void quantize_rows(const float* x, int64_t M, int64_t group, const QRows& xq) {
  const int64_t K = xq.K, nu = K / 32;
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x + m * K, K, group, xq.q + m * K, xq.ql + m * K, xq.d + m * nu,
                 xq.s32 + m * nu, xq.s16 + 2 * m * nu);
}

void quant_rows(const QuantPart& p, const QRows& xq, int64_t M, int64_t r0, int64_t r1, float* y,
                int64_t ldy) {
  All::rows(p, xq, M, r0, r1, y, ldy);
}

}  // namespace kvserve
