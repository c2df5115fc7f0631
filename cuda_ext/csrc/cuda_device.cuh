// What every .cu file of exl shares: the launch macro, dynamic shared memory, warp helpers.
// Written so that the host harness (host/cuda_host.h, docs/cuda_host.md) can run the same source.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

// kernel<<<grid, block, smem, stream>>>(args...) is written
// EXL_LAUNCH(grid, block, smem, stream, kernel)(args...); the host harness defines its own.
#ifndef EXL_LAUNCH
#define EXL_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
#endif

namespace exl {
namespace cuda {

constexpr int kWarp = 32;
constexpr unsigned kFull = 0xffffffffu;

// The launch's dynamic shared memory as T* (one declaration for all kernels, so that templates
// over different T do not clash; `extern __shared__` arrays are not used directly).
template <typename T>
__device__ __forceinline__ T* dynamic_shared() {
#ifdef EXL_CUDA_HOST
  return reinterpret_cast<T*>(::exl_host::dynamic_shared_base());
#else
  extern __shared__ __align__(16) unsigned char exl_dynamic_shared[];
  return reinterpret_cast<T*>(exl_dynamic_shared);
#endif
}

// A float or half element read / written as float (half: round to nearest even).
template <typename T>
__device__ __forceinline__ float load_f(const T* p);
template <>
__device__ __forceinline__ float load_f<float>(const float* p) { return *p; }
template <>
__device__ __forceinline__ float load_f<__half>(const __half* p) { return __half2float(*p); }

template <typename T>
__device__ __forceinline__ void store_f(T* p, float v);
template <>
__device__ __forceinline__ void store_f<float>(float* p, float v) { *p = v; }
template <>
__device__ __forceinline__ void store_f<__half>(__half* p, float v) { *p = __float2half_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

}  // namespace cuda
}  // namespace exl
