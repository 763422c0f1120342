// Attention of one query per head over a cache (flash-decoding, Dao et al. 2023, one pass per block of cached
// tokens): the G queries of one KV head's group are scored against a block of cached keys, the block's scores
// update a running maximum and exp-sum (online softmax, Milakov & Gimelshein 2018), and the block's values are
// accumulated with the new weights, so every cached key and value is read from memory once. The context of a
// (batch row, KV head) pair is cut into chunks whose size depends on that row's length alone; chunks run in
// parallel and are merged by log-sum-exp. Nothing depends on the batch size or on where a token is stored, so a
// row's result is bit-identical whether it is decoded alone or in a batch, from a contiguous cache or a paged one.
//
// Layout: q (B, H, Dk) contiguous, H = n_kv * G, query head h*G + g reads KV head h. The key of batch row b, KV
// head h, token t is the row `Rows::at(b, h, t)` of Dk values (strided, or through a table of slots into a
// pool); values likewise with Dv <= Dk values (MLA's absorbed values are the first Dv of the key row: the same
// memory). Arithmetic is float32; bfloat16 is widened on load and the output rounded once (to nearest even).
#pragma once

#include "amx.h"
#include "rows.h"
#include "scores.h"
#include "values.h"
#include "vectors.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace attnlab_fused {

// The scores of one block of n rows (kr, vr: the rows, cache element type or staged float32), its online-softmax
// update of `part` and its values accumulated into it. `from_memory`: the rows were not staged (so still in
// memory, or on their way): the first query then takes the values row by row (the order the hardware prefetcher
// follows), which leaves the block in cache for the others' column slices; staged rows are in cache already.
template <typename T, typename E>
void attend_block(const Dims& d, int64_t n, const E* const* kr, const E* const* vr, bool from_memory, Scratch<T>& w,
                  float* part) {
  const int64_t G = d.G, tb = d.tb, stride = d.dv_pad + 2;
  float* s = w.s.data();
  {  // the next block's lines (w.ahead, from attend_chunk), over this block's tile steps (roughly counted)
    const bool in_lanes = std::is_same<E, float>::value && lanes(d);
    const int64_t score_steps = in_lanes ? tb * (d.G / 16) * d.dk / kLanesKeys
                                         : tb / 4 * (d.G + 2) / 3 * (d.dk_pad / W);
    const int64_t value_steps = n * ((d.G + 2) / 3) * ((d.dv_pad + 8 * W - 1) / (8 * W));
    w.ahead.spread(score_steps + value_steps);
  }
  // the weights: in w.s (G, tb), query by query, or for float32 groups scored in the lanes in w.st (tb, G), W
  // queries per vector; p_stride / p_step: from one query's weight to the next query's / the next token's
  const bool in_lanes = std::is_same<E, float>::value && lanes(d);
  const float* p = in_lanes ? w.st.data() : s;
  const int64_t p_stride = in_lanes ? 1 : tb, p_step = in_lanes ? G : 1;
  if (in_lanes) {
    if constexpr (std::is_same<E, float>::value) scores_in_lanes(d, kr, w);
    softmax_lanes(d, n, w.st.data(), part);
  } else {
    scores_in_rows(d, kr, w);
    for (int64_t g = 0; g < G; ++g) {  // online softmax: new maximum, rescale what was accumulated, weights
      float* sg = s + g * tb;
      float* st = part + g * stride;
      for (int64_t j = n; j < tb; ++j) sg[j] = kNegInf;
      vf mx = vload(sg);
      for (int64_t j = W; j < tb; j += W) mx = mx > vload(sg + j) ? mx : vload(sg + j);
      const float m_old = st[d.dv_pad], m_new = std::max(m_old, vhmax(mx));
      if (m_new == kNegInf) {  // no score above -inf yet: weights 0, NaN where a score is NaN (a NaN query)
        for (int64_t j = 0; j < tb; ++j) sg[j] = sg[j] != sg[j] ? sg[j] : 0.f;
      } else {
        for (int64_t j = 0; j < tb; j += W) vstore(sg + j, exp2_neg(vload(sg + j) - splat<vf>(m_new)));
        for (int64_t j = n; j < tb; ++j) sg[j] = 0.f;  // exp2_neg flushes to 2^-126, not to 0
      }
      vf lsum = splat<vf>(0.f);
      for (int64_t j = 0; j < tb; j += W) lsum += vload(sg + j);
      const float alpha = m_old == kNegInf ? 0.f : std::exp2(m_old - m_new);
      if (alpha != 1.f)
        for (int64_t c = 0; c < d.dv_pad; c += W) vstore(st + c, vload(st + c) * splat<vf>(alpha));
      st[d.dv_pad] = m_new;
      st[d.dv_pad + 1] = st[d.dv_pad + 1] * alpha + vhsum(lsum);
    }
  }
  // Groups of up to 4 whose accumulators for a whole value row fit in the registers take the rows in one pass, in
  // row order, all queries at once (3 queries of 64 dims, float32, one core, in cache: 55 -> 51 us per 1024
  // tokens, against the first query row by row and then the others).
  const bool one_pass = G <= 4 && d.dv_pad <= W * heads_nv(static_cast<int>(G));
  int64_t g0 = 0;
  if (from_memory && !one_pass && accumulate_rows(d.dv_pad, part, p, p_step, vr, n, w.ahead)) g0 = 1;
  // the other queries in threes (3 x 8 W-column tiles for W = 16, 3 x 4 W for W = 8), four at the end rather than
  // a triple and a single
  const int64_t quad = (G - g0) % 3 == 1 && G - g0 >= 4 ? 4 : 0;
  int64_t g = g0;
  for (; g + 3 <= G - quad; g += 3)
    accumulate_heads<3>(part + g * stride, stride, p + g * p_stride, p_stride, p_step, vr, n, d.dv_pad, w.ahead);
  if (quad)
    accumulate_heads<4>(part + g * stride, stride, p + g * p_stride, p_stride, p_step, vr, n, d.dv_pad, w.ahead);
  if (G - g == 2)
    accumulate_heads<2>(part + g * stride, stride, p + g * p_stride, p_stride, p_step, vr, n, d.dv_pad, w.ahead);
  if (G - g == 1)
    accumulate_heads<1>(part + g * stride, stride, p + g * p_stride, p_stride, p_step, vr, n, d.dv_pad, w.ahead);
}

