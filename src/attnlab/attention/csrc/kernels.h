// The kernels' entry points as the operators of ops.cpp call them: one struct of named fields per entry point, in
// plain C++ (no PyTorch header), so that the kernel unit (kernels.cpp) and the operator unit (ops.cpp) compile
// apart, in parallel, and a field is set by its name, never by its place in a list.
#pragma once

#include <cstdint>

namespace attnlab_fused {

enum class DType : int { float32 = 0, bfloat16 = 1 };

struct Strides {  // in elements
  int64_t row = 0, head = 0, token = 0;
};

// Attention of q (B, H, dk) over the tokens [lo[b], hi[b]) of every batch row b into out (B, H, dv) (decode.h).
// The key of row b, KV head h, token t: strided, k + b row + h head + t token; or paged (table != nullptr): a pool
// (n_kv, slots, dk), the token's slot table[b * table_stride + t / block] + t % block (row stride unused). Values
// likewise, dv <= dk (MLA's values are the first dv columns of its key rows: v == k, the same strides).
struct DecodeArgs {
  DType dtype;
  const void* q;
  int64_t B, H, n_kv, dk, dv;
  const void* k;
  Strides k_strides;
  const void* v;
  Strides v_strides;
  const int64_t* table = nullptr;
  int64_t table_stride = 0, block = 1;
  const int64_t* lo;
  const int64_t* hi;
  float scale;
  void* out;
  int threads;
};

// y (M, sum of ns) = x (M, K) times n_w weights (ns[i], K) side by side, plus biases[i] (nullptr: none); all
// contiguous (linear.h).
struct LinearArgs {
  DType dtype;
  const void* x;
  int64_t M, K, n_w;
  const void* const* weights;
  const int64_t* ns;
  const void* const* biases;
  void* y;
  int threads;
};

// One pre-norm decoder block's decode step for M rows of one new token each (block.h): x and out (M, D); weights
// as nn.Linear holds them (wq (H hd, D), wk and wv (n_kv hd, D), wo (D, H hd), w1 and w3 (F, D), w2 (D, F)), norm
// gains (D), biases or nullptr; cos and sin float32 (rope_stride 0: one row shared, else one per batch row),
// nullptr: no RoPE; the new key and value go to the caches (M, n_kv, capacity, hd) at `pos`, and every row attends
// to its tokens 0 .. pos. All contiguous but the caches, whose rows (the last dim) are.
struct BlockArgs {
  DType dtype;
  int64_t M, D, H, n_kv, hd, F, pos;
  Strides k_strides, v_strides;
  int64_t rope_stride = 0;
  float eps, scale;
  const void* x;
  const void *attn_norm, *wq, *wk, *wv, *bq, *bk, *bv, *wo, *bo;
  const void *ffn_norm, *w1, *w3, *w2, *b1, *b3, *b2;
  const float *cos, *sin;
  void *cache_k, *cache_v, *out;
  int threads;
};

namespace kernels {  // defined in kernels.cpp

// Each returns 0, or a code for arguments it cannot take (the operators check them first).
int decode(const DecodeArgs& args);
int linear(const LinearArgs& args);
int block_step(const BlockArgs& args);

// What this build does on this machine: bit 0 = bfloat16 blocks on AMX tiles (compiled in, granted, enabled);
// bit 1 = the tiles' vectors are AVX-512's 16 lanes, bit 2 = AVX2's 8 (neither: what the compiler makes of 8 lanes);
// bit 3 = bfloat16 blocks on AVX512-BF16 dot products (compiled in, no tiles, enabled).
int features();
// Turn the pair path (AMX tiles or AVX512-BF16 dot products) off (0) or back on (1) for this process; returns
// features() after the change.
int set_amx(int on);

}  // namespace kernels

}  // namespace attnlab_fused
