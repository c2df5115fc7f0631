// Torch bindings of the CPU trellis kernels (docs/format.md §7.5): validation of a trellis layer's
// tensors, u = H (D_u x), the decode-and-dot GEMV (or tile decode + BLAS GEMM for large batches),
// y = D_v (H z), bias. The rotations are the scalar layers' (cpu_linear.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cpu_isa.h"
#include "cpu_linear.h"
#include "cpu_trellis.h"

namespace py = pybind11;

namespace exl {
namespace cpu {

// The trellis table for an instruction-set name (as the Kernels tables are named). The AVX-512 one
// also needs VBMI; where it is missing, that name uses the AVX-VNNI or AVX2 trellis kernels.
const TrellisKernels* trellis_named(const std::string& isa_name) {
  const std::string name = kernels_named(isa_name)->name;  // resolves "auto" and checks availability
  if (name == "avx512vnni" && avx512vnni_trellis()) return avx512vnni_trellis();
  if (name == "avxvnni" && avxvnni_trellis()) return avxvnni_trellis();
  if (name == "avx512vnni" && avxvnni_trellis() && __builtin_cpu_supports("avxvnni")) return avxvnni_trellis();
  if ((name == "avx512vnni" || name == "avxvnni" || name == "avx2") && avx2_trellis()) return avx2_trellis();
  return scalar_trellis();
}

namespace {

const char* kWho = "exl TrellisLinear";

class TrellisLinearCPU : public LinearCPU {
 public:
  TrellisLinearCPU(at::Tensor trellis, at::Tensor tscale, at::Tensor tmeta, at::Tensor su, c10::optional<at::Tensor> sv,
                   c10::optional<at::Tensor> bias, const std::string& isa, c10::optional<at::Tensor> tcode) {
    TORCH_CHECK(trellis.scalar_type() == at::kInt && trellis.dim() == 3, kWho,
                ": trellis must be an int32 tensor [N/16, K/16, 8*bits], got ", trellis.scalar_type(), " ",
                trellis.sizes());
    TORCH_CHECK(tmeta.scalar_type() == at::kInt && tmeta.dim() == 1 && tmeta.size(0) == 6, kWho,
                ": tmeta must be int32 [6] (version, bits, state bits, code, A, B), got ", tmeta.scalar_type(), " ",
                tmeta.sizes());
    const auto meta = tmeta.to(at::kCPU).contiguous();
    const int32_t* mp = meta.data_ptr<int32_t>();
    TORCH_CHECK(mp[3] == kCodeLcgByteSum || is_two_table(mp[3]), kWho, ": tmeta code id ", mp[3],
                " is unknown (this exl knows codes 1, 2 and 3); update exl");
    TORCH_CHECK(mp[0] == (mp[3] == kCodeLcgByteSum ? 1 : 2), kWho, ": tmeta tile layout version ", mp[0], " with code ",
                mp[3], " is not supported (this exl reads layout 1 with code 1 and layout 2 with codes 2 and 3)");
    code_.code = mp[3];
    code_.bits = mp[1];
    code_.state_bits = mp[2];
    code_.mul = uint32_t(mp[4]);
    code_.add = uint32_t(mp[5]);
    TORCH_CHECK(code_.bits >= 1 && code_.bits <= 8, kWho, ": tmeta bits ", code_.bits, " must be in 1..8");
    TORCH_CHECK(code_.state_bits >= std::max(8, code_.bits) && code_.state_bits <= 16, kWho, ": tmeta state bits ",
                code_.state_bits, " must be in ", std::max(8, code_.bits), "..16");
    if (code_.code == kCodeLcgByteSum) {
      TORCH_CHECK(code_.mul & 1u, kWho, ": tmeta multiplier A must be odd");
      TORCH_CHECK(!tcode || !tcode->defined(), kWho,
                  ": tcode was given for a code 1 layer (only codes 2 and 3 have tables); drop the layer's tcode tensor");
    } else {
      const int size = 2 * two_table_size(code_.code);
      TORCH_CHECK(code_.state_bits == 12 && code_.bits <= 7, kWho, ": code ", code_.code,
                  " needs L = 12 and bits <= 7, tmeta has L = ", code_.state_bits, ", bits = ", code_.bits);
      TORCH_CHECK(tcode && tcode->defined(), kWho, ": a code ", code_.code, " layer needs its tables: pass tcode (int8 [",
                  size, "])");
      TORCH_CHECK(tcode->scalar_type() == at::kChar && tcode->dim() == 1 && tcode->size(0) == size, kWho,
                  ": tcode of a code ", code_.code, " layer must be int8 [", size, "] (T_a then T_b), got ",
                  tcode->scalar_type(), " ", tcode->sizes());
      TORCH_CHECK(tcode->device().is_cpu(), kWho, " (CPU kernels): tcode must be on the CPU, got ", tcode->device());
      tcode_ = tcode->contiguous();
      code_.tables = tcode_.data_ptr<int8_t>();
    }
    TORCH_CHECK(trellis.size(2) == tile_words(code_.bits), kWho, ": trellis has ", trellis.size(2),
                " words per tile, ", code_.bits, "-bit tiles need ", tile_words(code_.bits));
    N_ = trellis.size(0) * kTile;
    K_ = trellis.size(1) * kTile;
    TORCH_CHECK(N_ > 0 && K_ > 0, kWho, ": empty layer ", trellis.sizes());
    TORCH_CHECK(trellis.device().is_cpu(), kWho, " (CPU kernels): the layer's tensors must be on the CPU, got ",
                trellis.device());
    TORCH_CHECK(tscale.scalar_type() == at::kHalf && tscale.dim() == 1 && tscale.size(0) == N_, kWho,
                ": tscale must be float16 [", N_, "], got ", tscale.scalar_type(), " ", tscale.sizes());
    auto check_signs = [&](const at::Tensor& s, int64_t n, const char* name) {
      TORCH_CHECK(s.scalar_type() == at::kByte && s.dim() == 1 && s.size(0) == (n + 7) / 8, kWho, ": ", name,
                  " must be uint8 [", (n + 7) / 8, "], got ", s.scalar_type(), " ", s.sizes());
    };
    check_signs(su, K_, "su");
    if (sv && sv->defined()) {  // optional from format version 3 (docs/format.md §7.4)
      check_signs(*sv, N_, "sv");
      sv_ = sv->contiguous();
    }
    if (bias && bias->defined()) {
      TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N_, kWho, ": bias must be [", N_, "], got ", bias->sizes());
      bias_ = bias->to(at::kFloat).contiguous();
    }
    trellis_ = trellis.contiguous();
    tscale_ = tscale.contiguous();
    su_ = su.contiguous();
    set_isa(isa.empty() ? env_isa() : isa);
  }

