// Torch bindings of the CUDA trellis kernels (cuda_trellis.cu): the forward pass of docs/format.md
// §7.5 on fp16 activations. The rotations are the scalar layers' (launch_hadamard, cuda_kernels.h).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <string>

#include "cuda_kernels.h"
#include "cuda_trellis.h"

namespace exl {
namespace cuda {
namespace {

const char* kWho = "exl TrellisLinear (CUDA kernels)";

// The device the kernels run on: CUDA, or the CPU under the host harness (as in cuda_ops.cpp).
#ifdef EXL_CUDA_HOST
constexpr auto kTrellisDevice = c10::DeviceType::CPU;
#else
constexpr auto kTrellisDevice = c10::DeviceType::CUDA;
#endif

class TrellisLinearCUDA {
 public:
  TrellisLinearCUDA(torch::Tensor trellis, torch::Tensor tscale, torch::Tensor tmeta, torch::Tensor su,
                    c10::optional<torch::Tensor> sv, c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> tcode) {
    TORCH_CHECK(trellis.device().type() == kTrellisDevice, kWho, ": trellis must be a CUDA tensor, got one on ",
                trellis.device());
    TORCH_CHECK(trellis.scalar_type() == torch::kInt32 && trellis.dim() == 3, kWho,
                ": trellis must be int32 [N/16, K/16, 8*bits], got ", trellis.scalar_type(), " ", trellis.sizes());
    TORCH_CHECK(tmeta.scalar_type() == torch::kInt32 && tmeta.numel() == 6, kWho, ": tmeta must be int32 [6]");
    const auto meta = tmeta.to(torch::kCPU).contiguous();
    const int32_t* mp = meta.data_ptr<int32_t>();
    TORCH_CHECK((mp[0] == 1 && mp[3] == kCodeLcgByteSum) || (mp[0] == 2 && is_two_table(mp[3])), kWho,
                ": tmeta layout version ", mp[0], " / code ", mp[3],
                " unsupported (this exl reads version 1 with code 1 and version 2 with codes 2 and 3, docs/format.md §7)");
    dev_.code = TrellisCode{mp[1], mp[2], uint32_t(mp[4]), uint32_t(mp[5]), mp[3]};
    const bool two_table = is_two_table(dev_.code.code);
    TORCH_CHECK(dev_.code.bits >= 1 && dev_.code.bits <= 8 && dev_.code.state_bits >= std::max(8, dev_.code.bits) &&
                    dev_.code.state_bits <= 16 && (two_table || (dev_.code.mul & 1u)),
                kWho, ": bad tmeta (bits ", dev_.code.bits, ", state bits ", dev_.code.state_bits, ")");
    TORCH_CHECK(!two_table || (dev_.code.state_bits == 12 && dev_.code.bits <= 7), kWho,
                ": trellis code ", dev_.code.code, " needs L = 12 state bits and K <= 7 bits per weight, got L = ", dev_.code.state_bits,
                ", K = ", dev_.code.bits);
    TORCH_CHECK(trellis.size(2) == tile_words(dev_.code.bits), kWho, ": trellis has ", trellis.size(2),
                " words per tile, ", dev_.code.bits, "-bit tiles need ", tile_words(dev_.code.bits));
    const bool has_tcode = tcode && tcode->defined();
    if (two_table) {
      const int size = 2 * two_table_size(dev_.code.code);
      TORCH_CHECK(has_tcode, kWho, ": a code ", dev_.code.code, " layer needs its tables: pass tcode (the layer's int8 [",
                  size, "] P.tcode)");
      TORCH_CHECK(tcode->scalar_type() == torch::kInt8 && tcode->numel() == size, kWho, ": tcode of a code ",
                  dev_.code.code, " layer must be int8 [", size, "], got ", tcode->scalar_type(), " ", tcode->sizes());
      TORCH_CHECK(tcode->device() == trellis.device(), kWho, ": tcode is on ", tcode->device(),
                  ", the layer (trellis) on ", trellis.device(), "; move it there");
      tcode_ = tcode->contiguous();
    } else {
      TORCH_CHECK(!has_tcode, kWho, ": tcode given for a code ", dev_.code.code,
                  " layer; only codes 2 and 3 have tables (leave tcode unset)");
    }
    dev_.N = trellis.size(0) * kTile;
    dev_.K = trellis.size(1) * kTile;
    TORCH_CHECK(tscale.scalar_type() == torch::kHalf && tscale.numel() == dev_.N, kWho, ": tscale must be float16 [",
                dev_.N, "]");
    TORCH_CHECK(su.scalar_type() == torch::kUInt8 && su.numel() == (dev_.K + 7) / 8, kWho, ": su must be uint8 [",
                (dev_.K + 7) / 8, "], got ", su.scalar_type(), " ", su.sizes());
    const bool has_sv = sv && sv->defined();  // the output rotation: optional from format version 3 (§7.4)
    TORCH_CHECK(!has_sv || (sv->scalar_type() == torch::kUInt8 && sv->numel() == (dev_.N + 7) / 8), kWho,
                ": sv must be uint8 [", (dev_.N + 7) / 8, "], got ", sv->scalar_type(), " ", sv->sizes());
    const auto d = trellis.device();
    trellis_ = trellis.contiguous();
    tscale_ = tscale.to(d).contiguous();
    su_ = su.to(d).contiguous();
    if (has_sv) sv_ = sv->to(d).contiguous();
    if (bias && bias->defined()) {
      TORCH_CHECK(bias->numel() == dev_.N, kWho, ": bias must be [", dev_.N, "]");
      bias_ = bias->to(d, torch::kFloat32).contiguous();
    }
    dev_.words = reinterpret_cast<const uint32_t*>(trellis_.data_ptr<int32_t>());
    dev_.tscale = reinterpret_cast<const __half*>(tscale_.data_ptr<at::Half>());
    if (two_table) dev_.code.tables = tcode_.data_ptr<int8_t>();
  }

