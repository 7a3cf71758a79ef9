// float32 CPU kernels (AVX2 + FMA): linear layers at the memory bandwidth of the weights for
// decode and near the FMA peak for prefill chunks, paged decode attention read straight from
// the block pool, and the small fused operations around them (RMSNorm, rotary embedding, gated
// activations, cache writes); a step's decoder layers in one parallel region.
// Each has a plain torch counterpart (kernels.reference, models.layers) that tests compare.
//
// Linear: decode multiplies a few activation rows by every weight matrix, so the work is
// reading the weights once. Each thread owns a contiguous run of output features and reads its
// weight rows front to back, once; more rows (prefill chunks) are packed into panels that
// register tiles reuse.
// Weights stay in nn.Linear's own [out, in] layout, shared with torch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <utility>
#include <vector>
#include <torch/library.h>

namespace {

constexpr int64_t FEW = 8;  // up to this many rows, weight rows go in threes (few_rows)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Few rows (decode): weight rows in threes. Each three goes against MA input rows and then,
// from L1, against the next MB (MB = 0: none); K goes in blocks of KB floats, so that the three
// rows' block stays in L1 between the two passes. Meanwhile the three rows after the next are
// requested into L2: with eight input rows the loop computes long enough per weight line that
// the hardware prefetcher falls behind (same-process A/B, 30 SmolLM2-shaped layers' matrices
// at 8 rows: 0.80 -> 0.54 ms a layer; at 4 rows 0.61 -> 0.50). One row goes alone (one_row).
template <int MA, int MB>
inline void by_threes(const float* x, int64_t K, const float* w, int nw, float* y, int64_t ldy,
                      const float* ahead, int64_t ahead_n) {
  constexpr int64_t KB = 256;
  constexpr int H = MB > 0 ? 2 : 1;
  __m256 keep[H][MA][3];
  for (int h = 0; h < H; ++h)
    for (int m = 0; m < MA; ++m)
      for (int r = 0; r < 3; ++r) keep[h][m][r] = _mm256_setzero_ps();
  const float* wr[3];
  for (int r = 0; r < 3; ++r) wr[r] = w + (r < nw ? r : 0) * K;
  const int64_t kt = K / 8 * 8;
  for (int64_t k0 = 0; k0 < kt; k0 += KB) {
    const int64_t k1 = std::min(kt, k0 + KB);
    for (int h = 0; h < H; ++h) {
      const int rows = h == 0 ? MA : MB;
      const float* xh = x + h * MA * K;
      __m256 acc[MA][3];
      for (int m = 0; m < MA; ++m)
        for (int r = 0; r < 3; ++r) acc[m][r] = keep[h][m][r];
      for (int64_t k = k0; k < k1; k += 8) {
        // Three rows ahead advance 24 floats per step: two lines of 16 per step, in one pass
        // or split between the two.
        if (3 * k < ahead_n) {
          _mm_prefetch(reinterpret_cast<const char*>(ahead + 3 * k + 16 * h), _MM_HINT_T1);
          if (H == 1) _mm_prefetch(reinterpret_cast<const char*>(ahead + 3 * k + 16), _MM_HINT_T1);
        }
        const __m256 w0 = _mm256_loadu_ps(wr[0] + k), w1 = _mm256_loadu_ps(wr[1] + k),
                     w2 = _mm256_loadu_ps(wr[2] + k);
        for (int m = 0; m < MA && m < rows; ++m) {
          const __m256 xv = _mm256_loadu_ps(xh + m * K + k);
          acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
          acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
          acc[m][2] = _mm256_fmadd_ps(xv, w2, acc[m][2]);
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
        for (int64_t kk = kt; kk < K; ++kk) s += x[(h * MA + m) * K + kk] * wr[r][kk];
        y[(h * MA + m) * ldy + r] = s;
      }
}

// One row: y = dot(x, w) with eight independent accumulators, enough loads in flight to keep
// the hardware prefetcher streaming the weight row at the memory bandwidth (threes measured
// slower here: one stream's decode step 13.2 -> 15.0 ms; so did this function inlined into
// few_rows, 3-8% on the layer's matrices, same process).
__attribute__((noinline)) float one_row(const float* x, int64_t K, const float* w) {
  __m256 acc[8];
  for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64)
    for (int u = 0; u < 8; ++u)
      acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8 * u), _mm256_loadu_ps(w + k + 8 * u),
                               acc[u]);
  for (; k + 8 <= K; k += 8)
    acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), acc[0]);
  for (int u = 1; u < 8; ++u) acc[0] = _mm256_add_ps(acc[0], acc[u]);
  float s = hsum(acc[0]);
  for (; k < K; ++k) s += x[k] * w[k];
  return s;
}

// Output features [n0, n1) of y [MA + MB, N] = x w^T, w having N rows.
template <int MA, int MB>
void few_rows_of(const float* x, int64_t K, const float* w, int64_t n0, int64_t n1, float* y,
                 int64_t N) {
  for (int64_t n = n0; n < n1; n += 3) {
    const int64_t a0 = std::min(N, n + 6), a1 = std::min(N, a0 + 3);
    by_threes<MA, MB>(x, K, w + n * K, static_cast<int>(std::min<int64_t>(3, n1 - n)), y + n, N,
                      w + a0 * K, (a1 - a0) * K);
  }
}

void few_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t n0, int64_t n1,
              float* y, int64_t N) {
  switch (M) {
    case 1:
      for (int64_t n = n0; n < n1; ++n) y[n] = one_row(x, K, w + n * K);
      break;
    case 2: few_rows_of<2, 0>(x, K, w, n0, n1, y, N); break;
    case 3: few_rows_of<3, 0>(x, K, w, n0, n1, y, N); break;
    case 4: few_rows_of<4, 0>(x, K, w, n0, n1, y, N); break;
    case 5: few_rows_of<3, 2>(x, K, w, n0, n1, y, N); break;
    case 6: few_rows_of<3, 3>(x, K, w, n0, n1, y, N); break;
    case 7: few_rows_of<4, 3>(x, K, w, n0, n1, y, N); break;
    case 8: few_rows_of<4, 4>(x, K, w, n0, n1, y, N); break;
  }
}

// Many rows (prefill chunks, decode batches above FEW): the input rows are packed once per
// matrix into panels of 8 rows, k-major, and a tile of TR weight rows x TV panels keeps its
// TR x TV sums in registers over all of K: each broadcast weight feeds TV FMAs and each loaded
// input vector TR, and the sums leave through a transpose, with no horizontal adds (100-111
// GF/s on one core with its data in L1, whose FMA peak is ~117). The next tile's weight rows
// are requested into L2 a slice per panel group.
constexpr int TR = 6, TV = 2;

// 8 vectors as the columns of an 8 x 8 block: r[j][i] <- r[i][j].
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
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

