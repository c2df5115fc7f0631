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
#include <stdlib.h>
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

// Weight scales of a quad per lane: block 4q+t's group scale in lanes 4t..4t+3 (0 past nb blocks).
// PER: blocks per group (1, 2, or 0 for any other count).
template <int PER>
EXL_INLINE __m512 quad_scales(const uint16_t* srow, int per, int q, int nb, bool full) {
  if constexpr (PER == 1) {
    const __m128i h = full ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(srow + 4 * q))
                           : _mm_maskz_loadu_epi16(__mmask8((1 << nb) - 1), srow + 4 * q);
    return spread4(_mm_cvtph_ps(h));
  } else if constexpr (PER == 2) {
    int32_t two;
    if (full) memcpy(&two, srow + 2 * q, 4);
    const __m128i h = full ? _mm_cvtsi32_si128(two)
                           : _mm_maskz_loadu_epi16(__mmask8((1 << ((nb + 1) / 2)) - 1), srow + 2 * q);
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                 _mm512_castps128_ps512(_mm_cvtph_ps(h)));
  } else {
    alignas(16) float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int t = 0; t < nb; ++t) s[t] = _cvtsh_ss(srow[(4 * q + t) / per]);
    return spread4(_mm_load_ps(s));
  }
}

// ---------------------------------------------------------------------------------------------
// Per-call preparation: the activation rows in quad order, with their block steps spread to lanes.

struct Prep {
  int quad_start[kMaxSegments + 1];  // first quad of each segment; the last entry is the total
  int64_t quads;
  int M;
  int8_t* x;    // [quads, padded to 4 when M > 1][M][kQuadBytes]
  // several rows: [quads / 4][M][16], the activation step of block t of quad 4G+j in lane 4t+j
  // (see multi_tile); unused for one row
  float* dq;
  float* gsc;   // 1 row: [n_groups] centre * gsum; several: [n_groups][16] (lane m: row m)
  // one row: the segments' blocks in runs of 16 (4 quads); run u of segment s (global index
  // run_start[s] + u) spans groups run_g[.] .. and run_idx[.][j] is block j's group counted from there
  int run_start[kMaxSegments + 1];
  int32_t* run_g;
  int32_t* run_idx;
  const float* d;  // one row: the activation steps [K / 32]
};

thread_local std::vector<uint8_t> tl_buf;

