// The fused CPU kernels of attnlab (attention/fused.py builds and calls them): plain C++17 with OpenMP, no PyTorch
// headers, so that the first-use build takes seconds; fused.py calls the C entry points below with ctypes.
//
// One compiled unit; each concern in its header:
//   vectors.h  vector lanes: bfloat16 widening and rounding, ordered sums, 2^x
//   rows.h     where cached rows live (strided or paged runs), walking them, lines asked for ahead, staging
//   scores.h   score tiles (row-wise and queries-in-lanes) and the online softmax in the lanes layout
//   values.h   value tiles: weights times value rows into the outputs
//   amx.h      bfloat16 blocks on AMX tiles (Sapphire Rapids and later)
//   decode.h   attention over a cache: blocks, chunks, the log-sum-exp merge (the algorithm is described there)
//   linear.h   few-row matrix-vector products of decode-step linear layers
//   block.h    a decoder block's whole decode step
// and here the entry points.

#include "amx.h"
#include "block.h"
#include "decode.h"
#include "linear.h"
#include "rows.h"
#include "scores.h"
#include "values.h"
#include "vectors.h"

#include <cstdint>

// The one entry point (ctypes): dtype 0 = float32, 1 = bfloat16. Keys k_strides = (row, head, token) in
// elements, values likewise; table nullptr for strided caches, else (B, table_stride) slots of `block` tokens
// (strides then: row unused, head, token). Row b attends to its tokens [lo[b], hi[b]). Returns 0.
extern "C" int attnlab_decode(int dtype, const void* q, int64_t B, int64_t H, int64_t n_kv, int64_t dk,
                              int64_t dv, const void* k, const int64_t* k_strides, const void* v,
                              const int64_t* v_strides, const int64_t* table, int64_t table_stride,
                              int64_t block, const int64_t* lo, const int64_t* hi, float scale, void* out,
                              int threads) {
  namespace fk = attnlab_fused;
  if (n_kv <= 0 || H % n_kv != 0 || dv > dk) return 1;
  if (dtype == 0) {
    fk::Rows<float> kr{static_cast<const float*>(k), k_strides[0], k_strides[1], k_strides[2], table,
                       table_stride, block, fk::log2_exact(block)};
    fk::Rows<float> vr{static_cast<const float*>(v), v_strides[0], v_strides[1], v_strides[2], table,
                       table_stride, block, fk::log2_exact(block)};
    fk::decode(static_cast<const float*>(q), B, H, n_kv, dk, dv, kr, vr, lo, hi, scale, static_cast<float*>(out),
               threads);
    return 0;
  }
  if (dtype == 1) {
    using T = fk::bf16;
    fk::Rows<T> kr{static_cast<const T*>(k), k_strides[0], k_strides[1], k_strides[2], table, table_stride, block,
                   fk::log2_exact(block)};
    fk::Rows<T> vr{static_cast<const T*>(v), v_strides[0], v_strides[1], v_strides[2], table, table_stride, block,
                   fk::log2_exact(block)};
    fk::decode(static_cast<const T*>(q), B, H, n_kv, dk, dv, kr, vr, lo, hi, scale, static_cast<T*>(out), threads);
    return 0;
  }
  return 2;
}

// y (M, sum of ns) = x (M, K) times n_w weights (ns[i], K) side by side, plus biases[i] (nullptr: none); all
// contiguous, dtype as above. Returns 0.
extern "C" int attnlab_linear(int dtype, const void* x, int64_t M, int64_t K, int64_t n_w, const void* const* ws,
                              const int64_t* ns, const void* const* biases, void* y, int threads) {
  namespace fk = attnlab_fused;
  if (M < 0 || K < 0 || n_w < 1) return 1;
  if (dtype == 0) {
    fk::linear(static_cast<const float*>(x), M, K, n_w, reinterpret_cast<const float* const*>(ws), ns,
               reinterpret_cast<const float* const*>(biases), static_cast<float*>(y), threads);
    return 0;
  }
  if (dtype == 1) {
    using T = fk::bf16;
    fk::linear(static_cast<const T*>(x), M, K, n_w, reinterpret_cast<const T* const*>(ws), ns,
               reinterpret_cast<const T* const*>(biases), static_cast<T*>(y), threads);
    return 0;
  }
  return 2;
}

// One decoder block's decode step (see `block` in block.h). dims: M, D, H, n_kv, head_dim, F, pos, the cache's key
// strides (row, head, token), value strides, the cos/sin row stride; ptrs: x, attention norm, wq, wk, wv, bq, bk,
// bv, wo, bo, MLP norm, w1, w3, w2, b1, b3, b2 (biases nullptr: none), cos, sin (float32, nullptr: no RoPE),
// cache keys, cache values, out (M, D); all contiguous but the caches. Returns 0.
extern "C" int attnlab_block(int dtype, const int64_t* dims, void* const* ptrs, float eps, float scale, int threads) {
  namespace fk = attnlab_fused;
  fk::BlockDims d{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6],
                  {dims[7], dims[8], dims[9]}, {dims[10], dims[11], dims[12]}, dims[13], eps, scale};
  if (d.M < 1 || d.n_kv < 1 || d.H % d.n_kv != 0 || d.hd % 2 != 0 || d.pos < 0) return 1;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    auto p = [&](int i) { return static_cast<T*>(ptrs[i]); };
    const fk::BlockTensors<T> t{p(0),  p(1),  p(2),  p(3),  p(4),  p(5),  p(6),  p(7),
                                p(8),  p(9),  p(10), p(11), p(12), p(13), p(14), p(15),
                                p(16), static_cast<const float*>(ptrs[17]), static_cast<const float*>(ptrs[18]),
                                p(19), p(20), p(21)};
    fk::block(d, t, threads);
  };
  if (dtype == 0) {
    run(float{});
    return 0;
  }
  if (dtype == 1) {
    run(fk::bf16{});
    return 0;
  }
  return 2;
}

// What this build does on this machine: bit 0 = bfloat16 blocks on AMX tiles (compiled in, granted, and enabled).
extern "C" int attnlab_features() {
#if defined(ATTNLAB_AMX)
  return attnlab_fused::amx_enabled.load() && attnlab_fused::amx_granted() ? 1 : 0;
#else
  return 0;
#endif
}

// Turn the AMX path off (0) or back on (1) for this process, to compare or test the other path; returns
// attnlab_features() after the change.
extern "C" int attnlab_set_amx(int on) {
#if defined(ATTNLAB_AMX)
  attnlab_fused::amx_enabled.store(on != 0);
#else
  (void)on;
#endif
  return attnlab_features();
}
