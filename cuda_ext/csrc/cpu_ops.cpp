// Torch bindings of the CPU kernels: layer validation, the forward pipeline of docs/format.md
// §1.4 (sign flip + FWHT, perm gather, fused dequant-matmul, FWHT + sign flip, bias), threading
// with exl::cpu::parallel_for (cpu_pool.h) and the run-time choice of instruction set.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor (lighter than torch/extension.h)

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_fused.h"
#include "cpu_isa.h"
#include "cpu_linear.h"
#include "cpu_pool.h"
#include "cpu_trellis.h"
#include "layer.h"

namespace py = pybind11;

namespace exl {
namespace cpu {
namespace {

// The GEMV tables this build has and this CPU runs (cpu_isa.h), best last.
std::vector<std::pair<std::string, const Kernels*>> available() {
  const Kernels* tables[isa::kLevels] = {scalar_kernels(), avx2_kernels(), avxvnni_kernels(), avx512vnni_kernels()};
  std::vector<std::pair<std::string, const Kernels*>> out;
  for (int l = 0; l < isa::kLevels; ++l)
    if (tables[l] && isa::supported(isa::Level(l))) out.push_back({isa::name(isa::Level(l)), tables[l]});
  return out;
}

std::vector<std::string> isa_names() {
  std::vector<std::string> out;
  for (const auto& [n, k] : available()) out.push_back(n);
  return out;
}

// Carve `count` values of T out of buf, 64-byte aligned relative to its start.
template <typename T>
T* scratch(std::vector<uint8_t>& buf, size_t& used, size_t count) {
  const size_t off = (used + 63) & ~size_t(63);
  used = off + count * sizeof(T);
  return reinterpret_cast<T*>(buf.data() + off);
}

enum class Path { Auto, Int8, Fp32, Gemm };

Path parse_path(const std::string& s) {
  if (s == "auto") return Path::Auto;
  if (s == "int8") return Path::Int8;
  if (s == "fp32") return Path::Fp32;
  if (s == "gemm") return Path::Gemm;
  TORCH_CHECK(false, "exl QuantLinear: unknown path '", s, "' (expected auto, int8, fp32 or gemm)");
}

class QuantLinearCPU : public LinearCPU {
 public:
  QuantLinearCPU(at::Tensor qweight, at::Tensor qscale, at::Tensor qmeta, c10::optional<at::Tensor> perm,
                 c10::optional<at::Tensor> su, c10::optional<at::Tensor> sv, c10::optional<at::Tensor> bias,
                 const std::string& isa)
      : kernels_(kernels_named(isa.empty() ? env_isa() : isa)) {
    const LayerSpec spec = check_layer(qweight, qscale, qmeta, perm, su, sv, bias);
    TORCH_CHECK(qweight.device().is_cpu(), "exl QuantLinear (CPU kernels): the layer's tensors must be on the CPU, got ",
                qweight.device());
    qweight_ = qweight.contiguous();
    qscale_ = qscale.contiguous();
    if (present(perm)) perm_ = perm->contiguous();
    if (present(su)) su_ = su->contiguous();
    if (present(sv)) sv_ = sv->contiguous();
    if (present(bias)) bias_ = bias->to(at::kFloat).contiguous();
    layer_.qweight = qweight_.data_ptr<uint8_t>();
    layer_.row_bytes = spec.row_bytes;
    layer_.qscale = reinterpret_cast<const uint16_t*>(qscale_.data_ptr<at::Half>());
    layer_.n_groups = spec.n_groups;
    layer_.N = spec.N;
    layer_.K = spec.K;
    layer_.segs = spec.segs;
  }

  int64_t in_features() const override { return layer_.K; }
  int64_t out_features() const override { return layer_.N; }
  std::string isa() const { return kernels_->name; }
  void set_isa(const std::string& name) { kernels_ = kernels_named(name); }

  // The batch size from which dequant + fp32 BLAS GEMM beats the int8 GEMV on this table (Kernels).
  int64_t int8_gemm_min_rows() const { return kernels_->int8_gemm_min_rows; }

