#include "linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <type_traits>

#include "qpacked.h"
#include "vec.h"

namespace kvserve {
namespace {

// Eight weights, or one, of a dense part as floats.
KVSERVE_INLINE vec8 load8w(const float* p) { return load8(p); }
KVSERVE_INLINE vec8 load8w(const F16* p) { return load8_f16(p); }
KVSERVE_INLINE vec8 load8w(const BF16* p) { return load8_bf16(p); }
KVSERVE_INLINE float value(float v) { return v; }
KVSERVE_INLINE float value(F16 v) { return f16_to_float(v.bits); }
KVSERVE_INLINE float value(BF16 v) { return bf16_to_float(v.bits); }

// Few rows (decode): weight rows in threes. Each three goes against MA input rows and then,
// from L1, against the next MB (MB = 0: none); K goes in blocks of KB floats, so that the three
// rows' block stays in L1 between the two passes. Meanwhile the three rows after the next are
// requested into L2: with eight input rows the loop computes long enough per weight line that
// the hardware prefetcher alone falls behind. One row goes alone (one_row).
template <int MA, int MB, class W>
inline void by_threes(const float* x, int64_t K, const W* w, int nw, float* y, int64_t ldy,
                      const W* ahead, int64_t ahead_n) {
  constexpr int64_t KB = 256;
  constexpr int H = MB > 0 ? 2 : 1;
  vec8 keep[H][MA][3];
  for (int h = 0; h < H; ++h)
    for (int m = 0; m < MA; ++m)
      for (int r = 0; r < 3; ++r) keep[h][m][r] = zero8();
  const W* wr[3];
  for (int r = 0; r < 3; ++r) wr[r] = w + (r < nw ? r : 0) * K;
  const int64_t kt = K / 8 * 8;
  for (int64_t k0 = 0; k0 < kt; k0 += KB) {
    const int64_t k1 = std::min(kt, k0 + KB);
    for (int h = 0; h < H; ++h) {
      const int rows = h == 0 ? MA : MB;
      const float* xh = x + h * MA * K;
      vec8 acc[MA][3];
      for (int m = 0; m < MA; ++m)
        for (int r = 0; r < 3; ++r) acc[m][r] = keep[h][m][r];
      for (int64_t k = k0; k < k1; k += 8) {
        // Three rows ahead advance 24 weights per step (96 bytes of float32, 48 of 16-bit
        // ones): two lines per step, in one pass or split between the two.
        if (3 * k < ahead_n) {
          const char* a = reinterpret_cast<const char*>(ahead + 3 * k);
          prefetch_l2(a + 64 * h);
          if (H == 1) prefetch_l2(a + 64);
        }
        const vec8 w0 = load8w(wr[0] + k), w1 = load8w(wr[1] + k), w2 = load8w(wr[2] + k);
        for (int m = 0; m < MA && m < rows; ++m) {
          const vec8 xv = load8(xh + m * K + k);
          acc[m][0] = fma8(xv, w0, acc[m][0]);
          acc[m][1] = fma8(xv, w1, acc[m][1]);
          acc[m][2] = fma8(xv, w2, acc[m][2]);
        }
      }
      for (int m = 0; m < MA; ++m)
        for (int r = 0; r < 3; ++r) keep[h][m][r] = acc[m][r];
    }
  }
  for (int h = 0; h < H; ++h)
    for (int m = 0; m < (h == 0 ? MA : MB); ++m)
      for (int r = 0; r < nw; ++r) {
        float s = hsum(keep[h][m][r]);
        for (int64_t kk = kt; kk < K; ++kk) s += x[(h * MA + m) * K + kk] * value(wr[r][kk]);
        y[(h * MA + m) * ldy + r] = s;
      }
}

// One row: y = dot(x, w) with eight independent accumulators, enough loads in flight for the
// hardware prefetcher to stream the weight row at the memory bandwidth. With one input row
// there is too little arithmetic per weight line for threes to pay, and the function stays out
// of line because GCC schedules its loop worse when it is inlined into few_rows.
template <class W>
__attribute__((noinline)) float one_row(const float* x, int64_t K, const W* w) {
  vec8 acc[8];
  for (int u = 0; u < 8; ++u) acc[u] = zero8();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64)
    for (int u = 0; u < 8; ++u) acc[u] = fma8(load8(x + k + 8 * u), load8w(w + k + 8 * u), acc[u]);
  for (; k + 8 <= K; k += 8) acc[0] = fma8(load8(x + k), load8w(w + k), acc[0]);
  for (int u = 1; u < 8; ++u) acc[0] = add8(acc[0], acc[u]);
  float s = hsum(acc[0]);
  for (; k < K; ++k) s += x[k] * value(w[k]);
  return s;
}

// Output features [n0, n1) of y [MA + MB, ldy] = x w^T, w having N rows.
template <int MA, int MB, class W>
void few_rows_of(const float* x, int64_t K, const W* w, int64_t n0, int64_t n1, float* y,
                 int64_t N, int64_t ldy) {
  for (int64_t n = n0; n < n1; n += 3) {
    const int64_t a0 = std::min(N, n + 6), a1 = std::min(N, a0 + 3);
    by_threes<MA, MB>(x, K, w + n * K, static_cast<int>(std::min<int64_t>(3, n1 - n)), y + n,
                      ldy, w + a0 * K, (a1 - a0) * K);
  }
}

template <class W>
void few_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t n0, int64_t n1,
              float* y, int64_t N, int64_t ldy) {
  switch (M) {
    case 1:
      for (int64_t n = n0; n < n1; ++n) y[n] = one_row(x, K, w + n * K);
      break;
    case 2: few_rows_of<2, 0, W>(x, K, w, n0, n1, y, N, ldy); break;
    case 3: few_rows_of<3, 0, W>(x, K, w, n0, n1, y, N, ldy); break;
    case 4: few_rows_of<4, 0, W>(x, K, w, n0, n1, y, N, ldy); break;
    case 5: few_rows_of<3, 2, W>(x, K, w, n0, n1, y, N, ldy); break;
    case 6: few_rows_of<3, 3, W>(x, K, w, n0, n1, y, N, ldy); break;
    case 7: few_rows_of<4, 3, W>(x, K, w, n0, n1, y, N, ldy); break;
    case 8: few_rows_of<4, 4, W>(x, K, w, n0, n1, y, N, ldy); break;
  }
}

