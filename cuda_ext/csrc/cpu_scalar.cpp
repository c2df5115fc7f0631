// Portable scalar CPU kernels: the fallback on any x86-64/ARM host, and the reference the SIMD
// kernels are tested against. Block decoding is format.h's, the same code the CUDA kernels run.
#include <math.h>
#include <string.h>

#include <algorithm>

#include "cpu_kernels.h"

namespace exl {
namespace cpu {
namespace {

template <int BITS>
void decode(const uint8_t* p, uint32_t* codes) {
  uint32_t w[BITS];
  load_block_words<BITS>(p, w);
  decode_block<BITS>(w, codes);
}

using DecodeFn = void (*)(const uint8_t*, uint32_t*);
DecodeFn decoder(int bits) {
  static const DecodeFn table[9] = {nullptr,    decode<1>, decode<2>, decode<3>, decode<4>,
                                    decode<5>, decode<6>, decode<7>, decode<8>};
  return table[bits];
}

void gemv_f32(const Layer& L, const float* x, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  uint32_t codes[kBlock];
  float w[kBlock];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) y[m * ldy + n] = 0.0f;
    const uint8_t* row = L.qweight + n * L.row_bytes;
    const uint16_t* srow = L.qscale + n * L.n_groups;
    for (int s = 0; s < L.segs.count; ++s) {
      const Segment& sg = L.segs.seg[s];
      const DecodeFn dec = decoder(sg.bits);
      const float c = code_offset(sg.bits);
      for (int b = 0; b < sg.k_len / kBlock; ++b) {
        const float scale = half_bits_to_float(srow[sg.group_start + b * kBlock / sg.group_size]);
        dec(row + sg.byte_start + int64_t(b) * block_bytes(sg.bits), codes);
        for (int i = 0; i < kBlock; ++i) w[i] = scale * (float(codes[i]) - c);
        const int64_t k0 = sg.k_start + int64_t(b) * kBlock;
        for (int64_t m = 0; m < M; ++m) {
          const float* xm = x + m * L.K + k0;
          float acc = 0.0f;
          for (int i = 0; i < kBlock; ++i) acc += w[i] * xm[i];
          y[m * ldy + n] += acc;
        }
      }
    }
  }
}

void gemv_q8(const Layer& L, const ActQ8& a, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  uint32_t codes[kBlock];
  const int64_t nb = L.K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = L.qweight + n * L.row_bytes;
    const uint16_t* srow = L.qscale + n * L.n_groups;
    for (int64_t m = 0; m < a.M; ++m) {
      const int8_t* xq = a.q + m * L.K;
      const float* d = a.d + m * nb;
      float acc = 0.0f, corr = 0.0f;
      for (int s = 0; s < L.segs.count; ++s) {
        const Segment& sg = L.segs.seg[s];
        const DecodeFn dec = decoder(sg.bits);
        const int per_group = sg.group_size / kBlock;
        float seg_corr = 0.0f;
        for (int g = 0; g < sg.k_len / sg.group_size; ++g) {
          const float scale = half_bits_to_float(srow[sg.group_start + g]);
          float gacc = 0.0f;
          for (int j = 0; j < per_group; ++j) {
            const int b = g * per_group + j;
            dec(row + sg.byte_start + int64_t(b) * block_bytes(sg.bits), codes);
            const int64_t kb = sg.k_start / kBlock + b;
            int32_t dot = 0;
            for (int i = 0; i < kBlock; ++i) dot += int32_t(codes[i]) * xq[kb * kBlock + i];
            gacc += float(dot) * d[kb];
          }
          acc += gacc * scale;
          seg_corr += scale * a.gsum[m * L.n_groups + sg.group_start + g];
        }
        corr += code_offset(sg.bits) * seg_corr;
      }
      y[m * ldy + n] = acc - corr;
    }
  }
}

void quantize_q8(const float* x, int64_t K, const void* perm, int perm_bytes, int8_t* q, float* d, int32_t* bsum) {
  float buf[kBlock];
  for (int64_t b = 0; b < K / kBlock; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) {
      const int64_t k = b * kBlock + i;
      int64_t src = k;
      if (perm) src = perm_bytes == 2 ? int64_t(static_cast<const int16_t*>(perm)[k])
                                      : int64_t(static_cast<const int32_t*>(perm)[k]);
      buf[i] = x[src];
      amax = std::max(amax, fabsf(buf[i]));
    }
    const float scale = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const float v = std::min(127.0f, std::max(-127.0f, nearbyintf(buf[i] * inv)));
      q[b * kBlock + i] = int8_t(v);
      sum += int32_t(v);
    }
    d[b] = scale;
    bsum[b] = sum;
  }
}

void dequant(const Layer& L, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  uint32_t codes[kBlock];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = L.qweight + n * L.row_bytes;
    const uint16_t* srow = L.qscale + n * L.n_groups;
    float* o = out + (n - n0) * ldo;
    for (int s = 0; s < L.segs.count; ++s) {
      const Segment& sg = L.segs.seg[s];
      const DecodeFn dec = decoder(sg.bits);
      const float c = code_offset(sg.bits);
      for (int b = 0; b < sg.k_len / kBlock; ++b) {
        const float scale = half_bits_to_float(srow[sg.group_start + b * kBlock / sg.group_size]);
        dec(row + sg.byte_start + int64_t(b) * block_bytes(sg.bits), codes);
        for (int i = 0; i < kBlock; ++i) o[sg.k_start + b * kBlock + i] = scale * (float(codes[i]) - c);
      }
    }
  }
}

void fwht(float* x, int64_t rows, int64_t n, int64_t ld, int64_t block, const uint8_t* signs, bool signs_first) {
  const float norm = 1.0f / sqrtf(float(block));
  for (int64_t r = 0; r < rows; ++r) {
    float* v = x + r * ld;
    if (signs && signs_first)
      for (int64_t i = 0; i < n; ++i) v[i] *= sign_at(signs, i);
    for (int64_t b0 = 0; b0 < n; b0 += block) {
      float* blk = v + b0;
      for (int64_t h = 1; h < block; h *= 2)
        for (int64_t i = 0; i < block; i += 2 * h)
          for (int64_t j = i; j < i + h; ++j) {
            const float a = blk[j], c = blk[j + h];
            blk[j] = a + c;
            blk[j + h] = a - c;
          }
      for (int64_t i = 0; i < block; ++i) blk[i] *= norm;
    }
    if (signs && !signs_first)
      for (int64_t i = 0; i < n; ++i) v[i] *= sign_at(signs, i);
  }
}

const Kernels kTable = {"scalar", gemv_f32, gemv_q8, quantize_q8, dequant, fwht, false, 17};

}  // namespace

const Kernels* scalar_kernels() { return &kTable; }

}  // namespace cpu
}  // namespace exl