  // Q [N, K] in permuted order, fp32.
  at::Tensor dequantize() const {
    auto out = at::empty({layer_.N, layer_.K}, at::kFloat);
    float* o = out.data_ptr<float>();
    exl::cpu::parallel_for(0, layer_.N, 16, [&](int64_t n0, int64_t n1) { kernels_->dequant(layer_, n0, n1, o + n0 * layer_.K, layer_.K); });
    return out;
  }

  at::Tensor forward(const at::Tensor& x, const std::string& path, int64_t gemm_min_rows, bool exact) override {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat,
                "exl QuantLinear (CPU kernels): input must be a float32 CPU tensor, got ", x.scalar_type(), " on ",
                x.device());
    const int64_t K = layer_.K, N = layer_.N;
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "exl QuantLinear: input has last dimension ",
                x.dim() ? x.size(-1) : 0, ", the layer has in_features=", K);
    auto out_shape = x.sizes().vec();
    out_shape.back() = N;
    const auto x2 = x.reshape({-1, K}).contiguous();
    const int64_t M = x2.size(0);
    auto y = at::empty({M, N}, at::kFloat);
    if (M == 0) return y.reshape(out_shape);
    Path p = parse_path(path);
    if (p == Path::Auto) p = M >= gemm_min_rows ? Path::Gemm : (exact ? Path::Fp32 : Path::Int8);

    // Scratch: kept per thread for small batches (decode calls this per layer per token), freed
    // after the call for large ones.
    const size_t need = 64 * 9 + size_t(M) * K * sizeof(float) * 2 + size_t(M) * K + size_t(M) * (K / kBlock + 8) * 12 +
                        size_t(M) * layer_.n_groups * 4 + size_t(M) * (K / kBlock) * 16;
    thread_local std::vector<uint8_t> small_buf;
    std::vector<uint8_t> large_buf;
    std::vector<uint8_t>& buf = M <= 64 ? small_buf : large_buf;
    if (buf.size() < need) buf.resize(need);
    size_t used = 0;

