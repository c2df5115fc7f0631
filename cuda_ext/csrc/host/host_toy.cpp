// The harness's toy kernels (toy_kernels.cu), compiled for the host.
#include "device_pass.h"

#include "toy_kernels.cu"
