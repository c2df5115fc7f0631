// AVX-512 (F/BW/VL/DQ) + AVX512-VNNI kernels; selected at run time when the CPU has them.
//
// The int8-activation GEMV is written here for 512-bit vectors; the other kernels are
// cpu_simd.inc's (256-bit) compiled for this target.
//
// Quad order: the GEMV works on 4 consecutive blocks of a segment at a time (a "quad"; a
// segment's last quad may be partial). For a quad, a 512-bit vector holds, in 128-bit lane t,
// codes 0-15 of block t ("lo") and a second one codes 16-31 ("hi"); the activations are
// rearranged once per call into the same order, so two vpdpbusd give, in i32 lanes 4t..4t+3, four
// partial sums of block t's exact dot product. Each lane is converted to fp32 and scaled by its
// block's activation step times the group's weight scale; the grid centre is folded in per group
// through ActQ8::gsum (see cpu_simd.inc).
#include "cpu_kernels.h"

// GCC 10+ only; clang ignores `#pragma GCC target`, so clang builds use the scalar kernels.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")
#define EXL_VNNI 2
namespace exl {
namespace cpu {
namespace {
namespace v256 {
#include "cpu_simd.inc"
}  // namespace v256

constexpr int kQuad = 4;                   // blocks per quad
constexpr int kQuadBytes = kQuad * kBlock;  // int8 activations of a quad: 64 bytes lo + 64 hi
constexpr int kMaxRows = 16;                // activation rows per pass over the weights
constexpr int kRegRows = 4;                 // up to this many: codes stay in registers (row_tile)

// All bits up to n (0 <= n <= 64) of a byte mask.
EXL_INLINE __mmask64 byte_mask(int n) {
  return n <= 0 ? __mmask64(0) : n >= 64 ? ~__mmask64(0) : (__mmask64(1) << n) - 1;
}

// Dword index of the plane-gather permutes: lane 4t+i takes, from the raw bytes of a quad (block t
// at dword t*BITS), dword off + i (mode 0: a 16-byte plane), off + (i & 1) (mode 1: 8-byte plane,
// twice) or off (mode 2: 4-byte plane, four times) of block t.
constexpr int qidx(int bits, int off, int mode, int lane) {
  return (lane / 4) * bits + off + (mode == 0 ? lane % 4 : mode == 1 ? (lane % 4) & 1 : 0);
}
#define EXL_QIDX(b, o, m)                                                                                           \
  _mm512_setr_epi32(qidx(b, o, m, 0), qidx(b, o, m, 1), qidx(b, o, m, 2), qidx(b, o, m, 3), qidx(b, o, m, 4),      \
                    qidx(b, o, m, 5), qidx(b, o, m, 6), qidx(b, o, m, 7), qidx(b, o, m, 8), qidx(b, o, m, 9),      \
                    qidx(b, o, m, 10), qidx(b, o, m, 11), qidx(b, o, m, 12), qidx(b, o, m, 13), qidx(b, o, m, 14), \
                    qidx(b, o, m, 15))

template <int BITS>
EXL_INLINE __m512i gather_dwords(__m512i z0, __m512i z1, __m512i idx) {
  if constexpr (BITS <= 4) return _mm512_permutexvar_epi32(idx, z0);
  return _mm512_permutex2var_epi32(z0, idx, z1);
}

// Codes of a quad in quad order (lo: codes 0-15 of block t in lane t, hi: codes 16-31), from the
// raw bytes z0 (bytes 0-63) and z1 (bytes 64-127). A plane of width P (docs/format.md §1.3) puts
// code i in byte i mod 4P at bit P*(i div 4P): after gathering each block's plane bytes into its
// lane (repeated so that every byte of the lane sees the right source byte), a rotate per 32/64-bit
// element brings each code's bits to their place, and a byte mask keeps them.
template <int BITS>
EXL_INLINE void unpack_raw(__m512i z0, __m512i z1, __m512i& lo, __m512i& hi) {
  if constexpr (BITS == 8) {
    lo = _mm512_permutex2var_epi64(z0, _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), z1);
    hi = _mm512_permutex2var_epi64(z0, _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15), z1);
  } else {
    __m512i l = _mm512_setzero_si512(), h = _mm512_setzero_si512();
    if constexpr ((BITS & 4) != 0) {  // codes 0-15: low nibbles of the 16 bytes, 16-31: high nibbles
      const __m512i g = BITS == 4 ? z0 : gather_dwords<BITS>(z0, z1, EXL_QIDX(BITS, 0, 0));
      const __m512i m = _mm512_set1_epi8(0x0f);
      l = _mm512_and_si512(g, m);
      h = _mm512_and_si512(_mm512_srli_epi16(g, 4), m);
    }
    if constexpr ((BITS & 2) != 0) {  // qword j of a lane: code 8j + b (lo) sits at bit 2j of byte b
      constexpr int s = BITS & 4;      // the plane's first code bit
      const __m512i g = gather_dwords<BITS>(z0, z1, EXL_QIDX(BITS, s, 1));
      const __m512i m = _mm512_set1_epi8(char(3 << s));
      constexpr long long r0 = (0 - s) & 63, r1 = (2 - s) & 63, r2 = (4 - s) & 63, r3 = (6 - s) & 63;
      l = _mm512_or_si512(l, _mm512_and_si512(_mm512_rorv_epi64(g, _mm512_setr_epi64(r0, r1, r0, r1, r0, r1, r0, r1)), m));
      h = _mm512_or_si512(h, _mm512_and_si512(_mm512_rorv_epi64(g, _mm512_setr_epi64(r2, r3, r2, r3, r2, r3, r2, r3)), m));
    }
    if constexpr ((BITS & 1) != 0) {  // dword j of a lane: code 4j + b (lo) sits at bit j of byte b
      constexpr int s = BITS & 6;
      const __m512i g = gather_dwords<BITS>(z0, z1, EXL_QIDX(BITS, s, 2));
      const __m512i m = _mm512_set1_epi8(char(1 << s));
      constexpr int a = (0 - s) & 31, b = (1 - s) & 31, c = (2 - s) & 31, d = (3 - s) & 31;
      constexpr int e = (4 - s) & 31, f = (5 - s) & 31, gg = (6 - s) & 31, hh = (7 - s) & 31;
      l = _mm512_or_si512(l, _mm512_and_si512(_mm512_rorv_epi32(g, _mm512_setr_epi32(a, b, c, d, a, b, c, d, a, b, c, d, a, b, c, d)), m));
      h = _mm512_or_si512(h, _mm512_and_si512(_mm512_rorv_epi32(g, _mm512_setr_epi32(e, f, gg, hh, e, f, gg, hh, e, f, gg, hh, e, f, gg, hh)), m));
    }
    lo = l;
    hi = h;
  }
}

// Codes of the quad at p with nb (1..4) blocks; FULL: nb == 4. Reads only the quad's bytes.
template <int BITS, bool FULL>
EXL_INLINE void unpack_quad(const uint8_t* p, int nb, __m512i& lo, __m512i& hi) {
  constexpr int bytes = kQuad * 4 * BITS;
  const int n = FULL ? bytes : nb * 4 * BITS;
  __m512i z0, z1 = _mm512_setzero_si512();
  if (FULL && bytes >= 64)
    z0 = _mm512_loadu_si512(p);
  else
    z0 = _mm512_maskz_loadu_epi8(byte_mask(n), p);
  if constexpr (bytes > 64) {
    if (FULL && bytes == 128)
      z1 = _mm512_loadu_si512(p + 64);
    else
      z1 = _mm512_maskz_loadu_epi8(byte_mask(n - 64), p + 64);
  }
  unpack_raw<BITS>(z0, z1, lo, hi);
}

EXL_INLINE __m512i dot_quad(__m512i lo, __m512i hi, __m512i xlo, __m512i xhi) {
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo), hi, xhi);
}

