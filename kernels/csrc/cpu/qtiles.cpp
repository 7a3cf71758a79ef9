// Products of block-format weights with many activation rows (prefill chunks): weight rows
// unpacked UNPACK_ROWS at a time into bytes and per-SUB scales, then tiles of R weight rows by
// V panels of 8 activation rows, whose byte sums stay in registers over each SUB values: each
// weight value is a broadcast against V vectors, each activation vector meets R rows.
#include <algorithm>
#include <cstring>

#include "qformats.h"
#include "qlinear.h"

namespace kvserve {
namespace {

constexpr int64_t UNPACK_ROWS = 24;
// 2 x R x V sums (bytes and floats) in registers, plus V activations and a broadcast.
constexpr int R = VECTOR_REGISTERS >= 32 ? 4 : 2, V = 2;

// Rows [r0, r0 + n) of the part unpacked (rows up to end prefetched): values q [n][K], scales sc and mins mn [n][K / SUB].
template <class F>
void unpack(const QuantPart& p, int64_t K, int64_t r0, int64_t n, int64_t end, uint8_t* q,
            float* sc, float* mn) {
  // The rows `ahead` on, up to the chunk's end, requested into L2 (as weight_rows does).
  const int64_t ahead = std::max<int64_t>(1, PREFETCH_BYTES / p.row_bytes);
  const int64_t nb = K / F::BLOCK, subs = K / F::SUB, per = F::BLOCK / F::SUB;
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* w = p.w + (r0 + r) * p.row_bytes;
    if (r + ahead < end - r0) prefetch_bytes_l2(w + ahead * p.row_bytes, p.row_bytes);
    for (int64_t b = 0; b < nb; ++b) {
      const F blk(w + b * F::BYTES);
      for (int j = 0; j < F::UNITS; ++j)
        store32(q + r * K + (b * F::UNITS + j) * 32, F::SIGNED ? offset128(blk.q(j)) : blk.q(j));
      blk.sub_scales(sc + r * subs + b * per, mn + r * subs + b * per);
    }
  }
}

// sums[r][v] + the byte products of weight rows wr[r] and panel digits x[v] over the S
// values from k0.
template <int VT>
KVSERVE_INLINE void sub_sums(const uint8_t* const* wr, const int8_t* const* x, int64_t k0,
                             int64_t S, bytes32 (&sums)[R][VT]) {
#pragma GCC unroll 8
  for (int64_t k = k0; k < k0 + S; k += 4) {
    bytes32 xv[VT];
    for (int v = 0; v < VT; ++v) xv[v] = load32(x[v] + k * 8);
    for (int r = 0; r < R; ++r) {
      const bytes32 w = splat4(wr[r] + k);
      for (int v = 0; v < VT; ++v) sums[r][v] = dot_acc(sums[r][v], w, xv[v]);
    }
  }
}

// y[i ldy + r] = dot(x row 8 g + i, w row r) for r < nr and i < mr, the panels g .. g + VT - 1
// against the unpacked rows (q, sc, mn as unpack leaves them).
template <class F, int VT>
void tile(const uint8_t* q, const float* sc, const float* mn, const QPanels& xp, int64_t g,
          int64_t nr, int64_t mr, float* y, int64_t ldy) {
  constexpr int64_t S = F::SUB;
  const int64_t K = xp.K, subs = K / S;
  vec8 acc[R][VT];
  const uint8_t* wr[R];
  const int8_t *xq[VT], *xl[VT];
  const float *xd[VT], *xs[VT];
  for (int r = 0; r < R; ++r) {
    wr[r] = q + (r < nr ? r : 0) * K;
    for (int v = 0; v < VT; ++v) acc[r][v] = zero8();
  }
  for (int v = 0; v < VT; ++v) {
    xq[v] = xp.q + (g + v) * 8 * K;
    xl[v] = xp.ql + (g + v) * 8 * K;
    xd[v] = xp.d + (g + v) * 8 * (K / 32);
    xs[v] = S == 16 ? xp.s16 + (g + v) * 8 * (K / 16) : xp.s32 + (g + v) * 8 * (K / 32);
  }
  for (int64_t s = 0; s < subs; ++s) {
    bytes32 sums[R][VT];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < VT; ++v) sums[r][v] = zero32();
    // The high digit's sums, times DIGIT_BASE, then the low digit's added (two_digit_dot).
    sub_sums<VT>(wr, xq, s * S, S, sums);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < VT; ++v) sums[r][v] = times_base(sums[r][v]);
    sub_sums<VT>(wr, xl, s * S, S, sums);
    for (int v = 0; v < VT; ++v) {
      const vec8 dx = load8(xd[v] + s * S / 32 * 8);
      const vec8 xsum = load8(xs[v] + s * 8);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r < nr ? r : 0) * subs + s;
        acc[r][v] = fma8(to_float(sums[r][v]), mul8(splat8(sc[i]), dx), acc[r][v]);
        acc[r][v] = fma8(splat8(mn[i]), xsum, acc[r][v]);
      }
    }
  }
  alignas(32) float out[8];
  for (int v = 0; v < VT; ++v)
    for (int r = 0; r < nr; ++r) {
      store8_aligned(out, acc[r][v]);
      for (int i = 0; i < 8 && 8 * v + i < mr; ++i) y[(8 * v + i) * ldy + r] = out[i];
    }
}

