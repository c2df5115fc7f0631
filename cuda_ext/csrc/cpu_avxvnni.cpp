// AVX2 + FMA + F16C + AVX-VNNI kernels (see cpu_simd.inc); selected at run time when the CPU has them.
#include "cpu_kernels.h"

// GCC 11+ only (AVX-VNNI); clang ignores `#pragma GCC target`, so clang builds use the scalar kernels.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#include <immintrin.h>
#include <math.h>
#include <string.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define EXL_VNNI 1
namespace exl {
namespace cpu {
namespace {
#include "cpu_simd.inc"
const Kernels kTable = {"avxvnni", gemv_f32, gemv_q8, quantize_q8, dequant, fwht, true, 64};
}  // namespace
const Kernels* avxvnni_kernels() { return &kTable; }
}  // namespace cpu
}  // namespace exl
#pragma GCC pop_options
#else
namespace exl {
namespace cpu {
const Kernels* avxvnni_kernels() { return nullptr; }
}  // namespace cpu
}  // namespace exl
#endif