EXL_INLINE __m512 spread4(__m128 v) {  // lane 4t+i = v[t]
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm512_castps128_ps512(v));
}

// ---------------------------------------------------------------------------------------------
// Per-call preparation: the activation rows in quad order, and what every row tile shares.

struct Prep {
  int quad_start[kMaxSegments + 1];  // first quad of each segment; the last entry is the total
  int64_t quads;
  int M;         // activation rows
  int8_t* x;     // [quads][M][kQuadBytes]: quad q of row m at (q * M + m) * kQuadBytes
  float* gsc;    // [M][gstride]: code centre * ActQ8::gsum per group, row by row
  int64_t gstride;
  // the segments' blocks in runs of 16 (4 quads); run u of segment s (global index run_start[s] + u)
  // spans groups run_g[.] .. and run_idx[.][j] is block j's group counted from there
  int run_start[kMaxSegments + 1];
  int32_t* run_g;
  int32_t* run_idx;
  const float* d;  // the activation steps [M][K / 32]
};

thread_local std::vector<uint8_t> tl_buf;

Prep prepare(const Layer& L, const ActQ8& a, int64_t m0, int M) {
  Prep P;
  P.M = M;
  P.quads = 0;
  for (int s = 0; s < L.segs.count; ++s) {
    P.quad_start[s] = int(P.quads);
    P.quads += (L.segs.seg[s].k_len / kBlock + kQuad - 1) / kQuad;
  }
  P.quad_start[L.segs.count] = int(P.quads);
  P.gstride = (L.n_groups + 15) & ~int64_t(15);
  const size_t xb = size_t(M) * P.quads * kQuadBytes, gb = size_t(M) * P.gstride * 4;
  int runs = 0;
  for (int s = 0; s < L.segs.count; ++s) {
    P.run_start[s] = runs;
    runs += (L.segs.seg[s].k_len / kBlock + 15) / 16;
  }
  P.run_start[L.segs.count] = runs;
  const size_t rb = size_t(runs) * 17 * 4;
  if (tl_buf.size() < xb + gb + rb + 64) tl_buf.resize(xb + gb + rb + 64);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(tl_buf.data()) + 63) & ~uintptr_t(63));
  P.x = reinterpret_cast<int8_t*>(base);
  P.gsc = reinterpret_cast<float*>(base + xb);
  P.run_idx = reinterpret_cast<int32_t*>(base + xb + gb);
  P.run_g = P.run_idx + size_t(runs) * 16;
  P.d = a.d + m0 * (L.K / kBlock);
  for (int s = 0; s < L.segs.count; ++s) {
    const Segment& sg = L.segs.seg[s];
    const int blocks = sg.k_len / kBlock, per = sg.group_size / kBlock;
    for (int u = 0; u * 16 < blocks; ++u) {
      const int r = P.run_start[s] + u, g0 = 16 * u / per;
      P.run_g[r] = g0;
      for (int j = 0; j < 16; ++j) P.run_idx[r * 16 + j] = 16 * u + j < blocks ? (16 * u + j) / per - g0 : 0;
    }
  }
  const __m512i ilo = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), ihi = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
  for (int m = 0; m < M; ++m) {
    const int8_t* xq = a.q + (m0 + m) * L.K;
    int8_t* xa = P.x + m * kQuadBytes;
    for (int s = 0; s < L.segs.count; ++s) {
      const Segment& sg = L.segs.seg[s];
      const int blocks = sg.k_len / kBlock;
      for (int q = 0; q * kQuad < blocks; ++q) {  // a partial last quad is zero-filled
        const int64_t b = sg.k_start / kBlock + kQuad * q;
        const int n = blocks - kQuad * q < kQuad ? blocks - kQuad * q : kQuad;
        const int8_t* src = xq + b * kBlock;
        const __m512i A = _mm512_maskz_loadu_epi8(byte_mask(n * kBlock), src);
        const __m512i B = _mm512_maskz_loadu_epi8(byte_mask(n * kBlock - 64), src + 64);
        const int64_t qi = P.quad_start[s] + q;
        _mm512_store_si512(xa + qi * M * kQuadBytes, _mm512_permutex2var_epi64(A, ilo, B));
        _mm512_store_si512(xa + qi * M * kQuadBytes + 64, _mm512_permutex2var_epi64(A, ihi, B));
      }
    }
    for (int s = 0; s < L.segs.count; ++s) {
      const Segment& sg = L.segs.seg[s];
      const float c = code_offset(sg.bits);
      for (int g = sg.group_start; g < sg.group_start + sg.k_len / sg.group_size; ++g)
        P.gsc[m * P.gstride + g] = c * a.gsum[(m0 + m) * L.n_groups + g];
    }
  }
  return P;
}