    // 1. u = H (D_u x)
    const float* u = x2.data_ptr<float>();
    if (su_.defined()) {
      float* r = scratch<float>(buf, used, size_t(M) * K);
      rotate_rows(kernels_, r, M, K, su_.data_ptr<uint8_t>(), true, u);
      u = r;
    }
    float* yp = y.data_ptr<float>();
    const int64_t grain = std::max<int64_t>(4, (int64_t(1) << 16) / std::max<int64_t>(K, 1));
    if (p == Path::Int8) {
      // 2.+3. gather through perm while quantizing to int8, then the fused int8 GEMV
      const int64_t nb = K / kBlock;
      int8_t* q = scratch<int8_t>(buf, used, size_t(M) * K);
      float* d = scratch<float>(buf, used, size_t(M) * nb);
      int32_t* bsum = scratch<int32_t>(buf, used, size_t(M) * nb);
      float* gsum = scratch<float>(buf, used, size_t(M) * layer_.n_groups);
      float* bsumf = scratch<float>(buf, used, size_t(M) * (nb + 8));
      const void* pp = perm_.defined() ? perm_.data_ptr() : nullptr;
      const int pb = perm_.defined() ? int(perm_.element_size()) : 0;
      int8_t* qp = kernels_->uses_pairs ? scratch<int8_t>(buf, used, size_t(M) * K) : nullptr;
      float* dx4 = kernels_->uses_pairs ? scratch<float>(buf, used, size_t(M) * nb * 4) : nullptr;
      auto quantize_row = [&](int64_t m) {
        kernels_->quantize_q8(u + m * K, K, pp, pb, q + m * K, d + m * nb, bsum + m * nb);
        for (int64_t b = 0; b < nb + 8; ++b) bsumf[m * (nb + 8) + b] = b < nb ? float(bsum[m * nb + b]) : 0.0f;
        float* gs = gsum + m * layer_.n_groups;
        for (int s = 0; s < layer_.segs.count; ++s) {
          const Segment& sg = layer_.segs.seg[s];
          const int per = sg.group_size / kBlock;
          for (int g = 0; g < sg.k_len / sg.group_size; ++g) {
            float acc = 0.0f;
            for (int j = 0; j < per; ++j) {
              const int64_t b = sg.k_start / kBlock + int64_t(g) * per + j;
              acc += d[m * nb + b] * float(bsum[m * nb + b]);
            }
            gs[sg.group_start + g] = acc;
          }
        }
        if (qp) {
          pair_order(q + m * K, qp + m * K);
          for (int64_t b = 0; b < nb * 4; ++b) dx4[m * nb * 4 + b] = d[m * nb + b / 4];
        }
      };
      // rows are independent: the team's threads share them (a 16-row decode step does this per layer)
      exl::cpu::parallel_for(0, M, std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
        for (int64_t m = r0; m < r1; ++m) quantize_row(m);
      });
      const ActQ8 a{q, d, gsum, bsumf, M, qp, dx4};
      exl::cpu::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { kernels_->gemv_q8(layer_, a, yp, N, n0, n1); });
    } else {
      // 2. u' = u[perm]
      if (perm_.defined()) {
        float* g = scratch<float>(buf, used, size_t(M) * K);
        if (perm_.scalar_type() == at::kShort)
          gather(u, perm_.data_ptr<int16_t>(), M, K, g);
        else
          gather(u, perm_.data_ptr<int32_t>(), M, K, g);
        u = g;
      }
      if (p == Path::Fp32) {
        exl::cpu::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { kernels_->gemv_f32(layer_, u, M, yp, N, n0, n1); });
      } else {
        gemm(u, M, y);
      }
    }
    // 4. y = D_v (H z), 5. bias
    if (sv_.defined()) rotate_rows(kernels_, yp, M, N, sv_.data_ptr<uint8_t>(), false);
    if (bias_.defined()) y.add_(bias_);
    return y.reshape(out_shape);
  }

 private:
  // One row of int8 activations in ActQ8::qp's pair order.
  void pair_order(const int8_t* q, int8_t* out) const {
    for (int s = 0; s < layer_.segs.count; ++s) {
      const Segment& sg = layer_.segs.seg[s];
      const int8_t* src = q + sg.k_start;
      int8_t* dst = out + sg.k_start;
      const int n_blocks = sg.k_len / kBlock;
      int b = 0;
      for (; b + 2 <= n_blocks; b += 2, src += 2 * kBlock, dst += 2 * kBlock) {
        std::copy(src, src + 16, dst);
        std::copy(src + 32, src + 48, dst + 16);
        std::copy(src + 16, src + 32, dst + 32);
        std::copy(src + 48, src + 64, dst + 48);
      }
      if (b < n_blocks) std::copy(src, src + kBlock, dst);
    }
  }

  template <typename I>
  static void gather(const float* u, const I* perm, int64_t M, int64_t K, float* out) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) out[m * K + k] = u[m * K + perm[k]];
  }

  // Large batches: dequantize a tile of rows into a cache-sized fp32 buffer (threads split the
  // rows), then multiply it with BLAS (threaded inside); no nested parallel regions.
  // Inside a decode step's team (cpu_pool.h) BLAS runs single-threaded: each thread then dequantizes
  // and multiplies its own share of the output features.
  void gemm(const float* u, int64_t M, at::Tensor& y) const {
    const int64_t K = layer_.K, N = layer_.N;
    const int64_t tile = std::max<int64_t>(64, std::min<int64_t>(1024, ((int64_t(1) << 19) / K) & ~int64_t(15)));
    const auto ut = at::from_blob(const_cast<float*>(u), {M, K}, at::kFloat);
    if (exl::cpu::in_team()) {
      const bool inference = c10::InferenceMode::is_enabled();  // thread-local: the team's threads take the caller's
      exl::cpu::parallel_for(0, N, 16, [&](int64_t a, int64_t b) {
        c10::InferenceMode mode(inference);
        auto w = at::empty({std::min(tile, b - a), K}, at::kFloat);
        for (int64_t n0 = a; n0 < b; n0 += tile) {
          const int64_t n1 = std::min(b, n0 + tile);
          kernels_->dequant(layer_, n0, n1, w.data_ptr<float>(), K);
          auto out = y.narrow(1, n0, n1 - n0);
          at::mm_out(out, ut, w.narrow(0, 0, n1 - n0).t());
        }
      });
      return;
    }
    auto w = at::empty({std::min(tile, N), K}, at::kFloat);
    float* wp = w.data_ptr<float>();
    for (int64_t n0 = 0; n0 < N; n0 += tile) {
      const int64_t n1 = std::min(N, n0 + tile);
      exl::cpu::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b) { kernels_->dequant(layer_, a, b, wp + (a - n0) * K, K); });
      auto out = y.narrow(1, n0, n1 - n0);
      at::mm_out(out, ut, w.narrow(0, 0, n1 - n0).t());
    }
  }

  at::Tensor qweight_, qscale_, perm_, su_, sv_, bias_;
  Layer layer_{};
  const Kernels* kernels_;
};

