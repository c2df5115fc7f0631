// One OpenMP region per decode step with exl's work sharing inside (see cpu_pool.h for why).
//
// The team's thread 0 publishes a region (`current`), bumps `epoch` and claims chunks like everyone
// else; the other threads spin on `epoch` (yielding the core after a while, so a step on a loaded
// machine does not starve whoever shares it) until `stop`. A region lives on the caller's stack: it
// is left only when every chunk is done and no thread still holds it (`busy`).
#include "cpu_pool.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define EXL_PAUSE() _mm_pause()
#else
#define EXL_PAUSE() std::this_thread::yield()
#endif

namespace exl {
namespace cpu {
namespace {

constexpr int64_t kSpinsBeforeYield = 1 << 14;  // pauses (~1 ms) before a waiting thread starts to yield

struct Region {
  ChunkFn fn;
  void* ctx;
  int64_t begin, end, chunk, nchunks;
  std::atomic<int64_t> next{0}, done{0};
  std::mutex error_mutex;
  std::exception_ptr error;

  void work();  // claim and run chunks until none is left
};

struct Team {
  std::atomic<Region*> current{nullptr};
  std::atomic<uint64_t> epoch{0};
  std::atomic<int> busy{0};
  std::atomic<bool> stop{false};
  int64_t threads = 1;  // in the OpenMP region
};

thread_local Team* tl_team = nullptr;    // set on the thread running a run_team body
thread_local bool tl_in_chunk = false;   // inside a chunk: nested parallel_for runs serially
std::atomic<int64_t> g_regions{0};

struct InChunk {  // marks this thread as running a chunk for its lifetime
  InChunk() { tl_in_chunk = true; }
  ~InChunk() { tl_in_chunk = false; }
};

void Region::work() {
  int64_t i;
  while ((i = next.fetch_add(1, std::memory_order_acq_rel)) < nchunks) {
    const int64_t b = begin + i * chunk;
    try {
      InChunk in_chunk;
      fn(ctx, b, std::min(end, b + chunk));
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
    done.fetch_add(1, std::memory_order_acq_rel);
  }
}

void serve(Team& t) {  // a team thread other than 0
  uint64_t seen = 0;
  int64_t idle = 0;
  for (;;) {
    const uint64_t e = t.epoch.load(std::memory_order_acquire);
    if (e != seen) {
      seen = e;
      t.busy.fetch_add(1, std::memory_order_seq_cst);
      if (Region* r = t.current.load(std::memory_order_seq_cst)) r->work();
      t.busy.fetch_sub(1, std::memory_order_seq_cst);
      idle = 0;
      continue;
    }
    if (t.stop.load(std::memory_order_acquire)) return;
    if (++idle < kSpinsBeforeYield) EXL_PAUSE(); else std::this_thread::yield();
  }
}

void dispatch(Team& t, Region& r) {
  t.current.store(&r, std::memory_order_seq_cst);
  t.epoch.fetch_add(1, std::memory_order_seq_cst);
  r.work();
  for (int64_t spins = 0; r.done.load(std::memory_order_acquire) < r.nchunks; ++spins) {
    if (spins < kSpinsBeforeYield) EXL_PAUSE(); else std::this_thread::yield();
  }
  t.current.store(nullptr, std::memory_order_seq_cst);
  while (t.busy.load(std::memory_order_seq_cst) != 0) EXL_PAUSE();
}

int64_t divup(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

bool in_team() { return tl_team != nullptr && !tl_in_chunk; }

int64_t parallel_threads() {
  if (tl_in_chunk) return 1;
  return tl_team != nullptr ? tl_team->threads : at::get_num_threads();
}

int64_t team_regions() { return g_regions.load(); }

// OpenMP 5.0; weak, so that a runtime without it (libgomp before GCC 9, whichever libgomp torch loaded) still
// loads the extension, and release_idle_threads() answers false there.
#pragma weak omp_pause_resource_all

bool release_idle_threads() {
  if (&omp_pause_resource_all == nullptr || omp_in_parallel() || tl_team != nullptr) return false;
  return omp_pause_resource_all(omp_pause_soft) == 0;
}

void parallel_run(int64_t begin, int64_t end, int64_t grain, ChunkFn fn, void* ctx) {
  if (begin >= end) return;
  if (tl_team == nullptr || tl_in_chunk) {
    at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { fn(ctx, b, e); });
    return;
  }
  // The chunks of at::parallel_for's OpenMP backend: min(threads, ceil(n / grain)) equal chunks.
  const int64_t n = end - begin;
  const int64_t threads = tl_team->threads;
  if (n <= grain || n == 1 || threads == 1) {
    InChunk in_chunk;
    fn(ctx, begin, end);
    return;
  }
  int64_t parts = threads;
  if (grain > 0) parts = std::min(parts, divup(n, grain));
  Region r;
  r.fn = fn;
  r.ctx = ctx;
  r.begin = begin;
  r.end = end;
  r.chunk = divup(n, parts);
  r.nchunks = divup(n, r.chunk);
  g_regions.fetch_add(1, std::memory_order_relaxed);
  dispatch(*tl_team, r);
  if (r.error) std::rethrow_exception(r.error);
}

void team_run(void (*body)(void*), void* ctx) {
  const int threads = at::get_num_threads();
  if (threads <= 1 || tl_team != nullptr || tl_in_chunk || omp_in_parallel()) {
    body(ctx);
    return;
  }
  Team team;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    if (omp_get_thread_num() == 0) {
      team.threads = omp_get_num_threads();
      tl_team = &team;
      try {
        body(ctx);
      } catch (...) {
        error = std::current_exception();
      }
      tl_team = nullptr;
      team.stop.store(true, std::memory_order_release);
    } else {
      serve(team);
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace cpu
}  // namespace exl
