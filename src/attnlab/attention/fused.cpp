// The fused CPU decode kernel of attnlab (attention/fused.py builds and calls it): plain C++17 with OpenMP, no
// PyTorch headers, so that the first-use build takes seconds; fused.py calls the one C entry point with ctypes.
//
// Attention (flash-decoding, Dao et al. 2023, one pass per block of cached tokens): the G queries of one KV
// head's group are scored against a block of cached keys, the block's scores update a running maximum and
// exp-sum (online softmax, Milakov & Gimelshein 2018), and the block's values are accumulated with the new
// weights, so every cached key and value is read from memory once. The context of a (batch row, KV head) pair
// is cut into chunks whose size depends on that row's length alone; chunks run in parallel and are merged by
// log-sum-exp. Nothing depends on the batch size or on where a token is stored, so a row's result is
// bit-identical whether it is decoded alone or in a batch, from a contiguous cache or a paged one.
//
// Layout: q (B, H, Dk) contiguous, H = n_kv * G, query head h*G + g reads KV head h. The key of batch row b, KV
// head h, token t is the row `Rows::at(b, h, t)` of Dk values (strided, or through a table of slots into a
// pool); values likewise with Dv <= Dk values (MLA's absorbed values are the first Dv of the key row: the same
// memory). Arithmetic is float32; bfloat16 is widened on load and the output rounded once (to nearest even).

#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
// bfloat16 blocks on the AMX tile unit (Intel Sapphire Rapids and later), where the compiler targets it (-march=native
// on such a CPU) and the kernel grants the tile state at run time; elsewhere the float32 tiles below take them.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__linux__)
#define ATTNLAB_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace attnlab_fused {

// GCC/Clang vector extensions: 8 float lanes (an AVX register; SSE pairs or scalar code on other targets).
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

struct bf16 {  // bfloat16 storage: the top 16 bits of a float32
  uint16_t bits;
};

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;
// Work below this many bytes read runs on one thread: a second thread saves little there, and on a loaded
// machine the region would wait for whichever thread the scheduler left out.
constexpr int64_t kParallelBytes = 1 << 20;

template <typename V = v8f>
inline V splat(float x) {
  return x - V{};  // every lane x
}
inline v8f load(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v8f load(const bf16* p) {  // widen: a 16-bit shift puts the bits on top of a float32
#if defined(__AVX2__)
  // one zero-extending load and one shift (GCC splits __builtin_convertvector into five instructions)
  const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return reinterpret_cast<v8f>(_mm256_castsi256_ps(u));
#else
  v8h h;
  std::memcpy(&h, p, sizeof h);
  const v8u u = __builtin_convertvector(h, v8u) << 16;
  v8f f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}
inline void store(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }
inline float widen(float x) { return x; }
inline float widen(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
template <typename T>
inline T narrow(float x);
template <>
inline float narrow<float>(float x) {
  return x;
}
template <>
inline bf16 narrow<bf16>(float x) {  // round to nearest even, NaN kept quiet (as c10::BFloat16)
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// r[i] = a[i][0] + ... + a[i][7] for eight vectors, always added in the same order.
inline v8f hadd(v8f a, v8f b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}
inline v8f sums8(const v8f* a) {
  const v8f u0 = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));  // per 128-bit half: partial sums of a0..a3
  const v8f u1 = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
  return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// ---- The attention tiles' vectors: W float lanes, 16 (an AVX-512 register) where the compiler targets AVX-512,
// else 8 (an AVX register; SSE pairs or scalar code elsewhere). Twice the lanes, twice the FMAs per instruction, and
// 32 registers instead of 16 for larger tiles.
#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(4 * W)));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf vload(const bf16* p) {  // widen, as load(const bf16*)
#if defined(__AVX512F__)
  const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<vf>(_mm512_castsi512_ps(u));
#else
  return load(p);
#endif
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// Keep `v` in a register. In the score tiles GCC otherwise folds the loads into the FMAs and reads every query
// and key twice (2 queries: 12 loads per 8 FMAs instead of 6, load-port bound, 1.28x slower with 32 queries of
// 128 dims). An empty asm statement with the operand in a vector register; nothing on other targets.
template <typename V>
inline void pin(V& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__AVX__)
  asm("" : "+x"(v));
#else
  (void)v;
#endif
}

// r[i] = the sum of a[i]'s lanes for n <= W vectors (lanes of r past n: zero), always added in the same order.
__attribute__((always_inline)) inline vf vsums(const vf* a, int n) {
#if defined(__AVX512F__)
  auto hadd16 = [](vf x, vf y) {  // lanes 0-7: pairs of x's lanes, 8-15: of y's
    return __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  };
  vf u[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) u[i] = i < n ? a[i] : splat<vf>(0.f);
#pragma GCC unroll 4
  for (int len = 16; len > 1; len /= 2)
#pragma GCC unroll 8
    for (int i = 0; i < len / 2; ++i) u[i] = hadd16(u[2 * i], u[2 * i + 1]);
  return u[0];
#else
  v8f u[8];
  for (int i = 0; i < 8; ++i) u[i] = i < n ? a[i] : splat(0.f);
  return sums8(u);
#endif
}
inline float vhsum(vf a) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(a));
#else
  return vsums(&a, 1)[0];
