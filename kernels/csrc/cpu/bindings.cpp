// The torch ops of the CPU kernels (library kvserve_cpu, loaded by kernels/cpu.py). Each op
// checks its tensors, resolves them to the pointers and views the kernels take, and calls the
// kernel; nothing else in the library sees a tensor argument. Each kernel has a plain torch
// counterpart (kernels.reference, models.layers) that the tests compare.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attention.h"
#include "cache.h"
#include "decoder_layer.h"
#include "linear.h"
#include "pointwise.h"

namespace kvserve {
namespace {

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

CacheRows rows_of(const at::Tensor& cache) {
  return {cache.data_ptr<float>(), cache.size(0),   cache.size(1),   cache.size(2),
          cache.size(3),           cache.stride(0), cache.stride(1), cache.stride(2)};
}

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

// Caches checked by check_paged, read through block_tables.
CacheView view_of(const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, int64_t window) {
  return {rows_of(k_cache), rows_of(v_cache), block_tables.data_ptr<int32_t>(),
          block_tables.size(1), window};
}

at::Tensor linear_op(const at::Tensor& x, const at::Tensor& w,
                     const std::optional<at::Tensor>& b) {
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
  const at::Tensor bc =
      b.has_value() && b->defined() ? b->to(at::kFloat).contiguous() : at::Tensor();
  const Matrix m{w.data_ptr<float>(), bc.defined() ? bc.data_ptr<float>() : nullptr, N, K};
  linear(m, xc.data_ptr<float>(), M, y.data_ptr<float>());
  return y.view(sizes);
}

// q [B, Hq, Dk] -> [B, Hq, Dv].
at::Tensor decode_attention_op(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, double scale, int64_t window) {
  check_f32(q, "q");
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t B = qc.size(0), Hq = qc.size(1), Dk = qc.size(2);
  check_paged(k_cache, v_cache, tables, lens, Hq, Dk);
  auto out = at::empty({B, Hq, v_cache.size(3)}, qc.options());
  const Queries queries{qc.data_ptr<float>(), Hq * Dk, Hq, static_cast<float>(scale),
                        out.data_ptr<float>()};
  PagedAttention(view_of(k_cache, v_cache, tables, window), queries, lens.data_ptr<int32_t>(), B,
                 at::get_num_threads())
      .run();
  return out;
}

// cache [N, bs, H, D] (each slot's [H, D] dense) at flat slots <- rows [T, H, D]; -1 skipped.
void write_cache_op(at::Tensor cache, const at::Tensor& rows, const at::Tensor& slots) {
  check_f32(cache, "cache");
  TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == cache.size(3),
              "cache slots must be dense");
  auto r = rows.to(at::kFloat).contiguous();
  auto sl = slots.to(at::kLong).contiguous();
  const int64_t T = r.size(0), row = r.numel() / std::max<int64_t>(T, 1);
  TORCH_CHECK(row == cache.size(2) * cache.size(3), "rows do not match the cache's slots");
  write_cache(rows_of(cache), r.data_ptr<float>(), sl.data_ptr<int64_t>(), T);
}

// Rotates the rotary values of every row of the cache's `blocks` in place (see Rotation).
void rotate_keys_op(at::Tensor cache, const at::Tensor& blocks, const at::Tensor& cos,
                    const at::Tensor& sin, int64_t start, bool interleaved) {
  check_f32(cache, "cache");
  TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1, "cache rows must be dense");
  auto b = blocks.to(at::kLong).contiguous();
  auto c = cos.to(at::kFloat).contiguous();
  auto s = sin.to(at::kFloat).contiguous();
  const int64_t half = c.numel();
  TORCH_CHECK(s.numel() == half && start + 2 * half <= cache.size(3),
              "the rotary pairs do not fit the cache's rows");
  const Rotation rot{c.data_ptr<float>(), s.data_ptr<float>(), half, start, interleaved};
  rotate_keys(rows_of(cache), b.data_ptr<int64_t>(), b.numel(), rot);
}

