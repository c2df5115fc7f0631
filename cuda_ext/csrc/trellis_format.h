// The exl trellis-coded layout (docs/format.md §7), decoded by CPU and CUDA kernels alike.
//
// A layer's rotated matrix is cut into 16x16 tiles; tile (i, j) is a circular bit stream of
// 256*K bits stored as 8*K little-endian 32-bit words. Weight t of a tile (row t mod 16, column
// t div 16) has the state s_t = the L bits starting at bit t*K (wrapping around), and the value
// code(s) = bytesum((A*s + B) mod 2^32) - 510.
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

// The contents of tmeta (docs/format.md §7.1) the kernels need.
struct TrellisCode {
  int bits;        // K: bits per weight, 1..8
  int state_bits;  // L: state bits, max(8, K)..16
  uint32_t mul;    // A (odd)
  uint32_t add;    // B
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

// The computed code (§7.3): an integer in [-510, 510].
EXL_THD int trellis_value(uint32_t state, const TrellisCode& c) {
  const uint32_t x = c.mul * state + c.add;
  return int(x & 255u) + int((x >> 8) & 255u) + int((x >> 16) & 255u) + int(x >> 24) - kTrellisCentre;
}

}  // namespace exl
