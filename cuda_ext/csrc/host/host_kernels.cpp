// The product CUDA kernels, compiled for the host harness (docs/cuda_host.md).
#include "device_pass.h"

#include "../cuda_kernels.cu"
#include "../cuda_trellis.cu"
#include "../cuda_attention.cu"
