// CUDA trellis kernels (docs/format.md §7): decode-and-dot GEMV (code 1: 1-8 activation rows, codes 2
// and 3: 1-16) and tile dequantization (fp16, scale folded in) for the cuBLAS GEMM path. The state and code
// are trellis_format.h's, the same functions the scalar CPU kernels run; the two-table codes' tables are staged in
// shared memory. Launches go through EXL_LAUNCH so that the host harness (docs/cuda_host.md) runs this
// same source.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_device.cuh"
#include "cuda_trellis.h"
#include "trellis_format.h"

namespace exl {
namespace cuda {
namespace {

constexpr int kTrellisWarps = 4;  // warps (tile rows) per block of the GEMV

// Word w (mod the tile's n words) of a tile held by the warp: lane l has words l (lo) and l + 32 (hi).
__device__ __forceinline__ uint32_t tile_word(uint32_t lo, uint32_t hi, int w, int n) {
  w = w < n ? w : w - n;
  const uint32_t a = __shfl_sync(kFull, lo, w & 31), b = __shfl_sync(kFull, hi, w & 31);
  return w < 32 ? a : b;
}

__device__ __forceinline__ float code_value(uint32_t state, const TrellisCode& c) {
  return float(trellis_value(state, c));
}

// A warp's sum for output n and activation row m over its K-slice (blockIdx.y): the output itself
// (scaled) when K is not split, else the slice's partial sum for split_sum_kernel.
__device__ __forceinline__ void store_sum(const TrellisDev& T, float s, int m, int M, int64_t n, float* z,
                                          float* partial) {
  if (gridDim.y == 1)
    z[m * T.N + n] = s * __half2float(T.tscale[n]);
  else
    partial[(int64_t(blockIdx.y) * M + m) * T.N + n] = s;
}

// z[m, n] = tscale[n] * (the S slices' partial sums, added in slice order); one thread per (m, n).
__global__ void split_sum_kernel(const float* __restrict__ partial, const __half* __restrict__ tscale, int64_t MN,
                                 int64_t N, int S, float* __restrict__ z) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= MN) return;
  float s = partial[e];
  for (int q = 1; q < S; ++q) s += partial[q * MN + e];
  z[e] = s * __half2float(tscale[e % N]);
}

// Code 1 (layout 1), one warp per tile row (16 outputs) and K-slice (blockIdx.y, trellis_gemv_split).
// Lane l decodes, in every tile of its slice, column c = l / 2 (input channel 16j + c), rows
// 8 (l & 1) .. + 7: weights t = 16c + 8(l & 1) + 0..7, whose windows lie in the 4 words from bit
// (16c + 8(l & 1)) K on. Partial sums of the 16 lanes of the same parity are added at the end.
template <int MR>
__global__ void trellis_gemv_kernel(TrellisDev T, const float* __restrict__ x, int M, float* __restrict__ z,
                                    int64_t slice_tiles, float* __restrict__ partial) {
  const int lane = threadIdx.x & 31;
  const int64_t i = int64_t(blockIdx.x) * kTrellisWarps + (threadIdx.x >> 5);
  if (i >= T.N / kTile) return;  // a whole warp leaves together
  const int K = T.code.bits, n = tile_words(K);
  const int64_t kt = T.K / kTile;
  const int c = lane >> 1, r0 = (lane & 1) * 8;
  const int bit0 = (16 * c + r0) * K, a0 = bit0 >> 5;
  const uint32_t mask = (1u << T.code.state_bits) - 1u;
  float acc[MR][8];
#pragma unroll
  for (int m = 0; m < MR; ++m)
#pragma unroll
    for (int r = 0; r < 8; ++r) acc[m][r] = 0.0f;
  const int64_t j0 = int64_t(blockIdx.y) * slice_tiles, j1 = j0 + slice_tiles < kt ? j0 + slice_tiles : kt;
  const uint32_t* w = T.words + (i * kt + j0) * n;
  for (int64_t j = j0; j < j1; ++j, w += n) {
    const uint32_t lo = lane < n ? __ldg(w + lane) : 0u, hi = lane + 32 < n ? __ldg(w + lane + 32) : 0u;
    uint32_t wd[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) wd[q] = tile_word(lo, hi, a0 + q, n);
    float xv[MR];
#pragma unroll
    for (int m = 0; m < MR; ++m) xv[m] = m < M ? __ldg(x + m * T.K + j * kTile + c) : 0.0f;
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const int b = bit0 + r * K - 32 * a0, q = b >> 5, sh = b & 31;  // q <= 2: the window is in wd[q], wd[q+1]
      const uint64_t pair = uint64_t(wd[q]) | (uint64_t(wd[q + 1]) << 32);
      const float v = code_value(uint32_t(pair >> sh) & mask, T.code);
#pragma unroll
      for (int m = 0; m < MR; ++m) acc[m][r] = fmaf(v, xv[m], acc[m][r]);
    }
  }
#pragma unroll
  for (int m = 0; m < MR; ++m)
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      float s = acc[m][r];
#pragma unroll
      for (int o = 16; o > 1; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
      acc[m][r] = s;
    }
  if (lane < 2) {
#pragma unroll
    for (int r = 0; r < 8; ++r)
#pragma unroll
      for (int m = 0; m < MR; ++m)
        if (m < M) store_sum(T, acc[m][r], m, M, i * kTile + r0 + r, z, partial);
  }
}

