// bfloat16 blocks on the AMX tile unit (Intel Sapphire Rapids and later), where the compiler targets it
// (-march=native on such a CPU) and the kernel grants the tile state at run time; elsewhere the float32 tiles
// (scores.h, values.h) take them. ATTNLAB_AMX is defined where this path is compiled in.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__linux__)
#define ATTNLAB_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "rows.h"
#include "scores.h"
#include "vectors.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace attnlab_fused {

// Where the CPU has AMX (Intel Sapphire Rapids and later: a tile unit that multiplies 16 x 32 bfloat16 by 32 x 16
// into 16 x 16 float32 in one instruction, over 1 TFLOP/s per core against ~0.2 for float32 FMAs), a bfloat16
// step can be bound by memory rather than arithmetic, if the rows reach the tiles in the layouts they take:
// - scores, transposed: S^T (tokens, Gp) = K (tokens, dk) Q^T. The key rows are the A operand where they lie in
//   the cache (16 rows of 32 values per tile, any row stride), the queries the B operand, laid out once per call
//   in the tile unit's pairs (row i holds elements 2i and 2i+1 of every column). Products of bfloat16 are exact in
//   float32 and summed in float32: the scores are as accurate as the float32 tiles' on widened rows.
// - the online softmax runs down the columns of S^T (16 queries per vector, no horizontal sums), rounds the
//   weights to bfloat16 as the tiles take them, and transposes them, 16 x 16 at a time, into P (Gp, tokens); the
//   exp-sum adds the rounded weights, so that the weights that multiply the values sum to the divisor
//   (FlashAttention, too, rounds its weights to the value type). 2^x is a degree-4 polynomial there (relative
//   error < 5e-5, far below bfloat16's rounding of the weights).
// - values: O (Gp, dv) += P V, with V the B operand: the block's value rows interleaved by pairs of tokens (two
//   permutes per 32 columns of two rows) into a buffer that the tiles read.
// Groups are padded to Gp, a multiple of 16, so that every tile register has one shape (16 rows of 64 bytes); the
// padding queries are zeros, their weights never computed. Nothing depends on where a row is stored or on the
// batch: rows that are not 16 at one stride are copied into a staging tile, same values, same sums.

#if defined(ATTNLAB_AMX)
constexpr int64_t kAmxTokens = 256;   // tokens per block: 16 key tiles of 16 rows, 8 value steps of 32
std::atomic<bool> amx_enabled{true};  // attnlab_set_amx(0) sends bfloat16 rows to the float32 tiles (tests, A/B)

// Whether this process may use the tiles: Linux hands out their register state (8 KiB) on request, once per
// process (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, kernel 5.16 and later).
inline bool amx_granted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Whether bfloat16 rows of these dims go to the tiles: keys in whole 32-value steps, values in 16-column slices, and
// groups of 8 or more queries (with 4, the float32 tiles on widened rows keep up with memory and the tiles' own
// loads, which stream less well, lose: 32 heads of 128 over 8 KV heads, contexts 4096 and 16384, 1.09-1.14x slower).
inline bool amx_takes(const Dims& d) {
  return amx_enabled.load(std::memory_order_relaxed) && d.G >= 8 && d.dk % 32 == 0 && d.dv % 16 == 0 &&
         amx_granted();
}

