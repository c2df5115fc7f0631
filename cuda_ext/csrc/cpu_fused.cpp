// Fused float32 CPU ops for the decode fast path (exl/modules/fused.py): one call each instead of
// a chain of small torch ops. Every op has a plain-PyTorch reference in exl/modules and a test
// against it (tests/test_fused.py). They read the caller's tensors in place (no copies) and write
// results over an input where the op says so (a non-contiguous one gets a new tensor instead).
//
//   rms_norm(x, w, eps)                      y = x / rms(x) * w over the last dim
//   add_rms_norm(x, residual, w, eps, xw)    s = (xw ? rms_norm(x, xw) : x) + residual, written over
//                                            x; returns (s, rms_norm(s, w) or None without w)
//   rope_(q, k, cos, sin, qw, kw, eps)       optional per-head RMSNorm, then rotate-half RoPE on
//                                            the first cos.size(-1) channels of q and k, in place
//   decode_attention(q, k, v, kc, vc, ...)   store T tokens' k, v at `pos` of a contiguous cache, then
//                                            each query row attends causally over its kept keys (GQA)
//   paged_attention(q, ks, vs, pages, seqs, positions, ...)
//                                            query rows of any sequences attend causally over their
//                                            pages of a paged store, in place (GQA)
//   paged_step_attention(q, k, v, ks, vs, pages, lengths, ...)
//                                            one decode token of each of B sequences: store k, v in
//                                            its page, then paged_attention
//
// Every attention runs one kernel loop (attend_tile) over a list of key offsets, whatever the layout
// (contiguous cache, page table) and however many query rows a sequence has: a query row's result is
// bit for bit the same alone, batched, in a prompt chunk or as a verified draft (per ISA table).
//   act_mul(gate, up, act)                   act(gate) * up, written over gate
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#endif

#include "cpu_fused.h"
#include "cpu_isa.h"
#include "cpu_pool.h"

namespace exl {
namespace fused {
namespace {

void check_f32_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.defined(), "exl ", op, ": ", name, " is undefined");
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "exl ", op, ": ", name,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

void check_weight(const at::Tensor& w, int64_t d, const char* op, const char* name) {
  check_f32_cpu(w, op, name);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == d && w.stride(0) == 1, "exl ", op, ": ", name, " must be a contiguous [",
              d, "] vector, got shape ", w.sizes());
}

// Rows of at least this many values are split across threads; smaller ones run serially, where
// a thread pool hand-off costs more than the work.
constexpr int64_t kGrainValues = 32768;

int64_t grain_rows(int64_t d) { return std::max<int64_t>(1, kGrainValues / std::max<int64_t>(d, 1)); }

inline float inv_rms(const float* x, int64_t d, float eps) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += x[i] * x[i];
  return 1.f / std::sqrt(s / float(d) + eps);
}

// y = (x * r) * w, the reference's order of roundings.
inline void scale_row(const float* x, float r, const float* w, float* y, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] = (x[i] * r) * w[i];
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_f32_cpu(x, "rms_norm", "x");
  TORCH_CHECK(x.dim() >= 1, "exl rms_norm: x must have at least one dimension");
  const int64_t d = x.size(-1);
  check_weight(weight, d, "rms_norm", "weight");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t rows = d ? xc.numel() / d : 0;
  const float* px = xc.data_ptr<float>();
  const float* pw = weight.data_ptr<float>();
  float* py = y.data_ptr<float>();
  const float e = float(eps);
  exl::cpu::parallel_for(0, rows, grain_rows(d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) scale_row(px + r * d, inv_rms(px + r * d, d, e), pw, py + r * d, d);
  });
  return y;
}

std::tuple<at::Tensor, c10::optional<at::Tensor>> add_rms_norm(at::Tensor& x, const at::Tensor& residual,
                                                              const c10::optional<at::Tensor>& weight, double eps,
                                                              const c10::optional<at::Tensor>& x_weight) {
  check_f32_cpu(x, "add_rms_norm", "x");
  check_f32_cpu(residual, "add_rms_norm", "residual");
  TORCH_CHECK(x.dim() >= 1 && residual.sizes() == x.sizes(), "exl add_rms_norm: residual has shape ",
              residual.sizes(), ", x has ", x.sizes());
  const int64_t d = x.size(-1);
  const bool has_w = weight && weight->defined(), has_xw = x_weight && x_weight->defined();
  if (has_w) check_weight(*weight, d, "add_rms_norm", "weight");
  if (has_xw) check_weight(*x_weight, d, "add_rms_norm", "x_weight");
  const bool in_place = x.is_contiguous();
  const at::Tensor xc = x.contiguous(), rc = residual.contiguous();
  at::Tensor sum = in_place ? x : at::empty_like(xc);
  at::Tensor y = has_w ? at::empty_like(xc) : at::Tensor();
  const int64_t rows = d ? x.numel() / d : 0;
  const float* px = xc.data_ptr<float>();
  const float* pr = rc.data_ptr<float>();
  float* pz = sum.data_ptr<float>();
  const float* pw = has_w ? weight->data_ptr<float>() : nullptr;
  const float* pxw = has_xw ? x_weight->data_ptr<float>() : nullptr;
  float* py = has_w ? y.data_ptr<float>() : nullptr;
  const float e = float(eps);
  exl::cpu::parallel_for(0, rows, grain_rows(d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = px + r * d;
      const float* rr = pr + r * d;
      float* zr = pz + r * d;
      if (pxw) {
        const float s = inv_rms(xr, d, e);
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) zr[i] = (xr[i] * s) * pxw[i] + rr[i];
      } else {
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) zr[i] = xr[i] + rr[i];
      }
      if (py) scale_row(zr, inv_rms(zr, d, e), pw, py + r * d, d);
    }
  });
  return {sum, has_w ? c10::optional<at::Tensor>(y) : c10::nullopt};
}

// In place on one head vector: optional RMSNorm (weight w), then rotate-half RoPE over the first
// 2*half channels: out = x * cos + cat(-x2, x1) * sin, multiplied and added as the reference does.
inline void norm_rope_head(float* x, int64_t d, const float* w, float eps, const float* cs, const float* sn,
                           int64_t half) {
  if (w) scale_row(x, inv_rms(x, d, eps), w, x, d);
  float* x1 = x;
  float* x2 = x + half;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = x1[i], b = x2[i];
    x1[i] = a * cs[i] + (-b) * sn[i];
    x2[i] = b * cs[half + i] + a * sn[half + i];
  }
}

void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
           const c10::optional<at::Tensor>& q_weight, const c10::optional<at::Tensor>& k_weight, double eps) {
  const char* op = "rope_";
  check_f32_cpu(q, op, "q");
  check_f32_cpu(k, op, "k");
  check_f32_cpu(cos, op, "cos");
  check_f32_cpu(sin, op, "sin");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "exl rope_: q and k must be [batch, tokens, heads, head_dim], got ",
              q.sizes(), " and ", k.sizes());
  const int64_t b = q.size(0), t = q.size(1), hq = q.size(2), d = q.size(3), hk = k.size(2);
  TORCH_CHECK(k.size(0) == b && k.size(1) == t && k.size(3) == d, "exl rope_: k ", k.sizes(),
              " does not match q ", q.sizes());
  TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(1) == t && (cos.size(0) == b || cos.size(0) == 1),
              "exl rope_: cos and sin must be [batch or 1, tokens, rotary_dim] matching q ", q.sizes(), ", got ",
              cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1, "exl rope_: the head_dim of q and k must be contiguous");
  const int64_t rot = cos.size(2);
  TORCH_CHECK(rot % 2 == 0 && rot <= d, "exl rope_: rotary_dim ", rot, " must be even and at most head_dim ", d);
  TORCH_CHECK(cos.stride(2) == 1 && sin.stride(2) == 1 && cos.strides() == sin.strides(),
              "exl rope_: cos and sin need equal strides and a contiguous last dim");
  const bool qw = q_weight && q_weight->defined(), kw = k_weight && k_weight->defined();
  TORCH_CHECK(qw == kw, "exl rope_: give both q_weight and k_weight (per-head RMSNorm) or neither");
  if (qw) {
    check_weight(*q_weight, d, op, "q_weight");
    check_weight(*k_weight, d, op, "k_weight");
  }
  float* pq = q.data_ptr<float>();
  float* pk = k.data_ptr<float>();
  const float* pc = cos.data_ptr<float>();
  const float* ps = sin.data_ptr<float>();
  const float* pqw = qw ? q_weight->data_ptr<float>() : nullptr;
  const float* pkw = kw ? k_weight->data_ptr<float>() : nullptr;
  const int64_t cb = cos.size(0) == 1 ? 0 : cos.stride(0), ct = cos.stride(1);
  const float e = float(eps);
  const int64_t heads = hq + hk;
  exl::cpu::parallel_for(0, b * t, grain_rows(heads * d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t bi = r / t, ti = r % t, off = bi * cb + ti * ct;
      float* qr = pq + bi * q.stride(0) + ti * q.stride(1);
      float* kr = pk + bi * k.stride(0) + ti * k.stride(1);
      for (int64_t h = 0; h < hq; ++h) norm_rope_head(qr + h * q.stride(2), d, pqw, e, pc + off, ps + off, rot / 2);
      for (int64_t h = 0; h < hk; ++h) norm_rope_head(kr + h * k.stride(2), d, pkw, e, pc + off, ps + off, rot / 2);
    }
  });
}

