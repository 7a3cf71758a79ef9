// The decoder_layers op: its arguments read by name, each layer's weights bound by name.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "decoder_layer.h"
#include "op_args.h"

namespace kvserve {
namespace {

// One layer's weights by name, as kernels.weights.DecoderLayerWeights.named_tensors() gives
// them (a matrix's parts as "<slot>", "<slot>.1", ..., each one's bias as "<name>_bias"; None
// for an absent one) with their GGML types (named_formats). Each field of LayerWeights takes
// its own by name; a name that no field takes is refused, as is a missing required one.
class NamedWeights {
 public:
  NamedWeights(const std::vector<std::string>& names,
               const c10::List<std::optional<at::Tensor>>& weights,
               const std::vector<int64_t>& formats, int64_t first) {
    for (size_t i = 0; i < names.size(); ++i)
      TORCH_CHECK(left_.emplace(names[i], Named{weights.get(first + i), formats[first + i]})
                      .second,
                  "the weight name '", names[i], "' is given twice");
  }

  // The norm weight `name` [size], nullptr when None (refused if required).
  const float* vector(const std::string& name, int64_t size, bool required = false) {
    const std::optional<at::Tensor> t = take(name);
    TORCH_CHECK(t.has_value() || !required, "the layer's weight '", name, "' is missing");
    if (!t.has_value()) return nullptr;
    TORCH_CHECK(t->scalar_type() == at::kFloat, "the layer's weight '", name,
                "' must be float32");
    TORCH_CHECK(t->numel() == size, "the layer's weight '", name, "' has ", t->numel(),
                " values, not ", size);
    return t->data_ptr<float>();
  }

  // The matrix `slot`: its parts "<slot>", "<slot>.1", ... (the first required, the others
  // None past the layer's last part), each with its format and its bias "<name>_bias" (None:
  // none).
  Matrix matrix(const std::string& slot, bool bias_allowed = true) {
    Matrix m;
    for (int64_t i = 0; i < MAX_PARTS; ++i) {
      const std::string name = i == 0 ? slot : slot + "." + std::to_string(i);
      const auto it = left_.find(name);
      const int64_t type = it == left_.end() ? 0 : it->second.format;
      const std::optional<at::Tensor> w = take(name);
      const std::string bias = name + "_bias";
      const std::optional<at::Tensor> b = take(bias);
      TORCH_CHECK(w.has_value() || i > 0, "the layer's weight '", name, "' is missing");
      TORCH_CHECK(w.has_value() ? m.count == i : !b.has_value(), "the layer's weight '",
                  w.has_value() ? name : bias, "' follows a missing part");
      TORCH_CHECK(!b.has_value() || bias_allowed, "the layer's weight '", bias,
                  "' must be None: the fused layer adds no bias there");
      if (w.has_value()) add_part(m, name, *w, b.has_value() ? *b : at::Tensor(), type);
    }
    return m;
  }

  // Once every field has taken its weight.
  void check_all_taken() const {
    TORCH_CHECK(left_.empty(), "unknown weight name '", left_.begin()->first,
                "' for the fused decoder layer");
  }

 private:
  struct Named {
    std::optional<at::Tensor> tensor;
    int64_t format;
  };

  // The weight `name`, removed from those left; nullopt when None or not given.
  std::optional<at::Tensor> take(const std::string& name) {
    const auto it = left_.find(name);
    if (it == left_.end()) return std::nullopt;
    std::optional<at::Tensor> t = it->second.tensor;
    left_.erase(it);
    if (!t.has_value() || !t->defined()) return std::nullopt;
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), "the layer's weight '", name,
                "' must be contiguous on the CPU");
    return t;
  }

  std::map<std::string, Named> left_;
};

