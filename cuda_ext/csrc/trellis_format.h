// The exl trellis-coded layout (docs/format.md §7), decoded by CPU and CUDA kernels alike.
//
// A layer's rotated matrix is cut into 16x16 tiles; tile (i, j) is a circular bit stream of
// 256*K bits stored as 8*K little-endian 32-bit words. Weight t of a tile has the state s_t = the
// L bits starting at bit t*K (wrapping around). Two codes, each with its own tile layout:
//   code 1, layout 1: weight t at row t mod 16, column t div 16;
//                     value = bytesum((A*s + B) mod 2^32) - 510
//   code 2, layout 2: weight t at row (t div 4) mod 16, column 4*(t div 64) + t mod 4 (L = 12);
//                     a = s & 127, b = (s >> 5) & 127, value = Ta[(a+b) & 127] + Tb[(a-b) & 127]
//                     with Ta, Tb the layer's int8 tables (tcode[0:128], tcode[128:256]).
//
// Header-only and __host__ __device__ under nvcc, so the scalar CPU kernels (and the CPU tests)
// run exactly the decode the CUDA kernels run.
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define EXL_THD __host__ __device__ __forceinline__
#else
#define EXL_THD inline
#endif

namespace exl {

constexpr int kTile = 16;                    // a tile is 16 outputs x 16 inputs
constexpr int kTileWeights = kTile * kTile;  // 256 weights, one walk
constexpr int kTrellisCentre = 510;          // 4 bytes of 0..255 sum to 0..1020
constexpr int kCodeLcgByteSum = 1;           // code 1 (§7.3), tile layout 1
constexpr int kCodeTwoTable = 2;             // code 2 (§7.3), tile layout 2, L = 12, K <= 7
constexpr int kTwoTableSize = 128;

// The contents of tmeta (and tcode) (docs/format.md §7.1) the kernels need.
struct TrellisCode {
  int bits;        // K: bits per weight, 1..8
  int state_bits;  // L: state bits, max(8, K)..16
  uint32_t mul;    // A (odd; code 1)
  uint32_t add;    // B (code 1)
  int code = kCodeLcgByteSum;     // 1 or 2; the tile layout is the code's own
  const int8_t* tables = nullptr;  // code 2: Ta = tables[0..127], Tb = tables[128..255] (host or device memory)
};

// 32-bit words of one tile's stream.
EXL_THD constexpr int tile_words(int bits) { return kTileWeights * bits / 32; }

// The state of weight t (0..255) of the tile whose words are w.
EXL_THD uint32_t trellis_state(const uint32_t* w, int t, const TrellisCode& c) {
  const int n = tile_words(c.bits);
  const int bit = t * c.bits;  // < 256*K: no wrap of the start
  const int a = bit >> 5, sh = bit & 31;
  const uint64_t pair = uint64_t(w[a]) | (uint64_t(w[a + 1 < n ? a + 1 : 0]) << 32);
  return uint32_t(pair >> sh) & ((1u << c.state_bits) - 1u);
}

// The code (§7.3): code 1 an integer in [-510, 510], code 2 in [-256, 254].
EXL_THD int trellis_value(uint32_t state, const TrellisCode& c) {
  if (c.code == kCodeTwoTable) {
    const uint32_t a = state & 127u, b = (state >> 5) & 127u;
    return int(c.tables[(a + b) & 127u]) + int(c.tables[kTwoTableSize + ((a - b) & 127u)]);
  }
  const uint32_t x = c.mul * state + c.add;
  return int(x & 255u) + int((x >> 8) & 255u) + int((x >> 16) & 255u) + int(x >> 24) - kTrellisCentre;
}

// Where weight t (0..255) of a tile sits: its row (0..15) and column (0..15) inside the tile (§7.2).
EXL_THD int trellis_row(int t, const TrellisCode& c) { return c.code == kCodeTwoTable ? (t >> 2) & 15 : t & 15; }
EXL_THD int trellis_col(int t, const TrellisCode& c) {
  return c.code == kCodeTwoTable ? 4 * (t >> 6) + (t & 3) : t >> 4;
}

}  // namespace exl
