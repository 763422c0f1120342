// bfloat16 blocks in pairs of bfloat16 (the pair path): on the AMX tile unit (Intel Sapphire Rapids and later),
// where the compiler targets it (-march=native on such a CPU) and the kernel grants the tile state at run time; else
// on AVX512-BF16's dot products (AMD Zen 4 and later, Intel Cooper Lake), same layouts, where the compiler targets
// those; elsewhere the float32 tiles (scores.h, values.h) take them. ATTNLAB_PAIRS is defined where the pair path
// is compiled in, ATTNLAB_AMX where its tile engine is too.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define ATTNLAB_PAIRS 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define ATTNLAB_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
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
//
// Without tiles the same layouts feed AVX512-BF16's dot products (below, dots_*): a 16-lane vector of queries per
// instruction, two products per lane, twice a float32 FMA's work and no widening of the rows (32 heads of 128 over 1,
// 2 and 4 KV heads, 1024 tokens in cache, one core of an AMD EPYC Zen 4: 2.04x, 1.99x and 1.36x the float32 tiles
// on widened rows; from memory on two cores, benchmarks/kernel_ab.py, 4096 and 16384 tokens: groups of 32
// 1.38-2.56x, of 16 1.34-1.95x, of 8 1.28-1.33x). Groups of 4 stay on the float32 tiles (16 lanes for 4 queries:
// 1.00x in cache, 0.80-0.93x from memory).

#if defined(ATTNLAB_PAIRS)
constexpr int64_t kAmxTokens = 256;     // tokens per block: 16 key tiles of 16 rows, 8 value steps of 32
std::atomic<bool> pairs_enabled{true};  // set_amx(0) sends bfloat16 rows to the float32 tiles (tests, A/B)

#if defined(ATTNLAB_AMX)
// Whether this process may use the tiles: Linux hands out their register state (8 KiB) on request, once per
// process (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, kernel 5.16 and later).
inline bool amx_granted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}
#else
inline bool amx_granted() { return false; }
#endif

// Whether bfloat16 rows of these dims take the pair path: keys in whole 32-value steps, values in 16-column slices,
// and on the tiles groups of 8 or more queries (with 4, the float32 tiles on widened rows keep up with memory and the
// tiles' own loads, which stream less well, lose: 32 heads of 128 over 8 KV heads, contexts 4096 and 16384,
// 1.09-1.14x slower); on the vectors' dot products, groups of kDotsGroup or more (the queries are padded to 16 lanes:
// groups of 4 lose, see above).
constexpr int64_t kDotsGroup = 8;
inline bool amx_takes(const Dims& d) {
  if (!pairs_enabled.load(std::memory_order_relaxed) || d.dk % 32 != 0 || d.dv % 16 != 0) return false;
  return d.G >= (amx_granted() ? 8 : kDotsGroup);
}

#if defined(ATTNLAB_AMX)
// Every tile register holds 16 rows of 64 bytes (palette 1): 16 x 16 float32 accumulators, 16 x 32 bfloat16 operands
// (key rows, weights), 16 pairs x 16 bfloat16 pairs (queries, values).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
#endif

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

// Whether a group's scores on the dot products take dots_eight: groups of 8, whose queries padded to 16 lanes
// would leave half of every instruction's products unused; not on the tiles.
inline bool eights(int64_t G) { return G == 8 && !amx_granted(); }

