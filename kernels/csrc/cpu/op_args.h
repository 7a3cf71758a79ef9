// What the torch ops share: the checks that resolve tensor arguments to the pointers and
// views the kernels take (bindings.cpp, layer_args.cpp), nothing else in the library sees a
// tensor.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "attention.h"
#include "linear.h"

namespace kvserve {

inline void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

// The KV-cache format a cache tensor's dtype names (kernels.kv_quant.KV_DTYPES).
inline KvFormat kv_format_of(const at::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kFloat: return KvFormat::F32;
    case at::kHalf: return KvFormat::F16;
    case at::kBFloat16: return KvFormat::BF16;
    case at::kChar: return KvFormat::I8;
    case at::kFloat8_e4m3fn: return KvFormat::FP8;
    // int4 keys per channel (kv_quant.per_channel): a row one byte longer than per token
    case at::kByte: return cache.size(3) % KV_GROUP_BYTES == 1 ? KvFormat::I4C : KvFormat::I4;
    default:
      TORCH_CHECK(false, "a KV cache must be float32, float16, bfloat16, int8, float8_e4m3fn or ",
                  "uint8 (int4), not ", cache.scalar_type());
  }
}

// A cache [blocks, bs, heads, row] on the CPU, each head's row dense and whole in its format.
inline CacheRows rows_of(const at::Tensor& cache) {
  TORCH_CHECK(cache.device().is_cpu() && cache.dim() == 4, "a KV cache must be 4-d, on the CPU");
  TORCH_CHECK(cache.stride(3) == 1, "cache rows must be dense");
  const KvFormat f = kv_format_of(cache);
  const int64_t e = cache.element_size(), D = kv_values(f, cache.size(3) * e);
  TORCH_CHECK(D > 0, "a ", cache.scalar_type(), " cache's rows of ", cache.size(3),
              " elements hold no whole row of values");
  return {static_cast<uint8_t*>(cache.data_ptr()), f, cache.size(0), cache.size(1),
          cache.size(2), D, cache.stride(0) * e, cache.stride(1) * e, cache.stride(2) * e};
}

inline void check_paged(const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t Hq,
                        int64_t Dk) {
  const CacheRows k = rows_of(k_cache), v = rows_of(v_cache);
  TORCH_CHECK(kv_pair_read(k.format, v.format),
              "the key and value caches must have one dtype, or two quantized ones");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block tables and lengths must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "block tables and lengths must be contiguous");
  TORCH_CHECK(Hq % k.heads == 0 && v.heads == k.heads && k.dim == Dk,
              "head shapes do not match the cache");
  // MLA's values are a prefix of its key rows: rotated as rows of their own only so.
  TORCH_CHECK(!stored_rotated(k.format) || hadamard_block(k.dim) == hadamard_block(v.dim),
              "quantized key and value rows must have the same rotation blocks");
}

// Caches checked by check_paged, read through block_tables.
inline CacheView view_of(const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_tables, int64_t window) {
  return {rows_of(k_cache), rows_of(v_cache), block_tables.data_ptr<int32_t>(),
          block_tables.size(1), window};
}

// A layer's recent rows (RecentRows): rk, rv [blocks, bs, heads, row] in one float format,
// read through tables [sequences, W] as rings of their last `tokens` positions; none when
// tokens is 0 (the tensors then unread).
inline RecentRows recent_of(const std::optional<at::Tensor>& rk,
                            const std::optional<at::Tensor>& rv,
                            const std::optional<at::Tensor>& tables, int64_t tokens,
                            const CacheView& main, int64_t B) {
  if (tokens == 0) return {};
  TORCH_CHECK(tokens > 0 && rk.has_value() && rv.has_value() && tables.has_value(),
              "recent rows need their key and value caches and block tables");
  const CacheRows k = rows_of(*rk), v = rows_of(*rv);
  TORCH_CHECK(!stored_rotated(k.format) && k.format == v.format,
              "recent rows are keys and values in one float format");
  TORCH_CHECK(k.heads == main.k.heads && v.heads == main.v.heads && k.dim == main.k.dim &&
                  v.dim == main.v.dim && k.bs == main.k.bs && v.bs == k.bs,
              "recent rows must have the main cache's heads, head sizes and block size");
  TORCH_CHECK(tables->scalar_type() == at::kInt && tables->is_contiguous() &&
                  tables->dim() == 2 && tables->size(0) == B,
              "the recent rows' block tables must be contiguous int32, one row per sequence");
  TORCH_CHECK(tables->size(1) * k.bs >= tokens,
              "the recent rows' ring is shorter than its tokens");
  return {k, v, tables->data_ptr<int32_t>(), tables->size(1), tokens};
}

