"""End-to-end tuning of the floats the codes leave free (`convert.py --tune N`, docs/quantization.md "Tuning").

After every matrix is encoded, two kinds of stored values are still plain floats: each trellis layer's row
scales (`tscale`, one per output channel) and every RMSNorm weight (which, in front of q/k/v and gate/up, acts
as a per-input-channel scale of those matrices). This stage moves them, and nothing else, by Adam to minimise
the mean KL(original ‖ quantized) of the next-token distributions: N steps of 2 calibration rows each (2N rows,
each seen once; more rows than the Hessians use, since the model is free to fit what it sees). The codes,
scalar layers, the embedding and the head stay as quantized, so the format and bits per weight do not change.
A row scale moves multiplicatively (s0 · (1 + d), d from 0), a norm weight additively.

Memory: the whole model in float32 on the conversion device (the other stages hold one block), plus the
original model's final hidden states of the 2N rows, plus what backward keeps of each block's forward. Where
those activations do not fit (`memory_plan`), each block's forward is recomputed in backward (per-block
checkpointing: one block's activations at a time, one more forward a step). The stage is resumable as a whole
(`tune.safetensors`).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from exl import format as F
from exl.modules.linear import Linear
from quant.model_parts import SourceModel
from quant.passes import no_cache, quantized_head
from quant.workdir import WorkDir

LR = 1e-3  # Adam's step at 3 bits and below; 3e-3 overfits the calibration text (held-out KLD +10%, SmolLM2 3.0 bpw)
LR_BITS = 3  # above it the step halves per bit: the corrections a scale needs shrink with the error, ~2^-K
BATCH = 2  # calibration rows per step
HEADROOM = 0.9  # the share of the device's free memory the stage may plan to use
OVERHEAD, BASE = 1.1, 0.75 * 2**30  # peak = OVERHEAD x counted tensors + BASE bytes, fitted on SmolLM2 (2 x 512
# tokens, CPU): peak RSS 4.13 GiB with every block's activations (3.35 counted), 2.88 GiB recomputing (1.97 counted)

log = logging.getLogger("exl.quant")


class TuneMemoryError(MemoryError):
    """The tuning stage does not fit the conversion device's memory, even recomputing each block."""


def memory_need(src: SourceModel, steps: int, length: int, recompute: bool) -> int:
    """Bytes the tuning stage holds at its peak, about: the decoder in float32, the embedding and both heads, the
    original final states of the 2·steps rows, the logits of one step, and the activations backward keeps (every
    block's, or with `recompute` one block's plus each block's input)."""
    c = src.config
    decoder = sum(math.prod(src.loader.info(k)[0]) for k in src.loader.keys() if k.startswith("model.layers."))
    tables = 3 * c.vocab_size * c.hidden_size  # embedding, original head, quantized head (dense)
    targets = BATCH * steps * length * c.hidden_size
    tokens = BATCH * length
    ffn = (c.num_experts_per_tok * c.moe_intermediate_size + c.shared_expert_intermediate_size
           if c.num_experts else c.intermediate_size)
    block = tokens * (12 * c.hidden_size + 4 * ffn)  # saved for backward: a dense SmolLM2 block keeps ~8k floats a
    # token (7h + 2.6i); ScaledCodes also keep each product x Vᵀ for its scale's gradient (another ~3h + 2i)
    acts = block + c.num_layers * tokens * c.hidden_size if recompute else c.num_layers * block
    return int(OVERHEAD * 4 * (decoder + tables + targets + 6 * tokens * c.vocab_size + acts) + BASE)


def free_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device, or the host's available memory (Linux); None where unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def memory_plan(src: SourceModel, steps: int, length: int) -> bool:
    """Whether to recompute each block in backward: False when the whole model's activations fit the device's
    free memory, True when only one block's do. Raises TuneMemoryError when neither fits."""
    free = free_bytes(src.device)
    whole = memory_need(src, steps, length, recompute=False)
    if free is None or whole <= HEADROOM * free:
        return False
    least = memory_need(src, steps, length, recompute=True)
    if least <= HEADROOM * free:
        log.info("tuning recomputes each block in backward: the whole model's activations need %.1f GiB, %.1f GiB "
                 "free on %s", whole / 2**30, free / 2**30, src.device)
        return True
    raise TuneMemoryError(f"tuning needs about {least / 2**30:.1f} GiB on {src.device} (the float32 model and one "
                          f"block's activations at a time) but {free / 2**30:.1f} GiB are free")


def step_size(bits: float) -> float:
    """Adam's step for values next to codes of `bits` bits per weight: LR up to LR_BITS, halved per bit above."""
    return LR * 2.0 ** -max(0.0, bits - LR_BITS)


