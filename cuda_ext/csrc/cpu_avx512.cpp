// AVX-512 (F/BW/VL/DQ) + AVX512-VNNI kernels; selected at run time when the CPU has them.
//
// The int8-activation GEMV is written here for 512-bit vectors; the other kernels are
// cpu_simd.inc's (256-bit) compiled for this target.
//
// Quad order: the GEMV works on 4 consecutive blocks of a segment at a time (a "quad"; a
// segment's last quad may be partial). For a quad, a 512-bit vector holds, in 128-bit lane t,
// codes 0-15 of block t ("lo") and a second one codes 16-31 ("hi"); the activations are
// rearranged once per call into the same order, so two vpdpbusd give, in i32 lanes 4t..4t+3, four
// partial sums of block t's exact dot product. Quads are taken in runs of 4 (16 blocks), whose
// block dot products are summed in int32 before one conversion and one FMA with the blocks'
// combined scales (the summation order, below, is the same for every number of activation rows);
// the grid centre is folded in per group through ActQ8::gsum (see cpu_simd.inc).
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

// ---------------------------------------------------------------------------------------------
// The summation order (one for every number of activation rows: batch invariance).
//
// A segment's blocks are taken in runs of 16 (4 quads) from its first block; a run's last quad may
// be partial. Per (weight row, activation row) pair the result is accumulated in one 16-lane fp32
// vector `acc`:
//   - a run of 4 quads adds its 16 blocks at once: acc = fma(float(dots), sw * d, acc), where
//     lane 4t+q of dots is the exact int32 dot product of the run's block 4q+t ("run lanes"),
//     sw the block's weight scale and d its activation step (0 past the segment's end);
//   - a run of 1-3 quads (a segment's tail) adds quad by quad: acc = fma(float(D), cs, acc), where
//     D holds the quad's four int32 partial sums per block (dot_quad) and cs = sw * d of each
//     lane's block;
//   - after the last segment: y = (sum of the 16 lanes of acc - the grid centre's share).
// Only these fp32 steps fix the bits. The int32 dot products are exact (|dot| < 2^24, so even the
// conversion is exact), so the paths may compute them any way: one activation row sums the quads'
// partial sums in int32 (sum_quads); several rows share the run's codes, unpacked and transposed
// once into run lanes, and take 8 vpdpbusd per row (unpack_run).

// Block of a run in run lane l (l = 4t + q: quad q, 128-bit lane t).
constexpr int run_block(int lane) { return 4 * (lane % 4) + lane / 4; }

// out[i], lane 4t+q = in[q], lane 4t+i (a 4x4 transpose of the dwords of each 128-bit lane).
EXL_INLINE void transpose4(const __m512i (&in)[4], __m512i* out) {
  const __m512i t0 = _mm512_unpacklo_epi32(in[0], in[1]), t1 = _mm512_unpackhi_epi32(in[0], in[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(in[2], in[3]), t3 = _mm512_unpackhi_epi32(in[2], in[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

// The run's block dot products in run lanes from the four quads' partial sums (dot_quad): lane
// 4t+q = the sum of D[q]'s lanes 4t..4t+3.
EXL_INLINE __m512i sum_quads(const __m512i (&D)[4]) {
  const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(D[0], D[1]), _mm512_unpackhi_epi32(D[0], D[1]));
  const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(D[2], D[3]), _mm512_unpackhi_epi32(D[2], D[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}

// The two fp32 steps of the order above, shared by every path.
EXL_INLINE __m512 add_run(__m512 acc, __m512i dots, __m512 cs) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), cs, acc);
}
EXL_INLINE __m512 add_quad(__m512 acc, __m512i D, __m512 cs, int q) {  // cs in run lanes, spread to quad q's
  const __m512i spread = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12), _mm512_set1_epi32(q));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(D), _mm512_permutexvar_ps(spread, cs), acc);
}

