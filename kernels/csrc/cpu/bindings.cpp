// The torch ops of the CPU kernels (library KVSERVE_OPS, a name per instruction set given by
// the build: kvserve_cpu_avx2, kvserve_cpu_avx512; loaded by kernels/cpu.py). Each op
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
#include "op_args.h"
#include "peak.h"
#include "pointwise.h"

namespace kvserve {
namespace {

// x [..., K] times the matrix of parts weights[i] (GGML type formats[i], bias biases[i]).
at::Tensor linear_op(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                     const c10::List<std::optional<at::Tensor>>& biases,
                     const std::vector<int64_t>& formats) {
  check_f32(x, "x");
  TORCH_CHECK(!weights.empty() && biases.size() == weights.size() &&
                  formats.size() == weights.size(),
              "one bias (or None) and one format per part");
  Matrix m;
  for (size_t i = 0; i < weights.size(); ++i) {
    const std::optional<at::Tensor> b = biases.get(i);
    add_part(m, "part " + std::to_string(i), weights[i],
             b.has_value() ? b->to(at::kFloat).contiguous() : at::Tensor(), formats[i]);
  }
  TORCH_CHECK(x.size(-1) == m.K, "x has ", x.size(-1), " features, the weight takes ", m.K);
  auto xc = x.reshape({-1, m.K}).contiguous();
  const int64_t M = xc.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = m.N;
  auto y = at::empty({M, m.N}, x.options());
  linear(m, xc.data_ptr<float>(), M, y.data_ptr<float>());
  return y.view(sizes);
}

// A block-format matrix w [rows, row bytes] of GGML type `type` repacked (qpacked.h).
at::Tensor repack_op(const at::Tensor& w, int64_t type) {
  TORCH_CHECK(known_format(type), "unknown block format (GGML type ", type, ")");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) % block_bytes(type) == 0,
              "the weight must be uint8 [rows, whole blocks of ", block_bytes(type), " bytes]");
  TORCH_CHECK(w.size(0) % PACK_ROWS == 0, "a repacked weight has a multiple of ", PACK_ROWS,
              " rows, not ", w.size(0));
  auto src = w.contiguous();
  auto out = at::empty_like(src);
  repack(type, src.data_ptr<uint8_t>(), src.size(0), src.size(1), out.data_ptr<uint8_t>());
  return out;
}

// Rows `rows` of a repacked matrix w (GGML type `type`) as float32 [len(rows), K].
at::Tensor dequantize_packed_op(const at::Tensor& w, int64_t type, const at::Tensor& rows) {
  TORCH_CHECK(known_format(type), "unknown block format (GGML type ", type, ")");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.size(0) % PACK_ROWS == 0 && w.size(1) % block_bytes(type) == 0,
              "a repacked weight is contiguous uint8 [a multiple of ", PACK_ROWS,
              " rows, whole blocks]");
  auto r = rows.to(at::kLong).contiguous();
  const int64_t n = r.numel(), K = w.size(1) / block_bytes(type) * block_values(type);
  const int64_t* ids = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < w.size(0), "row ", ids[i], " is out of range");
  auto out = at::empty({n, K}, w.options().dtype(at::kFloat));
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      dequantize_packed(type, w.data_ptr<uint8_t>(), w.size(1), ids[i],
                        out.data_ptr<float>() + i * K);
  });
  return out;
}

// q [B, Hq, Dk] -> [B, Hq, Dv], the caches read in their format; with scores, the counted
// sequences' attention added to them (sink_of).
at::Tensor decode_attention_op(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, double scale, int64_t window,
                               const std::optional<at::Tensor>& scores,
                               const std::optional<at::Tensor>& score_from,
                               const std::optional<at::Tensor>& recent_k,
                               const std::optional<at::Tensor>& recent_v,
                               const std::optional<at::Tensor>& recent_tables, int64_t recent) {
  check_f32(q, "q");
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t B = qc.size(0), Hq = qc.size(1), Dk = qc.size(2);
  check_paged(k_cache, v_cache, tables, lens, Hq, Dk);
  CacheView view = view_of(k_cache, v_cache, tables, window);
  std::optional<at::Tensor> rtables;
  if (recent_tables.has_value()) rtables = recent_tables->contiguous();
  view.recent = recent_of(recent_k, recent_v, rtables, recent, view, B);
  auto out = at::empty({B, Hq, view.v.dim}, qc.options());
  const Queries queries{qc.data_ptr<float>(), Hq * Dk, Hq, static_cast<float>(scale),
                        out.data_ptr<float>()};
  const ScoreSink sink = sink_of(scores, score_from, view.k, B, window);
  PagedAttention(view, queries, lens.data_ptr<int32_t>(), B, at::get_num_threads(), sink).run();
  return out;
}

