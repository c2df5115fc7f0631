// Host harness stand-in (docs/cuda_host.md): a launch error recorded by the harness becomes a c10::Error.
#pragma once
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <string>

#define C10_CUDA_KERNEL_LAUNCH_CHECK()                                                  \
  do {                                                                                  \
    const std::string exl_err = ::exl_host::take_last_error();                          \
    TORCH_CHECK(exl_err.empty(), "CUDA kernel failed (host harness): ", exl_err);       \
  } while (0)
