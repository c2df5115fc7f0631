// One OpenMP parallel region per decode step, and exl's own work sharing inside it.
//
// A decode step is a few hundred short parallel regions. As separate OpenMP regions (at::parallel_for)
// it is only fast while libgomp's idle threads spin between them, and libgomp stops spinning (~100
// iterations, then a futex sleep at every barrier) as soon as its thread teams hold more threads
// than the machine has cores — which happens whenever the model runs in a thread other than the one
// that first used OpenMP: the server's generator thread, any AsyncGenerator. On 2 cores that cut
// decode from ~200 to ~43 tokens/s. A second, private thread set is no cure either: it and OpenMP's
// threads (still used by torch ops and MKL around the step) spin against each other.
//
// So run_team() opens ONE OpenMP region for the whole step: thread 0 runs the step, the others wait
// (spinning) for the chunks its parallel_for calls publish. parallel_for splits [begin, end) into
// exactly the chunks at::parallel_for would use, so results are identical; any team thread runs any
// chunk (the caller takes the chunks a busy or descheduled thread has not claimed, so a core lost to
// another process does not stall the step). Outside run_team, parallel_for is at::parallel_for.
#pragma once

#include <cstdint>

namespace exl {
namespace cpu {

using ChunkFn = void (*)(void* ctx, int64_t begin, int64_t end);

// Type-erased bodies (cpu_pool.cpp).
void parallel_run(int64_t begin, int64_t end, int64_t grain, ChunkFn fn, void* ctx);
void team_run(void (*body)(void*), void* ctx);

// f(chunk_begin, chunk_end) over [begin, end) in chunks of at least `grain` units: on the team inside
// run_team, else on at::parallel_for. Runs serially inside another parallel_for. Rethrows the first
// exception.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  parallel_run(begin, end, grain,
               [](void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); },
               const_cast<void*>(static_cast<const void*>(&f)));
}

// Run f() on this thread with a team of at::get_num_threads() threads serving its parallel_for calls
// (one OpenMP region for all of them). Runs f() plainly with one thread or inside a parallel region.
template <class F>
inline void run_team(const F& f) {
  team_run([](void* ctx) { (*static_cast<const F*>(ctx))(); }, const_cast<void*>(static_cast<const void*>(&f)));
}

// True on the thread running a run_team body (outside its parallel_for chunks): BLAS calls there
// run single-threaded, so callers split them over parallel_for themselves.
bool in_team();

// The threads a parallel_for called here would split its work over: the team's inside run_team, 1 inside a
// parallel_for chunk, else at::get_num_threads() (which reads 1 on a team thread: it is inside an OpenMP region).
int64_t parallel_threads();

// Parallel regions served by teams in this process (a test reads it).
int64_t team_regions();

// Free the calling thread's idle OpenMP threads (omp_pause_resource_all, soft). libgomp keeps one thread
// pool per thread that ever opened a parallel region, and once the pools together hold more threads
// than the machine has cores it stops spinning at barriers (~100 iterations, then a futex sleep): every
// torch op and BLAS call of a prefill on the generator thread then pays for sleeps. A thread that has
// loaded a model (and so opened regions) and hands the model to a generator thread calls this; the
// next parallel region it opens starts a new pool. False where the OpenMP runtime cannot (then
// nothing changed) or the caller is inside a parallel region.
bool release_idle_threads();

}  // namespace cpu
}  // namespace exl