  int64_t in_features() const override { return K_; }
  int64_t out_features() const override { return N_; }
  std::string isa() const { return kernels_->name; }
  std::string trellis_isa() const { return trellis_kernels_->name; }
  void set_isa(const std::string& name) {
    kernels_ = kernels_named(name);
    trellis_kernels_ = trellis_named(name);
  }

  // The integer code values [N, K] as fp32 (exact), by the decode kernel.
  at::Tensor decode() const {
    auto out = at::empty({K_, N_}, at::kFloat);
    const TrellisLayer L = layer();
    trellis_kernels_->decode(L, 0, N_ / kTile, out.data_ptr<float>(), N_);
    return out.t().contiguous();
  }

  // Whether this table has the int8-activation GEMV for this layer (K a multiple of 32).
  bool has_int8() const { return trellis_kernels_->gemv_q8 != nullptr && K_ % 32 == 0; }

  // Whether the int8 GEMV beats tile decode + fp32 GEMM at every batch size on this table for this code
  // (TrellisKernels): TrellisLinear then never switches to the GEMM.
  bool int8_every_batch() const { return int8_gemm_min_rows() == kGemmNever; }

  // The batch size from which tile decode + fp32 BLAS GEMM beats the int8 GEMV (kGemmNever: never).
  int64_t int8_gemm_min_rows() const {
    return is_two_table(code_.code) ? trellis_kernels_->gemm_min_rows_two_table : trellis_kernels_->gemm_min_rows_code1;
  }

