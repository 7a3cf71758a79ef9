#include "decoder_layer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "pointwise.h"
#include "threads.h"

namespace kvserve {
namespace {

// The step's activations, shared by the layers (all of one shape): normed input, q|k|v,
// attention output, h, normed h, gate|up, act; and the new keys and values in a quantized
// cache's format (`fresh` bytes, keys then values), as prefill attention reads them.
struct LayerScratch {
  at::Tensor buf, fresh_buf;
  float *xn, *qkv, *attn, *h, *hn, *gu, *a;
  uint8_t* fresh;

  LayerScratch(int64_t T, int64_t H, int64_t nqkv, int64_t nq, int64_t I, int64_t fresh_bytes)
      : buf(at::empty({T * (H + nqkv + nq + H + H + 2 * I + I)}, at::kFloat)),
        fresh_buf(at::empty({fresh_bytes}, at::kByte)), fresh(fresh_buf.data_ptr<uint8_t>()) {
    xn = buf.data_ptr<float>();
    qkv = xn + T * H;
    attn = qkv + T * nqkv;
    h = attn + T * nq;
    hn = h + T * H;
    gu = hn + T * H;
    a = gu + T * 2 * I;
  }
};

// A thread's side of one layer's run: its products (its place and packing space), the layer's
// claim counters (DecoderLayer::USES per thread of the region) and the step's activations.
struct Pass {
  Products products;
  Counter* counters;
  const LayerScratch& sc;

  Team team() const { return products.team; }
  Counter* next(int64_t use) const { return counters + use * products.team.nt; }
};

constexpr auto nothing = [](int64_t, int64_t) {};

// One layer's weights, cache and attention plan, checked and resolved to pointers before the
// parallel region.
struct DecoderLayer {
  // The layer's claim counters: its matrices', then its attention units' (the decodes', then
  // the prefill chunks').
  enum Use : int64_t { QKV, O, GATE_UP, DOWN, ATTENTION, USES };

  LayerWeights w;
  const float *cos, *sin;
  CacheRows k_cache, v_cache;
  RecentRows recent;            // the layer's recent rows (tokens 0: none)
  const int64_t* slot;
  const int64_t* recent_slot;  // per new token its slot among the recent rows
  int64_t T, nd, H, Hq, Hkv, D, nq, nkv, nqkv, I, act;
  double eps;
  float off;
  NewRows fresh;            // the prefill chunks' keys and values as the cache gives them back
  PagedAttention paged;     // the decodes: rows 0 .. nd - 1
  PrefillAttention chunks;  // the prefill chunks: rows nd .. T - 1
  bool scored;              // whether attention adds to importance scores

  DecoderLayer(const LayerInputs& in, const LayerConstants& c, int64_t T_, int64_t H_,
               const LayerScratch& sc, int64_t threads)
      : w(in.weights), cos(in.cos), sin(in.sin), k_cache(in.cache.k), v_cache(in.cache.v),
        recent(in.cache.recent), slot(in.meta.slots), recent_slot(in.meta.recent_slots), T(T_),
        nd(in.meta.num_decodes), H(H_), Hq(c.num_heads),
        Hkv(k_cache.heads), D(k_cache.dim), nq(Hq * D), nkv(Hkv * D), nqkv(nq + 2 * nkv),
        I(w.down.K), act(c.act), eps(c.eps), off(c.norm_offset), fresh(new_rows(sc)),
        paged(in.cache, {sc.qkv, nqkv, Hq, c.scale, sc.attn}, in.meta.seq_lens, nd, threads,
              in.scores),
        chunks(in.cache, {sc.qkv, nqkv, Hq, c.scale, sc.attn}, in.meta, fresh, in.scores),
        scored(in.scores.into != nullptr) {
    TORCH_CHECK(v_cache.dim == D && k_cache.s2 == k_cache.row_bytes() &&
                    v_cache.s2 == v_cache.row_bytes(),
                "the layer's cache slots must be dense [heads, head_dim] rows");
    TORCH_CHECK(w.qkv.N == nqkv && w.qkv.K == H && w.o.N == H && w.o.K == nq &&
                    w.gate_up.N == 2 * I && w.gate_up.K == H && w.down.N == H,
                "the layer's weights do not have the shapes of its heads and hidden size");
    for (int64_t r = 0; r < T; ++r)
      TORCH_CHECK(slot[r] < k_cache.slots(), "slot ", slot[r], " is outside the cache");
    TORCH_CHECK(k_cache.format != KvFormat::I4C || recent.tokens > 0,
                "int4 keys go with their recent rows");
    if (recent.tokens == 0) return;
    TORCH_CHECK(k_cache.format != KvFormat::F32, "recent rows go beside a quantized cache");
    TORCH_CHECK(recent_slot != nullptr && recent.v.dim == D && recent.k.heads == Hkv &&
                    recent.k.s2 == recent.k.row_bytes() && recent.v.s2 == recent.v.row_bytes(),
                "the recent rows must be dense [heads, head_dim] rows with a slot per token");
    for (int64_t r = 0; r < T; ++r)
      TORCH_CHECK(recent_slot[r] < recent.k.slots(), "recent slot ", recent_slot[r],
                  " is outside the cache");
  }