// Many rows (prefill chunks, decode batches above FEW): the input rows are packed once per
// matrix into panels of 8 rows, k-major, and a tile of TR weight rows x TV panels keeps its
// TR x TV sums in registers over all of K: each broadcast weight feeds TV FMAs and each loaded
// input vector TR, and the sums leave through a transpose, with no horizontal adds, which keeps
// the tile close to the core's FMA peak when its data is in L1. The next tile's weight rows
// are requested into L2 a slice per panel group.
constexpr int TR = TILE_ROWS, TV = 2;

// y[m][r] = dot(x[m], w[r]) for r < nr (nr <= R) and the first mr rows of V panels of xt;
// w's rows K apart, y's ldy. The loops are unrolled by pragma so that every index of acc is a
// constant: GCC then keeps the R x V sums in registers all through K.
template <int R, int V>
inline void panel_tile(const float* xt, int64_t K, const float* w, int64_t nr, int64_t mr,
                       float* y, int64_t ldy) {
  vec8 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = zero8();
  const float* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + (r < nr ? r : 0) * K;
  const float* xp[V];
  for (int v = 0; v < V; ++v) xp[v] = xt + v * K * 8;
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    vec8 xv[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) xv[v] = load8(xp[v] + k * 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vec8 wv = splat8(wr[r][k]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = fma8(wv, xv[v], acc[r][v]);
    }
  }
  // The sums leave the registers in one pass of constant indices (indexed by the run-time
  // bounds below, they would be kept in memory all through the loop).
  alignas(32) float out[V][8][8];
  for (int v = 0; v < V; ++v) {
    for (int r = 0; r < R; ++r) store8_aligned(out[v][r], acc[r][v]);
    for (int r = R; r < 8; ++r) store8_aligned(out[v][r], zero8());
  }
  const mask8 mask = first_lanes(nr);
  for (int v = 0; v < V && v * 8 < mr; ++v) {
    vec8 c[8];
    for (int r = 0; r < 8; ++r) c[r] = load8_aligned(out[v][r]);
    transpose8(c);
    for (int i = 0; i < 8 && v * 8 + i < mr; ++i) store8_masked(y + (v * 8 + i) * ldy, mask, c[i]);
  }
}

// Output features [n0, n1) of y [M, ldy] = x w^T, x packed by pack_rows into xt. Broadcasting
// weights against packed input panels needs no horizontal sums, which tiles of dot products
// would pay for every output.
// 16-bit weights: the tile's rows are widened into `wide` (TR K floats) first, once for all
// the panels they meet.
template <class W>
void packed_rows(const float* xt, int64_t M, int64_t K, const W* w, int64_t n0, int64_t n1,
                 float* y, int64_t ldy, float* wide) {
  const int64_t panels = (M + 7) / 8, groups = (panels + TV - 1) / TV;
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(W));
  for (int64_t n = n0; n < n1; n += TR) {
    const int64_t nr = std::min<int64_t>(TR, n1 - n);
    const int64_t ahead = std::min<int64_t>(TR, std::max<int64_t>(0, n1 - n - TR));
    const float* wn;
    if constexpr (std::is_same_v<W, float>) {
      wn = w + n * K;
    } else {
      for (int64_t i = 0; i < nr * K; ++i) wide[i] = value(w[n * K + i]);
      wn = wide;
    }
    const char* next = reinterpret_cast<const char*>(w + (n + TR) * K);
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t r = 0; r < ahead; ++r)
        for (int64_t i = row_bytes * g / groups / 64 * 64; i < row_bytes * (g + 1) / groups;
             i += 64)
          prefetch_l2(next + r * row_bytes + i);
      const int64_t v = std::min<int64_t>(TV, panels - g * TV);
      const int64_t mr = std::min(8 * v, M - 8 * TV * g);
      const float* xg = xt + g * TV * K * 8;
      float* yg = y + 8 * TV * g * ldy + n;
      if (v == TV) panel_tile<TR, TV>(xg, K, wn, nr, mr, yg, ldy);
      else panel_tile<TR, 1>(xg, K, wn, nr, mr, yg, ldy);
    }
  }
}