// Every tile register holds 16 rows of 64 bytes (palette 1): 16 x 16 float32 accumulators, 16 x 32 bfloat16 operands
// (key rows, weights), 16 pairs x 16 bfloat16 pairs (queries, values).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// A thread's buffers of the tile path, kept from call to call (a decode step is too short to allocate ~100 KiB and
// clear it): for Gp queries (G real) and tb = kAmxTokens, the queries in pairs qt (dk/32 steps, 16 pairs, Gp, 2),
// scores st (tb, Gp), weights p (Gp, tb), interleaved values vi (dv/16 slices, tb/2 pairs, 32), a staging tile pair
// for key rows that are not 16 at one stride (32, dk), the output acc (Gp, dv), and per query the running maximum
// (of raw scores), exp-sum and rescaling factor.
struct AmxScratch {
  int64_t Gp = 0;
  std::vector<uint32_t> qt;
  std::vector<uint16_t> p, vi, kstage;
  std::vector<float> st, acc, m, l, alpha;
  Ahead ahead;  // the next block's rows, asked for a few lines per step of the softmax and the value interleave
  void reset(const Dims& d) {
    Gp = round_up(d.G, 16);
    qt.assign(d.dk / 2 * Gp, 0);
    p.resize(Gp * kAmxTokens);
    std::fill(p.begin() + d.G * kAmxTokens, p.end(), 0);  // the padding queries' weights: zero, never written
    vi.resize(d.dv * kAmxTokens);
    kstage.resize(32 * d.dk);
    st.resize(kAmxTokens * Gp);
    acc.resize(Gp * d.dv);
    m.resize(Gp);
    l.resize(Gp);
    alpha.resize(Gp);
  }
};

// The group's G queries (rows of dk at q) in the tile unit's pairs: qt[s][i][g] = q[g][32 s + 2 i .. + 1].
inline void amx_queries(const bf16* q, int64_t G, int64_t dk, AmxScratch& w) {
  const int64_t Gp = w.Gp;
  for (int64_t g = 0; g < G; ++g) {
    const bf16* qg = q + g * dk;
    for (int64_t c = 0; c < dk / 2; ++c) {
      uint32_t pair;
      std::memcpy(&pair, qg + 2 * c, 4);
      w.qt[c * Gp + g] = pair;  // c = 16 s + i
    }
  }
}

// Rows t0 .. t0+15 as one tile operand: where they lie if they are 16 rows at one stride (a contiguous cache
// always, a paged one within a page), else copied into `stage` (rows at or past `n` zero). Sets the byte stride.
inline const void* amx_rows(const Rows<bf16>& rows, const Item& it, int64_t t0, int64_t n, int64_t dk,
                            uint16_t* stage, int64_t* stride) {
  if (n >= 16) {
    if (rows.run(t0) >= 16) {  // within one page (or no pages): 16 rows at the token stride
      *stride = rows.token_stride * 2;
      return rows.at(it.b, it.h, t0);
    }
  }
  RowWalk<bf16> walk{rows, it.b, it.h, t0};
  for (int64_t j = 0; j < 16; ++j) {
    if (j < n) std::memcpy(stage + j * dk, walk.next(), dk * 2);
    else std::memset(stage + j * dk, 0, dk * 2);
  }
  *stride = dk * 2;
  return stage;
}

// Value rows t0 .. t0 + 2 pairs - 1 (those at or past n: zeros) interleaved by pairs of tokens into vi:
// vi[c][r][2 i + e] = v[2 r + e][16 c + i] for column slices c of 16.
inline void amx_values(const Rows<bf16>& values, const Item& it, int64_t t0, int64_t n, int64_t pairs, int64_t dv,
                       uint16_t* vi, Ahead& ahead) {
  alignas(64) static const uint16_t order[2][32] = {
      {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
      {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30,
       62, 31, 63}};
  const __m512i lo = _mm512_load_si512(order[0]), hi = _mm512_load_si512(order[1]);
  const int64_t slice = kAmxTokens / 2 * 32;  // elements per column slice
  RowWalk<bf16> walk{values, it.b, it.h, t0};
  for (int64_t r = 0; r < pairs; ++r) {
    const bf16* a = 2 * r < n ? walk.next() : nullptr;
    const bf16* b = 2 * r + 1 < n ? walk.next() : nullptr;
    uint16_t* out = vi + r * 32;
    int64_t c = 0;
    ahead.step();
    for (; c + 32 <= dv; c += 32, out += 2 * slice) {
      const __m512i x = a ? _mm512_loadu_si512(a + c) : _mm512_setzero_si512();
      const __m512i y = b ? _mm512_loadu_si512(b + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(out, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(out + slice, _mm512_permutex2var_epi16(x, hi, y));
    }
    if (c < dv) {  // a last slice of 16 columns
      const __m512i x = a ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c)))
                          : _mm512_setzero_si512();
      const __m512i y = b ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + c)))
                          : _mm512_setzero_si512();
      _mm512_storeu_si512(out, _mm512_permutex2var_epi16(x, lo, y));
    }
  }
}

