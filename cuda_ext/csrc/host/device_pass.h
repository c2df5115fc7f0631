// Included first by the host harness's kernel translation units: CUDA's runtime model (cuda_host.h)
// and the macros of nvcc's device pass, so that the .cu source takes its device code paths.
#pragma once
#include "cuda_host.h"

#ifndef __CUDACC__
#define __CUDACC__ 1
#endif
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 750  // the lowest architecture exl targets: its portable code paths
#endif
