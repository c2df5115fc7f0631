"""Quantize a float model folder with a peer tool on the CPU and write its dequantized decoder weights.

Run by `bench/quality.py --peers`, each tool in its own virtualenv (the tools pin versions of torch,
transformers and each other that exl's environment must not get; llmcompressor 0.14 wants
auto-round <= 0.15, so AutoRound 0.16 gets a second venv). Setup, once (CPU torch from the local wheel
or the PyTorch CPU index; a bare `torch` from PyPI is a 5.5 GB CUDA build):

    python -m venv ~/.cache/exl/peers/venv
    ~/.cache/exl/peers/venv/bin/pip install torch==2.13.0+cpu -r bench/peers/requirements.txt
    python -m venv ~/.cache/exl/peers/venv-autoround
    ~/.cache/exl/peers/venv-autoround/bin/pip install torch==2.13.0+cpu -r bench/peers/requirements-autoround.txt

    python bench/peers/quantize.py {gptq,autoround,hqq} --model DIR --calibration FILE --bits 4 --group 64 --out DIR

Tools and what each is asked for (only the decoder's linear layers; embedding and head untouched):
- gptq: llmcompressor's GPTQModifier, oneshot's default flow (sequential pipeline, static act-order,
  damping 0.01, block 128), int, symmetric, one float scale per group.
- autoround: auto-round's AutoRound (SignRound, default 200 iterations, lr, batch 8), scheme W<b>A16
  (int, symmetric) at the given group; rows whose width is not a multiple of the group are padded by
  the tool itself (576 -> 640 at group 128).
- hqq: hqq's HQQLinear (calibration-free half-quadratic optimisation of zero and scale, axis 1), float16
  scale and zero per group.

Calibration: the token rows in FILE (safetensors, `input_ids` [rows, length]); quality.py writes exl's
own default calibration rows there, so every calibrated tool sees exactly what exl's convert sees.

Output in --out: `weights.safetensors` (float32 dequantized weights, Hugging Face names) and `peer.json`
(tool, version, settings, stored bits per matrix, seconds). Every dequantized matrix is checked to lie
on its tool's grid (integer codes within 2^bits levels per group) before it is written.

This module imports no peer tool at the top: `stored_bits` and `check_on_grid` are used by exl's tests.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

DECODER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def stored_bits(rows: int, cols: int, bits: int, group: int, scale_bits: int = 16, zero_bits: int = 0) -> int:
    """Every bit a row-grouped integer format stores for a [rows, cols] matrix: `bits` per weight, and per
    group (ceil(cols / group) per row; a short last group still costs a full scale) one scale of
    `scale_bits` and one zero point of `zero_bits` (0 when symmetric)."""
    groups = math.ceil(cols / group)
    return rows * (cols * bits + groups * (scale_bits + zero_bits))


def check_on_grid(name: str, w, scale, zero, bits: int, group: int, tol: float = 2e-3) -> None:
    """Raise unless w [rows, cols] == (q - zero) * scale per group with integer q spanning <= 2^bits levels.

    scale, zero: [rows, ceil(cols / group)]; zero None: symmetric (q signed). A short last group is padded."""
    import torch

    rows, cols = w.shape
    n = scale.shape[1]
    real = (torch.arange(n * group) < cols).view(n, group)
    q = torch.nn.functional.pad(w.double(), (0, n * group - cols)).view(rows, n, group) / scale.double()[..., None]
    if zero is not None:
        q = q + zero.double()[..., None]
    off = float((q - q.round()).abs()[:, real].max())
    if off > tol:
        raise ValueError(f"{name}: dequantized weights are not on the tool's grid (max |q - round(q)| = {off:.4f})")
    q = q.round()
    span = q.masked_fill(~real, -math.inf).amax(-1) - q.masked_fill(~real, math.inf).amin(-1)
    if float(span.max()) > 2 ** bits - 1:
        raise ValueError(f"{name}: {int(span.max()) + 1} levels in a group, more than 2^{bits}")


def dequantize_codes(name: str, w, scale, zero, bits: int, group: int, signed: bool):
    """The matrix a checkpoint of the tool decodes: integer codes recovered from the tool's fake-quantized
    weights w (which it may have computed in bfloat16 or float32), times the float16-rounded scale (a checkpoint
    stores scales in half precision), in float32. scale, zero: [rows, groups]; zero None: symmetric."""
    import torch

    rows, cols = w.shape
    n = scale.shape[1]
    s16 = scale.half().float()
    q = torch.nn.functional.pad(w.float(), (0, n * group - cols)).view(rows, n, group) / scale.float()[..., None]
    if zero is not None:
        q = q + zero.float()[..., None]
    off = float((q - q.round()).abs().max())
    if off > 0.1:
        raise ValueError(f"{name}: the tool's weights are not on its grid (max |q - round(q)| = {off:.3f})")
    q = q.round()
    lo = -(2 ** (bits - 1)) if signed and zero is None else 0
    if float(q.min()) < lo or float(q.max()) > lo + 2 ** bits - 1:
        raise ValueError(f"{name}: codes {int(q.min())}..{int(q.max())} outside {bits} bits")
    if zero is not None:
        q = q - zero.float()[..., None]
    return (q * s16[..., None]).reshape(rows, -1)[:, :cols].contiguous()


def decoder_linears(model) -> dict:
    """HF name (without `.weight`) -> nn.Linear for every decoder linear layer."""
    out = {}
    for name, mod in model.named_modules():
        parts = name.split(".", 3)
        if name.startswith("model.layers.") and len(parts) == 4 and parts[3] in DECODER:
            out[name] = mod
    if len(out) != 7 * model.config.num_hidden_layers:
        raise ValueError(f"found {len(out)} decoder linears, expected 7 per layer")
    return out


def load_model(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def run_hqq(model, args, ids) -> tuple[dict, dict]:
    import torch
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear, Quantizer
    from tqdm import tqdm

    cfg = BaseQuantizeConfig(nbits=args.bits, group_size=args.group, axis=1)
    weights = {}
    for name, lin in tqdm(decoder_linears(model).items(), desc=f"hqq {args.bits}b g{args.group}"):
        q = HQQLinear(lin, cfg, del_orig=False, compute_dtype=torch.float16, device="cpu")
        # its stored float16 scale and zero, applied in float32 (HQQ's own dequantize computes in float16)
        meta = dict(q.meta, compute_dtype=torch.float32, scale=q.meta["scale"].float(), zero=q.meta["zero"].float())
        w = Quantizer.dequantize(q.W_q, meta)
        rows, cols = w.shape
        shape = (rows, cols // args.group)
        check_on_grid(name, w, meta["scale"].view(shape), meta["zero"].view(shape), args.bits, args.group)
        weights[name] = w
    return weights, {"config": {k: v for k, v in cfg["weight_quant_params"].items()}, "compute_dtype": "float16",
                     "stored": "codes + float16 scale + float16 zero per group"}


def run_gptq(model, args, ids) -> tuple[dict, dict]:
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=args.bits, type="int", symmetric=True, strategy="group", group_size=args.group))
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    oneshot(model=model, tokenizer=str(args.model), dataset=ds, recipe=recipe, num_calibration_samples=len(ids),
            max_seq_length=ids.shape[1])
    weights = {}
    for name, lin in decoder_linears(model).items():
        scale = lin.weight_scale.detach()
        if getattr(lin, "weight_g_idx", None) is not None and (lin.weight_g_idx.diff() < 0).any():
            raise ValueError(f"{name}: act-order group index present; this reader assumes groups in column order")
        w = dequantize_codes(name, lin.weight.detach(), scale, None, args.bits, args.group, signed=True)
        s16 = scale.half().float()
        check_on_grid(name, w, s16, None, args.bits, args.group)
        weights[name] = w
    return weights, {"recipe": recipe.model_dump(mode="json", exclude_none=True),
                     "stored": "codes + float16 scale per group (symmetric: no zero point; static act-order: no g_idx)"}


def run_autoround(model, args, ids) -> tuple[dict, dict]:
    import torch
    from auto_round import AutoRound
    from transformers import AutoTokenizer

    raw_file = args.out / "autoround-raw.pt"  # the tool's own result, kept so a rerun reads instead of re-tuning
    if raw_file.is_file():
        raw, ar = torch.load(raw_file), None
    else:
        tok = AutoTokenizer.from_pretrained(args.model)
        data = [{"input_ids": row[None], "attention_mask": torch.ones_like(row)[None]} for row in ids]
        kw = {} if args.iters is None else {"iters": args.iters}
        blocks = ({} if args.blocks is None else
                  {"to_quant_block_names": [[f"model.layers.{i}" for i in range(args.blocks)]]})
        ar = AutoRound(model, tok, scheme=f"W{args.bits}A16", group_size=args.group, dataset=data, nsamples=len(ids),
                       seqlen=ids.shape[1], device_map="cpu", **kw, **blocks)
        ar.quantize()
        raw = {name: (lin.weight.detach().clone(), lin.scale, lin.zp) for name, lin in decoder_linears(model).items()
               if args.blocks is None or int(name.split(".")[2]) < args.blocks}
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(raw, raw_file)
    weights = {}
    for name, (weight, scale, zp) in raw.items():
        scale = scale.float()
        zero = None if zp is None else (zp.float() if torch.is_tensor(zp) else torch.full_like(scale, float(zp)))
        w = dequantize_codes(name, weight, scale, zero, args.bits, args.group, signed=True)
        check_on_grid(name, w, scale.half().float(), zero, args.bits, args.group)
        weights[name] = w
    return weights, {"scheme": f"W{args.bits}A16", "iters": getattr(ar, "iters", args.iters or "default (200)"),
                     "batch_size": getattr(ar, "batch_size", None), "lr": str(getattr(ar, "lr", None)),
                     "scale_dtype": str(raw[name][1].dtype), "blocks": args.blocks,
                     "stored": "codes + float16 scale per group (symmetric); 576-wide rows padded to 640 by the tool, "
                               "codes counted for real weights only"}


TOOLS = {"hqq": (run_hqq, "hqq"), "gptq": (run_gptq, "llmcompressor"), "autoround": (run_autoround, "auto-round")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tool", choices=sorted(TOOLS))
    ap.add_argument("--model", type=Path, required=True, help="float model folder (Hugging Face layout)")
    ap.add_argument("--calibration", type=Path, help="safetensors file with input_ids [rows, length]")
    ap.add_argument("--bits", type=int, required=True)
    ap.add_argument("--group", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=None, help="autoround: iterations per block (default: the tool's)")
    ap.add_argument("--blocks", type=int, default=None, help="autoround: quantize only the first N blocks (timing)")
    args = ap.parse_args(argv)

    from importlib.metadata import version

    import torch
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(args.threads)
    ids = load_file(args.calibration)["input_ids"] if args.calibration else None
    if args.tool != "hqq" and ids is None:
        raise SystemExit(f"{args.tool} needs --calibration")
    fn, package = TOOLS[args.tool]
    model = load_model(args.model)
    t = time.time()
    weights, info = fn(model, args, ids)
    seconds = time.time() - t
    elems = sum(w.numel() for w in weights.values())
    # symmetric (gptq, autoround): the zero point is the fixed mid-level, not stored; hqq stores a float16 zero
    zero_bits = 16 if args.tool == "hqq" else 0
    total_bits = sum(stored_bits(*w.shape, args.bits, args.group, scale_bits=16, zero_bits=zero_bits)
                     for w in weights.values())
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "weights.safetensors.tmp"
    save_file({f"{k}.weight": v.contiguous() for k, v in weights.items()}, str(tmp))
    os.replace(tmp, args.out / "weights.safetensors")
    record = {"tool": args.tool, "package": package, "version": version(package), "torch": torch.__version__,
              "bits": args.bits, "group": args.group, "threads": args.threads, "seconds": seconds,
              "calibration": None if ids is None else list(ids.shape), "matrices": len(weights), "weights": elems,
              "stored_bits": total_bits, "bpw": total_bits / elems, "settings": info, "argv": sys.argv[1:]}
    (args.out / "peer.json.tmp").write_text(json.dumps(record, indent=1, default=str))
    os.replace(args.out / "peer.json.tmp", args.out / "peer.json")
    print(f"{args.tool} {args.bits}b g{args.group}: {len(weights)} matrices, {record['bpw']:.4f} bpw, {seconds:.0f} s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