Prep prepare(const Layer& L, const ActQ8& a, int64_t m0, int M, bool multi) {
  Prep P;
  P.M = M;
  P.quads = 0;
  for (int s = 0; s < L.segs.count; ++s) {
    P.quad_start[s] = int(P.quads);
    P.quads += (L.segs.seg[s].k_len / kBlock + kQuad - 1) / kQuad;
  }
  P.quad_start[L.segs.count] = int(P.quads);
  const bool single = !multi && M == 1;  // the one-row layout (gemv_rows<NR, 1>)
  const int64_t padded = single ? P.quads : (P.quads + kQuad - 1) / kQuad * kQuad;
  const size_t xb = size_t(M) * padded * kQuadBytes, db = single ? 0 : size_t(M) * padded * 16 * 4;
  const size_t gb = (size_t(L.n_groups) * (single ? 1 : 16) * 4 + 63) & ~size_t(63);
  int runs = 0;
  for (int s = 0; s < L.segs.count; ++s) {
    P.run_start[s] = runs;
    runs += (L.segs.seg[s].k_len / kBlock + 15) / 16;
  }
  P.run_start[L.segs.count] = runs;
  const size_t rb = !multi && M <= kRegRows ? size_t(runs) * 17 * 4 : 0;
  if (tl_buf.size() < xb + db + gb + rb + 64) tl_buf.resize(xb + db + gb + rb + 64);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(tl_buf.data()) + 63) & ~uintptr_t(63));
  P.x = reinterpret_cast<int8_t*>(base);
  P.dq = reinterpret_cast<float*>(base + xb);
  P.gsc = reinterpret_cast<float*>(base + xb + db);
  P.run_idx = reinterpret_cast<int32_t*>(base + xb + db + gb);
  P.run_g = P.run_idx + size_t(runs) * 16;
  P.d = a.d + m0 * (L.K / kBlock);
  if (!multi && M <= kRegRows) {
    for (int s = 0; s < L.segs.count; ++s) {
      const Segment& sg = L.segs.seg[s];
      const int blocks = sg.k_len / kBlock, per = sg.group_size / kBlock;
      for (int u = 0; u * 16 < blocks; ++u) {
        const int r = P.run_start[s] + u, g0 = 16 * u / per;
        P.run_g[r] = g0;
        for (int j = 0; j < 16; ++j) P.run_idx[r * 16 + j] = 16 * u + j < blocks ? (16 * u + j) / per - g0 : 0;
      }
    }
  }
  if (!single) memset(P.x, 0, xb + db);  // padding quads and blocks
  const int64_t nb = L.K / kBlock;
  const __m512i ilo = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), ihi = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
  for (int m = 0; m < M; ++m) {
    const int8_t* xq = a.q + (m0 + m) * L.K;
    const float* d = a.d + (m0 + m) * nb;
    int8_t* xa = P.x + m * kQuadBytes;
    float* dq = P.dq + m * 16;
    for (int s = 0; s < L.segs.count; ++s) {
      const Segment& sg = L.segs.seg[s];
      const int blocks = sg.k_len / kBlock;
      for (int q = 0; q * kQuad < blocks; ++q) {
        const int64_t b = sg.k_start / kBlock + kQuad * q;
        const int n = blocks - kQuad * q < kQuad ? blocks - kQuad * q : kQuad;
        const int8_t* src = xq + b * kBlock;
        const __m512i A = _mm512_maskz_loadu_epi8(byte_mask(n * kBlock), src);
        const __m512i B = _mm512_maskz_loadu_epi8(byte_mask(n * kBlock - 64), src + 64);
        const int64_t qi = P.quad_start[s] + q;
        _mm512_store_si512(xa + qi * M * kQuadBytes, _mm512_permutex2var_epi64(A, ilo, B));
        _mm512_store_si512(xa + qi * M * kQuadBytes + 64, _mm512_permutex2var_epi64(A, ihi, B));
        const __m512 dv = spread4(_mm_maskz_loadu_ps(__mmask8((1 << n) - 1), d + b));
        if (!single)
          _mm512_mask_store_ps(dq + (qi / kQuad) * M * 16, __mmask16(0x1111 << (qi % kQuad)), dv);
      }
    }
  }
  for (int s = 0; s < L.segs.count; ++s) {
    const Segment& sg = L.segs.seg[s];
    const float c = code_offset(sg.bits);
    for (int g = sg.group_start; g < sg.group_start + sg.k_len / sg.group_size; ++g) {
      if (single) {
        P.gsc[g] = c * a.gsum[m0 * L.n_groups + g];
      } else {
        for (int m = 0; m < 16; ++m) P.gsc[g * 16 + m] = m < M ? c * a.gsum[(m0 + m) * L.n_groups + g] : 0.0f;
      }
    }
  }
  return P;
}

// ---------------------------------------------------------------------------------------------
// One activation row: NR weight rows at a time share each quad of activations.

// Per run of 16 blocks, each row's combined block scales (weight scale of the block's group times
// the activation step) are built in one vector (16 fp16 scales converted at once, permuted to the
// blocks), then spread to each quad's lanes by a permute.
template <int BITS, int NR, int MR>
EXL_INLINE void row_segment(const Layer& L, const Prep& P, int s, int64_t n, __m512 (&acc)[NR][MR]) {
  const Segment& sg = L.segs.seg[s];
  const int blocks = sg.k_len / kBlock, seg_groups = sg.k_len / sg.group_size;
  const int64_t nbk_all = L.K / kBlock;
  const int8_t* xa = P.x + int64_t(P.quad_start[s]) * MR * kQuadBytes;
  const float* dseg = P.d + sg.k_start / kBlock;
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
        xlo[m] = _mm512_load_si512(xa + (int64_t(q) * MR + m) * kQuadBytes);
        xhi[m] = _mm512_load_si512(xa + (int64_t(q) * MR + m) * kQuadBytes + 64);
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

// Lane m: sum_g s[g] * gsc[g][m], the grid centre's share for activation row m (Prep, M > 1).
EXL_INLINE __m512 centre_rows(const uint16_t* srow, const float* gsc, int64_t n_groups) {
  alignas(64) float sf[16];
  __m512 cen = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < n_groups; g0 += 16) {
    const int64_t cnt = n_groups - g0 < 16 ? n_groups - g0 : 16;
    _mm512_store_ps(sf, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(__mmask16((1u << cnt) - 1), srow + g0)));
    for (int64_t g = 0; g < cnt; ++g) cen = _mm512_fmadd_ps(_mm512_set1_ps(sf[g]), _mm512_load_ps(gsc + (g0 + g) * 16), cen);
  }
  return cen;
}