// Floats of x [M, K] packed by pack_rows.
inline int64_t packed_size(int64_t M, int64_t K) { return (M + 7) / 8 * 8 * K; }

// x [M, K] as panels of 8 rows, k-major: xt[(g K + k) 8 + i] = x[8g + i][k], zero for rows
// past M.
void pack_rows(const float* x, int64_t M, int64_t K, float* xt) {
  for (int64_t g = 0; g * 8 < M; ++g) {
    const int64_t mr = std::min<int64_t>(8, M - g * 8);
    const float* xg = x + g * 8 * K;
    float* out = xt + g * K * 8;
    int64_t k = 0;
    if (mr == 8)
      for (; k + 8 <= K; k += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(xg + i * K + k);
        transpose8(r);
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + (k + j) * 8, r[j]);
      }
    for (; k < K; ++k)
      for (int i = 0; i < 8; ++i) out[k * 8 + i] = i < mr ? xg[i * K + k] : 0.f;
  }
}

// y[m][r] = dot(x[m], w[r]) for r < nr (nr <= R) and the first mr rows of V panels of xt;
// w's rows K apart, y's ldy.
template <int R, int V>
inline void panel_tile(const float* xt, int64_t K, const float* w, int64_t nr, int64_t mr,
                       float* y, int64_t ldy) {
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  const float* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + (r < nr ? r : 0) * K;
  const float* xp[V];
  for (int v = 0; v < V; ++v) xp[v] = xt + v * K * 8;
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    __m256 xv[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) xv[v] = _mm256_loadu_ps(xp[v] + k * 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_set1_ps(wr[r][k]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(wv, xv[v], acc[r][v]);
    }
  }
  // The sums leave the registers in one pass of constant indices (indexed by the run-time
  // bounds below, they would be kept in memory all through the loop).
  alignas(32) float out[V][8][8];
  for (int v = 0; v < V; ++v) {
    for (int r = 0; r < R; ++r) _mm256_store_ps(out[v][r], acc[r][v]);
    for (int r = R; r < 8; ++r) _mm256_store_ps(out[v][r], _mm256_setzero_ps());
  }
  alignas(32) static const int32_t lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  const __m256i mask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes + 8 - nr));
  for (int v = 0; v < V && v * 8 < mr; ++v) {
    __m256 c[8];
    for (int r = 0; r < 8; ++r) c[r] = _mm256_load_ps(out[v][r]);
    transpose8(c);
    for (int i = 0; i < 8 && v * 8 + i < mr; ++i) _mm256_maskstore_ps(y + (v * 8 + i) * ldy, mask, c[i]);
  }
}

// Output features [n0, n1) of y [M, N] = x w^T, x packed by pack_rows into xt (same-process
// A/B at 128 rows, SmolLM2's four matrices from memory: 5.02 -> 4.63 ms a layer against the
// dot-product tiles this replaced, which needed horizontal sums; at 12 to 40 rows no slower).
void packed_rows(const float* xt, int64_t M, int64_t K, const float* w, int64_t n0, int64_t n1,
                 float* y, int64_t N) {
  const int64_t panels = (M + 7) / 8, groups = (panels + TV - 1) / TV;
  for (int64_t n = n0; n < n1; n += TR) {
    const int64_t nr = std::min<int64_t>(TR, n1 - n);
    const int64_t ahead = std::min<int64_t>(TR, std::max<int64_t>(0, n1 - n - TR));
    const float* wn = w + n * K;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t r = 0; r < ahead; ++r)
        for (int64_t i = K * g / groups / 16 * 16; i < K * (g + 1) / groups; i += 16)
          _mm_prefetch(reinterpret_cast<const char*>(wn + (TR + r) * K + i), _MM_HINT_T1);
      const int64_t v = std::min<int64_t>(TV, panels - g * TV), mr = std::min(8 * v, M - 8 * TV * g);
      const float* xg = xt + g * TV * K * 8;
      float* yg = y + 8 * TV * g * N + n;
      if (v == TV) panel_tile<TR, TV>(xg, K, wn, nr, mr, yg, N);
      else panel_tile<TR, 1>(xg, K, wn, nr, mr, yg, N);
    }
  }
}

// A matrix's output features in chunks that the threads claim. Each thread starts with its
// own share (a contiguous run of weight rows, read front to back) and then takes what is left
// of the others', so that a thread whose memory reads ran slower this time does not keep the
// others waiting at the next barrier for more than one chunk. `next` holds a zeroed counter per
// thread (chunks of its share taken so far), each on a cache line of its own: counters that
// share a line make every claim move the line between cores.
constexpr int64_t CHUNK_BYTES = 65536;

struct alignas(64) Counter {
  std::atomic<int64_t> taken{0};
};

struct Chunks {
  int64_t n, size, nt;
  Counter* next;

  Chunks(int64_t n_, int64_t size_, int64_t nt_, Counter* next_)
      : n(n_), size(size_), nt(nt_), next(next_) {}

  template <class F>
  void run(int64_t t, F&& f) const {
    const int64_t total = (n + size - 1) / size;
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t s = (t + i) % nt;  // its own share first
      const int64_t c0 = total * s / nt, c1 = total * (s + 1) / nt;
      for (int64_t c; (c = c0 + next[s].taken.fetch_add(1, std::memory_order_relaxed)) < c1;)
        f(c * size, std::min(n, (c + 1) * size));
    }
  }
};

// Weight rows of K floats per chunk for M input rows: about CHUNK_BYTES, a multiple of 8 for
// few rows (they go in threes and eights) and of 24 (whole tiles) for more.
inline int64_t chunk_rows(int64_t K, int64_t M) {
  const int64_t unit = M <= FEW ? 8 : 4 * TR;
  return std::max<int64_t>(unit, CHUNK_BYTES / (K * 4) / unit * unit);
}

// Zeroed counters for `matrices` uses of Chunks by `threads` threads.
inline std::unique_ptr<Counter[]> counters(int64_t matrices, int64_t threads) {
  return std::unique_ptr<Counter[]>(new Counter[matrices * threads]);
}

// Output features [n0, n1) of y [M, ldy] = x [M, K] w^T (+ bias): one thread's chunk. With
// more than FEW rows, x must have been packed into xt (pack_rows) first.
void linear_rows(const float* x, const float* xt, int64_t M, int64_t K, const float* w,
                 const float* bias, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  if (M <= FEW) {
    few_rows(x, M, K, w, n0, n1, y, ldy);
  } else {
    packed_rows(xt, M, K, w, n0, n1, y, ldy);
  }
  if (bias != nullptr)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) y[m * ldy + n] += bias[n];
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "kvserve::linear takes float32");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "weight must be a contiguous [out, in] matrix");
  const int64_t K = w.size(1), N = w.size(0);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight takes ", K);
  auto xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const at::Tensor bc = b.has_value() && b->defined() ? b->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (N + 15) / 16);
  const auto next = counters(1, threads);
  // Each thread packs x for itself: no barrier between the packing and the products.
  const int64_t packed = M > FEW ? packed_size(M, K) : 0;
  const std::unique_ptr<float[]> xts(new float[threads * packed]);