// 2^x for x <= 0 to a relative error below 5e-5 (Taylor polynomial of degree 4 on |f| <= 1/2; scalef applies 2^n).
inline __m512 exp2_coarse(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(9.6181291e-3f), f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// o[j][i] = r[i][j] for 16 rows of 16 bfloat16 (stages of 16-, 32-, 64-bit interleaves, then 128-bit halves).
inline void transpose16x16(const __m256i* r, __m256i* o) {
  __m256i t[16], u[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm256_unpacklo_epi16(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm256_unpackhi_epi16(r[2 * k], r[2 * k + 1]);
  }
  for (int m = 0; m < 4; ++m) {  // u[4m + j]: tokens 4m .. 4m+3 of queries (per 128-bit half) 2j, 2j+1
    u[4 * m] = _mm256_unpacklo_epi32(t[4 * m], t[4 * m + 2]);
    u[4 * m + 1] = _mm256_unpackhi_epi32(t[4 * m], t[4 * m + 2]);
    u[4 * m + 2] = _mm256_unpacklo_epi32(t[4 * m + 1], t[4 * m + 3]);
    u[4 * m + 3] = _mm256_unpackhi_epi32(t[4 * m + 1], t[4 * m + 3]);
  }
  for (int j = 0; j < 4; ++j)
    for (int e = 0; e < 2; ++e) {  // query 2j + e of each half: tokens 0-7 (v) and 8-15 (x)
      const __m256i v = e ? _mm256_unpackhi_epi64(u[j], u[4 + j]) : _mm256_unpacklo_epi64(u[j], u[4 + j]);
      const __m256i x = e ? _mm256_unpackhi_epi64(u[8 + j], u[12 + j]) : _mm256_unpacklo_epi64(u[8 + j], u[12 + j]);
      o[2 * j + e] = _mm256_permute2x128_si256(v, x, 0x20);
      o[8 + 2 * j + e] = _mm256_permute2x128_si256(v, x, 0x31);
    }
}

// The online-softmax step of a block of n tokens whose scores are in w.st: per query the block's maximum, the
// factor alpha by which what was accumulated shrinks, the weights P (rounded to bfloat16; zero past n to a whole
// tile of 16: the 16 after that, in the last value step of 32, may hold an earlier block's weights, finite, which
// meet value rows of zeros) and the exp-sum. Scores are raw (the queries unscaled): weights are 2^((s - m) qscale).
inline void amx_softmax(int64_t G, int64_t n, float qscale, AmxScratch& w) {
  const int64_t Gp = w.Gp, tb = kAmxTokens, tiles = round_up(n, 16) / 16;
  const __m512 qs = _mm512_set1_ps(qscale);
  for (int64_t c = 0; c < G; c += 16) {  // 16 queries, a column of S^T
    const float* sc = w.st.data() + c;
    __m512 mx = _mm512_set1_ps(kNegInf);
    for (int64_t t = 0; t < n; ++t) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sc + t * Gp));
    const __m512 m_old = _mm512_loadu_ps(&w.m[c]), m_new = _mm512_max_ps(m_old, mx);
    const __m512 alpha = exp2_coarse(_mm512_mul_ps(_mm512_sub_ps(m_old, m_new), qs));  // ~0 while m_old = -inf
    _mm512_storeu_ps(&w.m[c], m_new);
    _mm512_storeu_ps(&w.alpha[c], alpha);
    const __m512 shift = _mm512_mul_ps(m_new, qs);
    __m512 lsum = _mm512_setzero_ps();
    for (int64_t tile = 0; tile < tiles; ++tile) {
      __m256i r[16], o[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t t = 16 * tile + i;
        if (t >= n) {
          r[i] = _mm256_setzero_si256();
          continue;
        }
        w.ahead.step();
        const __m512 e = exp2_coarse(_mm512_fmsub_ps(_mm512_loadu_ps(sc + t * Gp), qs, shift));
        r[i] = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e));
        lsum = _mm512_add_ps(lsum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r[i]), 16)));
      }
      transpose16x16(r, o);
      for (int64_t j = 0; j < 16; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&w.p[(c + j) * tb + 16 * tile]), o[j]);
    }
    _mm512_storeu_ps(&w.l[c], _mm512_fmadd_ps(_mm512_loadu_ps(&w.l[c]), alpha, lsum));
  }
}

