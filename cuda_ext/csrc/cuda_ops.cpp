// Torch bindings of the CUDA kernels (cuda_kernels.cu): the forward pipeline of docs/format.md
// §1.4 on fp16 activations, plus the Hadamard transform, the quantized KV cache (§6) and paged attention.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <string>

#include "cuda_attention.h"
#include "cuda_kernels.h"
#include "layer.h"

namespace exl {
namespace cuda {
namespace {

// The device the kernels run on: CUDA, or the CPU when the host harness runs them (docs/cuda_host.md).
#ifdef EXL_CUDA_HOST
constexpr auto kKernelDevice = c10::DeviceType::CPU;
#else
constexpr auto kKernelDevice = c10::DeviceType::CUDA;
#endif

void check_cuda(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().type() == kKernelDevice, "exl CUDA kernels: ", name, " must be a CUDA tensor, got one on ",
              t.device());
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

class QuantLinearCUDA {
 public:
  QuantLinearCUDA(torch::Tensor qweight, torch::Tensor qscale, torch::Tensor qmeta, c10::optional<torch::Tensor> perm,
                  c10::optional<torch::Tensor> su, c10::optional<torch::Tensor> sv, c10::optional<torch::Tensor> bias) {
    const LayerSpec spec = check_layer(qweight, qscale, qmeta, perm, su, sv, bias);
    check_cuda(qweight, "qweight");
    const auto dev = qweight.device();
    qweight_ = qweight.contiguous();
    qscale_ = qscale.contiguous();
    TORCH_CHECK(reinterpret_cast<uintptr_t>(qweight_.data_ptr()) % 4 == 0,
                "exl QuantLinear: qweight must be 4-byte aligned on the GPU (copy it with .contiguous().clone())");
    // u' = u[perm] is stored by the Hadamard launch: value i goes to inverse_perm[i]
    if (present(perm)) perm_inv_ = perm->to(dev, torch::kLong).argsort().to(torch::kInt).contiguous();
    if (present(su)) su_ = su->to(dev).contiguous();
    if (present(sv)) sv_ = sv->to(dev).contiguous();
    if (present(bias)) bias_ = bias->to(dev, torch::kFloat32).contiguous();
    layer_.qweight = qweight_.data_ptr<uint8_t>();
    layer_.row_bytes = spec.row_bytes;
    layer_.qscale = reinterpret_cast<const __half*>(qscale_.data_ptr<at::Half>());
    layer_.n_groups = spec.n_groups;
    layer_.N = spec.N;
    layer_.K = spec.K;
    layer_.segs = spec.segs;
  }

  int64_t in_features() const { return layer_.K; }
  int64_t out_features() const { return layer_.N; }

  // Q [N, K] in permuted order, fp16.
  torch::Tensor dequantize() const {
    const c10::cuda::CUDAGuard guard(qweight_.device());
    auto out = torch::empty({layer_.N, layer_.K}, qweight_.options().dtype(torch::kHalf));
    launch_dequant(layer_, 0, layer_.N, reinterpret_cast<__half*>(out.data_ptr<at::Half>()), stream());
    return out;
  }

  // path: "auto" (GEMV up to 8 rows, GEMM above), "gemv" or "gemm".
  torch::Tensor forward(const torch::Tensor& x, const std::string& path) const {
    check_cuda(x, "input");
    TORCH_CHECK(x.scalar_type() == torch::kHalf, "exl QuantLinear (CUDA kernels): input must be float16, got ",
                x.scalar_type());
    TORCH_CHECK(x.device() == qweight_.device(), "exl QuantLinear: input is on ", x.device(), ", the layer on ",
                qweight_.device());
    const int64_t K = layer_.K, N = layer_.N;
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "exl QuantLinear: input has last dimension ",
                x.dim() ? x.size(-1) : 0, ", the layer has in_features=", K);
    TORCH_CHECK(path == "auto" || path == "gemv" || path == "gemm", "exl QuantLinear: unknown path '", path,
                "' (expected auto, gemv or gemm)");
    const c10::cuda::CUDAGuard guard(x.device());
    auto out_shape = x.sizes().vec();
    out_shape.back() = N;
    const auto x2 = x.reshape({-1, K}).contiguous();
    const int64_t M = x2.size(0);
    auto y = torch::empty({M, N}, x.options());
    if (M == 0) return y.reshape(out_shape);
    const bool gemv = path == "gemv" || (path == "auto" && M <= kMaxGemvRows);
    const auto f32 = x.options().dtype(torch::kFloat32);

