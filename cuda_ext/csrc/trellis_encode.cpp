// Viterbi search over the bitshift trellis of docs/format.md §7: the quantizer's encoder for
// trellis-coded layers (quant/trellis.py). Plain-Python reference: quant.trellis.viterbi_reference.
//
// A walk of T steps has states s_t of L bits; s_{t+1} = (s_t >> K) | (new K bits << (L - K)). So
// the predecessors of s' are the 2^K states s = ((s' & (2^(L-K) - 1)) << K) | c, one group of
// consecutive states: a step takes the minimum over each group once (2^L reads) and adds every
// state's weighted error, O(2^L) per step for any K.
//
// The SIMD lanes are tiles, not states: W tiles (W = 16 on AVX-512, 8 on AVX2/baseline) walk the
// same trellis side by side, so every inner loop is a plain loop over W lanes that the compiler
// vectorizes without shuffles, for every K and L. cost[s][lane] is W floats per state.
//
// Tail-biting (the stream is circular, §7.2): a walk is valid when s_0's low L-K bits equal
// s_{T-1}'s high L-K bits (the overlap). `encode` finds the overlap as QTIP does: a first,
// unconstrained pass over the window of steps around the wrap point (T-w .. T-1, 0 .. w-1; w = 8 L/K
// by default: measured on Gaussian data, w = 4 L/K loses ~0.5% MSE at K=2) picks the state at step 0; the second pass runs over all T steps with s_0 and s_{T-1} constrained to it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace py = pybind11;