// A run's codes in run lanes, for several activation rows: C[i] (i < 4), lane 4t+q = dword i of
// lo of quad q, lane t; C[4 + i] the same of hi. With the activations in the same order,
// sum_i vpdpbusd(C[i], X[i]) is the run's block dot products in run lanes. nb: blocks of the last quad.
template <int BITS, bool FULL>
EXL_INLINE void unpack_run(const uint8_t* p, int nb, __m512i (&C)[8]) {
  constexpr int qb = kQuad * 4 * BITS;
  if constexpr (BITS == 4) {  // transpose the packed bytes (nibble planes per dword), then split nibbles
    const __m512i z[4] = {_mm512_loadu_si512(p), _mm512_loadu_si512(p + 64), _mm512_loadu_si512(p + 128),
                          FULL ? _mm512_loadu_si512(p + 192) : _mm512_maskz_loadu_epi8(byte_mask(nb * 16), p + 192)};
    __m512i w[4];
    transpose4(z, w);
    const __m512i m = _mm512_set1_epi8(0x0f);
    for (int i = 0; i < 4; ++i) {
      C[i] = _mm512_and_si512(w[i], m);
      C[4 + i] = _mm512_and_si512(_mm512_srli_epi16(w[i], 4), m);
    }
  } else {
    __m512i lo[4], hi[4];
    for (int q = 0; q < 3; ++q) unpack_quad<BITS, true>(p + q * qb, kQuad, lo[q], hi[q]);
    unpack_quad<BITS, FULL>(p + 3 * qb, nb, lo[3], hi[3]);
    transpose4(lo, C);
    transpose4(hi, C + 4);
  }
}

// ---------------------------------------------------------------------------------------------
// Per-call preparation: the activation rows in the kernels' order, and what every row tile shares.

struct Prep {
  int quad_start[kMaxSegments + 1];  // first quad of each segment; the last entry is the total
  int run_start[kMaxSegments + 1];   // first run of each segment (global run index); the last: total
  int64_t quads, runs;
  int M;          // activation rows
  bool run_lanes;  // several rows: the activations of runs of 4 quads in run lanes (8 x 64 bytes)
  int8_t* x;      // [M][quads * kQuadBytes]: quad q of row m at (m * quads + q) * kQuadBytes, quad order
                  // (codes 0-15 of block t in lane t, then 16-31), or per run of 4 quads transposed
                  // as by unpack_run when run_lanes
  float* dl;      // [M][runs * 16]: the activation steps in run lanes, 0 past a segment's end
  float* gsc;     // [M][gstride]: code centre * ActQ8::gsum per group, row by row (zero-padded)
  int64_t gstride;
  float* sf;      // [gstride]: scratch for one weight row's scales in fp32
  // run r spans groups run_g[r] ..; run_idx[r][l] is the group of the block in run lane l counted from there
  int32_t* run_g;
  int32_t* run_idx;
};

thread_local std::vector<uint8_t> tl_buf;