// NR weight rows against MR (1..kRegRows) activation rows, codes unpacked once into registers.
template <int NR, int MR>
void row_tile(const Layer& L, const Prep& P, float* y, int64_t ldy, int64_t n) {
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int s = 0; s < L.segs.count; ++s) {
    switch (L.segs.seg[s].bits) {
      case 1: row_segment<1, NR, MR>(L, P, s, n, acc); break;
      case 2: row_segment<2, NR, MR>(L, P, s, n, acc); break;
      case 3: row_segment<3, NR, MR>(L, P, s, n, acc); break;
      case 4: row_segment<4, NR, MR>(L, P, s, n, acc); break;
      case 5: row_segment<5, NR, MR>(L, P, s, n, acc); break;
      case 6: row_segment<6, NR, MR>(L, P, s, n, acc); break;
      case 7: row_segment<7, NR, MR>(L, P, s, n, acc); break;
      default: row_segment<8, NR, MR>(L, P, s, n, acc); break;
    }
  }
  for (int r = 0; r < NR; ++r) {
    const uint16_t* srow = L.qscale + (n + r) * L.n_groups;
    if constexpr (MR == 1) {
      y[n + r] = _mm512_reduce_add_ps(_mm512_sub_ps(acc[r][0], centre_row(srow, P.gsc, L.n_groups)));
    } else {
      alignas(64) float cv[16];
      _mm512_store_ps(cv, centre_rows(srow, P.gsc, L.n_groups));
      for (int m = 0; m < MR; ++m) y[m * ldy + n + r] = _mm512_reduce_add_ps(acc[r][m]) - cv[m];
    }
  }
}

template <int NR, int MR>
void gemv_rows(const Layer& L, const Prep& P, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  v256::prefetch_range(L.qweight + n0 * L.row_bytes,
                       std::min<int64_t>((n1 - n0) * L.row_bytes, v256::kPrefetchBytes));
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    v256::prefetch_rows(L, n, NR, n1);
    row_tile<NR, MR>(L, P, y, ldy, n);
  }
  for (; n < n1; ++n) row_tile<1, MR>(L, P, y, ldy, n);
}

// ---------------------------------------------------------------------------------------------
// More activation rows (kRegRows+1 .. 16): each weight row is unpacked once, a chunk of quads at a time,
// into an L1 buffer of codes (quad order) and per-lane weight scales; every activation row is
// then dotted against it (tiles of up to 8 rows, one accumulator each).
constexpr int kChunkQuads = 64;

template <int BITS>
void unpack_chunk(const uint8_t* w, const uint16_t* srow, int per, int q0, int nq, int blocks, uint8_t* codes,
                  float* sc) {
  constexpr int qb = kQuad * 4 * BITS;
  const int qpg = per % kQuad == 0 ? per / kQuad : 0;  // quads per group, when groups are whole quads
  for (int i = 0; i < nq; ++i) {
    const int q = q0 + i;
    const int nb = blocks - kQuad * q < kQuad ? blocks - kQuad * q : kQuad;
    __m512i lo, hi;
    __m512 s;
    if (nb == kQuad) {
      unpack_quad<BITS, true>(w + int64_t(q) * qb, kQuad, lo, hi);
      if (per == 1)
        s = quad_scales<1>(srow, per, q, kQuad, true);
      else if (per == 2)
        s = quad_scales<2>(srow, per, q, kQuad, true);
      else if (qpg)
        s = _mm512_set1_ps(_cvtsh_ss(srow[qpg == 1 ? q : q / qpg]));
      else
        s = quad_scales<0>(srow, per, q, kQuad, true);
    } else {  // a segment's partial last quad (never with groups of whole quads)
      unpack_quad<BITS, false>(w + int64_t(q) * qb, nb, lo, hi);
      if (per == 1)
        s = quad_scales<1>(srow, per, q, nb, false);
      else if (per == 2)
        s = quad_scales<2>(srow, per, q, nb, false);
      else
        s = quad_scales<0>(srow, per, q, nb, false);
    }
    _mm512_store_si512(codes + i * 128, lo);
    _mm512_store_si512(codes + i * 128 + 64, hi);
    _mm512_store_ps(sc + i * 16, s);
  }
}