#pragma omp parallel num_threads(threads)
  {
    float* xt = xts.get() + omp_get_thread_num() * packed;
    if (packed > 0) pack_rows(xp, M, K, xt);
    const Chunks chunks(N, chunk_rows(K, M), omp_get_num_threads(), next.get());
    chunks.run(omp_get_thread_num(), [&](int64_t n0, int64_t n1) {
      linear_rows(xp, xt, M, K, wp, bp, n0, n1, yp, N);
    });
  }
  return y.view(sizes);
}


inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8)
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// exp of 8 floats (Cephes' polynomial: relative error ~1e-7 over the range softmax uses).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)),
                    _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// s[i] = exp(s[i] - mx) over n floats; returns their sum.
inline float exp_shifted(float* s, int64_t n, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float total = hsum(acc);
  for (; i < n; ++i) total += (s[i] = std::exp(s[i] - mx));
  return total;
}

// The sums of eight vectors, as one vector: [sum(a[0]), ..., sum(a[7])].
inline __m256 sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

constexpr int64_t AHEAD = 32;  // rows requested ahead of the first pass over a unit's rows

// s[i] = dot(q, rows[i]) * scale for i < n, eight rows side by side so that their products
// do not wait on each other. With `next` (the value rows), the pass requests `ahead` floats
// from each key row and `ahead_next` from each value row AHEAD rows further as it goes.
void scores_of(const float* q, const float* const* rows, int64_t n, int64_t D, float scale,
               float* s, int64_t ahead, const float* const* next, int64_t ahead_next) {
  auto request = [](const float* row, int64_t d) {
    for (int64_t c = 0; c < d * 4; c += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row) + c, _MM_HINT_T0);
  };
  if (next != nullptr)
    for (int64_t r = 0; r < std::min(n, AHEAD); ++r)
      request(rows[r], ahead), request(next[r], ahead_next);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (next != nullptr)
      for (int64_t r = i + AHEAD; r < std::min(n, i + AHEAD + 8); ++r)
        request(rows[r], ahead), request(next[r], ahead_next);
    __m256 acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int r = 0; r < 8; ++r)
        acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[i + r] + d), acc[r]);
    }
    _mm256_storeu_ps(s + i, _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale)));
    for (; d < D; ++d)
      for (int r = 0; r < 8; ++r) s[i + r] += q[d] * rows[i + r][d] * scale;
  }
  for (; i < n; ++i) s[i] = dot(q, rows[i], D) * scale;
}

// out[c .. c + 8V) = scale * sum_i p[i] rows[i][c .. c + 8V), held in V registers.
template <int V>
inline void weighted_cols(const float* p, const float* const* rows, int64_t n, int64_t c,
                          float scale, float* out) {
  __m256 acc[V];
  for (int j = 0; j < V; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const __m256 pi = _mm256_set1_ps(p[i]);
    const float* row = rows[i] + c;
    for (int j = 0; j < V; ++j) acc[j] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(row + 8 * j), acc[j]);
  }
  for (int j = 0; j < V; ++j)
    _mm256_storeu_ps(out + c + 8 * j, _mm256_mul_ps(acc[j], _mm256_set1_ps(scale)));
}

// out[D] = scale * sum_i p[i] rows[i], 64 columns per pass over the rows.
void weighted_sum(const float* p, const float* const* rows, int64_t n, int64_t D, float scale,
                  float* out) {
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) weighted_cols<8>(p, rows, n, c, scale, out);
  for (; c + 8 <= D; c += 8) weighted_cols<1>(p, rows, n, c, scale, out);
  for (; c < D; ++c) {  // columns past the last multiple of 8 (none in practice)
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += p[i] * rows[i][c];
    out[c] = sum * scale;
  }
}

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

// One layer's paged cache as the attention kernels read it: per sequence a block table of W
// blocks (a ring of W with a window), a slot's heads adjacent in its row.
struct CacheView {
  const float *k, *v;
  const int32_t* tables;
  int64_t bs, W, window, ks0, ks1, ks2, vs0, vs1, vs2;

  CacheView(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables_,
            int64_t window_)
      : k(k_cache.data_ptr<float>()), v(v_cache.data_ptr<float>()),
        tables(tables_.data_ptr<int32_t>()), bs(k_cache.size(1)), W(tables_.size(1)),
        window(window_), ks0(k_cache.stride(0)), ks1(k_cache.stride(1)), ks2(k_cache.stride(2)),
        vs0(v_cache.stride(0)), vs1(v_cache.stride(1)), vs2(v_cache.stride(2)) {}

  // Head 0's key and value rows of sequence b at position pos; the next positions of its block
  // follow ks1 and vs1 apart.
  std::pair<const float*, const float*> rows(int64_t b, int64_t pos) const {
    const int64_t logical = window > 0 ? (pos / bs) % W : pos / bs;
    const int64_t block = tables[b * W + logical], off = pos % bs;
    return {k + block * ks0 + off * ks1, v + block * vs0 + off * vs1};
  }
};

// out[Dv] = softmax(scale * q . krows[i]) . vrows over n rows, the scores in `scores`;
// returns their max and the sum of exp(score - max) (0 with no rows). `ahead`, `next` and
// `ahead_next` as scores_of.
std::pair<float, float> attend(const float* q, const float* const* krows,
                               const float* const* vrows, int64_t n, int64_t Dk, int64_t Dv,
                               float scale, float* scores, float* out, int64_t ahead = 0,
                               const float* const* next = nullptr, int64_t ahead_next = 0) {
  scores_of(q, krows, n, Dk, scale, scores, ahead, next, ahead_next);
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, scores[i]);
  const float sum = n > 0 ? exp_shifted(scores, n, mx) : 0.f;
  weighted_sum(scores, vrows, n, Dv, sum > 0 ? 1.f / sum : 0.f, out);
  return {mx, sum};
}

// Paged decode attention: one query token per sequence, its context read through the block
// table (ring of W blocks with a window) from caches of any row stride (MLA's value is a view
// of its key rows); softmax in float32, as the reference. The work is a set of units, each a
// sequence's context or a part of it, all heads: a slot's heads are adjacent in the cache, so
// a unit reads whole blocks front to back. When the sequences are too few to occupy the
// threads (a batch of one), each context is cut into parts whose partial softmax results
// (max, sum and normalized output per query head) are merged after, as flash-decoding does.
struct PagedAttention {
  const float* q;  // q row b at q + b * q_stride, [Hq, Dk]
  float* out;      // [B, Hq, Dv]
  CacheView cache;
  const int32_t* lens;
  int64_t B, Hq, Hkv, G, Dk, Dv, q_stride;
  float scale;
  int64_t parts = 1;
  at::Tensor partial;  // [units, Hq, 2 + Dv]: max, sum, output; only with parts > 1

