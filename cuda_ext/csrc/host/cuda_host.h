// Host execution harness for the CUDA kernels: CUDA's programming model in plain C++17, so the
// same .cu source compiles with g++ and runs on the CPU (docs/cuda_host.md).
//
// - A launch runs its blocks one after another; the threads of a block run as real, concurrent
//   OS threads (a pool), so a missing __syncthreads/__syncwarp or a race can show.
// - __syncthreads is a barrier over the block's live threads, __syncwarp over the warp's.
// - __shfl_*_sync exchange values through per-warp slots and a barrier among the warp's lanes.
// - __shared__ is a function-local static (one block runs at a time); dynamic shared memory
//   (exl::cuda dynamic_shared<T>(), see cuda_device.cuh) is a per-launch buffer poisoned with NaNs.
// - __half rounds to nearest even like the hardware; __ldg checks alignment; atomics are real.
// - Errors CUDA would report (bad launch configuration, misaligned access, shuffles with exited
//   lanes, a deadlocked barrier) are recorded like cudaGetLastError and thrown by the bindings.
#pragma once
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <chrono>
#include <math.h>

#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#define EXL_CUDA_HOST 1

// ---------------------------------------------------------------------------------------------
// Qualifiers

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __shared__ static
#define __constant__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

// ---------------------------------------------------------------------------------------------
// Built-in types

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x, y, z;
};

#define EXL_VEC2(T, N, A) \
  struct alignas(A) N {   \
    T x, y;               \
  };
#define EXL_VEC4(T, N, A) \
  struct alignas(A) N {   \
    T x, y, z, w;         \
  };
EXL_VEC2(float, float2, 8)
EXL_VEC4(float, float4, 16)
EXL_VEC2(int, int2, 8)
EXL_VEC4(int, int4, 16)
EXL_VEC2(unsigned, uint2, 8)
EXL_VEC4(unsigned, uint4, 16)
EXL_VEC2(unsigned short, ushort2, 4)
EXL_VEC4(unsigned short, ushort4, 8)
EXL_VEC4(unsigned char, uchar4, 4)
#undef EXL_VEC2
#undef EXL_VEC4
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }

// Streams and errors: launches run synchronously, so every stream is the default one.
struct CUstream_st;
typedef CUstream_st* cudaStream_t;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidConfiguration = 9, cudaErrorLaunchFailure = 719 };

// ---------------------------------------------------------------------------------------------
// fp16: IEEE binary16 storage, conversions round to nearest even (subnormals, inf and NaN included)

namespace exl_host {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_f16_rn(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN stays NaN (quiet)
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: overflow to inf
  if (a >= 0x38800000u) {                                  // normal half: exponent >= -14
    const uint32_t mant = a & 0x7fffffu, exp = (a >> 23) - 112;  // rebias 127 -> 15
    uint32_t h = (exp << 10) | (mant >> 13);
    const uint32_t rest = mant & 0x1fffu;  // 13 dropped bits
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent: right
    return uint16_t(sign | h);
  }
  if (a < 0x33000000u) return sign;  // below half the smallest subnormal (2^-25): zero
  // subnormal half: value = m * 2^-24, m = round(a_value * 2^24)
  const uint32_t exp = a >> 23, mant = (a & 0x7fffffu) | 0x800000u;  // value = mant * 2^(exp-150)
  const int shift = int(126 - exp);  // 2^(exp-150) / 2^-24 = 2^(exp-126): shift right by 126-exp
  uint32_t h = mant >> shift;
  const uint32_t rest = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (h & 1u))) ++h;
  return uint16_t(sign | h);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_f32(sign | 0x7f800000u | (mant << 13));
  if (exp) return bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
  return (sign ? -1.0f : 1.0f) * float(mant) * 5.9604644775390625e-8f;  // m * 2^-24, exact
}

}  // namespace exl_host

struct __half {
  uint16_t x;  // raw bits (CUDA's __half_raw layout)
  __half() = default;
  __half(float f) : x(exl_host::f32_to_f16_rn(f)) {}
  operator float() const { return exl_host::f16_to_f32(x); }
};
struct alignas(4) __half2 {
  __half x, y;
};
typedef __half half;
typedef __half2 half2;

