// Host harness stand-in (docs/cuda_host.md): launches run synchronously on one default stream.
#pragma once
#include <c10/core/Device.h>
#include <cuda_runtime.h>

namespace c10 {
namespace cuda {
struct CUDAStream {
  operator cudaStream_t() const { return nullptr; }
};
inline CUDAStream getCurrentCUDAStream(c10::DeviceIndex = -1) { return {}; }
}  // namespace cuda
}  // namespace c10