  static constexpr int64_t MIN_PART = 32;  // positions

  PagedAttention(const float* q_, int64_t q_stride_, int64_t B_, int64_t Hq_,
                 const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables_,
                 const at::Tensor& lens_, float scale_, int64_t window_, float* out_,
                 int64_t threads)
      : q(q_), out(out_), cache(k_cache, v_cache, tables_, window_),
        lens(lens_.data_ptr<int32_t>()), B(B_), Hq(Hq_), Hkv(k_cache.size(2)),
        G(Hq_ / k_cache.size(2)), Dk(k_cache.size(3)), Dv(v_cache.size(3)), q_stride(q_stride_),
        scale(scale_) {
    int64_t longest = 0;
    for (int64_t b = 0; b < B; ++b) longest = std::max<int64_t>(longest, span(b));
    const int64_t wanted = (2 * threads + B - 1) / std::max<int64_t>(1, B);
    parts = std::max<int64_t>(1, std::min(wanted, longest / MIN_PART));
    if (parts > 1) partial = at::empty({units() * Hq * (2 + Dv)}, at::kFloat);
  }

  int64_t units() const { return B * parts; }
  int64_t first(int64_t b) const {
    return cache.window > 0 ? std::max<int64_t>(0, lens[b] - cache.window) : 0;
  }
  int64_t span(int64_t b) const { return lens[b] - first(b); }

  struct Scratch {
    std::vector<float> scores;
    std::vector<const float*> krows, vrows;
  };

  void unit(int64_t u, Scratch& s) const {
    const int64_t b = u / parts, part = u % parts;
    const int64_t whole = span(b), lo = first(b) + whole * part / parts;
    const int64_t hi = first(b) + whole * (part + 1) / parts, n = hi - lo;
    s.scores.resize(n);
    s.krows.resize(n);
    s.vrows.resize(n);
    // Head 0's rows of positions lo .. hi - 1, one table lookup per block (a ring of W with a
    // window); each further head's rows are these moved by the head stride.
    const CacheView& c = cache;
    for (int64_t pos = lo; pos < hi;) {
      const auto [kr, vr] = c.rows(b, pos);
      const int64_t m = std::min(c.bs - pos % c.bs, hi - pos);
      for (int64_t j = 0; j < m; ++j) {
        s.krows[pos - lo + j] = kr + j * c.ks1;
        s.vrows[pos - lo + j] = vr + j * c.vs1;
      }
      pos += m;
    }
    for (int64_t h = 0; h < Hkv; ++h) {
      if (h > 0)
        for (int64_t i = 0; i < n; ++i) s.krows[i] += c.ks2, s.vrows[i] += c.vs2;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hq = h * G + g;
        // The cache has usually left the CPU caches since the layer's last step (the weights
        // streamed through them): the first pass requests every head's rows ahead.
        const bool ahead = h == 0 && g == 0;
        float* p = parts > 1 ? partial.data_ptr<float>() + (u * Hq + hq) * (2 + Dv) : nullptr;
        const auto [mx, sum] =
            attend(q + b * q_stride + hq * Dk, s.krows.data(), s.vrows.data(), n, Dk, Dv, scale,
                   s.scores.data(), p != nullptr ? p + 2 : out + (b * Hq + hq) * Dv,
                   ahead ? (Hkv - 1) * c.ks2 + Dk : 0, ahead ? s.vrows.data() : nullptr,
                   (Hkv - 1) * c.vs2 + Dv);
        if (p != nullptr) p[0] = mx, p[1] = sum;
      }
    }
  }

  // Query heads' rows of the output (B * Hq of them) from the parts, when there are parts.
  int64_t rows_to_merge() const { return parts > 1 ? B * Hq : 0; }

  void merge(int64_t row) const {
    const int64_t b = row / Hq, hq = row % Hq, stride = Hq * (2 + Dv);  // part to part
    const float* p0 = partial.data_ptr<float>() + (b * parts * Hq + hq) * (2 + Dv);
    float mx = -INFINITY, total = 0.f;
    for (int64_t i = 0; i < parts; ++i) mx = std::max(mx, p0[i * stride]);
    for (int64_t i = 0; i < parts; ++i) total += p0[i * stride + 1] * std::exp(p0[i * stride] - mx);
    float* o = out + row * Dv;
    std::fill_n(o, Dv, 0.f);
    for (int64_t i = 0; i < parts; ++i) {
      const float* p = p0 + i * stride;
      if (p[1] == 0.f) continue;  // an empty part
      const float w = p[1] * std::exp(p[0] - mx) / total;
      for (int64_t c = 0; c < Dv; ++c) o[c] += w * p[2 + c];
    }
  }
};

void check_paged(const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t Hq,
                 int64_t Dk) {
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block tables and lengths must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "block tables and lengths must be contiguous");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "cache rows must be dense");
  TORCH_CHECK(Hq % k_cache.size(2) == 0 && k_cache.size(3) == Dk,
              "head shapes do not match the cache");
}

// Prefill attention inside the fused layers: chunks of new tokens (sequences nd .. B - 1, rows
// cu[s] .. cu[s + 1] at positions prefix[s] + j) attending causally to themselves and to their
// cached prefix, as reference.prefill_attention: the new tokens' keys and values are read from
// the step's q|k|v rows (the cache gets them after), the prefix through the block table (a ring
// of W blocks with a window). A unit is a block of up to ROWS query rows of one sequence and
// one KV head with its query heads: its keys and values stay in the CPU caches for all of them.
struct PrefillAttention {
  static constexpr int64_t ROWS = 16;
  const float* qkv;
  float* out;  // [T, Hq, D]
  CacheView cache;
  const int32_t *prefix, *cu;
  int64_t Hq, Hkv, G, D, nqkv;
  float scale;
  std::vector<int64_t> seq, row0;  // per block of rows: its sequence and first row

  PrefillAttention(const float* qkv_, int64_t nqkv_, int64_t nd, int64_t Hq_,
                   const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& tables_, const at::Tensor& prefix_, const at::Tensor& cu_,
                   float scale_, int64_t window_, float* out_)
      : qkv(qkv_), out(out_), cache(k_cache, v_cache, tables_, window_),
        prefix(prefix_.data_ptr<int32_t>()), cu(cu_.data_ptr<int32_t>()), Hq(Hq_),
        Hkv(k_cache.size(2)), G(Hq_ / k_cache.size(2)), D(k_cache.size(3)), nqkv(nqkv_),
        scale(scale_) {
    for (int64_t b = nd; b < prefix_.numel(); ++b) {
      TORCH_CHECK(prefix[b] >= 0 && (window_ > 0 || prefix[b] <= cache.W * cache.bs),
                  "a prefix is longer than its block table");
      for (int64_t r = cu[b]; r < cu[b + 1]; r += ROWS) seq.push_back(b), row0.push_back(r);
    }
  }