// ---- Vectorizable kernels. Written as plain loops the compiler vectorizes; each is compiled three
// times (baseline x86-64, AVX2+FMA and AVX-512, see KERNEL_TABLE) and chosen at run time.

#define EXL_INLINE inline __attribute__((always_inline))
// Float-to-int conversions and selects in these loops vectorize only when GCC may assume that no
// floating-point exception is trapped (values are unaffected).
#pragma GCC optimize("no-trapping-math")

// exp(x) in float32 to about 1 ulp (Cody-Waite reduction, Cephes' degree-5 polynomial), written
// without library calls so that loops over it vectorize.
EXL_INLINE float exp_f32(float x) {
  x = x < -87.3365f ? -87.3365f : x > 88.7228f ? 88.7228f : x;
  const float n = (x * 1.44269504089f + 12582912.f) - 12582912.f;  // round to nearest
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  return y * __builtin_bit_cast(float, bits);
}

struct Silu {
  static EXL_INLINE float f(float x) { return x / (1.f + exp_f32(-x)); }
};
struct GeluTanh {  // 0.5 x (1 + tanh(y)), y = sqrt(2/pi) (x + 0.044715 x^3); 1 + tanh(y) = 2 / (1 + exp(-2y))
  static EXL_INLINE float f(float x) {
    const float y = 0.7978845608f * (x + 0.044715f * x * x * x);
    return x / (1.f + exp_f32(-2.f * y));
  }
};
struct GeluErf {
  static EXL_INLINE float f(float x) { return 0.5f * x * (1.f + std::erf(x * 0.70710678118f)); }
};
struct Relu {
  static EXL_INLINE float f(float x) { return x > 0.f ? x : 0.f; }
};

template <typename Act>
EXL_INLINE void act_mul_span(const float* g, const float* u, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = Act::f(g[i]) * u[i];
}

// Attention of one tile: up to W query vectors ("lanes": nrows consecutive rows x nheads query heads of one
// kv head group) over their keys, key j at row offset offs[j] from `keys` / `values` (a contiguous cache, a
// page table: the caller's layout is only in the offsets); row r of the tile keeps its first counts[r] keys.
// Lane l is query head (l % nheads) of row (l / nheads): q + (l / nheads) * rs + (l % nheads) * d, written
// to out at the same place (row stride os). s: scratch [W, max count].
//
// One summation order for every lane, whatever tile it lands in: a score is one sequential chain of
// multiply-adds over the head dim (the lanes run side by side in a vector, four keys at a time, but each
// lane's chain is its own); the softmax and the weighted sum of values run per lane over its own keys. So a
// query's result depends only on its query, its keys and values and their count: not on where they lie,
// how many rows its sequence brings, or what else runs beside it. D > 0 fixes the head dim at compile time.
// W floats side by side (one vector register of a table's ISA): V in registers, U for unaligned loads/stores.
template <int W>
struct Lanes;
template <>
struct Lanes<4> {
  typedef float V __attribute__((vector_size(16)));
  typedef float U __attribute__((vector_size(16), aligned(4)));
};
template <>
struct Lanes<8> {
  typedef float V __attribute__((vector_size(32)));
  typedef float U __attribute__((vector_size(32), aligned(4)));
};
template <>
struct Lanes<16> {
  typedef float V __attribute__((vector_size(64)));
  typedef float U __attribute__((vector_size(64), aligned(4)));
};

// Keys and values are float32 or fp16 (a float16 cache store, its bits as uint16_t here): Kv<W, T>::load reads W
// of them as floats, Kv<W, T>::row a row of d into float (a pointer to it for float32, else the converted copy in
// buf). fp16 is converted exactly (every fp16 is a float), by vcvtph2ps in the AVX2 and AVX-512 tables: those
// loaders are target functions left to the inliner (GCC refuses always_inline ones called from these templates).
inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
  uint32_t bits;
  if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = 113;
    uint32_t m = man;
    while (!(m & 1024)) m <<= 1, --e;
    bits = sign | (uint32_t(e) << 23) | ((m & 1023) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#pragma GCC diagnostic ignored "-Wpsabi"  // vector returns of these inlined helpers: no ABI is crossed
template <int W, class T>
struct Kv;
template <int W>
struct Kv<W, float> {
  static EXL_INLINE typename Lanes<W>::V load(const float* p) {
    return *reinterpret_cast<const typename Lanes<W>::U*>(p);
  }
  static EXL_INLINE const float* row(const float* p, int64_t, float*) { return p; }
};
template <>
struct Kv<4, uint16_t> {
  static EXL_INLINE Lanes<4>::V load(const uint16_t* p) {
    return Lanes<4>::V{fp16_to_f32(p[0]), fp16_to_f32(p[1]), fp16_to_f32(p[2]), fp16_to_f32(p[3])};
  }
  static EXL_INLINE const float* row(const uint16_t* p, int64_t d, float* buf) {
    for (int64_t i = 0; i < d; ++i) buf[i] = fp16_to_f32(p[i]);
    return buf;
  }
};
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define EXL_FP16_LOADER(W, TARGET, VEC_LOAD)                                                                 \
  template <>                                                                                               \
  struct Kv<W, uint16_t> {                                                                                  \
    static inline __attribute__((target(TARGET))) Lanes<W>::V load(const uint16_t* p) { return VEC_LOAD; } \
    static inline __attribute__((target(TARGET))) const float* row(const uint16_t* p, int64_t d, float* buf) { \
      int64_t i = 0;                                                                                        \
      for (; i + W <= d; i += W) *reinterpret_cast<Lanes<W>::U*>(buf + i) = load(p + i);                    \
      for (; i < d; ++i) buf[i] = _cvtsh_ss(p[i]);                                                          \
      return buf;                                                                                           \
    }                                                                                                       \
  };
EXL_FP16_LOADER(8, "avx2,fma,f16c", (Lanes<8>::V)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))
EXL_FP16_LOADER(16, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512",
                (Lanes<16>::V)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))))
#undef EXL_FP16_LOADER
#endif

// n floats -> fp16 bits, rounded to nearest even (as c10::Half and Tensor.half()): vcvtps2ph in the AVX2 and AVX-512
// tables (a new token's keys and values, stored into a float16 cache).
template <int W>
struct ToFp16 {
  static inline void run(const float* x, uint16_t* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = c10::Half(x[i]).x;
  }
};
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
template <>
struct ToFp16<8> {
  static inline __attribute__((target("avx2,fma,f16c"))) void run(const float* x, uint16_t* y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; ++i) y[i] = c10::Half(x[i]).x;
  }
};
template <>
struct ToFp16<16> {
  static inline __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512"))) void
  run(const float* x, uint16_t* y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i),
                          _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; ++i) y[i] = c10::Half(x[i]).x;
  }
};
#endif

