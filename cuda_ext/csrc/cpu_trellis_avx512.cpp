// AVX-512 (F/BW/VL/DQ) + AVX512-VNNI + AVX512-VBMI trellis kernels (docs/format.md §7); selected at run time.
//
// A tile's stream (8K words) sits in up to four zmm registers. Column c of the tile (input channel
// 16j + c, the 16 weights t = 16c .. 16c+15 of outputs 16i .. 16i+15) is decoded in one vector:
// lane r needs the L-bit window at bit p = (16c + r)K. One vpermt2d puts, in qword q, the two words
// holding lanes 2q and 2q+1's windows (indexes precomputed per K and c, wrapping around the
// stream); one vpmultishiftqb cuts both 16-bit windows out of it (bytes at any bit offset, the
// other bytes zeroed by mask); for L < 16 an AND keeps L bits. One vpmulld + vpaddd give
// x = A s + B and one vpdpbusd against a vector of ones sums x's four bytes: the 16 values,
// exactly. Each value vector then meets each activation row with one fused multiply-add.
// Port 0 is the limit (vpmulld is two of its uops, vpdpbusd one), so nothing else runs there.
//
// Codes 2 and 3 (two tables, tile layout 2) have their own kernels (namespace two_table, cpu_trellis_two_table.inc):
// no multiply, 64 weights (a quad-column: 16 outputs x 4 inputs) per step, already in vpdpbusd order.
#include <string.h>

#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_trellis.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx512vbmi,avx2,fma,f16c")
namespace exl {
namespace cpu {
namespace {

#define EXL_TINLINE inline __attribute__((always_inline))

// Where tile row `row`'s GEMV prefetches, tile by tile: the same tile of row + TR (the next group of TR
// rows decoded together) where that row is below i_end, else kTrellisPrefetchBytes ahead in its own row.
// (Prefetching only ahead in its own row left the first 2 KiB of most rows of a group unfetched.)
EXL_TINLINE const uint32_t* prefetch_base(const TrellisLayer& T, int64_t row, int TR, int64_t i_end, int64_t row_words) {
  return row + TR < i_end ? T.words + (row + TR) * row_words : T.words + row * row_words + kTrellisPrefetchBytes / 4;
}

// Per K: for every column c, the two registers holding its words, the vpermt2d indexes that put
// words a, a+1 (a = p/32 of lane 2q's window at bit p) into qword q, and the vpmultishiftqb
// controls that cut lanes 2q and 2q+1's 16-bit windows out of that qword.
template <int KB>
struct Plan {
  static constexpr int kWords = 8 * KB;
  static constexpr int kRegs = (kWords + 15) / 16;
  alignas(64) int32_t idx[16][16];
  alignas(64) uint8_t ctl[16][64];
  int r1[16], r2[16];

  static constexpr int index(int w, int a, int b) { return w / 16 == a ? w - 16 * a : 16 + w - 16 * b; }

