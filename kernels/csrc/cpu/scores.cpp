// Importance scores: the probability mass the counted query rows pay each key, added to the
// scores beside the cache by the thread that owns the key's block, so that sequences sharing a
// block add to it without a race.
#include <algorithm>

#include "attention.h"
#include "vec.h"

namespace kvserve {

int64_t score_owners(int64_t threads) {
  int64_t n = 1;
  while (n < threads) n *= 2;
  return n;
}

namespace {

// f(slot, p0, p1) for each run p0 .. p1 - 1 of sequence b's positions lo .. hi - 1 that one
// block holds (slot: p0's), of the blocks that `owner` of `owners` owns (score_owners). Full
// attention: no ring.
template <class F>
void owned_runs(const CacheView& c, int64_t b, int64_t lo, int64_t hi, int64_t owner,
                int64_t owners, F&& f) {
  const int64_t bs = c.k.bs;
  for (int64_t i = lo / bs; i * bs < hi; ++i) {
    const int64_t block = c.tables[b * c.W + i], p0 = std::max(lo, i * bs);
    if ((block & (owners - 1)) == owner) f(block * bs + p0 - i * bs, p0, std::min(hi, i * bs + bs));
  }
}

// into[(p - p0) * H] += the sum over r < rows of src[r * stride + p], for p in p0 .. p1 - 1:
// one KV head's scores of a run of slots (each slot's H heads adjacent).
void add_run(const float* src, int64_t stride, int64_t rows, int64_t p0, int64_t p1, float* into,
             int64_t H) {
  for (int64_t c = p0; c < p1; c += 8) {
    const int64_t n = std::min<int64_t>(8, p1 - c);
    float sum[8] = {};
    if (n == 8) {
      vec8 acc = zero8();
      for (int64_t r = 0; r < rows; ++r) acc = add8(acc, load8(src + r * stride + c));
      store8(sum, acc);
    } else {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < n; ++i) sum[i] += src[r * stride + c + i];
    }
    for (int64_t i = 0; i < n; ++i) into[(c - p0 + i) * H] += sum[i];
  }
}

}  // namespace

void PagedAttention::add_scores(int64_t owner, int64_t owners) const {
  const int64_t H = cache.k.heads, per = rows_per_kv_head();
  for (int64_t b = 0; b < B; ++b) {
    if (!counted(b)) continue;
    const float* m = mass.data_ptr<float>() + mass_at[b];
    const int64_t whole = span(b);
    owned_runs(cache, b, 0, lens[b], owner, owners, [&](int64_t slot, int64_t p0, int64_t p1) {
      for (int64_t h = 0; h < H; ++h)
        add_run(m + h * per * whole, whole, per, p0, p1, sink.into + slot * H + h, H);
    });
  }
}

void PrefillAttention::add_scores(int64_t owner, int64_t owners) const {
  if (mass_at.empty()) return;
  const int64_t H = cache.k.heads;
  for (int64_t b = 0; b + 1 < static_cast<int64_t>(blocks_of.size()); ++b) {
    // The counted rows are the last of the chunk: its last block of rows has some if any has,
    // and reads every key that any reads.
    const int64_t i0 = blocks_of[b], i1 = blocks_of[b + 1];
    if (i0 == i1 || mass_at[i1 - 1] < 0) continue;
    owned_runs(cache, b, 0, keys(i1 - 1), owner, owners, [&](int64_t slot, int64_t p0, int64_t p1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t n = keys(i);
        if (mass_at[i] < 0 || n <= p0) continue;
        for (int64_t h = 0; h < H; ++h)
          add_run(mass.data_ptr<float>() + mass_at[i] + h * n, 0, 1, p0, std::min(p1, n),
                  sink.into + slot * H + h, H);
      }
    });
  }
}

}  // namespace kvserve