// Standalone FWHT (tests and callers that rotate activations themselves): returns a new tensor.
at::Tensor fwht(const at::Tensor& x, int64_t block, c10::optional<at::Tensor> signs, bool signs_first,
                   const std::string& isa) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "exl fwht: expected a float32 CPU tensor");
  const int64_t n = x.size(-1);
  if (block <= 0) block = hadamard_block(n);
  TORCH_CHECK((block & (block - 1)) == 0 && n % block == 0, "exl fwht: block ", block,
              " must be a power of two dividing the last dimension ", n);
  const uint8_t* s = nullptr;
  at::Tensor sc;
  if (signs && signs->defined()) {
    sc = signs->contiguous();
    TORCH_CHECK(sc.scalar_type() == at::kByte && sc.numel() == (n + 7) / 8, "exl fwht: signs must be uint8 [",
                (n + 7) / 8, "]");
    s = sc.data_ptr<uint8_t>();
  }
  auto y = x.contiguous().clone();
  const int64_t rows = n ? y.numel() / n : 0;
  const Kernels* k = kernels_named(isa);
  float* p = y.data_ptr<float>();
  exl::cpu::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)),
                   [&](int64_t r0, int64_t r1) { k->fwht(p + r0 * n, r1 - r0, n, n, block, s, signs_first); });
  return y;
}

// How many chunks at::parallel_for ran for n units of work (1 when it runs serially, as it
// silently does in an extension built without OpenMP).
int64_t parallel_chunks(int64_t n) {
  std::atomic<int64_t> chunks{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { chunks++; });
  return chunks.load();
}

// The chunks [(begin, end), ...] that exl::cpu::parallel_for in a team (team=true) or at::parallel_for ran for
// [begin, end) with `grain`, sorted; `throw_at` >= 0 makes the chunk holding that unit throw.
std::vector<std::pair<int64_t, int64_t>> parallel_partition(int64_t begin, int64_t end, int64_t grain, bool team,
                                                           int64_t throw_at) {
  std::mutex m;
  std::vector<std::pair<int64_t, int64_t>> chunks;
  auto body = [&](int64_t b, int64_t e) {
    if (throw_at >= b && throw_at < e) throw std::runtime_error("exl test: chunk [" + std::to_string(b) + ", " +
                                                                std::to_string(e) + ") failed on purpose");
    std::lock_guard<std::mutex> lock(m);
    chunks.emplace_back(b, e);
  };
  if (team) {
    exl::cpu::run_team([&] { exl::cpu::parallel_for(begin, end, grain, body); });
  } else {
    at::parallel_for(begin, end, grain, body);
  }
  std::sort(chunks.begin(), chunks.end());
  return chunks;
}

}  // namespace

const Kernels* kernels_named(const std::string& name) {
  const auto all = available();
  if (name.empty() || name == "auto") return all.back().second;
  for (const auto& [n, k] : all)
    if (n == name) return k;
  std::string names;
  for (const auto& [n, k] : all) names += " " + n;
  TORCH_CHECK(false, "exl CPU kernels: instruction set '", name, "' is not available here (available:", names,
              "); set EXL_CPU_ISA to one of these or unset it");
}

