// Toy kernels that exercise the host harness itself (tests/test_cuda_host.py), including deliberately
// broken ones it must catch. Test-only: compiled into the harness module, never into exl's extension.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace exl {
namespace toy {

// out[b, t] = in[b, n-1-t] through shared memory, n = threads per block; `sync` false drops the
// __syncthreads between the write and the read (a race).
void reverse(const float* in, float* out, int blocks, int n, bool sync);
// Within each warp, lane l reads lane l^1's value through shared memory; `sync` false drops the __syncwarp.
void warp_exchange(const float* in, float* out, int n, bool sync);
// out[t] = the value of lane src(t) for kind 0 __shfl_sync, 1 __shfl_xor_sync, 2 __shfl_down_sync,
// 3 __shfl_up_sync, each lane offering 100 * t + 7; n threads in one block.
void shuffle(int kind, int arg, int width, int n, int* out);
// out[t] = __ballot_sync(full, t % 3 == 0) for n threads in one block.
void ballot(int n, unsigned* out);
// Every thread of `blocks` x 256 adds 1 to *count and 0.5 to *sum.
void atomics(int blocks, int* count, float* sum);
// Lane 0 waits at __syncwarp while the others wait at __syncthreads: a deadlock.
void divergent_barrier();
// A float4 __ldg at p.
void ldg4(const float* p, float* out);
// Lanes 16..31 exit, then lanes 0..15 read lanes 16..31 with __shfl_sync.
void shuffle_from_exited(float* out);
// An empty kernel launched with the given shape (to check launch validation).
void launch_shape(unsigned grid, unsigned block, size_t smem);

}  // namespace toy
}  // namespace exl