// Four quads (4G .. 4G+3) at a time: their dot products are first summed within each block (a
// transposing add of i32 lanes), so that one conversion and one FMA serve 16 blocks; lane 4t+j
// then holds block t of quad 4G+j. xa, dq: the tile's first row at the chunk's first quad (Prep
// layout, M rows per quad); codes, sc: the chunk's unpacked quads (sc spread as by quad_scales).
template <int MR>
EXL_INLINE void multi_tile(const uint8_t* codes, const float* sc, const int8_t* xa, const float* dq, int M, int groups,
                           float* accp) {
  __m512 a[MR];
  for (int m = 0; m < MR; ++m) a[m] = _mm512_load_ps(accp + 16 * m);
  for (int G = 0; G < groups; ++G) {
    __m512i lo[kQuad], hi[kQuad];
    for (int j = 0; j < kQuad; ++j) {
      lo[j] = _mm512_load_si512(codes + (kQuad * G + j) * 128);
      hi[j] = _mm512_load_si512(codes + (kQuad * G + j) * 128 + 64);
    }
    const float* sg = sc + kQuad * G * 16;
    const __m512 s = _mm512_mask_blend_ps(
        0x8888, _mm512_mask_blend_ps(0x4444, _mm512_mask_blend_ps(0x2222, _mm512_load_ps(sg), _mm512_load_ps(sg + 16)), _mm512_load_ps(sg + 32)),
        _mm512_load_ps(sg + 48));
    const int8_t* x = xa + int64_t(G) * kQuad * M * kQuadBytes;
    const float* d = dq + int64_t(G) * M * 16;
    for (int m = 0; m < MR; ++m) {
      __m512i D[kQuad];
      for (int j = 0; j < kQuad; ++j) {
        const int8_t* xj = x + (int64_t(j) * M + m) * kQuadBytes;
        D[j] = dot_quad(lo[j], hi[j], _mm512_load_si512(xj), _mm512_load_si512(xj + 64));
      }
      const __m512i A = _mm512_add_epi32(_mm512_unpacklo_epi32(D[0], D[1]), _mm512_unpackhi_epi32(D[0], D[1]));
      const __m512i B = _mm512_add_epi32(_mm512_unpacklo_epi32(D[2], D[3]), _mm512_unpackhi_epi32(D[2], D[3]));
      const __m512i C = _mm512_add_epi32(_mm512_unpacklo_epi64(A, B), _mm512_unpackhi_epi64(A, B));
      a[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(C), _mm512_mul_ps(_mm512_load_ps(d + m * 16), s), a[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_store_ps(accp + 16 * m, a[m]);
}

// The last quads of a chunk (quad j = 0..left-1 of group G) one at a time: per-lane partial sums,
// the quad's block steps spread from the transposed layout.
template <int MR>
EXL_INLINE void multi_tail(const uint8_t* codes, const float* sc, const int8_t* xa, const float* dq, int M, int G,
                           int left, float* accp) {
  __m512 a[MR];
  for (int m = 0; m < MR; ++m) a[m] = _mm512_load_ps(accp + 16 * m);
  for (int j = 0; j < left; ++j) {
    const int q = kQuad * G + j;
    const __m512i lo = _mm512_load_si512(codes + q * 128), hi = _mm512_load_si512(codes + q * 128 + 64);
    const __m512 s = _mm512_load_ps(sc + q * 16);
    const __m512i pick = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12), _mm512_set1_epi32(j));
    for (int m = 0; m < MR; ++m) {
      const int8_t* x = xa + (int64_t(q) * M + m) * kQuadBytes;
      const __m512 d = _mm512_permutexvar_ps(pick, _mm512_load_ps(dq + (int64_t(G) * M + m) * 16));
      a[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_quad(lo, hi, _mm512_load_si512(x), _mm512_load_si512(x + 64))),
                             _mm512_mul_ps(d, s), a[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_store_ps(accp + 16 * m, a[m]);
}

// Lane m of the result: the sum of the 16 lanes of v[m] (a transposing add tree).
EXL_INLINE __m512 sum_lanes16(const __m512 (&v)[16]) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sum of rows 4i .. 4i+3
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[2 * i]), _mm512_castps_pd(t[2 * i + 1]))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[2 * i]), _mm512_castps_pd(t[2 * i + 1]))));
  const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
  const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xdd));
}

