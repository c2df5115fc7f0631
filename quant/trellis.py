"""Trellis encoding (docs/format.md §7): Viterbi search inside block LDLQ.

A tile of 16×16 rotated weights is one circular walk of 256 states through the bitshift trellis;
each state's computed code value times the row's scale stands for one weight. `encode_tiles` finds,
per tile, the walk of least weighted squared error (the C++ Viterbi of cuda_ext/csrc/trellis_encode.cpp;
`viterbi_reference` is its plain-NumPy reference). `ldlq` quantizes a matrix 16 input columns at a
time (one tile column for all rows) and feeds each strip's error forward through the Cholesky factor
of H⁻¹, as GPTQ does for scalar codes one column at a time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from exl import format as F
from exl.format import TILE, TILE_WEIGHTS, TrellisMeta

CODE_SIGMA = 147.8  # standard deviation of code 1's values over all states (≈ √(4·(256²−1)/12))
WINDOW = 0  # steps each side of the wrap point in the first (overlap-finding) pass; 0: 8·L/K


def tables(meta: TrellisMeta) -> torch.Tensor | None:
    """The `tcode` tables the quantizer writes for this code (None for a computed code)."""
    return F.two_table_default(meta.code) if meta.code in F.TWO_TABLE_CODES else None


@functools.lru_cache(maxsize=64)
def codebook(meta: TrellisMeta) -> torch.Tensor:
    """float32 [2^L]: the code value of every state (what the decoder computes)."""
    return F.trellis_codebook(meta, tables(meta)).to(torch.float32).contiguous()


@functools.lru_cache(maxsize=64)
def code_sigma(meta: TrellisMeta) -> float:
    """Standard deviation of the code's values over all states (147.8 for code 1, ≈ 67.5 for code 2)."""
    return float(codebook(meta).double().std())


# ---------------------------------------------------------------------------------------------
# Viterbi


def viterbi_reference(x: np.ndarray, c: np.ndarray, vals: np.ndarray, k: int, state_bits: int,
                      overlap: int | None = None) -> tuple[np.ndarray, float]:
    """The least Σ c_t (x_t − vals[s_t])² over walks s_0 … s_{T−1} of the trellis, in plain NumPy (float64).

    overlap None: free start and end. Else s_0 & (2^(L−K) − 1) == overlap == s_{T−1} >> K (a circular walk).
    Returns (states int64 [T], cost).
    """
    L, T = state_bits, len(x)
    S, G = 2**L, 2 ** (L - k)
    s_all = np.arange(S)
    err = lambda t: c[t] * (x[t] - vals.astype(np.float64)) ** 2  # noqa: E731
    cost = err(0)
    if overlap is not None:
        cost = np.where((s_all & (G - 1)) == overlap, cost, np.inf)
    back = np.zeros((T, S), dtype=np.int64)
    for t in range(1, T):
        groups = cost.reshape(G, 2**k)  # group g: the predecessors (g << K) | c of every s' with s' & (G−1) == g
        arg = groups.argmin(1)
        best = groups[np.arange(G), arg]
        g = s_all & (G - 1)
        back[t] = (g << k) | arg[g]
        cost = best[g] + err(t)
    if overlap is not None:
        cost = np.where((s_all >> k) == overlap, cost, np.inf)
    s = int(cost.argmin())
    total = float(cost[s])
    path = np.zeros(T, dtype=np.int64)
    path[-1] = s
    for t in range(T - 1, 0, -1):
        s = int(back[t, s])
        path[t - 1] = s
    return path, total


def walk_cost(states: np.ndarray, x: np.ndarray, c: np.ndarray, vals: np.ndarray) -> float:
    return float((c * (x - vals[states].astype(np.float64)) ** 2).sum())


def _kernels():
    from cuda_ext.build import load_cpu

    return load_cpu()


