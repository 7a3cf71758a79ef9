// Pre-norm decoder layers for a step's T new tokens (decodes first, then prefill chunks), each
//   h = x + [post_attention_norm](o(attention(rope([q|k]_norm(qkv(input_norm(x)))))))
//   y = h + [post_mlp_norm](down(act(gate) * up)(mlp_norm(h)))
// Bracketed norms are optional (Gemma 3 has them, Llama not); all norms share eps and offset.
// It mirrors the modules of models/llama.py and models/gemma3.py, which stay the reference;
// each layer has its own cos/sin and its cache group's attention metadata (kernels.paged).
//
// All the layers are one parallel region: the matrices go in Chunks, and the phases between
// are separated by barriers, not by forking the threads again, allocating each intermediate or
// returning to Python between layers: fixed costs per layer that at batch 1 would add up to
// about a seventh of the step.
#pragma once

#include <cstdint>
#include <vector>

#include "attention.h"
#include "linear.h"

namespace kvserve {

// A layer's weights, named as kernels.weights.DecoderLayerWeights. Norms are [hidden], but
// q_norm and k_norm [head_dim]; nullptr for a norm the model does not have.
struct LayerWeights {
  const float* input_norm = nullptr;  // before attention
  Matrix qkv{};                       // q, k and v fused: [(Hq + 2 Hkv) head_dim, hidden]
  Matrix o{};                         // [hidden, Hq head_dim]
  const float* mlp_norm = nullptr;    // before the MLP
  Matrix gate_up{};                   // gate and up fused: [2 I, hidden]
  Matrix down{};                      // [hidden, I]
  const float* q_norm = nullptr;      // per head, on q and k
  const float* k_norm = nullptr;
  const float* post_attention_norm = nullptr;  // after attention, before the residual
  const float* post_mlp_norm = nullptr;        // after the MLP, before the residual
  const float* k_offset = nullptr;             // [Hkv, head_dim] off every key once rotated
};

// The constants of a model's layers.
struct LayerConstants {
  double eps;         // of every norm
  float norm_offset;  // added to every norm's weight (Gemma's 1)
  float scale;        // of the attention scores
  int64_t num_heads;  // query heads
  int64_t act;        // the MLP's Activation
};

// One layer of the step: its weights, the rotary cos and sin [T, head_dim] of each new token,
// its cache and its cache group's metadata, and the importance scores its attention adds to.
struct LayerInputs {
  LayerWeights weights;
  const float *cos, *sin;
  CacheView cache;
  AttentionMeta meta;
  ScoreSink scores;
};

// y [T, hidden] = the layers of x [T, hidden], on torch's threads; the layers' caches get the
// new tokens' keys and values, in their formats.
void decoder_layers(const float* x, int64_t T, int64_t hidden,
                    const std::vector<LayerInputs>& layers, const LayerConstants& constants,
                    float* y);

}  // namespace kvserve