// The group's G queries (rows of dk at q) in the tile unit's pairs: qt[s][i][g] = q[g][32 s + 2 i .. + 1].
inline void amx_queries(const bf16* q, int64_t G, int64_t dk, AmxScratch& w) {
  const int64_t Gp = w.Gp;
  const bool eight = eights(G);
  for (int64_t g = 0; g < G; ++g) {
    const bf16* qg = q + g * dk;
    for (int64_t c = 0; c < dk / 2; ++c) {
      uint32_t pair;
      std::memcpy(&pair, qg + 2 * c, 4);
      if (eight) w.qt[c / 2 * 16 + 2 * g + c % 2] = pair;  // dots_eight's layout
      else w.qt[c * Gp + g] = pair;  // c = 16 s + i
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
  x = _mm512_max_ps(_mm512_set1_ps(-126.f), x);  // NaN stays NaN (max_ps returns its second operand)
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
    // queries with no score above -inf yet: weights 0, NaN where a score is NaN; alpha 0 (-inf - -inf is NaN)
    const __mmask16 dead = _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ);
    const __m512 alpha = _mm512_mask_mov_ps(  // ~0 while m_old = -inf
        exp2_coarse(_mm512_mul_ps(_mm512_sub_ps(m_old, m_new), qs)), dead, _mm512_setzero_ps());
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
        const __m512 x = _mm512_loadu_ps(sc + t * Gp);
        __m512 e = exp2_coarse(_mm512_fmsub_ps(x, qs, shift));
        if (dead) e = _mm512_mask_mov_ps(e, dead, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x));
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

// The dot-product engine (vdpbf16ps: per lane, two bfloat16 products added to a float32 accumulator; 32
// multiply-adds an instruction where a float32 FMA does 16), on 16-query vectors:
// - scores: QV vectors of queries (pairs c of qt) times R key rows, each key pair broadcast to the lanes, into
//   S^T rows (no horizontal sums); the R rows S elements apart (S = 0: ks, known at run time), so that they are
//   addressed from one register.
// - values: GT queries times NV slices of 16 columns, each query's weight pair (tokens 2r, 2r+1) broadcast against
//   the interleaved value pairs.
template <int QV, int R, int S>
__attribute__((always_inline)) inline void dots_scores(const uint32_t* qt, int64_t Gp, const bf16* k0, int64_t ks,
                                                       int64_t dk, float* st, Cursor& cursor) {
  const int64_t stride = S > 0 ? S : ks;
  __m512 a[R][QV];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < QV; ++v) a[r][v] = _mm512_setzero_ps();
  for (int64_t c = 0; c < dk / 2; ++c) {
    cursor.step();
    __m512i x[QV];
    for (int v = 0; v < QV; ++v) {
      x[v] = _mm512_loadu_si512(qt + c * Gp + 16 * v);
      pin(x[v]);
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, k0 + r * stride + 2 * c, 4);
      __m512i kb = _mm512_set1_epi32(static_cast<int>(pair));
      if (QV > 1) pin(kb);
      for (int v = 0; v < QV; ++v)
        a[r][v] = _mm512_dpbf16_ps(a[r][v], reinterpret_cast<__m512bh>(x[v]), reinterpret_cast<__m512bh>(kb));
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < QV; ++v) _mm512_storeu_ps(st + r * Gp + 16 * v, a[r][v]);
}

// Scores of 8 queries x R keys: each lane pair (2j, 2j+1) holds query j's pairs c and c+1 (amx_queries), against
// a key's pairs c, c+1 broadcast as one 64-bit word, so that every lane's products count (with the queries padded
// to 16 lanes, half of them would be for padding) and one broadcast serves two pairs; the lane pairs are added at
// the end. Against 16-lane queries half padding (benchmarks/kernel_ab.py, 32 heads of 128 over 4 KV heads, AMD EPYC
// Zen 4, 4096 and 16384 tokens): in cache 1.08-1.14x, from memory 1.04-1.08x.
template <int R, int S>
__attribute__((always_inline)) inline void dots_eight(const uint32_t* qt, const bf16* k0, int64_t ks, int64_t dk,
                                                      int64_t Gp, float* st, Cursor& cursor) {
  const int64_t stride = S > 0 ? S : ks;
  __m512 a[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < dk / 4; ++c) {
    cursor.step();
    __m512i x = _mm512_loadu_si512(qt + 16 * c);
    pin(x);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      int64_t two;
      std::memcpy(&two, k0 + r * stride + 4 * c, 8);
      a[r] = _mm512_dpbf16_ps(a[r], reinterpret_cast<__m512bh>(x),
                              reinterpret_cast<__m512bh>(_mm512_set1_epi64(two)));
    }
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int r = 0; r + 1 < R; r += 2) {  // lanes 0-7: key r's 8 scores, 8-15: key r+1's
    const __m512 sum = _mm512_add_ps(_mm512_permutex2var_ps(a[r], even, a[r + 1]),
                                     _mm512_permutex2var_ps(a[r], odd, a[r + 1]));
    _mm256_storeu_ps(st + r * Gp, _mm512_castps512_ps256(sum));
    _mm256_storeu_ps(st + (r + 1) * Gp, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sum), 1)));
  }
  if (R % 2) {
    const __m512 sum = _mm512_add_ps(_mm512_permutex2var_ps(a[R - 1], even, a[R - 1]),
                                     _mm512_permutex2var_ps(a[R - 1], odd, a[R - 1]));
    _mm256_storeu_ps(st + (R - 1) * Gp, _mm512_castps512_ps256(sum));
  }
}

template <int QV, int R>
inline void dots_scores_at(const uint32_t* qt, int64_t Gp, const bf16* k0, int64_t ks, int64_t dk, float* st,
                           Cursor& cursor) {
  if (ks == 128) dots_scores<QV, R, 128>(qt, Gp, k0, ks, dk, st, cursor);
  else if (ks == 64) dots_scores<QV, R, 64>(qt, Gp, k0, ks, dk, st, cursor);
  else dots_scores<QV, R, 0>(qt, Gp, k0, ks, dk, st, cursor);
}

