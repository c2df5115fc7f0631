// Host harness stand-in (docs/cuda_host.md): kernels run on the CPU, there is no device to switch to.
#pragma once
#include <c10/core/Device.h>

namespace c10 {
namespace cuda {
struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};
}  // namespace cuda
}  // namespace c10
