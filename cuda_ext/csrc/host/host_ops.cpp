// The host harness's Python module (docs/cuda_host.md): exl's CUDA bindings (cuda_ops.cpp, the same
// source as the GPU build) plus direct entry points to each launcher and the harness's toy kernels.
// Tensors are CPU tensors; outputs are written into the tensors passed in (views into guarded
// buffers in the tests), so a write out of bounds shows.
#define EXL_CUDA_OPS_NO_MODULE
#include "../cuda_ops.cpp"
#include "../cuda_trellis_ops.cpp"  // TrellisLinearCUDA, registered by bind()

#include "toy_kernels.h"

namespace exl {
namespace cuda {
namespace {

void check_out(const torch::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous(), "exl_cuda_host: ", name,
              " must be a contiguous CPU ", dtype, " tensor, got ", t.scalar_type(), " ", t.sizes());
}

void check_launch() { C10_CUDA_KERNEL_LAUNCH_CHECK(); }

const __half* half_ptr(const torch::Tensor& t) { return reinterpret_cast<const __half*>(t.data_ptr<at::Half>()); }

LayerDev layer_of(const torch::Tensor& qweight, const torch::Tensor& qscale, const torch::Tensor& qmeta) {
  const LayerSpec spec = check_layer(qweight, qscale, qmeta, {}, {}, {}, {});
  check_out(qweight, at::kByte, "qweight");
  check_out(qscale, at::kHalf, "qscale");
  return LayerDev{qweight.data_ptr<uint8_t>(), spec.row_bytes, half_ptr(qscale), spec.n_groups, spec.N, spec.K,
                  spec.segs};
}

void bind_host(pybind11::module_& m) {
  m.def("gemv", [](const torch::Tensor& qw, const torch::Tensor& qs, const torch::Tensor& qm, const torch::Tensor& x,
                   torch::Tensor z) {
    const LayerDev L = layer_of(qw, qs, qm);
    check_out(x, at::kFloat, "x");
    check_out(z, at::kFloat, "z");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == L.K && x.size(0) <= kMaxGemvRows && z.numel() == x.size(0) * L.N,
                "exl_cuda_host.gemv: shapes");
    launch_gemv(L, x.data_ptr<float>(), int(x.size(0)), z.data_ptr<float>(), nullptr);
    check_launch();
  });
  m.def("dequant", [](const torch::Tensor& qw, const torch::Tensor& qs, const torch::Tensor& qm, int64_t n0,
                      int64_t n1, torch::Tensor out) {
    const LayerDev L = layer_of(qw, qs, qm);
    check_out(out, at::kHalf, "out");
    TORCH_CHECK(0 <= n0 && n0 <= n1 && n1 <= L.N && out.numel() == (n1 - n0) * L.K, "exl_cuda_host.dequant: shapes");
    launch_dequant(L, n0, n1, reinterpret_cast<__half*>(out.data_ptr<at::Half>()), nullptr);
    check_launch();
  });
  m.def("hadamard", [](const torch::Tensor& in, torch::Tensor out, int64_t block, c10::optional<torch::Tensor> signs,
                       bool signs_first, c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> scatter) {
    TORCH_CHECK(in.is_contiguous() && out.is_contiguous() && in.numel() == out.numel() && in.dim() == 2,
                "exl_cuda_host.hadamard: in and out must be contiguous [rows, n] of the same size");
    TORCH_CHECK(!present(scatter) || (scatter->scalar_type() == at::kInt && scatter->numel() == in.size(1)),
                "exl_cuda_host.hadamard: scatter must be int32 [n]");
    launch_hadamard(in.data_ptr(), in.scalar_type() == at::kHalf, out.data_ptr(), out.scalar_type() == at::kHalf,
                    in.size(0), in.size(1), block, present(signs) ? signs->data_ptr<uint8_t>() : nullptr, signs_first,
                    present(bias) ? bias->data_ptr<float>() : nullptr,
                    present(scatter) ? scatter->data_ptr<int32_t>() : nullptr, nullptr);
    check_launch();
  }, py::arg("in"), py::arg("out"), py::arg("block"), py::arg("signs") = py::none(), py::arg("signs_first") = true,
     py::arg("bias") = py::none(), py::arg("scatter") = py::none());
  m.def("kv_quantize_into", [](const torch::Tensor& x, int64_t bits, c10::optional<torch::Tensor> signs,
                               torch::Tensor packed, torch::Tensor scales) {
    check_out(x, at::kHalf, "x");
    const int64_t d = x.size(-1);
    launch_kv_quantize(half_ptr(x), x.numel() / d, int(d), int(bits),
                       present(signs) ? signs->data_ptr<uint8_t>() : nullptr, packed.data_ptr<uint8_t>(), reinterpret_cast<__half*>(scales.data_ptr<at::Half>()), nullptr);
    check_launch();
  });
  m.def("kv_dequantize_into", [](const torch::Tensor& packed, const torch::Tensor& scales, int64_t bits, bool rotate,
                                 c10::optional<torch::Tensor> signs, torch::Tensor out) {
    const int64_t d = out.size(-1);
    launch_kv_dequantize(packed.data_ptr<uint8_t>(), half_ptr(scales), out.numel() / d, int(d), int(bits), rotate,
                         present(signs) ? signs->data_ptr<uint8_t>() : nullptr,
                         reinterpret_cast<__half*>(out.data_ptr<at::Half>()), nullptr);
    check_launch();
  });
  // the trellis launchers (cuda_trellis.cu) on a TrellisLinearCUDA's tensors
  m.def("trellis_gemv", [](const TrellisLinearCUDA& layer, const torch::Tensor& x, torch::Tensor z) {
    const TrellisDev& T = layer.dev();
    check_out(x, at::kFloat, "x");
    check_out(z, at::kFloat, "z");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == T.K && x.size(0) <= max_trellis_gemv_rows(T.code) &&
                    z.numel() == x.size(0) * T.N,
                "exl_cuda_host.trellis_gemv: shapes");
    const int64_t slices = trellis_gemv_split(T.N, T.K).count;
    auto partial = torch::empty({slices > 1 ? slices * x.size(0) * T.N : 0}, x.options());
    launch_trellis_gemv(T, x.data_ptr<float>(), int(x.size(0)), z.data_ptr<float>(),
                        slices > 1 ? partial.data_ptr<float>() : nullptr, nullptr);
    check_launch();
  });
  m.def("trellis_gemv_split", [](int64_t N, int64_t K) {
    const TrellisSplit s = trellis_gemv_split(N, K);
    return std::make_tuple(s.count, s.tiles);
  });
  m.def("trellis_dequant", [](const TrellisLinearCUDA& layer, int64_t n0, int64_t n1, torch::Tensor out) {
    const TrellisDev& T = layer.dev();
    check_out(out, at::kHalf, "out");
    TORCH_CHECK(0 <= n0 && n0 <= n1 && n1 <= T.N && n0 % kTile == 0 && n1 % kTile == 0 &&
                    out.numel() == (n1 - n0) * T.K,
                "exl_cuda_host.trellis_dequant: shapes");
    launch_trellis_dequant(T, n0, n1, reinterpret_cast<__half*>(out.data_ptr<at::Half>()), nullptr);
    check_launch();
  });

