#include "attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "vec.h"

namespace kvserve {
namespace {

// Key and value rows of n positions, a pointer per position.
struct KVRows {
  const float* const* k;
  const float* const* v;
  int64_t n;
};

// What the first pass over a unit's rows requests ahead, AHEAD rows further as it goes: the
// first k_floats of each key row and v_floats of each value row. The cache has usually left
// the CPU caches since the layer's last step (the weights streamed through them).
struct Lookahead {
  bool on = false;
  int64_t k_floats = 0, v_floats = 0;
};

constexpr int64_t AHEAD = 32;  // rows

// s[i] = exp(s[i] - mx) over n floats; returns their sum.
inline float exp_shifted(float* s, int64_t n, float mx) {
  const vec8 m = splat8(mx);
  vec8 acc = zero8();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const vec8 e = exp8(sub8(load8(s + i), m));
    store8(s + i, e);
    acc = add8(acc, e);
  }
  float total = hsum(acc);
  for (; i < n; ++i) total += (s[i] = std::exp(s[i] - mx));
  return total;
}

// s[i] = dot(q, kv.k[i]) * scale for i < kv.n, eight rows side by side so that their products
// do not wait on each other.
void scores_of(const float* q, const KVRows& kv, int64_t D, float scale, float* s,
               const Lookahead& ahead) {
  auto request = [](const float* row, int64_t d) {
    for (int64_t c = 0; c < d; c += 16) prefetch_l1(row + c);
  };
  const float* const* rows = kv.k;
  const int64_t n = kv.n;
  if (ahead.on)
    for (int64_t r = 0; r < std::min(n, AHEAD); ++r)
      request(rows[r], ahead.k_floats), request(kv.v[r], ahead.v_floats);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (ahead.on)
      for (int64_t r = i + AHEAD; r < std::min(n, i + AHEAD + 8); ++r)
        request(rows[r], ahead.k_floats), request(kv.v[r], ahead.v_floats);
    vec8 acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = zero8();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
      const vec8 qv = load8(q + d);
      for (int r = 0; r < 8; ++r) acc[r] = fma8(qv, load8(rows[i + r] + d), acc[r]);
    }
    store8(s + i, mul8(sum8(acc), splat8(scale)));
    for (; d < D; ++d)
      for (int r = 0; r < 8; ++r) s[i + r] += q[d] * rows[i + r][d] * scale;
  }
  for (; i < n; ++i) s[i] = dot(q, rows[i], D) * scale;
}

// out[c .. c + 8V) = scale * sum_i p[i] rows[i][c .. c + 8V), held in V registers.
template <int V>
inline void weighted_cols(const float* p, const float* const* rows, int64_t n, int64_t c,
                          float scale, float* out) {
  vec8 acc[V];
  for (int j = 0; j < V; ++j) acc[j] = zero8();
  for (int64_t i = 0; i < n; ++i) {
    const vec8 pi = splat8(p[i]);
    const float* row = rows[i] + c;
    for (int j = 0; j < V; ++j) acc[j] = fma8(pi, load8(row + 8 * j), acc[j]);
  }
  for (int j = 0; j < V; ++j) store8(out + c + 8 * j, mul8(acc[j], splat8(scale)));
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

// out[Dv] = softmax(scale * q . kv.k[i]) . kv.v over kv.n rows, the scores in `scores`;
// returns their max and the sum of exp(score - max) (0 with no rows).
std::pair<float, float> attend(const float* q, const KVRows& kv, int64_t Dk, int64_t Dv,
                               float scale, float* scores, float* out,
                               const Lookahead& ahead = {}) {
  const int64_t n = kv.n;
  scores_of(q, kv, Dk, scale, scores, ahead);
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, scores[i]);
  const float sum = n > 0 ? exp_shifted(scores, n, mx) : 0.f;
  weighted_sum(scores, kv.v, n, Dv, sum > 0 ? 1.f / sum : 0.f, out);
  return {mx, sum};
}

void resize(AttentionScratch& s, int64_t n) {
  s.scores.resize(n);
  s.krows.resize(n);
  s.vrows.resize(n);
}

}  // namespace

PagedAttention::PagedAttention(const CacheView& cache_, const Queries& q_, const int32_t* lens_,
                               int64_t B_, int64_t threads)
    : cache(cache_), q(q_), lens(lens_), B(B_) {
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max<int64_t>(longest, span(b));
  const int64_t wanted = (2 * threads + B - 1) / std::max<int64_t>(1, B);
  parts = std::max<int64_t>(1, std::min(wanted, longest / MIN_PART));
  if (parts > 1) partial = at::empty({units() * q.heads * (2 + cache.v.dim)}, at::kFloat);
}

int64_t PagedAttention::first(int64_t b) const {
  return cache.window > 0 ? std::max<int64_t>(0, lens[b] - cache.window) : 0;
}