  constexpr Plan() : idx(), ctl(), r1(), r2() {
    for (int c = 0; c < 16; ++c) {
      r1[c] = (16 * c * KB / 32) / 16;
      r2[c] = (r1[c] + 1) % kRegs;
      for (int q = 0; q < 8; ++q) {
        const int p0 = (16 * c + 2 * q) * KB, a = p0 / 32;
        idx[c][2 * q] = index(a % kWords, r1[c], r2[c]);
        idx[c][2 * q + 1] = index((a + 1) % kWords, r1[c], r2[c]);
        for (int h = 0; h < 2; ++h) {  // lane 2q + h: its window starts (p0 + h K - 32a) bits into the qword
          const int off = p0 + h * KB - 32 * a;
          for (int b = 0; b < 4; ++b) ctl[c][8 * q + 4 * h + b] = uint8_t(off + 8 * b);
        }
      }
    }
  }
};
template <int KB>
constexpr Plan<KB> kPlan{};

// The byte sum accumulates onto the bits of 2^23 (as float: 2^23 + sum, exact), so one subtraction
// of 2^23 + 510 gives the value as float (instead of a convert, which competes for port 0).
constexpr float kMagic = 8388608.0f;

struct Consts {
  __m512i mask, mul, add, magic, ones;
  __m512 offset;
  explicit Consts(const TrellisCode& c)
      : mask(_mm512_set1_epi32(int((1u << c.state_bits) - 1u))),
        mul(_mm512_set1_epi32(int(c.mul))),
        add(_mm512_set1_epi32(int(c.add))),
        magic(_mm512_set1_epi32(0x4B000000)),
        ones(_mm512_set1_epi8(1)),
        offset(_mm512_set1_ps(kMagic + float(kTrellisCentre))) {}
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

// States of column c (lane r: output 16i + r): the 16 windows. FULL: L = 16, the byte mask of the
// window cut leaves exactly the state; else one AND keeps its L bits.
template <int KB, bool FULL>
EXL_TINLINE __m512i states(const __m512i* z, int c, const Consts& k) {
  const Plan<KB>& P = kPlan<KB>;
  const __m512i src = _mm512_permutex2var_epi32(z[P.r1[c]], _mm512_load_si512(P.idx[c]), z[P.r2[c]]);
  const __m512i s = _mm512_maskz_multishift_epi64_epi8(__mmask64(0x3333333333333333ull), _mm512_load_si512(P.ctl[c]), src);
  return FULL ? s : _mm512_and_si512(s, k.mask);
}

// Values of column c as fp32.
template <int KB, bool FULL>
EXL_TINLINE __m512 column(const __m512i* z, int c, const Consts& k) {
  const __m512i x = _mm512_add_epi32(_mm512_mullo_epi32(states<KB, FULL>(z, c, k), k.mul), k.add);
  return _mm512_sub_ps(_mm512_castsi512_ps(_mm512_dpbusd_epi32(k.magic, x, k.ones)), k.offset);
}

// MR activation rows (rows past M repeat row 0 and are not stored) times TR tile rows at a time.
template <int KB, bool FULL, int MR, int TR>
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
      prefetch_tile<KB>(w[t] + j * tw + kTrellisPrefetchBytes / 4);
      load_tile<KB>(w[t] + j * tw, z[t]);
    }
#pragma GCC unroll 16
    for (int c = 0; c < kTile; ++c) {
      for (int t = 0; t < TR; ++t) {
        const __m512 v = column<KB, FULL>(z[t], c, k);
        for (int m = 0; m < MR; ++m) acc[t][m] = _mm512_fmadd_ps(v, _mm512_set1_ps(xp[m][j * kTile + c]), acc[t][m]);
      }
    }
  }
  for (int t = 0; t < TR; ++t) {
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(T.tscale + (i + t) * kTile)));
    for (int m = 0; m < MR && m < M; ++m) _mm512_storeu_ps(y + m * ldy + (i + t) * kTile, _mm512_mul_ps(acc[t][m], s));
  }
}

template <int KB, bool FULL, int MR>
void rows_for(const TrellisLayer& T, const float* x, int64_t M, float* y, int64_t ldy, int64_t i0, int64_t i1) {
  constexpr int TR = MR <= 4 ? 2 : 1;
  int64_t i = i0;
  for (; i + TR <= i1; i += TR) tile_rows<KB, FULL, MR, TR>(T, x, M, y, ldy, i);
  for (; i < i1; ++i) tile_rows<KB, FULL, MR, 1>(T, x, M, y, ldy, i);
}

template <int KB, bool FULL>
void gemv_k(const TrellisLayer& T, const float* x, int64_t M, float* y, int64_t ldy, int64_t i0, int64_t i1) {
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t mr = M - m0 < 16 ? M - m0 : 16;
    const float* xm = x + m0 * T.K;
    float* ym = y + m0 * ldy;
    if (mr == 1) rows_for<KB, FULL, 1>(T, xm, mr, ym, ldy, i0, i1);
    else if (mr == 2) rows_for<KB, FULL, 2>(T, xm, mr, ym, ldy, i0, i1);
    else if (mr <= 4) rows_for<KB, FULL, 4>(T, xm, mr, ym, ldy, i0, i1);
    else if (mr <= 8) rows_for<KB, FULL, 8>(T, xm, mr, ym, ldy, i0, i1);
    else rows_for<KB, FULL, 16>(T, xm, mr, ym, ldy, i0, i1);
  }
}

template <int KB, bool FULL>
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
      for (int c = 0; c < kTile; ++c) _mm512_storeu_ps(o + c * ldo, column<KB, FULL>(z, c, k));
    }
}

