"""One linear layer: price every candidate setting (measurement), or quantize it under one.

Error model. With H = Σ_t x_t x_tᵀ over T calibration tokens and f_n the mean squared gradient of the
model's log-likelihood with respect to output channel n (the diagonal output Fisher, from
`quant.fisher`), quantizing W to W + ΔW raises the mean KL-divergence of the model's next-token
distribution by about

    ΔKL ≈ ½ Σ_n f_n (ΔW H ΔWᵀ)_nn / T.

GPTQ returns (ΔW H ΔWᵀ)_nn for each row in its own coordinates; with an output rotation the rows are
mixed inside Hadamard blocks, so f is averaged over each block there.

A trellis walk covers the 16 rows of a tile, so its Viterbi trades error between rows: trellis matrices
are rotated on the input side only (format version 3, docs/format.md §7.4) and each row's cost in the
walk is weighted by f_n, which puts the error on the rows the model is least sensitive to.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from exl import format as F
from exl.format import hadamard_block
from quant import trellis as TR
from quant.candidates import Setting, TrellisSetting, candidates, parse_setting, storage_bits, trellis_candidates, trellis_storage_bits
from quant.hadamard import fwht
from quant.gptq import ALPHAS, HessianError, gptq, inverse_cholesky, one_thread
from quant.options import QuantOptions
from quant.pack import layer_tensors
from quant.transform import Transform, prepare

log = logging.getLogger("exl.quant")

REFERENCE = Setting(3, 64)  # the setting that decides each matrix's transform under transform=auto
TRELLIS_TRANSFORM = Transform(True, False, False)  # trellis layers: input side rotated, Fisher-weighted walks (§7.4)
# what a trellis choice may carry: the default, or both sides (measurements made before format version 3)
TRELLIS_TRANSFORMS = (TRELLIS_TRANSFORM, Transform(True, True, False))
WALK_WEIGHT_FLOOR = 1e-3  # a row's walk weight is at least this x the matrix's mean Fisher (never ignored)
AUTO_TRANSFORMS = (Transform(True, False, True), Transform(True, True, True), Transform(False, False, True),
                   Transform(False, True, True))


def row_weights(f: torch.Tensor, t: Transform) -> torch.Tensor:
    """Fisher weight of each row in the quantizer's coordinates."""
    if t.sv:
        b = hadamard_block(f.numel())
        f = f.view(-1, b).mean(1, keepdim=True).expand(-1, b).reshape(-1)
    return f


def walk_weights(f: torch.Tensor | None, t: Transform) -> torch.Tensor | None:
    """Each row's weight in a trellis walk's cost: its Fisher weight in the quantizer's coordinates, floored
    (WALK_WEIGHT_FLOOR) so that no row's error is free; None without a Fisher."""
    if f is None:
        return None
    f = row_weights(f.float(), t)
    return f.clamp_min(WALK_WEIGHT_FLOOR * float(f.mean()) + 1e-30)


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
    with one_thread(w.device):  # many small factorizations: threads only add hand-off latency
        return _measure(name, w, h, tokens, fisher, options, seed)


def _measure(name, w, h, tokens, fisher, options, seed) -> dict:
    n, k = w.shape
    fixed = parse_setting(options.fixed) if options.fixed else None
    trellis = []
    if options.codes != "scalar" and not isinstance(fixed, Setting):
        trellis = _measure_trellis(name, w, h, tokens, fisher, options, seed, fixed)
    if trellis and (options.codes == "trellis" or fixed is not None):  # a matrix that can be trellis-coded
        return {"name": name, "shape": [n, k], "transform": TRELLIS_TRANSFORM.name, "tokens": tokens,
                "candidates": trellis}
    rows = _subset(n, options.measure_rows, w.device)
    best, factored = None, {}
    for t in transform_options(options):  # the transform with the lowest error at the reference setting
        key = (t.su, t.perm)  # transforms differing only in sv share the rotated Hessian and its factor
        if key in factored:
            p0, u, damp = factored[key]
            p = prepare(w, h, t, seed, name, h_from=p0)
        else:
            p = prepare(w, h, t, seed, name)
            u, damp = factor(p.h, options)
            factored[key] = (p, u, damp)
        fw = row_weights(fisher, t)
        r = gptq(p.w[rows], u, [REFERENCE.segments(k)], alphas(options), want_codes=False)[0]
        err = float((r.row_err * fw[rows]).sum())
        if best is None or err < best[0]:
            best = (err, t, p, u, damp, fw)
    _, t, p, u, damp, fw = best
    settings = [fixed] if isinstance(fixed, Setting) else candidates(k, options.mixes)
    results = gptq(p.w[rows], u, [s.segments(k) for s in settings], alphas(options), want_codes=False)
    wf, frows = fw[rows], fw.sum() / fw[rows].sum().clamp_min(1e-30)
    wr = p.w[rows].to(p.h.dtype)
    base = ((wr @ p.h) * wr).sum(1).double()  # (W H Wᵀ)_nn
    out = []
    for s, r in zip(settings, results):
        kl = 0.5 * float((r.row_err * wf).sum() * frows) / max(tokens, 1)
        out.append({"setting": s.name, "bits": storage_bits(n, k, s.segments(k), t.perm, t.su, t.sv),
                    "kl": kl, "rel": float(r.row_err.sum() / base.sum().clamp_min(1e-30))})
    return {"name": name, "shape": [n, k], "transform": t.name, "damp": damp, "tokens": tokens,
            "candidates": out + trellis}


