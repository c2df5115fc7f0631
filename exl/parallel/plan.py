"""Who holds what: integer splits proportional to device shares, and layer placement by memory.

Everything here is pure arithmetic on sizes, so it is tested without devices (fake memory sizes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from exl.errors import ExlError

GiB = 1 << 30


class ParallelError(ExlError):
    """A model cannot be split as asked, or a rank failed while running."""


def proportional(total: int, shares: list[float], minimum: int = 1, what: str = "units") -> list[int]:
    """Split `total` whole units into parts proportional to `shares` (largest remainder), each ≥ minimum."""
    if not shares or any(not s > 0 for s in shares):
        raise ParallelError(f"device shares must be positive numbers, got {shares}")
    n = len(shares)
    if total < n * minimum:
        raise ParallelError(f"cannot split {total} {what} over {n} devices with at least {minimum} each: "
                            f"use fewer devices (--tp) or a model with more {what}")
    ideal = [total * s / sum(shares) for s in shares]
    counts = [max(minimum, math.floor(x)) for x in ideal]
    while sum(counts) > total:  # minimums pushed us over: take from the most over-served part
        i = max((i for i in range(n) if counts[i] > minimum), key=lambda i: counts[i] - ideal[i])
        counts[i] -= 1
    while sum(counts) < total:
        i = max(range(n), key=lambda i: ideal[i] - counts[i])
        counts[i] += 1
    return counts


def ranges(counts: list[int], unit: int = 1) -> list[tuple[int, int]]:
    """Consecutive [start, end) ranges of counts[i] * unit elements."""
    out, start = [], 0
    for c in counts:
        out.append((start, start + c * unit))
        start += c * unit
    return out


def split(total: int, shares: list[float], unit: int = 1, what: str = "channels") -> list[tuple[int, int]]:
    """Contiguous ranges over `total` elements, cut on multiples of `unit`, sized by shares."""
    if total % unit:
        raise ParallelError(f"{total} {what} are not a multiple of the split unit {unit}")
    return ranges(proportional(total // unit, shares, 1, what if unit == 1 else f"blocks of {unit} {what}"), unit)


def channel_unit(total: int, parts: int, preferred: int = 128) -> int:
    """The largest power of two ≤ preferred dividing `total` that still gives every part a block.

    128-channel blocks keep every quantization group (≤ 128) and Hadamard block whole
    (docs/format.md §4); tiny models fall back to smaller blocks.
    """
    unit = min(total & -total, preferred)
    while unit > 1 and total // unit < parts:
        unit //= 2
    return unit


def snap_cuts(total: int, shares: list[float], boundaries: list[int]) -> list[tuple[int, int]]:
    """Ranges over [0, total) cut only at allowed `boundaries`, as close to the shares as possible.

    With fewer pieces than parts, the last parts get empty ranges (they contribute nothing).
    """
    allowed = sorted(set(b for b in boundaries if 0 < b < total))
    n = len(shares)
    if len(allowed) < n - 1:
        pieces = [0] + allowed + [total] * (n - len(allowed))
        return list(zip(pieces[:-1], pieces[1:]))
    cuts, acc, prev = [0], 0.0, 0
    for i in range(n - 1):
        acc += shares[i] / sum(shares)
        lo = [b for b in allowed if b > prev]
        lo = lo[: len(lo) - (n - 2 - i)]  # leave a boundary for each later cut
        prev = min(lo, key=lambda b: abs(b - acc * total))
        cuts.append(prev)
    cuts.append(total)
    return list(zip(cuts[:-1], cuts[1:]))


@dataclass
class LayerPlacement:
    """Decoder layers [start, end) on each device, and the bytes they take."""

    layers: list[range]
    used_bytes: list[int]

    def device_of(self, layer: int) -> int:
        return next(d for d, r in enumerate(self.layers) if layer in r)


def place_layers(layer_bytes: list[int], budgets: list[int], fixed: list[int] | None = None,
                 balanced: bool = False) -> LayerPlacement:
    """Put layers on devices in order.

    budgets: bytes each device may use for weights; fixed: bytes already spoken for on each device
    (embedding and head on the first). Greedy (`balanced=False`, a manual --gpu-split) fills each
    device before the next, like ExLlama; balanced (automatic, from free memory) spreads the layers
    in proportion to the budgets, so every device gets work.
    """
    n = len(budgets)
    fixed = fixed or [0] * n
    room = [b - f for b, f in zip(budgets, fixed)]
    total = sum(layer_bytes)
    if sum(max(r, 0) for r in room) < total or any(r < 0 for r in room[:1]):
        need = (total + sum(fixed)) / GiB
        raise ParallelError(f"the model needs {need:.2f} GiB for weights but the devices offer "
                            f"{', '.join(f'{b / GiB:.2f}' for b in budgets)} GiB: give a larger --gpu-split, "
                            "more devices, or a smaller quantization")
    if balanced:
        target = [total * max(r, 0) / sum(max(r, 0) for r in room) for r in room]
    else:
        target = [max(r, 0) for r in room]
    layers, used, i = [], [], 0
    for d in range(n):
        start, size = i, 0
        last = d == n - 1
        while i < len(layer_bytes):
            nxt = size + layer_bytes[i]
            if nxt > room[d]:
                break
            if not last and balanced and nxt > target[d] and nxt - target[d] > target[d] - size:
                break  # closer to the target without this layer
            size, i = nxt, i + 1
        layers.append(range(start, i))
        used.append(size + fixed[d])
    if i < len(layer_bytes) and balanced:  # the spread left a tail that only a full fill can hold
        return place_layers(layer_bytes, budgets, fixed, balanced=False)
    if i < len(layer_bytes):
        raise ParallelError(f"layers {i}..{len(layer_bytes) - 1} do not fit: per-device budgets "
                            f"{', '.join(f'{b / GiB:.2f}' for b in budgets)} GiB are too small for the layer sizes; "
                            "raise the --gpu-split figures")
    return LayerPlacement(layers, used)