  int64_t in_features() const { return dev_.K; }
  const TrellisDev& dev() const { return dev_; }  // for the host harness's direct launcher entries
  int64_t out_features() const { return dev_.N; }

  // Q̂ = tscale * values [N, K] in fp16.
  torch::Tensor dequantize() const {
    const c10::cuda::CUDAGuard guard(trellis_.device());
    auto out = torch::empty({dev_.N, dev_.K}, tscale_.options());
    launch_trellis_dequant(dev_, 0, dev_.N, reinterpret_cast<__half*>(out.data_ptr<at::Half>()),
                           c10::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
  }

  // The most rows the "auto" path sends to the GEMV (8 for code 1, 16 for code 2).
  int64_t gemv_max_rows() const { return max_trellis_gemv_rows(dev_.code); }

  // path: "auto" (GEMV up to gemv_max_rows rows, GEMM above), "gemv" or "gemm".
  torch::Tensor forward(const torch::Tensor& x, const std::string& path) const {
    TORCH_CHECK(x.device().type() == kTrellisDevice && x.scalar_type() == torch::kHalf, kWho,
                ": input must be a float16 CUDA tensor");
    TORCH_CHECK(x.device() == trellis_.device(), kWho, ": input is on ", x.device(), ", the layer on ",
                trellis_.device());
    const int64_t K = dev_.K, N = dev_.N;
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, kWho, ": input has last dimension ", x.dim() ? x.size(-1) : 0,
                ", the layer has in_features=", K);
    TORCH_CHECK(path == "auto" || path == "gemv" || path == "gemm", kWho, ": unknown path '", path, "'");
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    auto out_shape = x.sizes().vec();
    out_shape.back() = N;
    const auto x2 = x.reshape({-1, K}).contiguous();
    const int64_t M = x2.size(0);
    auto y = torch::empty({M, N}, x.options());
    if (M == 0) return y.reshape(out_shape);
    const auto f32 = x.options().dtype(torch::kFloat32);
    // 1. u = H (D_u x) in fp32
    auto u = torch::empty({M, K}, f32);
    launch_hadamard(x2.data_ptr(), true, u.data_ptr(), false, M, K, hadamard_block(K), su_.data_ptr<uint8_t>(), true,
                    nullptr, nullptr, stream);
    // 2. z = tscale * (values u)
    auto z = torch::empty({M, N}, f32);
    const int gemv_rows = max_trellis_gemv_rows(dev_.code);
    if (path == "gemv" || (path == "auto" && M <= gemv_rows)) {
      const int64_t slices = trellis_gemv_split(N, K).count;
      torch::Tensor partial;  // the K split's partial sums
      if (slices > 1) partial = torch::empty({slices * std::min<int64_t>(gemv_rows, M) * N}, f32);
      for (int64_t m0 = 0; m0 < M; m0 += gemv_rows) {
        const int rows = int(std::min<int64_t>(gemv_rows, M - m0));
        launch_trellis_gemv(dev_, u.data_ptr<float>() + m0 * K, rows, z.data_ptr<float>() + m0 * N,
                            slices > 1 ? partial.data_ptr<float>() : nullptr, stream);
      }
    } else {
      const auto uh = u.to(torch::kHalf);
      const int64_t tile = std::max<int64_t>(128, std::min<int64_t>(N, (int64_t(64) << 20) / (2 * K))) / kTile * kTile;
      auto w = torch::empty({std::min(tile, N), K}, x.options());
      for (int64_t n0 = 0; n0 < N; n0 += tile) {
        const int64_t n1 = std::min(N, n0 + tile);
        launch_trellis_dequant(dev_, n0, n1, reinterpret_cast<__half*>(w.data_ptr<at::Half>()), stream);
        z.narrow(1, n0, n1 - n0).copy_(at::mm(uh, w.narrow(0, 0, n1 - n0).t()));
      }
    }
    // 3.+4. y = D_v (H z) + bias (z + bias without sv: a Hadamard block of 1), to fp16
    launch_hadamard(z.data_ptr(), false, y.data_ptr(), true, M, N, sv_.defined() ? hadamard_block(N) : 1,
                    sv_.defined() ? sv_.data_ptr<uint8_t>() : nullptr, false,
                    bias_.defined() ? bias_.data_ptr<float>() : nullptr, nullptr, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y.reshape(out_shape);
  }

 private:
  torch::Tensor trellis_, tscale_, su_, sv_, bias_, tcode_;
  TrellisDev dev_{};
};

}  // namespace

// Called by bind() (cuda_ops.cpp).
void register_trellis_cuda(pybind11::module_& m) {
  pybind11::class_<TrellisLinearCUDA>(m, "TrellisLinearCUDA")
      .def(pybind11::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                          c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>(),
           pybind11::arg("trellis"), pybind11::arg("tscale"), pybind11::arg("tmeta"), pybind11::arg("su"),
           pybind11::arg("sv"), pybind11::arg("bias") = pybind11::none(), pybind11::arg("tcode") = pybind11::none())
      .def("forward", &TrellisLinearCUDA::forward, pybind11::arg("x"), pybind11::arg("path") = "auto")
      .def("dequantize", &TrellisLinearCUDA::dequantize)
      .def_property_readonly("in_features", &TrellisLinearCUDA::in_features)
      .def_property_readonly("out_features", &TrellisLinearCUDA::out_features)
      .def_property_readonly("gemv_max_rows", &TrellisLinearCUDA::gemv_max_rows);
}

}  // namespace cuda
}  // namespace exl