Prep prepare(const Layer& L, const ActQ8& a, int64_t m0, int M, bool run_lanes) {
  Prep P;
  P.M = M;
  P.run_lanes = run_lanes;
  P.quads = P.runs = 0;
  for (int s = 0; s < L.segs.count; ++s) {
    P.quad_start[s] = int(P.quads);
    P.run_start[s] = int(P.runs);
    P.quads += (L.segs.seg[s].k_len / kBlock + kQuad - 1) / kQuad;
    P.runs += (L.segs.seg[s].k_len / kBlock + 15) / 16;
  }
  P.quad_start[L.segs.count] = int(P.quads);
  P.gstride = (L.n_groups + 15) & ~int64_t(15);
  P.run_start[L.segs.count] = int(P.runs);
  const size_t xb = size_t(M) * P.quads * kQuadBytes, db = size_t(M) * P.runs * 16 * 4,
               gb = size_t(M + 1) * P.gstride * 4, rb = size_t(P.runs) * 17 * 4;
  if (tl_buf.size() < xb + db + gb + rb + 64) tl_buf.resize(xb + db + gb + rb + 64);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(tl_buf.data()) + 63) & ~uintptr_t(63));
  P.x = reinterpret_cast<int8_t*>(base);
  P.dl = reinterpret_cast<float*>(base + xb);
  P.gsc = reinterpret_cast<float*>(base + xb + db);
  P.sf = P.gsc + size_t(M) * P.gstride;
  for (int64_t i = 0; i < (M + 1) * P.gstride; ++i) P.gsc[i] = 0.0f;  // the padding (and sf's) stays 0
  P.run_idx = reinterpret_cast<int32_t*>(base + xb + db + gb);
  P.run_g = P.run_idx + size_t(P.runs) * 16;
  for (int s = 0; s < L.segs.count; ++s) {
    const Segment& sg = L.segs.seg[s];
    const int blocks = sg.k_len / kBlock, per = sg.group_size / kBlock;
    for (int u = 0; u * 16 < blocks; ++u) {
      const int r = P.run_start[s] + u, g0 = 16 * u / per;
      P.run_g[r] = g0;
      for (int l = 0; l < 16; ++l) {
        const int b = 16 * u + run_block(l);
        P.run_idx[r * 16 + l] = b < blocks ? b / per - g0 : 0;
      }
    }
  }
  const int64_t nbk = L.K / kBlock;
  const __m512i ilo = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), ihi = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
  for (int m = 0; m < M; ++m) {
    const int8_t* xq = a.q + (m0 + m) * L.K;
    const float* d = a.d + (m0 + m) * nbk;
    int8_t* xa = P.x + m * P.quads * kQuadBytes;
    float* dl = P.dl + m * P.runs * 16;
    for (int s = 0; s < L.segs.count; ++s) {
      const Segment& sg = L.segs.seg[s];
      const int blocks = sg.k_len / kBlock;
      for (int q = 0; q * kQuad < blocks; ++q) {  // a partial last quad is zero-filled
        const int64_t b = sg.k_start / kBlock + kQuad * q;
        const int n = blocks - kQuad * q < kQuad ? blocks - kQuad * q : kQuad;
        const int8_t* src = xq + b * kBlock;
        const __m512i A = _mm512_maskz_loadu_epi8(byte_mask(n * kBlock), src);
        const __m512i B = _mm512_maskz_loadu_epi8(byte_mask(n * kBlock - 64), src + 64);
        int8_t* dst = xa + (P.quad_start[s] + q) * kQuadBytes;
        _mm512_store_si512(dst, _mm512_permutex2var_epi64(A, ilo, B));
        _mm512_store_si512(dst + 64, _mm512_permutex2var_epi64(A, ihi, B));
      }
      for (int u = 0; u * 16 < blocks; ++u) {
        if (run_lanes && blocks - 16 * u > 12) {  // a run of 4 quads: into run lanes, as unpack_run
          int8_t* r = xa + (P.quad_start[s] + 4 * u) * kQuadBytes;
          __m512i lo[4], hi[4], t[8];
          for (int q = 0; q < 4; ++q) {
            lo[q] = _mm512_load_si512(r + q * kQuadBytes);
            hi[q] = _mm512_load_si512(r + q * kQuadBytes + 64);
          }
          transpose4(lo, t);
          transpose4(hi, t + 4);
          for (int i = 0; i < 8; ++i) _mm512_store_si512(r + 64 * i, t[i]);
        }
        for (int l = 0; l < 16; ++l) {
          const int b = 16 * u + run_block(l);
          dl[(P.run_start[s] + u) * 16 + l] = b < blocks ? d[sg.k_start / kBlock + b] : 0.0f;
        }
      }
      const float c = code_offset(sg.bits);
      for (int g = sg.group_start; g < sg.group_start + sg.k_len / sg.group_size; ++g)
        P.gsc[m * P.gstride + g] = c * a.gsum[(m0 + m) * L.n_groups + g];
    }
  }
  return P;
}

// The weight scales of run `run` in run lanes (sr: the row's scales from the segment's first group).
EXL_INLINE __m512 run_scales(const Prep& P, const uint16_t* sr, int run, int seg_groups) {
  const int g0 = P.run_g[run], gc = seg_groups - g0 < 16 ? seg_groups - g0 : 16;
  const __m512i idx = _mm512_load_si512(P.run_idx + int64_t(run) * 16);
  return _mm512_permutexvar_ps(idx, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(__mmask16((1u << gc) - 1), sr + g0)));
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

// The end of the order: y = the sum of the 16 lanes of (acc - centre_row), added in pairs (l, l+2),
// then ((l, l+2), (l+1, l+3)) within each 128-bit lane, then 128-bit lanes (0, 1) and (2, 3), then
// those two. finish_one does it for one row, finish_rows for 16 at once (rows in lanes: a
// transposing add tree with the same pairs; IEEE addition is commutative).
EXL_INLINE float sum_lanes(__m512 a) {
  const __m512 w = _mm512_add_ps(a, _mm512_permute_ps(a, 0x4e));       // lanes l, l+2
  const __m512 z = _mm512_add_ps(w, _mm512_permute_ps(w, 0xb1));       // + lanes l+1, l+3
  const __m512 u = _mm512_add_ps(z, _mm512_shuffle_f32x4(z, z, 0xb1));  // 128-bit lanes 0+1, 2+3
  return _mm512_cvtss_f32(_mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, 0x4e)));  // (0+1) + (2+3)
}

