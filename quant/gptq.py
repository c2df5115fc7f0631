"""Hessian-aware rounding with error feedback (GPTQ, equivalently LDLQ) on the format's grid.

The grid is centred and symmetric, `w = s * (q - (2^b - 1) / 2)` with one float16 scale per group
(docs/format.md §1.2). Columns are processed in the order given (the caller permutes for act-order);
the rounding error of each column is spread over the columns not yet quantized through the upper
Cholesky factor U of H⁻¹, in lazy blocks of 32 columns. At the first column of each group the scale
is searched: the clipping factor that minimises the Hessian-weighted rounding error of the group.

`gptq` quantizes one matrix under many settings at once: the matrix is repeated once per setting
and each copy follows its own bit widths and group sizes. Rows are independent in GPTQ, so this is
exact, and it is how the measurement prices ~50 candidate settings per matrix in one pass.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from exl.format import BLOCK, Segment

# Coarse clipping factors tried for each group's scale (fraction of the max-abs scale), then refined.
ALPHAS = (0.95, 0.8, 0.65)
MIN_SCALE = 2.0**-20  # smallest scale written (an all-zero group); float16 keeps it as a subnormal


def hessian_dtype(k: int) -> torch.dtype:
    """float64 for Hessians up to 16384 inputs; float32 above (a 28672² float64 matrix is 6.6 GB, and the
    1% damping keeps float32 Cholesky factorizations stable)."""
    return torch.float64 if k <= 16384 else torch.float32


class HessianError(ValueError):
    """The Hessian cannot be factorized even after damping."""


@dataclass
class Result:
    codes: torch.Tensor  # uint8 [N, K] in the processed (permuted) column order
    scales: torch.Tensor  # float16 [N, n_groups]
    row_err: torch.Tensor  # float32 [N]: sum over columns of ((w - q) / U_jj)^2 = row of tr(ΔW H ΔWᵀ)


def inverse_cholesky(h: torch.Tensor, damp: float = 0.01, retries: int = 6) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor U of (H + δI)⁻¹ with δ = damp·mean(diag H), raising δ tenfold until it works.

    Returns (U as float32, the damping used). Dead channels (H_ii = 0) must be handled by the caller.
    """
    h = h.to(hessian_dtype(h.shape[0]))
    mean = float(h.diagonal().mean())
    if not mean > 0 or not bool(torch.isfinite(h.sum())):
        raise HessianError("the Hessian is zero or not finite")
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for _ in range(retries):
        l, info = torch.linalg.cholesky_ex(h + damp * mean * eye)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(l)
            u, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0 and bool(torch.isfinite(u.diagonal().sum())):
                return u.to(torch.float32), damp
        damp *= 10
    raise HessianError(f"the Hessian is not positive definite even with damping {damp / 10:g}")


_OUTER_THREADS: list[int] = []  # thread counts that one_thread() replaced, innermost last


@contextlib.contextmanager
def one_thread(device: torch.device):
    """Run many tiny CPU ops on one thread: thread hand-offs cost more than they save (and far more when
    the machine is busy). No effect on GPU. Large kernels inside take the threads back with all_threads()."""
    if device.type != "cpu":
        yield
        return
    n = torch.get_num_threads()
    _OUTER_THREADS.append(n)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        _OUTER_THREADS.pop()
        torch.set_num_threads(n)


@contextlib.contextmanager
def all_threads():
    """Inside one_thread(): the thread count it replaced, for one large parallel kernel (the trellis Viterbi)."""
    n, cur = (_OUTER_THREADS[-1] if _OUTER_THREADS else torch.get_num_threads()), torch.get_num_threads()
    if n != cur:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != cur:
            torch.set_num_threads(cur)