// Decode tiles hold few query lanes (one row times a GQA group, e.g. 3 of 16): broadcasting each key element
// over a mostly empty register wastes most of every multiply-add. So with up to kKeyMajorLanes lanes the
// AVX-512 table turns 16 keys at a time around instead: load them, transpose each 16x16 block of (key,
// dimension) in registers, and run each query lane over all 16 keys at once. Every score is still the
// chain s = ((0 + q0 k0) + q1 k1) + ... in order of the dimension, one fused multiply-add per term, as in
// the lane-major loop below (a*b = b*a): the scores are bit for bit the same whichever loop computes them,
// so a row's attention does not depend on how many rows share its tile (speculative drafts, prompt chunks).
constexpr int64_t kKeyMajorLanes = 8;

typedef float V16 __attribute__((vector_size(64)));
typedef float U16 __attribute__((vector_size(64), aligned(4)));
typedef int I16 __attribute__((vector_size(64)));

// rows r[0..15] of a 16x16 block -> its transpose, in four rounds of two-source shuffles (block swaps of 8, 4, 2, 1).
EXL_INLINE void transpose16(V16* r) {
#define EXL_T16_ROUND(B)                                                                                  \
  {                                                                                                       \
    constexpr I16 lo = {MASK_LO(B, 0), MASK_LO(B, 1), MASK_LO(B, 2), MASK_LO(B, 3), MASK_LO(B, 4),        \
                        MASK_LO(B, 5), MASK_LO(B, 6), MASK_LO(B, 7), MASK_LO(B, 8), MASK_LO(B, 9),        \
                        MASK_LO(B, 10), MASK_LO(B, 11), MASK_LO(B, 12), MASK_LO(B, 13), MASK_LO(B, 14),   \
                        MASK_LO(B, 15)};                                                                  \
    constexpr I16 hi = {MASK_HI(B, 0), MASK_HI(B, 1), MASK_HI(B, 2), MASK_HI(B, 3), MASK_HI(B, 4),        \
                        MASK_HI(B, 5), MASK_HI(B, 6), MASK_HI(B, 7), MASK_HI(B, 8), MASK_HI(B, 9),        \
                        MASK_HI(B, 10), MASK_HI(B, 11), MASK_HI(B, 12), MASK_HI(B, 13), MASK_HI(B, 14),   \
                        MASK_HI(B, 15)};                                                                  \
    for (int i = 0; i < 16; ++i)                                                                          \
      if (!(i & B)) {                                                                                     \
        const V16 a = r[i], b = r[i + B];                                                                 \
        r[i] = __builtin_shuffle(a, b, lo);                                                               \
        r[i + B] = __builtin_shuffle(a, b, hi);                                                           \
      }                                                                                                   \
  }
// row i (i & B == 0) keeps its columns c with c & B == 0 and takes row i+B's columns c - B; row i+B the rest
#define MASK_LO(B, c) (((c) & (B)) ? 16 + (c) - (B) : (c))
#define MASK_HI(B, c) (((c) & (B)) ? 16 + (c) : (c) + (B))
  EXL_T16_ROUND(8)
  EXL_T16_ROUND(4)
  EXL_T16_ROUND(2)
  EXL_T16_ROUND(1)
#undef MASK_LO
#undef MASK_HI
#undef EXL_T16_ROUND
}

// Before the scores of keys [j, j + count): prefetch the keys kPrefetchKeys further on and these keys' values (read
// after the softmax). A long context's rows come page by page from memory; without it the loops wait on them
// (AVX-512, 16 sequences at 1,024 positions: 1.25x faster attention, float32 and fp16 stores alike).
constexpr int64_t kPrefetchKeys = 32;
template <class T>
EXL_INLINE void prefetch_rows(const T* keys, const T* values, const int64_t* offs, int64_t j, int64_t count, int64_t n,
                              int64_t d) {
  const int64_t bytes = d * int64_t(sizeof(T));
  for (int64_t r = j + kPrefetchKeys; r < j + kPrefetchKeys + count && r < n; ++r)
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(keys + offs[r]) + b);
  for (int64_t r = j; r < j + count && r < n; ++r)
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(values + offs[r]) + b);
}

// Scores of keys j0 .. j0 + 16*floor((j1 - j0)/16) - 1 for `lanes` query lanes (qf: the transposed queries, lane l
// of element i at qf[i*16 + l]) into s[l*n + j] (n: all the tile's keys), times scale. Returns the first key not done.
template <int D, class T>
EXL_INLINE int64_t scores_key_major(const float* qf, int64_t lanes, const T* keys, const int64_t* offs, int64_t j0,
                                   int64_t j1, int64_t n, float scale, float* s, const T* values) {
  int64_t j = j0;
  for (; j + 16 <= j1; j += 16) {
    prefetch_rows(keys, values, offs, j, 16, n, D);
    V16 acc[kKeyMajorLanes] = {};
    for (int64_t c = 0; c < D; c += 16) {
      V16 kt[16];
      for (int r = 0; r < 16; ++r) kt[r] = Kv<16, T>::load(keys + offs[j + r] + c);
      transpose16(kt);  // kt[i]: element c + i of the 16 keys
      for (int64_t l = 0; l < lanes; ++l)
        for (int i = 0; i < 16; ++i) acc[l] += qf[(c + i) * 16 + l] * kt[i];
    }
    for (int64_t l = 0; l < lanes; ++l) *reinterpret_cast<U16*>(s + l * n + j) = acc[l] * scale;
  }
  return j;
}

// out row a (at o + a * os_) = Σ_j (s[a * n + j] · inv[a]) v_j for g = G lanes at once, j in order: each value
// row is loaded once for all G lanes and their G·C multiply-add chains overlap.
template <int64_t G, int64_t C, int W, class T>
EXL_INLINE void weigh_values(const float* s, int64_t n, const float* inv, const T* values, const int64_t* offs,
                             int64_t m, float* o, int64_t os_) {
  using V = typename Lanes<W>::V;
  using U = typename Lanes<W>::U;
  V acc[G][C] = {};
  for (int64_t j = 0; j < m; ++j) {
    V vj[C];
    for (int64_t c = 0; c < C; ++c) vj[c] = Kv<W, T>::load(values + offs[j] + c * W);
    for (int64_t a = 0; a < G; ++a) {
      const float p = s[a * n + j] * inv[a];
      for (int64_t c = 0; c < C; ++c) acc[a][c] += p * vj[c];
    }
  }
  for (int64_t a = 0; a < G; ++a)
    for (int64_t c = 0; c < C; ++c) *reinterpret_cast<U*>(o + a * os_ + c * W) = acc[a][c];
}

