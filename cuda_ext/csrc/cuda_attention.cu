// Paged attention on the GPU: query rows of any sequences attend causally over their pages of a
// paged KV store where the keys and values lie (no gather), for decode steps, drafts and short
// chunks; the CUDA counterpart of cpu_fused.cpp's paged_attention. The host harness runs this same
// file on CPU threads (docs/cuda_host.md).
//
// Keys are cut into chunks of kAttnChunk positions (absolute positions: chunk j holds positions
// [j * kAttnChunk, (j + 1) * kAttnChunk)), one thread block per (query row, KV head, chunk), so a long
// context spreads over many SMs (flash-decoding). A block holds the GQA group's G query heads in
// registers, so each key and value is read once for the group. Its warps take the chunk's keys
// t0+w, t0+w+nw, ... : a warp reads a key (lane l holds channels l, l+32, ...), sums the dot product
// across lanes, and keeps a running softmax (max, sum, weighted values) per query head. The warps'
// results meet in shared memory in a fixed order; with one chunk in the table the block writes the
// output, otherwise its (max, sum, values) go to a workspace and a second kernel combines the chunks
// in order. A row's chunks depend only on its own positions, and chunks it does not reach add exact
// zeros, so its output is the same bits whatever else is in the launch (batch invariance:
// speculative verification equals plain decoding).
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "cuda_attention.h"
#include "cuda_device.cuh"

