// CUDA kernels for Turing to Blackwell: fused dequant GEMV (1-8 rows), tile dequantization for the
// cuBLAS GEMM path, the blockwise Hadamard transform (with the act-order permutation fused into its
// store) and the KV-cache quantizer. The host harness runs this same file on CPU threads
// (docs/cuda_host.md).
// Block decoding is format.h's, shared with the CPU kernels.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_device.cuh"
#include "cuda_kernels.h"
#include "format.h"

namespace exl {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// GEMV: one warp per R output rows. Lane l takes blocks l, l+32, ... of each segment: it reads the
// block's 4*BITS bytes of each of its rows (the warp reads 32 consecutive blocks, one contiguous span
// of a row), decodes the codes and dots them with the fp32 activations of up to MR rows. The
// activations of each step's 32 blocks (a tile of 1024 channels) are staged once per thread block
// in shared memory, padded so that the lanes' float4 reads hit distinct banks, and each read feeds R
// rows (docs/benchmarks.md, "Can the decode GEMV keep the memory system busy").

template <int MR>
__host__ __device__ constexpr int gemv_rows_per_warp() { return MR < 4 ? MR : 4; }

constexpr int kTileStride = kBlock + 4;  // floats per block of activations in shared memory (padded)

template <int BITS, int MR, int R>
__device__ __forceinline__ void gemv_segment(const uint8_t* const (&row)[R], const __half* const (&srow)[R],
                                             const Segment& sg, const float* __restrict__ x, int64_t K, int M,
                                             float (&acc)[R][MR], int lane, bool active, float* tile) {
  const int nb = sg.k_len / kBlock;
  const float c = code_offset(BITS);
  for (int b0 = 0; b0 < nb; b0 += kWarp) {  // the same steps in every warp of the block
    const int b = b0 + lane;
    const bool mine = active && b < nb;
    const int nt = nb - b0 < kWarp ? nb - b0 : kWarp;  // blocks in this tile
    __syncthreads();                                  // every warp is done with the previous tile
    for (int e = threadIdx.x; e < M * nt * 8; e += blockDim.x) {  // float4 units, 8 per block
      const int m = e / (nt * 8), blk = e % (nt * 8) / 8, q4 = e % 8;
      const float4 v = __ldg(reinterpret_cast<const float4*>(x + m * K + sg.k_start + int64_t(b0 + blk) * kBlock) + q4);
      *reinterpret_cast<float4*>(tile + (m * kWarp + blk) * kTileStride + 4 * q4) = v;
    }
    __syncthreads();
    if (!mine) continue;
    uint32_t w[R][BITS];
    float s[R], cs[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      load_block_words<BITS>(row[r] + sg.byte_start + int64_t(b) * block_bytes(BITS), w[r]);
      s[r] = __half2float(srow[r][sg.group_start + b * kBlock / sg.group_size]);
      cs[r] = -c * s[r];  // (q - c) * s = q * s - c * s, exact in fp32 (a half-integer times an fp16)
    }
    const float* xs = tile + lane * kTileStride;
#pragma unroll
    for (int i = 0; i < kBlock; i += 4) {
      float q[R][4];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < 4; ++j) q[r][j] = fmaf(float(block_code<BITS>(w[r], i + j)), s[r], cs[r]);
#pragma unroll
      for (int m = 0; m < MR; ++m) {
        if (m < M) {
          const float4 xv = *reinterpret_cast<const float4*>(xs + m * kWarp * kTileStride + i);
#pragma unroll
          for (int r = 0; r < R; ++r)
            acc[r][m] = fmaf(q[r][0], xv.x, fmaf(q[r][1], xv.y, fmaf(q[r][2], xv.z, fmaf(q[r][3], xv.w, acc[r][m]))));
        }
      }
    }
  }
}

