"""Quantization settings for one matrix, their segments (docs/format.md §1.1) and their exact bit cost.

A `Setting` says how the K input channels (in act-order) are coded: `bits` bits in groups of
`group` channels, except the first `hi_frac` of the channels, which get `hi_bits` bits. The
optimizer chooses one setting per matrix from `candidates()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from exl.format import BLOCK, Segment


@dataclass(frozen=True, order=True)
class Setting:
    bits: int
    group: int
    hi_bits: int = 0  # 0: uniform
    hi_frac: float = 0.0

    @property
    def name(self) -> str:
        s = f"{self.bits}b/g{self.group}"
        if self.hi_bits:
            s = f"{self.hi_bits}b:{self.hi_frac:.3g}+{s}"
        return s

    @classmethod
    def parse(cls, name: str) -> "Setting":
        """Inverse of `name`: '4b/g64' or '6b:0.25+4b/g64'."""
        hi_bits, hi_frac = 0, 0.0
        if "+" in name:
            hi, name = name.split("+")
            b, f = hi.split(":")
            hi_bits, hi_frac = int(b.rstrip("b")), float(f)
        b, g = name.split("/")
        return cls(int(b.rstrip("b")), int(g.lstrip("g")), hi_bits, hi_frac)

    def segments(self, k: int) -> list[Segment]:
        """The segments covering K act-ordered channels (K a multiple of 32)."""
        if k % BLOCK:
            raise ValueError(f"K={k} is not a multiple of {BLOCK}")
        k_hi = 0
        if self.hi_bits:
            unit = self.group if self.hi_frac * k >= self.group else BLOCK
            k_hi = min(k - BLOCK, max(BLOCK, round(self.hi_frac * k / unit) * unit))
        return _split(k_hi, self.hi_bits, self.group) + _split(k - k_hi, self.bits, self.group)


def _split(k_len: int, bits: int, group: int) -> list[Segment]:
    """k_len channels at one bit width: whole groups, then a remainder with the largest group that fits."""
    out = []
    while k_len > 0:
        g = group
        while g > BLOCK and k_len < g:
            g //= 2
        take = k_len // g * g
        out.append(Segment(take, bits, g))
        k_len -= take
    return out


def storage_bits(n: int, k: int, segments: list[Segment], perm: bool, su: bool, sv: bool) -> int:
    """Bits stored for an [n, k] layer: qweight + qscale + qmeta + perm + su + sv (docs/format.md §2)."""
    bits = 8 * n * sum(s.n_bytes for s in segments)
    bits += 16 * n * sum(s.n_groups for s in segments)
    bits += 32 * 3 * len(segments)
    if perm:
        bits += (16 if k <= 32767 else 32) * k
    if su:
        bits += 8 * math.ceil(k / 8)
    if sv:
        bits += 8 * math.ceil(n / 8)
    return bits


UNIFORM_BITS = (2, 3, 4, 5, 6, 7, 8)
GROUPS = (32, 64, 128)


def candidates(k: int, mixes: bool = True) -> list[Setting]:
    """The settings measured for every matrix with K input channels.

    Uniform widths 2-8 with groups of 32, 64 and 128 channels; with `mixes`, the first quarter of the
    act-ordered channels one bit wider (3:2 ... 8:7, groups of 128); and 2/1-bit mixes so that targets
    down to 2.0 bpw are reachable. (Measured on SmolLM2: with Hadamard rotations the error-vs-bits hull
    is made almost only of uniform group-128/64 settings; wider mixes and +2-bit mixes never made it.)
    """
    out = [Setting(b, g) for b in UNIFORM_BITS for g in GROUPS]
    if mixes:
        out += [Setting(b, 128, b + 1, 0.25) for b in range(2, 8)]
    out += [Setting(1, 128, 2, f) for f in (0.25, 0.5, 0.75)]  # below 2 bpw
    seen, uniq = set(), []
    for s in out:  # settings that give identical segments on this K are measured once
        key = tuple(s.segments(k))
        if key not in seen:
            seen.add(key)
            uniq.append(s)
    return uniq