#endif
}
inline float vhmax(vf a) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(a));
#else
  v8f b = __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3);
  a = a > b ? a : b;
  b = __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5);
  a = a > b ? a : b;
  b = __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6);
  a = a > b ? a : b;
  return a[0];
#endif
}

// 2^x for x <= 0 (scores minus their maximum, in log2 units): x = n + f with n an integer and |f| <= 1/2;
// 2^f by its Taylor polynomial of degree 7 (relative error < 2e-8), 2^n written into the exponent bits.
template <typename V>
inline V exp2_neg(V x) {
  x = x < splat<V>(-126.f) ? splat<V>(-126.f) : x;  // below the smallest normal float: as good as 0 here
  const V magic = splat<V>(12582912.f);         // 1.5 * 2^23: adding it rounds to an integer
  const V n = (x + magic) - magic;
  const V f = x - n;
  V p = splat<V>(1.5252734e-5f);
  p = p * f + splat<V>(1.5403530e-4f);
  p = p * f + splat<V>(1.3333558e-3f);
  p = p * f + splat<V>(9.6181291e-3f);
  p = p * f + splat<V>(5.5504109e-2f);
  p = p * f + splat<V>(2.4022651e-1f);
  p = p * f + splat<V>(6.9314718e-1f);
  p = p * f + splat<V>(1.0f);
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64)  // p 2^n in one instruction (the same result: both products are exact)
    return reinterpret_cast<V>(_mm512_scalef_ps(reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(n)));
#endif
  typedef int32_t VI __attribute__((vector_size(sizeof(V))));
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

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
      if (--left == 0 && ++r < n_runs) {
        at = runs[r].p;
        left = runs[r].lines;
      }
    }
  }
  void clear() { n_runs = total = r = left = 0; }
};

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
  for (int64_t d = 0; d < width; d += W) {
    ahead.step();
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
  for (int64_t d = 0; d < dk; ++d) {
    ahead.step();
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

// acc[g][c:c+W NV] += sum_j p[g][j] * v[j][c:c+W NV] for GT query heads: one slice of W NV value columns, all
// in registers while the slice of the block's value rows streams past. Each row's GT weights are broadcast once
// and each of its NV vectors loaded once, for GT NV FMAs. R rows per step, each with its own accumulators (added
// at the end): an FMA waits ~4 cycles for the previous one into the same register, so a tile needs 8 or more
// accumulators in flight to keep both FMA units busy.
template <int GT, int NV, int R, typename E>
void accumulate(float* acc, int64_t acc_stride, const float* p, int64_t p_stride, int64_t p_step, const E* const* v,
                int64_t n, int64_t c, Ahead& ahead) {
  vf a[R][GT][NV];
#pragma GCC unroll 4
  for (int g = 0; g < GT; ++g) {
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      a[0][g][i] = vload(acc + g * acc_stride + c + W * i);
#pragma GCC unroll 8
      for (int r = 1; r < R; ++r) a[r][g][i] = splat<vf>(0.f);
    }
  }
  int64_t j = 0;
  for (; j + R <= n; j += R) {
    ahead.step();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const E* row = v[j + r] + c;
      // Opaque to the compiler: one base register with the vectors at constant offsets from it. Else GCC keeps
      // c + W i for every vector in a register of its own and spills (groups of 32, 128 dims: ~4 % of a step).
      asm("" : "+r"(row));
      vf pj[GT];
#pragma GCC unroll 4
      for (int g = 0; g < GT; ++g) {
        pj[g] = splat<vf>(p[g * p_stride + (j + r) * p_step]);
        pin(pj[g]);
      }
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) {
        vf x = vload(row + W * i);
        pin(x);
#pragma GCC unroll 4
        for (int g = 0; g < GT; ++g) a[r][g][i] += pj[g] * x;
      }
    }
  }
  for (; j < n; ++j) {
#pragma GCC unroll 4
    for (int g = 0; g < GT; ++g) {
      const vf pj = splat<vf>(p[g * p_stride + j * p_step]);
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) a[0][g][i] += pj * vload(v[j] + c + W * i);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GT; ++g) {
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
#pragma GCC unroll 8
      for (int r = 1; r < R; ++r) a[0][g][i] += a[r][g][i];
      vstore(acc + g * acc_stride + c + W * i, a[0][g][i]);
    }
  }
}