// One chunk: part (G, dv_pad + 2) receives, per query, the unnormalised output, the maximum score and the
// exp-sum (scores in log2 units: the queries were scaled by log2(e)).
template <typename T>
void attend_chunk(const Dims& d, const Rows<T>& keys, const Rows<T>& values, const Item& it, const Item* next,
                  Scratch<T>& w, float* part) {
  const int64_t G = d.G, tb = d.tb, stride = d.dv_pad + 2;
  const int64_t k_bytes = d.dk * static_cast<int64_t>(sizeof(T)), v_bytes = d.dv * static_cast<int64_t>(sizeof(T));
  const bool v_apart = values.base != keys.base;  // MLA's values are the first columns of its key rows
  // the lines of the block after t0 (in this chunk, else the first of the thread's next chunk) go to w.ahead
  auto plan_after = [&](int64_t t0) {
    w.ahead.clear();
    const Item* at = t0 + tb < it.hi ? &it : next;
    const int64_t t1 = t0 + tb < it.hi ? t0 + tb : at ? at->lo : 0;
    if (at == nullptr) return;
    const int64_t count = std::min(tb, at->hi - t1);
    w.ahead.add(keys, *at, t1, count, k_bytes);
    if (v_apart) w.ahead.add(values, *at, t1, count, v_bytes);
  };
  for (int64_t g = 0; g < G; ++g) {
    std::fill(part + g * stride, part + g * stride + d.dv_pad, 0.f);
    part[g * stride + d.dv_pad] = kNegInf;
    part[g * stride + d.dv_pad + 1] = 0.f;
  }
  for (int64_t t0 = it.lo; t0 < it.hi; t0 += tb) {
    const int64_t n = std::min(tb, it.hi - t0);
    plan_after(t0);
    if (in_place(d, n)) {
      RowWalk<T> kw{keys, it.b, it.h, t0}, vw{values, it.b, it.h, t0};
      for (int64_t j = 0; j < tb; ++j) {
        w.kc[j] = kw.next();
        w.vc[j] = vw.next();
      }
      attend_block(d, n, w.kc.data(), w.vc.data(), true, w, part);
      continue;
    }
    stage(keys, it.b, it.h, t0, n, d.dk, w.k.data(), d.dk_pad);
    stage(values, it.b, it.h, t0, n, d.dv, w.v.data(), d.dv_pad);
    if (n < tb) {  // rows past the chunk's end: zeros (their weights are set to 0)
      std::fill(w.k.begin() + n * d.dk_pad, w.k.end(), 0.f);
      std::fill(w.v.begin() + n * d.dv_pad, w.v.end(), 0.f);
    }
    attend_block(d, n, w.kr.data(), w.vr.data(), false, w, part);
  }
}

