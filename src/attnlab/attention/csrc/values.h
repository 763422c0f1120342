// Value tiles: a block's weights times its value rows, accumulated into the queries' outputs, in column slices
// held in registers (several queries at once) or row after row (one query, the order memory streams in).
#pragma once

#include "rows.h"
#include "vectors.h"

#include <cstdint>

namespace attnlab_fused {

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
  Stepper<E> cursor(ahead);
  int64_t j = 0;
  for (; j + R <= n; j += R) {
    cursor.step();
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
  Stepper<E> cursor(ahead);
  int64_t j = 0;
  for (; j + R <= n; j += R) {
    cursor.step();
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

}  // namespace attnlab_fused