// Columns [c, width) of GT query heads in slices of NV vectors while they fit, then of NV / 2, ...; rows in flight
// to make 8 or more accumulators.
template <int GT, int NV, typename E>
void accumulate_slices(float* acc, int64_t acc_stride, const float* p, int64_t p_stride, int64_t p_step,
                       const E* const* v, int64_t n, int64_t c, int64_t width, Ahead& ahead) {
  constexpr int R = GT * NV >= 8 ? 1 : (8 + GT * NV - 1) / (GT * NV);
  for (; c + NV * W <= width; c += NV * W)
    accumulate<GT, NV, R>(acc, acc_stride, p, p_stride, p_step, v, n, c, ahead);
  if constexpr (NV > 1) accumulate_slices<GT, NV / 2>(acc, acc_stride, p, p_stride, p_step, v, n, c, width, ahead);
}

// Vectors per value slice for GT query heads: GT NV accumulators, up to 24 of 32 registers for W = 16, 12 of 16
// for W = 8.
constexpr int heads_nv(int GT) {
  constexpr int regs = W == 16 ? 24 : 12, max_nv = W == 16 ? 8 : 4;
  return regs / GT >= max_nv ? max_nv : regs / GT >= 4 ? 4 : 2;
}

// The values of GT query heads over all `width` columns (a multiple of 16): slices as wide as the registers allow
// (heads_nv), so that each value row is read by as few slices as possible.
template <int GT, typename E>
void accumulate_heads(float* acc, int64_t acc_stride, const float* p, int64_t p_stride, int64_t p_step,
                      const E* const* v, int64_t n, int64_t width, Ahead& ahead) {
  accumulate_slices<GT, heads_nv(GT)>(acc, acc_stride, p, p_stride, p_step, v, n, 0, width, ahead);
}

// acc[:] += sum_j p[j] * v[j][:] for one query, NV vectors (the whole padded value row) at a time: the block's
// value rows are read in order, row after row, which is what the hardware prefetcher follows when they come from
// memory (column slices read every row's first lines, then every row's next ones: a strided pattern, 2-3x slower
// than this from memory, faster than it once the block is in cache). Small rows take two rows per step, each with
// its own accumulators (FMA latency); rows of up to 16 vectors fill the registers with one.
template <int NV, typename E>
void accumulate_rows(float* acc, const float* p, int64_t p_step, const E* const* v, int64_t n, Ahead& ahead) {
  constexpr int R = NV <= 8 ? 2 : 1;
  vf a[R][NV];
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) {
    a[0][i] = vload(acc + W * i);
    if (R == 2) a[R - 1][i] = splat<vf>(0.f);
  }
  int64_t j = 0;
  for (; j + R <= n; j += R) {
    ahead.step();
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      const vf pj = splat<vf>(p[(j + r) * p_step]);
      const E* row = v[j + r];
#pragma GCC unroll 16
      for (int i = 0; i < NV; ++i) a[r][i] += pj * vload(row + W * i);
    }
  }
  for (; j < n; ++j) {
    const vf pj = splat<vf>(p[j * p_step]);
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) a[0][i] += pj * vload(v[j] + W * i);
  }
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) vstore(acc + W * i, R == 2 ? a[0][i] + a[R - 1][i] : a[0][i]);
}

