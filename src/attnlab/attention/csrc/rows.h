// Where the cached rows live, contiguous or in the pages of a block table, and how they are walked: runs of rows
// at one stride (a page, or the whole row of a contiguous cache), the cache lines asked for ahead of use, and
// rows staged (widened, padded) into float32 buffers.
#pragma once

#include "vectors.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace attnlab_fused {

// Where the cached rows live: strided (table == nullptr), or paged: a pool (n_kv, slots, D) whose token t of
// batch row b sits at slot table[b * table_stride + t / block] + t % block.
template <typename T>
struct Rows {
  const T* base;
  int64_t row_stride, head_stride, token_stride;  // in elements
  const int64_t* table = nullptr;
  int64_t table_stride = 0, block = 1;
  int shift = -1;  // log2(block) for a power of two: a shift and a mask instead of a division (~25 cycles) per row

  const T* at(int64_t b, int64_t h, int64_t t) const {
    if (table == nullptr) return base + b * row_stride + h * head_stride + t * token_stride;
    const int64_t page = shift >= 0 ? t >> shift : t / block, in = shift >= 0 ? t & (block - 1) : t % block;
    return base + h * head_stride + (table[b * table_stride + page] + in) * token_stride;
  }
  // How many rows from t on lie at token_stride from at(b, h, t): the rest of its page (all, without a table).
  int64_t run(int64_t t) const {
    if (table == nullptr) return std::numeric_limits<int64_t>::max();
    return block - (shift >= 0 ? t & (block - 1) : t % block);
  }
};

// The rows t, t+1, ... of (b, h) one after another, a table lookup per page instead of per row.
template <typename T>
struct RowWalk {
  const Rows<T>& rows;
  int64_t b, h, t, left = 0;
  const T* p = nullptr;
  const T* next() {
    if (left == 0) {
      p = rows.at(b, h, t);
      left = rows.run(t);
    } else {
      p += rows.token_stride;
    }
    --left;
    ++t;
    return p;
  }
};

inline int log2_exact(int64_t x) {  // log2(x) for a power of two, else -1
  int s = 0;
  while (s < 62 && (int64_t{1} << s) < x) ++s;
  return (int64_t{1} << s) == x ? s : -1;
}

struct Item {  // one chunk [lo, hi) of the context of batch row b, KV head h
  int64_t b, h, lo, hi;
};

// run(i, next) for every chunk i < n of a parallel region, on each thread that calls it: chunks are handed out one
// at a time from the shared counter `taken`, so that a thread the machine slows down takes fewer, and each thread
// takes its next chunk (next, or -1) before it starts this one, so that it asks for that chunk's first block while
// finishing this one (the first block of a chunk otherwise starts cold: fp32, 32 heads over 1 KV head, 4096 tokens,
// 1.6x the time of the others). Against the static round-robin this replaced (benchmarks/kernel_ab.py, 32 heads of
// 128, KV from memory, 2 threads): 4 KV heads 1.08-1.16x in every run, AVX2 and AVX-512 builds, float32 and
// bfloat16 (both tile paths); other head counts 0.94-1.26x, within this shared machine's run-to-run noise.
template <typename F>
void for_each_chunk(std::atomic<int64_t>& taken, int64_t n, F&& run) {
  int64_t i = taken.fetch_add(1, std::memory_order_relaxed);
  while (i < n) {
    const int64_t next = taken.fetch_add(1, std::memory_order_relaxed);
    run(i, next < n ? next : -1);
    i = next;
  }
}