  int64_t units() const { return static_cast<int64_t>(seq.size()) * Hkv; }
  int64_t lowest(int64_t pos) const {
    return cache.window > 0 ? std::max<int64_t>(0, pos - cache.window + 1) : 0;
  }

  void unit(int64_t u, PagedAttention::Scratch& s) const {
    const int64_t b = seq[u / Hkv], h = u % Hkv, r0 = row0[u / Hkv];
    const int64_t c0 = cu[b], r1 = std::min<int64_t>(r0 + ROWS, cu[b + 1]), P = prefix[b];
    const int64_t lo = lowest(P + r0 - c0), hi = P + r1 - c0, n = hi - lo;
    s.scores.resize(n);
    s.krows.resize(n);
    s.vrows.resize(n);
    for (int64_t pos = lo; pos < hi; ++pos) {
      const float *kr, *vr;
      if (pos < P) {
        const auto [k0, v0] = cache.rows(b, pos);
        kr = k0 + h * cache.ks2, vr = v0 + h * cache.vs2;
      } else {
        kr = qkv + (c0 + pos - P) * nqkv + Hq * D + h * D;
        vr = kr + Hkv * D;
      }
      s.krows[pos - lo] = kr, s.vrows[pos - lo] = vr;
    }
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t pos = P + r - c0, a = lowest(pos) - lo, m = pos - lowest(pos) + 1;
      for (int64_t hq = h * G; hq < (h + 1) * G; ++hq)
        attend(qkv + r * nqkv + hq * D, s.krows.data() + a, s.vrows.data() + a, m, D, D, scale,
               s.scores.data(), out + (r * Hq + hq) * D);
    }
  }
};

// q [B, Hq, Dk] -> [B, Hq, Dv].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t window) {
  check_f32(q, "q");
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t B = qc.size(0), Hq = qc.size(1), Dk = qc.size(2);
  check_paged(k_cache, v_cache, tables, lens, Hq, Dk);
  auto out = at::empty({B, Hq, v_cache.size(3)}, qc.options());
  const PagedAttention attn(qc.data_ptr<float>(), Hq * Dk, B, Hq, k_cache, v_cache, tables,
                            lens, static_cast<float>(scale), window, out.data_ptr<float>(),
                            at::get_num_threads());
  at::parallel_for(0, attn.units(), 1, [&](int64_t u0, int64_t u1) {
    PagedAttention::Scratch scratch;
    for (int64_t u = u0; u < u1; ++u) attn.unit(u, scratch);
  });
  at::parallel_for(0, attn.rows_to_merge(), 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) attn.merge(r);
  });
  return out;
}

// The start of a cache's row for flat slot `slot` (block slot / bs, offset slot % bs).
inline float* slot_row(const at::Tensor& cache, int64_t slot) {
  const int64_t bs = cache.size(1);
  return cache.data_ptr<float>() + (slot / bs) * cache.stride(0) + (slot % bs) * cache.stride(1);
}

// cache [N, bs, H, D] (each slot's [H, D] dense) at flat slots <- rows [T, H, D]; -1 skipped.
void write_cache(at::Tensor cache, const at::Tensor& rows, const at::Tensor& slots) {
  check_f32(cache, "cache");
  TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == cache.size(3),
              "cache slots must be dense");
  auto r = rows.to(at::kFloat).contiguous();
  auto sl = slots.to(at::kLong).contiguous();
  const int64_t T = r.size(0), row = r.numel() / std::max<int64_t>(T, 1);
  TORCH_CHECK(row == cache.size(2) * cache.size(3), "rows do not match the cache's slots");
  const float* rp = r.data_ptr<float>();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t n = cache.size(0) * cache.size(1);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = sp[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < n, "slot ", slot, " is outside the cache");
    std::copy_n(rp + t * row, row, slot_row(cache, slot));
  }
}

// Rotate the rotary values of every row of the cache's `blocks` [n] in place, each pair by
// the angle whose cos and sin [half] are given: cache [N, bs, H, D], pair p at
// (start + p, start + half + p), or at (start + 2p, start + 2p + 1) when interleaved.
void rotate_keys(at::Tensor cache, const at::Tensor& blocks, const at::Tensor& cos,
                 const at::Tensor& sin, int64_t start, bool interleaved) {
  check_f32(cache, "cache");
  TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1, "cache rows must be dense");
  auto b = blocks.to(at::kLong).contiguous();
  auto c = cos.to(at::kFloat).contiguous();
  auto s = sin.to(at::kFloat).contiguous();
  const int64_t half = c.numel(), N = cache.size(0), bs = cache.size(1), H = cache.size(2);
  TORCH_CHECK(s.numel() == half && start + 2 * half <= cache.size(3),
              "the rotary pairs do not fit the cache's rows");
  const int64_t* bp = b.data_ptr<int64_t>();
  for (int64_t i = 0; i < b.numel(); ++i) {
    TORCH_CHECK(0 <= bp[i] && bp[i] < N, "block ", bp[i], " is outside the cache");
  }
  float* cp = cache.data_ptr<float>();
  const float* cs = c.data_ptr<float>();
  const float* sn = s.data_ptr<float>();
  const int64_t s0 = cache.stride(0), s1 = cache.stride(1), s2 = cache.stride(2);
  const int64_t step = interleaved ? 2 : 1, other = interleaved ? 1 : half;
  at::parallel_for(0, b.numel() * bs, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = cp + bp[r / bs] * s0 + (r % bs) * s1 + start;
      for (int64_t h = 0; h < H; ++h) {
        float* x = row + h * s2;
        for (int64_t p = 0; p < half; ++p) {
          const float x1 = x[p * step], x2 = x[p * step + other];
          x[p * step] = x1 * cs[p] - x2 * sn[p];
          x[p * step + other] = x2 * cs[p] + x1 * sn[p];
        }
      }
    }
  });
}

// RMSNorm of one row of D: y = x * rsqrt(mean(x^2) + eps) * (w + offset); y may be x.
inline void norm_row(const float* x, const float* w, int64_t D, double eps, float offset,
                     float* y) {
  const float inv = 1.f / std::sqrt(dot(x, x, D) / D + static_cast<float>(eps));
  for (int64_t i = 0; i < D; ++i) y[i] = x[i] * inv * (w[i] + offset);
}

// Rotary embedding of one head's row of D in the half-split layout, in place; c, s [D].
inline void rope_row(float* x, const float* c, const float* s, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = x[j], b = x[j + half];
    x[j] = a * c[j] - b * s[j];
    x[j + half] = b * c[j + half] + a * s[j + half];
  }
}

