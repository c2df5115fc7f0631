// AVX-512 (F/BW/VL/DQ) + AVX512-VNNI trellis kernels (docs/format.md §7); selected at run time.
//
// A tile's stream (8K words) sits in up to four zmm registers. Column c of the tile (input channel
// 16j + c, the 16 weights t = 16c .. 16c+15 of outputs 16i .. 16i+15) is decoded in one vector:
// lane r needs the L-bit window at bit p = (16c + r)K, which lies in words p/32 and p/32 + 1. Two
// vpermt2d gather those words (indexes precomputed per K and c, wrapping around the stream), a
// variable right shift of the low word, a left shift of the high word and one ternary-logic op
// (or, then mask to L bits) give the 16 states; one vpmulld + vpaddd give x = A s + B and one
// vpdpbusd against a vector of ones sums x's four bytes (onto -510): the 16 values, exactly.
// Each value vector then meets each activation row with one fused multiply-add.
#include "cpu_kernels.h"
#include "cpu_trellis.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")
namespace exl {
namespace cpu {
namespace {

#define EXL_TINLINE inline __attribute__((always_inline))

// Per K: for every column c, the two registers holding its words and, per lane, the vpermt2d
// indexes of words p/32 (lo) and p/32 + 1 (hi) and the shifts p mod 32 and 32 - p mod 32.
template <int KB>
struct Plan {
  static constexpr int kWords = 8 * KB;
  static constexpr int kRegs = (kWords + 15) / 16;
  alignas(64) int32_t lo[16][16];
  alignas(64) int32_t hi[16][16];
  alignas(64) int32_t shr[16][16];
  alignas(64) int32_t shl[16][16];
  int r1[16], r2[16];

  static constexpr int index(int w, int a, int b) { return w / 16 == a ? w - 16 * a : 16 + w - 16 * b; }

  constexpr Plan() : lo(), hi(), shr(), shl(), r1(), r2() {
    for (int c = 0; c < 16; ++c) {
      r1[c] = (16 * c * KB / 32) / 16;
      r2[c] = (r1[c] + 1) % kRegs;
      for (int r = 0; r < 16; ++r) {
        const int p = (16 * c + r) * KB, a = p / 32;
        lo[c][r] = index(a % kWords, r1[c], r2[c]);
        hi[c][r] = index((a + 1) % kWords, r1[c], r2[c]);
        shr[c][r] = p % 32;
        shl[c][r] = 32 - p % 32;
      }
    }
  }
};
template <int KB>
constexpr Plan<KB> kPlan{};

struct Consts {
  __m512i mask, mul, add, centre, ones;
  explicit Consts(const TrellisCode& c)
      : mask(_mm512_set1_epi32(int((1u << c.state_bits) - 1u))),
        mul(_mm512_set1_epi32(int(c.mul))),
        add(_mm512_set1_epi32(int(c.add))),
        centre(_mm512_set1_epi32(-kTrellisCentre)),
        ones(_mm512_set1_epi8(1)) {}
};

template <int KB>
EXL_TINLINE void load_tile(const uint32_t* w, __m512i* z) {
  constexpr int words = 8 * KB;
  for (int q = 0; q < Plan<KB>::kRegs; ++q) {
    if (words - 16 * q >= 16)
      z[q] = _mm512_loadu_si512(w + 16 * q);
    else
      z[q] = _mm512_maskz_loadu_epi32(__mmask16(0x00ff), w + 16 * q);
  }
}

// Values of column c of the tile in z (lane r: output 16i + r), as fp32.
template <int KB>
EXL_TINLINE __m512 column(const __m512i* z, int c, const Consts& k) {
  const Plan<KB>& P = kPlan<KB>;
  const __m512i a = z[P.r1[c]], b = z[P.r2[c]];
  const __m512i lo = _mm512_permutex2var_epi32(a, _mm512_load_si512(P.lo[c]), b);
  const __m512i hi = _mm512_permutex2var_epi32(a, _mm512_load_si512(P.hi[c]), b);
  const __m512i s = _mm512_ternarylogic_epi32(_mm512_srlv_epi32(lo, _mm512_load_si512(P.shr[c])),
                                              _mm512_sllv_epi32(hi, _mm512_load_si512(P.shl[c])), k.mask, 0xA8);
  const __m512i x = _mm512_add_epi32(_mm512_mullo_epi32(s, k.mul), k.add);
  return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(k.centre, x, k.ones));
}

// MR activation rows (rows past M repeat row 0 and are not stored) times TR tile rows at a time.
template <int KB, int MR, int TR>
void tile_rows(const TrellisLayer& T, const float* x, int64_t M, float* y, int64_t ldy, int64_t i) {
  constexpr int tw = 8 * KB, nr = Plan<KB>::kRegs;
  const int64_t kt = T.K / kTile;
  const Consts k(T.code);
  const float* xp[MR];
  for (int m = 0; m < MR; ++m) xp[m] = x + (m < M ? m : 0) * T.K;
  __m512 acc[TR][MR];
  for (int t = 0; t < TR; ++t)
    for (int m = 0; m < MR; ++m) acc[t][m] = _mm512_setzero_ps();
  const uint32_t* w[TR];
  for (int t = 0; t < TR; ++t) w[t] = T.words + (i + t) * kt * tw;
  for (int64_t j = 0; j < kt; ++j) {
    __m512i z[TR][nr];
    for (int t = 0; t < TR; ++t) {
      _mm_prefetch(reinterpret_cast<const char*>(w[t] + j * tw + 512), _MM_HINT_T0);
      load_tile<KB>(w[t] + j * tw, z[t]);
    }
#pragma GCC unroll 16
    for (int c = 0; c < kTile; ++c) {
      for (int t = 0; t < TR; ++t) {
        const __m512 v = column<KB>(z[t], c, k);
        for (int m = 0; m < MR; ++m) acc[t][m] = _mm512_fmadd_ps(v, _mm512_set1_ps(xp[m][j * kTile + c]), acc[t][m]);
      }
    }
  }
  for (int t = 0; t < TR; ++t) {
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(T.tscale + (i + t) * kTile)));
    for (int m = 0; m < MR && m < M; ++m) _mm512_storeu_ps(y + m * ldy + (i + t) * kTile, _mm512_mul_ps(acc[t][m], s));
  }
}

