// How the kernels split work over torch's intra-op threads (OpenMP's, in an x86 build of
// torch): inside one parallel region, a thread either takes its fixed share of rows or claims
// chunks of a matrix's output features (Chunks).
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

namespace kvserve {

// This thread's place in its parallel region: thread t of nt.
struct Team {
  int64_t t, nt;

  static Team current() { return {omp_get_thread_num(), omp_get_num_threads()}; }

  // This thread's share of n rows or tasks: [first, last).
  std::pair<int64_t, int64_t> share(int64_t n) const { return {n * t / nt, n * (t + 1) / nt}; }
};

struct alignas(64) Counter {
  std::atomic<int64_t> taken{0};
};

// Zeroed counters for `uses` uses of Chunks by `threads` threads.
inline std::unique_ptr<Counter[]> counters(int64_t uses, int64_t threads) {
  return std::unique_ptr<Counter[]>(new Counter[uses * threads]);
}

// n items (a matrix's output features) in chunks of `size` that the threads claim. Each thread
// starts with its own share (a contiguous run of weight rows, read front to back) and then
// takes what is left of the others', so that a thread whose memory reads ran slower this time
// does not keep the others waiting at the next barrier for more than one chunk. `next` holds a
// zeroed counter per thread (chunks of its share taken so far), each on a cache line of its
// own: counters that share a line make every claim move the line between cores.
struct Chunks {
  int64_t n, size, nt;
  Counter* next;

  Chunks(int64_t n_, int64_t size_, int64_t nt_, Counter* next_)
      : n(n_), size(size_), nt(nt_), next(next_) {}

  // f(first, last) for each chunk thread t claims.
  template <class F>
  void run(int64_t t, F&& f) const {
    const int64_t total = (n + size - 1) / size;
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t s = (t + i) % nt;  // its own share first
      const int64_t c0 = total * s / nt, c1 = total * (s + 1) / nt;
      for (int64_t c; (c = c0 + next[s].taken.fetch_add(1, std::memory_order_relaxed)) < c1;)
        f(c * size, std::min(n, (c + 1) * size));
    }
  }
};

}  // namespace kvserve