// Scores of keys [j0, j1) of a tile (qf: its lanes' queries, transposed: lane l of element i at qf[i*W + l]) into
// s[l*n + j], times scale; j0 a multiple of 16. Every score is the same in-order chain whichever loop computes it,
// so a tile's scores may be computed in any split of its keys.
template <int D, int W, class T>
EXL_INLINE void tile_scores(const float* qf, int64_t lanes, const T* keys, const T* values, const int64_t* offs,
                            int64_t j0, int64_t j1, int64_t n, int64_t d_, float scale, float* s) {
  using V = typename Lanes<W>::V;
  using U = typename Lanes<W>::U;
  const int64_t d = D > 0 ? D : d_;
  const U* qt = reinterpret_cast<const U*>(qf);
  int64_t j = j0;
  if constexpr (W == 16 && D > 0 && D % 16 == 0) {
    if (lanes <= kKeyMajorLanes) j = scores_key_major<D>(qf, lanes, keys, offs, j0, j1, n, scale, s, values);
  }
  // fp16 rows are converted to float before the loops below read them element by element
  constexpr bool kF32 = std::is_same<T, float>::value;
  alignas(64) float kb_fixed[4][D > 0 && !kF32 ? D : 1];
  std::vector<float> kb_any(D > 0 || kF32 ? 0 : 4 * d);
  float* kb[4];
  for (int r = 0; r < 4; ++r) kb[r] = D > 0 ? kb_fixed[r] : kb_any.data() + r * d;
  for (; j + 4 <= j1; j += 4) {  // four keys at a time: four independent chains per lane
    prefetch_rows(keys, values, offs, j, 4, n, d);
    const float *k0 = Kv<W, T>::row(keys + offs[j], d, kb[0]), *k1 = Kv<W, T>::row(keys + offs[j + 1], d, kb[1]),
                *k2 = Kv<W, T>::row(keys + offs[j + 2], d, kb[2]), *k3 = Kv<W, T>::row(keys + offs[j + 3], d, kb[3]);
    V a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t i = 0; i < d; ++i) {
      a0 += qt[i] * k0[i];
      a1 += qt[i] * k1[i];
      a2 += qt[i] * k2[i];
      a3 += qt[i] * k3[i];
    }
    for (int64_t l = 0; l < lanes; ++l) {
      float* sl = s + l * n + j;
      sl[0] = a0[l] * scale, sl[1] = a1[l] * scale, sl[2] = a2[l] * scale, sl[3] = a3[l] * scale;
    }
  }
  for (; j < j1; ++j) {
    const float* kj = Kv<W, T>::row(keys + offs[j], d, kb[0]);
    V a = {};
    for (int64_t i = 0; i < d; ++i) a += qt[i] * kj[i];
    for (int64_t l = 0; l < lanes; ++l) s[l * n + j] = a[l] * scale;
  }
}

// One lane's softmax over its m scores sh (unnormalized: returns 1 / their sum), after the softcap if any.
EXL_INLINE float lane_softmax(float* sh, int64_t m, float softcap) {
  if (softcap > 0.f)
    for (int64_t j = 0; j < m; ++j) sh[j] = softcap * std::tanh(sh[j] / softcap);
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < m; ++j) mx = sh[j] > mx ? sh[j] : mx;  // (std::max would not inline into the AVX2 instance)
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < m; ++j) {
    sh[j] = exp_f32(sh[j] - mx);
    sum += sh[j];
  }
  return 1.f / sum;
}

// out = Σ_j p_j v_j for the lanes of a one-row tile (their output rows follow each other at o), output columns
// [c0·W, (c0 + C)·W) only: G lanes per pass over the values, C vectors per row. Each output element is its own
// chain in order of j, so any split of the columns gives the same bits.
template <int64_t C, int W, class T>
EXL_INLINE void weigh_row_lanes(const float* s, int64_t n, const float* inv, int64_t lanes, const T* values,
                                const int64_t* offs, int64_t m, int64_t d, int64_t c0, float* o) {
  constexpr int64_t R = W == 16 ? 16 : 8, G = C >= R ? 1 : std::min<int64_t>(4, R / C);  // R: accumulators
  for (int64_t l0 = 0; l0 < lanes;) {
    const int64_t g = std::min<int64_t>(G, lanes - l0);
    const T* v = values + c0 * W;
    float* ol = o + l0 * d + c0 * W;
    switch (g) {
      case 4: weigh_values<4, C, W, T>(s + l0 * n, n, inv + l0, v, offs, m, ol, d); break;
      case 3: weigh_values<3, C, W, T>(s + l0 * n, n, inv + l0, v, offs, m, ol, d); break;
      case 2: weigh_values<2, C, W, T>(s + l0 * n, n, inv + l0, v, offs, m, ol, d); break;
      default: weigh_values<1, C, W, T>(s + l0 * n, n, inv + l0, v, offs, m, ol, d); break;
    }
    l0 += g;
  }
}

// A tile's queries transposed, as tile_scores reads them: qf[i*W + l] is element i of lane l's query (lane l: row
// l / nheads at q + (l / nheads) * rs, head l % nheads), 0 for the lanes past nrows * nheads.
EXL_INLINE void transpose_queries(const float* q, int64_t rs, int64_t nrows, int64_t nheads, int64_t d, int64_t W,
                                  float* qf) {
  const int64_t lanes = nrows * nheads;
  for (int64_t i = 0; i < d; ++i)
    for (int64_t l = 0; l < W; ++l) qf[i * W + l] = l < lanes ? q[(l / nheads) * rs + (l % nheads) * d + i] : 0.f;
}

template <int D, int W, class T>
EXL_INLINE void attend_tile(const float* q, int64_t rs, int64_t nrows, int64_t nheads, const T* keys,
                            const T* values, const int64_t* offs, const int64_t* counts, int64_t d_,
                            float scale, float softcap, float* s, float* out, int64_t os) {
  using V = typename Lanes<W>::V;
  const int64_t d = D > 0 ? D : d_, lanes = nrows * nheads;
  int64_t n = 0;
  for (int64_t r = 0; r < nrows; ++r) n = counts[r] > n ? counts[r] : n;
  V qt_fixed[D > 0 ? D : 1];  // the lanes' queries, transposed: lane l of qt[i] is element i of lane l's query
  std::vector<float> qt_any(D > 0 ? 0 : d * W);
  float* qf = D > 0 ? reinterpret_cast<float*>(qt_fixed) : qt_any.data();
  transpose_queries(q, rs, nrows, nheads, d, W, qf);
  tile_scores<D, W, T>(qf, lanes, keys, values, offs, 0, n, n, d, scale, s);
  float inv[W];
  for (int64_t l = 0; l < lanes; ++l) inv[l] = lane_softmax(s + l * n, counts[l / nheads], softcap);
  // out = Σ_j p_j v_j per lane, in order of j. With D known the output rows live in registers across the loop
  // over values; a decode tile (one row: every lane has the same keys) runs G lanes per pass over the values,
  // so that each value row is loaded once for them and their G * D/W chains overlap. The same per-lane sums.
  if constexpr (D > 0 && D % W == 0) {
    if (nrows == 1) {
      weigh_row_lanes<D / W, W, T>(s, n, inv, lanes, values, offs, counts[0], d, 0, out);
    } else {
      for (int64_t l = 0; l < lanes; ++l)
        weigh_values<1, D / W, W, T>(s + l * n, n, inv + l, values, offs, counts[l / nheads],
                                     out + (l / nheads) * os + (l % nheads) * d, d);
    }
  } else {
    alignas(64) float kb[D > 0 ? D : 1];
    std::vector<float> kb_any(D > 0 ? 0 : d);
    float* buf = D > 0 ? kb : kb_any.data();
    for (int64_t l = 0; l < lanes; ++l) {
      const int64_t m = counts[l / nheads];
      const float* sh = s + l * n;
      float* oh = out + (l / nheads) * os + (l % nheads) * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) oh[i] = 0.f;
      for (int64_t j = 0; j < m; ++j) {
        const float p = sh[j] * inv[l];
        const float* vj = Kv<W, T>::row(values + offs[j], d, buf);
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) oh[i] += p * vj[i];
      }
    }
  }
}

// A one-row tile split over threads (a long context's single decode row): its scores by key ranges, its lanes'
// softmax, then its output by column halves, with tile_scores, lane_softmax and weigh_row_lanes as attend_tile
// (so the same bits). Head dims 64 and 128.
template <int D, int W, class T>
EXL_INLINE void split_weigh(const float* s, int64_t n, const float* inv, int64_t lanes, const T* values,
                            const int64_t* offs, int64_t half, float* o) {
  constexpr int64_t C = D / W / 2;
  weigh_row_lanes<C, W, T>(s, n, inv, lanes, values, offs, n, D, half * C, o);
}

template <class T>
using AttendFn = void (*)(const float*, int64_t, int64_t, int64_t, const T*, const T*, const int64_t*,
                          const int64_t*, int64_t, float, float, float*, float*, int64_t);
template <class T>
using SplitScoresFn = void (*)(const float*, int64_t, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t,
                               int64_t, float, float*);
