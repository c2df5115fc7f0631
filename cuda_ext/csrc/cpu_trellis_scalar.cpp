// Portable scalar trellis kernels: the fallback on any host and the reference the SIMD kernels
// are tested against. The decode is trellis_format.h's, the same code the CUDA kernels run.
#include "cpu_kernels.h"
#include "cpu_trellis.h"

namespace exl {
namespace cpu {
namespace {

// Values of one tile, column-major: v[16 * column + row] (the code's tile layout places weight t).
void decode_tile(const uint32_t* w, const TrellisCode& c, float* v) {
  for (int t = 0; t < kTileWeights; ++t)
    v[kTile * trellis_col(t, c) + trellis_row(t, c)] = float(trellis_value(trellis_state(w, t, c), c));
}

void gemv(const TrellisLayer& T, const float* x, int64_t M, float* y, int64_t ldy, int64_t i0, int64_t i1) {
  const int64_t kt = T.K / kTile, tw = tile_words(T.code.bits);
  float v[kTileWeights];
  float acc[16][kTile];
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int64_t mr = M - m0 < 16 ? M - m0 : 16;
      for (int64_t m = 0; m < mr; ++m)
        for (int r = 0; r < kTile; ++r) acc[m][r] = 0.0f;
      for (int64_t j = 0; j < kt; ++j) {
        decode_tile(T.words + (i * kt + j) * tw, T.code, v);
        for (int64_t m = 0; m < mr; ++m) {
          const float* xm = x + (m0 + m) * T.K + j * kTile;
          for (int c = 0; c < kTile; ++c)
            for (int r = 0; r < kTile; ++r) acc[m][r] = __builtin_fmaf(v[c * kTile + r], xm[c], acc[m][r]);
        }
      }
      for (int64_t m = 0; m < mr; ++m)
        for (int r = 0; r < kTile; ++r)
          y[(m0 + m) * ldy + i * kTile + r] = acc[m][r] * half_bits_to_float(T.tscale[i * kTile + r]);
    }
  }
}

void decode(const TrellisLayer& T, int64_t i0, int64_t i1, float* out, int64_t ldo) {
  const int64_t kt = T.K / kTile, tw = tile_words(T.code.bits);
  float v[kTileWeights];
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t j = 0; j < kt; ++j) {
      decode_tile(T.words + (i * kt + j) * tw, T.code, v);
      for (int c = 0; c < kTile; ++c)
        for (int r = 0; r < kTile; ++r) out[(j * kTile + c) * ldo + (i - i0) * kTile + r] = v[c * kTile + r];
    }
}

void gemv_q8(const TrellisLayer& T, const int8_t* q8, const int32_t*, const float* d, const int32_t* /*bsum*/, int64_t M,
             float* y, int64_t ldy, int64_t i0, int64_t i1) {
  const int64_t kt = T.K / kTile, tw = tile_words(T.code.bits), nb = T.K / 32;
  float v[2][kTileWeights];
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t m = 0; m < M; ++m) {
      float acc[kTile] = {};
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot[kTile] = {};
        for (int h = 0; h < 2; ++h) {
          decode_tile(T.words + (i * kt + 2 * b + h) * tw, T.code, v[h]);
          for (int c = 0; c < kTile; ++c) {
            const int32_t q = q8[m * T.K + 32 * b + 16 * h + c];
            for (int r = 0; r < kTile; ++r) dot[r] += int32_t(v[h][c * kTile + r]) * q;  // exact: what both codes' offsets give
          }
        }
        for (int r = 0; r < kTile; ++r)
          acc[r] = __builtin_fmaf(float(dot[r]), d[m * nb + b], acc[r]);
      }
      for (int r = 0; r < kTile; ++r) y[m * ldy + i * kTile + r] = acc[r] * half_bits_to_float(T.tscale[i * kTile + r]);
    }
}

const TrellisKernels kTable = {"scalar", gemv, decode, gemv_q8, 17, 64};

}  // namespace

const TrellisKernels* scalar_trellis() { return &kTable; }

}  // namespace cpu
}  // namespace exl