  // Where prefill attention reads the new keys and values: a float32 cache's are the q|k|v
  // rows themselves, a quantized cache's are written to sc.fresh as the cache will hold them,
  // and after them, with recent rows, as those hold them.
  NewRows new_rows(const LayerScratch& sc) const {
    if (k_cache.format == KvFormat::F32) {
      auto* k = reinterpret_cast<uint8_t*>(sc.qkv + nq);
      return {k, k + 4 * nkv, 4 * nqkv, 4 * D, 4 * nqkv, 4 * D};
    }
    const int64_t Rk = k_cache.row_bytes(), Rv = v_cache.row_bytes();
    NewRows rows{sc.fresh, sc.fresh + T * Hkv * Rk, Hkv * Rk, Rk, Hkv * Rv, Rv};
    if (recent.tokens > 0) {
      const int64_t R = recent.k.row_bytes();
      rows.rk = rows.v + T * Hkv * Rv, rows.rv = rows.rk + T * Hkv * R;
      rows.r_row = Hkv * R, rows.r_head = R;
    }
    return rows;
  }

  // This thread's part of y [T, H] = the layer of x [T, H]; ends with a barrier.
  void run(const Pass& p, const float* x, float* y) const {
    attention_half(p, x);
    mlp_half(p, y);
  }

  // h = x + [post_attention_norm](o(attention(...))) and hn = mlp_norm(h), into p.sc.
  void attention_half(const Pass& p, const float* x) const {
    const LayerScratch& sc = p.sc;
    norm_rows(p.team(), x, w.input_norm, sc.xn);
#pragma omp barrier
    p.products.multiply(w.qkv, sc.xn, sc.qkv, p.next(QKV), nothing);
#pragma omp barrier
    prepare_heads(p.team(), sc.qkv);
#pragma omp barrier
    attend(p);
#pragma omp barrier
    if (paged.rows_to_merge() > 0 || T > nd) {
      finish_attention(p.team());
#pragma omp barrier
      if (k_cache.format == KvFormat::I4C && T > nd) {
        write_chunk_groups(p.team());
#pragma omp barrier
      }
    }
    if (scored) add_scores(p.team());  // no barrier after: nothing in the layers reads them
    p.products.multiply(w.o, sc.attn, sc.h, p.next(O), nothing);
    if (w.post_attention_norm != nullptr) {
#pragma omp barrier
      norm_rows(p.team(), sc.h, w.post_attention_norm, sc.h);
    }
#pragma omp barrier
    auto [r0, r1] = p.team().share(T);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < H; ++i) sc.h[r * H + i] += x[r * H + i];
      norm_row(sc.h + r * H, w.mlp_norm, H, eps, off, sc.hn + r * H);
    }
#pragma omp barrier
  }

  // y = h + [post_mlp_norm](down(act(gate) * up)(hn)).
  void mlp_half(const Pass& p, float* y) const {
    const float* h = p.sc.h;
    gate_up(p);
#pragma omp barrier
    if (w.post_mlp_norm != nullptr) {
      p.products.multiply(w.down, p.sc.a, y, p.next(DOWN), nothing);
#pragma omp barrier
      auto [r0, r1] = p.team().share(T);
      for (int64_t r = r0; r < r1; ++r) {
        norm_row(y + r * H, w.post_mlp_norm, H, eps, off, y + r * H);
        for (int64_t i = 0; i < H; ++i) y[r * H + i] += h[r * H + i];
      }
    } else {
      p.products.multiply(w.down, p.sc.a, y, p.next(DOWN), [&](int64_t n0, int64_t n1) {
        for (int64_t r = 0; r < T; ++r)
          for (int64_t i = n0; i < n1; ++i) y[r * H + i] += h[r * H + i];
      });
    }
#pragma omp barrier
  }

  // This thread's rows of out = RMSNorm(in) with weight `norm`; out may be in.
  void norm_rows(Team team, const float* in, const float* norm, float* out) const {
    auto [r0, r1] = team.share(T);
    for (int64_t r = r0; r < r1; ++r) norm_row(in + r * H, norm, H, eps, off, out + r * H);
  }