// ---------------------------------------------------------------------------------------------
// NR weight rows against MR activation rows (mo .. mo + MR - 1 of the Prep), codes unpacked once
// into registers. The arithmetic of one (weight row, activation row) pair is the same for every NR
// and MR, so a row's result does not depend on the batch (see gemv_q8).

// Per run of 16 blocks, each row's combined block scales (weight scale of the block's group times
// the activation step) are built in one vector (16 fp16 scales converted at once, permuted to the
// blocks), then spread to each quad's lanes by a permute.
// XS: the Prep's row count when known at compile time (a call of at most kRegRows rows), else 0.
template <int BITS, int NR, int MR, int XS>
EXL_INLINE void row_segment(const Layer& L, const Prep& P, int s, int64_t n, int mo, __m512 (&acc)[NR][MR]) {
  const Segment& sg = L.segs.seg[s];
  const int64_t xs = XS ? XS : P.M;
  const int blocks = sg.k_len / kBlock, seg_groups = sg.k_len / sg.group_size;
  const int64_t nbk_all = L.K / kBlock;
  const int8_t* xa = P.x + (int64_t(P.quad_start[s]) * xs + mo) * kQuadBytes;
  const float* dseg = P.d + mo * nbk_all + sg.k_start / kBlock;
  const uint8_t* w[NR];
  const uint16_t* sr[NR];
  for (int r = 0; r < NR; ++r) {
    w[r] = L.qweight + (n + r) * L.row_bytes + sg.byte_start;
    sr[r] = L.qscale + (n + r) * L.n_groups + sg.group_start;
  }
  constexpr int qb = kQuad * 4 * BITS;  // packed bytes of a quad
  const __m512i base = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  for (int u = 0; 16 * u < blocks; ++u) {
    const int run = P.run_start[s] + u, b0 = 16 * u;
    const int nbk = blocks - b0 < 16 ? blocks - b0 : 16;
    const int g0 = P.run_g[run], gc = seg_groups - g0 < 16 ? seg_groups - g0 : 16;
    const __m512i idx = _mm512_load_si512(P.run_idx + int64_t(run) * 16);
    __m512 cs[NR][MR];
    for (int r = 0; r < NR; ++r) {
      const __m512 sw = _mm512_permutexvar_ps(idx, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(__mmask16((1u << gc) - 1), sr[r] + g0)));
      for (int m = 0; m < MR; ++m)
        cs[r][m] = _mm512_mul_ps(sw, _mm512_maskz_loadu_ps(__mmask16((1u << nbk) - 1), dseg + m * nbk_all + b0));
    }
    auto step = [&](int k, int nb, auto full) EXL_INLINE_LAMBDA {
      constexpr bool F = decltype(full)::value;
      const int q = 4 * u + k;
      __m512i xlo[MR], xhi[MR];
      for (int m = 0; m < MR; ++m) {
        xlo[m] = _mm512_load_si512(xa + (q * xs + m) * kQuadBytes);
        xhi[m] = _mm512_load_si512(xa + (q * xs + m) * kQuadBytes + 64);
      }
      const __m512i spread = _mm512_add_epi32(base, _mm512_set1_epi32(4 * k));
      for (int r = 0; r < NR; ++r) {
        __m512i lo, hi;
        unpack_quad<BITS, F>(w[r] + int64_t(q) * qb, nb, lo, hi);
        for (int m = 0; m < MR; ++m)
          acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_quad(lo, hi, xlo[m], xhi[m])),
                                      _mm512_permutexvar_ps(spread, cs[r][m]), acc[r][m]);
      }
    };
    if (nbk == 16) {
      for (int k = 0; k < 4; ++k) step(k, kQuad, std::true_type());
    } else {
      int k = 0;
      for (; 4 * (k + 1) <= nbk; ++k) step(k, kQuad, std::true_type());
      if (4 * k < nbk) step(k, nbk - 4 * k, std::false_type());
    }
  }
}