  // path: "auto" (below gemm_min_rows rows the GEMV: int8 activations unless exact or unavailable,
  // else fp32; from gemm_min_rows on the GEMM), "int8", "fp32" (the GEMVs) or "gemm".
  at::Tensor forward(const at::Tensor& x, const std::string& path, int64_t gemm_min_rows, bool exact) override {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, kWho,
                " (CPU kernels): input must be a float32 CPU tensor, got ", x.scalar_type(), " on ", x.device());
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K_, kWho, ": input has last dimension ", x.dim() ? x.size(-1) : 0,
                ", the layer has in_features=", K_);
    TORCH_CHECK(path == "auto" || path == "int8" || path == "fp32" || path == "gemm", kWho, ": unknown path '", path,
                "' (expected auto, int8, fp32 or gemm)");
    TORCH_CHECK(path != "int8" || has_int8(), kWho, ": no int8 GEMV ", K_ % 32 ? "(in_features is not a multiple of 32)"
                : "in this instruction set's table", "; use path fp32");
    auto out_shape = x.sizes().vec();
    out_shape.back() = N_;
    const int64_t M = x.numel() / K_;
    auto y = at::empty({M, N_}, at::kFloat);
    if (M == 0) return y.reshape(out_shape);
    const bool gemm = path == "gemm" || (path == "auto" && M >= gemm_min_rows);
    const bool int8 = path == "int8" || (path == "auto" && !gemm && !exact && has_int8());
    // Scratch: per thread for small batches (decode calls this per layer per token), else for this call.
    const int64_t nb = K_ / 32;
    const bool with_qq = int8 && code_.code == kCodeLcgByteSum;  // code 1 reads each int8 activation repeated 4x
    const size_t need = 5 * 64 + size_t(M) * K_ * (4 + (int8 ? 1 : 0) + (with_qq ? 4 : 0)) + size_t(M) * nb * 8;
    thread_local std::vector<uint8_t> small_buf;
    std::vector<uint8_t> large_buf;
    std::vector<uint8_t>& buf = M <= 64 ? small_buf : large_buf;
    if (buf.size() < need) buf.resize(need);
    size_t used = 0;
    auto carve = [&](size_t bytes) {  // 64-byte aligned pieces of buf
      uint8_t* base = buf.data() + used;
      uint8_t* p = base + ((64 - reinterpret_cast<uintptr_t>(base) % 64) % 64);
      used = size_t(p - buf.data()) + bytes;
      return p;
    };
    // 1. u = H (D_u x)
    const at::Tensor x2 = x.reshape({M, K_}).contiguous();
    float* up = reinterpret_cast<float*>(carve(size_t(M) * K_ * 4));
    rotate_rows(kernels_, up, M, K_, su_.data_ptr<uint8_t>(), true, x2.data_ptr<float>());
    // 2. z = tscale * (values u)
    const TrellisLayer L = layer();
    float* yp = y.data_ptr<float>();
    const int64_t tiles = N_ / kTile;
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 12) / std::max<int64_t>(K_, 1));  // tiles: ~64K weights, as the scalar layers
    if (gemm) {
      gemm_(L, at::from_blob(up, {M, K_}, at::kFloat), y);
    } else if (int8) {
      // int8 activations per 32 channels (the scalar layers' quantizer)
      int8_t* qp = reinterpret_cast<int8_t*>(carve(size_t(M) * K_));
      int32_t* qqp = with_qq ? reinterpret_cast<int32_t*>(carve(size_t(M) * K_ * 4)) : nullptr;
      float* dp = reinterpret_cast<float*>(carve(size_t(M) * nb * 4));
      int32_t* bp = reinterpret_cast<int32_t*>(carve(size_t(M) * nb * 4));
      // rows are independent: the team's threads share them (as the scalar layers do)
      exl::cpu::parallel_for(0, M, std::max<int64_t>(1, 4096 / std::max<int64_t>(K_, 1)), [&](int64_t r0, int64_t r1) {
        for (int64_t m = r0; m < r1; ++m) {
          kernels_->quantize_q8(up + m * K_, K_, nullptr, 0, qp + m * K_, dp + m * nb, bp + m * nb);
          if (qqp)
            for (int64_t k = 0; k < K_; ++k) qqp[m * K_ + k] = int32_t(uint32_t(uint8_t(qp[m * K_ + k])) * 0x01010101u);
        }
      });
      exl::cpu::parallel_for(0, tiles, grain, [&](int64_t i0, int64_t i1) {
        trellis_kernels_->gemv_q8(L, qp, qqp, dp, bp, M, yp, N_, i0, i1);
      });
    } else {
      exl::cpu::parallel_for(0, tiles, grain, [&](int64_t i0, int64_t i1) { trellis_kernels_->gemv(L, up, M, yp, N_, i0, i1); });
    }
    // 3. y = D_v (H z) (with sv), 4. bias
    if (sv_.defined()) rotate_rows(kernels_, yp, M, N_, sv_.data_ptr<uint8_t>(), false);
    if (bias_.defined()) y.add_(bias_);
    return y.reshape(out_shape);
  }

 private:
  TrellisLayer layer() const {
    TrellisLayer L;
    L.words = reinterpret_cast<const uint32_t*>(trellis_.data_ptr<int32_t>());
    L.tscale = reinterpret_cast<const uint16_t*>(tscale_.data_ptr<at::Half>());
    L.N = N_;
    L.K = K_;
    L.code = code_;
    return L;
  }

  // Large batches: decode a block of tile rows (transposed, [K, rows]) into a cache-sized buffer,
  // threads splitting the tile rows, then one BLAS GEMM per block (threaded inside); scale after.
  void gemm_(const TrellisLayer& L, const at::Tensor& u, at::Tensor& y) const {
    const int64_t tiles = N_ / kTile;
    const int64_t block = std::max<int64_t>(4, std::min<int64_t>(64, ((int64_t(1) << 18) / K_) / kTile));  // tile rows
    auto w = at::empty({K_, std::min(block, tiles) * kTile}, at::kFloat);
    float* wp = w.data_ptr<float>();
    const int64_t ldw = w.size(1);
    for (int64_t i0 = 0; i0 < tiles; i0 += block) {
      const int64_t i1 = std::min(tiles, i0 + block), cols = (i1 - i0) * kTile;
      exl::cpu::parallel_for(i0, i1, 1, [&](int64_t a, int64_t b) {
        trellis_kernels_->decode(L, a, b, wp + (a - i0) * kTile, ldw);
      });
      auto out = y.narrow(1, i0 * kTile, cols);
      at::mm_out(out, u, w.narrow(1, 0, cols));
    }
    y.mul_(tscale_.to(at::kFloat));
  }

  at::Tensor trellis_, tscale_, su_, sv_, bias_, tcode_;
  int64_t N_ = 0, K_ = 0;
  TrellisCode code_{};
  const Kernels* kernels_ = nullptr;
  const TrellisKernels* trellis_kernels_ = nullptr;
};

}  // namespace
}  // namespace cpu
}  // namespace exl