// The layer's matrices must have the shapes of its heads and hidden size.
LayerWeights layer_weights(NamedWeights named, int64_t hidden, int64_t head_dim,
                           int64_t kv_heads) {
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
  w.k_offset = named.vector("k_offset", kv_heads * head_dim);
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
  std::vector<int64_t> num_decodes, windows, formats, recents;
  std::vector<std::string> weight_names;
  c10::List<std::optional<at::Tensor>> weights, scores, score_from, recent_k, recent_v,
      recent_slots, recent_tables;
  size_t L;

  explicit LayerLists(const Args& a)
      : cos(a["cos"].toTensorVector()), sin(a["sin"].toTensorVector()),
        k_caches(a["k_caches"].toTensorVector()), v_caches(a["v_caches"].toTensorVector()),
        slots(a["slots"].toTensorVector()), block_tables(a["block_tables"].toTensorVector()),
        seq_lens(a["seq_lens"].toTensorVector()), prefix_lens(a["prefix_lens"].toTensorVector()),
        cu_seqlens_q(a["cu_seqlens_q"].toTensorVector()),
        num_decodes(a["num_decodes"].toIntVector()), windows(a["windows"].toIntVector()),
        formats(a["weight_formats"].toIntVector()),
        weights(a["weights"].toOptionalTensorList()),
        scores(a["scores"].toOptionalTensorList()),
        score_from(a["score_from"].toOptionalTensorList()),
        recent_k(a["recent_k"].toOptionalTensorList()),
        recent_v(a["recent_v"].toOptionalTensorList()),
        recent_slots(a["recent_slots"].toOptionalTensorList()),
        recent_tables(a["recent_tables"].toOptionalTensorList()),
        recents(a["recents"].toIntVector()), L(k_caches.size()) {
    for (const c10::IValue& name : a["weight_names"].toListRef())
      weight_names.push_back(name.toStringRef());
    const size_t sizes[] = {cos.size(),          sin.size(),         v_caches.size(),
                            slots.size(),        block_tables.size(), seq_lens.size(),
                            prefix_lens.size(),  cu_seqlens_q.size(), num_decodes.size(),
                            windows.size(),      scores.size(),       score_from.size(),
                            recent_k.size(),     recent_v.size(),     recent_slots.size(),
                            recent_tables.size(), recents.size()};
    const auto one_per_layer = [&](size_t n) { return n == L; };
    TORCH_CHECK(L > 0 && weights.size() == L * weight_names.size() &&
                    formats.size() == weights.size() &&
                    std::all_of(std::begin(sizes), std::end(sizes), one_per_layer),
                "one cos, sin, cache pair, attention metadata, set of named weights, scores "
                "and recent rows per layer");
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
  const int64_t D = rows_of(k_cache).dim;
  check_paged(k_cache, v_cache, lists.block_tables[l], lists.seq_lens[l], Hq, D);
  const at::Tensor c = lists.cos[l].to(at::kFloat).contiguous();
  const at::Tensor s = lists.sin[l].to(at::kFloat).contiguous();
  const at::Tensor slots = lists.slots[l].to(at::kLong).contiguous();
  kept.insert(kept.end(), {c, s, slots});
  TORCH_CHECK(c.size(0) == T && c.size(1) == D && s.sizes() == c.sizes(),
              "cos/sin must be [T, head_dim]");
  NamedWeights named(lists.weight_names, lists.weights, lists.formats,
                     l * lists.weight_names.size());
  CacheView view = view_of(k_cache, v_cache, lists.block_tables[l], lists.windows[l]);
  const int64_t B = lists.seq_lens[l].numel();
  view.recent = recent_of(lists.recent_k.get(l), lists.recent_v.get(l),
                          lists.recent_tables.get(l), lists.recents[l], view, B);
  AttentionMeta meta = attention_meta(lists, l, T, slots);
  if (view.recent.tokens > 0) {
    const std::optional<at::Tensor> rs = lists.recent_slots.get(l);
    TORCH_CHECK(rs.has_value(), "recent rows need their slots");
    const at::Tensor recent_slots = rs->to(at::kLong).contiguous();
    TORCH_CHECK(recent_slots.numel() == T, "one recent slot per new token");
    kept.push_back(recent_slots);
    meta.recent_slots = recent_slots.data_ptr<int64_t>();
  }
  const ScoreSink sink = sink_of(lists.scores.get(l), lists.score_from.get(l), view.k,
                                 lists.seq_lens[l].numel(), lists.windows[l]);
  return {layer_weights(std::move(named), H, D, k_cache.size(2)), c.data_ptr<float>(),
          s.data_ptr<float>(), view, meta, sink};
}

}  // namespace

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

}  // namespace kvserve