def _grid(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    maxq = (2.0**bits.to(torch.float32)) - 1
    return maxq, maxq / 2


def _group_error(w, weight, s, maxq, centre):
    """Weighted rounding error of groups w [g, R] at per-row scales s [R]."""
    t = torch.addcmul(centre, w, 1.0 / s)
    t.round_().clamp_(min=0)
    torch.minimum(t, maxq, out=t)
    t.sub_(centre).mul_(s).sub_(w).square_()
    return weight @ t


def search_scales(w: torch.Tensor, bits: torch.Tensor, weight: torch.Tensor, alphas=ALPHAS) -> torch.Tensor:
    """Per-row scale (float16-exact, as float32) for groups w [g, R] (one group per column) at `bits` [R],
    minimising sum_j weight_j (w_j - Q(w_j))^2 over clipping factors: a coarse grid `alphas`, then two
    rounds of refinement around each row's best factor."""
    maxq, centre = _grid(bits)
    base = w.abs().amax(dim=0) / centre

    def scale(a):
        return (a * base).clamp_(MIN_SCALE, 65504.0).half().float()

    best_a = torch.full_like(base, alphas[0])
    best_s = scale(best_a)
    if len(alphas) == 1:
        return best_s
    best_e = _group_error(w, weight, best_s, maxq, centre)

    def consider(a):
        s = scale(a)
        e = _group_error(w, weight, s, maxq, centre)
        better = e < best_e
        best_e[better], best_s[better], best_a[better] = e[better], s[better], a[better]

    for a in alphas[1:]:
        consider(torch.full_like(base, a))
    step = abs(alphas[1] - alphas[0]) / 2 if len(alphas) > 1 else 0.05
    for _ in range(2):
        centre_a = best_a.clone()
        consider(centre_a + step)
        consider(centre_a - step)
        step /= 2
    return best_s


def _plan(segments_list: list[list[Segment]], k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per setting and per 32-column block: bit width, and the group size starting there (0: none)."""
    nb = k // BLOCK
    bits = torch.zeros(len(segments_list), nb, dtype=torch.int64)
    start = torch.zeros(len(segments_list), nb, dtype=torch.int64)
    for c, segs in enumerate(segments_list):
        b0 = 0
        for s in segs:
            n = s.k_len // BLOCK
            bits[c, b0 : b0 + n] = s.bits
            start[c, b0 : b0 + n : s.group_size // BLOCK] = s.group_size
            b0 += n
        if b0 != nb:
            raise ValueError(f"segments cover {b0 * BLOCK} channels, the matrix has {k}")
    return bits, start


def _columns(W1, U1, scale, centre, maxq, codes) -> torch.Tensor:
    """Quantize the rows of W1 [32, R] (one column of W each) in order, in place, feeding each one's
    error forward through U1; returns the scaled errors E1 [32, R]; writes codes [32, R] if given."""
    inv = 1.0 / scale
    E1 = torch.empty_like(W1)
    q = torch.empty_like(scale)
    for i in range(W1.shape[0]):
        x = W1[i]
        torch.addcmul(centre, x, inv, out=q)
        q.round_().clamp_(min=0)
        torch.minimum(q, maxq, out=q)
        if codes is not None:
            codes[i] = q.to(torch.uint8)
        e = E1[i]
        torch.addcmul(x, scale, q - centre, value=-1.0, out=e)  # w - s (q - c)
        e.div_(U1[i, i])
        if i + 1 < W1.shape[0]:
            W1[i + 1 :].addr_(U1[i, i + 1 :], e, alpha=-1.0)
    return E1


@torch.no_grad()
def gptq(w: torch.Tensor, u: torch.Tensor, segments_list: list[list[Segment]], alphas=ALPHAS,
         want_codes: bool = True) -> list[Result]:
    """Quantize w [N, K] (columns in processing order) once per segment list, with error feedback
    through u (upper Cholesky of H⁻¹, [K, K]; the identity gives round-to-nearest)."""
    n, k = w.shape
    n_set = len(segments_list)
    dev = w.device
    bits_tab, start_tab = _plan(segments_list, k, dev)
    WT = w.to(torch.float32).T.repeat(1, n_set).contiguous()  # [K, C*N]: one column of W per row of WT
    rows = n_set * n
    codes = torch.empty(k, rows, dtype=torch.uint8, device=dev) if want_codes else None
    scale = torch.ones(rows, dtype=torch.float32, device=dev)
    scales: list[list[torch.Tensor]] = [[] for _ in range(n_set)]
    loss = torch.zeros(rows, dtype=torch.float32, device=dev)
    u = u.to(dev, torch.float32)
    diag = u.diagonal()
    for j in range(k // BLOCK):
        b0, b1 = j * BLOCK, (j + 1) * BLOCK
        row_bits = bits_tab[:, j].repeat_interleave(n).to(dev)
        for g in start_tab[:, j].unique().tolist():  # settings whose group of size g starts here
            if g == 0:
                continue
            sets = (start_tab[:, j] == g).nonzero().flatten().tolist()
            idx = torch.cat([torch.arange(c * n, (c + 1) * n, device=dev) for c in sets])
            with one_thread(dev):
                s = search_scales(WT[b0 : b0 + g, idx], row_bits[idx], 1.0 / diag[b0 : b0 + g] ** 2, alphas)
            scale[idx] = s
            for i, c in enumerate(sets):
                scales[c].append(s[i * n : (i + 1) * n])
        maxq, centre = _grid(row_bits)
        with one_thread(dev):
            E1 = _columns(WT[b0:b1], u[b0:b1, b0:b1], scale, centre, maxq, codes[b0:b1] if want_codes else None)
            loss += (E1 * E1).sum(0)
        if b1 < k:
            WT[b1:].addmm_(u[b0:b1, b1:].T, E1, alpha=-1.0)
    out = []
    for c in range(n_set):
        r = slice(c * n, (c + 1) * n)
        sc = torch.stack(scales[c], dim=1).half() if scales[c] else torch.empty(n, 0, dtype=torch.float16)
        cd = codes[:, r].T.contiguous() if want_codes else None
        out.append(Result(cd, sc, loss[r].clone()))
    return out