// y[i] = act(g[i]) * u[i] for i < n; act 0 = silu, 1 = gelu (tanh approximation).
inline void gate_row(const float* g, const float* u, int64_t n, int64_t act, float* y) {
  // silu(v) = v / (1 + exp(-v)); gelu_tanh(v) = v / (1 + exp(-2k(v + 0.044715 v^3))),
  // k = sqrt(2 / pi) (0.5 (1 + tanh(z)) is 1 / (1 + exp(-2z))).
  const __m256 one = _mm256_set1_ps(1.f), c0 = _mm256_set1_ps(-1.5957691216057308f),
               c1 = _mm256_set1_ps(0.044715f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(g + i);
    __m256 z = _mm256_sub_ps(_mm256_setzero_ps(), v);
    if (act != 0) z = _mm256_mul_ps(c0, _mm256_fmadd_ps(_mm256_mul_ps(c1, v), _mm256_mul_ps(v, v), v));
    const __m256 a = _mm256_div_ps(v, _mm256_add_ps(one, exp8(z)));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) {
    const float v = g[i];
    const float z = act == 0 ? -v : -1.5957691216057308f * (v + 0.044715f * v * v * v);
    y[i] = v / (1.f + std::exp(z)) * u[i];
  }
}

// RMSNorm over the last dimension.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, double offset) {
  check_f32(x, "x");
  check_f32(w, "weight");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t D = wc.numel(), rows = xc.numel() / D;
  TORCH_CHECK(xc.size(-1) == D, "x has ", xc.size(-1), " features, the weight ", D);
  auto out = at::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float off = static_cast<float>(offset);
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * D, wp, D, eps, off, op + r * D);
  });
  return out;
}

// x [T, H, D] rotated by position in the half-split layout; cos/sin [T, D].
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_f32(x, "x");
  auto xc = x.contiguous();
  auto c = cos.to(at::kFloat).contiguous();
  auto s = sin.to(at::kFloat).contiguous();
  const int64_t T = xc.size(0), H = xc.size(1), D = xc.size(2);
  TORCH_CHECK(c.size(0) == T && c.size(1) == D, "cos/sin must be [T, head_dim]");
  auto out = xc.clone();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T * H, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) rope_row(op + i * D, cp + (i / H) * D, sp + (i / H) * D, D);
  });
  return out;
}

// act(h[:, :I]) * h[:, I:] for h [T, 2I]; act 0 = silu, 1 = gelu (tanh approximation).
at::Tensor gated_act(const at::Tensor& h, int64_t act) {
  check_f32(h, "h");
  auto hc = h.contiguous();
  const int64_t I = hc.size(-1) / 2, rows = hc.numel() / (2 * I);
  auto sizes = hc.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, hc.options());
  const float* hp = hc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) gate_row(hp + r * 2 * I, hp + r * 2 * I + I, I, act, op + r * I);
  });
  return out;
}

// Pre-norm decoder layers for a step's T new tokens (decodes first, then prefill chunks), each
//   h = x + [post_attn_norm](o_proj(attention(rope([q|k]_norm(qkv_proj(norm1(x)))))))
//   y = h + [post_mlp_norm](down(act(gate) * up)(norm2(h)))
// Bracketed norms are optional (Gemma 3 has them, Llama not); all norms share eps and offset.
// It mirrors the modules of models/llama.py and models/gemma3.py, which stay the reference;
// each layer has its own cos/sin and its cache group's attention metadata (kernels.paged).
//
// All the layers are one parallel region: the matrices go in Chunks, and the phases between
// are separated by barriers, not by forking the threads again, allocating each intermediate or
// returning to Python between layers (together about a seventh of the step at batch 1).

struct Matrix {
  const float* w;
  const float* bias;  // or nullptr
  int64_t N, K;
};

inline const float* opt(const c10::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
              "the layer's weights must be contiguous float32");
  return t->data_ptr<float>();
}

// Entry i of a list of optional weights that must be there.
inline at::Tensor required(const c10::List<c10::optional<at::Tensor>>& w, int64_t i) {
  const c10::optional<at::Tensor> t = w.get(i);
  TORCH_CHECK(t.has_value() && t->defined(), "a required weight of the layer is missing");
  return *t;
}

// The step's activations, shared by the layers (all of one shape): normed input, q|k|v,
// attention output, h, normed h, gate|up, act.
struct LayerScratch {
  at::Tensor buf;
  float *xn, *qkv, *attn, *h, *hn, *gu, *a;

  LayerScratch(int64_t T, int64_t H, int64_t nqkv, int64_t nq, int64_t I, const at::TensorOptions& o)
      : buf(at::empty({T * (H + nqkv + nq + H + H + 2 * I + I)}, o)) {
    xn = buf.data_ptr<float>();
    qkv = xn + T * H;
    attn = qkv + T * nqkv;
    h = attn + T * nq;
    hn = h + T * H;
    gu = hn + T * H;
    a = gu + T * 2 * I;
  }
};

// One layer's weights, cache and attention plan, checked and resolved to pointers before the
// parallel region. Counters 0, 1, 2 and 3 are its matrices' (q|k|v, o, gate|up, down), 4 its
// attention units' (the decodes', then the prefill chunks').
struct DecoderLayer {
  static constexpr int64_t COUNTERS = 5;
  int64_t T, nd, H, Hq, Hkv, D, nq, nkv, nqkv, I, act;
  double eps;
  float off;
  const float *norm1, *qn, *kn, *pan, *norm2, *gate_up, *pmn, *cp, *sp;
  Matrix qkv_m, o_m, down_m;
  at::Tensor k_cache, v_cache, c, s, sl;
  const int64_t* slot;
  PagedAttention paged;     // the decodes: rows 0 .. nd - 1
  PrefillAttention chunks;  // the prefill chunks: rows nd .. T - 1