    // 1.+2. u' = (H (D_u x))[perm] in fp32, one launch (a plain fp16 -> fp32 copy without su and perm)
    auto u = torch::empty({M, K}, f32);
    launch_hadamard(x2.data_ptr(), true, u.data_ptr(), false, M, K, su_.defined() ? hadamard_block(K) : 1,
                    su_.defined() ? su_.data_ptr<uint8_t>() : nullptr, true, nullptr,
                    perm_inv_.defined() ? perm_inv_.data_ptr<int32_t>() : nullptr, stream());
    // 3. z = Q u'
    auto z = torch::empty({M, N}, f32);
    if (gemv) {
      for (int64_t m0 = 0; m0 < M; m0 += kMaxGemvRows) {
        const int rows = int(std::min<int64_t>(kMaxGemvRows, M - m0));
        launch_gemv(layer_, u.data_ptr<float>() + m0 * K, rows, z.data_ptr<float>() + m0 * N, stream());
      }
    } else {
      const auto uh = u.to(torch::kHalf);
      const int64_t tile = std::max<int64_t>(128, std::min<int64_t>(N, (int64_t(64) << 20) / (2 * K)));
      auto w = torch::empty({std::min(tile, N), K}, x.options());
      for (int64_t n0 = 0; n0 < N; n0 += tile) {
        const int64_t n1 = std::min(N, n0 + tile);
        launch_dequant(layer_, n0, n1, reinterpret_cast<__half*>(w.data_ptr<at::Half>()), stream());
        z.narrow(1, n0, n1 - n0).copy_(at::mm(uh, w.narrow(0, 0, n1 - n0).t()));
      }
    }
    // 4.+5. y = D_v (H z) + bias, to fp16
    launch_hadamard(z.data_ptr(), false, y.data_ptr(), true, M, N, sv_.defined() ? hadamard_block(N) : 1,
                    sv_.defined() ? sv_.data_ptr<uint8_t>() : nullptr, false,
                    bias_.defined() ? bias_.data_ptr<float>() : nullptr, nullptr, stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y.reshape(out_shape);
  }