void PagedAttention::unit(int64_t u, AttentionScratch& s) const {
  const int64_t b = u / parts, part = u % parts;
  const int64_t whole = span(b), lo = first(b) + whole * part / parts;
  const int64_t hi = first(b) + whole * (part + 1) / parts, n = hi - lo;
  resize(s, n);
  // Head 0's rows of positions lo .. hi - 1, one table lookup per block (a ring of W with a
  // window); each further head's rows are these moved by the head stride.
  const CacheRows &k = cache.k, &v = cache.v;
  for (int64_t pos = lo; pos < hi;) {
    const auto [kr, vr] = cache.rows(b, pos);
    const int64_t m = std::min(k.bs - pos % k.bs, hi - pos);
    for (int64_t j = 0; j < m; ++j) {
      s.krows[pos - lo + j] = kr + j * k.s1;
      s.vrows[pos - lo + j] = vr + j * v.s1;
    }
    pos += m;
  }
  const int64_t Hq = q.heads, G = Hq / k.heads, Dk = k.dim, Dv = v.dim;
  const KVRows kv{s.krows.data(), s.vrows.data(), n};
  for (int64_t h = 0; h < k.heads; ++h) {
    if (h > 0)
      for (int64_t i = 0; i < n; ++i) s.krows[i] += k.s2, s.vrows[i] += v.s2;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t hq = h * G + g;
      // The first pass requests every head's rows ahead.
      const Lookahead ahead{h == 0 && g == 0, (k.heads - 1) * k.s2 + Dk,
                            (k.heads - 1) * v.s2 + Dv};
      float* p = parts > 1 ? partial.data_ptr<float>() + (u * Hq + hq) * (2 + Dv) : nullptr;
      float* out = p != nullptr ? p + 2 : q.out + (b * Hq + hq) * Dv;
      const auto [mx, sum] =
          attend(q.q + b * q.stride + hq * Dk, kv, Dk, Dv, q.scale, s.scores.data(), out, ahead);
      if (p != nullptr) p[0] = mx, p[1] = sum;
    }
  }
}

void PagedAttention::merge(int64_t row) const {
  const int64_t Hq = q.heads, Dv = cache.v.dim;
  const int64_t b = row / Hq, hq = row % Hq, stride = Hq * (2 + Dv);  // part to part
  const float* p0 = partial.data_ptr<float>() + (b * parts * Hq + hq) * (2 + Dv);
  float mx = -INFINITY, total = 0.f;
  for (int64_t i = 0; i < parts; ++i) mx = std::max(mx, p0[i * stride]);
  for (int64_t i = 0; i < parts; ++i) total += p0[i * stride + 1] * std::exp(p0[i * stride] - mx);
  float* o = q.out + row * Dv;
  std::fill_n(o, Dv, 0.f);
  for (int64_t i = 0; i < parts; ++i) {
    const float* p = p0 + i * stride;
    if (p[1] == 0.f) continue;  // an empty part
    const float w = p[1] * std::exp(p[0] - mx) / total;
    for (int64_t c = 0; c < Dv; ++c) o[c] += w * p[2 + c];
  }
}

void PagedAttention::run() const {
  at::parallel_for(0, units(), 1, [&](int64_t u0, int64_t u1) {
    AttentionScratch scratch;
    for (int64_t u = u0; u < u1; ++u) unit(u, scratch);
  });
  at::parallel_for(0, rows_to_merge(), 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) merge(r);
  });
}

PrefillAttention::PrefillAttention(const CacheView& cache_, const Queries& q_,
                                   const AttentionMeta& meta)
    : cache(cache_), q(q_), prefix(meta.prefix_lens), cu(meta.cu_seqlens_q) {
  for (int64_t b = meta.num_decodes; b < meta.B; ++b) {
    TORCH_CHECK(prefix[b] >= 0 && (cache.window > 0 || prefix[b] <= cache.W * cache.k.bs),
                "a prefix is longer than its block table");
    for (int64_t r = cu[b]; r < cu[b + 1]; r += ROWS) seq.push_back(b), row0.push_back(r);
  }
}

int64_t PrefillAttention::lowest(int64_t pos) const {
  return cache.window > 0 ? std::max<int64_t>(0, pos - cache.window + 1) : 0;
}

void PrefillAttention::unit(int64_t u, AttentionScratch& s) const {
  const int64_t Hkv = cache.k.heads, D = cache.k.dim, G = q.heads / Hkv;
  const int64_t b = seq[u / Hkv], h = u % Hkv, r0 = row0[u / Hkv];
  const int64_t c0 = cu[b], r1 = std::min<int64_t>(r0 + ROWS, cu[b + 1]), P = prefix[b];
  const int64_t lo = lowest(P + r0 - c0), hi = P + r1 - c0, n = hi - lo;
  resize(s, n);
  for (int64_t pos = lo; pos < hi; ++pos) {
    const float *kr, *vr;
    if (pos < P) {
      const auto [k0, v0] = cache.rows(b, pos);
      kr = k0 + h * cache.k.s2, vr = v0 + h * cache.v.s2;
    } else {
      kr = q.q + (c0 + pos - P) * q.stride + q.heads * D + h * D;
      vr = kr + Hkv * D;
    }
    s.krows[pos - lo] = kr, s.vrows[pos - lo] = vr;
  }
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t pos = P + r - c0, a = lowest(pos) - lo, m = pos - lowest(pos) + 1;
    const KVRows kv{s.krows.data() + a, s.vrows.data() + a, m};
    for (int64_t hq = h * G; hq < (h + 1) * G; ++hq)
      attend(q.q + r * q.stride + hq * D, kv, D, D, q.scale, s.scores.data(),
             q.out + (r * q.heads + hq) * D);
  }
}

}  // namespace kvserve