  // Per head row of q|k: normed (Gemma) and rotated; a decode's k and v written to the cache,
  // which its attention reads; a prefill chunk's to `fresh` in a quantized cache's format.
  void prepare_heads(Team team, float* qkv) const {
    auto [i0, i1] = team.share(T * (Hq + Hkv));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / (Hq + Hkv), head = i % (Hq + Hkv);
      float* row = qkv + r * nqkv + (head < Hq ? head * D : nq + (head - Hq) * D);
      const float* norm = head < Hq ? w.q_norm : w.k_norm;
      if (norm != nullptr) norm_row(row, norm, D, eps, off, row);
      rope_row(row, cos + r * D, sin + r * D, D);
      if (head < Hq) continue;
      if (w.k_offset != nullptr) {  // models.llama LlamaAttention.center_keys
        const float* o = w.k_offset + (head - Hq) * D;
        for (int64_t d = 0; d < D; ++d) row[d] -= o[d];
      }
      const int64_t h = head - Hq;
      if (r < nd) {
        if (slot[r] >= 0) store_kv(r, h, row);
        if (recent.tokens > 0 && recent_slot[r] >= 0) {
          store_row(recent.k.format, row, D, recent.k.slot(recent_slot[r]) + h * recent.k.s2);
          store_row(recent.v.format, row + nkv, D,
                    recent.v.slot(recent_slot[r]) + h * recent.v.s2);
        }
        if (k_cache.format == KvFormat::I4C) write_group(r, h);
      } else if (k_cache.format != KvFormat::F32) {
        // int4 keys: by their groups (write_chunk_groups); a chunk reads only whole cached ones
        if (k_cache.format != KvFormat::I4C)
          store_row(k_cache.format, row, D, fresh.k + r * fresh.k_row + h * fresh.k_head);
        store_row(v_cache.format, row + nkv, D, fresh.v + r * fresh.v_row + h * fresh.v_head);
        if (recent.tokens > 0) {
          const int64_t at = r * fresh.r_row + h * fresh.r_head;
          store_row(recent.k.format, row, D, fresh.rk + at);
          store_row(recent.v.format, row + nkv, D, fresh.rv + at);
        }
      }
    }
  }

  // Row r's key of KV head `head` (its value nkv floats further) to its cache slot.
  void store_kv(int64_t r, int64_t head, const float* k_row) const {
    if (k_cache.format != KvFormat::I4C)  // int4 keys: by their groups, above
      store_row(k_cache.format, k_row, D, k_cache.slot(slot[r]) + head * k_cache.s2);
    store_row(v_cache.format, k_row + nkv, D, v_cache.slot(slot[r]) + head * v_cache.s2);
  }

  void attend(const Pass& p) const {
    AttentionScratch scratch;
    const int64_t decodes = paged.units();
    Chunks(decodes + chunks.units(), 1, p.team().nt, p.next(ATTENTION))
        .run(p.team().t, [&](int64_t u, int64_t) {
          if (u < decodes) paged.unit(u, scratch);
          else chunks.unit(u - decodes, scratch);
        });
  }

  // The decodes' parts merged; the prefill chunks' k and v to the cache (as `fresh` holds
  // them), once their attention has read the ring slots a sliding-window chunk may overwrite.
  void finish_attention(Team team) const {
    auto [r0, r1] = team.share(paged.rows_to_merge());
    for (int64_t r = r0; r < r1; ++r) paged.merge(r);
    auto [i0, i1] = team.share((T - nd) * Hkv);
    const int64_t Rk = k_cache.row_bytes(), Rv = v_cache.row_bytes();
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = nd + i / Hkv, head = i % Hkv;
      if (recent.tokens > 0 && recent_slot[r] >= 0) {
        const int64_t at = r * fresh.r_row + head * fresh.r_head, R = recent.k.row_bytes();
        std::memcpy(recent.k.slot(recent_slot[r]) + head * recent.k.s2, fresh.rk + at, R);
        std::memcpy(recent.v.slot(recent_slot[r]) + head * recent.v.s2, fresh.rv + at, R);
      }
      if (slot[r] < 0) continue;
      if (k_cache.format != KvFormat::I4C)
        std::memcpy(k_cache.slot(slot[r]) + head * k_cache.s2,
                    fresh.k + r * fresh.k_row + head * fresh.k_head, Rk);
      std::memcpy(v_cache.slot(slot[r]) + head * v_cache.s2,
                  fresh.v + r * fresh.v_row + head * fresh.v_head, Rv);
    }
  }

  // int4 keys: a token that completes its group (a block holds whole groups, so its slot does
  // too) writes the group, head h's, from the recent rows, which hold all of it by then.
  void write_group(int64_t r, int64_t h) const {
    constexpr int64_t last = KV_CHANNEL_GROUP - 1;
    if (slot[r] < 0 || slot[r] % KV_CHANNEL_GROUP != last) return;
    store_channel_group(recent.k.format, recent.k.slot(recent_slot[r] - last) + h * recent.k.s2,
                        recent.k.s1, D, k_cache.slot(slot[r] - last) + h * k_cache.s2,
                        k_cache.s1);
  }

  // The groups of int4 keys the prefill chunks complete, once their recent rows are written.
  void write_chunk_groups(Team team) const {
    auto [i0, i1] = team.share((T - nd) * Hkv);
    for (int64_t i = i0; i < i1; ++i) write_group(nd + i / Hkv, i % Hkv);
  }

  // This thread's share of the keys' scores, once the decodes' parts are merged.
  void add_scores(Team team) const {
    const int64_t owners = score_owners(team.nt);
    auto [o0, o1] = team.share(owners);
    for (int64_t o = o0; o < o1; ++o) {
      paged.add_scores(o, owners);
      chunks.add_scores(o, owners);
    }
  }

  // a = act(gate) * up of hn. Gate and up features j and I + j belong to the same chunk, whose
  // thread applies the activation at once.
  void gate_up(const Pass& p) const {
    const LayerScratch& sc = p.sc;
    const Rows in = p.products.pack(sc.hn, w.gate_up);
    Chunks(I, chunk_rows(w.gate_up, T), p.team().nt, p.next(GATE_UP))
        .run(p.team().t, [&](int64_t j0, int64_t j1) {
          linear_rows(w.gate_up, in, j0, j1, sc.gu);
          linear_rows(w.gate_up, in, I + j0, I + j1, sc.gu);
          for (int64_t r = 0; r < T; ++r)
            gate_row(sc.gu + r * 2 * I + j0, sc.gu + r * 2 * I + I + j0, j1 - j0, act,
                     sc.a + r * I + j0);
        });
  }
};

}  // namespace

