// Host harness stand-in for the CUDA toolkit header of this name (docs/cuda_host.md).
#pragma once
#include "cuda_host.h"
