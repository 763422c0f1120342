// The fused CPU kernels of attnlab: the kernel unit, plain C++ with OpenMP and no PyTorch header (the operator
// unit, ops.cpp, includes those and calls the entry points below through kernels.h; fused.py builds both into one
// library, compiled in parallel). Each concern is in its header:
//   vectors.h  vector lanes: bfloat16 widening and rounding, ordered sums, 2^x
//   rows.h     where cached rows live (strided or paged runs), walking them, lines asked for ahead, staging
//   scores.h   score tiles (row-wise and queries-in-lanes) and the online softmax in the lanes layout
//   values.h   value tiles: weights times value rows into the outputs
//   amx.h      bfloat16 blocks in pairs: on AMX tiles (Sapphire Rapids and later) or AVX512-BF16 dot products
//   decode.h   attention over a cache: blocks, chunks, the log-sum-exp merge (the algorithm is described there)
//   linear.h   few-row matrix-vector products of decode-step linear layers
//   block.h    a decoder block's whole decode step
// and here the entry points, which turn kernels.h's structs into the typed calls of those headers.

#include "amx.h"
#include "block.h"
#include "decode.h"
#include "kernels.h"
#include "linear.h"
#include "rows.h"
#include "scores.h"
#include "values.h"
#include "vectors.h"

#include <cstdint>

namespace attnlab_fused::kernels {
namespace {

// The element type of a dtype, as a value to dispatch on: f(float{}) or f(bf16{}); 2 for another dtype.
template <typename F>
int by_dtype(DType dtype, F&& f) {
  if (dtype == DType::float32) {
    f(float{});
    return 0;
  }
  if (dtype == DType::bfloat16) {
    f(bf16{});
    return 0;
  }
  return 2;
}

}  // namespace

int decode(const DecodeArgs& a) {
  if (a.n_kv <= 0 || a.H % a.n_kv != 0 || a.dv > a.dk) return 1;
  return by_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int shift = log2_exact(a.block);
    const Rows<T> keys{static_cast<const T*>(a.k), a.k_strides.row, a.k_strides.head, a.k_strides.token, a.table,
                       a.table_stride, a.block, shift};
    const Rows<T> values{static_cast<const T*>(a.v), a.v_strides.row, a.v_strides.head, a.v_strides.token, a.table,
                         a.table_stride, a.block, shift};
    attnlab_fused::decode(static_cast<const T*>(a.q), a.B, a.H, a.n_kv, a.dk, a.dv, keys, values, a.lo, a.hi, a.scale,
                          static_cast<T*>(a.out), a.threads);
  });
}

int linear(const LinearArgs& a) {
  if (a.M < 0 || a.K < 0 || a.n_w < 1) return 1;
  return by_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    attnlab_fused::linear(static_cast<const T*>(a.x), a.M, a.K, a.n_w, reinterpret_cast<const T* const*>(a.weights),
                          a.ns, reinterpret_cast<const T* const*>(a.biases), static_cast<T*>(a.y), a.threads);
  });
}

int block_step(const BlockArgs& a) {
  if (a.M < 1 || a.n_kv < 1 || a.H % a.n_kv != 0 || a.hd % 2 != 0 || a.pos < 0) return 1;
  return by_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    auto in = [](const void* p) { return static_cast<const T*>(p); };
    auto out = [](void* p) { return static_cast<T*>(p); };
    const BlockTensors<T> t{
        .x = in(a.x), .attn_norm = in(a.attn_norm), .wq = in(a.wq), .wk = in(a.wk), .wv = in(a.wv),
        .bq = in(a.bq), .bk = in(a.bk), .bv = in(a.bv), .wo = in(a.wo), .bo = in(a.bo),
        .ffn_norm = in(a.ffn_norm), .w1 = in(a.w1), .w3 = in(a.w3), .w2 = in(a.w2), .b1 = in(a.b1),
        .b3 = in(a.b3), .b2 = in(a.b2), .cos = a.cos, .sin = a.sin, .cache_k = out(a.cache_k),
        .cache_v = out(a.cache_v), .out = out(a.out)};
    block(a, t, a.threads);
  });
}

int features() {
  int bits = 0;
#if defined(ATTNLAB_PAIRS)
  if (pairs_enabled.load()) bits |= amx_granted() ? 1 : 8;
#endif
#if defined(__AVX512F__)
  bits |= 2;  // 16-lane tiles
#elif defined(__AVX2__)
  bits |= 4;  // 8-lane tiles
#endif
  return bits;
}

int set_amx(int on) {
#if defined(ATTNLAB_PAIRS)
  pairs_enabled.store(on != 0);
#else
  (void)on;
#endif
  return features();
}

}  // namespace attnlab_fused::kernels
