// Validation of a quantized layer's tensors (docs/format.md §1), shared by the CPU and CUDA
// bindings. Every error names the tensor, what was expected and what was found.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "format.h"

namespace exl {

struct LayerSpec {
  SegmentTable segs;
  int64_t N = 0, K = 0, row_bytes = 0, n_groups = 0;
};

inline bool present(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

inline LayerSpec check_layer(const at::Tensor& qweight, const at::Tensor& qscale, const at::Tensor& qmeta,
                             const c10::optional<at::Tensor>& perm, const c10::optional<at::Tensor>& su,
                             const c10::optional<at::Tensor>& sv, const c10::optional<at::Tensor>& bias) {
  const char* who = "exl QuantLinear";
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2, who,
              ": qweight must be a 2-D uint8 tensor, got ", qweight.scalar_type(), " ", qweight.sizes());
  TORCH_CHECK(qscale.scalar_type() == at::kHalf && qscale.dim() == 2, who,
              ": qscale must be a 2-D float16 tensor, got ", qscale.scalar_type(), " ", qscale.sizes());
  TORCH_CHECK(qmeta.scalar_type() == at::kInt && qmeta.dim() == 2 && qmeta.size(1) == 3 && qmeta.size(0) >= 1,
              who, ": qmeta must be int32 [n_segments, 3], got ", qmeta.scalar_type(), " ", qmeta.sizes());
  TORCH_CHECK(qmeta.size(0) <= kMaxSegments, who, ": ", qmeta.size(0), " segments, the kernels support at most ",
              kMaxSegments);
  TORCH_CHECK(qweight.device() == qscale.device(), who, ": qweight is on ", qweight.device(), " but qscale on ",
              qscale.device());
  LayerSpec spec;
  const auto meta = qmeta.to(at::kCPU).contiguous();
  const int32_t* mp = meta.data_ptr<int32_t>();
  SegmentTable& t = spec.segs;
  t.count = int(meta.size(0));
  for (int s = 0; s < t.count; ++s) {
    const int k_len = mp[3 * s], bits = mp[3 * s + 1], gs = mp[3 * s + 2];
    TORCH_CHECK(bits >= 1 && bits <= 8, who, ": qmeta segment ", s, " has bits=", bits, " (must be 1..8)");
    TORCH_CHECK(gs > 0 && gs % kBlock == 0, who, ": qmeta segment ", s, " has group_size=", gs,
                " (must be a positive multiple of 32)");
    TORCH_CHECK(k_len > 0 && k_len % gs == 0, who, ": qmeta segment ", s, " has k_len=", k_len,
                ", not a positive multiple of its group_size ", gs);
    t.seg[s] = Segment{k_len, bits, gs, int(spec.K), int(spec.row_bytes), int(spec.n_groups)};
    spec.K += k_len;
    spec.row_bytes += int64_t(k_len) / kBlock * block_bytes(bits);
    spec.n_groups += k_len / gs;
  }
  spec.N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == spec.row_bytes, who, ": qweight has ", qweight.size(1),
              " bytes per row but the segments in qmeta need ", spec.row_bytes);
  TORCH_CHECK(qscale.size(0) == spec.N && qscale.size(1) == spec.n_groups, who, ": qscale is ", qscale.sizes(),
              " but qweight and qmeta need [", spec.N, ", ", spec.n_groups, "]");
  if (present(perm)) {
    TORCH_CHECK((perm->scalar_type() == at::kShort || perm->scalar_type() == at::kInt) && perm->dim() == 1 &&
                    perm->size(0) == spec.K,
                who, ": perm must be int16/int32 [", spec.K, "], got ", perm->scalar_type(), " ", perm->sizes());
    const auto p = perm->to(at::kCPU, at::kLong).contiguous();
    std::vector<bool> seen(spec.K, false);
    const int64_t* pp = p.data_ptr<int64_t>();
    for (int64_t i = 0; i < spec.K; ++i) {
      TORCH_CHECK(pp[i] >= 0 && pp[i] < spec.K && !seen[pp[i]], who, ": perm is not a permutation of 0..",
                  spec.K - 1, " (entry ", i, " is ", pp[i], ")");
      seen[pp[i]] = true;
    }
  }
  auto check_signs = [&](const c10::optional<at::Tensor>& s, int64_t n, const char* name) {
    if (!present(s)) return;
    TORCH_CHECK(s->scalar_type() == at::kByte && s->dim() == 1 && s->size(0) == (n + 7) / 8, who, ": ", name,
                " must be uint8 [", (n + 7) / 8, "], got ", s->scalar_type(), " ", s->sizes());
  };
  check_signs(su, spec.K, "su");
  check_signs(sv, spec.N, "sv");
  if (present(bias))
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == spec.N, who, ": bias must be [", spec.N, "], got ", bias->sizes());
  return spec;
}

}  // namespace exl