EXL_INLINE float finish_one(const Layer& L, const Prep& P, __m512 acc, int64_t n) {
  return sum_lanes(_mm512_sub_ps(acc, centre_row(L.qscale + n * L.n_groups, P.gsc, L.n_groups)));
}

// Lane m: the sum of the 16 lanes of v[m], added as finish_one adds them.
EXL_INLINE __m512 sum_lanes16(const __m512 (&v)[16]) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sum for rows 4i .. 4i+3
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[2 * i]), _mm512_castps_pd(t[2 * i + 1]))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[2 * i]), _mm512_castps_pd(t[2 * i + 1]))));
  const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
  const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xdd));
}

// Rows 0 .. P.M - 1 against weight row n: y[m * ldy] = finish_one of acc[m] (the row's scales
// converted once; from 8 rows on, the lanes of all rows summed by one transposing tree).
EXL_INLINE void finish_rows(const Layer& L, const Prep& P, const __m512* acc, int64_t n, float* y, int64_t ldy) {
  const uint16_t* sr = L.qscale + n * L.n_groups;
  for (int64_t g = 0; g < L.n_groups; g += 16) {
    const __mmask16 k = L.n_groups - g >= 16 ? __mmask16(0xffff) : __mmask16((1u << (L.n_groups - g)) - 1);
    _mm512_store_ps(P.sf + g, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, sr + g)));
  }
  __m512 v[16];
  for (int m = 0; m < P.M; ++m) {  // acc - centre_row, with the scales already in fp32
    __m512 c = _mm512_setzero_ps();
    const float* gsc = P.gsc + m * P.gstride;
    for (int64_t g = 0; g < L.n_groups; g += 16)
      c = _mm512_fmadd_ps(_mm512_load_ps(P.sf + g), _mm512_load_ps(gsc + g), c);  // both zero-padded
    v[m] = _mm512_sub_ps(acc[m], c);
  }
  if (P.M < 8) {
    for (int m = 0; m < P.M; ++m) y[m * ldy] = sum_lanes(v[m]);
    return;
  }
  for (int m = P.M; m < 16; ++m) v[m] = _mm512_setzero_ps();
  alignas(64) float out[16];
  _mm512_store_ps(out, sum_lanes16(v));
  for (int m = 0; m < P.M; ++m) y[m * ldy] = out[m];
}

// ---------------------------------------------------------------------------------------------
// One activation row: NR weight rows in registers, each quad unpacked and dotted as it comes.

template <int BITS, int NR>
EXL_INLINE void one_row_segment(const Layer& L, const Prep& P, int s, int64_t n, __m512 (&acc)[NR]) {
  const Segment& sg = L.segs.seg[s];
  const int blocks = sg.k_len / kBlock, seg_groups = sg.k_len / sg.group_size;
  const int8_t* xa = P.x + int64_t(P.quad_start[s]) * kQuadBytes;
  const uint8_t* w[NR];
  const uint16_t* sr[NR];
  for (int r = 0; r < NR; ++r) {
    w[r] = L.qweight + (n + r) * L.row_bytes + sg.byte_start;
    sr[r] = L.qscale + (n + r) * L.n_groups + sg.group_start;
  }
  constexpr int qb = kQuad * 4 * BITS;  // packed bytes of a quad
  for (int u = 0; 16 * u < blocks; ++u) {
    const int run = P.run_start[s] + u, nbk = blocks - 16 * u < 16 ? blocks - 16 * u : 16;
    const __m512 dl = _mm512_load_ps(P.dl + int64_t(run) * 16);
    __m512 cs[NR];
    for (int r = 0; r < NR; ++r) cs[r] = _mm512_mul_ps(run_scales(P, sr[r], run, seg_groups), dl);
    // the partial sums of quad 4u + k for every weight row
    auto quad = [&](int k, int nb, auto full, __m512i (&D)[NR]) EXL_INLINE_LAMBDA {
      const int q = 4 * u + k;
      const __m512i xlo = _mm512_load_si512(xa + q * kQuadBytes), xhi = _mm512_load_si512(xa + q * kQuadBytes + 64);
      for (int r = 0; r < NR; ++r) {
        __m512i lo, hi;
        unpack_quad<BITS, decltype(full)::value>(w[r] + int64_t(q) * qb, nb, lo, hi);
        D[r] = dot_quad(lo, hi, xlo, xhi);
      }
    };
    if (nbk > 12) {  // a run of 4 quads: its block dot products summed in int32, one fp32 step
      __m512i D[4][NR];
      for (int k = 0; k < 3; ++k) quad(k, kQuad, std::true_type(), D[k]);
      if (nbk == 16)
        quad(3, kQuad, std::true_type(), D[3]);
      else
        quad(3, nbk - 12, std::false_type(), D[3]);
      for (int r = 0; r < NR; ++r) acc[r] = add_run(acc[r], sum_quads({D[0][r], D[1][r], D[2][r], D[3][r]}), cs[r]);
    } else {  // a segment's tail of 1-3 quads: one fp32 step per quad
      for (int k = 0; 4 * k < nbk; ++k) {
        __m512i D[NR];
        if (4 * k + 4 <= nbk)
          quad(k, kQuad, std::true_type(), D);
        else
          quad(k, nbk - 4 * k, std::false_type(), D);
        for (int r = 0; r < NR; ++r) acc[r] = add_quad(acc[r], D[r], cs[r], k);
      }
    }
  }
}