def encode_tiles(x: list[torch.Tensor], c: list[torch.Tensor], metas: list[TrellisMeta], window: int = WINDOW,
                 overlaps: list[torch.Tensor] | None = None, isa: str = "auto") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per job i: the walks (int32 states [B_i, T]) and their weighted errors (float32 [B_i]) for the tiles
    x[i] (targets in code units, [B_i, T]) with error weights c[i]; circular (tail-biting) walks.
    All jobs run in one call so that every core has tiles to work on."""
    from quant.gptq import all_threads

    with all_threads():  # the quantizer runs small ops on one thread; the Viterbi splits tiles over all of them
        return _kernels().trellis_viterbi([t.float().contiguous() for t in x], [t.float().contiguous() for t in c],
                                          [codebook(m) for m in metas], [m.bits for m in metas],
                                          [m.state_bits for m in metas], window,
                                          None if overlaps is None else [o.int().contiguous() for o in overlaps], isa)


# ---------------------------------------------------------------------------------------------
# Block LDLQ


@dataclass
class Result:
    words: torch.Tensor | None  # int32 [N/16, K/16, 8·K_b]: the bit streams (None when not asked for)
    scales: torch.Tensor  # float16 [N]
    q: torch.Tensor  # float32 [N, K]: the quantized matrix (rotated coordinates)
    row_err: torch.Tensor  # float32 [N]: rows of tr(ΔW H ΔWᵀ) (through the factor, as quant.gptq)


# The scale that minimises the error on Gaussian data, as a multiple of rms(row) / CODE_SIGMA,
# per bits per weight (measured at L=12 with bench/trellis_mse.py's trellis_mse; docs/quantization.md).
SCALE_FACTOR = {1: 0.9, 2: 1.0, 3: 1.1, 4: 1.15, 5: 1.2, 6: 1.3, 7: 1.3, 8: 1.3}


def row_scales(w: torch.Tensor, meta: TrellisMeta) -> torch.Tensor:
    """float16-exact per-row scales (as float32) for rows of W [N, K]."""
    rms = w.float().pow(2).mean(1).sqrt()
    return (rms * SCALE_FACTOR[meta.bits] / code_sigma(meta)).clamp(2.0**-24, 65504.0).half().float()


def _tiles(x: torch.Tensor, layout: int) -> torch.Tensor:
    """Strip [N, 16] -> tiles [N/16, 256] in the tile's walk order (docs/format.md §7.2)."""
    return F.trellis_matrix_to_tiles(x, layout).reshape(x.shape[0] // TILE, TILE_WEIGHTS)


def _strip(t: torch.Tensor, layout: int) -> torch.Tensor:
    """Inverse of _tiles."""
    return F.trellis_tiles_to_matrix(t.reshape(t.shape[0], 1, TILE_WEIGHTS), layout)


@torch.no_grad()
def ldlq(w: torch.Tensor, u: torch.Tensor, metas: list[TrellisMeta], window: int = WINDOW,
         scales: list[torch.Tensor] | None = None, refit: bool = True, want_words: bool = True,
         passes: int = 0, row_weights: torch.Tensor | None = None) -> list[Result]:
    """Quantize W [N, K] (rotated; N, K multiples of 16) once per meta, with error feedback through u
    (upper Cholesky factor of H⁻¹, [K, K]; the identity gives plain per-tile Viterbi).

    Strip j (columns 16j … 16j+15) is encoded jointly by Viterbi on targets already corrected for the
    errors of the strips before it; its error E is fed forward as W[:, rest] −= E U_jj⁻¹ U_j,rest (block
    LDLQ). Within a strip the columns are weighted by diag((U_jjᵀ U_jj)⁻¹), each row by its scale².
    scales: the rows' starting scales per meta (default `row_scales`). refit: afterwards, refit each row's
    scale to its chosen codes in the Hessian metric (`refit_scales`). want_words: pack the walks into bit
    streams; without, Result.words is None (pricing needs only the errors). passes: refinement passes
    after the first (`refine`). row_weights: [N] each row's weight in the walks' cost (e.g. its Fisher
    sensitivity, so a walk puts its error on the rows that matter least); the reported errors stay unweighted.
    """
    n, k = w.shape
    if n % TILE or k % TILE:
        raise ValueError(f"a trellis-coded matrix needs N and K multiples of {TILE}, got {n}x{k}")
    u = u.to(w.device, torch.float32)
    dev = w.device
    rw = torch.ones(n, device=dev) if row_weights is None else row_weights.to(dev, torch.float32)
    works = [w.float().clone() for _ in metas]
    if scales is None:
        scales = [row_scales(w, m) for m in metas]
    scales = [sc.to(dev, torch.float32) for sc in scales]
    qs = [torch.empty(n, k, dtype=torch.float32, device=dev) for _ in metas]
    words = [torch.empty(n // TILE, k // TILE, m.words_per_tile, dtype=torch.int32) if want_words else None
             for m in metas]
    loss = [torch.zeros(n, dtype=torch.float32, device=dev) for _ in metas]
    vals = [codebook(m).to(dev) for m in metas]
    for j in range(k // TILE):
        b0, b1 = j * TILE, (j + 1) * TILE
        ujj = u[b0:b1, b0:b1]
        uinv = torch.linalg.solve_triangular(ujj, torch.eye(TILE, device=dev), upper=True)
        colw = (uinv @ uinv.T).diagonal()  # diag((UᵀU)⁻¹): the weight of each column's squared error
        xs, cs = [], []
        for i in range(len(metas)):
            s = scales[i]
            lay = metas[i].version
            xs.append(_tiles(works[i][:, b0:b1] / s[:, None], lay).cpu())
            cs.append(_tiles((rw * s * s)[:, None] * colw[None, :], lay).cpu())
        out = encode_tiles(xs, cs, metas, window)
        for i, (m, (states, _)) in enumerate(zip(metas, out)):
            if want_words:
                words[i][:, j] = F.trellis_pack(states, m)
            q = _strip(vals[i][states.long().to(dev)], m.version) * scales[i][:, None]
            qs[i][:, b0:b1] = q
            e = (works[i][:, b0:b1] - q) @ uinv  # [N, 16]: the strip's error through the factor
            loss[i] += (e * e).sum(1)
            if b1 < k:
                works[i][:, b1:].addmm_(e, u[b0:b1, b1:], alpha=-1.0)
    if passes:
        loss = refine(w.float(), u, qs, words, scales, metas, passes, window, rw)
    out = []
    for wd, s, q, le in zip(words, scales, qs, loss):
        if refit:
            s, q, le = refit_scales(w.float(), q, s, u, le)
        out.append(Result(wd, s.half(), q, le))
    return out


@torch.no_grad()
def refine(w: torch.Tensor, u: torch.Tensor, qs: list[torch.Tensor], words: list[torch.Tensor | None],
           scales: list[torch.Tensor], metas: list[TrellisMeta], passes: int, window: int = WINDOW,
           row_weights: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Lower the error of block LDLQ's result in place by Gauss-Seidel passes over the strips.

    LDLQ encodes strip j knowing only the strips before it. With every other strip fixed, the error
    tr(ΔW H ΔWᵀ) is a quadratic in strip j's values Q_j, least at T_j = W_j + ΔW_¬j H_¬j,j H_jj⁻¹ (ΔW = W − Q,
    H = (UᵀU)⁻¹ the damped Hessian that U factors): a pass encodes every strip again against that target
    (columns weighted by diag H_jj) and keeps a tile's new walk only where it lowers that quadratic, so the
    error never grows (with row_weights, the rows' weighted sum). Returns each meta's rows of the exact
    error ‖ΔW U⁻¹‖², for `refit_scales`."""
    n, k = w.shape
    dev = w.device
    rw = torch.ones(n, device=dev) if row_weights is None else row_weights.to(dev, torch.float32)
    uinv = torch.linalg.solve_triangular(u, torch.eye(k, device=dev), upper=True)
    h = uinv @ uinv.T
    vals = [codebook(m).to(dev) for m in metas]
    for _ in range(passes):
        for j in range(k // TILE):
            b0, b1 = j * TILE, (j + 1) * TILE
            hjj = h[b0:b1, b0:b1]
            xs, cs, gs = [], [], []
            for q, s, m in zip(qs, scales, metas):
                d = w - q
                g = d @ h[:, b0:b1] - d[:, b0:b1] @ hjj  # ΔW_¬j H_¬j,j
                gs.append(g)
                target = w[:, b0:b1] + torch.linalg.solve(hjj, g.T).T
                xs.append(_tiles(target / s[:, None], m.version).cpu())
                cs.append(_tiles((rw * s * s)[:, None] * hjj.diagonal()[None, :], m.version).cpu())
            out = encode_tiles(xs, cs, metas, window)
            for i, (m, (states, _)) in enumerate(zip(metas, out)):
                new = _strip(vals[i][states.long().to(dev)], m.version) * scales[i][:, None]
                old = qs[i][:, b0:b1]

                def quadratic(qj):  # per row, up to a constant: Δ_j H_jj Δ_jᵀ + 2 Δ_j (ΔW_¬j H_¬j,j)ᵀ
                    dj = w[:, b0:b1] - qj
                    return ((dj @ hjj) * dj).sum(1) + 2 * (dj * gs[i]).sum(1)

                better = ((quadratic(new) - quadratic(old)) * rw).view(n // TILE, TILE).sum(1) < 0  # per tile
                qs[i][:, b0:b1] = torch.where(better.repeat_interleave(TILE)[:, None], new, old)
                if words[i] is not None:
                    words[i][:, j] = torch.where(better.cpu()[:, None], F.trellis_pack(states, m), words[i][:, j])
    return [((torch.linalg.solve_triangular(u, w - q, upper=True, left=False)) ** 2).sum(1) for q in qs]


@torch.no_grad()
def refit_scales(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, u: torch.Tensor, row_err: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Refit each row's scale to its chosen code values V = Q / s by least squares in the Hessian metric:
    s' = (w H vᵀ) / (v H vᵀ) with H = (UᵀU)⁻¹, rounded to float16; a row keeps its old scale unless the
    new one lowers its error. Returns (scales, Q, row errors), the errors exactly tr(ΔW H ΔWᵀ) per row."""
    n = w.shape[0]
    v = q / s[:, None]
    # rows of X U⁻¹ for X = W and V: ‖x U⁻¹‖² = x H xᵀ
    y = torch.linalg.solve_triangular(u, torch.cat([w, v]), upper=True, left=False).double()
    yw, yv = y[:n], y[n:]
    den = (yv * yv).sum(1)
    s_new = torch.where(den > 0, (yw * yv).sum(1) / den.clamp_min(1e-300), s.double())
    s_new = s_new.clamp(2.0**-24, 65504.0).half().float()
    err_new = ((yw - s_new.double()[:, None] * yv) ** 2).sum(1).float()
    better = err_new < row_err
    s = torch.where(better, s_new, s)
    return s, v * s[:, None], torch.where(better, err_new, row_err)