template <int KB>
void gemv_l(const TrellisLayer& T, const float* x, int64_t M, float* y, int64_t ldy, int64_t i0, int64_t i1) {
  if (T.code.state_bits == 16) gemv_k<KB, true>(T, x, M, y, ldy, i0, i1);
  else gemv_k<KB, false>(T, x, M, y, ldy, i0, i1);
}

template <int KB>
void decode_l(const TrellisLayer& T, int64_t i0, int64_t i1, float* out, int64_t ldo) {
  if (T.code.state_bits == 16) decode_k<KB, true>(T, i0, i1, out, ldo);
  else decode_k<KB, false>(T, i0, i1, out, ldo);
}

// int8 activations (see TrellisKernels::gemv_q8): per column, x = A s + B and then one vpdpbusd per
// row, x's bytes against the row's int8 activation repeated 4x: the byte sum and the product in one.
template <int KB, bool FULL, int MR, int TR>
void tile_rows_q8(const TrellisLayer& T, const int32_t* qq, const float* d, const int32_t* bsum, int64_t M, float* y,
                  int64_t ldy, int64_t i, int64_t i_end) {
  constexpr int tw = 8 * KB, nr = Plan<KB>::kRegs;
  const int64_t kt = T.K / kTile, nb = T.K / 32;
  const Consts k(T.code);
  const int32_t* qp[MR];
  const float* dp[MR];
  const int32_t* bp[MR];
  for (int m = 0; m < MR; ++m) {
    const int64_t mm = m < M ? m : 0;
    qp[m] = qq + mm * T.K;
    dp[m] = d + mm * nb;
    bp[m] = bsum + mm * nb;
  }
  __m512 acc[TR][MR];
  for (int t = 0; t < TR; ++t)
    for (int m = 0; m < MR; ++m) acc[t][m] = _mm512_setzero_ps();
  const uint32_t* w[TR];
  const uint32_t* pf[TR];
  for (int t = 0; t < TR; ++t) {
    w[t] = T.words + (i + t) * kt * tw;
    pf[t] = prefetch_base(T, i + t, TR, i_end, kt * tw);
  }
  const __m512i centre = _mm512_set1_epi32(kTrellisCentre);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i dot[TR][MR];
    for (int t = 0; t < TR; ++t)
      for (int m = 0; m < MR; ++m) dot[t][m] = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const int64_t j = 2 * b + h;
      __m512i z[TR][nr];
      for (int t = 0; t < TR; ++t) {
        prefetch_tile<KB>(pf[t] + j * tw);
        load_tile<KB>(w[t] + j * tw, z[t]);
      }
#pragma GCC unroll 16
      for (int c = 0; c < kTile; ++c)
        for (int t = 0; t < TR; ++t) {
          const __m512i x = _mm512_add_epi32(_mm512_mullo_epi32(states<KB, FULL>(z[t], c, k), k.mul), k.add);
          for (int m = 0; m < MR; ++m)
            dot[t][m] = _mm512_dpbusd_epi32(dot[t][m], x, _mm512_set1_epi32(qp[m][j * kTile + c]));
        }
    }
    for (int t = 0; t < TR; ++t)
      for (int m = 0; m < MR; ++m) {
        const __m512i exact = _mm512_sub_epi32(dot[t][m], _mm512_mullo_epi32(centre, _mm512_set1_epi32(bp[m][b])));
        acc[t][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(dp[m][b]), acc[t][m]);
      }
  }
  for (int t = 0; t < TR; ++t) {
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(T.tscale + (i + t) * kTile)));
    for (int m = 0; m < MR && m < M; ++m) _mm512_storeu_ps(y + m * ldy + (i + t) * kTile, _mm512_mul_ps(acc[t][m], s));
  }
}

template <int KB, bool FULL, int MR>
void rows_q8(const TrellisLayer& T, const int32_t* qq, const float* d, const int32_t* bsum, int64_t M, float* y,
             int64_t ldy, int64_t i0, int64_t i1) {
  constexpr int TR = MR <= 2 ? 2 : 1;
  int64_t i = i0;
  for (; i + TR <= i1; i += TR) tile_rows_q8<KB, FULL, MR, TR>(T, qq, d, bsum, M, y, ldy, i, i1);
  for (; i < i1; ++i) tile_rows_q8<KB, FULL, MR, 1>(T, qq, d, bsum, M, y, ldy, i, i1);
}