// sum_g s[g] * gsc[g] over a row's n_groups scales (the grid centre's share), in a vector.
EXL_INLINE __m512 centre_row(const uint16_t* srow, const float* gsc, int64_t n_groups) {
  __m512 c = _mm512_setzero_ps();
  for (int64_t g = 0; g < n_groups; g += 16) {
    const __mmask16 m = n_groups - g >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n_groups - g)) - 1);
    c = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, srow + g)), _mm512_maskz_loadu_ps(m, gsc + g), c);
  }
  return c;
}

template <int NR, int MR, int XS>
void row_tile(const Layer& L, const Prep& P, float* y, int64_t ldy, int64_t n, int mo) {
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int s = 0; s < L.segs.count; ++s) {
    switch (L.segs.seg[s].bits) {
      case 1: row_segment<1, NR, MR, XS>(L, P, s, n, mo, acc); break;
      case 2: row_segment<2, NR, MR, XS>(L, P, s, n, mo, acc); break;
      case 3: row_segment<3, NR, MR, XS>(L, P, s, n, mo, acc); break;
      case 4: row_segment<4, NR, MR, XS>(L, P, s, n, mo, acc); break;
      case 5: row_segment<5, NR, MR, XS>(L, P, s, n, mo, acc); break;
      case 6: row_segment<6, NR, MR, XS>(L, P, s, n, mo, acc); break;
      case 7: row_segment<7, NR, MR, XS>(L, P, s, n, mo, acc); break;
      default: row_segment<8, NR, MR, XS>(L, P, s, n, mo, acc); break;
    }
  }
  for (int r = 0; r < NR; ++r) {
    const uint16_t* srow = L.qscale + (n + r) * L.n_groups;
    for (int m = 0; m < MR; ++m)
      y[(mo + m) * ldy + n + r] =
          _mm512_reduce_add_ps(_mm512_sub_ps(acc[r][m], centre_row(srow, P.gsc + (mo + m) * P.gstride, L.n_groups)));
  }
}