// Tokens per chunk for a row of `len` tokens: a function of the length alone (results must not depend on the
// batch), large enough to amortise a chunk's setup, small enough that one row keeps both cores busy.
inline int64_t chunk_tokens(int64_t len) { return std::min<int64_t>(4096, std::max<int64_t>(256, (len + 3) / 4)); }

// Tokens per staged block: keys and values of a block in ~64 KiB (level-2 cache), a multiple of 16 (of W).
inline int64_t block_tokens(int64_t dk_pad, int64_t dv_pad) {
  return std::max<int64_t>(16, std::min<int64_t>(128, (65536 / (4 * (dk_pad + dv_pad))) / 16 * 16));
}

// Merge the chunks of every (row, KV head) into out (B, H, dv): out = sum_c 2^(m_c - M) acc_c / sum_c 2^(m_c - M) l_c;
// the weights 2^(m_c - M) of a row's chunks and queries in one vector pass, the sums W columns at a time.
template <typename T>
void merge(const Dims& d, int64_t B, int64_t n_kv, int64_t H, const std::vector<int64_t>& first,
           const std::vector<float>& parts, T* out) {
  const int64_t G = d.G, dv = d.dv, stride = d.dv_pad + 2;
  std::vector<float> o(d.dv_pad), m(G), wgt;
  for (int64_t bh = 0; bh < B * n_kv; ++bh) {
    const int64_t c0 = first[bh], nc = first[bh + 1] - c0;
    std::fill(m.begin(), m.end(), kNegInf);
    for (int64_t c = 0; c < nc; ++c)
      for (int64_t g = 0; g < G; ++g) m[g] = std::max(m[g], parts[((c0 + c) * G + g) * stride + d.dv_pad]);
    wgt.assign(round_up(nc * G, W), 0.f);
    for (int64_t c = 0; c < nc; ++c)
      for (int64_t g = 0; g < G; ++g) wgt[c * G + g] = parts[((c0 + c) * G + g) * stride + d.dv_pad] - m[g];
    for (int64_t i = 0; i < nc * G; i += W) vstore(&wgt[i], exp2_neg(vload(&wgt[i])));
    for (int64_t g = 0; g < G; ++g) {
      std::fill(o.begin(), o.end(), 0.f);
      float l = 0.f;
      for (int64_t c = 0; c < nc; ++c) {
        const float* pc = parts.data() + ((c0 + c) * G + g) * stride;
        // a chunk with nothing attended, or only scores of -inf (exp2_neg gives 2^-126, not 0): its exp-sum is 0.
        // Not its maximum alone, -inf there too when every score was NaN (a NaN query), whose NaN exp-sum must
        // reach the output.
        if (pc[d.dv_pad + 1] == 0.f) continue;
        const float w = wgt[c * G + g];
        l += w * pc[d.dv_pad + 1];
        for (int64_t k = 0; k < d.dv_pad; k += W) vstore(&o[k], vload(&o[k]) + splat<vf>(w) * vload(pc + k));
      }
      const float inv = l == 0.f ? 0.f : 1.f / l;  // a row with nothing to attend to gets zeros (l NaN: NaN)
      T* dst = out + ((bh / n_kv) * H + (bh % n_kv) * G + g) * dv;
      for (int64_t k = 0; k < dv; ++k) dst[k] = narrow<T>(o[k] * inv);
    }
  }
}