// RMSNorm over the last dimension.
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& w, double eps, double offset) {
  check_f32(x, "x");
  check_f32(w, "weight");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t D = wc.numel(), rows = xc.numel() / D;
  TORCH_CHECK(xc.size(-1) == D, "x has ", xc.size(-1), " features, the weight ", D);
  auto out = at::empty_like(xc);
  rms_norm(xc.data_ptr<float>(), wc.data_ptr<float>(), rows, D, eps, static_cast<float>(offset),
           out.data_ptr<float>());
  return out;
}

// x [T, H, D] rotated by position in the half-split layout; cos/sin [T, D].
at::Tensor rope_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_f32(x, "x");
  auto xc = x.contiguous();
  auto c = cos.to(at::kFloat).contiguous();
  auto s = sin.to(at::kFloat).contiguous();
  const int64_t T = xc.size(0), H = xc.size(1), D = xc.size(2);
  TORCH_CHECK(c.size(0) == T && c.size(1) == D, "cos/sin must be [T, head_dim]");
  auto out = xc.clone();
  rope(out.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), T, H, D);
  return out;
}

// act(h[:, :I]) * h[:, I:] for h [T, 2I]; act an Activation.
at::Tensor gated_act_op(const at::Tensor& h, int64_t act) {
  check_f32(h, "h");
  auto hc = h.contiguous();
  const int64_t I = hc.size(-1) / 2, rows = hc.numel() / (2 * I);
  auto sizes = hc.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, hc.options());
  gated_act(hc.data_ptr<float>(), rows, I, act, out.data_ptr<float>());
  return out;
}

// --- decoder_layers: its arguments read by name, each layer's weights bound by name. ---

// One layer's weights by name, as kernels.weights.DecoderLayerWeights.named_tensors() gives
// them (a matrix's bias as "<name>_bias"; None for an absent one). Each field of LayerWeights
// takes its own by name; a name that no field takes is refused, as is a missing required one.
class NamedWeights {
 public:
  NamedWeights(const std::vector<std::string>& names,
               const c10::List<std::optional<at::Tensor>>& weights, int64_t first) {
    for (size_t i = 0; i < names.size(); ++i)
      TORCH_CHECK(left_.emplace(names[i], weights.get(first + i)).second, "the weight name '",
                  names[i], "' is given twice");
  }

  // The norm weight `name` [size], nullptr when None (refused if required).
  const float* vector(const std::string& name, int64_t size, bool required = false) {
    const std::optional<at::Tensor> t = take(name);
    TORCH_CHECK(t.has_value() || !required, "the layer's weight '", name, "' is missing");
    if (!t.has_value()) return nullptr;
    TORCH_CHECK(t->numel() == size, "the layer's weight '", name, "' has ", t->numel(),
                " values, not ", size);
    return t->data_ptr<float>();
  }

  // The matrix `name` [out, in], required, and its bias "<name>_bias" [out] (None: none).
  Matrix matrix(const std::string& name, bool bias_allowed = true) {
    const std::optional<at::Tensor> w = take(name);
    TORCH_CHECK(w.has_value(), "the layer's weight '", name, "' is missing");
    TORCH_CHECK(w->dim() == 2, "the layer's weight '", name, "' must be a matrix");
    const std::string bias = name + "_bias";
    const float* b = vector(bias, w->size(0));
    TORCH_CHECK(b == nullptr || bias_allowed, "the layer's weight '", bias,
                "' must be None: the fused layer adds no bias there");
    return {w->data_ptr<float>(), b, w->size(0), w->size(1)};
  }

  // Once every field has taken its weight.
  void check_all_taken() const {
    TORCH_CHECK(left_.empty(), "unknown weight name '", left_.begin()->first,
                "' for the fused decoder layer");
  }

 private:
  // The weight `name`, removed from those left; nullopt when None or not given.
  std::optional<at::Tensor> take(const std::string& name) {
    const auto it = left_.find(name);
    if (it == left_.end()) return std::nullopt;
    std::optional<at::Tensor> t = it->second;
    left_.erase(it);
    if (!t.has_value() || !t->defined()) return std::nullopt;
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "the layer's weight '", name, "' must be contiguous float32 on the CPU");
    return t;
  }

  std::map<std::string, std::optional<at::Tensor>> left_;
};