// cache [N, bs, H, R] (each slot's H rows dense) at flat slots <- rows [T, H, D] quantized to
// its format; -1 skipped.
void write_cache_op(at::Tensor cache, const at::Tensor& rows, const at::Tensor& slots) {
  const CacheRows c = rows_of(cache);
  TORCH_CHECK(c.format != KvFormat::I4C, "int4 keys are written by their groups (kv_quant)");
  TORCH_CHECK(cache.stride(2) == cache.size(3), "cache slots must be dense");
  auto r = rows.to(at::kFloat).contiguous();
  auto sl = slots.to(at::kLong).contiguous();
  const int64_t T = r.size(0), row = r.numel() / std::max<int64_t>(T, 1);
  TORCH_CHECK(row == c.heads * c.dim && sl.numel() == T, "rows do not match the cache's slots");
  write_cache(c, r.data_ptr<float>(), sl.data_ptr<int64_t>(), T);
}

// Rotates the rotary values of every row of the float32 cache's `blocks` in place (see
// Rotation).
void rotate_keys_op(at::Tensor cache, const at::Tensor& blocks, const at::Tensor& cos,
                    const at::Tensor& sin, int64_t start, bool interleaved) {
  check_f32(cache, "cache");
  const CacheRows c = rows_of(cache);
  auto b = blocks.to(at::kLong).contiguous();
  auto co = cos.to(at::kFloat).contiguous();
  auto s = sin.to(at::kFloat).contiguous();
  const int64_t half = co.numel();
  TORCH_CHECK(s.numel() == half && start + 2 * half <= c.dim,
              "the rotary pairs do not fit the cache's rows");
  const Rotation rot{co.data_ptr<float>(), s.data_ptr<float>(), half, start, interleaved};
  rotate_keys(c, b.data_ptr<int64_t>(), b.numel(), rot);
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


}  // namespace
}  // namespace kvserve

// TORCH_LIBRARY pastes its name into identifiers: one more macro level expands KVSERVE_OPS.
#define KVSERVE_LIBRARY(name, m) TORCH_LIBRARY(name, m)
#define KVSERVE_LIBRARY_IMPL(name, m) TORCH_LIBRARY_IMPL(name, CPU, m)

KVSERVE_LIBRARY(KVSERVE_OPS, m) {
  m.def("linear(Tensor x, Tensor[] weights, Tensor?[] biases, int[] formats) -> Tensor");
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window, Tensor(a!)? scores=None, "
      "Tensor? score_from=None, Tensor? recent_k=None, Tensor? recent_v=None, "
      "Tensor? recent_tables=None, int recent=0) -> Tensor");
  m.def("write_cache(Tensor(a!) cache, Tensor rows, Tensor slots) -> ()");
  m.def(
      "rotate_keys(Tensor(a!) cache, Tensor blocks, Tensor cos, Tensor sin, int start, "
      "bool interleaved) -> ()");
  m.def("rms_norm(Tensor x, Tensor w, float eps, float offset) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("gated_act(Tensor h, int act) -> Tensor");
  m.def("repack(Tensor w, int type) -> Tensor");
  m.def("dequantize_packed(Tensor w, int type, Tensor rows) -> Tensor");
  // No tensor to dispatch on: one kernel for every backend.
  m.def("int8_peak(int iterations) -> float", &kvserve::int8_peak);
  // Per layer: cos, sin [T, head_dim], k and v caches, its group's attention metadata, its
  // weights by name (weight_names.size() entries of weights and weight_formats per layer, None
  // for an absent one), and its importance scores and score_from (None: none kept).
  m.def(
      "decoder_layers(Tensor x, Tensor[] cos, Tensor[] sin, str[] weight_names, "
      "Tensor?[] weights, int[] weight_formats, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor[] slots, "
      "Tensor[] block_tables, Tensor[] seq_lens, Tensor[] prefix_lens, Tensor[] cu_seqlens_q, "
      "int[] num_decodes, int[] windows, float eps, float offset, float scale, int num_heads, "
      "int act, Tensor(c!)?[] scores, Tensor?[] score_from, Tensor(d!)?[] recent_k, "
      "Tensor(e!)?[] recent_v, Tensor?[] recent_slots, Tensor?[] recent_tables, "
      "int[] recents) -> Tensor");
}

KVSERVE_LIBRARY_IMPL(KVSERVE_OPS, m) {
  m.impl("linear", &kvserve::linear_op);
  m.impl("decode_attention", &kvserve::decode_attention_op);
  m.impl("write_cache", &kvserve::write_cache_op);
  m.impl("rotate_keys", &kvserve::rotate_keys_op);
  m.impl("rms_norm", &kvserve::rms_norm_op);
  m.impl("rope", &kvserve::rope_op);
  m.impl("gated_act", &kvserve::gated_act_op);
  m.impl("repack", &kvserve::repack_op);
  m.impl("dequantize_packed", &kvserve::dequantize_packed_op);
  m.impl("decoder_layers",
         torch::CppFunction::makeFromBoxedFunction<&kvserve::decoder_layers_op>());
}
