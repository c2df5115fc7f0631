"""Incoherence processing and act-order: the transforms applied to W and H before rounding.

    Ŵ = (H_N D_v) W (D_u H_K)        H_x̂ = (H_K D_u) H (D_u H_K)       (docs/format.md §1.4)

then the columns are permuted by decreasing diag(H_x̂) (act-order). Random signs come from a seed
derived from the layer name, so the same seed always gives the same model.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from quant.gptq import hessian_dtype
from quant.hadamard import fwht


@dataclass(frozen=True)
class Transform:
    su: bool = True  # input-side signs + Hadamard
    sv: bool = False  # output-side signs + Hadamard
    perm: bool = True  # act-order

    @property
    def name(self) -> str:
        parts = [p for p, on in (("su", self.su), ("sv", self.sv), ("perm", self.perm)) if on]
        return "+".join(parts) or "none"

    @classmethod
    def parse(cls, name: str) -> "Transform":
        parts = set(name.split("+")) - {"none"}
        if parts - {"su", "sv", "perm"}:
            raise ValueError(f"unknown transform {name!r}")
        return cls("su" in parts, "sv" in parts, "perm" in parts)


def random_signs(n: int, seed: int, name: str, side: str) -> torch.Tensor:
    """±1 float32 vector of length n, a pure function of (seed, layer name, side)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}:{side}".encode()))
    return torch.randint(0, 2, (n,), generator=g).mul_(2).sub_(1).to(torch.float32)


@dataclass
class Prepared:
    """A matrix and its Hessian in the quantizer's coordinates."""

    w: torch.Tensor  # [N, K] float32, rotated and permuted
    h: torch.Tensor  # [K, K] float64, rotated and permuted
    su: torch.Tensor | None
    sv: torch.Tensor | None
    perm: torch.Tensor | None  # int64 [K]: column j of w is column perm[j] of the rotated matrix


def prepare(w: torch.Tensor, h: torch.Tensor, t: Transform, seed: int, name: str,
            h_from: "Prepared | None" = None) -> Prepared:
    """Rotate and permute W [N, K] and H [K, K]; zero the columns of dead input channels.

    h_from: a Prepared of the same W and H with the same `su` and `perm` (only `sv` may differ); its
    rotated Hessian and permutation are reused instead of recomputed."""
    n, k = w.shape
    dead = h.diagonal() <= 0
    if h_from is not None:
        su, perm, hp = h_from.su, h_from.perm, h_from.h
    else:
        hp, su, perm = _hessian(h, dead, t, k, seed, name, w.device)
    sv = random_signs(n, seed, name, "v").to(w.device) if t.sv else None
    return Prepared(_weight(w, dead, su, sv, perm), hp, su, sv, perm)


def _hessian(h, dead, t: Transform, k: int, seed: int, name: str, device):
    """(H in the quantizer's coordinates (float64), input signs, act-order permutation)."""
    h = h.to(hessian_dtype(k)).clone()
    if dead.any():  # inputs that are always zero: any weight works; keep H positive definite
        idx = dead.nonzero().flatten()
        live = h.diagonal()[~dead]
        h[idx, idx] = float(live.mean()) if live.numel() else 1.0
    su = perm = None
    if t.su:
        su = random_signs(k, seed, name, "u").to(device)
        s64 = su.to(h.dtype)
        h = fwht(fwht(h * s64[:, None] * s64[None, :]).T)  # H_K D_u H D_u H_K (symmetric)
    if t.perm:
        perm = torch.argsort(h.diagonal(), descending=True, stable=True)
        h = h[perm][:, perm]
    return h, su, perm


def _weight(w, dead, su, sv, perm) -> torch.Tensor:
    """Ŵ = (H_N D_v) W (D_u H_K), columns permuted; float32."""
    w = w.to(torch.float32)
    if dead.any():
        w = w.clone()
        w[:, dead] = 0
    if su is not None:
        w = fwht(w * su)
    if sv is not None:
        w = fwht((w * sv[:, None]).T).T
    if perm is not None:
        w = w[:, perm]
    return w.contiguous()
