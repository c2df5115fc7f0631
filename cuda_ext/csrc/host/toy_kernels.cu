// Toy kernels of the host harness tests (toy_kernels.h). Valid CUDA; some are wrong on purpose.
#include <cuda_runtime.h>
#include <stdint.h>

#include "../cuda_device.cuh"
#include "toy_kernels.h"

namespace exl {
namespace toy {
namespace {

using cuda::dynamic_shared;
using cuda::kFull;

__global__ void reverse_kernel(const float* in, float* out, bool sync) {
  float* sh = dynamic_shared<float>();
  const int t = threadIdx.x, n = blockDim.x;
  sh[t] = in[blockIdx.x * n + t];
  if (sync) __syncthreads();
  out[blockIdx.x * n + t] = sh[n - 1 - t];
}

__global__ void warp_exchange_kernel(const float* in, float* out, bool sync) {
  float* sh = dynamic_shared<float>();
  const int t = threadIdx.x;
  sh[t] = in[t];
  if (sync) __syncwarp();
  out[t] = sh[t ^ 1];
}

__global__ void shuffle_kernel(int kind, int arg, int width, int* out) {
  const int t = threadIdx.x, v = 100 * t + 7;
  int r = 0;
  switch (kind) {
    case 0: r = __shfl_sync(kFull, v, arg, width); break;
    case 1: r = __shfl_xor_sync(kFull, v, arg, width); break;
    case 2: r = __shfl_down_sync(kFull, v, unsigned(arg), width); break;
    default: r = __shfl_up_sync(kFull, v, unsigned(arg), width); break;
  }
  out[t] = r;
}

__global__ void ballot_kernel(unsigned* out) { out[threadIdx.x] = __ballot_sync(kFull, threadIdx.x % 3 == 0); }

__global__ void atomics_kernel(int* count, float* sum) {
  atomicAdd(count, 1);
  atomicAdd(sum, 0.5f);
}

__global__ void divergent_barrier_kernel() {
  if (threadIdx.x == 0)
    __syncwarp();
  else
    __syncthreads();
}

__global__ void ldg4_kernel(const float* p, float* out) { out[0] = __ldg(reinterpret_cast<const float4*>(p)).x; }

__global__ void shuffle_from_exited_kernel(float* out) {
  const int lane = threadIdx.x % 32;
  if (lane >= 16) return;
  out[lane] = __shfl_sync(kFull, float(lane), lane + 16);
}

__global__ void empty_kernel() {}

}  // namespace

void reverse(const float* in, float* out, int blocks, int n, bool sync) {
  EXL_LAUNCH(blocks, n, n * sizeof(float), 0, reverse_kernel)(in, out, sync);
}
void warp_exchange(const float* in, float* out, int n, bool sync) {
  EXL_LAUNCH(1, n, n * sizeof(float), 0, warp_exchange_kernel)(in, out, sync);
}
void shuffle(int kind, int arg, int width, int n, int* out) {
  EXL_LAUNCH(1, n, 0, 0, shuffle_kernel)(kind, arg, width, out);
}
void ballot(int n, unsigned* out) { EXL_LAUNCH(1, n, 0, 0, ballot_kernel)(out); }
void atomics(int blocks, int* count, float* sum) { EXL_LAUNCH(blocks, 256, 0, 0, atomics_kernel)(count, sum); }
void divergent_barrier() { EXL_LAUNCH(1, 64, 0, 0, divergent_barrier_kernel)(); }
void ldg4(const float* p, float* out) { EXL_LAUNCH(1, 1, 0, 0, ldg4_kernel)(p, out); }
void shuffle_from_exited(float* out) { EXL_LAUNCH(1, 32, 0, 0, shuffle_from_exited_kernel)(out); }
void launch_shape(unsigned grid, unsigned block, size_t smem) { EXL_LAUNCH(grid, block, smem, 0, empty_kernel)(); }

}  // namespace toy
}  // namespace exl