template <int KB, int MR>
void rows_for(const TrellisLayer& T, const float* x, int64_t M, float* y, int64_t ldy, int64_t i0, int64_t i1) {
  constexpr int TR = MR <= 4 ? 2 : 1;
  int64_t i = i0;
  for (; i + TR <= i1; i += TR) tile_rows<KB, MR, TR>(T, x, M, y, ldy, i);
  for (; i < i1; ++i) tile_rows<KB, MR, 1>(T, x, M, y, ldy, i);
}

template <int KB>
void gemv_k(const TrellisLayer& T, const float* x, int64_t M, float* y, int64_t ldy, int64_t i0, int64_t i1) {
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t mr = M - m0 < 16 ? M - m0 : 16;
    const float* xm = x + m0 * T.K;
    float* ym = y + m0 * ldy;
    if (mr == 1) rows_for<KB, 1>(T, xm, mr, ym, ldy, i0, i1);
    else if (mr == 2) rows_for<KB, 2>(T, xm, mr, ym, ldy, i0, i1);
    else if (mr <= 4) rows_for<KB, 4>(T, xm, mr, ym, ldy, i0, i1);
    else if (mr <= 8) rows_for<KB, 8>(T, xm, mr, ym, ldy, i0, i1);
    else rows_for<KB, 16>(T, xm, mr, ym, ldy, i0, i1);
  }
}

template <int KB>
void decode_k(const TrellisLayer& T, int64_t i0, int64_t i1, float* out, int64_t ldo) {
  constexpr int tw = 8 * KB;
  const int64_t kt = T.K / kTile;
  const Consts k(T.code);
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t j = 0; j < kt; ++j) {
      __m512i z[Plan<KB>::kRegs];
      load_tile<KB>(T.words + (i * kt + j) * tw, z);
      float* o = out + j * kTile * ldo + (i - i0) * kTile;
#pragma GCC unroll 16
      for (int c = 0; c < kTile; ++c) _mm512_storeu_ps(o + c * ldo, column<KB>(z, c, k));
    }
}

void gemv(const TrellisLayer& T, const float* x, int64_t M, float* y, int64_t ldy, int64_t i0, int64_t i1) {
  switch (T.code.bits) {
    case 1: return gemv_k<1>(T, x, M, y, ldy, i0, i1);
    case 2: return gemv_k<2>(T, x, M, y, ldy, i0, i1);
    case 3: return gemv_k<3>(T, x, M, y, ldy, i0, i1);
    case 4: return gemv_k<4>(T, x, M, y, ldy, i0, i1);
    case 5: return gemv_k<5>(T, x, M, y, ldy, i0, i1);
    case 6: return gemv_k<6>(T, x, M, y, ldy, i0, i1);
    case 7: return gemv_k<7>(T, x, M, y, ldy, i0, i1);
    default: return gemv_k<8>(T, x, M, y, ldy, i0, i1);
  }
}

void decode(const TrellisLayer& T, int64_t i0, int64_t i1, float* out, int64_t ldo) {
  switch (T.code.bits) {
    case 1: return decode_k<1>(T, i0, i1, out, ldo);
    case 2: return decode_k<2>(T, i0, i1, out, ldo);
    case 3: return decode_k<3>(T, i0, i1, out, ldo);
    case 4: return decode_k<4>(T, i0, i1, out, ldo);
    case 5: return decode_k<5>(T, i0, i1, out, ldo);
    case 6: return decode_k<6>(T, i0, i1, out, ldo);
    case 7: return decode_k<7>(T, i0, i1, out, ldo);
    default: return decode_k<8>(T, i0, i1, out, ldo);
  }
}

const TrellisKernels kTable = {"avx512vnni", gemv, decode};
}  // namespace
const TrellisKernels* avx512vnni_trellis() { return &kTable; }
}  // namespace cpu
}  // namespace exl
#pragma GCC pop_options
#else
namespace exl {
namespace cpu {
const TrellisKernels* avx512vnni_trellis() { return nullptr; }
}  // namespace cpu
}  // namespace exl
#endif
