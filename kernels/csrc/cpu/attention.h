// Attention over the paged cache: decode (one query row per sequence, its context read
// through the block table) and, inside the fused layers, prefill chunks (their new keys and
// values read from rows written in the cache's format for them, their prefix from the cache).
// Rows are read in the cache's format (kv_format.h) a tile at a time, each tile by all the
// query heads that attend it, with a running softmax in float32 as flash attention keeps it;
// kernels.reference is what the tests compare with.
//
// Both may also add to the keys' importance scores (ScoreSink). A probability needs the final
// maximum and sum of its query's softmax, known only once all its keys are read: a unit keeps
// the weights exp(score - max) of its counted queries as the running softmax makes them, with
// the max of each tile's time (the pass over the cache stays one), turns them into
// probabilities at its end, and a later phase adds them to the scores.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "cache.h"

namespace kvserve {

// A layer's recent tokens (models.kv_spec.with_recent): each sequence's last `tokens`
// positions also held in rows of a float format (never rotated), a ring of W blocks per
// sequence. A query at position t reads its keys and values at t - tokens < p <= t from here,
// older ones from the main cache. tokens 0: none.
struct RecentRows {
  CacheRows k{}, v{};
  const int32_t* tables = nullptr;  // [sequences, W]
  int64_t W = 0, tokens = 0;

  std::pair<const uint8_t*, const uint8_t*> rows(int64_t b, int64_t pos) const {
    const int64_t block = tables[b * W + (pos / k.bs) % W], off = pos % k.bs;
    return {k.data + block * k.s0 + off * k.s1, v.data + block * v.s0 + off * v.s1};
  }
};

// One layer's paged cache as attention reads it: per sequence a row of `tables`, W blocks (a
// ring of W with a window), a slot's heads adjacent in its row. The value rows may have any
// stride (MLA's values are a view of its key rows); keys and values share a format, or are
// two quantized ones (kv_format.h, with_formats).
struct CacheView {
  CacheRows k, v;
  const int32_t* tables;  // [sequences, W]
  int64_t W, window;      // window 0: none
  RecentRows recent{};

  // Head 0's key and value rows of sequence b at position pos; the next positions of its block
  // follow k.s1 and v.s1 apart.
  std::pair<const uint8_t*, const uint8_t*> rows(int64_t b, int64_t pos) const {
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
  const int64_t* recent_slots = nullptr;  // per new token its slot in the recent rows' ring
};

// Query rows: row r's head h at q + r * stride + h * head_dim, for h < heads; the scores
// scaled by `scale`; the output [rows, heads, value dim] at out.
struct Queries {
  const float* q;
  int64_t stride, heads;
  float scale;
  float* out;
};

// Importance scores (kernels.reference, eviction by importance): `into` [cache slots, Hkv]
// float32 beside a layer's cache, in its block layout. A query row of sequence b whose slot is
// at least from[b] adds to each key it reads the probability it pays it, summed over the query
// heads of the key's KV head. Full attention only; into nullptr: no scores kept.
struct ScoreSink {
  float* into = nullptr;
  const int32_t* from = nullptr;
};

// The keys' scores are added in a phase of their own, split into `owners` (a power of two, at
// least the threads) by block: a block's scores are added by its owner alone, so that sequences
// sharing a block (a cached prefix) never add to one score at once.
int64_t score_owners(int64_t threads);

struct QueryState;
struct TileShape;

// A thread's space for a unit's rows, queries and tiles, kept from unit to unit.
struct AttentionScratch {
  std::vector<const uint8_t*> krows, vrows;  // the unit's rows (decode: of its first head)
  std::vector<const uint8_t*> rkrows, rvrows;  // prefill: the same positions' recent rows
  std::vector<const uint8_t*> ktile, vtile;  // a tile's rows of one head
  // I4C keys: each row's group's first row (decode: of the first head), those of the tile's
  // rows of one head, the rows' stride, and the codes of the group last read.
  std::vector<const uint8_t*> kgroups, kgtile;
  int64_t kstride = 0;
  ChannelCodes codes;
  std::vector<const float*> floats;          // a tile's rows as floats
  std::vector<float> tile, scores, rotated;  // converted rows, scores per query, rotated queries
  std::vector<float> scaled;                 // I4C keys: a query times a group's scales
  std::unique_ptr<float[]> kept;             // counted queries' weights (QueryState)
  int64_t kept_size = 0;
  std::vector<float> maxima;
  std::vector<QueryState> queries;