inline __half __float2half_rn(float f) { return __half(f); }
inline __half __float2half(float f) { return __half(f); }
inline float __half2float(__half h) { return float(h); }
inline __half2 __floats2half2_rn(float a, float b) { return {__half(a), __half(b)}; }
inline __half2 __float2half2_rn(float a) { return {__half(a), __half(a)}; }
inline __half2 __halves2half2(__half a, __half b) { return {a, b}; }
inline float2 __half22float2(__half2 h) { return {float(h.x), float(h.y)}; }
inline float __low2float(__half2 h) { return float(h.x); }
inline float __high2float(__half2 h) { return float(h.y); }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline __half __ushort_as_half(unsigned short u) {
  __half h;
  h.x = u;
  return h;
}
// Arithmetic rounds once to fp16 (exact in fp32 first, as the hardware's fp16 units).
inline __half __hadd(__half a, __half b) { return __half(float(a) + float(b)); }
inline __half __hsub(__half a, __half b) { return __half(float(a) - float(b)); }
inline __half __hmul(__half a, __half b) { return __half(float(a) * float(b)); }
inline __half __hfma(__half a, __half b, __half c) { return __half(float(double(a) * double(b) + double(c))); }
inline __half2 __hadd2(__half2 a, __half2 b) { return {__hadd(a.x, b.x), __hadd(a.y, b.y)}; }
inline __half2 __hmul2(__half2 a, __half2 b) { return {__hmul(a.x, b.x), __hmul(a.y, b.y)}; }
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) { return {__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)}; }

// ---------------------------------------------------------------------------------------------
// Math and bit intrinsics (IEEE results; --use_fast_math approximations are not modeled)

inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __expf(float a) { return std::exp(a); }
inline float __logf(float a) { return std::log(a); }
inline float __saturatef(float a) { return a < 0.0f ? 0.0f : (a > 1.0f ? 1.0f : (a == a ? a : 0.0f)); }
inline float rsqrtf(float a) { return 1.0f / std::sqrt(a); }
inline int __float_as_int(float f) { return int(exl_host::f32_bits(f)); }
inline unsigned __float_as_uint(float f) { return exl_host::f32_bits(f); }
inline float __int_as_float(int i) { return exl_host::bits_f32(uint32_t(i)); }
inline float __uint_as_float(unsigned u) { return exl_host::bits_f32(u); }
inline int __float2int_rn(float f) { return int(std::nearbyint(f)); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __clz(int v) { return v ? __builtin_clz(unsigned(v)) : 32; }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline unsigned __brev(unsigned v) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
  const uint64_t v = (uint64_t(hi) << 32) | lo;
  return unsigned((v << (s & 31)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
  const uint64_t v = (uint64_t(hi) << 32) | lo;
  return unsigned(v >> (s & 31));
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = (uint64_t(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= unsigned((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
}
using std::fabs;
using std::fmax;
using std::fmin;

// ---------------------------------------------------------------------------------------------
// Execution: one launch, its blocks, their threads

namespace exl_host {

struct Abort {};  // unwinds the threads of a failed block

struct LaunchError {
  std::mutex m;
  std::string first;  // the first error since the last get_last_error()
  void set(const std::string& s) {
    std::lock_guard<std::mutex> g(m);
    if (first.empty()) first = s;
  }
};
inline LaunchError& last_error() {
  static LaunchError e;
  return e;
}
inline std::string take_last_error() {
  auto& e = last_error();
  std::lock_guard<std::mutex> g(e.m);
  std::string s;
  s.swap(e.first);
  return s;
}

inline double& barrier_timeout_s() {  // a barrier that waits this long is reported as a deadlock
  static double t = 20.0;
  return t;
}

struct Block;

// A barrier over a changing set of participants: a thread that exits leaves it (as on the hardware,
// where exited threads no longer count), and may thereby release the others.
class Barrier {
 public:
  void reset(int n) { expected_ = n, arrived_ = 0, gen_ = 0; }
  void wait(Block& b, const char* what);
  void leave() {
    std::lock_guard<std::mutex> g(m_);
    --expected_;
    if (arrived_ > 0 && arrived_ >= expected_) release();
  }
  void wake_all() {
    std::lock_guard<std::mutex> g(m_);
    cv_.notify_all();
  }

 private:
  void release() {
    arrived_ = 0;
    ++gen_;
    cv_.notify_all();
  }
  std::mutex m_;
  std::condition_variable cv_;
  int expected_ = 0, arrived_ = 0;
  uint64_t gen_ = 0;
};

struct Warp {
  Barrier bar;
  std::atomic<uint32_t> live{0};  // lanes that have not exited
  uint32_t exists = 0;            // lanes of this warp inside blockDim
  uint64_t slot[2][32];           // shuffle exchange, double-buffered
  uint64_t seq[2][32];            // which of the lane's warp operations wrote the slot
};

struct Block {
  const char* kernel = "";
  dim3 idx, dim;
  int nthreads = 0;
  Barrier bar;
  std::vector<std::unique_ptr<Warp>> warps;
  std::atomic<bool> aborted{false};
  void fail(const std::string& msg) {
    char where[96];
    snprintf(where, sizeof where, " (block (%u,%u,%u))", idx.x, idx.y, idx.z);
    last_error().set(std::string(kernel) + ": " + msg + where);
    if (!aborted.exchange(true)) {
      bar.wake_all();
      for (auto& w : warps) w->bar.wake_all();
    }
  }
};

inline void Barrier::wait(Block& b, const char* what) {
  std::unique_lock<std::mutex> lk(m_);
  if (b.aborted) throw Abort{};
  const uint64_t g = gen_;
  if (++arrived_ >= expected_) {
    release();
    return;
  }
  const auto limit = std::chrono::duration<double>(barrier_timeout_s());
  if (!cv_.wait_for(lk, limit, [&] { return gen_ != g || b.aborted.load(); })) {
    lk.unlock();
    b.fail(std::string("deadlock: ") + what + " waited " + std::to_string(barrier_timeout_s()) +
           " s for threads that never arrived (a barrier in divergent code?)");
    throw Abort{};
  }
  if (gen_ == g) throw Abort{};  // woken by an abort
}

// Per-thread CUDA state.
struct ThreadState {
  Block* block = nullptr;
  unsigned tid = 0;          // linear thread index in the block
  uint64_t warp_ops = 0;     // shuffles/votes this lane has done: the next one uses buffer warp_ops % 2
  void* dyn_smem = nullptr;
};
inline thread_local ThreadState self;

inline Block& block() { return *self.block; }
inline Warp& warp() { return *self.block->warps[self.tid / 32]; }
inline unsigned lane() { return self.tid % 32; }

}  // namespace exl_host

inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;
constexpr int warpSize = 32;

inline void __syncthreads() { exl_host::block().bar.wait(exl_host::block(), "__syncthreads"); }

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

namespace exl_host {

// The lanes that take part in a warp-level operation with `mask`: every lane named must exist and
// be live, and (a limit of the harness) the mask must name every live lane of the warp.
inline void check_warp_mask(unsigned mask, const char* what) {
  Warp& w = warp();
  const uint32_t live = w.live.load();
  const uint32_t named = mask & w.exists;
  if (named & ~live) block().fail(std::string(what) + " with a mask naming lanes that have exited (undefined in CUDA)");
  else if (live & ~mask)
    block().fail(std::string(what) + " with a mask leaving out live lanes: partial-warp masks are not modeled");
  if (block().aborted) throw Abort{};
}

template <typename T>
T shuffle(unsigned mask, T v, int src, const char* what) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  check_warp_mask(mask, what);
  Warp& w = warp();
  const unsigned me = lane();
  const uint64_t op = ++self.warp_ops, p = op % 2;
  uint64_t raw = 0;
  memcpy(&raw, &v, sizeof(T));
  w.slot[p][me] = raw;
  w.seq[p][me] = op;
  w.bar.wait(block(), what);
  if (src < 0) return v;  // out of the lane's segment: its own value
  if (w.seq[p][src] != op) {  // the source lane did not take part in this operation
    block().fail(std::string(what) + " reads lane " + std::to_string(src) + ", which has exited");
    throw Abort{};
  }
  memcpy(&v, &w.slot[p][src], sizeof(T));
  return v;
}

}  // namespace exl_host

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  exl_host::check_warp_mask(mask, "__syncwarp");
  exl_host::warp().bar.wait(exl_host::block(), "__syncwarp");
}
template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const int l = int(exl_host::lane());
  return exl_host::shuffle(mask, v, (l / width) * width + ((src % width) + width) % width, "__shfl_sync");
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int l = int(exl_host::lane()), s = l ^ lane_mask;
  return exl_host::shuffle(mask, v, s / width == l / width ? s : -1, "__shfl_xor_sync");
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int l = int(exl_host::lane());
  return exl_host::shuffle(mask, v, (l % width) + int(delta) < width ? l + int(delta) : -1, "__shfl_down_sync");
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int l = int(exl_host::lane());
  return exl_host::shuffle(mask, v, (l % width) >= int(delta) ? l - int(delta) : -1, "__shfl_up_sync");
}
// Warp votes: every lane publishes its predicate, then reads all of them.
inline unsigned __ballot_sync(unsigned mask, int pred) {
  using namespace exl_host;
  check_warp_mask(mask, "__ballot_sync");
  Warp& w = warp();
  const uint64_t op = ++self.warp_ops, p = op % 2;
  w.slot[p][lane()] = pred ? 1u : 0u;
  w.seq[p][lane()] = op;
  w.bar.wait(block(), "__ballot_sync");
  unsigned r = 0;
  for (unsigned l = 0; l < 32; ++l)
    if ((mask >> l) & (w.exists >> l) & 1u) r |= unsigned(w.seq[p][l] == op && (w.slot[p][l] & 1u)) << l;
  return r;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == (mask & exl_host::warp().exists); }
inline unsigned __activemask() { return exl_host::warp().live.load(); }

// ---------------------------------------------------------------------------------------------
// Memory: read-only loads (alignment checked like the hardware), atomics

template <typename T>
T __ldg(const T* p) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(T)) {
    exl_host::block().fail("misaligned address: __ldg of " + std::to_string(sizeof(T)) + " bytes at an address not " +
                           std::to_string(alignof(T)) + "-byte aligned");
    throw exl_host::Abort{};
  }
  return *p;
}

template <typename T>
T atomicAdd(T* p, T v) {
  if constexpr (std::is_integral<T>::value) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
  } else {
    T old, desired;
    __atomic_load(p, &old, __ATOMIC_RELAXED);
    do {
      desired = old + v;
    } while (!__atomic_compare_exchange(p, &old, &desired, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return old;
  }
}
template <typename T>
T atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }
template <typename T>
T atomicExch(T* p, T v) {
  T old;
  __atomic_exchange(p, &v, &old, __ATOMIC_RELAXED);
  return old;
}
template <typename T>
T atomicCAS(T* p, T expected, T desired) {
  __atomic_compare_exchange(p, &expected, &desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return expected;
}
template <typename T>
T atomicMax(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
template <typename T>
T atomicMin(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (old > v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
template <typename T>
T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
template <typename T>
T atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_RELAXED); }

// ---------------------------------------------------------------------------------------------
// The launch: a pool of worker threads runs each block's threads concurrently

namespace exl_host {

constexpr int kMaxThreadsPerBlock = 1024;
constexpr size_t kMaxDynamicShared = 48 * 1024;  // without cudaFuncSetAttribute opt-in

class Pool {
 public:
  static Pool& get() {
    static Pool p;
    return p;
  }
  // Run body(tid) for tid in [0, n) on n distinct threads, all at once; returns when all are done.
  void run(int n, const std::function<void(unsigned)>& body) {
    std::unique_lock<std::mutex> lk(m_);
    while (int(workers_.size()) < n) {
      const unsigned id = unsigned(workers_.size());
      workers_.emplace_back([this, id] { loop(id); });
    }
    body_ = &body;
    active_ = n;
    pending_ = n;
    ++gen_;
    cv_.notify_all();
    done_cv_.wait(lk, [&] { return pending_ == 0; });
    body_ = nullptr;
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> g(m_);
      stop_ = true;
      cv_.notify_all();
    }
    for (auto& t : workers_) t.join();
  }

 private:
  void loop(unsigned id) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(unsigned)>* body;
      {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [&] { return stop_ || (gen_ != seen && int(id) < active_); });
        if (stop_) return;
        seen = gen_;
        body = body_;
      }
      (*body)(id);
      std::lock_guard<std::mutex> g(m_);
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(unsigned)>* body_ = nullptr;
  int active_ = 0, pending_ = 0;
  uint64_t gen_ = 0;
  bool stop_ = false;
};

inline std::mutex& launch_mutex() {  // one launch at a time (static __shared__ is per kernel, not per block)
  static std::mutex m;
  return m;
}

template <typename... P, typename... A>
void launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 blk, size_t smem, A&&... args) {
  std::lock_guard<std::mutex> one_at_a_time(launch_mutex());
  const uint64_t threads = uint64_t(blk.x) * blk.y * blk.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || blk.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    char msg[160];
    snprintf(msg, sizeof msg, "%s: invalid configuration argument: grid (%u,%u,%u), block (%u,%u,%u)", name, grid.x,
             grid.y, grid.z, blk.x, blk.y, blk.z);
    last_error().set(msg);
    return;
  }
  if (smem > kMaxDynamicShared) {
    last_error().set(std::string(name) + ": too much dynamic shared memory (" + std::to_string(smem) + " bytes > " +
                     std::to_string(kMaxDynamicShared) + " without an opt-in)");
    return;
  }
  // Arguments are copied once, as the launch copies them to the device (the kernel takes them by value).
  auto call = [&](auto&... a) { kernel(a...); };
  auto params = std::make_tuple(P(args)...);
  std::vector<float> dyn((smem + sizeof(float) - 1) / sizeof(float) + 4);
  const int n = int(threads), nwarps = (n + 31) / 32;
  Block b;
  b.kernel = name;
  b.dim = blk;
  b.nthreads = n;
  for (int w = 0; w < nwarps; ++w) b.warps.emplace_back(new Warp);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        b.idx = dim3(x, y, z);
        b.aborted = false;
        b.bar.reset(n);
        for (int w = 0; w < nwarps; ++w) {
          const int lanes = n - 32 * w < 32 ? n - 32 * w : 32;
          Warp& wp = *b.warps[w];
          wp.bar.reset(lanes);
          wp.exists = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
          wp.live = wp.exists;
          memset(wp.seq, 0, sizeof wp.seq);
        }
        std::fill(dyn.begin(), dyn.end(), std::numeric_limits<float>::quiet_NaN());  // uninitialized shared memory
        Pool::get().run(n, [&](unsigned tid) {
          self = ThreadState{&b, tid, 0, dyn.data()};  // warp_ops restarts at 0 with the seq tags
          threadIdx = uint3{tid % blk.x, (tid / blk.x) % blk.y, tid / (blk.x * blk.y)};
          blockIdx = uint3{x, y, z};
          blockDim = blk;
          gridDim = grid;
          auto local = params;  // each thread sees its own copy of the parameters
          try {
            std::apply(call, local);
          } catch (const Abort&) {
          } catch (const std::exception& e) {
            b.fail(std::string("exception: ") + e.what());
          }
          Warp& w = *b.warps[tid / 32];
          w.live.fetch_and(~(1u << (tid % 32)));
          w.bar.leave();
          b.bar.leave();
          self = ThreadState{};
        });
        if (b.aborted) return;
      }
}

inline void* dynamic_shared_base() { return self.dyn_smem; }

}  // namespace exl_host

// kernel<<<grid, block, smem, stream>>>(args...) is written EXL_LAUNCH(grid, block, smem, stream, kernel)(args...)
// in the sources (cuda_device.cuh); here it runs the grid on the pool before returning.
#define EXL_LAUNCH(grid, block, smem, stream, ...)                                              \
  [&](auto&&... exl_args) {                                                                     \
    (void)(stream);                                                                             \
    ::exl_host::launch(#__VA_ARGS__, &__VA_ARGS__, dim3(grid), dim3(block), size_t(smem), exl_args...); \
  }

inline cudaError_t cudaGetLastError() {
  return exl_host::take_last_error().empty() ? cudaSuccess : cudaErrorLaunchFailure;
}
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