// Unpack quads [c0, c0 + cq) of weight row n (quads counted across segments, as in Prep).
void unpack_quads(const Layer& L, const Prep& P, int64_t n, int c0, int cq, uint8_t* codes, float* sc) {
  for (int s = 0; s < L.segs.count; ++s) {
    const int lo = P.quad_start[s] > c0 ? P.quad_start[s] : c0;
    const int hi = P.quad_start[s + 1] < c0 + cq ? P.quad_start[s + 1] : c0 + cq;
    if (lo >= hi) continue;
    const Segment& sg = L.segs.seg[s];
    const uint8_t* w = L.qweight + n * L.row_bytes + sg.byte_start;
    const uint16_t* srow = L.qscale + n * L.n_groups + sg.group_start;
    const int blocks = sg.k_len / kBlock, per = sg.group_size / kBlock, q0 = lo - P.quad_start[s];
    uint8_t* c = codes + (lo - c0) * 128;
    float* f = sc + (lo - c0) * 16;
    switch (sg.bits) {
      case 1: unpack_chunk<1>(w, srow, per, q0, hi - lo, blocks, c, f); break;
      case 2: unpack_chunk<2>(w, srow, per, q0, hi - lo, blocks, c, f); break;
      case 3: unpack_chunk<3>(w, srow, per, q0, hi - lo, blocks, c, f); break;
      case 4: unpack_chunk<4>(w, srow, per, q0, hi - lo, blocks, c, f); break;
      case 5: unpack_chunk<5>(w, srow, per, q0, hi - lo, blocks, c, f); break;
      case 6: unpack_chunk<6>(w, srow, per, q0, hi - lo, blocks, c, f); break;
      case 7: unpack_chunk<7>(w, srow, per, q0, hi - lo, blocks, c, f); break;
      default: unpack_chunk<8>(w, srow, per, q0, hi - lo, blocks, c, f); break;
    }
  }
}

