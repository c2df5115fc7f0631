"""A function-preserving, randomly rotated copy of a Llama-family model (the evaluation model).

SmolLM2's published weights went through llama.cpp's Q4_1 (a 4-bit grid with groups of 32), so
any 4-bit group-32 quantizer would find them already on its grid and look better than it is. This
copy computes the same function with weights that lie on no grid:

1. fold each RMSNorm's weight into the linear layers that read its output (q/k/v, gate/up, the head)
   and set the norm weights to 1;
2. untie the head from the embedding;
3. rotate the residual stream by a seeded random orthogonal matrix Q: h' = h Q. RMSNorm is
   unchanged by the rotation (it only uses ‖h‖), so readers become W diag(γ) Q, writers (o_proj,
   down_proj and their biases) Qᵀ W, the embedding E Q.

    python -m quant.rotate SmolLM2-135M-Instruct smollm2-rotated --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from exl.config import ModelConfig
from exl.errors import UnsupportedModelError
from exl.files import public_mode
from exl.loader import TensorLoader
from quant.writer import TOKENIZER_FILES

SUPPORTED = ("llama", "mistral", "qwen2")
READERS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}
WRITERS = ("self_attn.o_proj", "mlp.down_proj")


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    """Haar-random orthogonal [n, n] float64 matrix from a seed (QR of a Gaussian, signs fixed)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r))[None, :]


def rotate_model(src: str | Path, dst: str | Path, seed: int = 0) -> Path:
    """Write the rotated copy of the HF folder `src` to `dst` (float32). Returns `dst`."""
    src, dst = Path(src), Path(dst)
    config = ModelConfig.from_dir(src)
    if config.model_type not in SUPPORTED or config.quantization:
        raise UnsupportedModelError(f"{src}: rotation supports dense {', '.join(SUPPORTED)} models, "
                                    f"not {config.model_type!r}{' (quantized)' if config.quantization else ''}")
    loader = TensorLoader(src)
    d = config.hidden_size
    q = random_orthogonal(d, seed)
    get = lambda name: loader.get(name, torch.float64)  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    embed = get("model.embed_tokens.weight")
    head = get("lm_head.weight") if "lm_head.weight" in loader else embed
    out["model.embed_tokens.weight"] = embed @ q
    out["lm_head.weight"] = head * get("model.norm.weight")[None, :] @ q
    out["model.norm.weight"] = torch.ones(d, dtype=torch.float64)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for norm, readers in READERS.items():
            gamma = get(p + norm + ".weight")
            for r in readers:
                out[p + r + ".weight"] = get(p + r + ".weight") * gamma[None, :] @ q
            out[p + norm + ".weight"] = torch.ones(d, dtype=torch.float64)
        for w in WRITERS:
            out[p + w + ".weight"] = q.T @ get(p + w + ".weight")
            if p + w + ".bias" in loader:
                out[p + w + ".bias"] = get(p + w + ".bias") @ q
        for name in loader.with_prefix(p):  # everything else (q/k/v biases, q/k norms) unchanged
            if name not in out:
                out[name] = get(name)
    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / f".model.safetensors.tmp-{os.getpid()}"
    save_file({k: v.to(torch.float32).contiguous() for k, v in out.items()}, str(tmp), metadata={"format": "pt"})
    public_mode(tmp)
    os.replace(tmp, dst / "model.safetensors")
    raw = json.loads((src / "config.json").read_text())
    raw["tie_word_embeddings"] = False
    raw["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return dst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m quant.rotate", description=__doc__.split("\n\n")[0])
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(rotate_model(a.input, a.output, a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