def _tile_rows(n: int, rows: int, device) -> torch.Tensor:
    """Rows of evenly spaced whole 16-row tiles, about `rows` of them (the same on every run)."""
    tiles = _subset(n // F.TILE, max(1, rows // F.TILE), device)
    return (tiles[:, None] * F.TILE + torch.arange(F.TILE, device=device)).flatten()


def _measure_trellis(name, w, h, tokens, fisher, options, seed, fixed=None) -> list[dict]:
    """Trellis candidates (each with its transform, TRELLIS_TRANSFORM), priced like the scalar ones: block LDLQ
    on whole tiles of evenly spaced rows with Fisher-weighted walks, all settings in one batched run, errors
    scaled to all rows."""
    n, k = w.shape
    settings = trellis_candidates(n, k, options.trellis_widths, options.state_bits)
    if fixed is not None:
        settings = [fixed] if trellis_candidates(n, k) else []
    if not settings:
        return []
    t = TRELLIS_TRANSFORM
    p = prepare(w, h, t, seed, name)
    u, _ = factor(p.h, options)
    rows = _tile_rows(n, options.measure_rows, w.device)
    results = TR.ldlq(p.w[rows], u, [s.meta() for s in settings], want_words=False,
                      row_weights=walk_weights(fisher, t)[rows])
    fw = row_weights(fisher, t)
    wf, frows = fw[rows], fw.sum() / fw[rows].sum().clamp_min(1e-30)
    wr = p.w[rows].to(p.h.dtype)
    base = ((wr @ p.h) * wr).sum(1).double()
    out = []
    for s, r in zip(settings, results):
        kl = 0.5 * float((r.row_err.to(wf.device) * wf).sum() * frows) / max(tokens, 1)
        out.append({"setting": s.name, "bits": trellis_storage_bits(n, k, s.bits, s.code, t.sv), "kl": kl,
                    "rel": float(r.row_err.sum() / base.sum().clamp_min(1e-30)), "transform": t.name})
    return out


@dataclass
class Quantized:
    tensors: dict[str, torch.Tensor]
    weight: torch.Tensor  # the dequantized W [N, K], float32, on the input's device
    rel: float  # tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)
    kl: float  # predicted ΔKL (needs the Fisher; 0 without)
    bits: int


@torch.no_grad()
def quantize(name: str, w: torch.Tensor, h: torch.Tensor, setting: Setting | TrellisSetting, transform: Transform,
             options: QuantOptions, seed: int, bias: torch.Tensor | None = None,
             fisher: torch.Tensor | None = None, tokens: int = 1) -> Quantized:
    """Quantize W [N, K] under one setting: the format's tensors and the matrix they stand for. A trellis
    setting takes `transform` if it is one of TRELLIS_TRANSFORMS (what its measurement priced), else
    TRELLIS_TRANSFORM; with `fisher`, its walks weight each row by it (`walk_weights`)."""
    with one_thread(w.device):
        return _quantize(name, w, h, setting, transform, options, seed, bias, fisher, tokens)


def _quantize(name, w, h, setting, transform, options, seed, bias, fisher, tokens) -> Quantized:
    n, k = w.shape
    if isinstance(setting, TrellisSetting):
        tt = transform if transform in TRELLIS_TRANSFORMS else TRELLIS_TRANSFORM
        p = prepare(w, h, tt, seed, name)
        u, _ = factor(p.h, options)
        r = TR.ldlq(p.w, u, [setting.meta()], passes=options.trellis_passes, row_weights=walk_weights(fisher, tt))[0]
        t = trellis_tensors(p, r, setting, bias)
        wq = unrotate(p, r.q.to(w.device))
        bits = trellis_storage_bits(n, k, setting.bits, setting.code, tt.sv)
    else:
        p = prepare(w, h, transform, seed, name)
        u, _ = factor(p.h, options)
        segments = setting.segments(k)
        r = gptq(p.w, u, [segments], alphas(options))[0]
        t = layer_tensors(p, r, segments, bias)
        wq = unrotate(p, F.dequantize_codes(r.codes, r.scales, segments, torch.float32).to(w.device))
        bits = storage_bits(n, k, segments, transform.perm, transform.su, transform.sv)
    w32, h32 = w.float(), h.to(w.device, torch.float32)
    both = torch.cat([wq - w32, w32])
    energy = ((both @ h32) * both).sum(1).double()  # rows of ΔW H ΔWᵀ, then of W H Wᵀ
    err, base = energy[:n], energy[n:]
    kl = 0.0
    if fisher is not None:
        kl = 0.5 * float((err * fisher.double().to(err.device)).sum()) / max(tokens, 1)
    return Quantized(t, wq, float(err.sum() / base.sum().clamp_min(1e-30)), kl, bits)


def trellis_tensors(p, r: TR.Result, setting: TrellisSetting, bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """trellis/tscale/tmeta/su (+ sv if rotated on the output side, + bias) of a trellis-coded layer
    (docs/format.md §7.1), on the CPU."""
    t = {"trellis": r.words.cpu().contiguous(), "tscale": r.scales.cpu().to(torch.float16).contiguous(),
         "tmeta": setting.meta().to_tensor(), "su": F.pack_signs(p.su.cpu())}
    if p.sv is not None:
        t["sv"] = F.pack_signs(p.sv.cpu())
    if setting.code in F.TWO_TABLE_CODES:
        t["tcode"] = TR.tables(setting.meta())
    if bias is not None:
        t["bias"] = bias.detach().cpu().to(torch.float16)
    return t


def unrotate(p, q: torch.Tensor) -> torch.Tensor:
    """The matrix in original coordinates from Q in the quantizer's (float32 version of F.dequantize)."""
    w = torch.empty_like(q)
    if p.perm is not None:
        w[:, p.perm] = q
    else:
        w = q
    if p.su is not None:
        w = fwht(w) * p.su
    if p.sv is not None:
        w = p.sv[:, None] * fwht(w.T).T
    return w