namespace exl {
namespace cuda {
namespace {

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

// DIRECT: the table holds one chunk; the block writes the output. Otherwise it writes its chunk's partial result
// (values [d], max, sum per query head) to partial[((row * hq + head) * n_chunks + chunk) * (d + 2)].
template <typename T, int G, int NI, bool DIRECT>
__global__ void paged_attention_kernel(AttnArgs a, float* __restrict__ partial) {
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
  const int64_t chunk = blockIdx.z, c0 = chunk * kAttnChunk;
  const int64_t t0 = lo > c0 ? lo : c0, t1 = p < c0 + kAttnChunk - 1 ? p : c0 + kAttnChunk - 1;  // may be empty

  float qr[G][NI], acc[G][NI], m[G], l[G];
  const T* qrow = q + (row * a.hq + int64_t(h) * grp) * d;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const int c = lane + kWarp * i;
      qr[g][i] = g < grp && c < d ? load_f(qrow + g * d + c) : 0.0f;
      acc[g][i] = 0.0f;
    }
  }
  const int64_t head = int64_t(h) * a.n_slots;
  for (int64_t t = t0 + warp; !bad && t <= t1; t += nw) {  // bad and t are the same in every lane
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
      kr[i] = c < d ? load_f(k + base + c) : 0.0f;
      vr[i] = c < d ? load_f(v + base + c) : 0.0f;
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
  const int64_t n_chunks = gridDim.z;
  for (int e = threadIdx.x; e < grp * d; e += blockDim.x) {
    const int g = e / d, c = e % d;
    float mx = -INFINITY;
    for (int w = 0; w < nw; ++w) mx = fmaxf(mx, smem[w * attn_floats_per_warp(G, d) + g * stride + d]);
    float num = 0.0f, den = 0.0f;
    if (mx != -INFINITY) {  // -inf: no key of this row in this chunk
      for (int w = 0; w < nw; ++w) {  // warps in order: one summation order for every launch
        const float* part = smem + w * attn_floats_per_warp(G, d) + g * stride;
        const float f = expf(part[d] - mx);  // 0 for a warp that saw no key
        num = fmaf(part[c], f, num);
        den = fmaf(part[d + 1], f, den);
      }
    }
    const int64_t head_row = row * a.hq + int64_t(h) * grp + g;
    if (DIRECT) {
      store_f(static_cast<T*>(a.out) + head_row * d + c, any_bad ? NAN : num / den);
    } else {
      float* dst = partial + (head_row * n_chunks + chunk) * (d + 2);
      dst[c] = any_bad ? NAN : num;
      if (c == 0) {
        dst[d] = mx;
        dst[d + 1] = den;
      }
    }
  }
}

// out[row, head] = the chunks' partial results of that query head combined in chunk order.
template <typename T>
__global__ void attention_combine_kernel(const float* __restrict__ partial, int n_chunks, int d, T* __restrict__ out) {
  const int64_t head_row = blockIdx.x;
  const float* part = partial + head_row * n_chunks * (d + 2);
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    float mx = -INFINITY;
    for (int j = 0; j < n_chunks; ++j) mx = fmaxf(mx, part[j * (d + 2) + d]);
    float num = 0.0f, den = 0.0f;
    for (int j = 0; j < n_chunks; ++j) {  // a chunk the row does not reach has max -inf: it adds exact zeros
      const float* pj = part + j * (d + 2);
      const float f = expf(pj[d] - mx);
      num = fmaf(pj[c], f, num);  // NaN (a bad table) propagates
      den = fmaf(pj[d + 1], f, den);
    }
    store_f(out + head_row * d + c, num / den);
  }
}

template <typename T, int G, int NI>
void launch(const AttnArgs& a, float* partial, cudaStream_t stream) {
  auto smem = [&](int threads) {
    return size_t(threads / kWarp) * size_t(attn_floats_per_warp(G, a.d) + 1) * sizeof(float);
  };
  const int threads = smem(256) <= 48 * 1024 ? 256 : 128;
  const unsigned n_chunks = unsigned(attn_chunks(a.P, a.page_size));
  const dim3 grid(unsigned(a.T), unsigned(a.hk), n_chunks);
  if (n_chunks == 1) {
    EXL_LAUNCH(grid, threads, smem(threads), stream, paged_attention_kernel<T, G, NI, true>)(a, nullptr);
    return;
  }
  EXL_LAUNCH(grid, threads, smem(threads), stream, paged_attention_kernel<T, G, NI, false>)(a, partial);
  const int combine_threads = a.d <= 64 ? 64 : a.d <= 128 ? 128 : 256;
  EXL_LAUNCH(unsigned(a.T * a.hq), combine_threads, 0, stream, attention_combine_kernel<T>)(
      partial, int(n_chunks), a.d, static_cast<T*>(a.out));
}

template <typename T, int G>
void launch_group(const AttnArgs& a, float* partial, cudaStream_t stream) {
  if (a.d <= 2 * kWarp)
    launch<T, G, 2>(a, partial, stream);
  else if (a.d <= 4 * kWarp)
    launch<T, G, 4>(a, partial, stream);
  else
    launch<T, G, 8>(a, partial, stream);
}

template <typename T>
void launch_typed(const AttnArgs& a, float* partial, cudaStream_t stream) {
  const int grp = a.hq / a.hk;
  if (grp <= 1)
    launch_group<T, 1>(a, partial, stream);
  else if (grp <= 2)
    launch_group<T, 2>(a, partial, stream);
  else if (grp <= 4)
    launch_group<T, 4>(a, partial, stream);
  else
    launch_group<T, 8>(a, partial, stream);
}

}  // namespace

void launch_paged_attention(const void* q, const void* k, const void* v, bool half, const int64_t* pages, int64_t S,
                            int64_t P, const int64_t* seqs, const int64_t* pos, int64_t T, int hq, int hk, int d,
                            int64_t n_slots, int page_size, float scale, int window, float softcap, void* out,
                            float* partial, cudaStream_t stream) {
  if (T == 0 || hk == 0 || d == 0) return;  // an empty grid is a launch error in CUDA
  const AttnArgs a{q, k, v, pages, seqs, pos, S, P, T, n_slots, hq, hk, d, page_size, window, scale, softcap, out};
  if (half)
    launch_typed<__half>(a, partial, stream);
  else
    launch_typed<float>(a, partial, stream);
}

}  // namespace cuda
}  // namespace exl
