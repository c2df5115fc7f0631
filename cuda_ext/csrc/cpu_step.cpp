// The decode step in one call: every block of a model for one new token of each of B sequences,
// over the paged float32 KV cache (exl/cache/paged.py), inside the CPU extension.
//
// The step is composed the way the model is: each module binds its own step object (QuantLinear and
// Linear a LinearStep, Attention an AttentionStep, GatedMLP an MLPStep, SparseMoE a MoEStep), a block
// composes them into a BlockStep and the model strings its blocks into a DecodeStep (see the
// `cpu_step` methods in exl/modules and exl/models). The step runs the same kernels and fused ops, in
// the same order, as the modules' fused path; what it removes is the Python between them.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "cpu_fused.h"
#include "cpu_pool.h"

namespace py = pybind11;

namespace exl {
namespace cpu {

// cpu_ops.cpp: the QuantLinearCPU bound to a Python object
void* quant_linear_ptr(py::handle layer);
at::Tensor quant_linear_forward(void* layer, const at::Tensor& x, int64_t gemm_min_rows, bool exact);
int64_t quant_linear_features(void* layer, bool out);

namespace {

// y = W x (+ b): a quantized layer (its QuantLinearCPU kernel object) or a dense float32 weight.
class LinearStep {
 public:
  static std::shared_ptr<LinearStep> quant(py::object kernel, int64_t gemm_min_rows, bool exact) {
    auto l = std::make_shared<LinearStep>();
    l->quant_ = quant_linear_ptr(kernel);  // a TypeError names the bad argument
    l->keep_ = std::move(kernel);          // the kernel lives as long as this step
    l->gemm_min_rows_ = gemm_min_rows;
    l->exact_ = exact;
    l->in_ = quant_linear_features(l->quant_, false);
    l->out_ = quant_linear_features(l->quant_, true);
    return l;
  }

  static std::shared_ptr<LinearStep> dense(at::Tensor weight, c10::optional<at::Tensor> bias) {
    TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
                "exl LinearStep.dense: weight must be a float32 CPU matrix, got ", weight.scalar_type(), " ",
                weight.sizes());
    auto l = std::make_shared<LinearStep>();
    l->weight_ = weight;
    if (bias && bias->defined()) l->bias_ = *bias;
    l->in_ = weight.size(1);
    l->out_ = weight.size(0);
    return l;
  }

  at::Tensor forward(const at::Tensor& x) const {
    if (quant_) return quant_linear_forward(quant_, x, gemm_min_rows_, exact_);
    return at::linear(x, weight_, bias_.defined() ? c10::optional<at::Tensor>(bias_) : c10::nullopt);
  }

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }

 private:
  void* quant_ = nullptr;
  py::object keep_;
  int64_t gemm_min_rows_ = 17;
  bool exact_ = false;
  at::Tensor weight_, bias_;
  int64_t in_ = 0, out_ = 0;
};
using Linear = std::shared_ptr<LinearStep>;

// What one step's attention reads: the paged stores, each sequence's page table and length (with the
// new token), and the RoPE tables (one [B, 1, rotary_dim] cos/sin pair per table the model uses).
struct Batch {
  at::Tensor k_store, v_store;  // [layers, kv_heads, slots, head_dim] float32
  at::Tensor pages, lengths;    // [B, P], [B] int64
  int64_t page_size = 0;
  std::vector<at::Tensor> cos, sin;
};

class AttentionStep {
 public:
  AttentionStep(int64_t layer, Linear q, Linear k, Linear v, Linear o, int64_t heads, int64_t kv_heads,
                int64_t head_dim, int64_t rope, double scale, int64_t window, double softcap,
                c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, double qk_eps)
      : layer_(layer), q_(std::move(q)), k_(std::move(k)), v_(std::move(v)), o_(std::move(o)), heads_(heads),
        kv_heads_(kv_heads), head_dim_(head_dim), rope_(rope), scale_(scale), window_(window), softcap_(softcap),
        qk_eps_(qk_eps) {
    TORCH_CHECK(q_ && k_ && v_ && o_, "exl AttentionStep: q, k, v and o must be LinearSteps");
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0,
                "exl AttentionStep: bad head layout ", heads, "/", kv_heads, " x ", head_dim);
    TORCH_CHECK(q_->out_features() == heads * head_dim && k_->out_features() == kv_heads * head_dim &&
                    v_->out_features() == kv_heads * head_dim && o_->in_features() == heads * head_dim,
                "exl AttentionStep: q/k/v/o shapes do not match ", heads, "/", kv_heads, " heads of ", head_dim);
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "exl AttentionStep: give both q_norm and k_norm or neither");
    if (q_norm) q_norm_ = q_norm->contiguous();
    if (k_norm) k_norm_ = k_norm->contiguous();
  }

  // x [B, hidden] (normed) -> [B, hidden]
  at::Tensor forward(const at::Tensor& x, Batch& b) const {
    const fused::Ops& f = fused::ops();
    const int64_t n = x.size(0);
    at::Tensor q = q_->forward(x).view({n, 1, heads_, head_dim_});
    at::Tensor k = k_->forward(x).view({n, 1, kv_heads_, head_dim_});
    const at::Tensor v = v_->forward(x).view({n, kv_heads_, head_dim_});
    f.rope_(q, k, b.cos[rope_], b.sin[rope_], q_norm_, k_norm_, qk_eps_);
    at::Tensor ks = b.k_store[layer_], vs = b.v_store[layer_];
    const at::Tensor o = f.paged_step_attention(q.view({n, heads_, head_dim_}), k.view({n, kv_heads_, head_dim_}), v,
                                                ks, vs, b.pages, b.lengths, b.page_size, scale_, window_, softcap_);
    return o_->forward(o.view({n, heads_ * head_dim_}));
  }

  int64_t layer() const { return layer_; }
  int64_t rope() const { return rope_; }
  int64_t kv_heads() const { return kv_heads_; }
  int64_t head_dim() const { return head_dim_; }

 private:
  int64_t layer_;
  Linear q_, k_, v_, o_;
  int64_t heads_, kv_heads_, head_dim_, rope_;
  double scale_;
  int64_t window_;
  double softcap_;
  c10::optional<at::Tensor> q_norm_, k_norm_;  // Qwen3, Gemma 3: RMSNorm on each query and key head
  double qk_eps_;
};

