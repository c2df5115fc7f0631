"""Quantization settings for one matrix, their segments (docs/format.md §1.1) and their exact bit cost.

A `Setting` says how the K input channels (in act-order) are coded: `bits` bits in groups of
`group` channels, except the first `hi_frac` of the channels, which get `hi_bits` bits. A
`TrellisSetting` codes the whole matrix as trellis walks (docs/format.md §7) at `bits` bits per
weight with `state_bits` of state. The optimizer chooses one setting per matrix from `candidates()`
and `trellis_candidates()`; `parse_setting` reads either name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from exl import format as F
from exl.format import BLOCK, TILE, Segment, TrellisMeta


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


# ---------------------------------------------------------------------------------------------
# Trellis-coded settings (docs/format.md §7)

TRELLIS_PREFIX = "trellis"


# The two-table codes are the default only where their tables cost under 0.02 bpw (the threshold was set
# for code 2's 256 bytes and kept for code 3's 128, so that the choice of matrices did not move).
TWO_TABLE_MIN_WEIGHTS = 8 * 2 * F.TWO_TABLE_SIZE * 50  # n·k ≥ 102 400


def default_code(bits: int, state_bits: int, weights: int | None = None) -> int:
    """The trellis code exl writes (docs/format.md §7.3): code 3 (two 64-entry tables; about 2.5× faster to
    decode on the AVX-512 CPU than code 1, 1.3× faster than code 2) where it is defined and within ~6% of
    code 1's error (K_b ≤ 4 at L = 12) and its tables cost under 0.02 bpw of an n·k = `weights` matrix
    (None: a large one), else code 1."""
    if state_bits == F.TWO_TABLE_STATE_BITS and bits <= 4 and (weights is None or weights >= TWO_TABLE_MIN_WEIGHTS):
        return F.CODE_TWO_TABLE_64
    return F.CODE_LCG_BYTESUM


@dataclass(frozen=True, order=True)
class TrellisSetting:
    bits: int  # K_b: bits per weight, 1..8
    state_bits: int = 12  # L
    code: int = F.CODE_LCG_BYTESUM  # §7.3

    @property
    def name(self) -> str:
        tail = "" if self.code == F.CODE_LCG_BYTESUM else f"/c{self.code}"
        return f"{TRELLIS_PREFIX}{self.bits}/L{self.state_bits}{tail}"

    @classmethod
    def parse(cls, name: str) -> "TrellisSetting":
        """Inverse of `name`: 'trellis3/L12' (code 1), 'trellis3/L12/c2' or 'trellis3/L12/c3'."""
        if not name.startswith(TRELLIS_PREFIX):
            raise ValueError(f"not a trellis setting: {name!r}")
        parts = name[len(TRELLIS_PREFIX):].split("/")
        try:
            if len(parts) not in (2, 3) or not parts[1].startswith("L") or (len(parts) == 3 and parts[2][:1] != "c"):
                raise ValueError
            return cls(int(parts[0]), int(parts[1][1:]), int(parts[2][1:]) if len(parts) == 3 else F.CODE_LCG_BYTESUM)
        except ValueError:
            raise ValueError(f"not a trellis setting: {name!r} (expected e.g. 'trellis3/L12' or 'trellis3/L12/c2')") from None

    def meta(self) -> TrellisMeta:
        return TrellisMeta(self.bits, self.state_bits, code=self.code)

    def fits(self, n: int, k: int) -> bool:
        return n % TILE == 0 and k % TILE == 0


def parse_setting(name: str) -> Setting | TrellisSetting:
    """A scalar ('4b/g64') or trellis ('trellis3/L12') setting from its name."""
    return TrellisSetting.parse(name) if name.startswith(TRELLIS_PREFIX) else Setting.parse(name)


def trellis_storage_bits(n: int, k: int, bits: int, code: int = F.CODE_LCG_BYTESUM, sv: bool = False) -> int:
    """Bits stored for an [n, k] trellis layer: trellis + tscale + tmeta + tcode + su (+ sv) (docs/format.md §7.6)."""
    tables = 8 * 2 * F.two_table_size(code) if code in F.TWO_TABLE_CODES else 0
    return bits * n * k + 16 * n + 32 * 6 + tables + 8 * math.ceil(k / 8) + (8 * math.ceil(n / 8) if sv else 0)


TRELLIS_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


def trellis_candidates(n: int, k: int, bits=TRELLIS_BITS, state_bits: int = 12) -> list[TrellisSetting]:
    """The trellis settings measured for an [n, k] matrix (none unless n and k are multiples of 16)."""
    if n % TILE or k % TILE:
        return []
    out = []
    for b in bits:
        L = max(state_bits, b + 1, 8)
        out.append(TrellisSetting(b, L, default_code(b, L, n * k)))
    return out
