"""convert.py end to end on tiny random Llama models: output format and accounting, resume after
kills, measurement reuse, bad inputs; plus one fast conversion of the real SmolLM2."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

import exl
from exl import format as F
from quant.convert import ConvertError, Job, convert
from quant.optimize import TargetError
from quant.options import QuantOptions

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
CHAT = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(folder: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer trained on a little Python source (vocab entries = `vocab`)."""
    import inspect

    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([inspect.getsource(json), inspect.getsource(os)], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHAT}))


def make_tiny(folder: Path, seed: int = 0, family: tuple[str, str] = ("LlamaConfig", "LlamaForCausalLM"),
              **overrides) -> Path:
    """A tiny random model of `family` (transformers' config and model class names) with a tokenizer."""
    cfg = getattr(transformers, family[0])(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, family[1])(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + 1.0 if "norm" in n else torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    tiny_tokenizer(folder, cfg.vocab_size)
    return folder


FAST = QuantOptions(measure_rows=32, fisher_rows=2, codes="scalar")  # the trellis tests say codes= themselves


def tiny_job(src, out, bits=4.0, **kw):
    kw.setdefault("options", FAST)
    kw.setdefault("rows", 6)
    kw.setdefault("length", 48)
    return Job(input=str(src), output=str(out), bits=bits, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "q4"
    report = convert(tiny_job(tiny, out, rows=16, length=64), progress=False)
    return out, report


def quant_layer_bits(folder: Path) -> tuple[int, int, int]:
    """(stored bits of quantized decoder layers, their N*K, head bits), read from the files' headers."""
    sizes = {"U8": 1, "I8": 1, "I16": 2, "I32": 4, "F16": 2, "F32": 4}
    bits = weights = head = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                prefix, suffix = name.rsplit(".", 1)
                if suffix not in F.QUANT_SUFFIXES + F.TRELLIS_SUFFIXES:
                    continue
                sl = st.get_slice(name)
                b = 8 * math.prod(sl.get_shape()) * sizes[sl.get_dtype()]
                if prefix == "lm_head":
                    head += b
                else:
                    bits += b
                if suffix == "qmeta" and prefix != "lm_head":
                    meta = st.get_tensor(name)
                    k = int(meta[:, 0].sum())
                    n = st.get_slice(prefix + ".qweight").get_shape()[0]
                    weights += n * k
                if suffix == "trellis" and prefix != "lm_head":
                    nt, kt, _ = st.get_slice(name).get_shape()
                    weights += nt * kt * F.TILE_WEIGHTS
    return bits, weights, head


def test_output_folder_loads_and_accounts_bits(tiny, converted):
    out, report = converted
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "exl" and qc["version"] == F.FORMAT_VERSION and qc["bits"] == 4.0
    assert qc["head_bits"] == 6 and cfg["tie_word_embeddings"] is False
    assert qc["calibration"]["source"] == "builtin" and qc["calibration"]["rows"] == 16
    for name in ("tokenizer.json", "tokenizer_config.json", "measurement.json", "generation_config.json"):
        assert (out / name).is_file(), name
    assert not (out / "work").exists()
    bits, weights, head = quant_layer_bits(out)
    assert weights == 2 * (64 * 64 * 2 + 32 * 64 * 2 + 96 * 64 * 3)  # all 14 linears of the 2 blocks
    assert bits / weights == pytest.approx(qc["measured_bpw"], abs=1e-4)
    assert abs(qc["measured_bpw"] - 4.0) <= 0.02 and qc["measured_bpw"] <= 4.0 + 1e-9
    assert head / (320 * 64) == pytest.approx(qc["head_bpw"], abs=1e-4)
    model = exl.load_model(out, progress=False)
    ref = exl.load_model(tiny, progress=False)
    assert type(model.layers[0].mlp.down).__name__ == "QuantLinear"
    assert model.layers[0].mlp.down.bits_per_weight == pytest.approx(
        next(s["bpw"] for s in report["layers"] if s["name"] == "model.layers.0.mlp.down_proj"))
    from calibration import calibration_rows
    from exl.tokenizer import Tokenizer

    ids = calibration_rows(None, Tokenizer.from_dir(tiny), 4, 64, seed=99)[0]  # text the model was not calibrated on
    lr = torch.log_softmax(ref(ids), -1)

    def kl(m):
        lq = torch.log_softmax(m(ids), -1)
        return float((lr.exp() * (lr - lq)).sum(-1).mean())

    # at 4.0 bpw, better than plain round-to-nearest at 4 bits with groups of 32 (4.5 bpw)
    from quant.gptq import gptq

    for layer in ref.layers:
        for lin in (layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj, layer.attn.o_proj,
                    layer.mlp.gate, layer.mlp.up, layer.mlp.down):
            segs = [F.Segment(lin.weight.shape[1], 4, 32)]
            r = gptq(lin.weight.data, torch.eye(lin.weight.shape[1]), [segs], alphas=(1.0,))[0]
            lin.weight.data.copy_(F.dequantize_codes(r.codes, r.scales, segs))
    assert 0 < kl(model) < kl(ref)  # (and ours also carries a 6-bit head)


def _kl_on_fresh_text(tiny, model, ref):
    from calibration import calibration_rows
    from exl.tokenizer import Tokenizer

    ids = calibration_rows(None, Tokenizer.from_dir(tiny), 4, 64, seed=99)[0]
    lr = torch.log_softmax(ref(ids), -1)
    lq = torch.log_softmax(model(ids), -1)
    return float((lr.exp() * (lr - lq)).sum(-1).mean())


@pytest.fixture(scope="module")
def trellis_converted(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "t3"
    options = QuantOptions(measure_rows=32, fisher_rows=2, codes="trellis", trellis_bits=(2, 3, 4))
    return out, convert(tiny_job(tiny, out, bits=3.0, rows=16, length=64, options=options), progress=False)


def test_trellis_conversion_loads_accounts_bits_and_beats_scalar(tiny, trellis_converted, tmp_path):
    out, report = trellis_converted
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["version"] == F.ONE_SIDED_TRELLIS_VERSION == 3 and qc["trellis_layers"] == 14
    bits, weights, _ = quant_layer_bits(out)
    assert weights == 2 * (64 * 64 * 2 + 32 * 64 * 2 + 96 * 64 * 3)
    assert bits / weights == pytest.approx(qc["measured_bpw"], abs=1e-4)
    assert 2.9 <= qc["measured_bpw"] <= 3.0  # 14 matrices, whole bits each: a coarse knapsack
    assert all(s["setting"].startswith("trellis") and s["transform"] == "su" for s in report["layers"])
    from exl.loader import TensorLoader

    loader = TensorLoader(out)
    prefix = "model.layers.1.mlp.down_proj"
    t = {s: loader.get(f"{prefix}.{s}") for s in F.TRELLIS_SUFFIXES if f"{prefix}.{s}" in loader}
    assert "sv" not in t  # format version 3: input rotation only, Fisher-weighted walks
    assert F.is_trellis(t) and F.bits_per_weight(t) == pytest.approx(
        next(s["bpw"] for s in report["layers"] if s["name"] == prefix))
    model = exl.load_model(out, progress=False)
    ref = exl.load_model(tiny, progress=False)
    lin = model.layers[1].mlp.down
    assert type(lin).__name__ == "TrellisLinear"
    x = torch.randn(3, 96)
    want = F.reference_forward(x, t)
    assert (lin(x) - want).abs().max() < 0.02 * want.abs().max()  # int8 activations (the default): ~0.5% RMS
    lin.exact = True  # fp32 activations: the reference's numbers
    torch.testing.assert_close(lin(x), want, rtol=1e-4, atol=1e-4)
    lin.exact = False
    scalar = convert(tiny_job(tiny, tmp_path / "s3", bits=3.0, rows=16, length=64), progress=False)
    kl_t = _kl_on_fresh_text(tiny, model, ref)
    kl_s = _kl_on_fresh_text(tiny, exl.load_model(tmp_path / "s3", progress=False), ref)
    assert 0 < kl_t < kl_s
    assert report["predicted_kl"] < scalar["predicted_kl"]


def test_trellis_two_table_conversion_writes_tables_and_runs_on_the_kernels(tiny, tmp_path, monkeypatch):
    import quant.candidates as C

    monkeypatch.setattr(C, "TWO_TABLE_MIN_WEIGHTS", 0)  # the tiny matrices would keep code 1 (tables too dear)
    out = tmp_path / "c2"
    options = QuantOptions(measure_rows=32, fisher_rows=2, codes="trellis", trellis_bits=(2, 3))
    report = convert(tiny_job(tiny, out, bits=3.0, rows=16, length=64, options=options), progress=False)
    assert all(s["setting"].endswith("/c3") for s in report["layers"])
    from exl.loader import TensorLoader

    loader = TensorLoader(out)
    prefix = "model.layers.0.mlp.up_proj"
    t = {s: loader.get(f"{prefix}.{s}") for s in F.TRELLIS_SUFFIXES if f"{prefix}.{s}" in loader}
    meta = F.TrellisMeta.from_tensor(t["tmeta"])
    assert meta.code == F.CODE_TWO_TABLE_64 and meta.version == 2 and torch.equal(t["tcode"], F.two_table_default(3))
    model = exl.load_model(out, progress=False)
    lin = model.layers[0].mlp.up
    x = torch.randn(3, lin.in_features)
    want = F.reference_forward(x, t)
    assert (lin(x) - want).abs().max() < 0.02 * want.abs().max()  # int8 activations
    lin.exact = True
    torch.testing.assert_close(lin(x), want, rtol=1e-4, atol=1e-4)


def changed_tensors(a: Path, b: Path) -> set[str]:
    """Names of the tensors that differ between two converted folders holding the same tensor names."""
    from exl.loader import TensorLoader

    la, lb = TensorLoader(a), TensorLoader(b)
    assert sorted(la.keys()) == sorted(lb.keys())
    return {k for k in la.keys() if not torch.equal(la.get(k), lb.get(k))}


def test_tuning_moves_only_row_scales_and_norms_and_lowers_kl(tiny, trellis_converted, tmp_path):
    """--tune: the codes, bits and every other tensor stay; row scales and norms move; KL to the original falls
    on the tuning rows and on text it never saw."""
    from exl.loader import TensorLoader
    from quant.tune import ScaledCodes

    base, base_report = trellis_converted
    options = replace(QuantOptions.from_dict(base_report["options"]), tune_steps=32)
    out = tmp_path / "tuned"
    report = convert(tiny_job(tiny, out, bits=3.0, rows=16, length=64, options=options, measurement=str(base)),
                     progress=False)
    assert "tune" in report["timings"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert report["measured_bpw"] == base_report["measured_bpw"] and qc["options"]["tune_steps"] == 32
    moved = changed_tensors(base, out)
    assert moved and all(k.endswith((".tscale", "norm.weight")) for k in moved), sorted(moved)
    assert any(k.endswith(".tscale") for k in moved) and "model.norm.weight" in moved
    ref = exl.load_model(tiny, progress=False)
    kl_base = _kl_on_fresh_text(tiny, exl.load_model(base, progress=False), ref)
    kl_tuned = _kl_on_fresh_text(tiny, exl.load_model(out, progress=False), ref)
    assert 0 < kl_tuned < 0.97 * kl_base  # 0.948x here (64 tuning rows of 64 tokens on a random model)
    # a trellis layer as tuning sees it: the reference forward at its stored scales
    prefix = "model.layers.0.mlp.up_proj"
    b = TensorLoader(out)
    t = {s: b.get(f"{prefix}.{s}") for s in F.TRELLIS_SUFFIXES if f"{prefix}.{s}" in b}
    x = torch.randn(5, 64)
    torch.testing.assert_close(ScaledCodes(t, "cpu")(x), F.reference_forward(x, t), rtol=1e-4, atol=1e-5)


def test_tuning_builds_blocks_without_reading_quantized_weights(tiny, monkeypatch):
    """The tuning stage's blocks read norms and dense layers only: a quantized layer's float weight (replaced by
    its codes) is not read; and the step halves per bit above 3 bits (the corrections shrink with the error)."""
    from quant import tune
    from quant.model_parts import SourceModel

    src = SourceModel(tiny)
    read = []
    real_get = type(src.loader).get
    monkeypatch.setattr(type(src.loader), "get", lambda self, name, *a, **k: read.append(name) or real_get(self, name, *a, **k))
    unread = frozenset({"model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj"})
    block, refs, norms = src.tunable_block(1, unread=unread)
    assert {r.name for r in refs} >= unread and all(r.module.weight.is_meta == (r.name in unread) for r in refs)
    assert not any(n.startswith(tuple(unread)) for n in read) and "model.layers.1.self_attn.k_proj.weight" in read
    assert {n for n, _ in norms} == {"model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"}
    assert [tune.step_size(b) for b in (2, 3, 4, 5)] == [tune.LR, tune.LR, tune.LR / 2, tune.LR / 4]


def test_tuning_recomputes_blocks_when_memory_is_short_and_refuses_when_it_cannot_fit(tiny, trellis_converted,
                                                                                       tmp_path, monkeypatch):
    """With too little free memory for every block's activations, tuning recomputes each block in backward and
    writes the same tensors; with too little even for one block's, --tune is refused before any long stage."""
    from quant import tune
    from quant.model_parts import SourceModel

    base, base_report = trellis_converted
    options = replace(QuantOptions.from_dict(base_report["options"]), tune_steps=4)
    job = lambda out, **kw: tiny_job(tiny, out, bits=3.0, rows=16, length=64, options=options,  # noqa: E731
                                     measurement=str(base), **kw)
    convert(job(tmp_path / "whole", work=str(tmp_path / "work")), progress=False)  # the work folder keeps tune.safetensors
    src = SourceModel(tiny)
    whole, least = (tune.memory_need(src, 4, 64, recompute=r) for r in (False, True))
    assert least < whole
    free = (least + whole) / 2 / tune.HEADROOM
    monkeypatch.setattr(tune, "free_bytes", lambda device: free)
    monkeypatch.setattr(tune, "checkpoint", lambda f, *a, **k: calls.append(f) or torch.utils.checkpoint.checkpoint(f, *a, **k))
    calls = []
    convert(job(tmp_path / "recomputed"), progress=False)
    assert len(calls) == 4 * src.num_layers  # every block, every step
    assert changed_tensors(tmp_path / "whole", tmp_path / "recomputed") == set()

    monkeypatch.setattr(tune, "free_bytes", lambda device: least / 2)
    with pytest.raises(ConvertError, match=r"--tune 4: tuning needs about .* GiB on cpu .* GiB are free"):
        convert(job(tmp_path / "refused"), progress=False)
    assert not (tmp_path / "refused" / "model.safetensors").exists()
    assert not list((tmp_path / "refused").glob("work/quant/block_*"))  # refused before quantizing
    # a resume whose tuning is done needs no memory for it: not refused
    shutil.rmtree(tmp_path / "whole")
    convert(job(tmp_path / "whole", work=str(tmp_path / "work")), resume=True, progress=False)
    assert changed_tensors(tmp_path / "whole", tmp_path / "recomputed") == set()


@pytest.mark.parametrize("family, extra", [
    (("Gemma3TextConfig", "Gemma3ForCausalLM"), dict(head_dim=16, sliding_window=8, final_logit_softcapping=30.0)),
    (("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=16)),  # q/k norms
])
def test_tuning_other_families(tmp_path, family, extra):
    """The tuned folder of a Gemma 3 (norm offset, soft-capped logits, sliding windows) and a Qwen3 MoE model (q/k
    norms, experts) loads, only row scales and norms moved, and KL to the original falls on text it never saw."""
    src = make_tiny(tmp_path / "model", family=family, **extra)
    opts = QuantOptions(measure_rows=32, fisher_rows=2, codes="trellis", trellis_bits=(2, 3))
    convert(tiny_job(src, tmp_path / "base", bits=2.5, rows=16, length=64, options=opts), progress=False)
    convert(tiny_job(src, tmp_path / "tuned", bits=2.5, rows=16, length=64, options=replace(opts, tune_steps=32),
                     measurement=str(tmp_path / "base")), progress=False)
    moved = changed_tensors(tmp_path / "base", tmp_path / "tuned")
    assert all(k.endswith((".tscale", "norm.weight")) for k in moved), sorted(moved)
    assert any(k.endswith("q_norm.weight") for k in moved)  # both families normalise queries and keys
    ref = exl.load_model(src, progress=False)
    kl_base = _kl_on_fresh_text(src, exl.load_model(tmp_path / "base", progress=False), ref)
    kl_tuned = _kl_on_fresh_text(src, exl.load_model(tmp_path / "tuned", progress=False), ref)
    assert 0 < kl_tuned < 0.97 * kl_base  # 0.94x (Gemma 3), 0.90x (Qwen3 MoE) here


def test_auto_codes_choose_the_better_kind_per_matrix(tiny, tmp_path):
    from quant.optimize import optimize

    options = QuantOptions(measure_rows=32, fisher_rows=2, trellis_bits=(2, 3, 4, 5))
    report = convert(tiny_job(tiny, tmp_path / "a", bits=3.5, options=options), progress=False)
    layers = json.loads((tmp_path / "a" / "measurement.json").read_text())["layers"]
    kinds = {c["setting"].startswith("trellis") for r in layers for c in r["candidates"]}
    assert kinds == {True, False}

    def only(trellis):
        return [{**r, "candidates": [c for c in r["candidates"] if c["setting"].startswith("trellis") == trellis]}
                for r in layers]

    both = optimize(layers, 3.5)["predicted_kl"]
    assert report["predicted_kl"] == pytest.approx(both)
    assert both <= optimize(only(True), 3.5)["predicted_kl"] + 1e-12
    assert both <= optimize(only(False), 3.5)["predicted_kl"] + 1e-12
    # the auto measurement serves a trellis-only and a scalar-only conversion: the optimizer sees one kind
    for kind, trellis in (("trellis", True), ("scalar", False)):
        one = replace(options, codes=kind, trellis_bits=None)
        rep = convert(tiny_job(tiny, tmp_path / kind, bits=3.5, options=one, measurement=str(tmp_path / "a")),
                      progress=False)
        assert {s["setting"].startswith("trellis") for s in rep["layers"]} == {trellis}
        assert rep["predicted_kl"] == pytest.approx(optimize(only(trellis), 3.5)["predicted_kl"])
        assert "measure" not in rep["timings"]
        assert ("fisher" in rep["timings"]) == trellis  # Fisher-weighted walks: a -m conversion makes the Fisher
    # a measurement made before format version 3 (trellis candidates with both rotations) converts as it priced
    old = json.loads((tmp_path / "a" / "measurement.json").read_text())
    for r in old["layers"]:
        for c in r["candidates"]:
            if c["setting"].startswith("trellis"):
                c["transform"] = "su+sv"
    (tmp_path / "old-trellis.json").write_text(json.dumps(old))
    rep = convert(tiny_job(tiny, tmp_path / "v2", bits=3.5, options=replace(options, codes="trellis", trellis_bits=None),
                           measurement=str(tmp_path / "old-trellis.json")), progress=False)
    assert {s["transform"] for s in rep["layers"]} == {"su+sv"} and "fisher" not in rep["timings"]
    assert json.loads((tmp_path / "v2" / "config.json").read_text())["quantization_config"]["version"] == 2
    from exl.loader import TensorLoader

    assert "model.layers.0.mlp.up_proj.sv" in TensorLoader(tmp_path / "v2")
    # but not with trellis widths it did not measure, nor other options
    for other in (replace(options, codes="trellis", trellis_bits=(2, 3, 6)), replace(options, codes="scalar", damp=0.02)):
        with pytest.raises(ConvertError, match="other quantizer options"):
            convert(tiny_job(tiny, tmp_path / "c", bits=3.5, options=other, measurement=str(tmp_path / "a")),
                    progress=False)
        assert not (tmp_path / "c").exists()  # refused before anything was written
    # a scalar-only measurement (as made before trellis codes) is refused with a hint
    with pytest.raises(ConvertError, match="--codes scalar"):
        convert(tiny_job(tiny, tmp_path / "b", options=options, measurement=str(_scalar_measurement(tmp_path))),
                progress=False)


def _scalar_measurement(tmp_path):
    """A measurement.json as exl wrote it before trellis codes (version 1, scalar options key)."""
    m = {"version": 1, "options": FAST.measurement_key(), "layers": []}
    p = tmp_path / "old.json"
    p.write_text(json.dumps(m))
    return p


def test_hessians_match_each_layers_own_input(tiny):
    """Every linear gets the Hessian of its own input (q/k/v and gate/up share one; no stale reuse)."""
    from exl.cache.base import NoCache
    from quant.capture import HessianCache, taps
    from quant.model_parts import SourceModel

    src = SourceModel(tiny)
    block, refs = src.block(0)
    x = torch.randn(3, 20, 64)
    direct = {}
    hooks = [r.module.register_forward_hook(lambda m, i, o, name=r.name: direct.__setitem__(name, i[0].reshape(-1, i[0].shape[-1])))
             for r in refs]
    with torch.inference_mode():
        block(x, NoCache(3, 20))
    for h in hooks:
        h.remove()
    cache, got = HessianCache(), {}

    def tap(ref, inp):
        got[ref.name] = cache(inp, ref.name)[0]
        return ref.module(inp)

    with torch.inference_mode(), taps(refs, tap):
        block(x, NoCache(3, 20))
    assert set(got) == set(direct) and len(got) == 7
    for name, xs in direct.items():
        assert torch.allclose(got[name], (xs.T @ xs).double(), rtol=1e-5, atol=1e-4), name


def test_report_checks_prediction(converted):
    _, report = converted
    ev = report["eval"]
    assert ev["rows"] == 2 and ev["kl"] > 0 and ev["ppl"] > 1 and report["predicted_kl"] > 0
    assert {s["name"] for s in report["layers"]} == {f"model.layers.{i}.{m}" for i in range(2) for m in
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj")}


def test_reuse_measurement_for_another_size(tiny, converted, tmp_path):
    out, _ = converted
    report = convert(tiny_job(tiny, tmp_path / "q3", bits=3.0, measurement=str(out)), progress=False)
    assert abs(report["measured_bpw"] - 3.0) <= 0.02
    assert "fisher" not in report["timings"] and "measure" not in report["timings"]
    assert (tmp_path / "q3" / "measurement.json").read_bytes() == (out / "measurement.json").read_bytes()
    with pytest.raises(TargetError, match="out of reach"):
        convert(tiny_job(tiny, tmp_path / "q9", bits=1.6, measurement=str(out)), progress=False)
    other = make_tiny(tmp_path / "other", hidden_size=96, intermediate_size=64)
    with pytest.raises(ConvertError, match="another model"):
        convert(tiny_job(other, tmp_path / "qo", measurement=str(out)), progress=False)
    with pytest.raises(ConvertError, match="other quantizer options"):
        convert(tiny_job(tiny, tmp_path / "qx", measurement=str(out), options=QuantOptions(measure_rows=16)),
                progress=False)


def test_exl_commands_run_the_converted_model(converted, tmp_path):
    out, _ = converted
    gen = subprocess.run([sys.executable, "-m", "exl.cli", "generate", "-m", str(out), "-p", "def main():",
                          "--max-new-tokens", "8"], cwd=ROOT, capture_output=True, text=True)
    assert gen.returncode == 0 and gen.stdout.strip(), gen.stderr[-2000:]
    text = tmp_path / "t.txt"
    text.write_text("import os\nprint(os.getcwd())\n" * 40)
    ev = subprocess.run([sys.executable, "-m", "exl.cli", "eval", "ppl", "-m", str(out), "--text", str(text),
                         "--ctx", "64", "--json"], cwd=ROOT, capture_output=True, text=True)
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert json.loads(ev.stdout.strip().splitlines()[-1])["ppl"] > 1


def test_optimizer_hits_targets_on_a_real_measurement(converted):
    from quant.optimize import optimize

    out, _ = converted
    layers = json.loads((out / "measurement.json").read_text())["layers"]
    previous = None  # (a 64-wide toy: per-matrix overheads put 2.0 bpw out of reach; SmolLM2 reaches it)
    for target in (2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0):
        plan = optimize(layers, target)
        assert target - 0.02 <= plan["bpw"] <= target
        if previous is not None:
            assert plan["predicted_kl"] < previous
        previous = plan["predicted_kl"]


def test_sharded_output_loads(tmp_path):
    from exl.loader import TensorLoader
    from quant.writer import write_shards

    tensors = {f"t{i}": torch.full((100 + i,), float(i)) for i in range(7)}
    items = [(k, v.numel() * 4, (lambda v=v: v)) for k, v in tensors.items()]
    names = write_shards(tmp_path, items, shard_bytes=1000)
    assert len(names) == 4 and names[0] == "model-00001-of-00004.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    loader = TensorLoader(tmp_path)
    for k, v in tensors.items():
        assert torch.equal(loader.get(k), v)
    assert write_shards(tmp_path, items, shard_bytes=10**9) == ["model.safetensors"]  # stale shards removed
    assert sorted(f.name for f in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def output_bytes(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file() and f.name != "quantization_report.json"}


def run_cli(args, kill_before: str | None = None) -> int:
    """Run convert.py; with kill_before, it SIGKILLs itself just before that file is renamed into place
    (quant.faults: deterministic, no timing)."""
    cmd = [sys.executable, str(ROOT / "convert.py"), *args, "-q"]
    env = dict(os.environ)
    if kill_before is not None:
        env["EXL_KILL_BEFORE_COMMIT"] = kill_before
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=600)
    if kill_before is None:
        assert proc.returncode == 0, proc.stdout.decode()[-3000:]
    return proc.returncode


def tmp_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob(".*.tmp-*"))


def test_resume_after_kills_gives_identical_output(tiny, tmp_path):
    args = ["-i", str(tiny), "-b", "3.5", "-cr", "6", "-cl", "48", "--seed", "3", "--tune", "2"]
    run_cli([*args, "-o", str(tmp_path / "ref")])
    out, work = tmp_path / "out", tmp_path / "work"
    full = [*args, "-o", str(out), "-w", str(work)]
    # one kill in every stage, the last two while the output folder is written (shard, then config.json)
    stages = ["fisher/in_001.safetensors", "measure/block_000.json", "quant/block_000.json", "head.json",
              "tune.safetensors", "out/model.safetensors", "out/config.json"]
    for i, stage in enumerate(stages):
        assert run_cli(full + (["-r"] if i else []), kill_before=stage) == -signal.SIGKILL, stage
        assert tmp_files(out if stage.startswith("out/") else work), stage  # the half-written file is there
    assert not (out / "config.json").exists()
    run_cli(full + ["-r"])
    assert not tmp_files(out) and not tmp_files(work)
    assert output_bytes(out) == output_bytes(tmp_path / "ref")
    umask = os.umask(0)
    os.umask(umask)
    for f in out.iterdir():  # every file, the safetensors shard too, as readable as the umask allows
        if f.is_file():
            assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc.get("trellis_layers", 0) > 0 and qc["version"] == F.ONE_SIDED_TRELLIS_VERSION  # auto codes chose some trellis


def test_bad_inputs(tiny, tmp_path):
    with pytest.raises(ConvertError, match="not a folder"):
        convert(tiny_job(tmp_path / "missing", tmp_path / "o1"), progress=False)
    with pytest.raises(ConvertError, match="between"):
        convert(tiny_job(tiny, tmp_path / "o2", bits=12), progress=False)
    with pytest.raises(ConvertError, match="head bits"):
        convert(tiny_job(tiny, tmp_path / "o3", head_bits=12), progress=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x.txt").write_text("x")
    with pytest.raises(ConvertError, match="not empty"):
        convert(tiny_job(tiny, tmp_path / "full"), progress=False)
    job = tiny_job(tiny, tmp_path / "o4", rows=1, length=16)
    with pytest.raises(ConvertError, match="at least"):
        convert(job, progress=False)
    with pytest.raises(Exception, match="does not exist"):
        convert(tiny_job(tiny, tmp_path / "o5", calibration=str(tmp_path / "nope.parquet")), progress=False)
    # --tune needs 2 rows a step from the calibration data: refused before any pass runs, naming both
    (tmp_path / "small.txt").write_text(" ".join(["def f(x): return x"] * 200))
    small = tiny_job(tiny, tmp_path / "o6", rows=2, length=64, calibration=str(tmp_path / "small.txt"),
                     options=replace(FAST, tune_steps=50))
    with pytest.raises(ConvertError, match=r"--tune 50 needs 100 calibration rows of 64 tokens.*fewer steps"):
        convert(small, progress=False)
    assert not (tmp_path / "o6" / "work" / "fisher.safetensors").exists()


def test_resume_refuses_other_arguments(tiny, tmp_path):
    work = tmp_path / "w"
    (work).mkdir()
    (work / "job.json").write_text(json.dumps({"bits": 9}))
    with pytest.raises(ConvertError, match="-r to resume"):
        convert(tiny_job(tiny, tmp_path / "o", work=str(work)), progress=False)
    with pytest.raises(ConvertError, match="different arguments"):
        convert(tiny_job(tiny, tmp_path / "o", work=str(work)), resume=True, progress=False)


def test_nan_activations_drop_rows_or_refuse(tmp_path, caplog):
    src = make_tiny(tmp_path / "nan", tie_word_embeddings=False)
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    emb = tensors["model.embed_tokens.weight"]
    from exl.tokenizer import Tokenizer

    from calibration import calibration_rows

    ids, _ = calibration_rows(None, Tokenizer.from_dir(src), 6, 48, 0)
    others = set(ids[:4].flatten().tolist()) | set(ids[5].tolist())
    bad = next(t for t in ids[4].tolist() if t not in others)  # a token of the 5th row only
    emb[bad] = float("inf")
    save_file(tensors, src / "model.safetensors")
    with caplog.at_level("WARNING", logger="exl.quant"):
        report = convert(tiny_job(src, tmp_path / "o"), progress=False)
    assert "dropped" in caplog.text and abs(report["measured_bpw"] - 4.0) <= 0.02
    emb[:] = float("inf")
    save_file(tensors, src / "model.safetensors")
    from quant.passes import CalibrationFailure

    with pytest.raises(CalibrationFailure, match="NaN/inf"):
        convert(tiny_job(src, tmp_path / "o2"), progress=False)


def test_cli_help():
    for cmd in ([sys.executable, "convert.py", "--help"], [sys.executable, "-m", "exl.cli", "convert", "--help"]):
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
        for flag in ("-i", "-o", "-b", "-hb", "-w", "-r", "-c", "-cr", "-cl", "-m", "--seed", "-ss"):
            assert f" {flag}" in out, (cmd, flag)


def test_cli_trellis_passes_reach_the_options_and_bad_ones_are_refused(tmp_path):
    import argparse

    from exl.commands.convert import add_arguments, job_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["-i", "in", "-o", "out", "-b", "3.0"]
    assert job_from_args(p.parse_args(base)).options.trellis_passes == 0  # the default
    assert job_from_args(p.parse_args(base + ["--trellis-passes", "1"])).options.trellis_passes == 1
    for bad in ("-1", "9", "two", "1.5"):
        res = subprocess.run([sys.executable, "convert.py", *base, "--trellis-passes", bad], cwd=ROOT,
                             capture_output=True, text=True)
        assert res.returncode == 2 and "--trellis-passes" in res.stderr and "0 to 8" in res.stderr, bad
    assert job_from_args(p.parse_args(base + ["--tune", "72"])).options.tune_steps == 72
    for bad in ("-1", "4097", "many"):
        res = subprocess.run([sys.executable, "convert.py", *base, "--tune", bad], cwd=ROOT, capture_output=True, text=True)
        assert res.returncode == 2 and "--tune" in res.stderr and "0 to 4096" in res.stderr, bad
    assert not (ROOT / "out").exists()


def test_real_model_end_to_end(smollm_dir, tmp_path):
    """SmolLM2-135M with little calibration: the whole pipeline on the real architecture and sizes."""
    out = tmp_path / "smol"
    job = Job(input=str(smollm_dir), output=str(out), bits=4.0, rows=2, length=256,
              options=QuantOptions(measure_rows=32, fisher_rows=1, transform="su+perm", codes="scalar"))
    report = convert(job, progress=False)
    assert abs(report["measured_bpw"] - 4.0) <= 0.02
    bits, weights, _ = quant_layer_bits(out)
    assert weights == 30 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 576 * 1536)
    assert bits / weights == pytest.approx(report["measured_bpw"], abs=1e-6)
    model, ref = exl.load_model(out, progress=False), exl.load_model(smollm_dir, progress=False)
    from calibration.evaltext import eval_tokens
    from exl.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(out)
    ids = torch.tensor([tok.encode("The capital of France is Paris. The capital of Germany is")])
    top = model(ids)[0, -1].topk(3).indices.tolist()
    assert tok.encode(" Berlin")[0] in top
    text = torch.tensor(eval_tokens(tok)[:512]).view(2, 256)  # held-out text
    lq, lr = torch.log_softmax(model(text), -1), torch.log_softmax(ref(text), -1)
    assert float((lr.exp() * (lr - lq)).sum(-1).mean()) < 0.3


def eval_kld(model_dir, ref_dir, n_windows=4):
    from calibration.evaltext import eval_tokens
    from exl.eval import perplexity
    from exl.tokenizer import Tokenizer

    tokens = eval_tokens(Tokenizer.from_dir(ref_dir))
    return perplexity(exl.load_model(model_dir, progress=False), tokens, 512, n_windows,
                      ref_model=exl.load_model(ref_dir, progress=False), progress=False)


@pytest.mark.slow
def test_smollm2_rotated_default_conversion_quality(smollm_dir, tmp_path):
    """The default conversion of the rotated SmolLM2 at 4.0 and (reusing the measurement) 3.0 bpw beats
    llama.cpp's Q4_0 (4.5 bpw, KLD 0.47 on this model and text; docs/quantization.md)."""
    from quant.rotate import rotate_model

    rot = rotate_model(smollm_dir, tmp_path / "rot", seed=0)
    r4 = convert(Job(input=str(rot), output=str(tmp_path / "q4"), bits=4.0), progress=False)
    assert abs(r4["measured_bpw"] - 4.0) <= 0.02
    e4 = eval_kld(tmp_path / "q4", rot)
    assert e4["kld"] < 0.17  # half of IQ4_NL's (4.53 bpw) 0.35
    r3 = convert(Job(input=str(rot), output=str(tmp_path / "q3"), bits=3.0, measurement=str(tmp_path / "q4")),
                 progress=False)
    assert abs(r3["measured_bpw"] - 3.0) <= 0.02 and "measure" not in r3["timings"]
    assert eval_kld(tmp_path / "q3", rot)["kld"] < 0.45


@pytest.mark.slow
def test_smollm2_resume_after_kills_is_identical(smollm_dir, tmp_path):
    args = ["-i", str(smollm_dir), "-b", "3.0", "-cr", "6", "-cl", "256"]
    run_cli([*args, "-o", str(tmp_path / "ref")])
    out, work = tmp_path / "out", tmp_path / "work"
    full = [*args, "-o", str(out), "-w", str(work)]
    assert run_cli(full, kill_before="measure/block_011.json") == -signal.SIGKILL
    assert run_cli(full + ["-r"], kill_before="quant/block_020.json") == -signal.SIGKILL
    assert run_cli(full + ["-r"], kill_before="out/model.safetensors") == -signal.SIGKILL
    run_cli(full + ["-r"])
    assert output_bytes(out) == output_bytes(tmp_path / "ref")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc.get("trellis_layers", 0) > 0 and qc["version"] == F.ONE_SIDED_TRELLIS_VERSION  # auto codes chose some trellis


def test_loaded_model_holds_only_the_stored_bytes(converted):
    """Serving memory: after loading and running, the model's tensors are the files' tensors (packed weights,
    fp16 scales and embedding; only the small norm vectors widen to fp32) and the CPU kernels share them:
    no dequantized or full-precision copy of any quantized matrix exists."""
    from exl.cache.contiguous import KVCache
    from exl.modules.quant_linear import QuantLinear

    out, _ = converted
    model = exl.load_model(out, progress=False)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 2]))  # prefill (GEMM path) builds every kernel
        cache = KVCache(model.config, 1, 24)
        model(torch.tensor([[1, 2, 3]]), cache=cache)
        model(torch.tensor([[4]]), cache=cache)  # decode (int8 GEMV path)
    storages = {}
    for t in list(model.parameters()) + list(model.buffers()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    held = sum(storages.values())
    on_disk = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    norms = sum(m.weight.numel() * 2 for m in model.modules() if type(m).__name__ == "RMSNorm")  # fp16 -> fp32
    assert held <= on_disk + norms + 4096, (held, on_disk, norms)
    assert all(not isinstance(m, torch.nn.Linear) for m in model.modules())
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 7 * model.config.num_layers + 1  # + head


@pytest.mark.parametrize("name", ["llama-tied-bias", "gemma3", "qwen3-moe"])
def test_source_model_walks_the_models_own_code(tmp_path, name):
    """SourceModel builds a lazily loaded CausalLM piece by piece: embedding (Gemma's scale), blocks, final norm,
    the head (tied or not) and soft-capped logits equal the loaded model's."""
    from test_models import make_model

    from exl.cache.base import NoCache
    from quant.model_parts import SourceModel

    _, path = make_model(tmp_path, name)
    model = exl.load_model(path, progress=False, device="cpu")
    src = SourceModel(path)
    assert src.model.embed_tokens is None and len(src.model.layers) == 0  # nothing read up front
    ids = torch.randint(0, 211, (2, 12), generator=torch.Generator().manual_seed(0))
    h = src.embed(ids)
    assert torch.equal(h, model.embed(ids))
    for i in range(src.num_layers):
        block, refs = src.block(i)
        assert refs and all(r.name.startswith(f"model.layers.{i}.") for r in refs)
        with torch.inference_mode():
            h = block(h, NoCache(*ids.shape, ids.device))
    want = model(ids)
    with torch.inference_mode():
        got = src.logits(h, src.final_norm(), src.head_weight())
    assert torch.equal(got, want)
    if model.config.final_logit_softcapping:
        assert got.abs().max() < model.config.final_logit_softcapping
    tied = "lm_head.weight" not in src.loader
    assert tied == (name == "llama-tied-bias")
    assert torch.equal(src.head_weight(), model.lm_head.weight)
