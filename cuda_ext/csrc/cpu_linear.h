// What the CPU bindings share between layer kinds (scalar-coded QuantLinearCPU, trellis-coded
// TrellisLinearCPU): the interface the decode step (cpu_step.cpp) calls, the ISA table lookup and the rotations
// of docs/format.md §1.4 / §7.5.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "cpu_kernels.h"
#include "cpu_pool.h"

namespace exl {
namespace cpu {

class LinearCPU {
 public:
  virtual ~LinearCPU() = default;
  // y = layer(x) for float32 x [..., in_features]; path and exact as QuantLinearCPU's.
  virtual at::Tensor forward(const at::Tensor& x, const std::string& path, int64_t gemm_min_rows, bool exact) = 0;
  virtual int64_t in_features() const = 0;
  virtual int64_t out_features() const = 0;
};

// The kernel table of an instruction set by name ("auto" or "": the best here). Errors name the
// available ones. Defined in cpu_ops.cpp.
const Kernels* kernels_named(const std::string& name);

// EXL_CPU_ISA, or "" when unset.
inline std::string env_isa() {
  const char* e = std::getenv("EXL_CPU_ISA");
  return e ? std::string(e) : std::string();
}

// In place on rows x[m, 0:n] (m < M, contiguous): the normalized blockwise Walsh-Hadamard
// transform with the sign flip from packed bits applied before it (input rotation) or after it
// (output rotation); rows split over threads (chunks of >= ~4K values: a 16-row decode step shares its
// 576-wide rotations between 2 threads). With `src`, each chunk first copies its rows from src.
inline void rotate_rows(const Kernels* k, float* x, int64_t M, int64_t n, const uint8_t* signs, bool signs_first,
                        const float* src = nullptr) {
  const int64_t hb = hadamard_block(n);
  exl::cpu::parallel_for(0, M, std::max<int64_t>(1, 4096 / std::max<int64_t>(n, 1)), [&](int64_t m0, int64_t m1) {
    if (src) std::copy(src + m0 * n, src + m1 * n, x + m0 * n);
    k->fwht(x + m0 * n, m1 - m0, n, n, hb, signs, signs_first);
  });
}

}  // namespace cpu
}  // namespace exl