constexpr int64_t kDotsKeys = 12;  // key rows per score step: 24 accumulators with 32 queries, of 32 registers

// S^T (n, Gp) of one block's key rows, read where they lie: steps of 12 rows at one stride (a contiguous cache, or
// within a page), then of 4, then single rows.
inline void dots_block_scores(const Dims& d, const Rows<bf16>& keys, const Item& it, int64_t t0, int64_t n,
                              AmxScratch& w) {
  const int64_t Gp = w.Gp;
  for (int64_t t = 0; t < n;) {
    // a Cursor per row step: the next block's keys end within the block's score steps, and a Cursor moves on to
    // the next run (its values) only where it starts
    Cursor cursor(w.ahead);
    const int64_t run = std::min(n - t, keys.run(t0 + t));
    const int64_t R = run >= kDotsKeys ? kDotsKeys : run >= 4 ? 4 : 1;
    const bf16* k0 = keys.at(it.b, it.h, t0 + t);
    const int64_t ks = keys.token_stride;
    for (int64_t qg = 0; qg < Gp; qg += 32) {
      const uint32_t* qt = w.qt.data() + qg;
      float* st = w.st.data() + t * Gp + qg;
      if (eights(d.G)) {
        if (R == kDotsKeys && ks == 128) dots_eight<kDotsKeys, 128>(qt, k0, ks, d.dk, Gp, st, cursor);
        else if (R == kDotsKeys) dots_eight<kDotsKeys, 0>(qt, k0, ks, d.dk, Gp, st, cursor);
        else if (R == 4) dots_eight<4, 0>(qt, k0, ks, d.dk, Gp, st, cursor);
        else dots_eight<1, 0>(qt, k0, ks, d.dk, Gp, st, cursor);
      } else if (Gp - qg >= 32) {
        if (R == kDotsKeys) dots_scores_at<2, kDotsKeys>(qt, Gp, k0, ks, d.dk, st, cursor);
        else if (R == 4) dots_scores_at<2, 4>(qt, Gp, k0, ks, d.dk, st, cursor);
        else dots_scores_at<2, 1>(qt, Gp, k0, ks, d.dk, st, cursor);
      } else {
        if (R == kDotsKeys) dots_scores_at<1, kDotsKeys>(qt, Gp, k0, ks, d.dk, st, cursor);
        else if (R == 4) dots_scores_at<1, 4>(qt, Gp, k0, ks, d.dk, st, cursor);
        else dots_scores_at<1, 1>(qt, Gp, k0, ks, d.dk, st, cursor);
      }
    }
    t += R;
  }
}

// acc[g][16 (s0 + v) ..] += sum_r P[g][2r, 2r+1] . V[2r, 2r+1][..] for GT queries and NV slices of 16 columns.
template <int GT, int NV>
inline void dots_values(float* acc, int64_t dv, const uint16_t* p, int64_t tb, const uint16_t* vi, int64_t slice,
                        int64_t pairs, int64_t s0, Ahead& ahead) {
  Cursor cursor(ahead);
  __m512 a[GT][NV];
#pragma GCC unroll 4
  for (int g = 0; g < GT; ++g)
    for (int v = 0; v < NV; ++v) a[g][v] = _mm512_loadu_ps(acc + g * dv + 16 * (s0 + v));
  const uint16_t* vs = vi + s0 * slice;
  for (int64_t r = 0; r < pairs; ++r) {
    cursor.step();
    __m512i pb[GT];
#pragma GCC unroll 4
    for (int g = 0; g < GT; ++g) {
      uint32_t pair;
      std::memcpy(&pair, p + g * tb + 2 * r, 4);
      pb[g] = _mm512_set1_epi32(static_cast<int>(pair));
      pin(pb[g]);
    }
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      __m512i x = _mm512_loadu_si512(vs + v * slice + r * 32);
      pin(x);
#pragma GCC unroll 4
      for (int g = 0; g < GT; ++g)
        a[g][v] = _mm512_dpbf16_ps(a[g][v], reinterpret_cast<__m512bh>(x), reinterpret_cast<__m512bh>(pb[g]));
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GT; ++g)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + g * dv + 16 * (s0 + v), a[g][v]);
}

template <int GT>
inline void dots_values_slices(float* acc, int64_t dv, const uint16_t* p, int64_t tb, const uint16_t* vi,
                               int64_t slice, int64_t pairs, Ahead& ahead) {
  const int64_t slices = dv / 16;
  int64_t s0 = 0;
  for (; s0 + 4 <= slices; s0 += 4) dots_values<GT, 4>(acc, dv, p, tb, vi, slice, pairs, s0, ahead);
  for (; s0 < slices; ++s0) dots_values<GT, 1>(acc, dv, p, tb, vi, slice, pairs, s0, ahead);
}