  // the harness itself
  m.def("set_barrier_timeout", [](double s) { exl_host::barrier_timeout_s() = s; });
  m.def("f32_to_f16_bits", [](const torch::Tensor& x) {
    check_out(x, at::kFloat, "x");
    auto out = torch::empty(x.sizes(), x.options().dtype(at::kShort));
    const float* p = x.data_ptr<float>();
    int16_t* o = out.data_ptr<int16_t>();
    for (int64_t i = 0; i < x.numel(); ++i) o[i] = int16_t(__float2half_rn(p[i]).x);
    return out;
  });
  m.def("f16_bits_to_f32", [](const torch::Tensor& h) {
    check_out(h, at::kShort, "h");
    auto out = torch::empty(h.sizes(), h.options().dtype(at::kFloat));
    const int16_t* p = h.data_ptr<int16_t>();
    float* o = out.data_ptr<float>();
    for (int64_t i = 0; i < h.numel(); ++i) o[i] = __half2float(__ushort_as_half(uint16_t(p[i])));
    return out;
  });
  m.def("toy_reverse", [](const torch::Tensor& in, torch::Tensor out, int64_t n, bool sync) {
    toy::reverse(in.data_ptr<float>(), out.data_ptr<float>(), int(in.numel() / n), int(n), sync);
    check_launch();
  });
  m.def("toy_warp_exchange", [](const torch::Tensor& in, torch::Tensor out, bool sync) {
    toy::warp_exchange(in.data_ptr<float>(), out.data_ptr<float>(), int(in.numel()), sync);
    check_launch();
  });
  m.def("toy_shuffle", [](int64_t kind, int64_t arg, int64_t width, int64_t n) {
    auto out = torch::full({n}, -1, torch::kInt);
    toy::shuffle(int(kind), int(arg), int(width), int(n), out.data_ptr<int>());
    check_launch();
    return out;
  });
  m.def("toy_ballot", [](int64_t n) {
    auto out = torch::zeros({n}, torch::kLong);
    std::vector<unsigned> r(n);
    toy::ballot(int(n), r.data());
    check_launch();
    for (int64_t i = 0; i < n; ++i) out[i] = int64_t(r[i]);
    return out;
  });
  m.def("toy_atomics", [](int64_t blocks) {
    int count = 0;
    float sum = 0.0f;
    toy::atomics(int(blocks), &count, &sum);
    check_launch();
    return std::make_tuple(count, sum);
  });
  m.def("toy_divergent_barrier", [] {
    toy::divergent_barrier();
    check_launch();
  });
  m.def("toy_ldg4", [](const torch::Tensor& x, int64_t offset) {
    float out = 0;
    toy::ldg4(x.data_ptr<float>() + offset, &out);
    check_launch();
    return out;
  });
  m.def("toy_shuffle_from_exited", [] {
    float out[32];
    toy::shuffle_from_exited(out);
    check_launch();
  });
  m.def("toy_launch_shape", [](int64_t grid, int64_t block, int64_t smem) {
    toy::launch_shape(unsigned(grid), unsigned(block), size_t(smem));
    check_launch();
  });
}

}  // namespace
}  // namespace cuda
}  // namespace exl

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  exl::cuda::bind(m);
  exl::cuda::bind_host(m);
  m.doc() = "exl's CUDA kernels run on the CPU by the host harness (tests only; docs/cuda_host.md)";
}
