// Matrix-vector products for decode steps: y = x W^T + bias for a few rows of x, over one or more weights.
#pragma once

#include "vectors.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace attnlab_fused {

// A decode step reads every weight once for one token per sequence, so its linear layers are bound by how fast
// the weight rows stream from memory, not by arithmetic. The weights that share an input (a layer's query, key
// and value projections; the MLP's gate and up projections) are one call: their rows are cut into groups of
// four, the groups of all of them are split evenly over the threads, and each thread streams its contiguous
// range, prefetching a few groups ahead. The four rows of a group are read once for all M input rows, and the
// inputs (widened to float32 once) stay in the first-level cache.

constexpr int64_t kPrefetchGroups = 2;

// The dot products of four weight rows with one input row of `k` floats; `ahead` (or nullptr) is prefetched.
template <typename T>
inline void dot4(const float* x, const T* w0, const T* w1, const T* w2, const T* w3, int64_t k, float* out,
                 const char* ahead) {
  v8f a0 = splat(0.f), a1 = splat(0.f), a2 = splat(0.f), a3 = splat(0.f);
  int64_t c = 0;
  for (; c + 8 <= k; c += 8) {
    if (ahead != nullptr) {  // the rows to come, as fast as these are read: 4 rows x 8 values per step
      __builtin_prefetch(ahead + 4 * c * sizeof(T));
      if (sizeof(T) == 4) __builtin_prefetch(ahead + 4 * c * sizeof(T) + 64);
    }
    const v8f xv = load(x + c);
    a0 += xv * load(w0 + c);
    a1 += xv * load(w1 + c);
    a2 += xv * load(w2 + c);
    a3 += xv * load(w3 + c);
  }
  float t0 = 0.f, t1 = 0.f, t2 = 0.f, t3 = 0.f;
  for (; c < k; ++c) {
    t0 += x[c] * widen(w0[c]);
    t1 += x[c] * widen(w1[c]);
    t2 += x[c] * widen(w2[c]);
    t3 += x[c] * widen(w3[c]);
  }
  const v8f z = splat(0.f);
  const v8f parts[8] = {a0, a1, a2, a3, z, z, z, z};
  const v8f r = sums8(parts);
  out[0] = r[0] + t0;
  out[1] = r[1] + t1;
  out[2] = r[2] + t2;
  out[3] = r[3] + t3;
}

// Rows [n0, n1) of one weight w (N, K) for all M inputs, into columns col + n of y (M, y_stride).
template <typename T>
void linear_rows(const float* xf, int64_t M, int64_t K, const T* w, const T* bias, int64_t N, int64_t n0,
                 int64_t n1, T* y, int64_t y_stride, int64_t col) {
  float r[4];
  for (int64_t n = n0; n < n1; n += 4) {
    const int64_t rows = std::min<int64_t>(4, n1 - n);
    const T* w0 = w + n * K;  // rows past the range repeat the last one (computed, not stored)
    const T* w1 = w + (n + std::min<int64_t>(1, rows - 1)) * K;
    const T* w2 = w + (n + std::min<int64_t>(2, rows - 1)) * K;
    const T* w3 = w + (n + std::min<int64_t>(3, rows - 1)) * K;
    const int64_t next = std::min(n + 4 * kPrefetchGroups, N - 4);
    const char* ahead = next > n ? reinterpret_cast<const char*>(w + next * K) : nullptr;
    for (int64_t m = 0; m < M; ++m) {
      dot4(xf + m * K, w0, w1, w2, w3, K, r, m == 0 ? ahead : nullptr);
      for (int64_t i = 0; i < rows; ++i)
        y[m * y_stride + col + n + i] = narrow<T>(r[i] + (bias == nullptr ? 0.f : widen(bias[n + i])));
    }
  }
}

// y (M, sum of ns) = x (M, K) times the n_w weights (ns[i], K) side by side, plus their biases (or nullptr).
template <typename T>
void linear(const T* x, int64_t M, int64_t K, int64_t n_w, const T* const* ws, const int64_t* ns,
            const T* const* biases, T* y, int max_threads) {
  std::vector<float> xf(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = widen(x[i]);
  std::vector<int64_t> first_group(n_w + 1, 0), first_col(n_w + 1, 0);
  for (int64_t i = 0; i < n_w; ++i) {
    first_group[i + 1] = first_group[i] + (ns[i] + 3) / 4;
    first_col[i + 1] = first_col[i] + ns[i];
  }
  const int64_t groups = first_group[n_w], width = first_col[n_w];
  const int64_t bytes = width * K * static_cast<int64_t>(sizeof(T));
  const int n_threads = bytes < kParallelBytes / 4 ? 1 : std::max(1, max_threads);
#pragma omp parallel num_threads(n_threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;  // this thread's groups, all weights counted
    for (int64_t i = 0; i < n_w; ++i) {
      const int64_t lo = std::max(g0, first_group[i]), hi = std::min(g1, first_group[i + 1]);
      if (lo >= hi) continue;
      const int64_t n0 = (lo - first_group[i]) * 4, n1 = std::min(ns[i], (hi - first_group[i]) * 4);
      linear_rows(xf.data(), M, K, ws[i], biases[i], ns[i], n0, n1, y, width, first_col[i]);
    }
  }
}

}  // namespace attnlab_fused