#if defined(ATTNLAB_AMX)
// The tile engine's scores S^T (tb, Gp) of one block, 32 tokens x 32 queries at a time: four accumulators (tiles
// 0-3) in flight, key rows in tiles 4-5, queries in 6-7.
inline void tile_block_scores(const Dims& d, const Rows<bf16>& keys, const Item& it, int64_t t0, int64_t n,
                              AmxScratch& w) {
  const int64_t Gp = w.Gp, dk = d.dk;
  float* st = w.st.data();
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
}

// The tile engine's O += P V for one block of `steps` value steps of 32 tokens.
inline void tile_block_values(const Dims& d, int64_t steps, AmxScratch& w) {
  const int64_t tb = kAmxTokens, dv = d.dv, slice = tb / 2 * 32;
  for (int64_t qg = 0; qg < d.G; qg += 16)  // four slices of 16 columns (tiles 0-3) at a time
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
#endif

// One block of n tokens (t0 ..) of a chunk on the pair path: scores, softmax, values into w.acc; on the tiles where
// the CPU has them, else on the dot products. Asks for the next block's rows while it computes.
void amx_block(const Dims& d, const Rows<bf16>& keys, const Rows<bf16>& values, const Item& it, int64_t t0,
               int64_t n, float qscale, AmxScratch& w) {
  const int64_t Gp = w.Gp, tb = kAmxTokens, dk = d.dk, dv = d.dv;
  const bool tiles = amx_granted();
  if (tiles)
    w.ahead.spread((d.G + 15) / 16 * round_up(n, 16) + round_up(n, 32) / 2 +
                   round_up(n, 32) / 32 * (Gp / 32 + 1) * dk / 32);
  else  // the score steps (one per key pair and row step), the softmax's rows, the value interleave's pairs and the
    // value steps (one per token pair, four queries and 64 columns): spread over all of them, for asked for only
    // during the scores (which run a step in ~12 cycles) the lines came faster than memory brings them, and the
    // prefetches stalled (a third of the score tiles' time, 32 heads over 2 KV heads)
    w.ahead.spread((n + kDotsKeys - 1) / kDotsKeys * ((Gp + 31) / 32) * dk / (eights(d.G) ? 4 : 2) +
                   (d.G + 15) / 16 * n + round_up(n, 32) / 2 + (d.G + 3) / 4 * ((dv / 16 + 3) / 4) * ((n + 1) / 2));
  if (tiles) {
#if defined(ATTNLAB_AMX)
    tile_block_scores(d, keys, it, t0, n, w);
#endif
  } else {
    dots_block_scores(d, keys, it, t0, n, w);
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
  if (tiles) {
#if defined(ATTNLAB_AMX)
    tile_block_values(d, steps, w);
#endif
    return;
  }
  // O += P V, four queries at a time (the weights past n are zeros, and so are the value rows)
  const int64_t pairs = (n + 1) / 2;
  int64_t g = 0;
  for (; g + 4 <= d.G; g += 4)
    dots_values_slices<4>(w.acc.data() + g * dv, dv, w.p.data() + g * tb, tb, w.vi.data(), slice, pairs, w.ahead);
  for (; g < d.G; ++g)
    dots_values_slices<1>(w.acc.data() + g * dv, dv, w.p.data() + g * tb, tb, w.vi.data(), slice, pairs, w.ahead);
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
  std::atomic<int64_t> taken{0};
#pragma omp parallel num_threads(n_threads)
  {
    static thread_local AmxScratch w;
    w.reset(d);
#if defined(ATTNLAB_AMX)
    const TileConfig cfg;
    if (amx_granted()) _tile_loadconfig(&cfg);
#endif
    int64_t q_of = -1;  // the (b, h) whose queries are in w.qt
    for_each_chunk(taken, n_items, [&](int64_t i, int64_t next) {  // as decode's chunks
      const Item& it = items[i];
      if (q_of != it.b * n_kv + it.h) {
        q_of = it.b * n_kv + it.h;
        amx_queries(q + (it.b * H + it.h * d.G) * d.dk, d.G, d.dk, w);
      }
      amx_chunk(d, keys, values, it, next >= 0 ? &items[next] : nullptr, qscale, w, parts + i * d.G * stride);
    });
#if defined(ATTNLAB_AMX)
    if (amx_granted()) _tile_release();  // hand the tile state back: a context switch then saves 8 KiB less
#endif
  }
}
#endif

}  // namespace attnlab_fused
