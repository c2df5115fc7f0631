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
//   code 3, layout 2: the same with 64-entry tables: a = s & 63, b = (s >> 6) & 63,
//                     value = Ta[(a+b) & 63] + Tb[(a-b) & 63], Ta = tcode[0:64], Tb = tcode[64:128].
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
constexpr int kCodeTwoTable64 = 3;           // code 3 (§7.3), the same with 64-entry tables
constexpr int kTwoTableSize = 128;           // entries per table: code 2 128, code 3 64

// Whether a code is a two-table code (2 or 3), the entries of each of its tables, and where b starts.
EXL_THD constexpr bool is_two_table(int code) { return code == kCodeTwoTable || code == kCodeTwoTable64; }
EXL_THD constexpr int two_table_size(int code) { return code == kCodeTwoTable64 ? 64 : 128; }
EXL_THD constexpr int two_table_shift(int code) { return code == kCodeTwoTable64 ? 6 : 5; }

// The contents of tmeta (and tcode) (docs/format.md §7.1) the kernels need.
struct TrellisCode {
  int bits;        // K: bits per weight, 1..8
  int state_bits;  // L: state bits, max(8, K)..16
  uint32_t mul;    // A (odd; code 1)
  uint32_t add;    // B (code 1)
  int code = kCodeLcgByteSum;     // 1, 2 or 3; the tile layout is the code's own
  const int8_t* tables = nullptr;  // codes 2, 3: Ta then Tb, two_table_size(code) each (host or device memory)
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

// The code (§7.3): code 1 an integer in [-510, 510], codes 2 and 3 in [-256, 254].
EXL_THD int trellis_value(uint32_t state, const TrellisCode& c) {
  if (is_two_table(c.code)) {
    const uint32_t n = uint32_t(two_table_size(c.code)), m = n - 1u;
    const uint32_t a = state & m, b = (state >> two_table_shift(c.code)) & m;
    return int(c.tables[(a + b) & m]) + int(c.tables[n + ((a - b) & m)]);
  }
  const uint32_t x = c.mul * state + c.add;
  return int(x & 255u) + int((x >> 8) & 255u) + int((x >> 16) & 255u) + int(x >> 24) - kTrellisCentre;
}

// Where weight t (0..255) of a tile sits: its row (0..15) and column (0..15) inside the tile (§7.2).
EXL_THD int trellis_row(int t, const TrellisCode& c) { return is_two_table(c.code) ? (t >> 2) & 15 : t & 15; }
EXL_THD int trellis_col(int t, const TrellisCode& c) {
  return is_two_table(c.code) ? 4 * (t >> 6) + (t & 3) : t >> 4;
}

}  // namespace exl