// One block of n tokens (t0 ..) of a chunk on the tiles: scores, softmax, values into w.acc. Asks for the next
// block's rows while the scores are computed.
void amx_block(const Dims& d, const Rows<bf16>& keys, const Rows<bf16>& values, const Item& it, int64_t t0,
               int64_t n, float qscale, AmxScratch& w) {
  const int64_t Gp = w.Gp, tb = kAmxTokens, dk = d.dk, dv = d.dv;
  float* st = w.st.data();
  w.ahead.spread((d.G + 15) / 16 * round_up(n, 16) + round_up(n, 32) / 2 + round_up(n, 32) / 32 * (Gp / 32 + 1) * dk / 32);
  // scores S^T (tb, Gp), 32 tokens x 32 queries at a time: four accumulators (tiles 0-3) in flight, key rows in
  // tiles 4-5, queries in 6-7
  for (int64_t tt = 0; tt < n; tt += 32) {
    int64_t s0 = 0, s1 = 0;
    const char* k0 = static_cast<const char*>(amx_rows(keys, it, t0 + tt, n - tt, dk, w.kstage.data(), &s0));
    const char* k1 = static_cast<const char*>(
        amx_rows(keys, it, t0 + tt + 16, n - tt - 16, dk, w.kstage.data() + 16 * dk, &s1));
    for (int64_t qg = 0; qg < Gp; qg += 32) {
      const bool two = qg + 16 < Gp;
      _tile_zero(0);
      _tile_zero(1);
      if (two) {
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t s = 0; s < dk / 32; ++s) {
        w.ahead.step();
        _tile_loadd(4, k0 + 64 * s, s0);
        _tile_loadd(5, k1 + 64 * s, s1);
        _tile_loadd(6, &w.qt[s * 16 * Gp + qg], Gp * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
          _tile_loadd(7, &w.qt[s * 16 * Gp + qg + 16], Gp * 4);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, st + tt * Gp + qg, Gp * 4);
      _tile_stored(1, st + (tt + 16) * Gp + qg, Gp * 4);
      if (two) {
        _tile_stored(2, st + tt * Gp + qg + 16, Gp * 4);
        _tile_stored(3, st + (tt + 16) * Gp + qg + 16, Gp * 4);
      }
    }
  }
  amx_softmax(d.G, n, qscale, w);
  for (int64_t g = 0; g < d.G; ++g)  // what was accumulated, rescaled to the new maximum
    if (w.alpha[g] != 1.f) {
      const __m512 a = _mm512_set1_ps(w.alpha[g]);
      for (int64_t c = 0; c < dv; c += 16)
        _mm512_storeu_ps(&w.acc[g * dv + c], _mm512_mul_ps(_mm512_loadu_ps(&w.acc[g * dv + c]), a));
    }
  const int64_t steps = round_up(n, 32) / 32, slice = tb / 2 * 32;
  amx_values(values, it, t0, n, steps * 16, dv, w.vi.data(), w.ahead);
  for (int64_t qg = 0; qg < d.G; qg += 16)  // O += P V: four slices of 16 columns (tiles 0-3) at a time
    for (int64_t c = 0; c < dv / 16; c += 4) {
      const int64_t nc = std::min<int64_t>(4, dv / 16 - c);
      float* o = w.acc.data() + qg * dv + 16 * c;
      _tile_loadd(0, o, dv * 4);
      if (nc > 1) _tile_loadd(1, o + 16, dv * 4);
      if (nc > 2) _tile_loadd(2, o + 32, dv * 4);
      if (nc > 3) _tile_loadd(3, o + 48, dv * 4);
      for (int64_t s = 0; s < steps; ++s) {
        const uint16_t* vs = w.vi.data() + c * slice + s * 16 * 32;
        _tile_loadd(4, w.p.data() + qg * tb + 32 * s, tb * 2);
        _tile_loadd(6, vs, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (nc > 1) {
          _tile_loadd(7, vs + slice, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (nc > 2) {
          _tile_loadd(5, vs + 2 * slice, 64);
          _tile_dpbf16ps(2, 4, 5);
        }
        if (nc > 3) {
          _tile_loadd(6, vs + 3 * slice, 64);
          _tile_dpbf16ps(3, 4, 6);
        }
      }
      _tile_stored(0, o, dv * 4);
      if (nc > 1) _tile_stored(1, o + 16, dv * 4);
      if (nc > 2) _tile_stored(2, o + 32, dv * 4);
      if (nc > 3) _tile_stored(3, o + 48, dv * 4);
    }
}

// One chunk on the tiles; part as attend_chunk's (the maximum in log2 units, as the merge expects).
void amx_chunk(const Dims& d, const Rows<bf16>& keys, const Rows<bf16>& values, const Item& it, const Item* next,
               float qscale, AmxScratch& w, float* part) {
  const int64_t stride = d.dv_pad + 2, tb = kAmxTokens;
  const bool v_apart = values.base != keys.base;  // MLA's values are the first columns of its key rows
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  std::fill(w.m.begin(), w.m.end(), kNegInf);
  std::fill(w.l.begin(), w.l.end(), 0.f);
  for (int64_t t0 = it.lo; t0 < it.hi; t0 += tb) {
    w.ahead.clear();  // the block after this one (in this chunk, else the first of the thread's next chunk)
    const Item* at = t0 + tb < it.hi ? &it : next;
    if (at != nullptr) {
      const int64_t t1 = at == &it ? t0 + tb : at->lo, count = std::min(tb, at->hi - t1);
      w.ahead.add(keys, *at, t1, count, d.dk * 2);
      if (v_apart) w.ahead.add(values, *at, t1, count, d.dv * 2);
    }
    amx_block(d, keys, values, it, t0, std::min(tb, it.hi - t0), qscale, w);
  }
  for (int64_t g = 0; g < d.G; ++g) {
    float* pg = part + g * stride;
    std::copy(w.acc.begin() + g * d.dv, w.acc.begin() + (g + 1) * d.dv, pg);
    std::fill(pg + d.dv, pg + d.dv_pad, 0.f);
    pg[d.dv_pad] = w.m[g] * qscale;
    pg[d.dv_pad + 1] = w.l[g];
  }
}

// Every chunk of `items` on the tiles (decode's parallel region for bfloat16 rows the tiles take).
void amx_decode(const Dims& d, const bf16* q, int64_t H, int64_t n_kv, const Rows<bf16>& keys,
                const Rows<bf16>& values, const std::vector<Item>& items, float qscale, int n_threads, float* parts) {
  const int64_t n_items = static_cast<int64_t>(items.size()), stride = d.dv_pad + 2;
#pragma omp parallel num_threads(n_threads)
  {
    static thread_local AmxScratch w;
    w.reset(d);
    const TileConfig cfg;
    _tile_loadconfig(&cfg);
    int64_t q_of = -1;  // the (b, h) whose queries are in w.qt
    const int64_t nt = omp_get_num_threads();
#pragma omp for schedule(static, 1)  // round-robin: a thread knows its next chunk (as in decode)
    for (int64_t i = 0; i < n_items; ++i) {
      const Item& it = items[i];
      if (q_of != it.b * n_kv + it.h) {
        q_of = it.b * n_kv + it.h;
        amx_queries(q + (it.b * H + it.h * d.G) * d.dk, d.G, d.dk, w);
      }
      amx_chunk(d, keys, values, it, i + nt < n_items ? &items[i + nt] : nullptr, qscale, w, parts + i * d.G * stride);
    }
    _tile_release();  // hand the tile state back: a context switch then saves 8 KiB less
  }
}
#endif

}  // namespace attnlab_fused