template <int KB, bool FULL>
void gemv_q8_k(const TrellisLayer& T, const int32_t* qq, const float* d, const int32_t* bsum, int64_t M, float* y,
               int64_t ldy, int64_t i0, int64_t i1) {
  const int64_t nb = T.K / 32;
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const int64_t mr = M - m0 < 8 ? M - m0 : 8;
    const int32_t* q = qq + m0 * T.K;
    const float* dm = d + m0 * nb;
    const int32_t* bm = bsum + m0 * nb;
    float* ym = y + m0 * ldy;
    if (mr == 1) rows_q8<KB, FULL, 1>(T, q, dm, bm, mr, ym, ldy, i0, i1);
    else if (mr == 2) rows_q8<KB, FULL, 2>(T, q, dm, bm, mr, ym, ldy, i0, i1);
    else if (mr <= 4) rows_q8<KB, FULL, 4>(T, q, dm, bm, mr, ym, ldy, i0, i1);
    else rows_q8<KB, FULL, 8>(T, q, dm, bm, mr, ym, ldy, i0, i1);
  }
}

template <int KB>
void gemv_q8_l(const TrellisLayer& T, const int32_t* qq, const float* d, const int32_t* bsum, int64_t M, float* y,
               int64_t ldy, int64_t i0, int64_t i1) {
  if (T.code.state_bits == 16) gemv_q8_k<KB, true>(T, qq, d, bsum, M, y, ldy, i0, i1);
  else gemv_q8_k<KB, false>(T, qq, d, bsum, M, y, ldy, i0, i1);
}

#include "cpu_trellis_two_table.inc"

// Code 1 on AMX tiles (groups of kAmxMinRows to 16 rows, when amx_enabled()): column c's x = A s + B (16
// outputs x 4 bytes, as decoded) is one row of an AMX "B" tile whose K groups are input channels, and the
// activations repeated 4x (qq) are the "A" tile, so one tdpbsud per 16 columns gives the vpdpbusd kernel's
// exact block sums (byte sums times activations); the fp32 steps after it are that kernel's. Weights are
// decoded kAhead - 1 blocks ahead and sums read kLag blocks later (see the two-table AMX kernel).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx512vbmi,avx2,fma,f16c,amx-tile,amx-int8")

// Even blocks' sums in tile 0, odd blocks' in tile 1 (M x 16 int32); activations of a block's two halves in
// tiles 2, 3 (M x 64 bytes); its two 16-column weight tiles in 4, 5 (16 x 64 bytes).
EXL_TINLINE void amx_configure_code1(int64_t M) {
  two_table::AmxConfig c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t : {0, 1, 2, 3}) c.rows[t] = uint8_t(M), c.colsb[t] = 64;
  for (int t : {4, 5}) c.rows[t] = 16, c.colsb[t] = 64;
  // GCC's _tile_loadconfig declares a read of 8 bytes only: without this barrier the stores to c above may be
  // dropped (seen as a SIGSEGV in an earlier kernel)
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

#define EXL_AMX1_BLOCK(CT, a, lda, w, out) \
  do {                                     \
    _tile_loadd(2, a, lda);                \
    _tile_loadd(3, (a) + 64, lda);         \
    _tile_loadd(4, w, 64);                 \
    _tile_loadd(5, (w) + 1024, 64);        \
    _tile_zero(CT);                        \
    _tile_dpbsud(CT, 2, 4);                \
    _tile_dpbsud(CT, 3, 5);                \
    _tile_stored(CT, out, 64);             \
  } while (0)