void decoder_layers(const float* x, int64_t T, int64_t H, const std::vector<LayerInputs>& inputs,
                    const LayerConstants& constants, float* y) {
  const int64_t L = inputs.size(), threads = at::get_num_threads();
  const LayerInputs& first = inputs.at(0);
  const int64_t D = first.cache.k.dim, nq = constants.num_heads * D;
  const int64_t nqkv = nq + 2 * first.cache.k.heads * D, I = first.weights.down.K;
  int64_t fresh_bytes = 0;
  for (const LayerInputs& in : inputs)
    if (in.cache.k.format != KvFormat::F32) {
      const RecentRows& r = in.cache.recent;
      const int64_t row = in.cache.k.row_bytes() + in.cache.v.row_bytes() +
                          (r.tokens > 0 ? r.k.row_bytes() + r.v.row_bytes() : 0);
      fresh_bytes = std::max(fresh_bytes, T * in.cache.k.heads * row);
    }
  const LayerScratch scratch(T, H, nqkv, nq, I, fresh_bytes);
  std::vector<DecoderLayer> layers;
  layers.reserve(L);
  for (const LayerInputs& in : inputs) {
    layers.emplace_back(in, constants, T, H, scratch, threads);
    TORCH_CHECK(layers.back().nqkv == nqkv && layers.back().I == I,
                "the layers must have one shape");
  }
  const auto next = counters(DecoderLayer::USES * L, threads);
  bool dense = false, half = false, quantized = false;
  for (const LayerInputs& in : inputs)
    for (const Matrix* m : {&in.weights.qkv, &in.weights.o, &in.weights.gate_up, &in.weights.down})
      dense |= m->has(false), half |= m->has_half(), quantized |= m->has(true);
  const PackSpace size(T, std::max({H, nq, I}), dense, half, quantized);
  const std::unique_ptr<char[]> spaces(new char[threads * size.bytes]);
  // Layer l writes outs[(L - 1 - l) % 2], the last one y, and reads its predecessor's output.
  const at::Tensor spare = at::empty({T * H}, at::kFloat);
  float* const outs[2] = {y, spare.data_ptr<float>()};

#pragma omp parallel num_threads(threads)
  {
    const Team team = Team::current();
    const Products products{team, T, size, spaces.get() + team.t * size.bytes};
    for (int64_t l = 0; l < L; ++l) {
      const Pass pass{products, next.get() + l * DecoderLayer::USES * threads, scratch};
      layers[l].run(pass, l == 0 ? x : outs[(L - l) % 2], outs[(L - 1 - l) % 2]);
    }
  }
}

}  // namespace kvserve