namespace exl {
namespace trellis {
namespace {

constexpr float kInf = 1e30f;
// From this many groups (2^(L-K)) on, a step is one sweep over the groups into a second cost array
// (each group's best feeds its 2^K successors at once): ~15% less time at K <= 3, L = 12. With fewer,
// larger groups the sweep's 2^K scattered stores cost more than the separate pass over the states.
// Both orders compute the same values, so the walks are identical.
constexpr int64_t kFusedGroups = 512;

struct Job {
  const float* x;     // [B, T] targets in code units
  const float* c;     // [B, T] error weights
  const float* vals;  // [2^L] code values
  const int32_t* overlap;  // [B] fixed overlaps, or nullptr
  int32_t* states;    // [B, T] out
  float* cost;        // [B] out: the chosen walk's weighted squared error
  int64_t B, T;
  int K, L, window;
};

struct Scratch {
  std::vector<float> cost_buf, m_buf;  // over-allocated by 64 bytes: aligned views below
  std::vector<uint8_t> bp;
  std::vector<int32_t> order;  // step i of a pass -> position in the tile
  float* cost = nullptr;
  float* next = nullptr;  // the second cost array of the one-sweep step (kFusedGroups)
  float* m = nullptr;
  void size(int64_t states, int64_t groups, int64_t steps, int lanes) {
    cost_buf.resize(size_t(2 * states * lanes + 16));
    m_buf.resize(size_t(groups * lanes + 16));
    cost = align(cost_buf.data());
    next = cost + states * lanes;
    m = align(m_buf.data());
    bp.resize(size_t(steps * groups * lanes));
    order.resize(size_t(steps));
  }
  static float* align(float* p) { return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63)); }
};

// GCC vector extensions: W lanes of float / int32 / uint8, lowered to the target's registers.
template <int W>
struct Vec {
  typedef float f __attribute__((vector_size(4 * W)));
  typedef int32_t i __attribute__((vector_size(4 * W)));
  typedef uint8_t b __attribute__((vector_size(W)));
};

// One Viterbi pass over `steps` steps for W lanes. order[i]: position in the tile of step i.
// overlap[l] < 0: free start and end; else s_0 & gmask == overlap and s_{last} >> K == overlap.
// Writes path[i * W + l] (state at step i) and total[l].
template <int W>
static inline __attribute__((always_inline)) void viterbi_lanes(const float* const* xs, const float* const* cs,
                                                                 int lanes, const int32_t* order, int steps,
                                                                 const float* vals, int K, int L,
                                                                 const int32_t* overlap, Scratch& sc,
                                                                 int32_t* path, float* total) {
  typedef typename Vec<W>::f VF;
  typedef typename Vec<W>::i VI;
  typedef typename Vec<W>::b VB;
  const int64_t S = int64_t(1) << L, G = int64_t(1) << (L - K), C = int64_t(1) << K;
  const uint32_t gmask = uint32_t(G - 1);
  VF* __restrict cost = reinterpret_cast<VF*>(sc.cost);
  VF* __restrict m = reinterpret_cast<VF*>(sc.m);
  VB* __restrict bp = reinterpret_cast<VB*>(sc.bp.data());
  VI ov;
  for (int l = 0; l < W; ++l) ov[l] = l < lanes ? overlap[l] : -1;
  VF xv, cv;
  auto load = [&](int i) {
    const int p = order[i];
    for (int l = 0; l < W; ++l) {
      xv[l] = l < lanes ? xs[l][p] : 0.f;
      cv[l] = l < lanes ? cs[l][p] : 0.f;
    }
  };
  // step 0
  load(0);
  const VF inf = VF{} + kInf;
  for (int64_t s = 0; s < S; ++s) {
    const VF d = xv - vals[s];
    const VI ok = (ov < 0) | (ov == int32_t(uint32_t(s) & gmask));
    cost[s] = ok ? cv * d * d : inf;
  }
  VF* __restrict next = reinterpret_cast<VF*>(sc.next);
  // the best predecessor of group g (the states g << K | c) in `cost`: its cost, its c into bpi[g]
  auto group_best = [&](int64_t g, VB* __restrict bpi) {
    const VF* __restrict grp = cost + (g << K);
    VF best = grp[0];
    VI arg = VI{};
    for (int64_t c = 1; c < C; ++c) {
      const VF r = grp[c];
      const VI lt = r < best;
      best = lt ? r : best;
      arg = lt ? (VI{} + int32_t(c)) : arg;
    }
    bpi[g] = __builtin_convertvector(arg, VB);
    return best;
  };
  for (int i = 1; i < steps && G >= kFusedGroups; ++i) {
    load(i);
    // one sweep: the best predecessor of each group g (the states g << K | c), then the C states it
    // leads to (hi << (L-K) | g), each its group's best plus its own weighted error, into `next`
    VB* __restrict bpi = bp + int64_t(i) * G;
    for (int64_t g = 0; g < G; ++g) {
      const VF best = group_best(g, bpi);
      for (int64_t hi = 0; hi < C; ++hi) {
        const VF d = xv - vals[hi * G + g];
        next[hi * G + g] = best + cv * d * d;
      }
    }
    std::swap(cost, next);
  }
  for (int i = 1; i < steps && G < kFusedGroups; ++i) {
    // best predecessor of each group g (the states g << K | c)
    VB* __restrict bpi = bp + int64_t(i) * G;
    for (int64_t g = 0; g < G; ++g) m[g] = group_best(g, bpi);
    load(i);
    // every state: its group's best plus its own weighted error
    for (int64_t hi = 0; hi < C; ++hi) {
      const float* __restrict v = vals + hi * G;
      VF* __restrict out = cost + hi * G;
      for (int64_t g = 0; g < G; ++g) {
        const VF d = xv - v[g];
        out[g] = m[g] + cv * d * d;
      }
    }
  }
  // the last state: any (free) or one whose high L-K bits are the overlap
  const float* fc = reinterpret_cast<const float*>(cost);
  const uint8_t* fb = reinterpret_cast<const uint8_t*>(bp);
  for (int l = 0; l < lanes; ++l) {
    int64_t lo = 0, hi = S;
    if (ov[l] >= 0) {
      lo = int64_t(ov[l]) << K;
      hi = lo + C;
    }
    int64_t arg = lo;
    float best = fc[lo * W + l];
    for (int64_t s = lo + 1; s < hi; ++s)
      if (fc[s * W + l] < best) {
        best = fc[s * W + l];
        arg = s;
      }
    total[l] = best;
    uint32_t s = uint32_t(arg);
    path[int64_t(steps - 1) * W + l] = int32_t(s);
    for (int i = steps - 1; i > 0; --i) {
      const uint32_t g = s & gmask;
      s = (g << K) | fb[(int64_t(i) * G + g) * W + l];
      path[int64_t(i - 1) * W + l] = int32_t(s);
    }
  }
}

// Both passes for lanes [b0, b0 + lanes) of a job.
template <int W>
static inline __attribute__((always_inline)) void encode_lanes(const Job& job, int64_t b0, int lanes, Scratch& sc) {
  const int T = int(job.T), K = job.K, L = job.L;
  const uint32_t gmask = (uint32_t(1) << (L - K)) - 1;
  const float* xs[W];
  const float* cs[W];
  for (int l = 0; l < lanes; ++l) {
    xs[l] = job.x + (b0 + l) * T;
    cs[l] = job.c + (b0 + l) * T;
  }
  std::vector<int32_t> path(size_t(T) * W);
  float total[W];
  int32_t overlap[W];
  for (int l = 0; l < W; ++l) overlap[l] = job.overlap && l < lanes ? job.overlap[b0 + l] : -1;
  if (!job.overlap && job.window >= 0) {  // pass 1: free walk over the steps around the wrap point
    // window 0: eight constraint lengths (L/K steps) each side, enough for the survivors to merge
    const int auto_w = std::max(16, 8 * ((L + K - 1) / K));
    const int w = std::min(job.window > 0 ? job.window : auto_w, T / 2);
    for (int i = 0; i < 2 * w; ++i) sc.order[i] = (T - w + i) % T;
    viterbi_lanes<W>(xs, cs, lanes, sc.order.data(), 2 * w, job.vals, K, L, overlap, sc, path.data(), total);
    for (int l = 0; l < lanes; ++l) overlap[l] = int32_t(uint32_t(path[int64_t(w) * W + l]) & gmask);
  }
  for (int i = 0; i < T; ++i) sc.order[i] = i;
  viterbi_lanes<W>(xs, cs, lanes, sc.order.data(), T, job.vals, K, L, overlap, sc, path.data(), total);
  for (int l = 0; l < lanes; ++l) {
    for (int i = 0; i < T; ++i) job.states[(b0 + l) * T + i] = path[int64_t(i) * W + l];
    job.cost[b0 + l] = total[l];
  }
}

using EncodeFn = void (*)(const Job&, int64_t, int, Scratch&);

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) void encode_avx512(const Job& j, int64_t b0,
                                                                                         int n, Scratch& sc) {
  encode_lanes<16>(j, b0, n, sc);
}
__attribute__((target("avx2,fma"))) void encode_avx2(const Job& j, int64_t b0, int n, Scratch& sc) {
  encode_lanes<8>(j, b0, n, sc);
}
void encode_scalar(const Job& j, int64_t b0, int n, Scratch& sc) { encode_lanes<8>(j, b0, n, sc); }