// Cache lines to ask for ahead of use, a few at every step of the tiles' inner loops. Spread like this, memory
// streams while the FMAs run; asked for in bursts (a block's rows at a time), the requests fill the line-fill
// buffers and the core waits for them to drain, so memory time and compute time add up. A 12-row queries-in-lanes
// tile streaming its rows from memory (32 FMAs per line, 2 threads, scratch harness): 11.5 GB/s with one burst per
// tile, 15.7 GB/s with one line per step of its dot products. The lines are kept as runs of consecutive lines (a
// contiguous block's keys: one run; paged: one per page) rather than listed one by one: writing the list cost ~17 %
// of a small group's time (3 queries of 64 dims, float32, one core, in cache: 66 -> 55 us per 1024 tokens; from
// memory on two threads 1.07x; the 20 shapes of docs/performance.md 1.00-1.20x but for float32 groups of 8, which
// measured 0.97-1.03x in the harness).
struct Ahead {
  struct Run {
    const char* p;  // first line (64-byte aligned)
    int64_t lines;
  };
  std::vector<Run> runs;
  int64_t n_runs = 0, total = 0, per = 1;  // runs, and lines in them
  int64_t r = 0, left = 0;                   // the run being asked for, and its lines not yet asked for
  const char* at = nullptr;
  // rows t0 .. t0+count-1 of `rows` (of `bytes` each) for item `it`, appended: one run per stretch of rows that
  // lie back to back (a contiguous cache: the whole block; paged: a page), else one per row
  template <typename T>
  void add(const Rows<T>& rows, const Item& it, int64_t t0, int64_t count, int64_t bytes) {
    const bool packed = rows.token_stride * static_cast<int64_t>(sizeof(T)) == bytes;
    for (int64_t t = t0; t < t0 + count;) {
      const int64_t m = packed ? std::min(t0 + count - t, rows.run(t)) : 1;
      const uintptr_t lo = reinterpret_cast<uintptr_t>(rows.at(it.b, it.h, t)), hi = lo + m * bytes;
      const uintptr_t first = lo & ~uintptr_t{63};
      if (static_cast<int64_t>(runs.size()) <= n_runs) runs.resize(2 * n_runs + 8);
      runs[n_runs++] = {reinterpret_cast<const char*>(first), static_cast<int64_t>((hi - first + 63) / 64)};
      total += runs[n_runs - 1].lines;
      t += m;
    }
  }
  // what was added, asked for over `steps` tile steps
  void spread(int64_t steps) {
    r = 0;
    left = n_runs > 0 ? runs[0].lines : 0;
    at = n_runs > 0 ? runs[0].p : nullptr;
    per = std::max<int64_t>(1, (total + steps - 1) / std::max<int64_t>(1, steps));
  }
  inline void step() {
    for (int64_t k = 0; k < per && left > 0; ++k) {
      __builtin_prefetch(at, 0, 2);
      at += 64;
      if (--left == 0) next_run();
    }
  }
  // from a run asked for in full to the next one (none left: left stays 0)
  inline void next_run() {
    if (++r < n_runs) {
      at = runs[r].p;
      left = runs[r].lines;
    }
  }
  void clear() { n_runs = total = r = left = 0; }
};

// Ahead's position copied into locals for the length of one tile's loop, so that the loop keeps it in registers.
// Through the reference, every step stored `at` and `left` back to memory, and GCC, not knowing those stores leave
// the tile's accumulators alone, kept the accumulators in memory too: the row-wise score tiles stored and reloaded
// all 16 at every step (float32 groups of 8, 128 dims, one core, in cache: 31 -> 49-65 GFLOP/s). Three integer
// registers (where the line is, where its run ends, lines per step): a run that ends within the loop is followed
// from the next loop on, since the state to move to the next run in the loop took integer registers that the
// bfloat16 tiles need for their key rows (they spilled those, 5-8 % slower).
struct Cursor {
  Ahead& ahead;
  const char* at;
  const char* stop;
  int64_t per;
  explicit Cursor(Ahead& a) : ahead(a), per(a.per) {
    if (a.left == 0 && a.r < a.n_runs) a.next_run();
    at = a.at;
    stop = a.at + 64 * a.left;
  }
  ~Cursor() {
    ahead.left = (stop - at) / 64;
    ahead.at = at;
  }
  inline void step() {
    for (int64_t k = 0; k < per && at < stop; ++k, at += 64) __builtin_prefetch(at, 0, 2);
  }
};

// Ahead itself, stepped through the reference: for bfloat16 rows, whose tiles (widening every load) gained nothing
// from a Cursor with 16 lanes and lost 20-25 % with AVX2's 8 (benchmarks/kernel_ab.py, one thread, 4096 tokens).
struct InPlace {
  Ahead& ahead;
  explicit InPlace(Ahead& a) : ahead(a) {}
  inline void step() { ahead.step(); }
};

// How a tile reading rows of E steps through Ahead.
template <typename E>
using Stepper = std::conditional_t<std::is_same<E, float>::value, Cursor, InPlace>;

// Tokens t0 .. t0+n-1 into float rows of `width` (>= dim; the padding columns stay zero from allocation).
template <typename T>
void stage(const Rows<T>& rows, int64_t b, int64_t h, int64_t t0, int64_t n, int64_t dim, float* dst,
           int64_t width) {
  RowWalk<T> walk{rows, b, h, t0};
  for (int64_t j = 0; j < n; ++j) {
    const T* src = walk.next();
    float* out = dst + j * width;
    int64_t d = 0;
    for (; d + W <= dim; d += W) vstore(out + d, vload(src + d));
    for (; d < dim; ++d) out[d] = widen(src[d]);
  }
}

}  // namespace attnlab_fused
