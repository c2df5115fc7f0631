// Paged attention on the GPU: query rows of any sequences attend causally over their pages of a
// paged KV store where the keys and values lie (no gather), for decode steps, drafts and short
// chunks; the CUDA counterpart of cpu_fused.cpp's paged_attention. The host harness runs this same
// file on CPU threads (docs/cuda_host.md).
//
// One thread block per (query row, KV head) holds the GQA group's G query heads in registers, so each
// key and value is read once for the group. Its warps take keys lo+w, lo+w+nw, ... : a warp reads a
// key (lane l holds channels l, l+32, ...), sums the dot product across lanes, and keeps a running
// softmax (max, sum, weighted values) per query head. The warps' partial results then meet in shared
// memory and are combined in a fixed order, so a row's output does not depend on the other rows of
// the launch (batch invariance: speculative verification equals plain decoding).
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "cuda_attention.h"
#include "cuda_device.cuh"

namespace exl {
namespace cuda {
namespace {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ void store_float(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_float(__half* p, float v) { *p = __float2half_rn(v); }

struct AttnArgs {
  const void *q, *k, *v;
  const int64_t *pages, *seqs, *pos;
  int64_t S, P, T, n_slots;
  int hq, hk, d, page_size, window;
  float scale, softcap;
  void* out;
};

// Shared memory per warp: for each of the G query heads its weighted value sums [d], max and sum; then
// one flag per warp (a bad page seen).
__host__ __device__ constexpr int64_t attn_floats_per_warp(int G, int d) { return int64_t(G) * (d + 2); }

template <typename T, int G, int NI>
__global__ void paged_attention_kernel(AttnArgs a) {
  float* smem = dynamic_shared<float>();
  const int nw = blockDim.x / kWarp, warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t row = blockIdx.x;
  const int h = blockIdx.y, grp = a.hq / a.hk, d = a.d;
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  const int64_t s = a.seqs[row], p = a.pos[row], n_pages = a.n_slots / a.page_size;
  bool bad = s < 0 || s >= a.S || p < 0 || p >= a.P * a.page_size;
  const int64_t lo = a.window > 0 && p - a.window + 1 > 0 ? p - a.window + 1 : 0;

  float qr[G][NI], acc[G][NI], m[G], l[G];
  const T* qrow = q + (row * a.hq + int64_t(h) * grp) * d;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const int c = lane + kWarp * i;
      qr[g][i] = g < grp && c < d ? to_float(qrow[g * d + c]) : 0.0f;
      acc[g][i] = 0.0f;
    }
  }
  const int64_t head = int64_t(h) * a.n_slots;
  for (int64_t t = lo + warp; !bad && t <= p; t += nw) {  // bad and t are the same in every lane
    const int64_t page = a.pages[s * a.P + t / a.page_size];
    if (page < 0 || page >= n_pages) {
      bad = true;
      break;
    }
    const int64_t base = (head + page * a.page_size + t % a.page_size) * d;
    float kr[NI], vr[NI];
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const int c = lane + kWarp * i;
      kr[i] = c < d ? to_float(k[base + c]) : 0.0f;
      vr[i] = c < d ? to_float(v[base + c]) : 0.0f;
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < NI; ++i) dot = fmaf(qr[g][i], kr[i], dot);
      float score = warp_sum(dot) * a.scale;
      if (a.softcap > 0.0f) score = a.softcap * tanhf(score / a.softcap);
      const float mx = fmaxf(m[g], score);
      const float keep = expf(m[g] - mx), w = expf(score - mx);  // keep = 0 at the first key (m = -inf)
      l[g] = fmaf(l[g], keep, w);
#pragma unroll
      for (int i = 0; i < NI; ++i) acc[g][i] = fmaf(acc[g][i], keep, w * vr[i]);
      m[g] = mx;
    }
  }

  const int64_t stride = d + 2;
  float* mine = smem + warp * attn_floats_per_warp(G, d);
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const int c = lane + kWarp * i;
      if (c < d) mine[g * stride + c] = acc[g][i];
    }
    if (lane == 0) {
      mine[g * stride + d] = m[g];
      mine[g * stride + d + 1] = l[g];
    }
  }
  float* flags = smem + nw * attn_floats_per_warp(G, d);
  if (lane == 0) flags[warp] = bad ? 1.0f : 0.0f;
  __syncthreads();

  bool any_bad = false;
  for (int w = 0; w < nw; ++w) any_bad |= flags[w] != 0.0f;
  T* orow = static_cast<T*>(a.out) + (row * a.hq + int64_t(h) * grp) * d;
  for (int e = threadIdx.x; e < grp * d; e += blockDim.x) {
    const int g = e / d, c = e % d;
    float mx = -INFINITY;
    for (int w = 0; w < nw; ++w) mx = fmaxf(mx, smem[w * attn_floats_per_warp(G, d) + g * stride + d]);
    float num = 0.0f, den = 0.0f;
    for (int w = 0; w < nw; ++w) {  // warps in order: one summation order for every launch
      const float* part = smem + w * attn_floats_per_warp(G, d) + g * stride;
      const float f = expf(part[d] - mx);  // 0 for a warp that saw no key
      num = fmaf(part[c], f, num);
      den = fmaf(part[d + 1], f, den);
    }
    store_float(orow + g * d + c, any_bad ? NAN : num / den);
  }
}

template <typename T, int G, int NI>
void launch(const AttnArgs& a, cudaStream_t stream) {
  auto smem = [&](int threads) {
    return size_t(threads / kWarp) * size_t(attn_floats_per_warp(G, a.d) + 1) * sizeof(float);
  };
  const int threads = smem(256) <= 48 * 1024 ? 256 : 128;
  EXL_LAUNCH(dim3(unsigned(a.T), unsigned(a.hk)), threads, smem(threads), stream, paged_attention_kernel<T, G, NI>)(a);
}

template <typename T, int G>
void launch_group(const AttnArgs& a, cudaStream_t stream) {
  if (a.d <= 2 * kWarp)
    launch<T, G, 2>(a, stream);
  else if (a.d <= 4 * kWarp)
    launch<T, G, 4>(a, stream);
  else
    launch<T, G, 8>(a, stream);
}

template <typename T>
void launch_typed(const AttnArgs& a, cudaStream_t stream) {
  const int grp = a.hq / a.hk;
  if (grp <= 1)
    launch_group<T, 1>(a, stream);
  else if (grp <= 2)
    launch_group<T, 2>(a, stream);
  else if (grp <= 4)
    launch_group<T, 4>(a, stream);
  else
    launch_group<T, 8>(a, stream);
}

}  // namespace

void launch_paged_attention(const void* q, const void* k, const void* v, bool half, const int64_t* pages, int64_t S,
                            int64_t P, const int64_t* seqs, const int64_t* pos, int64_t T, int hq, int hk, int d,
                            int64_t n_slots, int page_size, float scale, int window, float softcap, void* out,
                            cudaStream_t stream) {
  if (T == 0 || hk == 0 || d == 0) return;  // an empty grid is a launch error in CUDA
  const AttnArgs a{q, k, v, pages, seqs, pos, S, P, T, n_slots, hq, hk, d, page_size, window, scale, softcap, out};
  if (half)
    launch_typed<__half>(a, stream);
  else
    launch_typed<float>(a, stream);
}

}  // namespace cuda
}  // namespace exl
