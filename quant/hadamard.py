"""Blockwise Walsh–Hadamard transform by matrix multiplication (fast on CPU and GPU).

Computes the same transform as `exl.format.fwht` (normalized, block-diagonal, Sylvester order,
blocks of `hadamard_block(n)`), up to float rounding, with one batched matmul per call instead of a
Python loop over butterfly stages.
"""

from __future__ import annotations

import functools

import torch

from exl.format import hadamard_block


@functools.lru_cache(maxsize=16)
def _sylvester(block: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / block**0.5).to(device=device, dtype=dtype)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Normalized blockwise Hadamard transform over the last dimension."""
    n = x.shape[-1]
    b = hadamard_block(n)
    h = _sylvester(b, x.dtype, str(x.device))
    return (x.reshape(-1, n // b, b) @ h).reshape(x.shape)