// Tile row i for M (<= 16) rows; qb: qq as bytes (row stride 4K); cb: 510 * bsum.
template <int KB, bool FULL>
void tile_row_amx1(const TrellisLayer& T, const int8_t* qb, const float* d, const int32_t* cb, int64_t M, float* y,
                   int64_t ldy, int64_t i, int64_t i_end) {
  constexpr int tw = 8 * KB, nr = Plan<KB>::kRegs, kAhead = 3, kLag = 2;
  const int64_t kt = T.K / kTile, nb = T.K / 32;
  const Consts k(T.code);
  alignas(64) uint8_t wb[kAhead][2 * kTile][64];  // a ring: block b's 32 columns at b % kAhead
  alignas(64) int32_t sums[kLag + 1][16][16];
  __m512 acc[16];
  for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
  const uint32_t* w = T.words + i * kt * tw;
  const uint32_t* pf = prefetch_base(T, i, 1, i_end, kt * tw);
  auto decode_block = [&](int64_t b) {
    for (int h = 0; h < 2; ++h) {
      const int64_t j = 2 * b + h;
      __m512i z[nr];
      prefetch_tile<KB>(pf + j * tw);
      load_tile<KB>(w + j * tw, z);
#pragma GCC unroll 16
      for (int c = 0; c < kTile; ++c)
        _mm512_store_si512(wb[b % kAhead][kTile * h + c],
                           _mm512_add_epi32(_mm512_mullo_epi32(states<KB, FULL>(z, c, k), k.mul), k.add));
    }
  };
  auto finish = [&](int64_t b) { two_table::amx_accumulate(acc, sums[b % (kLag + 1)], cb, d, M, nb, b); };
  for (int64_t b = 0; b < kAhead - 1 && b < nb; ++b) decode_block(b);
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* a = qb + b * 128;
    const uint8_t* wt = wb[b % kAhead][0];
    if (b & 1) EXL_AMX1_BLOCK(1, a, 4 * T.K, wt, sums[b % (kLag + 1)]);
    else EXL_AMX1_BLOCK(0, a, 4 * T.K, wt, sums[b % (kLag + 1)]);
    if (b + kAhead - 1 < nb) decode_block(b + kAhead - 1);
    if (b >= kLag) finish(b - kLag);
  }
  for (int64_t b = nb > kLag ? nb - kLag : 0; b < nb; ++b) finish(b);
  two_table::amx_store(T, acc, M, y, ldy, i);
}
#undef EXL_AMX1_BLOCK

template <int KB>
void gemv_q8_amx1(const TrellisLayer& T, const int32_t* qq, const float* d, const int32_t* bsum, int64_t M, float* y,
                  int64_t ldy, int64_t i0, int64_t i1) {
  const int64_t nb = T.K / 32;
  thread_local std::vector<int32_t> cb;
  if (cb.size() < size_t(16 * nb)) cb.resize(16 * nb);
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t mr = M - m0 < 16 ? M - m0 : 16;
    if (mr < kAmxMinRowsCode1) {  // a short last group: the vpdpbusd kernel (the same bits)
      gemv_q8_l<KB>(T, qq + m0 * T.K, d + m0 * nb, bsum + m0 * nb, mr, y + m0 * ldy, ldy, i0, i1);
      break;
    }
    for (int64_t e = 0; e < mr * nb; ++e) cb[e] = kTrellisCentre * bsum[m0 * nb + e];
    amx_configure_code1(mr);
    const int8_t* qb = reinterpret_cast<const int8_t*>(qq + m0 * T.K);
    for (int64_t i = i0; i < i1; ++i) {
      if (T.code.state_bits == 16) tile_row_amx1<KB, true>(T, qb, d + m0 * nb, cb.data(), mr, y + m0 * ldy, ldy, i, i1);
      else tile_row_amx1<KB, false>(T, qb, d + m0 * nb, cb.data(), mr, y + m0 * ldy, ldy, i, i1);
    }
    _tile_release();
  }
}
#pragma GCC pop_options

// Code 1 at K_b bits: groups of kAmxMinRowsCode1 rows or more on AMX tiles where in use, else vpdpbusd.
template <int KB>
void gemv_q8_code1(const TrellisLayer& T, const int32_t* qq, const float* d, const int32_t* bsum, int64_t M, float* y,
                   int64_t ldy, int64_t i0, int64_t i1) {
  if (M >= kAmxMinRowsCode1 && amx_enabled()) return gemv_q8_amx1<KB>(T, qq, d, bsum, M, y, ldy, i0, i1);
  gemv_q8_l<KB>(T, qq, d, bsum, M, y, ldy, i0, i1);
}

