// CPU trellis kernels (docs/format.md §7): plain C++ (no torch), one table per instruction set,
// chosen at run time by the same names as cpu_kernels.h's tables (scalar, avx2, avxvnni,
// avx512vnni). The ISA units follow cpu_kernels.h's rules: kernels in anonymous namespaces,
// reached only through the tables.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "trellis_format.h"

namespace exl {
namespace cpu {

// A trellis-coded layer as the kernels see it.
struct TrellisLayer {
  const uint32_t* words;   // [N/16, K/16, 8*bits]: tile (i, j) at words + (i*(K/16) + j) * tile_words(bits)
  const uint16_t* tscale;  // fp16 bits, [N]
  int64_t N, K;
  TrellisCode code;
};

// Software prefetch distance of the GEMV kernels: every cache line of the tile this many bytes ahead
// of the one being decoded (a tile row's tiles are contiguous). One line per tile (the kernels' first
// version) left half of a 4-bit tile row to the hardware prefetchers, which AMD Zen 4 runs late:
// 8 GB/s from DRAM at one thread where llama.cpp reaches 13.
constexpr int kTrellisPrefetchBytes = 2048;

// Every cache line of the tile at w (32 KB bytes), ahead of its use.
template <int KB>
inline void prefetch_tile(const uint32_t* w) {
  const char* p = reinterpret_cast<const char*>(w);
  for (int off = 0; off < 32 * KB; off += 64) __builtin_prefetch(p + off, 0, 3);
  if ((32 * KB) % 64) __builtin_prefetch(p + 32 * KB - 1, 0, 3);
}

struct TrellisKernels {
  const char* name;
  // y[m, n] = tscale[n] * sum_k value(n, k) x[m, k] for the outputs of tile rows [i0, i1) (n = 16*i0 ..
  // 16*i1 - 1); x: [M, K] contiguous, y: row stride ldy. Each tile is decoded once for all M rows, and
  // a row's arithmetic does not depend on M or on the other rows (batch invariance): every output
  // sums its K products in order k = 0, 1, ..., K-1 with fp32 fused multiply-adds, then scales.
  void (*gemv)(const TrellisLayer&, const float* x, int64_t M, float* y, int64_t ldy, int64_t i0, int64_t i1);
  // out[k * ldo + (n - 16*i0)] = value(n, k) (exact small integers as fp32), for the outputs n of
  // tile rows [i0, i1) and every k: the transposed block a GEMM multiplies with.
  void (*decode)(const TrellisLayer&, int64_t i0, int64_t i1, float* out, int64_t ldo);
  // The GEMV with int8 activations (quantized per 32 channels as the scalar layers' int8 path, K a
  // multiple of 32): q [M, K] the int8 activations, qq [M, K] each of them repeated in the 4 bytes of
  // an int32 (code 1 only; codes 2 and 3 read q, qq may be nullptr), d [M, K/32] the steps, bsum [M, K/32]
  // the sums of the int8 values per block. Per output and block of 32 channels the sum of value * q
  // is exact in int32 (code 1: (value + 510) * q by one vpdpbusd of x = A s + B's bytes against q per
  // column, the byte sum and the product in one instruction, minus 510 * bsum; codes 2, 3: (T_a + 128) *
  // q + (T_b + 128) * q by two vpdpbusd per 4 inputs, minus 256 * bsum); converted, times d, it is
  // added in fp32 block after block (order k = 0, 32, ...), then scaled. Bit for bit the same on
  // every table that has it (nullptr: none, use gemv).
  void (*gemv_q8)(const TrellisLayer&, const int8_t* q, const int32_t* qq, const float* d, const int32_t* bsum,
                  int64_t M, float* y, int64_t ldy, int64_t i0, int64_t i1);
  // The batch size from which tile decode + fp32 BLAS GEMM beats gemv_q8 (kGemmNever: never), for code 1
  // and for the two-table codes 2 and 3, measured over a whole model's layers and through the generator's
  // prefill (docs/benchmarks.md). Codes 2 and 3: never on the AVX-512 table (1.5-2.7x faster from 64 to 512
  // rows on AMD Zen 4, 1.3-4x on a Sapphire Rapids-class Xeon, "2026-12-06 (fourth session)"), 64 on
  // AVX-VNNI, 17 on AVX2, whose 256-bit table lookups make the GEMV compute-bound (1.3-1.8x the GEMM's time
  // from 24 rows on, Zen 3). Code 1: 96 on the AVX-512 table (even at ~64-128 rows on a Xeon), else 17.
  int64_t gemm_min_rows_code1, gemm_min_rows_two_table;
};

// AMX (AMX-TILE + AMX-INT8, granted by the kernel: Linux >= 5.16's arch_prctl(ARCH_REQ_XCOMP_PERM)): the
// AVX-512 table's int8 GEMV runs its dot products as tile multiplies for groups of kAmxMinRows (codes 2, 3)
// or kAmxMinRowsCode1 (code 1) to 16 rows, bit for bit the same results (from there on it is faster; below,
// the tile work per block costs more than the vpdpbusd it saves). amx_supported(): this CPU and OS can;
// amx_enabled(): in use (default: supported and EXL_CPU_AMX is not 0); set_amx(on) switches it (on only where
// supported) and returns whether it is now in use.
constexpr int64_t kAmxMinRows = 9;
constexpr int64_t kAmxMinRowsCode1 = 5;
bool amx_supported();
bool amx_enabled();
bool set_amx(bool on);

const TrellisKernels* scalar_trellis();
const TrellisKernels* avx2_trellis();        // AVX2 + FMA + F16C
const TrellisKernels* avxvnni_trellis();     // the above + AVX-VNNI (byte sums with vpdpbusd)
const TrellisKernels* avx512vnni_trellis();  // AVX-512 F/BW/VL/DQ + VNNI + VBMI

}  // namespace cpu
}  // namespace exl