using SplitSoftmaxFn = float (*)(float*, int64_t, float);
template <class T>
using SplitWeighFn = void (*)(const float*, int64_t, const float*, int64_t, const T*, const int64_t*, int64_t, int64_t,
                              float*);
using ActMulFn = void (*)(const float*, const float*, float*, int64_t);
using ToFp16Fn = void (*)(const float*, uint16_t*, int64_t);

struct Kernels {
  const char* name;
  int64_t lanes;  // query vectors per attention tile (one vector register's floats)
  AttendFn<float> attend;        // over float32 keys and values
  AttendFn<uint16_t> attend_h;   // over fp16 ones (a float16 cache store)
  // one-row tiles split over threads (attend_listed): scores of a key range, a lane's softmax, a column half
  SplitScoresFn<float> split_scores;
  SplitScoresFn<uint16_t> split_scores_h;
  SplitSoftmaxFn split_softmax;
  SplitWeighFn<float> split_weigh;
  SplitWeighFn<uint16_t> split_weigh_h;
  ActMulFn silu_mul, gelu_tanh_mul, gelu_mul, relu_mul;
  ToFp16Fn to_fp16;  // floats -> fp16 bits, rounded to nearest even

  const AttendFn<float>& attend_for(const float*) const { return attend; }
  const AttendFn<uint16_t>& attend_for(const uint16_t*) const { return attend_h; }
  const SplitScoresFn<float>& scores_for(const float*) const { return split_scores; }
  const SplitScoresFn<uint16_t>& scores_for(const uint16_t*) const { return split_scores_h; }
  const SplitWeighFn<float>& weigh_for(const float*) const { return split_weigh; }
  const SplitWeighFn<uint16_t>& weigh_for(const uint16_t*) const { return split_weigh_h; }
};

#define KERNEL_TABLE(NAME, ATTR, W)                                                                             \
  template <class T>                                                                                            \
  ATTR void attend_##NAME(const float* q, int64_t rs, int64_t nrows, int64_t nheads, const T* k, const T* v,   \
                          const int64_t* offs, const int64_t* counts, int64_t d, float scale, float softcap,     \
                          float* s, float* out, int64_t os) {                                                   \
    if (d == 64)                                                                                                \
      attend_tile<64, W, T>(q, rs, nrows, nheads, k, v, offs, counts, d, scale, softcap, s, out, os);           \
    else if (d == 128)                                                                                          \
      attend_tile<128, W, T>(q, rs, nrows, nheads, k, v, offs, counts, d, scale, softcap, s, out, os);          \
    else                                                                                                        \
      attend_tile<0, W, T>(q, rs, nrows, nheads, k, v, offs, counts, d, scale, softcap, s, out, os);            \
  }                                                                                                             \
  template <class T>                                                                                            \
  ATTR void split_scores_##NAME(const float* qf, int64_t lanes, const T* k, const T* v, const int64_t* offs,   \
                                int64_t j0, int64_t j1, int64_t n, int64_t d, float scale, float* s) {         \
    if (d == 64)                                                                                                \
      tile_scores<64, W, T>(qf, lanes, k, v, offs, j0, j1, n, d, scale, s);                                     \
    else                                                                                                        \
      tile_scores<128, W, T>(qf, lanes, k, v, offs, j0, j1, n, d, scale, s);                                    \
  }                                                                                                             \
  ATTR float split_softmax_##NAME(float* sh, int64_t m, float softcap) { return lane_softmax(sh, m, softcap); }  \
  template <class T>                                                                                            \
  ATTR void split_weigh_##NAME(const float* s, int64_t n, const float* inv, int64_t lanes, const T* v,          \
                               const int64_t* offs, int64_t d, int64_t half, float* o) {                        \
    if (d == 64)                                                                                                \
      split_weigh<64, W, T>(s, n, inv, lanes, v, offs, half, o);                                                \
    else                                                                                                        \
      split_weigh<128, W, T>(s, n, inv, lanes, v, offs, half, o);                                               \
  }                                                                                                             \
  ATTR void silu_mul_##NAME(const float* g, const float* u, float* o, int64_t n) { act_mul_span<Silu>(g, u, o, n); } \
  ATTR void gelu_tanh_mul_##NAME(const float* g, const float* u, float* o, int64_t n) {                         \
    act_mul_span<GeluTanh>(g, u, o, n);                                                                         \
  }                                                                                                             \
  ATTR void gelu_mul_##NAME(const float* g, const float* u, float* o, int64_t n) { act_mul_span<GeluErf>(g, u, o, n); } \
  ATTR void relu_mul_##NAME(const float* g, const float* u, float* o, int64_t n) { act_mul_span<Relu>(g, u, o, n); } \
  ATTR void to_fp16_##NAME(const float* x, uint16_t* y, int64_t n) { ToFp16<W>::run(x, y, n); }                  \
  const Kernels k##NAME = {#NAME,                                                                                \
                           W,                                                                                    \
                           attend_##NAME<float>,                                                                 \
                           attend_##NAME<uint16_t>,                                                              \
                           split_scores_##NAME<float>,                                                           \
                           split_scores_##NAME<uint16_t>,                                                        \
                           split_softmax_##NAME,                                                                 \
                           split_weigh_##NAME<float>,                                                            \
                           split_weigh_##NAME<uint16_t>,                                                         \
                           silu_mul_##NAME,                                                                      \
                           gelu_tanh_mul_##NAME,                                                                 \
                           gelu_mul_##NAME,                                                                      \
                           relu_mul_##NAME,                                                                      \
                           to_fp16_##NAME};