// The importance scores beside a cache of rows k: float32 [blocks, bs, heads], contiguous,
// and score_from int32 [B]; none without scores (kernels.reference).
inline ScoreSink sink_of(const std::optional<at::Tensor>& scores,
                         const std::optional<at::Tensor>& score_from, const CacheRows& k,
                         int64_t B, int64_t window) {
  if (!scores.has_value() || !scores->defined()) return {};
  const at::Tensor& s = *scores;
  TORCH_CHECK(score_from.has_value() && score_from->defined(), "scores need score_from");
  const at::Tensor& from = *score_from;
  check_f32(s, "scores");
  TORCH_CHECK(s.is_contiguous() && s.dim() == 3 && s.size(0) == k.blocks && s.size(1) == k.bs &&
                  s.size(2) == k.heads,
              "scores must be contiguous [blocks, block size, KV heads] beside the cache");
  TORCH_CHECK(from.scalar_type() == at::kInt && from.is_contiguous() && from.numel() == B &&
                  from.device().is_cpu(),
              "score_from must be contiguous int32, one per sequence");
  TORCH_CHECK(window == 0, "importance scores are kept for full attention only");
  return {s.data_ptr<float>(), from.data_ptr<int32_t>()};
}

// Adds to m the part `name` of GGML type `type`: float32, float16 or bfloat16 [rows, K] when
// dense (types 0, 1 and 30), else uint8 [rows, row bytes] holding whole blocks of that format;
// its bias float32 [rows] or undefined. The first part sets m.K, the others must have as many
// inputs.
inline void add_part(Matrix& m, const std::string& name, const at::Tensor& w,
                     const at::Tensor& bias, int64_t type) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(), "the weight '", name,
              "' must be a contiguous matrix on the CPU");
  TORCH_CHECK(m.count < MAX_PARTS, "at most ", MAX_PARTS, " parts per matrix");
  int64_t K = w.size(1);
  if (is_dense(type)) {
    const at::ScalarType dtype = type == DENSE_F32   ? at::kFloat
                                 : type == DENSE_F16 ? at::kHalf
                                                     : at::kBFloat16;
    TORCH_CHECK(w.scalar_type() == dtype, "the dense weight '", name, "' of GGML type ", type,
                " must be ", dtype, ", not ", w.scalar_type());
  } else {
    const int64_t base = type % PACKED;
    TORCH_CHECK(known_format(base) && type < 2 * PACKED, "the weight '", name,
                "' has an unknown format (GGML type ", type, ")");
    TORCH_CHECK(w.scalar_type() == at::kByte && w.size(1) % block_bytes(base) == 0,
                "the weight '", name, "' must be uint8 [out, whole blocks of ",
                block_bytes(base), " bytes]");
    TORCH_CHECK(!is_packed(type) || w.size(0) % PACK_ROWS == 0, "the repacked weight '", name,
                "' must have a multiple of ", PACK_ROWS, " rows");
    K = w.size(1) / block_bytes(base) * block_values(base);
  }
  TORCH_CHECK(m.count == 0 || K == m.K, "the weight '", name, "' has ", K, " inputs, not ", m.K);
  if (bias.defined())
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() &&
                    bias.numel() == w.size(0),
                "the bias of '", name, "' must be contiguous float32 [", w.size(0), "]");
  m.K = K;
  m.add({w.data_ptr(), bias.defined() ? bias.data_ptr<float>() : nullptr, w.size(0),
         w.size(1) * w.element_size(), type});
}

// The boxed decoder_layers op (layer_args.cpp).
void decoder_layers_op(const c10::OperatorHandle& op, torch::jit::Stack* stack);

}  // namespace kvserve