 private:
  torch::Tensor qweight_, qscale_, perm_inv_, su_, sv_, bias_;
  LayerDev layer_{};
};

// Normalized blockwise FWHT over the last dim (fp16 or fp32 in, same dtype out), optional signs.
torch::Tensor fwht(const torch::Tensor& x, int64_t block, c10::optional<torch::Tensor> signs, bool signs_first) {
  check_cuda(x, "x");
  TORCH_CHECK(x.scalar_type() == torch::kHalf || x.scalar_type() == torch::kFloat32,
              "exl fwht: expected float16 or float32, got ", x.scalar_type());
  const int64_t n = x.size(-1);
  if (block <= 0) block = hadamard_block(n);
  TORCH_CHECK(block <= 128 && (block & (block - 1)) == 0 && n % block == 0, "exl fwht: block ", block,
              " must be a power of two <= 128 dividing the last dimension ", n);
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor s;
  if (present(signs)) {
    s = signs->to(x.device()).contiguous();
    TORCH_CHECK(s.scalar_type() == torch::kUInt8 && s.numel() == (n + 7) / 8, "exl fwht: signs must be uint8 [",
                (n + 7) / 8, "]");
  }
  const auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  const bool half = x.scalar_type() == torch::kHalf;
  launch_hadamard(xc.data_ptr(), half, y.data_ptr(), half, n ? xc.numel() / n : 0, n, block,
                  s.defined() ? s.data_ptr<uint8_t>() : nullptr, signs_first, nullptr, nullptr, stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

void check_kv(int64_t d, int64_t bits) {
  TORCH_CHECK(d >= 32 && d <= 1024 && (d & (d - 1)) == 0, "exl KV cache: head dim ", d,
              " must be a power of two in 32..1024 for the CUDA kernels");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "exl KV cache: bits must be 4, 6 or 8, got ", bits);
}

torch::Tensor kv_signs(const c10::optional<torch::Tensor>& signs, int64_t d, const torch::Device& dev) {
  if (!present(signs)) return torch::Tensor();
  TORCH_CHECK(signs->scalar_type() == torch::kUInt8 && signs->numel() == d / 8,
              "exl KV cache: signs must be packed uint8 [", d / 8, "] (exl.format.pack_signs)");
  return signs->to(dev).contiguous();
}

// x [..., d] fp16 -> (codes uint8 [..., d*bits/8], scales fp16 [..., d/32]); docs/format.md §6.
std::vector<torch::Tensor> kv_quantize(const torch::Tensor& x, int64_t bits, c10::optional<torch::Tensor> signs) {
  check_cuda(x, "x");
  TORCH_CHECK(x.scalar_type() == torch::kHalf, "exl kv_quantize: expected float16, got ", x.scalar_type());
  const int64_t d = x.size(-1);
  check_kv(d, bits);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto s = kv_signs(signs, d, x.device());
  const auto xc = x.contiguous();
  const int64_t rows = xc.numel() / d;
  auto pshape = x.sizes().vec();
  pshape.back() = d * bits / 8;
  auto sshape = x.sizes().vec();
  sshape.back() = d / kBlock;
  auto packed = torch::empty(pshape, x.options().dtype(torch::kUInt8));
  auto scales = torch::empty(sshape, x.options());
  launch_kv_quantize(reinterpret_cast<const __half*>(xc.data_ptr<at::Half>()), rows, int(d), int(bits),
                     s.defined() ? s.data_ptr<uint8_t>() : nullptr, packed.data_ptr<uint8_t>(),
                     reinterpret_cast<__half*>(scales.data_ptr<at::Half>()), stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {packed, scales};
}

// (codes, scales) -> fp16 [..., d]: the rotated vectors, or the original ones with rotate=True.
torch::Tensor kv_dequantize(const torch::Tensor& packed, const torch::Tensor& scales, int64_t bits, bool rotate,
                            c10::optional<torch::Tensor> signs) {
  check_cuda(packed, "packed");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && scales.scalar_type() == torch::kHalf,
              "exl kv_dequantize: expected uint8 codes and float16 scales");
  TORCH_CHECK(bits >= 1 && (packed.size(-1) * 8) % bits == 0, "exl kv_dequantize: last dim ", packed.size(-1),
              " does not hold whole ", bits, "-bit codes");
  const int64_t d = packed.size(-1) * 8 / bits;
  check_kv(d, bits);
  TORCH_CHECK(scales.size(-1) == d / kBlock && scales.numel() / (d / kBlock) == packed.numel() / packed.size(-1),
              "exl kv_dequantize: scales ", scales.sizes(), " do not match codes ", packed.sizes());
  const c10::cuda::CUDAGuard guard(packed.device());
  const auto s = kv_signs(signs, d, packed.device());
  const auto pc = packed.contiguous();
  const auto sc = scales.contiguous();
  auto shape = packed.sizes().vec();
  shape.back() = d;
  auto out = torch::empty(shape, scales.options());
  launch_kv_dequantize(pc.data_ptr<uint8_t>(), reinterpret_cast<const __half*>(sc.data_ptr<at::Half>()),
                       pc.numel() / pc.size(-1), int(d), int(bits), rotate, s.defined() ? s.data_ptr<uint8_t>() : nullptr,
                       reinterpret_cast<__half*>(out.data_ptr<at::Half>()), stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// Query rows q [T, hq, D] attend causally over their pages of one layer's store k, v [hk, slots, D], in place
// (cuda_attention.h says how rows, positions, windows and pages are read). q, k, v: all float16 or all
// float32 on one device; pages [S, P], seqs [T], positions [T]: int64 on that device (they are read there,
// so nothing waits for the GPU; a row whose table entries are out of range comes out NaN). Returns [T, hq, D].
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_store, const torch::Tensor& v_store,
                              const torch::Tensor& pages, const torch::Tensor& seqs, const torch::Tensor& positions,
                              int64_t page_size, double scale, int64_t window, double softcap) {
  for (const auto& [t, name] : {std::pair<const torch::Tensor*, const char*>{&q, "q"}, {&k_store, "k_store"},
                                {&v_store, "v_store"}}) {
    check_cuda(*t, name);
    TORCH_CHECK(t->dim() == 3 && t->is_contiguous() && t->scalar_type() == q.scalar_type() &&
                    (q.scalar_type() == torch::kHalf || q.scalar_type() == torch::kFloat),
                "exl paged_attention: q, k_store and v_store must be contiguous 3-d tensors, all float16 or all "
                "float32; ", name, " is ", t->scalar_type(), " ", t->sizes());
    TORCH_CHECK(t->device() == q.device(), "exl paged_attention: ", name, " is on ", t->device(), ", q on ",
                q.device());
  }
  const int64_t T = q.size(0), hq = q.size(1), d = q.size(2), hk = k_store.size(0), n_slots = k_store.size(1);
  TORCH_CHECK(v_store.sizes() == k_store.sizes() && k_store.size(2) == d && hk > 0 && hq % hk == 0,
              "exl paged_attention: stores ", k_store.sizes(), " / ", v_store.sizes(), " do not fit q ", q.sizes());
  TORCH_CHECK(hq / hk <= kAttnMaxGroup && d <= kAttnMaxHeadDim, "exl paged_attention: ", hq / hk,
              " query heads per KV head and head size ", d, " (at most ", kAttnMaxGroup, " and ", kAttnMaxHeadDim,
              "); use the reference attention");
  TORCH_CHECK(page_size > 0 && n_slots % page_size == 0, "exl paged_attention: page_size ", page_size,
              " must divide the store's ", n_slots, " slots");
  TORCH_CHECK(pages.scalar_type() == torch::kLong && pages.dim() == 2 && pages.is_contiguous() &&
                  pages.device() == q.device(),
              "exl paged_attention: pages must be a contiguous int64 [sequences, pages] table on ", q.device(),
              ", got ", pages.scalar_type(), " ", pages.sizes(), " on ", pages.device());
  for (const auto& [t, name] : {std::pair<const torch::Tensor*, const char*>{&seqs, "seqs"}, {&positions, "positions"}})
    TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous() && t->numel() == T && t->device() == q.device(),
                "exl paged_attention: ", name, " must be a contiguous int64 tensor of ", T, " entries (one per query "
                "row) on ", q.device(), ", got ", t->scalar_type(), " ", t->sizes(), " on ", t->device());
  const c10::cuda::CUDAGuard guard(q.device());
  auto out = torch::empty_like(q);
  const auto work = torch::empty({attn_workspace_floats(T, hq, d, pages.size(1), page_size)},
                                 q.options().dtype(torch::kFloat));
  launch_paged_attention(q.data_ptr(), k_store.data_ptr(), v_store.data_ptr(), q.scalar_type() == torch::kHalf,
                         pages.data_ptr<int64_t>(), pages.size(0), pages.size(1), seqs.data_ptr<int64_t>(),
                         positions.data_ptr<int64_t>(), T, int(hq), int(hk), int(d), n_slots, int(page_size),
                         float(scale), int(window), float(softcap), out.data_ptr(),
                         work.numel() ? work.data_ptr<float>() : nullptr, stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

void bind(pybind11::module_& m) {
  m.doc() = "exl CUDA kernels: fused dequant GEMV, GEMM via cuBLAS, Hadamard, quantized KV cache, paged attention";
  void register_trellis_cuda(pybind11::module_&); register_trellis_cuda(m);  // cuda_trellis_ops.cpp
  m.def("fwht", &exl::cuda::fwht, py::arg("x"), py::arg("block") = 0, py::arg("signs") = py::none(),
        py::arg("signs_first") = true);
  m.def("paged_attention", &exl::cuda::paged_attention, py::arg("q"), py::arg("k_store"), py::arg("v_store"),
        py::arg("pages"), py::arg("seqs"), py::arg("positions"), py::arg("page_size"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("kv_quantize", &exl::cuda::kv_quantize, py::arg("x"), py::arg("bits"), py::arg("signs") = py::none());
  m.def("kv_dequantize", &exl::cuda::kv_dequantize, py::arg("packed"), py::arg("scales"), py::arg("bits"),
        py::arg("rotate") = false, py::arg("signs") = py::none());
  py::class_<QuantLinearCUDA>(m, "QuantLinearCUDA")
      .def(py::init<torch::Tensor, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                    c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>(),
           py::arg("qweight"), py::arg("qscale"), py::arg("qmeta"), py::arg("perm") = py::none(),
           py::arg("su") = py::none(), py::arg("sv") = py::none(), py::arg("bias") = py::none())
      .def("forward", &QuantLinearCUDA::forward, py::arg("x"), py::arg("path") = "auto")
      .def("dequantize", &QuantLinearCUDA::dequantize)
      .def_property_readonly("in_features", &QuantLinearCUDA::in_features)
      .def_property_readonly("out_features", &QuantLinearCUDA::out_features);
}

}  // namespace cuda
}  // namespace exl

#ifndef EXL_CUDA_OPS_NO_MODULE  // the host harness builds its own module around bind()
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { exl::cuda::bind(m); }
#endif