template <int NR>
void one_row_tile(const Layer& L, const Prep& P, float* y, int64_t n) {
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int s = 0; s < L.segs.count; ++s) {
    switch (L.segs.seg[s].bits) {
      case 1: one_row_segment<1, NR>(L, P, s, n, acc); break;
      case 2: one_row_segment<2, NR>(L, P, s, n, acc); break;
      case 3: one_row_segment<3, NR>(L, P, s, n, acc); break;
      case 4: one_row_segment<4, NR>(L, P, s, n, acc); break;
      case 5: one_row_segment<5, NR>(L, P, s, n, acc); break;
      case 6: one_row_segment<6, NR>(L, P, s, n, acc); break;
      case 7: one_row_segment<7, NR>(L, P, s, n, acc); break;
      default: one_row_segment<8, NR>(L, P, s, n, acc); break;
    }
  }
  for (int r = 0; r < NR; ++r) y[n + r] = finish_one(L, P, acc[r], n + r);
}

void gemv_one_row(const Layer& L, const Prep& P, float* y, int64_t n0, int64_t n1) {
  v256::prefetch_range(L.qweight + n0 * L.row_bytes, std::min<int64_t>((n1 - n0) * L.row_bytes, v256::kPrefetchBytes));
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    v256::prefetch_rows(L, n, 4, n1);
    one_row_tile<4>(L, P, y, n);
  }
  for (; n < n1; ++n) one_row_tile<1>(L, P, y, n);
}

// ---------------------------------------------------------------------------------------------
// Several activation rows (2 .. kMaxRows): per tile of NR weight rows and per run, the codes are
// unpacked once (into run lanes, or per tail quad) and every activation row is dotted against them;
// the rows' accumulators live in L1 (acc[r][m]).

