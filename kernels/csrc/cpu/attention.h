// Attention over the paged cache: decode (one query row per sequence, its context read
// through the block table) and, inside the fused layers, prefill chunks (their new keys and
// values read from the step's q|k|v rows, their prefix from the cache). Softmax in float32, as
// kernels.reference, which the tests compare with.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "cache.h"

namespace kvserve {

// One layer's paged cache as attention reads it: per sequence a row of `tables`, W blocks (a
// ring of W with a window), a slot's heads adjacent in its row. The value rows may have any
// stride (MLA's values are a view of its key rows).
struct CacheView {
  CacheRows k, v;
  const int32_t* tables;  // [sequences, W]
  int64_t W, window;      // window 0: none

  // Head 0's key and value rows of sequence b at position pos; the next positions of its block
  // follow k.s1 and v.s1 apart.
  std::pair<const float*, const float*> rows(int64_t b, int64_t pos) const {
    const int64_t logical = window > 0 ? (pos / k.bs) % W : pos / k.bs;
    const int64_t block = tables[b * W + logical], off = pos % k.bs;
    return {k.data + block * k.s0 + off * k.s1, v.data + block * v.s0 + off * v.s1};
  }
};

// A cache group's attention metadata for the step (kernels.paged.AttentionMetadata): B
// sequences, the first num_decodes with one new token each, then prefill chunks; sequence b's
// new tokens are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1, at positions
// prefix_lens[b] + j.
struct AttentionMeta {
  const int64_t* slots;  // per new token its flat cache slot, -1: not kept
  const int32_t *seq_lens, *prefix_lens, *cu_seqlens_q;
  int64_t B, num_decodes;
};

// Query rows: row r's head h at q + r * stride + h * head_dim, for h < heads; the scores
// scaled by `scale`; the output [rows, heads, value dim] at out.
struct Queries {
  const float* q;
  int64_t stride, heads;
  float scale;
  float* out;
};

// A thread's space for a unit's scores and row pointers, kept from unit to unit.
struct AttentionScratch {
  std::vector<float> scores;
  std::vector<const float*> krows, vrows;
};

// Paged decode attention for B sequences of lengths lens, one query row each. The work is a
// set of units, each a sequence's context or a part of it, all heads: a slot's heads are
// adjacent in the cache, so a unit reads whole blocks front to back. When the sequences are too
// few to occupy the threads (a batch of one), each context is cut into parts whose partial
// softmax results (max, sum and normalized output per query head) are merged after, as
// flash-decoding does.
struct PagedAttention {
  static constexpr int64_t MIN_PART = 32;  // positions
  CacheView cache;
  Queries q;
  const int32_t* lens;
  int64_t B, parts = 1;
  at::Tensor partial;  // [units, heads, 2 + value dim]: max, sum, output; only with parts > 1

  PagedAttention(const CacheView& cache, const Queries& q, const int32_t* lens, int64_t B,
                 int64_t threads);

  int64_t units() const { return B * parts; }
  void unit(int64_t u, AttentionScratch& s) const;
  // Query heads' rows of the output (B * heads of them) from the parts, when there are parts.
  int64_t rows_to_merge() const { return parts > 1 ? B * q.heads : 0; }
  void merge(int64_t row) const;
  // All the units, then the merges, on torch's threads.
  void run() const;

 private:
  int64_t first(int64_t b) const;
  int64_t span(int64_t b) const { return lens[b] - first(b); }
};

// Prefill chunks attending causally to themselves and to their cached prefix, as
// reference.prefill_attention: sequences num_decodes .. B - 1 of `meta`; the new tokens' keys
// and values are read from the step's q|k|v rows (the queries' rows: their keys follow the
// query heads, their values the keys), the prefix through the block table. The cache gets the
// new rows after. A unit is a block of up to ROWS query rows of one sequence and one KV head
// with its query heads: its keys and values stay in the CPU caches for all of them.
struct PrefillAttention {
  static constexpr int64_t ROWS = 16;
  CacheView cache;
  Queries q;
  const int32_t *prefix, *cu;
  std::vector<int64_t> seq, row0;  // per block of rows: its sequence and first row

  PrefillAttention(const CacheView& cache, const Queries& q, const AttentionMeta& meta);

  int64_t units() const { return static_cast<int64_t>(seq.size()) * cache.k.heads; }
  void unit(int64_t u, AttentionScratch& s) const;

 private:
  int64_t lowest(int64_t pos) const;
};

}  // namespace kvserve