class ScaledCodes(nn.Module):
    """A trellis layer as its decoded codes V (dense, frozen) times trainable row scales: y = (x Vᵀ) ⊙ s0 (1 + d)."""

    def __init__(self, tensors: dict[str, torch.Tensor], device):
        super().__init__()
        s0 = tensors["tscale"].to(device, torch.float32)
        w = F.dequantize({k: v.to(device) for k, v in tensors.items()}, torch.float32)  # no sv: rows are outputs
        self.register_buffer("codes", w / torch.where(s0 == 0, 1.0, s0)[:, None])
        self.register_buffer("s0", s0)
        self.register_buffer("bias", tensors["bias"].to(device, torch.float32) if "bias" in tensors else None)
        self.d = nn.Parameter(torch.zeros_like(s0))
        self.bits = F.TrellisMeta.from_tensor(tensors["tmeta"]).bits

    def scale(self) -> torch.Tensor:
        return self.s0 * (1 + self.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.codes) * self.scale()
        return y if self.bias is None else y + self.bias


def _tunable(tensors: dict[str, torch.Tensor]) -> bool:
    return F.is_trellis(tensors) and "sv" not in tensors


def _student_block(src: SourceModel, wd: WorkDir, i: int, scaled: dict, norms: dict) -> nn.Module:
    """Block i with its quantized layers dense (trellis ones as ScaledCodes) and its norms trainable."""
    q = wd.load_tensors(f"quant/block_{i:03d}.safetensors", src.device)
    block, refs, block_norms = src.tunable_block(i, unread=frozenset(k.rsplit(".", 1)[0] for k in q))
    for p in block.parameters():
        p.requires_grad_(False)
    for ref in refs:
        t = {s: q[f"{ref.name}.{s}"] for s in F.QUANT_SUFFIXES + F.TRELLIS_SUFFIXES + ("bias",)
             if f"{ref.name}.{s}" in q}
        if not t:
            continue  # not quantized (kept dense)
        if _tunable(t):
            m = scaled[ref.name] = ScaledCodes(t, src.device)
        else:
            m = Linear(F.dequantize(t, torch.float32), t["bias"].float() if "bias" in t else None)
        setattr(ref.parent, ref.attr, m)
    norms.update(block_norms)
    return block


def tune_pass(src: SourceModel, wd: WorkDir, rows: torch.Tensor, steps: int, head: dict,
              progress: bool = True) -> dict[str, torch.Tensor]:
    """Tuned `tscale` of every one-sided trellis layer and every RMSNorm weight, by checkpoint name (see module doc).
    rows: [2·steps, T] calibration token ids. head: the quantization pass's head record (its `head` is None when the
    head stays unquantized). The norms come back as the weights the checkpoint stores (Gemma's offset kept)."""
    if wd.exists("tune.safetensors"):
        return wd.load_tensors("tune.safetensors")
    recompute = memory_plan(src, steps, rows.shape[1])
    dev, n = src.device, src.num_layers
    rows = rows.to(dev)
    with torch.inference_mode():  # the original model's final hidden states, one block in memory at a time
        h = src.embed(rows)
        for i in tqdm(range(n), desc="tune: original", unit="block", disable=not progress, dynamic_ncols=True):
            h = src.block(i)[0](h, no_cache(h))
    target_h = h.clone()
    target_norm, target_head = src.final_norm(), src.head_weight()
    del h

    scaled: dict[str, ScaledCodes] = {}
    norms: dict[str, nn.Module] = {}
    blocks = [_student_block(src, wd, i, scaled, norms) for i in range(n)]
    final = norms["model.norm.weight"] = src.final_norm()
    if head["head"] is not None:
        head_w = F.dequantize(quantized_head(wd, dev), torch.float32)
    else:
        head_w = target_head
    start = {name: m.weight.detach().clone() for name, m in norms.items()}
    for m in norms.values():
        m.weight.requires_grad_(True)
    codes = list(scaled.values())  # each row scale steps by its layer's K; the norms by the numel-weighted mean K
    mean_bits = (sum(m.bits * m.codes.numel() for m in codes) / sum(m.codes.numel() for m in codes)) if codes else 0
    opt = torch.optim.Adam([{"params": [m.d], "lr": step_size(m.bits)} for m in codes]
                           + [{"params": [m.weight for m in norms.values()], "lr": step_size(mean_bits)}])
    embed_table = src.model.build_embedding(src.model.builder)

    bar = tqdm(range(steps), desc="tune", unit="step", disable=not progress, dynamic_ncols=True)
    for step in bar:
        sel = slice(step * BATCH, (step + 1) * BATCH)
        with torch.no_grad():
            target = torch.log_softmax(src.logits(target_h[sel], target_norm, target_head), -1)
        with torch.enable_grad():
            h = src.model.embed(rows[sel], embed_table)
            for b in blocks:
                h = checkpoint(b, h, no_cache(h), use_reentrant=False) if recompute else b(h, no_cache(h))
            out = torch.log_softmax(src.logits(h, final, head_w), -1)
            kl = (target.exp() * (target - out)).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            kl.backward()
            opt.step()
        bar.set_postfix(kl=f"{kl.item():.4f}")

    stored = {}
    for name, m in scaled.items():
        stored[f"{name}.tscale"] = m.scale().detach().to("cpu", torch.float16)
    for name, m in norms.items():  # what the checkpoint stores, moved by what the weight moved
        stored[name] = (src.loader.get(name, torch.float32, device="cpu")
                        + (m.weight.detach() - start[name]).cpu())
    wd.save_tensors("tune.safetensors", stored)
    return stored
