"""Slicing one layer's stored tensors into a rank's part (docs/format.md §4).

Dense weights are sliced by rows (output channels) or columns (input channels). Quantized layers
are sliced on their packed form: output rows directly; input channels only on group boundaries
in permuted order, as a contiguous byte range of every row plus that range's scales and segments.
Rotations and the permutation are returned separately when a part cannot apply them itself.
"""

from __future__ import annotations

import torch

from exl import format as fmt
from exl.format import Segment
from exl.parallel.plan import ParallelError


def group_boundaries(qmeta: torch.Tensor) -> list[int]:
    """Every permuted input position where a quantization group starts (plus K)."""
    out, k = [], 0
    for s in fmt.segments_from_meta(qmeta):
        out.extend(range(k, k + s.k_len, s.group_size))
        k += s.k_len
    return out + [k]


def quant_rows(t: dict[str, torch.Tensor], n0: int, n1: int) -> dict[str, torch.Tensor]:
    """Output channels [n0, n1) of a quantized layer: qweight, qscale and bias rows; the rest shared.

    `sv` is dropped: the caller applies the output rotation (its blocks must not straddle n0, n1).
    """
    out = {k: v for k, v in t.items() if k in ("qmeta", "perm", "su")}
    out["qweight"] = t["qweight"][n0:n1].contiguous()
    out["qscale"] = t["qscale"][n0:n1].contiguous()
    if "bias" in t:
        out["bias"] = t["bias"][n0:n1].contiguous()
    return out


def quant_k_range(t: dict[str, torch.Tensor], j0: int, j1: int) -> dict[str, torch.Tensor]:
    """Permuted input positions [j0, j1) of a quantized layer as a plain (unrotated) layer.

    Returns qweight (a byte range of every row), qscale (those groups) and qmeta (the cut segments).
    j0 and j1 must be group boundaries.
    """
    segs = fmt.segments_from_meta(t["qmeta"])
    new, byte_ranges, group_ranges = [], [], []
    k = b = g = 0
    for s in segs:
        a, e = max(j0, k), min(j1, k + s.k_len)
        if a < e:
            if (a - k) % s.group_size or (e - k) % s.group_size:
                raise ParallelError(f"input split [{j0}, {j1}) cuts a quantization group of {s.group_size} "
                                    f"channels (segment at {k})")
            new.append(Segment(e - a, s.bits, s.group_size))
            byte_ranges.append((b + (a - k) // fmt.BLOCK * 4 * s.bits, b + (e - k) // fmt.BLOCK * 4 * s.bits))
            group_ranges.append((g + (a - k) // s.group_size, g + (e - k) // s.group_size))
        k, b, g = k + s.k_len, b + s.n_bytes, g + s.n_groups
    return {
        "qweight": torch.cat([t["qweight"][:, x:y] for x, y in byte_ranges], dim=1).contiguous(),
        "qscale": torch.cat([t["qscale"][:, x:y] for x, y in group_ranges], dim=1).contiguous(),
        "qmeta": fmt.segments_to_meta(new),
    }


def signs(packed: torch.Tensor | None, n: int, lo: int = 0, hi: int | None = None, dtype=torch.float32):
    """Unpacked ±1 signs [lo:hi] of a packed sign vector over n channels (None stays None)."""
    if packed is None:
        return None
    return fmt.unpack_signs(packed, n, dtype)[lo:hi]
