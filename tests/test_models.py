"""Our forward pass is the same function as transformers', for every supported family.

Tiny randomly initialised models are saved with transformers' save_pretrained, loaded with exl,
and logits compared in fp32 on the same tokens.
"""

import pytest
import torch
import transformers

import exl
from exl.cache.contiguous import KVCache

pytestmark = pytest.mark.kernels  # models on the compiled kernels; CI runs these under a second torch too

BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)

CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied-bias": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, attention_bias=True)),
    "llama-rope-linear": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0})),
    "llama-rope-dynamic": ("LlamaConfig", "LlamaForCausalLM", dict(max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})),
    "llama-rope-llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 500000.0})),
    "llama-rope-yarn": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0})),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=7, head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=5, query_pre_attn_scalar=24,
               final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})),
    "gemma3-pattern": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=5, num_hidden_layers=7)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1], head_dim=16)),
    "qwen3-moe-nonorm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False)),
    "qwen2-moe-shared": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=80)),
}


def make_model(tmp_path, name, seed=0):
    cfg_cls, model_cls, extra = CASES[name]
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **extra})
    cfg._attn_implementation = "eager"  # the reference path (sdpa silently drops attention soft-capping)
    torch.manual_seed(seed)
    ref = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():  # random init leaves norms at 1 and small weights: make them informative
        for n, p in ref.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if "gemma" in name else 1.0))
            else:
                p.copy_(torch.randn_like(p) * 0.08)
    path = tmp_path / name
    ref.save_pretrained(path)
    return ref, path


def check_close(ours, theirs, tol=1e-4):
    scale = theirs.abs().max()
    err = (ours - theirs).abs().max()
    assert err <= tol * scale, f"max abs diff {err:.3e} > {tol} x logit scale {scale:.3e}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers(tmp_path, name):
    ref, path = make_model(tmp_path, name)
    model = exl.load_model(path, progress=False)
    ids = torch.randint(0, BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits.float()
    check_close(model(ids), want)


@pytest.mark.parametrize("name", ["llama", "mistral-window", "gemma3", "qwen3-moe"])
def test_incremental_decode_matches_full_forward(tmp_path, name):
    _, path = make_model(tmp_path, name)
    model = exl.load_model(path, progress=False)
    ids = torch.randint(0, BASE["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(2))
    full = model(ids)
    cache = KVCache(model.config, batch=1, max_len=32)
    parts = [model(ids[:, :9], cache=cache)]  # prefill, then one token at a time and a chunk of 3
    for t in range(9, 14):
        parts.append(model(ids[:, t : t + 1], cache=cache))
    parts.append(model(ids[:, 14:17], cache=cache))
    parts.append(model(ids[:, 17:], cache=cache))
    check_close(torch.cat(parts, dim=1), full, 1e-5)


def test_models_package_does_not_import_parallel():
    """exl.load_model sits above exl.models and exl.parallel: the models never reach up into parallel."""
    import subprocess
    import sys

    code = ("import sys, exl.models, exl.models.base, exl.models.llama, exl.models.qwen, exl.models.gemma3, "
            "exl.models.moe, exl.loading; "
            "bad = sorted(m for m in sys.modules if m.startswith('exl.parallel')); "
            "assert not bad, bad; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    # ... nor lazily, inside a function: no import statement of exl/models names exl.parallel
    import ast
    from pathlib import Path

    for f in sorted(Path(exl.__file__).parent.joinpath("models").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("exl.parallel") for n in names), f"{f.name}:{node.lineno} imports {names}"


def test_load_model_rejects_parallel_options_without_devices(tmp_path):
    _, path = make_model(tmp_path, "llama")
    with pytest.raises(TypeError, match="mode only apply with tp >= 2 or gpu_split"):
        exl.load_model(path, progress=False, mode="expert")
    model = exl.load_model(path, progress=False, device="cpu", dtype=torch.float32, tp=1)
    assert model.device.type == "cpu" and model.dtype is torch.float32
