// CPU kernel interface: plain C++ (no torch), one function table per instruction set.
//
// The ISA-specific translation units (cpu_avx2.cpp, cpu_avxvnni.cpp, cpu_avx512.cpp) compile the same kernels
// under `#pragma GCC target`, so the built library runs on any x86-64 and picks the best table at
// run time (cpu_ops.cpp). Nothing in those units may be an inline function shared with other
// units (that would break the one-definition rule across instruction sets): kernels live in
// anonymous namespaces and are reached only through the tables below.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "format.h"

namespace exl {
namespace cpu {

// A quantized layer as the kernels see it (docs/format.md §1). Codes are in permuted order.
struct Layer {
  const uint8_t* qweight;  // [N, row_bytes]
  int64_t row_bytes;
  const uint16_t* qscale;  // fp16 bits, [N, n_groups]
  int64_t n_groups;
  int64_t N, K;
  SegmentTable segs;
};

// Activations quantized to int8 in blocks of 32 channels: x[m, k] ~ d[m, k/32] * q[m, k].
struct ActQ8 {
  const int8_t* q;     // [M, K]
  const float* d;      // [M, K/32]
  const float* gsum;   // [M, n_groups]: sum over the group's blocks j of d[m, j] * sum(q[m, block j])
  const float* bsum;   // [M, K/32 + 8]: sum(q[m, block j]) as float, zero-padded by 8 blocks per row
  int64_t M;
  // q in pair order (nullptr unless Kernels::uses_pairs): in each segment, blocks 2i and 2i+1 (counted from the
  // segment's first block) are stored as [b lo16 | b+1 lo16 | b hi16 | b+1 hi16] (16-byte halves),
  // an odd last block as is. The AVX2 small-batch kernels dot two blocks per vector this way.
  const int8_t* qp;
  // d with every block's step repeated 4 times ([M, K/32*4]; nullptr where qp is): the steps of
  // blocks b and b+1 as one vector at dx4 + 4 b, as the pair-order dot products lay them out.
  const float* dx4;
};

struct Kernels {
  const char* name;
  // y[m, n] = sum_k Q[n, k] x[m, k] for n in [n0, n1); fp32 weights, fp32 FMA accumulation.
  // x: [M, K] contiguous; y: row stride ldy.
  void (*gemv_f32)(const Layer&, const float* x, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1);
  // The same product with int8 activations (exact int32 dot per block, fp32 across blocks).
  void (*gemv_q8)(const Layer&, const ActQ8&, float* y, int64_t ldy, int64_t n0, int64_t n1);
  // Quantize one row of K activations, read through perm when perm != nullptr (x[perm[k]]),
  // perm_bytes 2 (int16) or 4 (int32). Writes q[K], d[K/32] and bsum[K/32] = sum of q per block.
  void (*quantize_q8)(const float* x, int64_t K, const void* perm, int perm_bytes, int8_t* q, float* d,
                      int32_t* bsum);
  // out[r, k] = Q[n0 + r, k] in fp32 (exact: every weight is representable), row stride ldo.
  void (*dequant)(const Layer&, int64_t n0, int64_t n1, float* out, int64_t ldo);
  // In place on rows x[r, 0:n] (row stride ld): normalized blockwise Walsh-Hadamard transform
  // (Sylvester order, block a power of two dividing n), with an optional sign flip from packed
  // sign bits applied before (signs_first) or after the transform.
  void (*fwht)(float* x, int64_t rows, int64_t n, int64_t ld, int64_t block, const uint8_t* signs,
               bool signs_first);
  // gemv_q8 reads ActQ8::qp and ActQ8::dx4 (the caller builds them for every call).
  bool uses_pairs;
  // The batch size from which dequant + fp32 BLAS GEMM beats this table's int8 GEMV (kGemmNever: never),
  // measured over a whole model's layers (cold weights) and through the generator's prefill
  // (docs/benchmarks.md, "2026-12-06 (third session)" and "(fourth session)"); the GEMM streams each weight
  // as fp32 three times. AVX-512 VNNI: never (the int8 GEMV is faster up to 1024 rows on a Sapphire
  // Rapids-class Xeon); AVX-VNNI: 64 (about 60 on that Xeon with the table forced, against an AVX-512 BLAS);
  // AVX2: 128 (~120 on a Zen 3 since its 2x4 tiles); scalar: 17.
  int64_t int8_gemm_min_rows;
};

// A table's "never switch to the GEMM" (exl/modules/quant_linear.py's GEMM_NEVER).
constexpr int64_t kGemmNever = INT64_MAX;

const Kernels* scalar_kernels();
const Kernels* avx2_kernels();     // AVX2 + FMA + F16C
const Kernels* avxvnni_kernels();  // the above + AVX-VNNI (vpdpbusd on 256-bit vectors)
const Kernels* avx512vnni_kernels();  // AVX-512 F/BW/VL/DQ + AVX512-VNNI (512-bit int8 GEMV)

// IEEE half (as bits) to float, without F16C.
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normalize
    exp = 113;
    while (!(man & 0x400u)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

}  // namespace cpu
}  // namespace exl