  AttentionScratch();
  ~AttentionScratch();
};

// Paged decode attention for B sequences of lengths lens, one query row each. The work is a
// set of units, each a sequence's context or a part of it, all heads: a slot's heads are
// adjacent in the cache, so a unit reads whole blocks front to back. When the sequences are too
// few to occupy the threads (a batch of one), each context is cut into parts whose partial
// softmax results (max, sum and normalized output per query head) are merged after, as
// flash-decoding does.
//
// With scores, each counted sequence keeps its keys' probabilities in `mass`, [rows, span]:
// without parts a row per KV head, its group's probabilities summed; with parts a row per query
// head, each part's relative to its own softmax until merge weighs it.
struct PagedAttention {
  static constexpr int64_t MIN_PART = 32;  // positions
  CacheView cache;
  Queries q;
  const int32_t* lens;
  int64_t B, parts = 1;
  at::Tensor partial;  // [units, heads, 2 + value dim]: max, sum, output; only with parts > 1
  ScoreSink sink;
  at::Tensor mass;
  std::vector<int64_t> mass_at;  // per sequence its rows' offset in mass; -1: not counted

  PagedAttention(const CacheView& cache, const Queries& q, const int32_t* lens, int64_t B,
                 int64_t threads, const ScoreSink& sink = {});

  int64_t units() const { return B * parts; }
  void unit(int64_t u, AttentionScratch& s) const;
  // Query heads' rows of the output (B * heads of them) from the parts, when there are parts.
  int64_t rows_to_merge() const { return parts > 1 ? B * q.heads : 0; }
  void merge(int64_t row) const;
  // The scores of the keys in the blocks of `owner` (score_owners), after the merges.
  void add_scores(int64_t owner, int64_t owners) const;
  // All the units, then the merges, then the scores, on torch's threads.
  void run() const;

 private:
  int64_t first(int64_t b) const;
  int64_t span(int64_t b) const { return lens[b] - first(b); }
  bool counted(int64_t b) const { return !mass_at.empty() && mass_at[b] >= 0; }
  int64_t rows_per_kv_head() const { return parts > 1 ? q.heads / cache.k.heads : 1; }
  template <KvFormat FK, KvFormat FV>
  void unit_in(int64_t u, AttentionScratch& s) const;
  // The unit's rows a .. end - 1 (s.krows, s.vrows: those of head 0 in k and v) taken by its
  // queries, a tile at a time.
  template <KvFormat FK, KvFormat FV>
  void attend_rows(int64_t a, int64_t end, const CacheRows& k, const CacheRows& v,
                   const TileShape& shape, AttentionScratch& s) const;
  void keep_probabilities(int64_t b, int64_t at, const QueryState* qs, int64_t tile) const;
};

// Where a prefill chunk's new keys and values are read: row r's key of head h at
// k + r * k_row + h * k_head (its value at v + r * v_row + h * v_head), bytes in the caches'
// formats, written for this step but not yet to the cache; with recent tokens, the same rows in
// the recent rows' format at rk, rv (r * r_row + h * r_head).
struct NewRows {
  uint8_t *k, *v;
  int64_t k_row, k_head, v_row, v_head;
  uint8_t *rk = nullptr, *rv = nullptr;
  int64_t r_row = 0, r_head = 0;
};

// Prefill chunks attending causally to themselves and to their cached prefix, as
// reference.prefill_attention: sequences num_decodes .. B - 1 of `meta`; the new tokens' keys
// and values are read from `fresh` (as the cache will give them back), the prefix through the
// block table. The cache gets the new rows after. A unit is a block of up to ROWS query rows
// of one sequence and one KV head with its query heads: each tile of its keys and values is
// read once for all of them.
//
// With scores, a block of rows with counted rows keeps in `mass` [KV heads, keys it reads] the
// probabilities its counted rows pay each key, summed; add_scores sums the blocks of a sequence.
struct PrefillAttention {
  static constexpr int64_t ROWS = 16;
  CacheView cache;
  Queries q;
  NewRows fresh;
  const int32_t *prefix, *cu;
  std::vector<int64_t> seq, row0;  // per block of rows: its sequence and first row
  std::vector<int64_t> blocks_of;  // sequence b's blocks of rows: blocks_of[b] .. blocks_of[b + 1]
  ScoreSink sink;
  at::Tensor mass;
  std::vector<int64_t> mass_at;  // per block of rows its offset in mass; -1: no row counted

  PrefillAttention(const CacheView& cache, const Queries& q, const AttentionMeta& meta,
                   const NewRows& fresh, const ScoreSink& sink = {});

  int64_t units() const { return static_cast<int64_t>(seq.size()) * cache.k.heads; }
  void unit(int64_t u, AttentionScratch& s) const;
  // The scores of the keys in the blocks of `owner` (score_owners), after every unit.
  void add_scores(int64_t owner, int64_t owners) const;

 private:
  int64_t lowest(int64_t pos) const;
  int64_t keys(int64_t i) const;           // block of rows i: the keys its last row reads
  int64_t first_counted(int64_t i) const;  // block of rows i: its first row that counts
  void rows_of_unit(int64_t b, int64_t h, int64_t lo, int64_t hi, int64_t first,
                    AttentionScratch& s) const;
  template <KvFormat FK, KvFormat FV>
  void unit_in(int64_t u, AttentionScratch& s) const;
};

}  // namespace kvserve