  DecoderLayer(int64_t T_, int64_t H_, const at::Tensor& cos, const at::Tensor& sin,
               const c10::List<c10::optional<at::Tensor>>& w, int64_t w0, at::Tensor k_cache_,
               at::Tensor v_cache_, const at::Tensor& slots, const at::Tensor& block_tables,
               const at::Tensor& seq_lens, const at::Tensor& prefix_lens,
               const at::Tensor& cu_seqlens_q, int64_t num_decodes, double eps_, double offset,
               double scale, int64_t num_heads, int64_t act_, int64_t window,
               const LayerScratch& scratch, int64_t threads)
      : T(T_), nd(num_decodes), H(H_), Hq(num_heads), Hkv(k_cache_.size(2)),
        D(k_cache_.size(3)), nq(Hq * D), nkv(Hkv * D), nqkv(nq + 2 * nkv), act(act_),
        eps(eps_), off(static_cast<float>(offset)), k_cache(k_cache_), v_cache(v_cache_),
        c(cos.to(at::kFloat).contiguous()), s(sin.to(at::kFloat).contiguous()),
        sl(slots.to(at::kLong).contiguous()), slot(sl.data_ptr<int64_t>()),
        paged(scratch.qkv, nqkv, checked_decodes(num_decodes, block_tables, seq_lens,
                                                 prefix_lens, cu_seqlens_q, T_),
              num_heads, k_cache_, v_cache_, block_tables, seq_lens, static_cast<float>(scale),
              window, scratch.attn, threads),
        chunks(scratch.qkv, nqkv, num_decodes, num_heads, k_cache_, v_cache_, block_tables,
               prefix_lens, cu_seqlens_q, static_cast<float>(scale), window, scratch.attn) {
    // The layer's twelve weights: norm1, qkv weight and bias, q_norm, k_norm, o weight and
    // bias, post-attention norm, norm2, gate|up weight, down weight, post-MLP norm.
    auto get = [&](int64_t i) -> c10::optional<at::Tensor> { return w.get(w0 + i); };
    auto req = [&](int64_t i) { return opt(required(w, w0 + i)); };
    const at::Tensor qkv_w = required(w, w0 + 1), o_w = required(w, w0 + 5);
    const at::Tensor gate_up_w = required(w, w0 + 9), down_w = required(w, w0 + 10);
    I = down_w.size(1);
    check_paged(k_cache, v_cache, block_tables, seq_lens, Hq, D);
    TORCH_CHECK(v_cache.size(3) == D && k_cache.stride(2) == D && v_cache.stride(2) == D,
                "the layer's cache slots must be dense [heads, head_dim] rows");
    TORCH_CHECK(qkv_w.size(0) == nqkv && qkv_w.size(1) == H && o_w.size(0) == H &&
                    o_w.size(1) == nq && gate_up_w.size(0) == 2 * I && gate_up_w.size(1) == H &&
                    down_w.size(0) == H,
                "the layer's weights do not have the shapes of its heads and hidden size");
    TORCH_CHECK(c.size(0) == T && c.size(1) == D, "cos/sin must be [T, head_dim]");
    TORCH_CHECK(sl.numel() == T, "one slot per new token");
    const int64_t cap = k_cache.size(0) * k_cache.size(1);
    for (int64_t r = 0; r < T; ++r) TORCH_CHECK(slot[r] < cap, "slot ", slot[r], " is outside the cache");
    norm1 = req(0), qn = opt(get(3)), kn = opt(get(4)), pan = opt(get(7));
    norm2 = req(8), gate_up = req(9), pmn = opt(get(11));
    qkv_m = {req(1), opt(get(2)), nqkv, H};
    o_m = {req(5), opt(get(6)), H, nq};
    down_m = {req(10), nullptr, H, I};
    cp = c.data_ptr<float>(), sp = s.data_ptr<float>();
  }

  // The metadata's shapes, checked before PagedAttention reads them: the number of decodes.
  static int64_t checked_decodes(int64_t nd, const at::Tensor& tables, const at::Tensor& lens,
                                 const at::Tensor& prefix, const at::Tensor& cu, int64_t T) {
    const int64_t B = lens.numel();
    TORCH_CHECK(prefix.scalar_type() == at::kInt && cu.scalar_type() == at::kInt &&
                    prefix.is_contiguous() && cu.is_contiguous(),
                "prefix lengths and cu_seqlens_q must be contiguous int32");
    TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && prefix.numel() == B &&
                    cu.numel() == B + 1 && 0 <= nd && nd <= B,
                "one block table, prefix length and cu_seqlens_q entry per sequence");
    const int32_t* q = cu.data_ptr<int32_t>();
    TORCH_CHECK(q[0] == 0 && q[nd] == nd && q[B] == T,
                "cu_seqlens_q must start at 0, give each decode one row and end at T");
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(q[b] <= q[b + 1], "cu_seqlens_q must not decrease");
    return nd;
  }

  // Thread t of nt: y [T, H] = the layer of xp [T, H]; ends with a barrier. xt holds the
  // thread's packed copy of a matrix's input (packed_size(T, the largest K) floats).
  void run(int64_t t, int64_t nt, const float* xp, float* y, const LayerScratch& sc,
           Counter* next, float* xt) const {
    auto rows = [&](int64_t n) {  // this thread's share of n rows or tasks, one at a time
      return std::make_pair(n * t / nt, n * (t + 1) / nt);
    };
    auto norm_rows = [&](const float* in, const float* w, float* o) {
      auto [r0, r1] = rows(T);
      for (int64_t r = r0; r < r1; ++r) norm_row(in + r * H, w, H, eps, off, o + r * H);
    };
    // The i-th matrix of the layer, in chunks; f(n0, n1) after each chunk's rows are written.
    auto multiply = [&](int64_t i, const Matrix& m, const float* in, float* o, auto&& f) {
      if (T > FEW) pack_rows(in, T, m.K, xt);
      Chunks(m.N, chunk_rows(m.K, T), nt, next + i * nt).run(t, [&](int64_t n0, int64_t n1) {
        linear_rows(in, xt, T, m.K, m.w, m.bias, n0, n1, o, m.N);
        f(n0, n1);
      });
    };
    auto nothing = [](int64_t, int64_t) {};
    float *qkv = sc.qkv, *h = sc.h;

    norm_rows(xp, norm1, sc.xn);
#pragma omp barrier
    multiply(0, qkv_m, sc.xn, qkv, nothing);
#pragma omp barrier
    // Per head row: q and k normed (Gemma) and rotated; a decode's k and v written to the
    // cache, which its attention reads.
    auto to_cache = [&](int64_t r, int64_t head, const float* row) {
      std::copy_n(row, D, slot_row(k_cache, slot[r]) + head * D);
      std::copy_n(row + nkv, D, slot_row(v_cache, slot[r]) + head * D);
    };
    {
      auto [i0, i1] = rows(T * (Hq + Hkv));
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = i / (Hq + Hkv), head = i % (Hq + Hkv);
        float* row = qkv + r * nqkv + (head < Hq ? head * D : nq + (head - Hq) * D);
        const float* w = head < Hq ? qn : kn;
        if (w != nullptr) norm_row(row, w, D, eps, off, row);
        rope_row(row, cp + r * D, sp + r * D, D);
        if (head >= Hq && r < nd && slot[r] >= 0) to_cache(r, head - Hq, row);
      }
    }
#pragma omp barrier
    {
      PagedAttention::Scratch scratch;
      const int64_t decodes = paged.units();
      Chunks(decodes + chunks.units(), 1, nt, next + 4 * nt).run(t, [&](int64_t u, int64_t) {
        if (u < decodes) paged.unit(u, scratch);
        else chunks.unit(u - decodes, scratch);
      });
    }