template <int BITS, int NR>
EXL_INLINE void many_rows_segment(const Layer& L, const Prep& P, int s, int64_t n, __m512 (*acc)[kMaxRows]) {
  const Segment& sg = L.segs.seg[s];
  const int blocks = sg.k_len / kBlock, seg_groups = sg.k_len / sg.group_size;
  const int M = P.M;
  const int64_t xrow = P.quads * kQuadBytes, drow = P.runs * 16;
  const int8_t* xa = P.x + int64_t(P.quad_start[s]) * kQuadBytes;
  const uint8_t* w[NR];
  const uint16_t* sr[NR];
  for (int r = 0; r < NR; ++r) {
    w[r] = L.qweight + (n + r) * L.row_bytes + sg.byte_start;
    sr[r] = L.qscale + (n + r) * L.n_groups + sg.group_start;
  }
  constexpr int qb = kQuad * 4 * BITS;
  for (int u = 0; 16 * u < blocks; ++u) {
    const int run = P.run_start[s] + u, nbk = blocks - 16 * u < 16 ? blocks - 16 * u : 16;
    __m512 sw[NR];
    for (int r = 0; r < NR; ++r) sw[r] = run_scales(P, sr[r], run, seg_groups);
    if (nbk > 12) {
      __m512i C[NR][8];
      for (int r = 0; r < NR; ++r) {
        if (nbk == 16)
          unpack_run<BITS, true>(w[r] + int64_t(4 * u) * qb, kQuad, C[r]);
        else
          unpack_run<BITS, false>(w[r] + int64_t(4 * u) * qb, nbk - 12, C[r]);
      }
      for (int m = 0; m < M; ++m) {
        const int8_t* x = xa + m * xrow + int64_t(4 * u) * kQuadBytes;
        const __m512 dl = _mm512_load_ps(P.dl + m * drow + int64_t(run) * 16);
        __m512i e[NR], o[NR];  // two chains of vpdpbusd per weight row (int32: their sum is exact)
        for (int r = 0; r < NR; ++r) e[r] = o[r] = _mm512_setzero_si512();
        for (int i = 0; i < 8; i += 2) {
          const __m512i x0 = _mm512_load_si512(x + 64 * i), x1 = _mm512_load_si512(x + 64 * i + 64);
          for (int r = 0; r < NR; ++r) {
            e[r] = _mm512_dpbusd_epi32(e[r], C[r][i], x0);
            o[r] = _mm512_dpbusd_epi32(o[r], C[r][i + 1], x1);
          }
        }
        for (int r = 0; r < NR; ++r) acc[r][m] = add_run(acc[r][m], _mm512_add_epi32(e[r], o[r]), _mm512_mul_ps(sw[r], dl));
      }
    } else {
      for (int k = 0; 4 * k < nbk; ++k) {
        const int q = 4 * u + k, nb = nbk - 4 * k < kQuad ? nbk - 4 * k : kQuad;
        __m512i lo[NR], hi[NR];
        for (int r = 0; r < NR; ++r) {
          if (nb == kQuad)
            unpack_quad<BITS, true>(w[r] + int64_t(q) * qb, kQuad, lo[r], hi[r]);
          else
            unpack_quad<BITS, false>(w[r] + int64_t(q) * qb, nb, lo[r], hi[r]);
        }
        for (int m = 0; m < M; ++m) {
          const int8_t* x = xa + m * xrow + int64_t(q) * kQuadBytes;
          const __m512i xlo = _mm512_load_si512(x), xhi = _mm512_load_si512(x + 64);
          const __m512 dl = _mm512_load_ps(P.dl + m * drow + int64_t(run) * 16);
          for (int r = 0; r < NR; ++r)
            acc[r][m] = add_quad(acc[r][m], dot_quad(lo[r], hi[r], xlo, xhi), _mm512_mul_ps(sw[r], dl), k);
        }
      }
    }
  }
}

template <int NR>
void many_rows_tile(const Layer& L, const Prep& P, float* y, int64_t ldy, int64_t n) {
  __m512 acc[NR][kMaxRows];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < P.M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int s = 0; s < L.segs.count; ++s) {
    switch (L.segs.seg[s].bits) {
      case 1: many_rows_segment<1, NR>(L, P, s, n, acc); break;
      case 2: many_rows_segment<2, NR>(L, P, s, n, acc); break;
      case 3: many_rows_segment<3, NR>(L, P, s, n, acc); break;
      case 4: many_rows_segment<4, NR>(L, P, s, n, acc); break;
      case 5: many_rows_segment<5, NR>(L, P, s, n, acc); break;
      case 6: many_rows_segment<6, NR>(L, P, s, n, acc); break;
      case 7: many_rows_segment<7, NR>(L, P, s, n, acc); break;
      default: many_rows_segment<8, NR>(L, P, s, n, acc); break;
    }
  }
  for (int r = 0; r < NR; ++r)
    finish_rows(L, P, acc[r], n + r, y + n + r, ldy);
}

void gemv_many_rows(const Layer& L, const Prep& P, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  v256::prefetch_range(L.qweight + n0 * L.row_bytes, std::min<int64_t>((n1 - n0) * L.row_bytes, v256::kPrefetchBytes));
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    v256::prefetch_rows(L, n, 2, n1);
    many_rows_tile<2>(L, P, y, ldy, n);
  }
  for (; n < n1; ++n) many_rows_tile<1>(L, P, y, ldy, n);
}