KERNEL_TABLE(scalar, , 4)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
KERNEL_TABLE(avx2, __attribute__((target("avx2,fma,f16c"))), 8)
KERNEL_TABLE(avx512,
             __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512"))), 16)
constexpr const Kernels* kAvx2 = &kavx2;
constexpr const Kernels* kAvx512 = &kavx512;
#else
constexpr const Kernels* kAvx2 = nullptr;
constexpr const Kernels* kAvx512 = nullptr;
#endif

// The kernels for an isa of cpu_isa.h ("auto": EXL_CPU_ISA or the best level): the best table this
// build has at or below that level (the fused ops use no VNNI: avxvnni runs the avx2 table).
const Kernels* kernels(const std::string& name, const char* op) {
  isa::Level level;
  std::string error;
  TORCH_CHECK(isa::resolve(name, &level, &error), "exl ", op, ": ", error);
  if (level >= isa::kAvx512Vnni && kAvx512) return kAvx512;
  if (level >= isa::kAvx2 && kAvx2) return kAvx2;
  return &kscalar;
}

// The name of the fused table an isa request runs ("scalar", "avx2" or "avx512").
std::string fused_isa(const std::string& name) { return kernels(name, "fused_isa")->name; }

// What a batch of query rows attends over: row r's keys lie at offs[first[r] + j], j < count[r], from each kv
// head's base (the offsets are shared by the kv heads). Built by a layout (contiguous cache, page table) and
// handed to attend_listed.
struct KeyLists {
  std::vector<int64_t> offs, first, count;
};

// A tile of attend_listed: rows row .. row + nrows - 1 (one sequence) times query heads head .. of a kv head's group.
struct Tile {
  int64_t row, nrows, head;
};

// One decode row over a long context, when its tiles (one per kv head and group of query heads) are fewer than twice
// the threads: a tile a thread would take the whole of would leave the others idle (SmolLM2's 3 kv heads on 2
// threads: 2 + 1). So the threads share each tile's work instead, in three passes: the scores by ranges of
// kSplitBlock keys, the lanes' softmax, the output by column halves; with attend_tile's own pieces (tile_scores,
// lane_softmax, weigh_row_lanes), so a row's result is bit for bit what one thread gives. tiles: attend_listed's
// (one row, so one per query-head group); item i is tile i / hk of kv head i % hk, as there.
constexpr int64_t kSplitKeys = 1024, kSplitBlock = 256;
std::atomic<int64_t> split_rows{0};  // rows attended this way (a test reads it)

template <class E>
void attend_split(const Kernels* kern, const float* q, float* out, int64_t hq, int64_t hk, int64_t d, const E* kd,
                  const E* vd, int64_t hs, const KeyLists& keys, const std::vector<Tile>& tiles, float scale,
                  float softcap) {
  const int64_t g = hq / hk, W = kern->lanes, n = keys.count[0], heads = std::min(g, W);
  const int64_t* offs = keys.offs.data() + keys.first[0];
  const int64_t ni = int64_t(tiles.size()) * hk, blocks = (n + kSplitBlock - 1) / kSplitBlock;
  auto lanes_of = [&](int64_t i) { return std::min(heads, g - tiles[i / hk].head); };
  auto first_head = [&](int64_t i) { return (i % hk) * g + tiles[i / hk].head; };  // of item i, in q and out
  std::vector<std::pair<int64_t, int64_t>> lanes;  // (item, lane)
  for (int64_t i = 0; i < ni; ++i)
    for (int64_t l = 0; l < lanes_of(i); ++l) lanes.push_back({i, l});
  split_rows.fetch_add(1, std::memory_order_relaxed);
  thread_local std::vector<float> qf, sc, inv;  // grown, never shrunk: no zeroing per call
  if (qf.size() < size_t(ni * d * W)) qf.resize(ni * d * W);
  if (sc.size() < size_t(ni * heads * n)) sc.resize(ni * heads * n);
  if (inv.size() < size_t(ni * W)) inv.resize(ni * W);
  for (int64_t i = 0; i < ni; ++i)
    transpose_queries(q + first_head(i) * d, hq * d, 1, lanes_of(i), d, W, qf.data() + i * d * W);
  float *s = sc.data(), *qt = qf.data(), *iv = inv.data();  // (the workers' own thread_locals are other vectors)
  exl::cpu::parallel_for(0, ni * blocks, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t i = u / blocks, h = i % hk, j0 = (u % blocks) * kSplitBlock;
      kern->scores_for(kd)(qt + i * d * W, lanes_of(i), kd + h * hs, vd + h * hs, offs, j0,
                           std::min(n, j0 + kSplitBlock), n, d, scale, s + i * heads * n);
    }
  });
  exl::cpu::parallel_for(0, int64_t(lanes.size()), 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const auto [i, l] = lanes[u];
      iv[i * W + l] = kern->split_softmax(s + (i * heads + l) * n, n, softcap);
    }
  });
  exl::cpu::parallel_for(0, ni * 2, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t i = u / 2, h = i % hk;
      kern->weigh_for(kd)(s + i * heads * n, n, iv + i * W, lanes_of(i), vd + h * hs, offs, d, u % 2,
                          out + first_head(i) * d);
    }
  });
}

// T query rows q [T, Hq, D] (contiguous), each over its own listed keys, into out [T, Hq, D]: kv head h's keys
// and values (E: float, or uint16_t for fp16) start at kd + h * hs and vd + h * hs. Work items are tiles of one
// kv head: consecutive rows that share their list's start (the rows of one sequence) times the head group's query
// heads, up to the table's lanes. Tiles are taken from both ends in turn so that a causal prompt's short and long
// rows share each thread's chunk evenly.
template <class E>
void attend_listed(const Kernels* kern, const float* q, float* out, int64_t T, int64_t hq, int64_t hk, int64_t d,
                   const E* kd, const E* vd, int64_t hs, const KeyLists& keys, float scale, float softcap) {
  const int64_t g = hq / hk, W = kern->lanes;
  const int64_t heads = std::min(g, W), rows_per = std::max<int64_t>(1, W / g);
  std::vector<Tile> tiles;
  int64_t total = 0;
  for (int64_t r0 = 0; r0 < T;) {
    int64_t r1 = r0 + 1;
    while (r1 < T && r1 - r0 < rows_per && keys.first[r1] == keys.first[r0]) ++r1;
    for (int64_t h = 0; h < g; h += heads) tiles.push_back({r0, r1 - r0, h});
    for (int64_t r = r0; r < r1; ++r) total += keys.count[r];
    r0 = r1;
  }
  const int64_t n_tiles = int64_t(tiles.size());
  const int64_t threads = exl::cpu::parallel_threads();
  if (T == 1 && (d == 64 || d == 128) && keys.count[0] >= kSplitKeys && threads > 1 && n_tiles * hk < 2 * threads) {
    attend_split(kern, q, out, hq, hk, d, kd, vd, hs, keys, tiles, scale, softcap);
    return;
  }
  const int64_t work = g * std::max<int64_t>(total / std::max<int64_t>(T, 1), 1) * d * 2 * T / std::max<int64_t>(n_tiles, 1);
  // Split over threads only from ~0.5 M multiply-adds per chunk: below that a thread hand-off costs more than
  // it saves, and much more when the cores are oversubscribed.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 19) / std::max<int64_t>(work, 1));
  exl::cpu::parallel_for(0, n_tiles * hk, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> s;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t k = i / hk, h = i % hk;
      const Tile& t = tiles[k % 2 ? n_tiles - 1 - k / 2 : k / 2];
      int64_t n = 0;
      for (int64_t r = t.row; r < t.row + t.nrows; ++r) n = std::max(n, keys.count[r]);
      s.resize(W * n);
      const int64_t nheads = std::min(heads, g - t.head), off = (t.row * hq + h * g + t.head) * d;
      kern->attend_for(kd)(q + off, hq * d, t.nrows, nheads, kd + h * hs, vd + h * hs,
                           keys.offs.data() + keys.first[t.row], keys.count.data() + t.row, d, scale, softcap,
                           s.data(), out + off, hq * d);
    }
  });
}

// Store T new tokens' k, v [B, T, Hk, D] at positions pos .. pos + T - 1 of cache[layer], then each query row
// (b, t) of q [B, T, Hq, D] attends over positions [pos + t - window + 1, pos + t] (all from 0 when window <= 0)
// of its sequence: decode (T = 1), drafts and prompt chunks alike, through attend_listed.
at::Tensor decode_attention(const at::Tensor& q_, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                            at::Tensor& v_cache, int64_t layer, int64_t pos, double scale, int64_t window,
                            double softcap, const std::string& isa) {
  const char* op = "decode_attention";
  check_f32_cpu(q_, op, "q");
  check_f32_cpu(k, op, "k");
  check_f32_cpu(v, op, "v");
  check_f32_cpu(k_cache, op, "k_cache");
  check_f32_cpu(v_cache, op, "v_cache");
  TORCH_CHECK(q_.dim() == 4, "exl decode_attention: q must be [batch, tokens, heads, head_dim], got ", q_.sizes());
  const int64_t b = q_.size(0), t = q_.size(1), hq = q_.size(2), d = q_.size(3);
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "exl decode_attention: k_cache and v_cache must be alike [layers, batch, kv_heads, max_len, head_dim], "
              "got ", k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t hk = k_cache.size(2), max_len = k_cache.size(3);
  TORCH_CHECK(k_cache.size(1) == b && k_cache.size(4) == d && hk > 0 && hq % hk == 0,
              "exl decode_attention: cache ", k_cache.sizes(), " does not fit q ", q_.sizes(),
              " (batch, head_dim, and heads a multiple of kv_heads)");
  TORCH_CHECK(k.sizes() == v.sizes() && k.dim() == 4 && k.size(0) == b && k.size(1) == t && k.size(2) == hk &&
                  k.size(3) == d,
              "exl decode_attention: k and v must be [", b, ", ", t, ", ", hk, ", ", d, "], got ", k.sizes(), " and ",
              v.sizes());
  TORCH_CHECK(layer >= 0 && layer < k_cache.size(0), "exl decode_attention: layer ", layer, " out of range [0, ",
              k_cache.size(0), ")");
  TORCH_CHECK(pos >= 0 && pos + t <= max_len, "exl decode_attention: position ", pos + t - 1, " out of range [0, ",
              max_len, ")");
  TORCH_CHECK(k_cache.stride(4) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "exl decode_attention: the head_dim of k, v and the cache must be contiguous");
  const Kernels* kern = kernels(isa, op);
  const at::Tensor q = q_.contiguous();
  const int64_t ld = k_cache.stride(3), cs_b = k_cache.stride(1), cs_h = k_cache.stride(2);
  float* kc = k_cache.data_ptr<float>() + layer * k_cache.stride(0);
  float* vc = v_cache.data_ptr<float>() + layer * v_cache.stride(0);
  const float* pk = k.data_ptr<float>();
  const float* pv = v.data_ptr<float>();
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t ti = 0; ti < t; ++ti)
      for (int64_t h = 0; h < hk; ++h) {
        const float* ks = pk + bi * k.stride(0) + ti * k.stride(1) + h * k.stride(2);
        const float* vs = pv + bi * v.stride(0) + ti * v.stride(1) + h * v.stride(2);
        const int64_t at = bi * cs_b + h * cs_h + (pos + ti) * ld;
        std::copy(ks, ks + d, kc + at);
        std::copy(vs, vs + d, vc + at);
      }
  // Row (bi, ti) at position p = pos + ti keeps positions [lo(p), p]; the rows of one sequence share one list
  // of offsets over [lo(pos), pos + t).
  KeyLists keys;
  keys.first.resize(b * t);
  keys.count.resize(b * t);
  const int64_t lo0 = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  for (int64_t bi = 0; bi < b; ++bi) {
    const int64_t base = int64_t(keys.offs.size());
    for (int64_t p = lo0; p < pos + t; ++p) keys.offs.push_back(bi * cs_b + p * ld);
    for (int64_t ti = 0; ti < t; ++ti) {
      const int64_t p = pos + ti, lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
      keys.first[bi * t + ti] = base + lo - lo0;
      keys.count[bi * t + ti] = p + 1 - lo;
    }
  }
  at::Tensor out = at::empty({b, t, hq, d}, q.options());
  attend_listed(kern, q.data_ptr<float>(), out.data_ptr<float>(), b * t, hq, hk, d, kc, vc, cs_h, keys, float(scale),
                float(softcap));
  return out;
}