template <int MR>
__global__ void gemv_kernel(LayerDev L, const float* __restrict__ x, int M, float* __restrict__ z) {
  constexpr int R = gemv_rows_per_warp<MR>();
  __shared__ __align__(16) float tile[MR * kWarp * kTileStride];
  const int64_t n0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp * R;
  const int lane = threadIdx.x % kWarp;
  const bool active = n0 < L.N;  // warps past the last row still stage activations for the others
  const uint8_t* row[R];
  const __half* srow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t n = n0 + r < L.N ? n0 + r : (active ? n0 : 0);  // past the last row: recompute a row, store nothing
    row[r] = L.qweight + n * L.row_bytes;
    srow[r] = L.qscale + n * L.n_groups;
  }
  float acc[R][MR];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MR; ++m) acc[r][m] = 0.0f;
  for (int s = 0; s < L.segs.count; ++s) {
    const Segment sg = L.segs.seg[s];
    switch (sg.bits) {
      case 1: gemv_segment<1, MR, R>(row, srow, sg, x, L.K, M, acc, lane, active, tile); break;
      case 2: gemv_segment<2, MR, R>(row, srow, sg, x, L.K, M, acc, lane, active, tile); break;
      case 3: gemv_segment<3, MR, R>(row, srow, sg, x, L.K, M, acc, lane, active, tile); break;
      case 4: gemv_segment<4, MR, R>(row, srow, sg, x, L.K, M, acc, lane, active, tile); break;
      case 5: gemv_segment<5, MR, R>(row, srow, sg, x, L.K, M, acc, lane, active, tile); break;
      case 6: gemv_segment<6, MR, R>(row, srow, sg, x, L.K, M, acc, lane, active, tile); break;
      case 7: gemv_segment<7, MR, R>(row, srow, sg, x, L.K, M, acc, lane, active, tile); break;
      default: gemv_segment<8, MR, R>(row, srow, sg, x, L.K, M, acc, lane, active, tile); break;
    }
  }
  if (!active) return;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MR; ++m) {
      const float v = warp_sum(acc[r][m]);
      if (lane == 0 && m < M && n0 + r < L.N) z[m * L.N + n0 + r] = v;
    }
}

// ---------------------------------------------------------------------------------------------
// Dequantization to fp16, one warp per row, one block of 32 codes per lane and step.

template <int BITS>
__device__ __forceinline__ void dequant_segment(const uint8_t* row, const __half* srow, const Segment& sg,
                                                __half* out, int lane) {
  const int nb = sg.k_len / kBlock;
  const float c = code_offset(BITS);
  for (int b = lane; b < nb; b += kWarp) {
    uint32_t w[BITS];
    load_block_words<BITS>(row + sg.byte_start + int64_t(b) * block_bytes(BITS), w);
    const float s = __half2float(srow[sg.group_start + b * kBlock / sg.group_size]);
    uint4 v[4];
    __half2* h = reinterpret_cast<__half2*>(v);
#pragma unroll
    for (int i = 0; i < kBlock / 2; ++i)
      h[i] = __floats2half2_rn((float(block_code<BITS>(w, 2 * i)) - c) * s,
                               (float(block_code<BITS>(w, 2 * i + 1)) - c) * s);
    uint4* dst = reinterpret_cast<uint4*>(out + sg.k_start + int64_t(b) * kBlock);
#pragma unroll
    for (int j = 0; j < 4; ++j) dst[j] = v[j];
  }
}