void gemv_multi(const Layer& L, const Prep& P, float* y, int64_t ldy, int64_t n0, int64_t n1, int64_t m0, int M) {
  alignas(64) uint8_t codes[kChunkQuads * 128];
  alignas(64) float sc[kChunkQuads * 16];
  alignas(64) float acc[kMaxRows * 16];
  alignas(64) float sf[16];
  alignas(64) float out[16];
  for (int64_t n = n0; n < n1; ++n) {
    v256::prefetch_rows(L, n, 1, n1);
    for (int m = 0; m < M; ++m) _mm512_store_ps(acc + 16 * m, _mm512_setzero_ps());
    for (int c0 = 0; c0 < P.quads; c0 += kChunkQuads) {
      const int nq = P.quads - c0 < kChunkQuads ? int(P.quads - c0) : kChunkQuads;
      unpack_quads(L, P, n, c0, nq, codes, sc);
      const int groups = nq / kQuad, left = nq % kQuad;  // chunks start at multiples of 4 quads
      for (int mt = 0; mt < M; mt += 8) {
        const int8_t* xa = P.x + (int64_t(c0) * M + mt) * kQuadBytes;
        const float* dq = P.dq + (int64_t(c0 / kQuad) * M + mt) * 16;
        float* ap = acc + mt * 16;
        switch (M - mt < 8 ? M - mt : 8) {
          case 8: multi_tile<8>(codes, sc, xa, dq, M, groups, ap); break;
          case 7: multi_tile<7>(codes, sc, xa, dq, M, groups, ap); break;
          case 6: multi_tile<6>(codes, sc, xa, dq, M, groups, ap); break;
          case 5: multi_tile<5>(codes, sc, xa, dq, M, groups, ap); break;
          case 4: multi_tile<4>(codes, sc, xa, dq, M, groups, ap); break;
          case 3: multi_tile<3>(codes, sc, xa, dq, M, groups, ap); break;
          case 2: multi_tile<2>(codes, sc, xa, dq, M, groups, ap); break;
          default: multi_tile<1>(codes, sc, xa, dq, M, groups, ap); break;
        }
        if (left) {
          switch (M - mt < 8 ? M - mt : 8) {
            case 8: multi_tail<8>(codes, sc, xa, dq, M, groups, left, ap); break;
            case 7: multi_tail<7>(codes, sc, xa, dq, M, groups, left, ap); break;
            case 6: multi_tail<6>(codes, sc, xa, dq, M, groups, left, ap); break;
            case 5: multi_tail<5>(codes, sc, xa, dq, M, groups, left, ap); break;
            case 4: multi_tail<4>(codes, sc, xa, dq, M, groups, left, ap); break;
            case 3: multi_tail<3>(codes, sc, xa, dq, M, groups, left, ap); break;
            case 2: multi_tail<2>(codes, sc, xa, dq, M, groups, left, ap); break;
            default: multi_tail<1>(codes, sc, xa, dq, M, groups, left, ap); break;
          }
        }
      }
    }
    // the grid centre's share for all rows at once: lane m of sum_g s[g] * gsc[g][m]
    __m512 cen = _mm512_setzero_ps();
    const uint16_t* srow = L.qscale + n * L.n_groups;
    for (int64_t g0 = 0; g0 < L.n_groups; g0 += 16) {
      const int64_t cnt = L.n_groups - g0 < 16 ? L.n_groups - g0 : 16;
      _mm512_store_ps(sf, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(__mmask16((1u << cnt) - 1), srow + g0)));
      for (int64_t g = 0; g < cnt; ++g) cen = _mm512_fmadd_ps(_mm512_set1_ps(sf[g]), _mm512_load_ps(P.gsc + (g0 + g) * 16), cen);
    }
    __m512 v[16];
    for (int m = 0; m < 16; ++m) v[m] = m < M ? _mm512_load_ps(acc + 16 * m) : _mm512_setzero_ps();
    _mm512_store_ps(out, _mm512_sub_ps(sum_lanes16(v), cen));
    for (int m = 0; m < M; ++m) y[(m0 + m) * ldy + n] = out[m];
  }
}

// Batch invariance (EXL_CPU_BATCH_INVARIANT=1): every batch size takes gemv_multi, whose arithmetic
// for one activation row does not depend on the other rows, so a row's result is bit for bit the
// same alone or among 16 (speculative decoding, which verifies drafts in one batch, then reproduces
// plain greedy decoding exactly). Off by default: 1-4 rows take the register paths, which decode
// about 1.5x faster and differ from gemv_multi by ~1e-6 relative.
bool batch_invariant() {
  static const bool on = [] {
    const char* e = getenv("EXL_CPU_BATCH_INVARIANT");
    return e && strcmp(e, "1") == 0;
  }();
  return on;
}

void gemv_q8(const Layer& L, const ActQ8& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  const bool invariant = batch_invariant();
  for (int64_t m0 = 0; m0 < a.M; m0 += kMaxRows) {
    const int M = int(a.M - m0 < kMaxRows ? a.M - m0 : kMaxRows);
    const bool multi = invariant || M > kRegRows;
    const Prep P = prepare(L, a, m0, M, multi);
    float* ym = y + m0 * ldy;
    switch (multi ? 0 : M) {
      case 1: gemv_rows<4, 1>(L, P, ym, ldy, n0, n1); break;
      case 2: gemv_rows<4, 2>(L, P, ym, ldy, n0, n1); break;
      case 3: gemv_rows<2, 3>(L, P, ym, ldy, n0, n1); break;
      case 4: gemv_rows<2, 4>(L, P, ym, ldy, n0, n1); break;
      default: gemv_multi(L, P, y, ldy, n0, n1, m0, M); break;  // 5-16 rows, or batch-invariant mode
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