void gemv_q8(const TrellisLayer& T, const int8_t* q8, const int32_t* qq, const float* d, const int32_t* bsum, int64_t M,
             float* y, int64_t ldy, int64_t i0, int64_t i1) {
  if (is_two_table(T.code.code)) return two_table::gemv_q8(T, q8, d, bsum, M, y, ldy, i0, i1);
  switch (T.code.bits) {
    case 1: return gemv_q8_code1<1>(T, qq, d, bsum, M, y, ldy, i0, i1);
    case 2: return gemv_q8_code1<2>(T, qq, d, bsum, M, y, ldy, i0, i1);
    case 3: return gemv_q8_code1<3>(T, qq, d, bsum, M, y, ldy, i0, i1);
    case 4: return gemv_q8_code1<4>(T, qq, d, bsum, M, y, ldy, i0, i1);
    case 5: return gemv_q8_code1<5>(T, qq, d, bsum, M, y, ldy, i0, i1);
    case 6: return gemv_q8_code1<6>(T, qq, d, bsum, M, y, ldy, i0, i1);
    case 7: return gemv_q8_code1<7>(T, qq, d, bsum, M, y, ldy, i0, i1);
    default: return gemv_q8_code1<8>(T, qq, d, bsum, M, y, ldy, i0, i1);
  }
}

void gemv(const TrellisLayer& T, const float* x, int64_t M, float* y, int64_t ldy, int64_t i0, int64_t i1) {
  if (is_two_table(T.code.code)) return two_table::gemv(T, x, M, y, ldy, i0, i1);
  switch (T.code.bits) {
    case 1: return gemv_l<1>(T, x, M, y, ldy, i0, i1);
    case 2: return gemv_l<2>(T, x, M, y, ldy, i0, i1);
    case 3: return gemv_l<3>(T, x, M, y, ldy, i0, i1);
    case 4: return gemv_l<4>(T, x, M, y, ldy, i0, i1);
    case 5: return gemv_l<5>(T, x, M, y, ldy, i0, i1);
    case 6: return gemv_l<6>(T, x, M, y, ldy, i0, i1);
    case 7: return gemv_l<7>(T, x, M, y, ldy, i0, i1);
    default: return gemv_l<8>(T, x, M, y, ldy, i0, i1);
  }
}

void decode(const TrellisLayer& T, int64_t i0, int64_t i1, float* out, int64_t ldo) {
  if (is_two_table(T.code.code)) return two_table::decode(T, i0, i1, out, ldo);
  switch (T.code.bits) {
    case 1: return decode_l<1>(T, i0, i1, out, ldo);
    case 2: return decode_l<2>(T, i0, i1, out, ldo);
    case 3: return decode_l<3>(T, i0, i1, out, ldo);
    case 4: return decode_l<4>(T, i0, i1, out, ldo);
    case 5: return decode_l<5>(T, i0, i1, out, ldo);
    case 6: return decode_l<6>(T, i0, i1, out, ldo);
    case 7: return decode_l<7>(T, i0, i1, out, ldo);
    default: return decode_l<8>(T, i0, i1, out, ldo);
  }
}

const TrellisKernels kTable = {"avx512vnni", gemv, decode, gemv_q8, 96, kGemmNever};
}  // namespace
// Needs AVX512-VBMI (vpmultishiftqb) on top of the avx512vnni table's features; without it the
// trellis layers of that table use the AVX-VNNI/AVX2 kernels (see trellis_named).
const TrellisKernels* avx512vnni_trellis() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vbmi") ? &kTable : nullptr;
}
}  // namespace cpu
}  // namespace exl
#pragma GCC pop_options

#include <cpuid.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

namespace exl {
namespace cpu {
namespace {
bool detect_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), int8 = d & (1u << 25);
  if (!tile || !int8 || !avx512vnni_trellis()) return false;
  // The tile registers' state must be requested from the kernel (Linux 5.16+), once per process.
  constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
}
std::atomic<bool>& amx_switch() {
  static std::atomic<bool> on{[] {
    const char* env = getenv("EXL_CPU_AMX");
    return amx_supported() && !(env && std::string(env) == "0");
  }()};
  return on;
}
}  // namespace
bool amx_supported() {
  static const bool ok = detect_amx();
  return ok;
}
bool amx_enabled() { return amx_switch().load(std::memory_order_relaxed); }
bool set_amx(bool on) {
  amx_switch().store(on && amx_supported());
  return amx_enabled();
}
}  // namespace cpu
}  // namespace exl
#else
namespace exl {
namespace cpu {
const TrellisKernels* avx512vnni_trellis() { return nullptr; }
bool amx_supported() { return false; }
bool amx_enabled() { return false; }
bool set_amx(bool) { return false; }
}  // namespace cpu
}  // namespace exl
#endif
