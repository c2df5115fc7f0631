// AVX2 and AVX-VNNI trellis kernels (see cpu_trellis_simd.inc); selected at run time.
#include "cpu_kernels.h"
#include "cpu_trellis.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#include <string.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define EXL_TVNNI 0
namespace exl {
namespace cpu {
namespace {
namespace t_avx2 {
#include "cpu_trellis_simd.inc"
const TrellisKernels kTable = {"avx2", gemv, decode, gemv_q8, 17, 17};
}  // namespace t_avx2
}  // namespace
const TrellisKernels* avx2_trellis() { return &t_avx2::kTable; }
}  // namespace cpu
}  // namespace exl
#pragma GCC pop_options
#undef EXL_TVNNI
#undef EXL_TINLINE

#if __GNUC__ >= 11
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define EXL_TVNNI 1
namespace exl {
namespace cpu {
namespace {
namespace t_avxvnni {
#include "cpu_trellis_simd.inc"
const TrellisKernels kTable = {"avxvnni", gemv, decode, gemv_q8, 17, 64};
}  // namespace t_avxvnni
}  // namespace
const TrellisKernels* avxvnni_trellis() { return &t_avxvnni::kTable; }
}  // namespace cpu
}  // namespace exl
#pragma GCC pop_options
#else
namespace exl {
namespace cpu {
const TrellisKernels* avxvnni_trellis() { return nullptr; }
}  // namespace cpu
}  // namespace exl
#endif
#else
namespace exl {
namespace cpu {
const TrellisKernels* avx2_trellis() { return nullptr; }
const TrellisKernels* avxvnni_trellis() { return nullptr; }
}  // namespace cpu
}  // namespace exl
#endif