__global__ void dequant_kernel(LayerDev L, int64_t n0, int64_t n1, __half* __restrict__ out) {
  const int64_t n = n0 + (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (n >= n1) return;
  const uint8_t* row = L.qweight + n * L.row_bytes;
  const __half* srow = L.qscale + n * L.n_groups;
  __half* o = out + (n - n0) * L.K;
  for (int s = 0; s < L.segs.count; ++s) {
    const Segment sg = L.segs.seg[s];
    switch (sg.bits) {
      case 1: dequant_segment<1>(row, srow, sg, o, lane); break;
      case 2: dequant_segment<2>(row, srow, sg, o, lane); break;
      case 3: dequant_segment<3>(row, srow, sg, o, lane); break;
      case 4: dequant_segment<4>(row, srow, sg, o, lane); break;
      case 5: dequant_segment<5>(row, srow, sg, o, lane); break;
      case 6: dequant_segment<6>(row, srow, sg, o, lane); break;
      case 7: dequant_segment<7>(row, srow, sg, o, lane); break;
      default: dequant_segment<8>(row, srow, sg, o, lane); break;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Blockwise Hadamard transform. One thread block per (row, chunk of kChunk values); chunks are
// whole Hadamard blocks (block <= 128 divides kChunk), butterflies in shared memory. With `scatter`
// (the inverse of the act-order permutation) value i is stored at scatter[i], so the transform and
// the permutation u' = u[perm] of the forward pass are one launch.

constexpr int kChunk = 2048;
constexpr int kHadThreads = 256;

template <typename TI, typename TO>
__global__ void hadamard_kernel(const TI* __restrict__ in, TO* __restrict__ out, int64_t n, int block, float norm,
                                const uint8_t* __restrict__ signs, bool signs_first, const float* __restrict__ bias,
                                const int32_t* __restrict__ scatter) {
  __shared__ float sh[kChunk];
  const int64_t r = blockIdx.x;
  const int64_t c0 = int64_t(blockIdx.y) * kChunk;
  const int len = n - c0 < kChunk ? int(n - c0) : kChunk;
  const TI* src = in + r * n + c0;
  for (int i = threadIdx.x; i < len; i += blockDim.x) {
    float v = load_f<TI>(src + i);
    if (signs && signs_first) v *= sign_at(signs, c0 + i);
    sh[i] = v;
  }
  __syncthreads();
  for (int h = 1; h < block; h <<= 1) {
    for (int p = threadIdx.x; p < len / 2; p += blockDim.x) {
      const int i = (p / h) * 2 * h + (p % h);
      const float a = sh[i], b = sh[i + h];
      sh[i] = a + b;
      sh[i + h] = a - b;
    }
    __syncthreads();
  }
  TO* dst = out + r * n;
  for (int i = threadIdx.x; i < len; i += blockDim.x) {
    float v = sh[i] * norm;
    if (signs && !signs_first) v *= sign_at(signs, c0 + i);
    if (bias) v += bias[c0 + i];
    store_f<TO>(dst + (scatter ? int64_t(scatter[c0 + i]) : c0 + i), v);
  }
}

// ---------------------------------------------------------------------------------------------
// KV cache: one warp per head vector of d channels, staged in shared memory.

__device__ __forceinline__ void warp_fwht(float* v, int d, int block, int lane) {
  for (int h = 1; h < block; h <<= 1) {
    for (int p = lane; p < d / 2; p += kWarp) {
      const int i = (p / h) * 2 * h + (p % h);
      const float a = v[i], b = v[i + h];
      v[i] = a + b;
      v[i + h] = a - b;
    }
    __syncwarp();
  }
}

// Layout (docs/format.md §6, reference exl/cache/kv_store.py): a head vector x of d channels is
// rotated, y = H_d (D_s x) / sqrt(d) (signs optional, one Sylvester Hadamard block of size d), then
// cut into groups of 32 values with one fp16 scale s = max|y| / c each, c = (2^b - 1) / 2; codes
// q = round(y / s + c) clamped to [0, 2^b - 1] are packed as an LSB-first bit stream (code i of a
// row at bit i*b), i.e. 4*b bytes per group.

template <int BITS>
__device__ __forceinline__ void kv_store_group(uint8_t* dst, const uint32_t* codes) {
  uint32_t w[BITS];
#pragma unroll
  for (int t = 0; t < BITS; ++t) w[t] = 0;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) {
    const int bit = i * BITS;
    w[bit / 32] |= codes[i] << (bit % 32);
    if ((bit % 32) + BITS > 32) w[bit / 32 + 1] |= codes[i] >> (32 - bit % 32);
  }
  uint32_t* d32 = reinterpret_cast<uint32_t*>(dst);
#pragma unroll
  for (int t = 0; t < BITS; ++t) d32[t] = w[t];
}

template <int BITS>
__device__ __forceinline__ uint32_t kv_code(const uint32_t* w, int i) {
  const int bit = i * BITS;
  uint64_t v = w[bit / 32];
  if ((bit % 32) + BITS > 32) v |= uint64_t(w[bit / 32 + 1]) << 32;
  return uint32_t(v >> (bit % 32)) & ((1u << BITS) - 1u);
}

template <int BITS>
__global__ void kv_quantize_kernel(const __half* __restrict__ x, int64_t rows, int d, float norm,
                                   const uint8_t* __restrict__ signs, uint8_t* __restrict__ packed,
                                   __half* __restrict__ scales) {
  float* smem = dynamic_shared<float>();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / kWarp) + warp;
  if (r >= rows) return;
  float* v = smem + warp * d;
  for (int i = lane; i < d; i += kWarp) v[i] = __half2float(x[r * d + i]) * (signs ? sign_at(signs, i) : 1.0f);
  __syncwarp();
  warp_fwht(v, d, d, lane);
  const float c = code_offset(BITS);
  const float top = float((1 << BITS) - 1);
  for (int g = lane; g < d / kBlock; g += kWarp) {  // one lane per group of 32
    float* y = v + g * kBlock;
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kBlock; ++i) {
      y[i] *= norm;
      amax = fmaxf(amax, fabsf(y[i]));
    }
    const __half hs = __float2half_rn(fmaxf(__fdiv_rn(amax, c), 1e-8f));
    const float s = __half2float(hs);
    scales[r * (d / kBlock) + g] = hs;
    uint32_t codes[kBlock];
#pragma unroll
    for (int i = 0; i < kBlock; ++i)
      codes[i] = s > 0.0f ? uint32_t(fminf(fmaxf(rintf(__fdiv_rn(y[i], s) + c), 0.0f), top)) : uint32_t(rintf(c));
    kv_store_group<BITS>(packed + r * (int64_t(d) * BITS / 8) + g * block_bytes(BITS), codes);
  }
}

template <int BITS>
__global__ void kv_dequantize_kernel(const uint8_t* __restrict__ packed, const __half* __restrict__ scales,
                                     int64_t rows, int d, float norm, bool rotate, const uint8_t* __restrict__ signs,
                                     __half* __restrict__ out) {
  float* smem = dynamic_shared<float>();
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / kWarp) + warp;
  if (r >= rows) return;
  float* v = smem + warp * d;
  const float c = code_offset(BITS);
  for (int g = lane; g < d / kBlock; g += kWarp) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(packed + r * (int64_t(d) * BITS / 8) + g * block_bytes(BITS));
    uint32_t w[BITS];
#pragma unroll
    for (int t = 0; t < BITS; ++t) w[t] = __ldg(src + t);
    const float s = __half2float(scales[r * (d / kBlock) + g]);
#pragma unroll
    for (int i = 0; i < kBlock; ++i) v[g * kBlock + i] = (float(kv_code<BITS>(w, i)) - c) * s;
  }
  __syncwarp();
  if (rotate) warp_fwht(v, d, d, lane);  // H is its own inverse: x = D_s H y / sqrt(d)
  for (int i = lane; i < d; i += kWarp) {
    const float y = rotate ? v[i] * norm * (signs ? sign_at(signs, i) : 1.0f) : v[i];
    out[r * d + i] = __float2half_rn(y);
  }
}