struct Isa {
  const char* name;
  EncodeFn fn;
  int lanes;
};

std::vector<Isa> available() {
  std::vector<Isa> out = {{"scalar", &encode_scalar, 8}};
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.push_back({"avx2", &encode_avx2, 8});
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    out.push_back({"avx512", &encode_avx512, 16});
#endif
  return out;
}

Isa pick(std::string name) {
  const auto all = available();
  if (name == "auto" || name.empty()) {
    const char* e = std::getenv("EXL_CPU_ISA");  // the kernels' names map onto the encoder's
    name = e ? e : "auto";
    if (name == "avx512vnni") name = "avx512";
    if (name == "avxvnni") name = "avx2";
    if (name == "auto") return all.back();
  }
  std::string names;
  for (const auto& i : all) {
    if (name == i.name) return i;
    names += std::string(" ") + i.name;
  }
  TORCH_CHECK(false, "exl trellis encoder: instruction set '", name, "' is not available here (available:", names, ")");
}

void check_f32(const at::Tensor& t, const char* what, int64_t i) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), "exl trellis_viterbi: ", what,
              "[", i, "] must be a contiguous float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

// Encode every tile of every job; returns (states int32 [B_i, T], cost float32 [B_i]) per job.
std::vector<std::pair<at::Tensor, at::Tensor>> viterbi(const std::vector<at::Tensor>& x, const std::vector<at::Tensor>& c,
                                                       const std::vector<at::Tensor>& codebooks,
                                                       const std::vector<int64_t>& bits,
                                                       const std::vector<int64_t>& state_bits, int64_t window,
                                                       const c10::optional<std::vector<at::Tensor>>& overlaps,
                                                       const std::string& isa) {
  const size_t n = x.size();
  TORCH_CHECK(c.size() == n && codebooks.size() == n && bits.size() == n && state_bits.size() == n,
              "exl trellis_viterbi: x, c, codebooks, bits and state_bits must have one entry per job");
  const Isa impl = pick(isa);
  std::vector<Job> jobs(n);
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  int maxL = 0;
  int64_t maxT = 1;
  std::vector<std::pair<size_t, int64_t>> work;  // (job, first lane)
  for (size_t j = 0; j < n; ++j) {
    check_f32(x[j], "x", j);
    check_f32(c[j], "c", j);
    check_f32(codebooks[j], "codebooks", j);
    const int K = int(bits[j]), L = int(state_bits[j]);
    TORCH_CHECK(K >= 1 && K <= 8 && L > K && L <= 20, "exl trellis_viterbi: job ", j, " has K=", K, ", L=", L,
                " (need 1 <= K <= 8 and K < L <= 20)");
    TORCH_CHECK(x[j].dim() == 2 && c[j].sizes() == x[j].sizes(), "exl trellis_viterbi: x[", j,
                "] must be [tiles, steps] and c[", j, "] the same shape");
    TORCH_CHECK(codebooks[j].numel() == (int64_t(1) << L), "exl trellis_viterbi: codebooks[", j, "] has ",
                codebooks[j].numel(), " values, 2^L = ", int64_t(1) << L);
    const int64_t B = x[j].size(0), T = x[j].size(1);
    TORCH_CHECK(T >= 2 && T * K >= L, "exl trellis_viterbi: job ", j, " has ", T, " steps; a circular walk needs T*K >= L");
    const int32_t* ov = nullptr;
    if (overlaps) {
      TORCH_CHECK(overlaps->size() == n, "exl trellis_viterbi: overlaps must have one entry per job");
      const at::Tensor& o = (*overlaps)[j];
      TORCH_CHECK(o.scalar_type() == at::kInt && o.is_contiguous() && o.numel() == B, "exl trellis_viterbi: overlaps[",
                  j, "] must be a contiguous int32 [", B, "] tensor");
      ov = o.data_ptr<int32_t>();
    }
    auto states = at::empty({B, T}, at::kInt);
    auto cost = at::empty({B}, at::kFloat);
    jobs[j] = Job{x[j].data_ptr<float>(), c[j].data_ptr<float>(), codebooks[j].data_ptr<float>(), ov,
                  states.data_ptr<int32_t>(), cost.data_ptr<float>(), B, T, K, L, int(window)};
    out.emplace_back(states, cost);
    maxL = std::max(maxL, L);
    maxT = std::max(maxT, T);
    for (int64_t b = 0; b < B; b += impl.lanes) work.emplace_back(j, b);
  }
  int64_t maxG = 1;
  for (size_t j = 0; j < n; ++j) maxG = std::max<int64_t>(maxG, int64_t(1) << (state_bits[j] - bits[j]));
  {
    py::gil_scoped_release release;
    at::parallel_for(0, int64_t(work.size()), 1, [&](int64_t w0, int64_t w1) {
      Scratch sc;
      sc.size(int64_t(1) << maxL, maxG, maxT, impl.lanes);
      for (int64_t w = w0; w < w1; ++w) {
        const Job& job = jobs[work[w].first];
        const int64_t b0 = work[w].second;
        impl.fn(job, b0, int(std::min<int64_t>(impl.lanes, job.B - b0)), sc);
      }
    });
  }
  return out;
}

std::vector<std::string> isa_names() {
  std::vector<std::string> out;
  for (const auto& i : available()) out.push_back(i.name);
  return out;
}

}  // namespace
}  // namespace trellis
}  // namespace exl

// Called from cpu_ops.cpp's PYBIND11_MODULE.
void register_trellis_encode(py::module_& m) {
  m.def("trellis_viterbi", &exl::trellis::viterbi, py::arg("x"), py::arg("c"), py::arg("codebooks"), py::arg("bits"),
        py::arg("state_bits"), py::arg("window") = 0, py::arg("overlaps") = py::none(), py::arg("isa") = "auto",
        "Least weighted-squared-error circular walks through the bitshift trellis, per tile of each job: "
        "tail-biting by a first pass over `window` steps each side of the wrap point (0: 8 L/K); with "
        "`overlaps`, one exact pass constrained to them; window < 0 and no overlaps: free start and end");
  m.def("trellis_encoder_isas", &exl::trellis::isa_names, "Instruction sets of the trellis encoder usable here");
}