// The feed-forward half of a block: a gated MLP or a mixture of experts.
class FFNStep {
 public:
  virtual ~FFNStep() = default;
  virtual at::Tensor forward(const at::Tensor& x) const = 0;  // [n, hidden] -> a new [n, hidden]
};

class MLPStep : public FFNStep {
 public:
  MLPStep(Linear gate, Linear up, Linear down, std::string act)
      : gate_(std::move(gate)), up_(std::move(up)), down_(std::move(down)), act_(std::move(act)) {
    TORCH_CHECK(gate_ && up_ && down_, "exl MLPStep: gate, up and down must be LinearSteps");
    TORCH_CHECK(act_ == "silu" || act_ == "gelu" || act_ == "gelu_tanh" || act_ == "relu",
                "exl MLPStep: unknown activation '", act_, "' (silu, gelu, gelu_tanh, relu)");
  }

  at::Tensor forward(const at::Tensor& x) const override {
    at::Tensor g = gate_->forward(x);
    const at::Tensor u = up_->forward(x);
    return down_->forward(fused::ops().act_mul(g, u, act_, "auto"));
  }

 private:
  Linear gate_, up_, down_;
  std::string act_;
};

// Top-k routed experts (softmax over the router's logits, weights of the chosen k, optionally
// renormalised), plus an optional shared expert scaled by a sigmoid gate: SparseMoE's arithmetic.
class MoEStep : public FFNStep {
 public:
  MoEStep(Linear router, std::vector<std::shared_ptr<MLPStep>> experts, int64_t top_k, bool normalize,
          std::shared_ptr<MLPStep> shared, Linear shared_gate)
      : router_(std::move(router)), experts_(std::move(experts)), top_k_(top_k), normalize_(normalize),
        shared_(std::move(shared)), shared_gate_(std::move(shared_gate)) {
    TORCH_CHECK(router_ && router_->out_features() == int64_t(experts_.size()) && top_k > 0 &&
                    top_k <= int64_t(experts_.size()),
                "exl MoEStep: the router scores ", router_ ? router_->out_features() : 0, " experts, got ",
                experts_.size(), " experts and top_k ", top_k);
  }