// Attention of q (B, H, dk) over rows [lo[b], hi[b]) of every batch row into out (B, H, dv).
template <typename T>
void decode(const T* q, int64_t B, int64_t H, int64_t n_kv, int64_t dk, int64_t dv, const Rows<T>& keys,
            const Rows<T>& values, const int64_t* lo, const int64_t* hi, float scale, T* out, int max_threads) {
  Dims d{H / n_kv, dk, dv, round_up(dk, 16), round_up(dv, 16), 0};
  d.tb = block_tokens(d.dk_pad, d.dv_pad);
  std::vector<Item> items;
  std::vector<int64_t> first(B * n_kv + 1, 0);  // the chunks of pair bh are items first[bh] .. first[bh+1]-1
  int64_t tokens = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t ch = chunk_tokens(std::max<int64_t>(0, hi[b] - lo[b]));
    tokens += std::max<int64_t>(0, hi[b] - lo[b]);
    for (int64_t h = 0; h < n_kv; ++h) {
      for (int64_t t = lo[b]; t < hi[b]; t += ch) items.push_back({b, h, t, std::min(hi[b], t + ch)});
      first[b * n_kv + h + 1] = static_cast<int64_t>(items.size());
    }
  }
  const int64_t G = d.G, stride = d.dv_pad + 2, n_items = static_cast<int64_t>(items.size());
  std::vector<float> parts(std::max<int64_t>(1, n_items * G * stride));
  const float qscale = scale * kLog2e;  // scores in log2 units: exp2 instead of exp
  const int64_t bytes = tokens * n_kv * (dk + dv) * static_cast<int64_t>(sizeof(T));
  const int n_threads = bytes < kParallelBytes ? 1 : std::max(1, std::min<int>(max_threads, static_cast<int>(n_items)));
#if defined(ATTNLAB_PAIRS)
  if constexpr (std::is_same<T, bf16>::value) {
    if (amx_takes(d)) {
      amx_decode(d, q, H, n_kv, keys, values, items, qscale, n_threads, parts.data());
      merge(d, B, n_kv, H, first, parts, out);
      return;
    }
  }
#endif
  std::atomic<int64_t> taken{0};
#pragma omp parallel num_threads(n_threads)
  {
    static thread_local Scratch<T> w;
    w.reset(d);
    int64_t q_of = -1;  // the (b, h) whose queries are in w.q
    for_each_chunk(taken, n_items, [&](int64_t i, int64_t next) {
      const Item& it = items[i];
      if (q_of != it.b * n_kv + it.h) {
        q_of = it.b * n_kv + it.h;
        for (int64_t g = 0; g < G; ++g) {
          const T* src = q + (it.b * H + it.h * G + g) * dk;
          for (int64_t c = 0; c < dk; ++c) w.q[g * d.dk_pad + c] = widen(src[c]) * qscale;
        }
        if (lanes(d))
          for (int64_t g = 0; g < G; ++g)
            for (int64_t c = 0; c < dk; ++c) w.qt[c * G + g] = w.q[g * d.dk_pad + c];
      }
      attend_chunk(d, keys, values, it, next >= 0 ? &items[next] : nullptr, w, parts.data() + i * G * stride);
    });
  }
  merge(d, B, n_kv, H, first, parts, out);
}

}  // namespace attnlab_fused
