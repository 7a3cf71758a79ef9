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

inline CacheRows rows_of(const at::Tensor& cache) {
  return {cache.data_ptr<float>(), cache.size(0),   cache.size(1),   cache.size(2),
          cache.size(3),           cache.stride(0), cache.stride(1), cache.stride(2)};
}

inline void check_paged(const at::Tensor& k_cache, const at::Tensor& v_cache,
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
inline CacheView view_of(const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, int64_t window) {
  return {rows_of(k_cache), rows_of(v_cache), block_tables.data_ptr<int32_t>(),
          block_tables.size(1), window};
}

// Adds to m the part `name` of GGML type `type`: float32 [rows, K] when dense (type 0), else
// uint8 [rows, row bytes] holding whole blocks of that format; its bias float32 [rows] or
// undefined. The first part sets m.K, the others must have as many inputs.
inline void add_part(Matrix& m, const std::string& name, const at::Tensor& w,
                     const at::Tensor& bias, int64_t type) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(), "the weight '", name,
              "' must be a contiguous matrix on the CPU");
  TORCH_CHECK(m.count < MAX_PARTS, "at most ", MAX_PARTS, " parts per matrix");
  int64_t K = w.size(1);
  if (type == 0) {
    TORCH_CHECK(w.scalar_type() == at::kFloat, "the dense weight '", name, "' must be float32");
  } else {
    TORCH_CHECK(known_format(type), "the weight '", name, "' has an unknown format (GGML type ",
                type, ")");
    TORCH_CHECK(w.scalar_type() == at::kByte && w.size(1) % block_bytes(type) == 0,
                "the weight '", name, "' must be uint8 [out, whole blocks of ",
                block_bytes(type), " bytes]");
    K = w.size(1) / block_bytes(type) * block_values(type);
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
