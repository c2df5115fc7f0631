// Launcher of the paged attention kernel (cuda_attention.cu), called by the torch binding
// (cuda_ops.cpp, `paged_attention`). Raw pointers only, like cuda_kernels.h.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace exl {
namespace cuda {

// Query heads per KV head and head sizes the kernel covers (GQA groups up to 8, heads up to 256).
constexpr int kAttnMaxGroup = 8;
constexpr int kAttnMaxHeadDim = 256;
// Positions per chunk of keys (one thread block per query row, KV head and chunk).
constexpr int kAttnChunk = 256;

// Chunks a launch covers: every position the page table [., P] can hold (at least one, so that a table without
// pages still launches and its rows come out NaN).
inline int64_t attn_chunks(int64_t P, int64_t page_size) {
  const int64_t n = (P * page_size + kAttnChunk - 1) / kAttnChunk;
  return n > 0 ? n : 1;
}
// Floats of workspace a launch needs (0 when the table holds one chunk: no combine step).
inline int64_t attn_workspace_floats(int64_t T, int64_t hq, int64_t d, int64_t P, int64_t page_size) {
  const int64_t n = attn_chunks(P, page_size);
  return n > 1 ? T * hq * n * (d + 2) : 0;
}

// T query rows attend causally over their sequences' pages of a paged store, in place (GQA).
// q, out [T, hq, d]; k, v [hk, n_slots, d] (one layer of the store), all float16 (half) or all
// float32; pages int64 [S, P]; seqs, pos int64 [T]: row r belongs to sequence seqs[r], sits at
// position pos[r] and sees positions max(0, pos[r] - window + 1) .. pos[r] (all from 0 when
// window <= 0); position p of sequence s lies at slot pages[s, p / page_size] * page_size +
// p % page_size. Scores are q.k * scale, then softcap * tanh(score / softcap) when softcap > 0.
// A row whose sequence, position or page is out of range gets NaN (the kernel never reads outside).
// `partial`: attn_workspace_floats(...) floats of scratch (may be null when that is 0).
void launch_paged_attention(const void* q, const void* k, const void* v, bool half, const int64_t* pages, int64_t S,
                            int64_t P, const int64_t* seqs, const int64_t* pos, int64_t T, int hq, int hk, int d,
                            int64_t n_slots, int page_size, float scale, int window, float softcap, void* out,
                            float* partial, cudaStream_t stream);

}  // namespace cuda
}  // namespace exl