  at::Tensor forward(const at::Tensor& x) const override {
    const at::Tensor probs = at::softmax(router_->forward(x).to(at::kFloat), -1);
    auto [weights, ids] = at::topk(probs, top_k_, -1);
    if (normalize_) weights = weights / weights.sum(-1, true);
    weights = weights.to(x.scalar_type());
    at::Tensor out = at::zeros_like(x);
    const at::Tensor flat = ids.contiguous();
    const int64_t* pi = flat.data_ptr<int64_t>();
    const std::set<int64_t> used(pi, pi + flat.numel());  // ascending, as torch.unique
    for (const int64_t e : used) {
      const at::Tensor where = at::nonzero(ids == e);  // (token, slot) pairs in row-major order
      const at::Tensor token = where.select(1, 0), slot = where.select(1, 1);
      const at::Tensor w = weights.index({token, slot}).unsqueeze(1);
      out.index_add_(0, token, experts_[e]->forward(x.index_select(0, token)) * w);
    }
    if (shared_) {
      at::Tensor s = shared_->forward(x);
      if (shared_gate_) s = at::sigmoid(shared_gate_->forward(x)) * s;
      out = out + s;
    }
    return out;
  }

 private:
  Linear router_;
  std::vector<std::shared_ptr<MLPStep>> experts_;
  int64_t top_k_;
  bool normalize_;
  std::shared_ptr<MLPStep> shared_;
  Linear shared_gate_;
};

// A pre-norm block, with Gemma 3's optional norms after each sublayer:
//   h = x + [post_attn](Attn(attn_norm(x)));  out = h + [post_ffn](FFN(ffn_norm(h)))
class BlockStep {
 public:
  BlockStep(at::Tensor attn_norm, double attn_eps, std::shared_ptr<AttentionStep> attn,
            c10::optional<at::Tensor> post_attn_norm, at::Tensor ffn_norm, double ffn_eps, std::shared_ptr<FFNStep> ffn,
            c10::optional<at::Tensor> post_ffn_norm)
      : attn_norm_(attn_norm.contiguous()), attn_eps_(attn_eps), attn_(std::move(attn)),
        ffn_norm_(ffn_norm.contiguous()), ffn_eps_(ffn_eps), ffn_(std::move(ffn)) {
    TORCH_CHECK(attn_ && ffn_, "exl BlockStep: give an AttentionStep and an MLPStep or MoEStep");
    if (post_attn_norm) post_attn_ = post_attn_norm->contiguous();
    if (post_ffn_norm) post_ffn_ = post_ffn_norm->contiguous();
  }

  at::Tensor forward(const at::Tensor& x, Batch& b) const {
    const fused::Ops& f = fused::ops();
    at::Tensor a = attn_->forward(f.rms_norm(x, attn_norm_, attn_eps_), b);
    auto [h, n] = f.add_rms_norm(a, x, ffn_norm_, ffn_eps_, post_attn_);
    at::Tensor y = ffn_->forward(*n);
    if (post_ffn_) return std::get<0>(f.add_rms_norm(y, h, c10::nullopt, ffn_eps_, post_ffn_));
    return y.add_(h);
  }

  const AttentionStep& attention() const { return *attn_; }

 private:
  at::Tensor attn_norm_;
  double attn_eps_;
  std::shared_ptr<AttentionStep> attn_;
  c10::optional<at::Tensor> post_attn_;
  at::Tensor ffn_norm_;
  double ffn_eps_;
  std::shared_ptr<FFNStep> ffn_;
  c10::optional<at::Tensor> post_ffn_;
};

// Every block of a model, for one new token of each of B sequences.
class DecodeStep {
 public:
  void add(std::shared_ptr<BlockStep> block) {
    TORCH_CHECK(block, "exl DecodeStep.add: expected a BlockStep");
    blocks_.push_back(std::move(block));
  }
  int64_t size() const { return int64_t(blocks_.size()); }

