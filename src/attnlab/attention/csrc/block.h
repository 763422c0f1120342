// One decoder block's decode step (attnlab.model.Block): pre-norm attention and SwiGLU MLP in one call.
#pragma once

#include "decode.h"
#include "kernels.h"
#include "linear.h"
#include "rows.h"
#include "vectors.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace attnlab_fused {

// For a few rows of one new token each (batch rows), over a contiguous KV cache: RMSNorm, the q/k/v projections,
// RoPE (half-split pairs), the new key and value written into the cache, attention over the cache (decode.h),
// the output projection and the residual, then RMSNorm, the gate and up projections, SiLU(gate) * up,
// the down projection and the residual. Each step rounds to the storage type where PyTorch's modules do (every
// module's output, RMSNorm's normalised input before its gain, SiLU before the product), so the block agrees
// with the module-by-module forward up to the order of the sums. The point is the per-op overhead: a step of a
// small model is ~25 PyTorch ops per block, each a dispatch and an allocation; here it is one call.

// The block's tensors (BlockArgs' pointers) typed.
template <typename T>
struct BlockTensors {
  const T* x;
  const T *attn_norm, *wq, *wk, *wv, *bq, *bk, *bv, *wo, *bo;
  const T *ffn_norm, *w1, *w3, *w2, *b1, *b3, *b2;
  const float *cos, *sin;
  T *cache_k, *cache_v, *out;
};

// y (M, D) = weight * narrow(x / rms(x)), the arithmetic in float32 (RMSNorm of attention/norm.py).
template <typename T>
void rms_norm(const T* x, const T* weight, int64_t M, int64_t D, float eps, T* y) {
  for (int64_t m = 0; m < M; ++m) {
    const T* xm = x + m * D;
    double ss = 0.0;
    for (int64_t i = 0; i < D; ++i) ss += static_cast<double>(widen(xm[i])) * widen(xm[i]);
    const float r = 1.f / std::sqrt(static_cast<float>(ss / D) + eps);
    for (int64_t i = 0; i < D; ++i) y[m * D + i] = narrow<T>(widen(weight[i]) * widen(narrow<T>(widen(xm[i]) * r)));
  }
}

// Rotate one head vector of `hd` values by the pairs (i, i + hd/2) (apply_rope of attention/rope.py).
template <typename T>
void rope(const T* x, const float* cos, const float* sin, int64_t hd, T* y) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = widen(x[i]), b = widen(x[i + half]);
    y[i] = narrow<T>(a * cos[i] - b * sin[i]);
    y[i + half] = narrow<T>(b * cos[i + half] + a * sin[i + half]);
  }
}

template <typename T>
void block(const BlockArgs& d, const BlockTensors<T>& t, int threads) {
  const int64_t M = d.M, D = d.D, hd = d.hd, qw = d.H * hd, kw = d.n_kv * hd, F = d.F;
  std::vector<T> xn(M * D), qkv(M * (qw + 2 * kw)), q(M * qw), att(M * qw), h(M * D), gu(M * 2 * F), act(M * F);
  // attention: norm, projections, RoPE, the cache write, attention over the cache, output projection
  rms_norm(t.x, t.attn_norm, M, D, d.eps, xn.data());
  {
    const T* ws[3] = {t.wq, t.wk, t.wv};
    const T* bs[3] = {t.bq, t.bk, t.bv};
    const int64_t ns[3] = {qw, kw, kw};
    linear(xn.data(), M, D, 3, ws, ns, bs, qkv.data(), threads);
  }
  const int64_t row = qw + 2 * kw;
  for (int64_t m = 0; m < M; ++m) {
    const T* qm = qkv.data() + m * row;
    const T* km = qm + qw;
    const T* vm = km + kw;
    for (int64_t head = 0; head < d.n_kv; ++head) {
      T* kd = t.cache_k + m * d.k_strides.row + head * d.k_strides.head + d.pos * d.k_strides.token;
      T* vd = t.cache_v + m * d.v_strides.row + head * d.v_strides.head + d.pos * d.v_strides.token;
      if (t.cos != nullptr)
        rope(km + head * hd, t.cos + m * d.rope_stride, t.sin + m * d.rope_stride, hd, kd);
      else
        std::copy(km + head * hd, km + (head + 1) * hd, kd);
      std::copy(vm + head * hd, vm + (head + 1) * hd, vd);
    }
    for (int64_t head = 0; head < d.H; ++head) {
      if (t.cos != nullptr)
        rope(qm + head * hd, t.cos + m * d.rope_stride, t.sin + m * d.rope_stride, hd, q.data() + m * qw + head * hd);
      else
        std::copy(qm + head * hd, qm + (head + 1) * hd, q.data() + m * qw + head * hd);
    }
  }
  {
    const Rows<T> keys{t.cache_k, d.k_strides.row, d.k_strides.head, d.k_strides.token};
    const Rows<T> values{t.cache_v, d.v_strides.row, d.v_strides.head, d.v_strides.token};
    const std::vector<int64_t> lo(M, 0), hi(M, d.pos + 1);
    decode(q.data(), M, d.H, d.n_kv, hd, hd, keys, values, lo.data(), hi.data(), d.scale, att.data(), threads);
  }
  {
    const T* ws[1] = {t.wo};
    const T* bs[1] = {t.bo};
    const int64_t ns[1] = {D};
    linear(att.data(), M, qw, 1, ws, ns, bs, h.data(), threads);
  }
  for (int64_t i = 0; i < M * D; ++i) h[i] = narrow<T>(widen(t.x[i]) + widen(h[i]));
  // MLP: norm, gate and up in one pass, SiLU(gate) * up, down projection, residual
  rms_norm(h.data(), t.ffn_norm, M, D, d.eps, xn.data());
  {
    const T* ws[2] = {t.w1, t.w3};
    const T* bs[2] = {t.b1, t.b3};
    const int64_t ns[2] = {F, F};
    linear(xn.data(), M, D, 2, ws, ns, bs, gu.data(), threads);
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < F; ++i) {
      const float g = widen(gu[m * 2 * F + i]);
      const T silu = narrow<T>(g / (1.f + std::exp(-g)));
      act[m * F + i] = narrow<T>(widen(silu) * widen(gu[m * 2 * F + F + i]));
    }
  {
    const T* ws[1] = {t.w2};
    const T* bs[1] = {t.b2};
    const int64_t ns[1] = {D};
    linear(act.data(), M, F, 1, ws, ns, bs, t.out, threads);
  }
  for (int64_t i = 0; i < M * D; ++i) t.out[i] = narrow<T>(widen(h[i]) + widen(t.out[i]));
}

}  // namespace attnlab_fused
