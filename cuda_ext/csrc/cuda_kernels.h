// Launchers of the CUDA kernels (cuda_kernels.cu), called by the torch bindings (cuda_ops.cpp).
// Raw pointers only, so the .cu file needs no torch headers and `python -m cuda_ext.compile_check`
// can compile it for every architecture quickly.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "format.h"

namespace exl {
namespace cuda {

struct LayerDev {
  const uint8_t* qweight;  // [N, row_bytes]
  int64_t row_bytes;
  const __half* qscale;    // [N, n_groups]
  int64_t n_groups;
  int64_t N, K;
  SegmentTable segs;
};

constexpr int kMaxGemvRows = 8;

// z[m, n] = sum_k Q[n, k] x[m, k] (fp32 out) for M <= kMaxGemvRows; x fp32 [M, K] (16-byte aligned).
void launch_gemv(const LayerDev& L, const float* x, int M, float* z, cudaStream_t stream);
// out[r, k] = Q[n0 + r, k] in fp16 for rows n0 <= n < n1.
void launch_dequant(const LayerDev& L, int64_t n0, int64_t n1, __half* out, cudaStream_t stream);
// Rows of n values: optional signs before, normalized blockwise FWHT (block 1 = none), optional
// signs after, optional fp32 bias; in/out dtypes half or float (in_half / out_half). With `scatter`
// (int32 [n], a permutation) value i of a row is stored at scatter[i]: pass the inverse of the
// act-order perm to get u' = u[perm] in the same launch.
void launch_hadamard(const void* in, bool in_half, void* out, bool out_half, int64_t rows, int64_t n, int64_t block,
                     const uint8_t* signs, bool signs_first, const float* bias, const int32_t* scatter,
                     cudaStream_t stream);
// Quantized KV cache (docs/format.md §6): rows of d channels, d a power of two in 32..1024, bits
// 4, 6 or 8, signs (packed bits, optional) of the rotation.
void launch_kv_quantize(const __half* x, int64_t rows, int d, int bits, const uint8_t* signs, uint8_t* packed,
                        __half* scales, cudaStream_t stream);
void launch_kv_dequantize(const uint8_t* packed, const __half* scales, int64_t rows, int d, int bits, bool rotate,
                          const uint8_t* signs, __half* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace exl