// Check a paged store pair and a page table: q float32, stores [Hk, slots, D] both float32 or both float16, pages
// [S, P] int64.
void check_paged(const char* op, const at::Tensor& q, const at::Tensor& k_store, const at::Tensor& v_store,
                 const at::Tensor& pages, int64_t page_size) {
  check_f32_cpu(q, op, "q");
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&k_store, "k_store"}, {&v_store, "v_store"}})
    TORCH_CHECK(t->defined() && t->device().is_cpu() &&
                    (t->scalar_type() == at::kFloat || t->scalar_type() == at::kHalf) &&
                    t->scalar_type() == k_store.scalar_type(),
                "exl ", op, ": k_store and v_store must be CPU tensors, both float32 or both float16, got ",
                k_store.scalar_type(), " and ", v_store.scalar_type());
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&q, "q"}, {&k_store, "k_store"},
                                {&v_store, "v_store"}})
    TORCH_CHECK(t->dim() == 3 && t->is_contiguous(), "exl ", op, ": ", name, " must be contiguous and 3-d, got ",
                t->sizes());
  const int64_t hq = q.size(1), d = q.size(2), hk = k_store.size(0), n_slots = k_store.size(1);
  TORCH_CHECK(v_store.sizes() == k_store.sizes() && k_store.size(2) == d && hk > 0 && hq % hk == 0, "exl ", op,
              ": stores ", k_store.sizes(), " / ", v_store.sizes(), " do not fit q ", q.sizes());
  TORCH_CHECK(pages.scalar_type() == at::kLong && pages.device().is_cpu() && pages.is_contiguous() && pages.dim() == 2,
              "exl ", op, ": pages must be a contiguous int64 CPU [sequences, pages] table, got ", pages.scalar_type(),
              " ", pages.sizes());
  TORCH_CHECK(page_size > 0 && n_slots % page_size == 0, "exl ", op, ": page_size ", page_size,
              " must divide the store's ", n_slots, " slots");
}

// The key lists of T query rows over a page table: row r (sequence seq[r], at position pos[r]) keeps positions
// [pos[r] - window + 1, pos[r]] (from 0 when window <= 0); position p of sequence s lies at slot
// pages[s, p / page_size] * page_size + p % page_size. Consecutive rows of one sequence share one list.
KeyLists paged_keys(const char* op, const int64_t* pp, int64_t S, int64_t P, int64_t n_pages, int64_t page_size,
                    const int64_t* seq, const int64_t* pos, int64_t T, int64_t window, int64_t d) {
  KeyLists keys;
  keys.first.resize(T);
  keys.count.resize(T);
  for (int64_t r0 = 0; r0 < T;) {
    const int64_t s = seq[r0];
    TORCH_CHECK(s >= 0 && s < S, "exl ", op, ": row ", r0, " belongs to sequence ", s, ", out of range [0, ", S, ")");
    int64_t r1 = r0, lo0 = INT64_MAX, hi = 0;
    for (; r1 < T && seq[r1] == s; ++r1) {
      TORCH_CHECK(pos[r1] >= 0 && pos[r1] < P * page_size, "exl ", op, ": row ", r1, " is at position ", pos[r1],
                  ", sequence ", s, "'s page table holds [0, ", P * page_size, ")");
      lo0 = std::min(lo0, window > 0 ? std::max<int64_t>(0, pos[r1] - window + 1) : int64_t(0));
      hi = std::max(hi, pos[r1] + 1);
    }
    const int64_t base = int64_t(keys.offs.size());
    for (int64_t p = lo0; p < hi;) {  // page by page
      const int64_t start = p / page_size * page_size, end = std::min(hi, start + page_size), page = pp[s * P + p / page_size];
      TORCH_CHECK(page >= 0 && page < n_pages, "exl ", op, ": sequence ", s, " page ", p / page_size, " is ", page,
                  ", out of range [0, ", n_pages, ")");
      for (const int64_t shift = page * page_size - start; p < end; ++p) keys.offs.push_back((shift + p) * d);
    }
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos[r] - window + 1) : 0;
      keys.first[r] = base + lo - lo0;
      keys.count[r] = pos[r] + 1 - lo;
    }
    r0 = r1;
  }
  return keys;
}

// f(keys, values) with a checked store pair's data: fp16 bits (uint16_t*) for float16 stores, else float*.
template <class F>
void with_store_data(const at::Tensor& k_store, const at::Tensor& v_store, const F& f) {
  if (k_store.scalar_type() == at::kHalf)
    f(reinterpret_cast<uint16_t*>(k_store.data_ptr<at::Half>()),
      reinterpret_cast<uint16_t*>(v_store.data_ptr<at::Half>()));
  else
    f(k_store.data_ptr<float>(), v_store.data_ptr<float>());
}

// Attention of T query rows q [T, Hq, D] straight from a paged float32 or float16 store [Hk, slots, D] (keys and
// values already written): row r of sequence seqs[r] at position positions[r] attends over its sequence's positions
// [positions[r] - window + 1, positions[r]] through its row of the page table pages [S, P]. Decode rows,
// verified drafts and prompt chunks alike; returns out [T, Hq, D].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_store, const at::Tensor& v_store,
                           const at::Tensor& pages, const at::Tensor& seqs, const at::Tensor& positions,
                           int64_t page_size, double scale, int64_t window, double softcap) {
  const char* op = "paged_attention";
  check_paged(op, q, k_store, v_store, pages, page_size);
  const int64_t T = q.size(0), hq = q.size(1), d = q.size(2), hk = k_store.size(0), n_slots = k_store.size(1);
  for (const auto* t : {&seqs, &positions})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->device().is_cpu() && t->is_contiguous() && t->numel() == T,
                "exl paged_attention: seqs and positions must be contiguous int64 CPU tensors of ", T,
                " entries (one per query row), got ", t->scalar_type(), " ", t->sizes());
  const KeyLists keys = paged_keys(op, pages.data_ptr<int64_t>(), pages.size(0), pages.size(1), n_slots / page_size,
                                   page_size, seqs.data_ptr<int64_t>(), positions.data_ptr<int64_t>(), T, window, d);
  at::Tensor out = at::empty({T, hq, d}, q.options());
  with_store_data(k_store, v_store, [&](auto* kd, auto* vd) {
    attend_listed(kernels("auto", op), q.data_ptr<float>(), out.data_ptr<float>(), T, hq, hk, d, kd, vd, n_slots * d,
                  keys, float(scale), float(softcap));
  });
  return out;
}