// Chunks of about this many bytes of weight rows: many per matrix, for the threads to balance,
// each long enough to stream.
constexpr int64_t CHUNK_BYTES = 65536;

}  // namespace

void pack_rows(const float* x, int64_t M, int64_t K, float* xt) {
  for (int64_t g = 0; g * 8 < M; ++g) {
    const int64_t mr = std::min<int64_t>(8, M - g * 8);
    const float* xg = x + g * 8 * K;
    float* out = xt + g * K * 8;
    int64_t k = 0;
    if (mr == 8)
      for (; k + 8 <= K; k += 8) {
        vec8 r[8];
        for (int i = 0; i < 8; ++i) r[i] = load8(xg + i * K + k);
        transpose8(r);
        for (int j = 0; j < 8; ++j) store8(out + (k + j) * 8, r[j]);
      }
    for (; k < K; ++k)
      for (int i = 0; i < 8; ++i) out[k * 8 + i] = i < mr ? xg[i * K + k] : 0.f;
  }
}

// About CHUNK_BYTES of weight rows (of the matrix's longest rows), a multiple of 8 for few
// rows (they go in threes and eights, or in the repacked products' tiles) and of 24 (whole
// tiles) for more.
int64_t chunk_rows(const Matrix& m, int64_t M) {
  int64_t row_bytes = 1;
  for (int64_t i = 0; i < m.count; ++i) row_bytes = std::max(row_bytes, m.parts[i].row_bytes);
  // Few rows: whole tiles of the repacked products (several groups of 8 weight rows read
  // side by side), else runs of threes and eights.
  const int64_t unit = M > FEW ? 4 * TR : m.has_packed() ? packed_tile_rows(M) : 8;
  return std::max<int64_t>(unit, CHUNK_BYTES / row_bytes / unit * unit);
}

// Rows [r0, r1) of a dense part w [N, K] into y's columns from r0, y [M, ldy].
template <class W>
void dense_rows(const W* w, const Rows& in, int64_t K, int64_t r0, int64_t r1, float* y,
                int64_t N, int64_t ldy) {
  if (in.M <= FEW) few_rows(in.x, in.M, K, w, r0, r1, y, N, ldy);
  else packed_rows(in.xt, in.M, K, w, r0, r1, y, ldy, in.wide);
}

// Rows [r0, r1) of part p into y's columns from r0, y [M, ldy].
static void part_rows(const Part& p, const Rows& in, int64_t K, int64_t r0, int64_t r1, float* y,
               int64_t ldy) {
  const QuantPart q{static_cast<const uint8_t*>(p.w), p.row_bytes, p.type % PACKED};
  if (is_packed(p.type)) {
    packed_products(q, in.xp, in.M, r0, r1, y, ldy);
  } else if (!is_dense(p.type) && in.M > few_rows(p.type) && tiles_read(p.type)) {
    quant_tiles(q, in.xp, in.M, r0, r1, y, ldy, in.scratch);
  } else if (!is_dense(p.type)) {
    quant_rows(q, in.xq, in.M, r0, r1, y, ldy);
  } else if (p.type == DENSE_F16) {
    dense_rows(static_cast<const F16*>(p.w), in, K, r0, r1, y, p.rows, ldy);
  } else if (p.type == DENSE_BF16) {
    dense_rows(static_cast<const BF16*>(p.w), in, K, r0, r1, y, p.rows, ldy);
  } else {
    dense_rows(static_cast<const float*>(p.w), in, K, r0, r1, y, p.rows, ldy);
  }
  if (p.bias != nullptr)
    for (int64_t r = 0; r < in.M; ++r)
      for (int64_t n = r0; n < r1; ++n) y[r * ldy + n] += p.bias[n];
}

void linear_rows(const Matrix& m, const Rows& in, int64_t n0, int64_t n1, float* y) {
  int64_t first = 0;  // the part's first feature
  for (int64_t i = 0; i < m.count && first < n1; first += m.parts[i++].rows) {
    const Part& p = m.parts[i];
    const int64_t r0 = std::max<int64_t>(0, n0 - first), r1 = std::min(p.rows, n1 - first);
    if (r0 < r1) part_rows(p, in, m.K, r0, r1, y + first, m.N);
  }
}

void linear(const Matrix& m, const float* x, int64_t M, float* y) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (m.N + 15) / 16);
  const auto next = counters(1, threads);
  const PackSpace size(M, m.K, m.has(false), m.has_half(), m.has(true));
  const std::unique_ptr<char[]> spaces(new char[threads * size.bytes]);
#pragma omp parallel num_threads(threads)
  {
    const Team team = Team::current();
    const Products products{team, M, size, spaces.get() + team.t * size.bytes};
    products.multiply(m, x, y, next.get(), [](int64_t, int64_t) {});
  }
}

}  // namespace kvserve
