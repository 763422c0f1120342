// Score tiles and the online softmax: queries times a block of key rows, row-wise (the group's queries against
// a few keys at a time) or with the queries in the lanes (groups of a multiple of 16, float32), and the softmax
// update of a block's scores in the lanes layout; with the per-thread buffers of a chunk (Scratch) they fill.
#pragma once

#include "rows.h"
#include "vectors.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace attnlab_fused {

// Scores of Q queries x K keys (key rows k[0..K-1]): Q K FMA chains, Q + K loads per Q K FMAs, the queries and keys
// pinned in registers (else GCC folds the loads into the FMAs, reading each twice per step). The queries are rows
// q + i q_stride; s receives row i of K scores at s + i s_stride. Q K <= 16 accumulators (W = 16: 32 registers),
// <= 12 (W = 8: 16 registers). Always inlined, with the reduction tree unrolled: out of line, GCC kept the
// accumulators in a stack array (cleared by a memset at every call) and the tree as a loop (float32 groups of 8,
// 128 dims, one core, in cache: 262 -> 221 us per 1024 tokens; from memory on two threads 1.04x).
template <int Q, int K, typename E>
__attribute__((always_inline)) inline void scores_tile(const float* q, int64_t q_stride, const E* const* k,
                                                       int64_t width, float* s, int64_t s_stride, Ahead& ahead) {
  vf a[Q * K];
  for (int i = 0; i < Q * K; ++i) a[i] = splat<vf>(0.f);
  Stepper<E> cursor(ahead);
  for (int64_t d = 0; d < width; d += W) {
    cursor.step();
    vf x[Q];
#pragma GCC unroll 4
    for (int i = 0; i < Q; ++i) {
      x[i] = vload(q + i * q_stride + d);
      pin(x[i]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < K; ++j) {
      vf kv = vload(k[j] + d);
      pin(kv);
#pragma GCC unroll 4
      for (int i = 0; i < Q; ++i) a[K * i + j] += x[i] * kv;
    }
  }
  for (int i0 = 0; i0 < Q * K; i0 += W) {
    const vf r = vsums(a + i0, std::min(W, Q * K - i0));
    for (int l = 0; l < std::min(W, Q * K - i0); ++l) s[(i0 + l) / K * s_stride + (i0 + l) % K] = r[l];
  }
}

// Scores of QV W queries x R keys with the queries in the lanes: qt holds the group's queries transposed, (dk, G)
// with the tile's QV W in columns 0.., and each key element is broadcast to them: QV + R loads per QV R FMAs and no
// horizontal sums, which take ~15 % of the row-wise tiles' time (single-core harness, 128 dims, W = 8, groups of
// 16 and 32: 97-98 GFLOP/s against 80-83). st receives key r's scores at st + r * G.
// S > 0: the key rows are S floats apart (k[r] = k[0] + r S, checked by the caller), addressed from one register
// at constant offsets; with a pointer per row (S = 0) the 12 rows' pointers do not fit the integer registers
// beside the loop's own and are reloaded from the stack at every step.
template <int QV, int R, int S = 0>
inline void scores_lanes(const float* qt, int64_t G, const float* const* k, int64_t dk, float* st, Ahead& ahead) {
  const float* k0 = k[0];
  vf a[R][QV];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < QV; ++v) a[r][v] = splat<vf>(0.f);
  Cursor cursor(ahead);
  for (int64_t d = 0; d < dk; ++d) {
    cursor.step();
    vf x[QV];
    for (int v = 0; v < QV; ++v) {
      x[v] = vload(qt + d * G + v * W);
      pin(x[v]);
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      vf kb = splat<vf>(S > 0 ? k0[r * S + d] : k[r][d]);
      if (QV > 1) pin(kb);  // one broadcast for QV FMAs (else it folds into each: a load per FMA)
      for (int v = 0; v < QV; ++v) a[r][v] += kb * x[v];
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < QV; ++v) vstore(st + r * G + v * W, a[r][v]);
}

struct Dims {
  int64_t G, dk, dv, dk_pad, dv_pad, tb;
};

// Whether float32 rows are scored with the queries in the lanes (scores_lanes): groups of a multiple of 16. Groups
// of 8 with W = 8 in the lanes too (one vector of queries x 12 keys) measured 1.00-1.05x (kernel_ab.py, AVX2
// build on Zen 4, 32 heads of 128, 4096-16384 tokens, 40 rounds): from memory they wait on the reads, not the tiles.
inline bool lanes(const Dims& d) { return d.G % 16 == 0; }

// Per-thread buffers of one chunk: queries (G, dk_pad), a staged block of keys (tb, dk_pad) and values
// (tb, dv_pad), the block's scores/weights (G, tb), and the block's row pointers (into the cache or the staging);
// for groups scored with the queries in the lanes, the queries transposed (dk, G) and the scores as they come
// out of the tiles (tb, G).
template <typename T>
struct Scratch {
  std::vector<float> q, k, v, s, qt, st;
  std::vector<const T*> kc, vc;      // rows read where they lie in the cache
  Ahead ahead;                       // lines asked for ahead of use (this block's values, the next block's keys)
  std::vector<const float*> kr, vr;  // rows staged in k and v
  Dims dims{};                       // what the buffers are laid out for
  // Kept by each thread from call to call (a step is too short to allocate and clear ~100 KiB); cleared when the
  // dims change, since padding columns must be zero and only the columns of real values are ever written.
  void reset(const Dims& d) {
    if (d.G == dims.G && d.dk == dims.dk && d.dv == dims.dv && d.dk_pad == dims.dk_pad &&
        d.dv_pad == dims.dv_pad && d.tb == dims.tb)
      return;
    dims = d;
    q.assign(d.G * d.dk_pad, 0.f);
    k.assign(d.tb * d.dk_pad, 0.f);
    v.assign(d.tb * d.dv_pad, 0.f);
    s.assign(d.G * d.tb, 0.f);
    qt.assign(lanes(d) ? d.dk * d.G : 0, 0.f);
    st.assign(lanes(d) ? d.tb * d.G : 0, 0.f);
    kc.resize(d.tb);
    vc.resize(d.tb);
    kr.resize(d.tb);
    vr.resize(d.tb);
    for (int64_t j = 0; j < d.tb; ++j) {
      kr[j] = k.data() + j * d.dk_pad;
      vr[j] = v.data() + j * d.dv_pad;
    }
  }
};

// Whether a block of n rows is read where its rows lie (contiguous or paged alike, bfloat16 widened in registers
// by every tile that reads it): rows that need no padding, and a whole block (no rows past the chunk's end to
// zero). Else the rows are staged: widened, padded. Reading bfloat16 in place rather than staging every block
// (benchmarks/kernel_ab.py, 32 heads of 128, KV from memory): groups of 4 1.15-1.25x, of 8 1.09-1.18x, of 16 and
// 32 1.00-1.09x, though groups of 32 widen each key row eleven times instead of once.
inline bool in_place(const Dims& d, int64_t n) { return d.dk == d.dk_pad && d.dv == d.dv_pad && n == d.tb; }

// The scores (G, tb) of one block's key rows kr (n of them; the rest zeros), 4 keys per step: with W = 16 the
// queries in fours (4 x 4 tiles, each key row read once per four queries), with W = 8 in threes (3 x 4: 12 of
// 16 registers), then a pair, then a single query (1 x 8 tiles, load-bound: avoided unless G is odd); with W = 8
// groups of 4 take 4 x 2 tiles, so that each key row is read (for bfloat16: widened) once. Every tile step also
// asks for a few lines of the next block's keys and values (w.ahead, planned by attend_chunk: rows.h's Ahead), so
// that memory streams while the FMAs run.
template <typename T, typename E>
void scores_in_rows(const Dims& d, const E* const* kr, Scratch<T>& w) {
  const int64_t G = d.G, tb = d.tb, dq = d.dk_pad;
  const float* q = w.q.data();
  float* s = w.s.data();
  int64_t single = G;  // the query left over for 1 x 8 tiles, if any
  for (int64_t j = 0; j < tb; j += 4) {
    int64_t g = 0;
    if constexpr (W == 16) {
      for (; g + 4 <= G; g += 4) scores_tile<4, 4>(q + g * dq, dq, &kr[j], dq, s + g * tb + j, tb, w.ahead);
      if (G - g == 3) scores_tile<3, 4>(q + g * dq, dq, &kr[j], dq, s + g * tb + j, tb, w.ahead);
      if (G - g == 2) scores_tile<2, 4>(q + g * dq, dq, &kr[j], dq, s + g * tb + j, tb, w.ahead);
      single = G - g == 1 ? g : G;
    } else {
      if (G == 4) {
        scores_tile<4, 2>(q, dq, &kr[j], dq, s + j, tb, w.ahead);
        scores_tile<4, 2>(q, dq, &kr[j + 2], dq, s + j + 2, tb, w.ahead);
        continue;
      }
      int64_t G3 = G / 3 * 3;
      if (G - G3 == 1 && G3 >= 3) G3 -= 3;  // 4 left: two pairs rather than a triple and a single
      for (; g < G3; g += 3) scores_tile<3, 4>(q + g * dq, dq, &kr[j], dq, s + g * tb + j, tb, w.ahead);
      for (; g + 2 <= G; g += 2) scores_tile<2, 4>(q + g * dq, dq, &kr[j], dq, s + g * tb + j, tb, w.ahead);
      single = g < G ? g : G;
    }
  }
  if (single < G)
    for (int64_t j = 0; j < tb; j += 8)
      scores_tile<1, 8>(q + single * dq, dq, &kr[j], dq, s + single * tb + j, tb, w.ahead);
}

// The same scores for float32 rows and groups of a multiple of 16 (`lanes`): tiles of 32 queries (2 vectors of 16,
// W = 16, for groups of a multiple of 32; else 16 queries) x R keys, R = 12 (W = 16: 24 or 12 accumulators of 32
// registers) or 6 (W = 8: 12 of 16), then x 4 (so that the rest of the block is a multiple of 4), into w.st (tb,
// G), where the softmax (softmax_lanes) and the value tiles read them.
constexpr int kLanesKeys = W == 16 ? 12 : 6;  // keys per queries-in-lanes tile (but a block's last few: 4)

// One queries-in-lanes tile of QV vectors of queries and `rows` keys (kLanesKeys or 4); a full tile whose rows are
// S = 64 or 128 floats apart is addressed from its first row.
template <int QV>
inline void lanes_tile(int64_t rows, int S, const float* q, int64_t G, const float* const* k, int64_t dk,
                       float* out, Ahead& ahead) {
  constexpr int R = kLanesKeys;
  if (rows != R) scores_lanes<QV, 4>(q, G, k, dk, out, ahead);
  else if (S == 128) scores_lanes<QV, R, 128>(q, G, k, dk, out, ahead);
  else if (S == 64) scores_lanes<QV, R, 64>(q, G, k, dk, out, ahead);
  else scores_lanes<QV, R>(q, G, k, dk, out, ahead);
}

template <typename T>
void scores_in_lanes(const Dims& d, const float* const* kr, Scratch<T>& w) {
  constexpr int64_t R = kLanesKeys;
  constexpr int QV = 16 / W;  // vectors of queries in a 16-query tile
  const int64_t G = d.G, tb = d.tb;
  const bool pairs = W == 16 && G % 32 == 0;  // 32 queries per tile
  float* st = w.st.data();
  int64_t wide = tb / R;
  while ((tb - R * wide) % 4 != 0) --wide;
  for (int64_t j = 0; j < tb;) {
    const int64_t rows = j < R * wide ? R : 4;
    bool even = d.dk == 64 || d.dk == 128;  // rows dk apart (a contiguous cache, or within a page)
    for (int64_t r = 1; r < rows && even; ++r) even = kr[j + r] == kr[j] + r * d.dk;
    const int S = !even ? 0 : static_cast<int>(d.dk);
    for (int64_t g = 0; g < G; g += pairs ? 32 : 16) {
      if (pairs) lanes_tile<2 * QV>(rows, S, &w.qt[g], G, &kr[j], d.dk, st + j * G + g, w.ahead);
      else lanes_tile<QV>(rows, S, &w.qt[g], G, &kr[j], d.dk, st + j * G + g, w.ahead);
    }
    j += rows;
  }
}

// The online-softmax step of a block of n tokens for scores in the lanes layout, st (tb, G), G a multiple of 16:
// W queries per vector, the block's maximum taken down each column (no horizontal reductions, no transposes), the
// weights written over the scores (rows past n keep their scores: only a staged block is partial, and its value
// rows there are zeros), what was accumulated in part rescaled, and part's maximum and exp-sum updated.
inline void softmax_lanes(const Dims& d, int64_t n, float* st, float* part) {
  const int64_t G = d.G, stride = d.dv_pad + 2;
  for (int64_t c = 0; c < G; c += W) {
    alignas(64) float m[W], l[W], alpha[W];
    for (int i = 0; i < W; ++i) {
      m[i] = part[(c + i) * stride + d.dv_pad];
      l[i] = part[(c + i) * stride + d.dv_pad + 1];
    }
    vf mx = splat<vf>(kNegInf);
    for (int64_t j = 0; j < n; ++j) mx = mx > vload(st + j * G + c) ? mx : vload(st + j * G + c);
    const vf m_old = vload(m), m_new = m_old > mx ? m_old : mx;
    const vf neg_inf = splat<vf>(kNegInf), zero = splat<vf>(0.f);
    alignas(64) float m_now[W];
    vstore(m_now, m_new);
    bool dead = false;  // a query with no score above -inf yet: its weights 0, NaN where a score is NaN
    for (int i = 0; i < W; ++i) dead |= m_now[i] == kNegInf;
    vf lsum = zero;
    for (int64_t j = 0; j < n; ++j) {
      const vf x = vload(st + j * G + c);
      vf e = exp2_neg(x - m_new);
      if (dead) e = m_new == neg_inf ? (x != x ? x : zero) : e;
      vstore(st + j * G + c, e);
      lsum += e;
    }
    // m_old = -inf (nothing yet): ~2^-126, times what is zero; both -inf: 0 (not NaN)
    vstore(alpha, m_new == neg_inf ? zero : exp2_neg(m_old - m_new));
    vstore(l, vload(l) * vload(alpha) + lsum);
    vstore(m, m_new);
    for (int i = 0; i < W; ++i) {
      float* acc = part + (c + i) * stride;
      if (alpha[i] != 1.f)
        for (int64_t k = 0; k < d.dv_pad; k += W) vstore(acc + k, vload(acc + k) * splat<vf>(alpha[i]));
      acc[d.dv_pad] = m[i];
      acc[d.dv_pad + 1] = l[i];
    }
  }
}

}  // namespace attnlab_fused
