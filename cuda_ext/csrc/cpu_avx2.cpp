// AVX2 + FMA + F16C kernels (see cpu_simd.inc); selected at run time when the CPU has them.
#include "cpu_kernels.h"

// GCC only: clang ignores `#pragma GCC target`, so clang builds use the scalar kernels.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#include <math.h>
#include <string.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define EXL_VNNI 0
namespace exl {
namespace cpu {
namespace {
#include "cpu_simd.inc"
const Kernels kTable = {"avx2", gemv_f32, gemv_q8, quantize_q8, dequant, fwht, true, 128};
}  // namespace
const Kernels* avx2_kernels() { return &kTable; }
}  // namespace cpu
}  // namespace exl
#pragma GCC pop_options
#else
namespace exl {
namespace cpu {
const Kernels* avx2_kernels() { return nullptr; }
}  // namespace cpu
}  // namespace exl
#endif