LayerWeights layer_weights(NamedWeights named, int64_t hidden, int64_t head_dim) {
  LayerWeights w;
  w.input_norm = named.vector("input_norm", hidden, /*required=*/true);
  w.qkv = named.matrix("qkv");
  w.o = named.matrix("o");
  w.mlp_norm = named.vector("mlp_norm", hidden, /*required=*/true);
  w.gate_up = named.matrix("gate_up", /*bias_allowed=*/false);
  w.down = named.matrix("down", /*bias_allowed=*/false);
  w.q_norm = named.vector("q_norm", head_dim);
  w.k_norm = named.vector("k_norm", head_dim);
  w.post_attention_norm = named.vector("post_attention_norm", hidden);
  w.post_mlp_norm = named.vector("post_mlp_norm", hidden);
  named.check_all_taken();
  return w;
}

// The arguments of a boxed op (on the stack), by their names in its schema.
class Args {
 public:
  Args(const c10::OperatorHandle& op, const torch::jit::Stack& stack)
      : schema_(op.schema()), stack_(stack),
        first_(stack.size() - schema_.arguments().size()) {}

  const c10::IValue& operator[](const char* name) const {
    const std::optional<int> i = schema_.argumentIndexWithName(name);
    TORCH_INTERNAL_ASSERT(i.has_value(), "the op has no argument ", name);
    return stack_[first_ + *i];
  }

 private:
  const c10::FunctionSchema& schema_;
  const torch::jit::Stack& stack_;
  size_t first_;
};

// decoder_layers' per-layer lists (each weight_names.size() weights per layer), their sizes
// checked.
struct LayerLists {
  std::vector<at::Tensor> cos, sin, k_caches, v_caches, slots, block_tables, seq_lens,
      prefix_lens, cu_seqlens_q;
  std::vector<int64_t> num_decodes, windows;
  std::vector<std::string> weight_names;
  c10::List<std::optional<at::Tensor>> weights;
  size_t L;

  explicit LayerLists(const Args& a)
      : cos(a["cos"].toTensorVector()), sin(a["sin"].toTensorVector()),
        k_caches(a["k_caches"].toTensorVector()), v_caches(a["v_caches"].toTensorVector()),
        slots(a["slots"].toTensorVector()), block_tables(a["block_tables"].toTensorVector()),
        seq_lens(a["seq_lens"].toTensorVector()), prefix_lens(a["prefix_lens"].toTensorVector()),
        cu_seqlens_q(a["cu_seqlens_q"].toTensorVector()),
        num_decodes(a["num_decodes"].toIntVector()), windows(a["windows"].toIntVector()),
        weights(a["weights"].toOptionalTensorList()), L(k_caches.size()) {
    for (const c10::IValue& name : a["weight_names"].toListRef())
      weight_names.push_back(name.toStringRef());
    const size_t sizes[] = {cos.size(),          sin.size(),         v_caches.size(),
                            slots.size(),        block_tables.size(), seq_lens.size(),
                            prefix_lens.size(),  cu_seqlens_q.size(), num_decodes.size(),
                            windows.size()};
    const auto one_per_layer = [&](size_t n) { return n == L; };
    TORCH_CHECK(L > 0 && weights.size() == L * weight_names.size() &&
                    std::all_of(std::begin(sizes), std::end(sizes), one_per_layer),
                "one cos, sin, cache pair, attention metadata and set of named weights per layer");
  }
};

// Layer l's group's metadata, checked against the step's T rows: the number of decodes
// (num_decodes) and the rows of each sequence (cu_seqlens_q) agree.
AttentionMeta attention_meta(const LayerLists& lists, size_t l, int64_t T,
                             const at::Tensor& slots) {
  const at::Tensor &tables = lists.block_tables[l], &lens = lists.seq_lens[l];
  const at::Tensor &prefix = lists.prefix_lens[l], &cu = lists.cu_seqlens_q[l];
  const int64_t B = lens.numel(), nd = lists.num_decodes[l];
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
  TORCH_CHECK(slots.numel() == T, "one slot per new token");
  return {slots.data_ptr<int64_t>(), lens.data_ptr<int32_t>(), prefix.data_ptr<int32_t>(), q, B,
          nd};
}