// The row-order accumulation for one query, if the padded rows have 1 to 16 vectors (else false).
template <typename E>
inline bool accumulate_rows(int64_t width, float* acc, const float* p, int64_t p_step, const E* const* v, int64_t n,
                            Ahead& ahead) {
  switch (width / W) {
    case 1: accumulate_rows<1, E>(acc, p, p_step, v, n, ahead); return true;
    case 2: accumulate_rows<2, E>(acc, p, p_step, v, n, ahead); return true;
    case 3: accumulate_rows<3, E>(acc, p, p_step, v, n, ahead); return true;
    case 4: accumulate_rows<4, E>(acc, p, p_step, v, n, ahead); return true;
    case 5: accumulate_rows<5, E>(acc, p, p_step, v, n, ahead); return true;
    case 6: accumulate_rows<6, E>(acc, p, p_step, v, n, ahead); return true;
    case 7: accumulate_rows<7, E>(acc, p, p_step, v, n, ahead); return true;
    case 8: accumulate_rows<8, E>(acc, p, p_step, v, n, ahead); return true;
    case 10: accumulate_rows<10, E>(acc, p, p_step, v, n, ahead); return true;
    case 12: accumulate_rows<12, E>(acc, p, p_step, v, n, ahead); return true;
    case 14: accumulate_rows<14, E>(acc, p, p_step, v, n, ahead); return true;
    case 16: accumulate_rows<16, E>(acc, p, p_step, v, n, ahead); return true;
    default: return false;
  }
}

struct Dims {
  int64_t G, dk, dv, dk_pad, dv_pad, tb;
};

// Whether float32 rows are scored with the queries in the lanes (scores_lanes): groups of a multiple of 16.
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
// groups of 4 take 4 x 2 tiles, so that each key row is read (for bfloat16: widened) once. Also asks for the next
// block's keys, four rows per 4-key step: the tiles read four rows side by side, a pattern the hardware prefetcher
// follows poorly (benchmarks/kernel_ab.py, 32 heads of 128, KV from memory, float32: groups of 4 and 8
// 1.03-1.32x, of 16 and 32 1.03-1.25x; bfloat16, then staged block by block: within the tool's spread). bfloat16
// rows read in place also ask for this block's values vr, four rows per step, so that they arrive while the scores
// are computed (groups of 4 1.09-1.10x over two runs, others 1.02-1.07x); float32 values, twice the lines, lose
// 2-6 % that way (and 2-10 % when the next block's values are asked for during this block's value tiles instead).
template <typename T, typename E>
void scores_in_rows(const Dims& d, const Rows<T>& keys, const Item& it, int64_t t0, int64_t n, const E* const* kr,
                    const E* const* vr, Scratch<T>& w) {
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
void scores_in_lanes(const Dims& d, const Rows<T>& keys, const Item& it, int64_t t0, const float* const* kr,
                     Scratch<T>& w) {
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
    vf lsum = splat<vf>(0.f);
    for (int64_t j = 0; j < n; ++j) {
      const vf e = exp2_neg(vload(st + j * G + c) - m_new);
      vstore(st + j * G + c, e);
      lsum += e;
    }
    vstore(alpha, exp2_neg(m_old - m_new));  // m_old = -inf (nothing yet): ~2^-126, times what is zero
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

// The scores of one block of n rows (kr, vr: the rows, cache element type or staged float32), its online-softmax
// update of `part` and its values accumulated into it. `from_memory`: the rows were not staged (so still in
// memory, or on their way): the first query then takes the values row by row (the order the hardware prefetcher
// follows), which leaves the block in cache for the others' column slices; staged rows are in cache already.
template <typename T, typename E>
void attend_block(const Dims& d, const Rows<T>& keys, const Item& it, int64_t t0, int64_t n, const E* const* kr,
                  const E* const* vr, bool from_memory, Scratch<T>& w, float* part) {
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
    if constexpr (std::is_same<E, float>::value) scores_in_lanes(d, keys, it, t0, kr, w);
    softmax_lanes(d, n, w.st.data(), part);
  } else {
    scores_in_rows(d, keys, it, t0, n, kr, vr, w);
    for (int64_t g = 0; g < G; ++g) {  // online softmax: new maximum, rescale what was accumulated, weights
      float* sg = s + g * tb;
      float* st = part + g * stride;
      for (int64_t j = n; j < tb; ++j) sg[j] = kNegInf;
      vf mx = vload(sg);
      for (int64_t j = W; j < tb; j += W) mx = mx > vload(sg + j) ? mx : vload(sg + j);
      const float m_old = st[d.dv_pad], m_new = std::max(m_old, vhmax(mx));
      for (int64_t j = 0; j < tb; j += W) vstore(sg + j, exp2_neg(vload(sg + j) - splat<vf>(m_new)));
      for (int64_t j = n; j < tb; ++j) sg[j] = 0.f;  // exp2_neg flushes to 2^-126, not to 0
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
      attend_block(d, keys, it, t0, n, w.kc.data(), w.vc.data(), true, w, part);
      continue;
    }
    stage(keys, it.b, it.h, t0, n, d.dk, w.k.data(), d.dk_pad);
    stage(values, it.b, it.h, t0, n, d.dv, w.v.data(), d.dv_pad);
    if (n < tb) {  // rows past the chunk's end: zeros (their weights are set to 0)
      std::fill(w.k.begin() + n * d.dk_pad, w.k.end(), 0.f);
      std::fill(w.v.begin() + n * d.dv_pad, w.v.end(), 0.f);
    }
    attend_block(d, keys, it, t0, n, w.kr.data(), w.vr.data(), false, w, part);
  }
}

// ---- bfloat16 blocks on AMX tiles.
//
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
        if (pc[d.dv_pad] == kNegInf) continue;  // a chunk with nothing attended (exp2_neg gives 2^-126, not 0)
        const float w = wgt[c * G + g];
        l += w * pc[d.dv_pad + 1];
        for (int64_t k = 0; k < d.dv_pad; k += W) vstore(&o[k], vload(&o[k]) + splat<vf>(w) * vload(pc + k));
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;  // a row with nothing to attend to gets zeros
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
#if defined(ATTNLAB_AMX)
  if constexpr (std::is_same<T, bf16>::value) {
    if (amx_takes(d)) {
      amx_decode(d, q, H, n_kv, keys, values, items, qscale, n_threads, parts.data());
      merge(d, B, n_kv, H, first, parts, out);
      return;
    }
  }
#endif
#pragma omp parallel num_threads(n_threads)
  {
    static thread_local Scratch<T> w;
    w.reset(d);
    int64_t q_of = -1;  // the (b, h) whose queries are in w.q
    const int64_t nt = omp_get_num_threads();
    // Round-robin (not dynamic) so that a thread knows its next chunk and asks for its first block while finishing
    // this one: the first block of a chunk otherwise starts cold (fp32, 32 heads over 1 KV head, 4096 tokens: 1.6x
    // the time of the others).
#pragma omp for schedule(static, 1)
    for (int64_t i = 0; i < n_items; ++i) {
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
      attend_chunk(d, keys, values, it, i + nt < n_items ? &items[i + nt] : nullptr, w, parts.data() + i * G * stride);
    }
  }
  merge(d, B, n_kv, H, first, parts, out);
}


