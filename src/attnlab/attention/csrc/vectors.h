// Vectors of float lanes, the bits every tile is made of: bfloat16 storage and its widening and rounding, loads,
// stores, horizontal sums and maxima always added in one order, and 2^x for the online softmax. 8 lanes (v8f) for
// the matrix-vector products, W lanes (vf: 16 where the compiler targets AVX-512, else 8) for the attention tiles.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

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

}  // namespace attnlab_fused