// Layer l of the step; `kept` holds the converted tensors its pointers point into.
LayerInputs layer_inputs(const LayerLists& lists, size_t l, int64_t T, int64_t H, int64_t Hq,
                         std::vector<at::Tensor>& kept) {
  const at::Tensor &k_cache = lists.k_caches[l], &v_cache = lists.v_caches[l];
  const int64_t D = k_cache.size(3);
  check_paged(k_cache, v_cache, lists.block_tables[l], lists.seq_lens[l], Hq, D);
  const at::Tensor c = lists.cos[l].to(at::kFloat).contiguous();
  const at::Tensor s = lists.sin[l].to(at::kFloat).contiguous();
  const at::Tensor slots = lists.slots[l].to(at::kLong).contiguous();
  kept.insert(kept.end(), {c, s, slots});
  TORCH_CHECK(c.size(0) == T && c.size(1) == D && s.sizes() == c.sizes(),
              "cos/sin must be [T, head_dim]");
  NamedWeights named(lists.weight_names, lists.weights, l * lists.weight_names.size());
  return {layer_weights(std::move(named), H, D), c.data_ptr<float>(), s.data_ptr<float>(),
          view_of(k_cache, v_cache, lists.block_tables[l], lists.windows[l]),
          attention_meta(lists, l, T, slots)};
}

// x [T, hidden] through the layers (decoder_layer.h), the arguments read by name: the op takes
// more than a positional C++ signature reads well.
void decoder_layers_op(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const Args args(op, *stack);
  const at::Tensor x = args["x"].toTensor();
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, hidden] matrix");
  const int64_t T = x.size(0), H = x.size(1);
  const LayerConstants constants{args["eps"].toDouble(),
                                 static_cast<float>(args["offset"].toDouble()),
                                 static_cast<float>(args["scale"].toDouble()),
                                 args["num_heads"].toInt(), args["act"].toInt()};
  const LayerLists lists(args);
  std::vector<at::Tensor> kept;
  std::vector<LayerInputs> layers;
  for (size_t l = 0; l < lists.L; ++l)
    layers.push_back(layer_inputs(lists, l, T, H, constants.num_heads, kept));
  at::Tensor y = at::empty({T, H}, x.options());
  decoder_layers(x.data_ptr<float>(), T, H, layers, constants, y.data_ptr<float>());
  torch::jit::drop(*stack, op.schema().arguments().size());
  torch::jit::push(*stack, std::move(y));
}

}  // namespace
}  // namespace kvserve

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
  // Per layer: cos, sin [T, head_dim], k and v caches, its group's attention metadata, and its
  // weights by name (weight_names.size() entries of weights per layer, None for an absent one).
  m.def(
      "decoder_layers(Tensor x, Tensor[] cos, Tensor[] sin, str[] weight_names, "
      "Tensor?[] weights, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor[] slots, "
      "Tensor[] block_tables, Tensor[] seq_lens, Tensor[] prefix_lens, Tensor[] cu_seqlens_q, "
      "int[] num_decodes, int[] windows, float eps, float offset, float scale, int num_heads, "
      "int act) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("linear", &kvserve::linear_op);
  m.impl("decode_attention", &kvserve::decode_attention_op);
  m.impl("write_cache", &kvserve::write_cache_op);
  m.impl("rotate_keys", &kvserve::rotate_keys_op);
  m.impl("rms_norm", &kvserve::rms_norm_op);
  m.impl("rope", &kvserve::rope_op);
  m.impl("gated_act", &kvserve::gated_act_op);
  m.impl("decoder_layers",
         torch::CppFunction::makeFromBoxedFunction<&kvserve::decoder_layers_op>());
}