// A two-table code's value of a state (trellis_value, docs/format.md §7.3) in fewer steps. Code 2's
// indices (a + b) mod 128 and (a - b) mod 128, a = s mod 128, b = (s >> 5) mod 128, are
// (s + (s >> 5)) mod 128 and (s - (s >> 5)) mod 128, as the low 7 bits of a sum or difference depend
// only on the operands' low 7 bits (code 3 likewise with 64 and s >> 6). So the state's bits from
// bit 12 on may be anything.
template <int C>
__device__ __forceinline__ int two_table_value(uint32_t state, const int8_t* tables) {
  constexpr uint32_t n = two_table_size(C), m = n - 1u;
  const uint32_t b = state >> two_table_shift(C);
  return int(tables[(state + b) & m]) + int(tables[n + ((state - b) & m)]);
}

// Codes 2 and 3 (layout 2; C the code), one warp per tile row (16 outputs) and K-slice. Lane l decodes weights
// t = 8l .. 8l+7 of every tile of its slice: two quads, each 4 consecutive inputs 16j + 4(l div 8) .. +3
// of one output, outputs 2(l mod 8) (t = 8l .. 8l+3) and 2(l mod 8) + 1 (t = 8l+4 .. 8l+7). Their
// 12-bit windows lie in the 3 words from bit 8lK on (K <= 7: the window starts at most 24 bits into
// the first word and ends by bit 24 + 7K + 12 <= 85). Code 2's T_a and T_b are 32 shared-memory words
// each (code 3's 16), one per bank, so the lookups never conflict. Each row's sums run in the same order whatever M is
// (batch invariance); the partial sums of the 4 lanes with the same l mod 8 are added at the end.
template <int MR, int C>
__global__ void two_table_gemv_kernel(TrellisDev T, const float* __restrict__ x, int M, float* __restrict__ z,
                                      int64_t slice_tiles, float* __restrict__ partial) {
  __shared__ int8_t tables[2 * kTwoTableSize];
  for (int e = threadIdx.x; e < 2 * two_table_size(C); e += blockDim.x) tables[e] = T.code.tables[e];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t i = int64_t(blockIdx.x) * kTrellisWarps + (threadIdx.x >> 5);
  if (i >= T.N / kTile) return;  // a whole warp leaves together
  const int K = T.code.bits, n = tile_words(K);
  const int64_t kt = T.K / kTile;
  const int bit0 = 8 * lane * K, a0 = bit0 >> 5, sh0 = bit0 & 31;
  const int col = 4 * (lane >> 3);
  float acc[MR][2];
#pragma unroll
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = 0.0f;
  const int64_t j0 = int64_t(blockIdx.y) * slice_tiles, j1 = j0 + slice_tiles < kt ? j0 + slice_tiles : kt;
  const uint32_t* w = T.words + (i * kt + j0) * n;
  for (int64_t j = j0; j < j1; ++j, w += n) {
    const uint32_t lo = lane < n ? __ldg(w + lane) : 0u, hi = lane + 32 < n ? __ldg(w + lane + 32) : 0u;
    const uint32_t w0 = tile_word(lo, hi, a0, n), w1 = tile_word(lo, hi, a0 + 1, n), w2 = tile_word(lo, hi, a0 + 2, n);
    // The lane's 8 windows, bits 8lK .. 8lK + 7K + 11 of the stream (at most 61), as one 64-bit value
    // (rest:state) that slides K bits per weight.
    uint32_t state = __funnelshift_r(w0, w1, sh0), rest = __funnelshift_r(w1, w2, sh0);
    float v[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      v[r] = float(two_table_value<C>(state, tables));
      state = __funnelshift_r(state, rest, K);
      rest >>= K;
    }
    const float* xj = x + j * kTile + col;
#pragma unroll
    for (int m = 0; m < MR; ++m) {
      if (m < M) {
        const float4 xq = __ldg(reinterpret_cast<const float4*>(xj + m * T.K));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float a = acc[m][h];
          a = fmaf(v[4 * h], xq.x, a);
          a = fmaf(v[4 * h + 1], xq.y, a);
          a = fmaf(v[4 * h + 2], xq.z, a);
          acc[m][h] = fmaf(v[4 * h + 3], xq.w, a);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MR; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float s = acc[m][h];
      s += __shfl_xor_sync(kFull, s, 8);
      s += __shfl_xor_sync(kFull, s, 16);
      acc[m][h] = s;
    }
  if (lane < 8) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int m = 0; m < MR; ++m)
        if (m < M) store_sum(T, acc[m][h], m, M, i * kTile + 2 * lane + h, z, partial);
  }
}