// One decode step of B sequences over a paged float32 or float16 store (new keys and values rounded to nearest),
// in place: k, v [B, Hk, D] of each sequence's new token are written at position lengths[b] - 1 (its slot from its
// row of the page table pages [B, P]), then paged_attention's rows: q [B, Hq, D], row b of sequence b at position
// lengths[b] - 1. Returns out [B, Hq, D].
at::Tensor paged_step_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_store,
                                at::Tensor& v_store, const at::Tensor& pages, const at::Tensor& lengths,
                                int64_t page_size, double scale, int64_t window, double softcap) {
  const char* op = "paged_step_attention";
  check_paged(op, q, k_store, v_store, pages, page_size);
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2), hk = k_store.size(0), n_slots = k_store.size(1);
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&k, "k"}, {&v, "v"}}) {
    check_f32_cpu(*t, op, name);
    TORCH_CHECK(t->is_contiguous() && t->dim() == 3 && t->size(0) == b && t->size(1) == hk && t->size(2) == d,
                "exl paged_step_attention: ", name, " must be contiguous [", b, ", ", hk, ", ", d, "], got ",
                t->sizes());
  }
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && pages.size(0) == b &&
                  lengths.numel() == b,
              "exl paged_step_attention: pages must be [", b, ", pages] and lengths int64 [", b, "], got ",
              pages.sizes(), " and ", lengths.sizes());
  const int64_t P = pages.size(1), n_pages = n_slots / page_size;
  const int64_t* pp = pages.data_ptr<int64_t>();
  const int64_t* pl = lengths.data_ptr<int64_t>();
  std::vector<int64_t> seq(b), pos(b);
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(pl[i] >= 1 && pl[i] <= P * page_size, "exl paged_step_attention: sequence ", i, " has length ", pl[i],
                ", its page table holds [1, ", P * page_size, "]");
    seq[i] = i, pos[i] = pl[i] - 1;
  }
  const KeyLists keys = paged_keys(op, pp, b, P, n_pages, page_size, seq.data(), pos.data(), b, window, d);
  const float* pk = k.data_ptr<float>();
  const float* pv = v.data_ptr<float>();
  const Kernels* kern = kernels("auto", op);
  at::Tensor out = at::empty({b, hq, d}, q.options());
  with_store_data(k_store, v_store, [&](auto* kd, auto* vd) {
    for (int64_t i = 0; i < b; ++i) {  // store the new keys and values first (a sequence attends to its own)
      const int64_t p = pos[i], slot = pp[i * P + p / page_size] * page_size + p % page_size;
      for (int64_t h = 0; h < hk; ++h) {
        const float *ks = pk + (i * hk + h) * d, *vs = pv + (i * hk + h) * d;
        auto* kt = kd + (h * n_slots + slot) * d;
        auto* vt = vd + (h * n_slots + slot) * d;
        if constexpr (std::is_same<std::remove_pointer_t<decltype(kd)>, float>::value) {
          std::copy(ks, ks + d, kt);
          std::copy(vs, vs + d, vt);
        } else {
          kern->to_fp16(ks, kt, d);
          kern->to_fp16(vs, vt, d);
        }
      }
    }
    attend_listed(kern, q.data_ptr<float>(), out.data_ptr<float>(), b, hq, hk, d, kd, vd, n_slots * d, keys,
                  float(scale), float(softcap));
  });
  return out;
}

at::Tensor act_mul(at::Tensor& gate, const at::Tensor& up, const std::string& act, const std::string& isa) {
  check_f32_cpu(gate, "act_mul", "gate");
  check_f32_cpu(up, "act_mul", "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "exl act_mul: gate has shape ", gate.sizes(), ", up has ", up.sizes());
  const at::Tensor gc = gate.contiguous(), uc = up.contiguous();
  at::Tensor out = gate.is_contiguous() ? gate : at::empty_like(gc);
  const float* g = gc.data_ptr<float>();
  const float* u = uc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const Kernels* k = kernels(isa, "act_mul");
  const ActMulFn fn = act == "silu"        ? k->silu_mul
                      : act == "gelu_tanh" ? k->gelu_tanh_mul
                      : act == "gelu"      ? k->gelu_mul
                      : act == "relu"      ? k->relu_mul
                                           : nullptr;
  TORCH_CHECK(fn, "exl act_mul: unknown activation '", act, "' (silu, gelu, gelu_tanh, relu)");
  exl::cpu::parallel_for(0, gate.numel(), kGrainValues, [&](int64_t i0, int64_t i1) { fn(g + i0, u + i0, o + i0, i1 - i0); });
  return out;
}

}  // namespace

const Ops& ops() {
  static const Ops table{&rms_norm, &add_rms_norm, &rope_, &decode_attention, &act_mul, &paged_step_attention};
  return table;
}

}  // namespace fused
}  // namespace exl

namespace py = pybind11;

// Called from cpu_ops.cpp's PYBIND11_MODULE: the fused ops live in the same extension module.
void register_fused(py::module_& m) {
  using namespace exl::fused;
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"),
        "RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight (new tensor)");
  m.def("add_rms_norm", &add_rms_norm, py::arg("x"), py::arg("residual"), py::arg("weight") = py::none(),
        py::arg("eps") = 1e-6, py::arg("x_weight") = py::none(),
        "(s, rms_norm(s, weight) or None) for s = (rms_norm(x, x_weight) if x_weight else x) + residual; "
        "s is written over x when x is contiguous");
  m.def("rope_", &rope_, py::arg("q"), py::arg("k"), py::arg("cos"), py::arg("sin"), py::arg("q_weight") = py::none(),
        py::arg("k_weight") = py::none(), py::arg("eps") = 1e-6,
        "In place on q, k [B, T, H, D]: optional per-head RMSNorm, then rotate-half RoPE on the first cos.size(-1) dims");
  m.def("decode_attention", &decode_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("layer"), py::arg("pos"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0, py::arg("isa") = "auto",
        "Store k, v [B, T, Hk, D] at pos.. of cache[layer], then causal GQA attention of each query row over "
        "positions [p-window+1, p] (p: its position)");
  m.def("paged_attention", &paged_attention, py::arg("q"), py::arg("k_store"), py::arg("v_store"), py::arg("pages"),
        py::arg("seqs"), py::arg("positions"), py::arg("page_size"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0, py::call_guard<py::gil_scoped_release>(),
        "GQA attention of q rows [T, Hq, D], row r of sequence seqs[r] at positions[r], over its sequence's pages "
        "of a [kv_heads, slots, head_dim] store, causally (the keys and values already written)");
  m.def("paged_step_attention", &paged_step_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_store"),
        py::arg("v_store"), py::arg("pages"), py::arg("lengths"), py::arg("page_size"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::call_guard<py::gil_scoped_release>(),
        "Store each sequence's new k, v in its page, then single-query GQA attention over its pages in place");
  m.def("act_mul", &act_mul, py::arg("gate"), py::arg("up"), py::arg("act"), py::arg("isa") = "auto",
        "act(gate) * up for act in silu, gelu, gelu_tanh, relu; written over gate when gate is contiguous");
  m.def("split_attention_rows", [] { return split_rows.load(); },
        "Decode rows whose attention the threads shared by key ranges and column halves (one long-context row)");
  m.def("fused_isa", &fused_isa, py::arg("isa") = "auto",
        "The fused-op table an isa request runs: 'scalar', 'avx2' or 'avx512'");
}