inline unsigned blocks_for(int64_t threads, int per_block) { return unsigned((threads + per_block - 1) / per_block); }

}  // namespace

void launch_gemv(const LayerDev& L, const float* x, int M, float* z, cudaStream_t stream) {
  if (L.N == 0 || M == 0) return;  // an empty grid is a launch error in CUDA
  const int threads = 128;  // 4 warps, each R = gemv_rows_per_warp<MR>() output rows
  auto grid = [&](int R) { return blocks_for((L.N + R - 1) / R * kWarp, threads); };
  if (M <= 1)
    EXL_LAUNCH(grid(gemv_rows_per_warp<1>()), threads, 0, stream, gemv_kernel<1>)(L, x, M, z);
  else if (M <= 2)
    EXL_LAUNCH(grid(gemv_rows_per_warp<2>()), threads, 0, stream, gemv_kernel<2>)(L, x, M, z);
  else if (M <= 4)
    EXL_LAUNCH(grid(gemv_rows_per_warp<4>()), threads, 0, stream, gemv_kernel<4>)(L, x, M, z);
  else
    EXL_LAUNCH(grid(gemv_rows_per_warp<8>()), threads, 0, stream, gemv_kernel<8>)(L, x, M, z);
}

void launch_dequant(const LayerDev& L, int64_t n0, int64_t n1, __half* out, cudaStream_t stream) {
  if (n1 <= n0) return;
  const int threads = 256;
  EXL_LAUNCH(blocks_for((n1 - n0) * kWarp, threads), threads, 0, stream, dequant_kernel)(L, n0, n1, out);
}

