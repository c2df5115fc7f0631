// The exl packed-code layout (docs/format.md §1.3), decoded by CPU and CUDA kernels alike.
//
// A block of 32 b-bit codes takes 4*b bytes, split into bit planes of widths 8, 4, 2, 1 (those
// in b's binary expansion, largest first, the largest holding the lowest code bits). In a plane
// of width p, code i sits in byte (i mod 4p) at bit offset p*(i div 4p).
//
// Everything here is header-only, branch-free once BITS is a template argument, and marked
// __host__ __device__ under nvcc so the scalar CPU kernels (and therefore the CPU tests) run
// exactly the decode the CUDA kernels run.
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define EXL_HD __host__ __device__ __forceinline__
#else
#define EXL_HD inline
#endif

namespace exl {

constexpr int kBlock = 32;  // codes per packed block

// Bytes of one packed block of `bits`-bit codes.
EXL_HD constexpr int block_bytes(int bits) { return 4 * bits; }

// The grid centre: w = scale * (q - code_offset(bits)).
EXL_HD constexpr float code_offset(int bits) { return 0.5f * float((1 << bits) - 1); }

// Field of code i (0..31) in a plane of width P whose 4*P bytes are the little-endian words w.
template <int P>
EXL_HD uint32_t plane_field(const uint32_t* w, int i) {
  const int byte = i % (4 * P);
  const int shift = 8 * (byte % 4) + P * (i / (4 * P));
  return (w[byte / 4] >> shift) & ((1u << P) - 1u);
}

// Word index (into the block's words) where the plane of width P starts, for BITS-bit codes.
template <int BITS, int P>
EXL_HD constexpr int plane_word(void) {
  return (P == 8 || P == 4 ? 0 : (P == 2 ? (BITS & 4) : (BITS & 6)));
}

// Lowest code bit held by the plane of width P (the planes above it hold the bits below).
template <int BITS, int P>
EXL_HD constexpr int plane_shift(void) {
  return plane_word<BITS, P>();  // a plane's word offset equals the number of bits before it
}

// Code i (0..31) of one block given its BITS words (4*BITS bytes, little-endian).
template <int BITS>
EXL_HD uint32_t block_code(const uint32_t* w, int i) {
  uint32_t q = 0;
  if (BITS & 8) q |= plane_field<8>(w + plane_word<BITS, 8>(), i) << plane_shift<BITS, 8>();
  if (BITS & 4) q |= plane_field<4>(w + plane_word<BITS, 4>(), i) << plane_shift<BITS, 4>();
  if (BITS & 2) q |= plane_field<2>(w + plane_word<BITS, 2>(), i) << plane_shift<BITS, 2>();
  if (BITS & 1) q |= plane_field<1>(w + plane_word<BITS, 1>(), i) << plane_shift<BITS, 1>();
  return q;
}

// All 32 codes of one block.
template <int BITS>
EXL_HD void decode_block(const uint32_t* w, uint32_t* codes) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int i = 0; i < kBlock; ++i) codes[i] = block_code<BITS>(w, i);
}

// Load a block's words from bytes (any alignment on the host; 4-byte aligned on the device).
template <int BITS>
EXL_HD void load_block_words(const uint8_t* p, uint32_t* w) {
#if defined(__CUDA_ARCH__)
  const uint32_t* p32 = reinterpret_cast<const uint32_t*>(p);
#pragma unroll
  for (int t = 0; t < BITS; ++t) w[t] = __ldg(p32 + t);
#else
  for (int t = 0; t < BITS; ++t)
    w[t] = uint32_t(p[4 * t]) | (uint32_t(p[4 * t + 1]) << 8) | (uint32_t(p[4 * t + 2]) << 16) |
           (uint32_t(p[4 * t + 3]) << 24);
#endif
}

// Sign bit i of a packed sign vector (bit i%8 of byte i/8; set means -1).
EXL_HD float sign_at(const uint8_t* s, int64_t i) { return ((s[i >> 3] >> (i & 7)) & 1) ? -1.0f : 1.0f; }

// Hadamard block size on n channels: the largest power of two dividing n, at most 128.
EXL_HD int64_t hadamard_block(int64_t n) {
  const int64_t b = n & -n;
  return b < 128 ? b : 128;
}

// A row's segment table (docs/format.md §1.1) with running offsets, as kernels need it.
constexpr int kMaxSegments = 16;
struct Segment {
  int k_len, bits, group_size;
  int k_start;      // first channel (permuted order)
  int byte_start;   // first byte inside a row
  int group_start;  // first scale group
};
struct SegmentTable {
  int count;
  Segment seg[kMaxSegments];
};

}  // namespace exl