void register_trellis(py::module_& m) {
  using exl::cpu::TrellisLinearCPU;
  py::class_<TrellisLinearCPU, exl::cpu::LinearCPU>(m, "TrellisLinearCPU")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                    const std::string&, c10::optional<at::Tensor>>(),
           py::arg("trellis"), py::arg("tscale"), py::arg("tmeta"), py::arg("su"), py::arg("sv"),
           py::arg("bias") = py::none(), py::arg("isa") = "", py::arg("tcode") = py::none())
      .def("forward", &TrellisLinearCPU::forward, py::arg("x"), py::arg("path") = "auto", py::arg("gemm_min_rows") = 32,
           py::arg("exact") = false, py::call_guard<py::gil_scoped_release>())
      .def("decode", &TrellisLinearCPU::decode, "The code values [N, K] (exact integers as float32)")
      .def_property_readonly("has_int8", &TrellisLinearCPU::has_int8)
      .def_property_readonly("int8_every_batch", &TrellisLinearCPU::int8_every_batch,
                             "whether the int8 GEMV beats the GEMM at every batch size on this table and CPU")
      .def_property_readonly("int8_gemm_min_rows", &TrellisLinearCPU::int8_gemm_min_rows,
                             "from this many rows on, tile decode + GEMM beats the int8 GEMV (2**63-1: never)")
      .def_property("isa", &TrellisLinearCPU::isa, &TrellisLinearCPU::set_isa)
      .def_property_readonly("trellis_isa", &TrellisLinearCPU::trellis_isa,
                             "the trellis kernels' table (the AVX-512 one needs VBMI; else avxvnni or avx2)")
      .def_property_readonly("in_features", &TrellisLinearCPU::in_features)
      .def_property_readonly("out_features", &TrellisLinearCPU::out_features);
}