// The walk index (0..255) of the weight at row r, column c of a tile: the inverse of trellis_row/col.
__device__ __forceinline__ int walk_index(int r, int c, const TrellisCode& code) {
  return is_two_table(code.code) ? 64 * (c >> 2) + 4 * r + (c & 3) : 16 * c + r;
}

// One block of 256 threads per tile: thread p writes row p div 16, column p mod 16 of the tile (16 threads
// store one row's 32 contiguous bytes) and decodes the weight the code's layout puts there.
__global__ void trellis_dequant_kernel(TrellisDev T, int64_t i0, __half* __restrict__ out) {
  __shared__ uint32_t words[64];
  __shared__ int8_t tables[2 * kTwoTableSize];
  const int64_t kt = T.K / kTile, tile = blockIdx.x;
  const int64_t i = i0 + tile / kt, j = tile % kt;
  const int n = tile_words(T.code.bits), p = threadIdx.x;
  if (p < n) words[p] = T.words[(i * kt + j) * n + p];
  TrellisCode code = T.code;
  if (is_two_table(code.code)) {
    if (p < 2 * two_table_size(code.code)) tables[p] = code.tables[p];  // 256 threads, at most 256 table bytes
    code.tables = tables;
  }
  __syncthreads();
  const int r = p >> 4, c = p & 15;
  const int64_t row = i * kTile + r;
  const float v = code_value(trellis_state(words, walk_index(r, c, code), code), code);
  out[(row - i0 * kTile) * T.K + j * kTile + c] = __float2half_rn(v * __half2float(T.tscale[row]));
}

template <int C>
void launch_two_table(dim3 grid, dim3 block, cudaStream_t stream, const TrellisDev& T, const float* x, int M, float* z,
                      int64_t st, float* partial) {
  switch (M) {
    case 1: EXL_LAUNCH(grid, block, 0, stream, two_table_gemv_kernel<1, C>)(T, x, M, z, st, partial); break;
    case 2: EXL_LAUNCH(grid, block, 0, stream, two_table_gemv_kernel<2, C>)(T, x, M, z, st, partial); break;
    case 3:
    case 4: EXL_LAUNCH(grid, block, 0, stream, two_table_gemv_kernel<4, C>)(T, x, M, z, st, partial); break;
    case 5:
    case 6:
    case 7:
    case 8: EXL_LAUNCH(grid, block, 0, stream, two_table_gemv_kernel<8, C>)(T, x, M, z, st, partial); break;
    default: EXL_LAUNCH(grid, block, 0, stream, two_table_gemv_kernel<16, C>)(T, x, M, z, st, partial); break;
  }
}

}  // namespace

void launch_trellis_gemv(const TrellisDev& T, const float* x, int M, float* z, float* partial, cudaStream_t stream) {
  const int64_t tiles = T.N / kTile;
  if (tiles == 0 || M <= 0) return;
  const TrellisSplit split = trellis_gemv_split(T.N, T.K);
  const dim3 grid(unsigned((tiles + kTrellisWarps - 1) / kTrellisWarps), unsigned(split.count)),
      block(32 * kTrellisWarps);
  const int64_t st = split.tiles;
  if (T.code.code == kCodeTwoTable64) {
    launch_two_table<kCodeTwoTable64>(grid, block, stream, T, x, M, z, st, partial);
  } else if (T.code.code == kCodeTwoTable) {
    launch_two_table<kCodeTwoTable>(grid, block, stream, T, x, M, z, st, partial);
  } else {
    switch (M) {
      case 1: EXL_LAUNCH(grid, block, 0, stream, trellis_gemv_kernel<1>)(T, x, M, z, st, partial); break;
      case 2: EXL_LAUNCH(grid, block, 0, stream, trellis_gemv_kernel<2>)(T, x, M, z, st, partial); break;
      case 3:
      case 4: EXL_LAUNCH(grid, block, 0, stream, trellis_gemv_kernel<4>)(T, x, M, z, st, partial); break;
      default: EXL_LAUNCH(grid, block, 0, stream, trellis_gemv_kernel<8>)(T, x, M, z, st, partial); break;
    }
  }
  if (split.count > 1) {
    const int64_t mn = int64_t(M) * T.N;
    EXL_LAUNCH(dim3(unsigned((mn + 255) / 256)), dim3(256), 0, stream, split_sum_kernel)(partial, T.tscale, mn, T.N,
                                                                                          int(split.count), z);
  }
}

void launch_trellis_dequant(const TrellisDev& T, int64_t n0, int64_t n1, __half* out, cudaStream_t stream) {
  const int64_t tiles = (n1 - n0) / kTile * (T.K / kTile);
  if (tiles <= 0) return;
  EXL_LAUNCH(dim3(unsigned(tiles)), dim3(kTileWeights), 0, stream, trellis_dequant_kernel)(T, n0 / kTile, out);
}

}  // namespace cuda
}  // namespace exl