// A bound linear layer (QuantLinearCPU or TrellisLinearCPU, both LinearCPU) as seen by the decode step
// (cpu_step.cpp), which composes the layers.
void* quant_linear_ptr(py::handle layer) { return layer.cast<LinearCPU*>(); }
at::Tensor quant_linear_forward(void* layer, const at::Tensor& x, int64_t gemm_min_rows, bool exact) {
  return static_cast<LinearCPU*>(layer)->forward(x, "auto", gemm_min_rows, exact);
}
int64_t quant_linear_features(void* layer, bool out) {
  auto* l = static_cast<LinearCPU*>(layer);
  return out ? l->out_features() : l->in_features();
}

}  // namespace cpu
}  // namespace exl

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using exl::cpu::QuantLinearCPU;
  m.doc() = "exl CPU kernels: fused dequant-matmul for the exl quantized format";
  void register_fused(py::module_&); register_fused(m);  // the fused decode ops, cpu_fused.cpp
  py::class_<exl::cpu::LinearCPU>(m, "LinearCPU");  // the base of every CPU linear layer the decode step takes
  void register_trellis(py::module_&); register_trellis(m);  // TrellisLinearCPU, cpu_trellis_ops.cpp
  void register_trellis_encode(py::module_&); register_trellis_encode(m);  // the trellis encoder, trellis_encode.cpp
  void register_step(py::module_&); register_step(m);    // the one-call decode step, cpu_step.cpp
  m.def("isa_names", &exl::cpu::isa_names, "Instruction sets usable on this CPU, best last");
  m.def("parallel_partition", &exl::cpu::parallel_partition, py::arg("begin"), py::arg("end"), py::arg("grain"),
        py::arg("team") = true, py::arg("throw_at") = -1, "Chunks a run_team team or at::parallel_for runs (tests)");
  m.def("amx_supported", &exl::cpu::amx_supported, "Whether this CPU and OS run AMX int8 tile multiplies");
  m.def("amx_enabled", &exl::cpu::amx_enabled, "Whether the trellis int8 GEMV uses AMX tiles (from amx_min_rows rows on)");
  m.attr("amx_min_rows") = py::int_(exl::cpu::kAmxMinRows);            // codes 2 and 3
  m.attr("amx_min_rows_code1") = py::int_(exl::cpu::kAmxMinRowsCode1);
  m.def("set_amx", &exl::cpu::set_amx, py::arg("on"), "Use AMX where supported (True) or not; returns whether in use");
  m.def("team_regions", &exl::cpu::team_regions, "Parallel regions served by run_team teams (cpu_pool.h)");
  m.def("release_idle_threads", &exl::cpu::release_idle_threads,
        "Free the calling thread's idle OpenMP thread pool (cpu_pool.h); False where the runtime cannot");
  m.def("parallel_chunks", &exl::cpu::parallel_chunks, "Chunks at::parallel_for runs for n units (threading check)");
  m.def("fwht", &exl::cpu::fwht, py::arg("x"), py::arg("block") = 0, py::arg("signs") = py::none(),
        py::arg("signs_first") = true, py::arg("isa") = "auto",
        "Normalized blockwise fast Walsh-Hadamard transform over the last dim, optional sign flip");
  py::class_<QuantLinearCPU, exl::cpu::LinearCPU>(m, "QuantLinearCPU")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>,
                    c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                    const std::string&>(),
           py::arg("qweight"), py::arg("qscale"), py::arg("qmeta"), py::arg("perm") = py::none(),
           py::arg("su") = py::none(), py::arg("sv") = py::none(), py::arg("bias") = py::none(), py::arg("isa") = "")
      .def("forward", &QuantLinearCPU::forward, py::arg("x"), py::arg("path") = "auto", py::arg("gemm_min_rows") = 17, py::arg("exact") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("dequantize", &QuantLinearCPU::dequantize)
      .def_property("isa", &QuantLinearCPU::isa, &QuantLinearCPU::set_isa)
      .def_property_readonly("int8_gemm_min_rows", &QuantLinearCPU::int8_gemm_min_rows,
                             "from this many rows on, dequant + GEMM beats the int8 GEMV on this table")
      .def_property_readonly("in_features", &QuantLinearCPU::in_features)
      .def_property_readonly("out_features", &QuantLinearCPU::out_features);
}
