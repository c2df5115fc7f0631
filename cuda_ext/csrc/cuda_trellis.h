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
  TrellisCode code;       // code 2: code.tables = the layer's tcode (int8 [256], device memory)
};

constexpr int kMaxTrellisGemvRows = 8;    // code 1: 8 rows x 8 outputs of accumulators per lane
constexpr int kMaxTwoTableGemvRows = 16;  // code 2: 16 rows x 2 outputs per lane

// The most activation rows one GEMV launch takes for this layer's code.
inline int max_trellis_gemv_rows(const TrellisCode& c) {
  return c.code == kCodeTwoTable ? kMaxTwoTableGemvRows : kMaxTrellisGemvRows;
}

// z[m, n] = tscale[n] * sum_k value(n, k) x[m, k] (fp32) for M <= max_trellis_gemv_rows(T.code);
// x fp32 [M, K], 16-byte aligned.
void launch_trellis_gemv(const TrellisDev& T, const float* x, int M, float* z, cudaStream_t stream);
// out[n - n0, k] = tscale[n] * value(n, k) in fp16 (row-major [n1 - n0, K]) for n0 <= n < n1, multiples of 16.
void launch_trellis_dequant(const TrellisDev& T, int64_t n0, int64_t n1, __half* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace exl