// Batch invariance: every path follows the one order above, so a row's result is bit for bit the
// same alone or among any others (speculative decoding verifies drafts in one batch and so
// reproduces plain greedy decoding exactly). Rows go in passes of up to kMaxRows.
void gemv_q8(const Layer& L, const ActQ8& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < a.M; m0 += kMaxRows) {
    const int M = int(a.M - m0 < kMaxRows ? a.M - m0 : kMaxRows);
    const Prep P = prepare(L, a, m0, M, M > 1);
    if (M == 1)
      gemv_one_row(L, P, y + m0 * ldy, n0, n1);
    else
      gemv_many_rows(L, P, y + m0 * ldy, ldy, n0, n1);
  }
}

// Fast Walsh-Hadamard transform of blocks of 16 to 128 values held in registers (one load and one store per
// value; the AVX2 version passes over memory once per stage h >= 8): stages h = 1, 2, 4, 8 inside a vector,
// h >= 16 across vectors. Every butterfly is (a + c, a - c) in the AVX2 version's order of stages, and the
// norm and the sign flips are the same exact steps, so the results are bit for bit those of v256::fwht.
EXL_INLINE __m512 fwht16(__m512 v) {
  __m512 t = _mm512_permute_ps(v, 0xb1);  // h = 1
  v = _mm512_mask_blend_ps(0xaaaa, _mm512_add_ps(v, t), _mm512_sub_ps(t, v));
  t = _mm512_permute_ps(v, 0x4e);  // h = 2
  v = _mm512_mask_blend_ps(0xcccc, _mm512_add_ps(v, t), _mm512_sub_ps(t, v));
  t = _mm512_shuffle_f32x4(v, v, 0xb1);  // h = 4: 128-bit lanes (1, 0, 3, 2)
  v = _mm512_mask_blend_ps(0xf0f0, _mm512_add_ps(v, t), _mm512_sub_ps(t, v));
  t = _mm512_shuffle_f32x4(v, v, 0x4e);  // h = 8: 128-bit lanes (2, 3, 0, 1)
  return _mm512_mask_blend_ps(0xff00, _mm512_add_ps(v, t), _mm512_sub_ps(t, v));
}

EXL_INLINE __m512 flip16(__m512 v, const uint8_t* signs, int64_t i) {  // i: a multiple of 16
  uint16_t bits;
  memcpy(&bits, signs + (i >> 3), 2);
  return _mm512_mask_xor_ps(v, __mmask16(bits), v, _mm512_set1_ps(-0.0f));
}

template <int NV>
void fwht_rows(float* x, int64_t rows, int64_t n, int64_t ld, const uint8_t* signs, bool signs_first) {
  const __m512 norm = _mm512_set1_ps(1.0f / sqrtf(float(16 * NV)));
  for (int64_t r = 0; r < rows; ++r) {
    float* v = x + r * ld;
    for (int64_t b0 = 0; b0 < n; b0 += 16 * NV) {
      __m512 z[NV];
      for (int k = 0; k < NV; ++k) {
        z[k] = _mm512_loadu_ps(v + b0 + 16 * k);
        if (signs && signs_first) z[k] = flip16(z[k], signs, b0 + 16 * k);
        z[k] = fwht16(z[k]);
      }
      for (int h = 1; h < NV; h *= 2)
        for (int i = 0; i < NV; i += 2 * h)
          for (int j = i; j < i + h; ++j) {
            const __m512 a = z[j], c = z[j + h];
            z[j] = _mm512_add_ps(a, c);
            z[j + h] = _mm512_sub_ps(a, c);
          }
      for (int k = 0; k < NV; ++k) {
        __m512 o = _mm512_mul_ps(z[k], norm);
        if (signs && !signs_first) o = flip16(o, signs, b0 + 16 * k);
        _mm512_storeu_ps(v + b0 + 16 * k, o);
      }
    }
  }
}

void fwht(float* x, int64_t rows, int64_t n, int64_t ld, int64_t block, const uint8_t* signs, bool signs_first) {
  switch (block) {
    case 16: return fwht_rows<1>(x, rows, n, ld, signs, signs_first);
    case 32: return fwht_rows<2>(x, rows, n, ld, signs, signs_first);
    case 64: return fwht_rows<4>(x, rows, n, ld, signs, signs_first);
    case 128: return fwht_rows<8>(x, rows, n, ld, signs, signs_first);
    default: return v256::fwht(x, rows, n, ld, block, signs, signs_first);
  }
}

const Kernels kTable = {"avx512vnni", v256::gemv_f32, gemv_q8, v256::quantize_q8, v256::dequant, fwht, false, kGemmNever};
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