  // x [B, hidden] (the embedded tokens) -> the residual stream after the last block, [B, hidden].
  at::Tensor forward(const at::Tensor& x, at::Tensor k_store, at::Tensor v_store, at::Tensor pages,
                     at::Tensor lengths, int64_t page_size, std::vector<at::Tensor> cos,
                     std::vector<at::Tensor> sin) const {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "exl DecodeStep: x must be float32 [sequences, hidden] on the CPU, got ", x.scalar_type(), " ",
                x.sizes());
    const int64_t n = x.size(0);
    TORCH_CHECK(k_store.dim() == 4 && k_store.sizes() == v_store.sizes(),
                "exl DecodeStep: k_store and v_store must be alike [layers, kv_heads, slots, head_dim], got ",
                k_store.sizes(), " and ", v_store.sizes());
    TORCH_CHECK(cos.size() == sin.size(), "exl DecodeStep: as many cos as sin tables");
    for (size_t i = 0; i < cos.size(); ++i)
      TORCH_CHECK(cos[i].dim() == 3 && cos[i].size(0) == n && cos[i].size(1) == 1,
                  "exl DecodeStep: RoPE table ", i, " must be [", n, ", 1, rotary_dim], got ", cos[i].sizes());
    for (const auto& blk : blocks_) {
      const AttentionStep& a = blk->attention();
      TORCH_CHECK(a.layer() >= 0 && a.layer() < k_store.size(0) && a.rope() >= 0 && a.rope() < int64_t(cos.size()) &&
                      k_store.size(1) == a.kv_heads() && k_store.size(3) == a.head_dim(),
                  "exl DecodeStep: cache ", k_store.sizes(), " with ", cos.size(), " RoPE tables does not fit layer ",
                  a.layer(), " (rope table ", a.rope(), ", ", a.kv_heads(), " kv heads of ", a.head_dim(), ")");
    }
    Batch b{std::move(k_store), std::move(v_store), std::move(pages), std::move(lengths), page_size, std::move(cos),
            std::move(sin)};
    at::Tensor h = x.contiguous();
    run_team([&] {  // one OpenMP region for the step's few hundred parallel loops (cpu_pool.h)
      for (const auto& blk : blocks_) h = blk->forward(h, b);
    });
    return h;
  }

 private:
  std::vector<std::shared_ptr<BlockStep>> blocks_;
};

}  // namespace
}  // namespace cpu
}  // namespace exl

// Called from cpu_ops.cpp's PYBIND11_MODULE.
void register_step(py::module_& m) {
  using namespace exl::cpu;
  py::class_<LinearStep, std::shared_ptr<LinearStep>>(m, "LinearStep")
      .def_static("quant", &LinearStep::quant, py::arg("kernel"), py::arg("gemm_min_rows") = 17,
                  py::arg("exact") = false, "A quantized layer: its QuantLinearCPU and the row count from which it GEMMs")
      .def_static("dense", &LinearStep::dense, py::arg("weight"), py::arg("bias") = py::none(),
                  "A dense float32 layer y = x W^T + b")
      .def_property_readonly("in_features", &LinearStep::in_features)
      .def_property_readonly("out_features", &LinearStep::out_features);
  py::class_<AttentionStep, std::shared_ptr<AttentionStep>>(m, "AttentionStep")
      .def(py::init<int64_t, Linear, Linear, Linear, Linear, int64_t, int64_t, int64_t, int64_t, double, int64_t, double,
                    c10::optional<at::Tensor>, c10::optional<at::Tensor>, double>(),
           py::arg("layer"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("rope"), py::arg("scale"), py::arg("window") = 0,
           py::arg("softcap") = 0.0, py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
           py::arg("qk_eps") = 1e-6);
  py::class_<FFNStep, std::shared_ptr<FFNStep>>(m, "FFNStep");
  py::class_<MLPStep, FFNStep, std::shared_ptr<MLPStep>>(m, "MLPStep")
      .def(py::init<Linear, Linear, Linear, std::string>(), py::arg("gate"), py::arg("up"), py::arg("down"),
           py::arg("act"));
  py::class_<MoEStep, FFNStep, std::shared_ptr<MoEStep>>(m, "MoEStep")
      .def(py::init<Linear, std::vector<std::shared_ptr<MLPStep>>, int64_t, bool, std::shared_ptr<MLPStep>, Linear>(),
           py::arg("router"), py::arg("experts"), py::arg("top_k"), py::arg("normalize") = true,
           py::arg("shared") = py::none(), py::arg("shared_gate") = py::none());
  py::class_<BlockStep, std::shared_ptr<BlockStep>>(m, "BlockStep")
      .def(py::init<at::Tensor, double, std::shared_ptr<AttentionStep>, c10::optional<at::Tensor>, at::Tensor, double,
                    std::shared_ptr<FFNStep>, c10::optional<at::Tensor>>(),
           py::arg("attn_norm"), py::arg("attn_eps"), py::arg("attn"), py::arg("post_attn_norm"), py::arg("ffn_norm"),
           py::arg("ffn_eps"), py::arg("ffn"), py::arg("post_ffn_norm"));
  py::class_<DecodeStep, std::shared_ptr<DecodeStep>>(m, "DecodeStep")
      .def(py::init<>())
      .def("add", &DecodeStep::add, py::arg("block"))
      .def("forward", &DecodeStep::forward, py::arg("x"), py::arg("k_store"), py::arg("v_store"), py::arg("pages"),
           py::arg("lengths"), py::arg("page_size"), py::arg("cos"), py::arg("sin"),
           py::call_guard<py::gil_scoped_release>(),
           "Every block for one new token of each sequence over the paged float32 cache")
      .def("__len__", &DecodeStep::size);
}