template <class F>
void tiles_of(const QuantPart& p, const QPanels& xp, int64_t M, int64_t r0, int64_t r1,
              float* y, int64_t ldy, uint8_t* scratch) {
  const int64_t K = xp.K, subs = K / F::SUB;
  uint8_t* q = scratch;
  float* sc = reinterpret_cast<float*>(scratch + UNPACK_ROWS * K);
  float* mn = sc + UNPACK_ROWS * subs;
  for (int64_t c0 = r0; c0 < r1; c0 += UNPACK_ROWS) {
    const int64_t n = std::min(UNPACK_ROWS, r1 - c0);
    unpack<F>(p, K, c0, n, r1, q, sc, mn);
    for (int64_t g = 0; g < xp.panels; g += V) {
      const int64_t mr = std::min<int64_t>(8 * V, M - 8 * g);
      for (int64_t r = 0; r < n; r += R) {
        float* yt = y + 8 * g * ldy + c0 + r;
        const int64_t nr = std::min<int64_t>(R, n - r);
        if (xp.panels - g >= V) tile<F, V>(q + r * K, sc + r * subs, mn + r * subs, xp, g, nr, mr, yt, ldy);
        else tile<F, 1>(q + r * K, sc + r * subs, mn + r * subs, xp, g, nr, mr, yt, ldy);
      }
    }
  }
}

}  // namespace

int64_t unpack_bytes(int64_t K) { return UNPACK_ROWS * (K + K / 16 * 8); }

bool tiles_read(int64_t type) { return type != Q8_0::TYPE || FULL_BYTE_DOTS; }

int64_t few_rows(int64_t type) { return block_values(type) == 256 ? 5 : QFEW; }

void pack_panels(const QRows& xq, int64_t M, const QPanels& xp) {
  const int64_t K = xq.K, nu = K / 32;
  for (int64_t g = 0; g < xp.panels; ++g)
    for (int64_t i = 0; i < 8; ++i) {
      const int64_t row = 8 * g + i;
      int8_t* q = xp.q + g * 8 * K + 4 * i;
      int8_t* ql = xp.ql + g * 8 * K + 4 * i;
      // 4 values at a time, as 32-bit words.
      for (int64_t k = 0; k < K; k += 4) {
        int32_t hi = 0, lo = 0;
        if (row < M) std::memcpy(&hi, xq.q + row * K + k, 4), std::memcpy(&lo, xq.ql + row * K + k, 4);
        std::memcpy(q + k * 8, &hi, 4);
        std::memcpy(ql + k * 8, &lo, 4);
      }
      for (int64_t u = 0; u < nu; ++u) {
        xp.d[(g * nu + u) * 8 + i] = row < M ? xq.d[row * nu + u] : 0.f;
        xp.s32[(g * nu + u) * 8 + i] = row < M ? xq.s32[row * nu + u] : 0.f;
      }
      for (int64_t h = 0; h < 2 * nu; ++h)
        xp.s16[(g * 2 * nu + h) * 8 + i] = row < M ? xq.s16[row * 2 * nu + h] : 0.f;
    }
}

void quant_tiles(const QuantPart& p, const QPanels& xp, int64_t M, int64_t r0, int64_t r1,
                 float* y, int64_t ldy, uint8_t* scratch) {
  switch (p.type) {
    case Q4_0::TYPE: tiles_of<Q4_0>(p, xp, M, r0, r1, y, ldy, scratch); break;
    case Q4_1::TYPE: tiles_of<Q4_1>(p, xp, M, r0, r1, y, ldy, scratch); break;
    case Q5_0::TYPE: tiles_of<Q5_0>(p, xp, M, r0, r1, y, ldy, scratch); break;
    case Q5_1::TYPE: tiles_of<Q5_1>(p, xp, M, r0, r1, y, ldy, scratch); break;
    case Q8_0::TYPE: tiles_of<Q8_0>(p, xp, M, r0, r1, y, ldy, scratch); break;
    case Q4_K::TYPE: tiles_of<Q4_K>(p, xp, M, r0, r1, y, ldy, scratch); break;
    case Q5_K::TYPE: tiles_of<Q5_K>(p, xp, M, r0, r1, y, ldy, scratch); break;
    case Q6_K::TYPE: tiles_of<Q6_K>(p, xp, M, r0, r1, y, ldy, scratch); break;
    default: break;
  }
}

}  // namespace kvserve