#pragma omp barrier
    // The prefill chunks' k and v go to the cache once their attention has read the ring
    // slots a sliding-window chunk may overwrite.
    if (paged.rows_to_merge() > 0 || T > nd) {
      auto [r0, r1] = rows(paged.rows_to_merge());
      for (int64_t r = r0; r < r1; ++r) paged.merge(r);
      auto [i0, i1] = rows((T - nd) * Hkv);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = nd + i / Hkv, head = i % Hkv;
        if (slot[r] >= 0) to_cache(r, head, qkv + r * nqkv + nq + head * D);
      }
#pragma omp barrier
    }
    multiply(1, o_m, sc.attn, h, nothing);
    if (pan != nullptr) {
#pragma omp barrier
      norm_rows(h, pan, h);
    }
#pragma omp barrier
    {
      auto [r0, r1] = rows(T);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t i = 0; i < H; ++i) h[r * H + i] += xp[r * H + i];
        norm_row(h + r * H, norm2, H, eps, off, sc.hn + r * H);
      }
    }
#pragma omp barrier
    {
      // Gate and up features j and I + j belong to the same chunk, whose thread applies the
      // activation at once.
      float *gu = sc.gu, *a = sc.a;
      if (T > FEW) pack_rows(sc.hn, T, H, xt);
      Chunks(I, chunk_rows(H, T), nt, next + 2 * nt).run(t, [&](int64_t j0, int64_t j1) {
        linear_rows(sc.hn, xt, T, H, gate_up, nullptr, j0, j1, gu, 2 * I);
        linear_rows(sc.hn, xt, T, H, gate_up, nullptr, I + j0, I + j1, gu, 2 * I);
        for (int64_t r = 0; r < T; ++r)
          gate_row(gu + r * 2 * I + j0, gu + r * 2 * I + I + j0, j1 - j0, act, a + r * I + j0);
      });
    }
#pragma omp barrier
    if (pmn != nullptr) {
      multiply(3, down_m, sc.a, y, nothing);
#pragma omp barrier
      auto [r0, r1] = rows(T);
      for (int64_t r = r0; r < r1; ++r) {
        norm_row(y + r * H, pmn, H, eps, off, y + r * H);
        for (int64_t i = 0; i < H; ++i) y[r * H + i] += h[r * H + i];
      }
    } else {
      multiply(3, down_m, sc.a, y, [&](int64_t n0, int64_t n1) {
        for (int64_t r = 0; r < T; ++r)
          for (int64_t i = n0; i < n1; ++i) y[r * H + i] += h[r * H + i];
      });
    }
#pragma omp barrier
  }
};

// x [T, hidden] through L layers: per layer cos, sin [T, head_dim], caches, and its group's
// slots, block tables, lengths, prefix lengths, cu_seqlens_q, number of decodes and window; and
// twelve entries of `weights` (see DecoderLayer; None for an absent optional one).
at::Tensor decoder_layers(const at::Tensor& x, at::TensorList cos, at::TensorList sin,
                          const c10::List<c10::optional<at::Tensor>>& weights,
                          at::TensorList k_caches, at::TensorList v_caches, at::TensorList slots,
                          at::TensorList block_tables, at::TensorList seq_lens,
                          at::TensorList prefix_lens, at::TensorList cu_seqlens_q,
                          at::IntArrayRef num_decodes, at::IntArrayRef windows, double eps,
                          double offset, double scale, int64_t num_heads, int64_t act) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, hidden] matrix");
  const int64_t L = k_caches.size();
  TORCH_CHECK(L > 0 && cos.size() == L && sin.size() == L && v_caches.size() == L &&
                  slots.size() == L && block_tables.size() == L && seq_lens.size() == L &&
                  prefix_lens.size() == L && cu_seqlens_q.size() == L &&
                  num_decodes.size() == L && windows.size() == L && weights.size() == 12 * L,
              "one cos, sin, cache pair, attention metadata and 12 weights per layer");
  const int64_t T = x.size(0), H = x.size(1), threads = at::get_num_threads();
  const int64_t D = k_caches[0].size(3), nq = num_heads * D;
  const LayerScratch scratch(T, H, nq + 2 * k_caches[0].size(2) * D, nq, required(weights, 10).size(1),
                             x.options());
  std::vector<DecoderLayer> layers;
  layers.reserve(L);
  for (int64_t l = 0; l < L; ++l) {
    layers.emplace_back(T, H, cos[l], sin[l], weights, 12 * l, k_caches[l], v_caches[l],
                        slots[l], block_tables[l], seq_lens[l], prefix_lens[l], cu_seqlens_q[l],
                        num_decodes[l], eps, offset, scale, num_heads, act, windows[l], scratch,
                        threads);
    TORCH_CHECK(layers[l].nqkv == layers[0].nqkv && layers[l].I == layers[0].I,
                "the layers must have one shape");
  }
  // Layer l reads outs[(l + 1) % 2] (x for the first) and writes outs[l % 2].
  const at::Tensor outs[2] = {at::empty({T, H}, x.options()), at::empty({T, H}, x.options())};
  const auto next = counters(DecoderLayer::COUNTERS * L, threads);
  const int64_t I = layers[0].I;
  const int64_t packed = T > FEW ? packed_size(T, std::max({H, nq, I})) : 0;
  const std::unique_ptr<float[]> xts(new float[threads * packed]);

#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    for (int64_t l = 0; l < L; ++l) {
      const float* in = l == 0 ? x.data_ptr<float>() : outs[(l + 1) % 2].data_ptr<float>();
      layers[l].run(t, nt, in, outs[l % 2].data_ptr<float>(), scratch,
                    next.get() + l * DecoderLayer::COUNTERS * threads, xts.get() + t * packed);
    }
  }
  return outs[(L - 1) % 2];
}

}  // namespace

TORCH_LIBRARY(kvserve_cpu, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? b=None) -> Tensor");
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window) -> Tensor");
  m.def("write_cache(Tensor(a!) cache, Tensor rows, Tensor slots) -> ()");
  m.def(
      "rotate_keys(Tensor(a!) cache, Tensor blocks, Tensor cos, Tensor sin, int start, "
      "bool interleaved) -> ()");
  m.def("rms_norm(Tensor x, Tensor w, float eps, float offset) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("gated_act(Tensor h, int act) -> Tensor");
  m.def(
      "decoder_layers(Tensor x, Tensor[] cos, Tensor[] sin, Tensor?[] weights, "
      "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor[] slots, Tensor[] block_tables, "
      "Tensor[] seq_lens, Tensor[] prefix_lens, Tensor[] cu_seqlens_q, int[] num_decodes, "
      "int[] windows, float eps, float offset, float scale, int num_heads, int act) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("linear", &linear);
  m.impl("decode_attention", &decode_attention);
  m.impl("write_cache", &write_cache);
  m.impl("rotate_keys", &rotate_keys);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope", &rope);
  m.impl("gated_act", &gated_act);
  m.impl("decoder_layers", &decoder_layers);
}