// A call of MR (<= kRegRows) activation rows: weight rows in tiles of NR.
template <int NR, int MR>
void gemv_rows(const Layer& L, const Prep& P, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  v256::prefetch_range(L.qweight + n0 * L.row_bytes,
                       std::min<int64_t>((n1 - n0) * L.row_bytes, v256::kPrefetchBytes));
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    v256::prefetch_rows(L, n, NR, n1);
    row_tile<NR, MR, MR>(L, P, y, ldy, n, 0);
  }
  for (; n < n1; ++n) row_tile<1, MR, MR>(L, P, y, ldy, n, 0);
}

// Activation rows mo .. mo + mr - 1 (mr <= kRegRows) of a larger call against weight rows n .. n + NR - 1.
template <int NR>
EXL_INLINE void row_group(const Layer& L, const Prep& P, float* y, int64_t ldy, int64_t n, int mo, int mr) {
  switch (mr) {
    case 1: row_tile<NR, 1, 0>(L, P, y, ldy, n, mo); break;
    case 2: row_tile<NR, 2, 0>(L, P, y, ldy, n, mo); break;
    case 3: row_tile<NR, 3, 0>(L, P, y, ldy, n, mo); break;
    default: row_tile<NR, 4, 0>(L, P, y, ldy, n, mo); break;
  }
}

// More than kRegRows rows: weight rows in tiles of 2; per tile, the activation rows in groups of up
// to kRegRows (the tile's packed bytes stay in L1 between groups: the weights are read from memory
// once per call, unpacked once per group).
void gemv_rows_many(const Layer& L, const Prep& P, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  v256::prefetch_range(L.qweight + n0 * L.row_bytes,
                       std::min<int64_t>((n1 - n0) * L.row_bytes, v256::kPrefetchBytes));
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    v256::prefetch_rows(L, n, 2, n1);
    for (int mo = 0; mo < P.M; mo += kRegRows) row_group<2>(L, P, y, ldy, n, mo, std::min(kRegRows, P.M - mo));
  }
  for (; n < n1; ++n)
    for (int mo = 0; mo < P.M; mo += kRegRows) row_group<1>(L, P, y, ldy, n, mo, std::min(kRegRows, P.M - mo));
}

// Batch invariance: one summation order for every batch size. Each (weight row, activation row)
// pair is computed by the same register code (row_tile: only the addressing differs between
// NR, MR and XS), so a row's result is bit for bit the same alone or among any others
// (speculative decoding verifies drafts in one batch and so reproduces plain greedy decoding
// exactly).
void gemv_q8(const Layer& L, const ActQ8& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < a.M; m0 += kMaxRows) {
    const int M = int(a.M - m0 < kMaxRows ? a.M - m0 : kMaxRows);
    const Prep P = prepare(L, a, m0, M);
    float* ym = y + m0 * ldy;
    switch (M) {
      case 1: gemv_rows<4, 1>(L, P, ym, ldy, n0, n1); break;
      case 2: gemv_rows<4, 2>(L, P, ym, ldy, n0, n1); break;
      case 3: gemv_rows<2, 3>(L, P, ym, ldy, n0, n1); break;
      case 4: gemv_rows<2, 4>(L, P, ym, ldy, n0, n1); break;
      default: gemv_rows_many(L, P, ym, ldy, n0, n1); break;
    }
  }
}

const Kernels kTable = {"avx512vnni", v256::gemv_f32, gemv_q8, v256::quantize_q8, v256::dequant, v256::fwht};
}  // namespace
const Kernels* avx512vnni_kernels() { return &kTable; }
}  // namespace cpu
}  // namespace exl
#pragma GCC pop_options
#else
namespace exl {
namespace cpu {
const Kernels* avx512vnni_kernels() { return nullptr; }
}  // namespace cpu
}  // namespace exl
#endif
