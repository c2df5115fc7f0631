// The fused float32 CPU ops of cpu_fused.cpp, for C++ callers in the same extension (the decode
// step in cpu_step.cpp). Same semantics as their Python bindings (see cpu_fused.cpp).
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <tuple>

namespace exl {
namespace fused {

struct Ops {
  at::Tensor (*rms_norm)(const at::Tensor& x, const at::Tensor& weight, double eps);
  std::tuple<at::Tensor, c10::optional<at::Tensor>> (*add_rms_norm)(at::Tensor& x, const at::Tensor& residual,
                                                                    const c10::optional<at::Tensor>& weight, double eps,
                                                                    const c10::optional<at::Tensor>& x_weight);
  void (*rope_)(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                const c10::optional<at::Tensor>& q_weight, const c10::optional<at::Tensor>& k_weight, double eps);
  at::Tensor (*decode_attention)(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                                 at::Tensor& v_cache, int64_t layer, int64_t pos, double scale, int64_t window,
                                 double softcap, const std::string& isa);
  at::Tensor (*act_mul)(at::Tensor& gate, const at::Tensor& up, const std::string& act, const std::string& isa);
  at::Tensor (*paged_step_attention)(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     at::Tensor& k_store, at::Tensor& v_store, const at::Tensor& pages,
                                     const at::Tensor& lengths, int64_t page_size, double scale, int64_t window,
                                     double softcap);
};

const Ops& ops();

}  // namespace fused
}  // namespace exl