void launch_hadamard(const void* in, bool in_half, void* out, bool out_half, int64_t rows, int64_t n, int64_t block,
                     const uint8_t* signs, bool signs_first, const float* bias, const int32_t* scatter,
                     cudaStream_t stream) {
  if (rows == 0 || n == 0) return;
  const dim3 grid(unsigned(rows), unsigned((n + kChunk - 1) / kChunk));
  const float norm = 1.0f / sqrtf(float(block));
  const int b = int(block);
#define EXL_HAD(TI, TO)                                                                                 \
  EXL_LAUNCH(grid, kHadThreads, 0, stream, hadamard_kernel<TI, TO>)(static_cast<const TI*>(in),                  \
                                                                    static_cast<TO*>(out), n, b, norm, signs, \
                                                                    signs_first, bias, scatter)
  if (in_half && out_half)
    EXL_HAD(__half, __half);
  else if (in_half)
    EXL_HAD(__half, float);
  else if (out_half)
    EXL_HAD(float, __half);
  else
    EXL_HAD(float, float);
#undef EXL_HAD
}

void launch_kv_quantize(const __half* x, int64_t rows, int d, int bits, const uint8_t* signs, uint8_t* packed,
                        __half* scales, cudaStream_t stream) {
  if (rows == 0) return;
  const int threads = 128, warps = threads / kWarp;
  const float norm = 1.0f / sqrtf(float(d));
  const unsigned grid = blocks_for(rows, warps);
  const size_t smem = size_t(warps) * d * sizeof(float);
#define EXL_KVQ(B) \
  EXL_LAUNCH(grid, threads, smem, stream, kv_quantize_kernel<B>)(x, rows, d, norm, signs, packed, scales)
  switch (bits) {
    case 4: EXL_KVQ(4); break;
    case 6: EXL_KVQ(6); break;
    default: EXL_KVQ(8); break;
  }
#undef EXL_KVQ
}

void launch_kv_dequantize(const uint8_t* packed, const __half* scales, int64_t rows, int d, int bits, bool rotate,
                          const uint8_t* signs, __half* out, cudaStream_t stream) {
  if (rows == 0) return;
  const int threads = 128, warps = threads / kWarp;
  const float norm = 1.0f / sqrtf(float(d));
  const unsigned grid = blocks_for(rows, warps);
  const size_t smem = size_t(warps) * d * sizeof(float);
#define EXL_KVD(B) \
  EXL_LAUNCH(grid, threads, smem, stream, kv_dequantize_kernel<B>)(packed, scales, rows, d, norm, rotate, signs, out)
  switch (bits) {
    case 4: EXL_KVD(4); break;
    case 6: EXL_KVD(6); break;
    default: EXL_KVD(8); break;
  }
#undef EXL_KVD
}

}  // namespace cuda
}  // namespace exl