// ---- Matrix-vector products for decode steps: y = x W^T + bias for a few rows of x, over one or more weights.
//
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


// ---- One decoder block's decode step (attnlab.model.Block): pre-norm attention and SwiGLU MLP in one call.
//
// For a few rows of one new token each (batch rows), over a contiguous KV cache: RMSNorm, the q/k/v projections,
// RoPE (half-split pairs), the new key and value written into the cache, attention over the cache (decode
// above), the output projection and the residual, then RMSNorm, the gate and up projections, SiLU(gate) * up,
// the down projection and the residual. Each step rounds to the storage type where PyTorch's modules do (every
// module's output, RMSNorm's normalised input before its gain, SiLU before the product), so the block agrees
// with the module-by-module forward up to the order of the sums. The point is the per-op overhead: a step of a
// small model is ~25 PyTorch ops per block, each a dispatch and an allocation; here it is one call.

struct BlockDims {
  int64_t M, D, H, n_kv, hd, F, pos;  // rows, model width, query/KV heads, head dim, MLP width, cache position
  int64_t k_strides[3], v_strides[3];  // cache strides (row, head, token) in elements
  int64_t rope_stride;                 // between the rows' cos/sin (0: shared); cos == nullptr: no RoPE
  float eps, scale;
};

// The block's tensors, in the order of attnlab_block's pointer array.
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
void block(const BlockDims& d, const BlockTensors<T>& t, int threads) {
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
      T* kd = t.cache_k + m * d.k_strides[0] + head * d.k_strides[1] + d.pos * d.k_strides[2];
      T* vd = t.cache_v + m * d.v_strides[0] + head * d.v_strides[1] + d.pos * d.v_strides[2];
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
    const Rows<T> keys{t.cache_k, d.k_strides[0], d.k_strides[1], d.k_strides[2]};
    const Rows<T> values{t.cache_v, d.v_strides[0], d.v_strides[1], d.v_strides[2]};
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

// One decoder block's decode step (see `block` above). dims: M, D, H, n_kv, head_dim, F, pos, the cache's key
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
