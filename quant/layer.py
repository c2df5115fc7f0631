"""One linear layer: price every candidate setting (measurement), or quantize it under one.

Error model. With H = Σ_t x_t x_tᵀ over T calibration tokens and f_n the mean squared gradient of the
model's log-likelihood with respect to output channel n (the diagonal output Fisher, from
`quant.fisher`), quantizing W to W + ΔW raises the mean KL-divergence of the model's next-token
distribution by about

    ΔKL ≈ ½ Σ_n f_n (ΔW H ΔWᵀ)_nn / T.

GPTQ returns (ΔW H ΔWᵀ)_nn for each row in its own coordinates; with an output rotation the rows are
mixed inside Hadamard blocks, so f is averaged over each block there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from exl.format import hadamard_block
from quant.candidates import Setting, candidates, storage_bits
from quant.gptq import ALPHAS, HessianError, gptq, inverse_cholesky
from quant.options import QuantOptions
from quant.pack import dequantized, layer_tensors
from quant.transform import Transform, prepare

log = logging.getLogger("exl.quant")

REFERENCE = Setting(3, 64)  # the setting that decides each matrix's transform under transform=auto
AUTO_TRANSFORMS = (Transform(True, False, True), Transform(False, False, True), Transform(True, True, True))


def row_weights(f: torch.Tensor, t: Transform) -> torch.Tensor:
    """Fisher weight of each row in the quantizer's coordinates."""
    if t.sv:
        b = hadamard_block(f.numel())
        f = f.view(-1, b).mean(1, keepdim=True).expand(-1, b).reshape(-1)
    return f


def factor(h: torch.Tensor, options: QuantOptions) -> tuple[torch.Tensor, float]:
    """U for GPTQ (identity for round-to-nearest); falls back to round-to-nearest if H is hopeless."""
    k = h.shape[0]
    if options.method == "rtn":
        return torch.eye(k, dtype=torch.float32, device=h.device), 0.0
    try:
        return inverse_cholesky(h, options.damp)
    except HessianError as e:
        log.warning("%s; using round-to-nearest for this layer", e)
        return torch.eye(k, dtype=torch.float32, device=h.device), float("inf")


def alphas(options: QuantOptions):
    return ALPHAS if options.scale_search else (1.0,)


def transform_options(options: QuantOptions) -> list[Transform]:
    return list(AUTO_TRANSFORMS) if options.transform == "auto" else [Transform.parse(options.transform)]


def _subset(n: int, rows: int, device) -> torch.Tensor:
    """Evenly spaced rows (the same on every run)."""
    if rows >= n:
        return torch.arange(n, device=device)
    return torch.linspace(0, n - 1, rows, device=device).round().long()


@torch.no_grad()
def measure(name: str, w: torch.Tensor, h: torch.Tensor, tokens: int, fisher: torch.Tensor,
            options: QuantOptions, seed: int) -> dict:
    """Predicted ΔKL and exact storage bits of every candidate setting for W [N, K] with Hessian H."""
    n, k = w.shape
    rows = _subset(n, options.measure_rows, w.device)
    best = None
    for t in transform_options(options):  # the transform with the lowest error at the reference setting
        p = prepare(w, h, t, seed, name)
        u, damp = factor(p.h, options)
        fw = row_weights(fisher, t)
        r = gptq(p.w[rows], u, [REFERENCE.segments(k)], alphas(options), want_codes=False)[0]
        err = float((r.row_err * fw[rows]).sum())
        if best is None or err < best[0]:
            best = (err, t, p, u, damp, fw)
    _, t, p, u, damp, fw = best
    settings = [Setting.parse(options.fixed)] if options.fixed else candidates(k, options.mixes)
    results = gptq(p.w[rows], u, [s.segments(k) for s in settings], alphas(options), want_codes=False)
    wf, frows = fw[rows], fw.sum() / fw[rows].sum().clamp_min(1e-30)
    base = (p.w[rows].double() @ p.h.to(p.w.device) * p.w[rows].double()).sum(1)  # (W H Wᵀ)_nn
    out = []
    for s, r in zip(settings, results):
        kl = 0.5 * float((r.row_err * wf).sum() * frows) / max(tokens, 1)
        out.append({"setting": s.name, "bits": storage_bits(n, k, s.segments(k), t.perm, t.su, t.sv),
                    "kl": kl, "rel": float(r.row_err.sum() / base.sum().clamp_min(1e-30))})
    return {"name": name, "shape": [n, k], "transform": t.name, "damp": damp, "tokens": tokens, "candidates": out}


@dataclass
class Quantized:
    tensors: dict[str, torch.Tensor]
    weight: torch.Tensor  # the dequantized W [N, K], float32, on the input's device
    rel: float  # tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)
    kl: float  # predicted ΔKL (needs the Fisher; 0 without)
    bits: int


@torch.no_grad()
def quantize(name: str, w: torch.Tensor, h: torch.Tensor, setting: Setting, transform: Transform,
             options: QuantOptions, seed: int, bias: torch.Tensor | None = None,
             fisher: torch.Tensor | None = None, tokens: int = 1) -> Quantized:
    """Quantize W [N, K] under one setting: the format's tensors and the matrix they stand for."""
    n, k = w.shape
    p = prepare(w, h, transform, seed, name)
    u, _ = factor(p.h, options)
    segments = setting.segments(k)
    r = gptq(p.w, u, [segments], alphas(options))[0]
    t = layer_tensors(p, r, segments, bias)
    wq = dequantized(t).to(w.device)
    dw = (wq - w.float()).double()
    hd = h.to(dw.device, torch.float64)
    num = float(((dw @ hd) * dw).sum())
    den = float(((w.double() @ hd) * w.double()).sum())
    kl = 0.0
    if fisher is not None:
        kl = 0.5 * float((((dw @ hd) * dw).sum(1) * fisher.double().to(dw.device)).sum()) / max(tokens, 1)
    bits = storage_bits(n, k, segments, transform.perm, transform.su, transform.sv)
    return Quantized(t, wq, num / max(den, 1e-30), kl, bits)
