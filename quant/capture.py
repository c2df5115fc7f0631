"""Intercept a block's linear layers during a forward pass.

`taps(refs, fn)` swaps every linear layer of a block for a stand-in that calls `fn(ref, x)` and
returns its result as the layer's output. That one mechanism serves all passes: collect Hessians and
price candidates (measurement), quantize a layer the moment its input is known and feed its
quantized output onward (quantization, so later layers of the block see quantized inputs), and
record output gradients (Fisher).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from quant.gptq import hessian_dtype
from quant.model_parts import LinearRef

log = logging.getLogger("exl.quant")


class _Tap(nn.Module):
    def __init__(self, ref: LinearRef, fn):
        super().__init__()
        self.ref, self.fn = ref, fn

    def forward(self, x):
        return self.fn(self.ref, x)


@contextlib.contextmanager
def taps(refs: list[LinearRef], fn):
    for r in refs:
        setattr(r.parent, r.attr, _Tap(r, fn))
    try:
        yield
    finally:
        for r in refs:
            setattr(r.parent, r.attr, r.module)


class HessianCache:
    """H = Σ xᵀx over the valid tokens of a layer input, computed once per distinct input tensor
    (q/k/v share one input, as do gate/up). Inputs are matched by identity and kept alive while
    cached: matching by address would confuse a freed input with a new one at the same address."""

    def __init__(self, valid: torch.Tensor | None = None):
        self.valid = valid  # bool [B*T] token mask, or None
        self._cache: list[tuple[torch.Tensor, tuple[torch.Tensor, int]]] = []

    def __call__(self, x: torch.Tensor, name: str = "") -> tuple[torch.Tensor, int]:
        for seen, result in self._cache:
            if seen is x:
                return result
        result = hessian(x, self.valid, name)
        self._cache.append((x, result))
        return result


def hessian(x: torch.Tensor, valid: torch.Tensor | None = None, name: str = "") -> tuple[torch.Tensor, int]:
    """(H = Σ_t x_t x_tᵀ [K, K] (float64 up to 16384 inputs), tokens used). Tokens with NaN/inf are skipped."""
    x = x.reshape(-1, x.shape[-1]).float()
    if valid is not None and valid.numel() == x.shape[0] and not bool(valid.all()):
        x = x[valid.to(x.device)]
    h = x.T @ x
    if not bool(torch.isfinite(h.diagonal().sum())):  # a NaN/inf input shows on the diagonal; only then
                                                       # look for the culprits (a full scan of x is slow)
        finite = torch.isfinite(x).all(dim=1)
        log.warning("%s: %d of %d calibration tokens have NaN/inf inputs and are skipped", name,
                    int((~finite).sum()), x.shape[0])
        x = x[finite]
        h = x.T @ x
    return h.to(hessian_dtype(h.shape[0])), int(x.shape[0])
