// Launchers of the CUDA trellis kernels (cuda_trellis.cu, docs/format.md §7), called by the torch
// bindings (cuda_trellis_ops.cpp). Raw pointers only, like cuda_kernels.h.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "trellis_format.h"

namespace exl {
namespace cuda {

struct TrellisDev {
  const uint32_t* words;  // [N/16, K/16, 8*bits]
  const __half* tscale;   // [N]
  int64_t N, K;
  TrellisCode code;       // codes 2, 3: code.tables = the layer's tcode (int8 [256] / [128], device memory)
};

constexpr int kMaxTrellisGemvRows = 8;    // code 1: 8 rows x 8 outputs of accumulators per lane
constexpr int kMaxTwoTableGemvRows = 16;  // codes 2, 3: 16 rows x 2 outputs per lane

// The most activation rows one GEMV launch takes for this layer's code.
inline int max_trellis_gemv_rows(const TrellisCode& c) {
  return is_two_table(c.code) ? kMaxTwoTableGemvRows : kMaxTrellisGemvRows;
}

// The GEMV's K split: one warp per 16 outputs and K-slice of `tiles` tiles (the last may be shorter),
// `count` slices. Enough warps to fill a large GPU (kTrellisTargetWarps), slices of at least
// kTrellisMinSliceTiles tiles. It depends on the shape alone, so each row's summation order (and
// result) is the same at every M.
constexpr int64_t kTrellisTargetWarps = 2048;  // e.g. 16 warps on each of 128 SMs
constexpr int64_t kTrellisMinSliceTiles = 4;
struct TrellisSplit {
  int64_t count, tiles;
};
inline TrellisSplit trellis_gemv_split(int64_t N, int64_t K) {
  const int64_t rows = N / kTile, kt = K / kTile;
  if (rows <= 0 || kt <= 0) return {1, kt};
  int64_t s = (kTrellisTargetWarps + rows - 1) / rows;
  s = s < kt / kTrellisMinSliceTiles ? s : kt / kTrellisMinSliceTiles;
  s = s > 1 ? s : 1;
  const int64_t per = (kt + s - 1) / s;
  return {(kt + per - 1) / per, per};  // no empty slice
}

// z[m, n] = tscale[n] * sum_k value(n, k) x[m, k] (fp32) for M <= max_trellis_gemv_rows(T.code);
// x fp32 [M, K], 16-byte aligned. With a K split (trellis_gemv_split(N, K).count = S > 1) each slice's
// sums go to partial (fp32 [S, M, N], caller-owned) and a second launch adds them in slice order.
void launch_trellis_gemv(const TrellisDev& T, const float* x, int M, float* z, float* partial, cudaStream_t stream);
// out[n - n0, k] = tscale[n] * value(n, k) in fp16 (row-major [n1 - n0, K]) for n0 <= n < n1, multiples of 16.
void launch_trellis_dequant(const TrellisDev& T, int64_t n0, int64_t n1, __half* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace exl
