"""The exl tensor format, executable reference (see docs/format.md).

Everything here is plain PyTorch and favours clarity over speed: it is the ground truth that the
quantizer packs with and that every kernel is tested against.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

FORMAT_VERSION = 1  # a folder of scalar-coded layers only
TRELLIS_FORMAT_VERSION = 2  # a folder holding any trellis-coded layer (§7), each with both rotations
ONE_SIDED_TRELLIS_VERSION = 3  # a folder with a trellis layer that has no output rotation (no `sv`, §7.4)
READABLE_VERSIONS = (FORMAT_VERSION, TRELLIS_FORMAT_VERSION, ONE_SIDED_TRELLIS_VERSION)
BLOCK = 32  # codes per packed block
QUANT_SUFFIXES = ("qweight", "qscale", "qmeta", "perm", "su", "sv")


@dataclass(frozen=True)
class Segment:
    """A run of `k_len` input channels coded with `bits` bits, one scale per `group_size`."""

    k_len: int
    bits: int
    group_size: int

    def __post_init__(self):
        if not 1 <= self.bits <= 8:
            raise ValueError(f"bits must be in 1..8, got {self.bits}")
        if self.group_size <= 0 or self.group_size % BLOCK:
            raise ValueError(f"group_size must be a positive multiple of {BLOCK}, got {self.group_size}")
        if self.k_len <= 0 or self.k_len % self.group_size:
            raise ValueError(f"k_len {self.k_len} is not a multiple of group_size {self.group_size}")

    @property
    def n_groups(self) -> int:
        return self.k_len // self.group_size

    @property
    def n_bytes(self) -> int:
        """Packed bytes of this segment in one row."""
        return self.k_len // BLOCK * 4 * self.bits


def segments_from_meta(qmeta: torch.Tensor) -> list[Segment]:
    return [Segment(int(k), int(b), int(g)) for k, b, g in qmeta.tolist()]


def segments_to_meta(segments: list[Segment]) -> torch.Tensor:
    return torch.tensor([[s.k_len, s.bits, s.group_size] for s in segments], dtype=torch.int32)


def planes(bits: int) -> list[tuple[int, int]]:
    """Bit planes of a `bits`-bit code as (width, shift), largest plane first (docs/format.md §1.3)."""
    out, shift = [], 0
    for width in (8, 4, 2, 1):
        if bits & width:
            out.append((width, shift))
            shift += width
    return out


def code_offset(bits: int) -> float:
    """The grid centre: w = scale * (q - code_offset(bits))."""
    return (2**bits - 1) / 2


# ---------------------------------------------------------------------------------------------
# Packing


def _pack_segment(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: uint8 [N, k_len] -> uint8 [N, k_len/32 * 4*bits]"""
    n, k = codes.shape
    blocks = codes.to(torch.int32).view(n, k // BLOCK, BLOCK)
    parts = []
    for width, shift in planes(bits):
        field = (blocks >> shift) & (2**width - 1)
        field = field.view(n, k // BLOCK, 8 // width, 4 * width)  # [.., a = i div 4p, j = i mod 4p]
        weights = (torch.arange(8 // width, dtype=torch.int32) * width).view(1, 1, -1, 1)
        parts.append((field << weights).sum(dim=2))  # fields of one byte occupy disjoint bits
    return torch.cat(parts, dim=-1).to(torch.uint8).reshape(n, -1)


def _unpack_segment(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [N, k_len/32 * 4*bits] -> uint8 codes [N, k_len]"""
    n = packed.shape[0]
    blocks = packed.to(torch.int32).view(n, -1, 4 * bits)
    codes = torch.zeros(n, blocks.shape[1], BLOCK, dtype=torch.int32)
    offset = 0
    for width, shift in planes(bits):
        plane = blocks[:, :, offset : offset + 4 * width].unsqueeze(2)  # [N, nb, 1, 4p]
        shifts = (torch.arange(8 // width, dtype=torch.int32) * width).view(1, 1, -1, 1)
        field = (plane >> shifts) & (2**width - 1)  # [N, nb, 8/p, 4p] -> code index a*4p + j
        codes |= field.reshape(n, -1, BLOCK) << shift
        offset += 4 * width
    return codes.reshape(n, -1).to(torch.uint8)


def pack_codes(codes: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
    """Pack integer codes [N, K] (K in permuted order) into qweight uint8 [N, row_bytes]."""
    if codes.shape[1] != sum(s.k_len for s in segments):
        raise ValueError(f"codes have K={codes.shape[1]} but segments cover {sum(s.k_len for s in segments)}")
    out, k0 = [], 0
    for s in segments:
        seg = codes[:, k0 : k0 + s.k_len]
        if int(seg.max()) >= 2**s.bits:
            raise ValueError(f"code {int(seg.max())} does not fit in {s.bits} bits")
        out.append(_pack_segment(seg, s.bits))
        k0 += s.k_len
    return torch.cat(out, dim=1).contiguous()


def unpack_codes(qweight: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
    """Inverse of pack_codes: uint8 [N, row_bytes] -> uint8 codes [N, K]."""
    out, b0 = [], 0
    for s in segments:
        out.append(_unpack_segment(qweight[:, b0 : b0 + s.n_bytes], s.bits))
        b0 += s.n_bytes
    if b0 != qweight.shape[1]:
        raise ValueError(f"qweight has {qweight.shape[1]} bytes per row, segments need {b0}")
    return torch.cat(out, dim=1)


def group_bits_and_offsets(segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per input channel (permuted order): its bit width and the index of its scale group."""
    bits, groups, g0 = [], [], 0
    for s in segments:
        bits.append(torch.full((s.k_len,), s.bits, dtype=torch.int32))
        groups.append(g0 + torch.arange(s.k_len, dtype=torch.int64) // s.group_size)
        g0 += s.n_groups
    return torch.cat(bits), torch.cat(groups)


def dequantize_codes(codes: torch.Tensor, qscale: torch.Tensor, segments: list[Segment], dtype=torch.float32):
    """Codes [N, K] and scales [N, n_groups] -> the permuted, rotated matrix Q [N, K], on the codes' device."""
    bits, groups = group_bits_and_offsets(segments)
    centre = (2.0 ** bits.to(codes.device, torch.float64) - 1) / 2
    scale = qscale.to(codes.device, torch.float64)[:, groups.to(codes.device)]
    return ((codes.to(torch.float64) - centre) * scale).to(dtype)


# ---------------------------------------------------------------------------------------------
# Signs and Hadamard rotations


def pack_signs(signs: torch.Tensor) -> torch.Tensor:
    """±1 vector [n] -> uint8 [ceil(n/8)], bit set means -1."""
    n = signs.numel()
    bits = (signs.flatten() < 0).to(torch.int32)
    bits = torch.nn.functional.pad(bits, (0, (-n) % 8)).view(-1, 8)
    return (bits << torch.arange(8, dtype=torch.int32)).sum(dim=1).to(torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int, dtype=torch.float32) -> torch.Tensor:
    bits = (packed.to(torch.int32).unsqueeze(1) >> torch.arange(8, dtype=torch.int32)) & 1
    return (1 - 2 * bits.flatten()[:n]).to(dtype)


def hadamard_block(n: int) -> int:
    """Block size of the block-diagonal Hadamard on n channels: largest power of 2 dividing n, ≤ 128."""
    return min(n & -n, 128)


def fwht(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Normalized blockwise fast Walsh–Hadamard transform over the last dim (Sylvester order)."""
    n = x.shape[-1]
    block = block or hadamard_block(n)
    shape = x.shape
    y = x.reshape(-1, n // block, block)
    h = 1
    while h < block:
        y = y.view(y.shape[0], y.shape[1], block // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=3).view(y.shape[0], y.shape[1], block)
        h *= 2
    return (y / math.sqrt(block)).reshape(shape)


def hadamard_matrix(n: int, dtype=torch.float64) -> torch.Tensor:
    """Dense H_n (block-diagonal, normalized, symmetric): for tests and the quantizer."""
    return fwht(torch.eye(n, dtype=dtype))


# ---------------------------------------------------------------------------------------------
# Whole layers


def dequantize(t: dict[str, torch.Tensor], dtype=torch.float32) -> torch.Tensor:
    """Reconstruct the dense W [N, K] of a quantized layer (scalar- or trellis-coded) given its tensors by suffix."""
    if is_trellis(t):
        return _dequantize_trellis(t, dtype)
    segments = segments_from_meta(t["qmeta"])
    q = dequantize_codes(unpack_codes(t["qweight"], segments), t["qscale"], segments, torch.float64)
    n, k = q.shape
    w = torch.empty_like(q)
    if "perm" in t:
        w[:, t["perm"].long()] = q  # Q[:, j] = Ŵ[:, perm[j]]
    else:
        w = q
    if "su" in t:  # Ŵ = W D_u H_K  =>  W = Ŵ H_K D_u
        w = fwht(w) * unpack_signs(t["su"], k, torch.float64)
    if "sv" in t:  # Ŵ = H_N D_v W  =>  W = D_v H_N Ŵ
        w = unpack_signs(t["sv"], n, torch.float64)[:, None] * fwht(w.T).T
    return w.to(dtype)


def reference_forward(x: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The five forward steps of docs/format.md §1.4 (§7.5 for trellis layers) in plain PyTorch (fp32 accumulation)."""
    if is_trellis(t):
        return _reference_forward_trellis(x, t)
    segments = segments_from_meta(t["qmeta"])
    q = dequantize_codes(unpack_codes(t["qweight"], segments), t["qscale"], segments, torch.float32)
    k = q.shape[1]
    u = x.to(torch.float32)
    if "su" in t:
        u = fwht(u * unpack_signs(t["su"], k))
    if "perm" in t:
        u = u[..., t["perm"].long()]
    z = u @ q.T
    if "sv" in t:
        z = fwht(z) * unpack_signs(t["sv"], q.shape[0])
    if "bias" in t:
        z = z + t["bias"].to(torch.float32)
    return z.to(x.dtype)


def storage_bits(t: dict[str, torch.Tensor]) -> int:
    """Stored bits of a quantized layer (docs/format.md §2, §7.6): everything but the bias."""
    suffixes = TRELLIS_SUFFIXES if is_trellis(t) else QUANT_SUFFIXES
    return sum(8 * t[s].numel() * t[s].element_size() for s in suffixes if s in t)


def layer_shape(t: dict[str, torch.Tensor]) -> tuple[int, int]:
    if is_trellis(t):
        return t["trellis"].shape[0] * TILE, t["trellis"].shape[1] * TILE
    return t["qweight"].shape[0], int(t["qmeta"][:, 0].sum())


def bits_per_weight(t: dict[str, torch.Tensor]) -> float:
    n, k = layer_shape(t)
    return storage_bits(t) / (n * k)


def perm_dtype(k: int) -> torch.dtype:
    return torch.int16 if k <= 32767 else torch.int32


# ---------------------------------------------------------------------------------------------
# Trellis-coded layers (docs/format.md §7, format version 2)

TRELLIS_LAYOUTS = (1, 2)  # tile layouts (§7.2): 1 column-major (code 1), 2 quad-row order (codes 2, 3)
TILE = 16  # a tile is 16 output channels x 16 input channels = 256 weights, one trellis walk
TILE_WEIGHTS = TILE * TILE
TRELLIS_SUFFIXES = ("trellis", "tscale", "tmeta", "tcode", "su", "sv")
CODE_LCG_BYTESUM = 1  # §7.3: a multiply-add and a byte sum per weight
CODE_TWO_TABLE = 2  # §7.3: the sum of two lookups in 128-entry int8 tables (`P.tcode`)
CODE_TWO_TABLE_64 = 3  # §7.3: the same with 64-entry tables (one register-wide lookup each on AVX-512)
TWO_TABLE_CODES = (CODE_TWO_TABLE, CODE_TWO_TABLE_64)
CODE_LAYOUT = {CODE_LCG_BYTESUM: 1, CODE_TWO_TABLE: 2, CODE_TWO_TABLE_64: 2}  # each code comes with its tile layout
CODE_CENTRE = 510  # 4 bytes of 0..255 sum to 0..1020; the centre makes the code symmetric
TWO_TABLE_STATE_BITS = 12  # codes 2 and 3 are defined for L = 12 only
TWO_TABLE_MAX_BITS = 7  # and K_b <= 7 (a decoder reads each weight's two index bytes from one 64-bit window)
TWO_TABLE_SIZE = 128  # entries per table of code 2 (two_table_size: any two-table code)


def two_table_size(code: int) -> int:
    """Entries in each of a two-table code's tables: 128 (code 2) or 64 (code 3)."""
    return 64 if code == CODE_TWO_TABLE_64 else TWO_TABLE_SIZE


def two_table_shift(code: int) -> int:
    """The state bit where index b starts: 5 (code 2, b = bits 5–11) or 6 (code 3, b = bits 6–11)."""
    return 6 if code == CODE_TWO_TABLE_64 else 5


@dataclass(frozen=True)
class TrellisMeta:
    """The contents of `P.tmeta` (int32 [6]): version, bits per weight, state bits, code id, code constants."""

    bits: int  # K: bits per weight, 1..8
    state_bits: int = 16  # L: bits of trellis state, max(8, K)..16
    mul: int = 0xB9D2F219  # A: odd multiplier of the code's LCG (stored as int32 bits); chosen by measurement:
    add: int = 0x29207D73  # B: addend of the code's LCG; docs/quantization.md, bench/trellis_mse.py --constants
    code: int = CODE_LCG_BYTESUM
    version: int = 0  # tile layout; 0: the code's own (CODE_LAYOUT)

    def __post_init__(self):
        if self.version == 0 and self.code in CODE_LAYOUT:
            object.__setattr__(self, "version", CODE_LAYOUT[self.code])
        if self.code in TWO_TABLE_CODES:
            object.__setattr__(self, "mul", 0)  # unused by codes 2 and 3, stored as 0
            object.__setattr__(self, "add", 0)
        if not 1 <= self.bits <= 8:
            raise ValueError(f"trellis bits must be in 1..8, got {self.bits}")
        if not max(8, self.bits) <= self.state_bits <= 16:
            raise ValueError(f"trellis state bits must be in {max(8, self.bits)}..16, got {self.state_bits}")
        if self.code not in CODE_LAYOUT:
            raise ValueError(f"unknown trellis code id {self.code} (this exl reads codes {sorted(CODE_LAYOUT)}); "
                             "update exl")
        if self.version not in TRELLIS_LAYOUTS:
            raise ValueError(f"trellis layout version {self.version} is not supported (this exl reads "
                             f"{TRELLIS_LAYOUTS}); update exl")
        if self.version != CODE_LAYOUT[self.code]:
            raise ValueError(f"trellis code {self.code} is stored in tile layout {CODE_LAYOUT[self.code]}, "
                             f"not {self.version}")
        if self.code == CODE_LCG_BYTESUM and not self.mul & 1:
            raise ValueError("the trellis code multiplier must be odd")
        if self.code in TWO_TABLE_CODES and (self.state_bits != TWO_TABLE_STATE_BITS
                                             or self.bits > TWO_TABLE_MAX_BITS):
            raise ValueError(f"trellis code {self.code} needs L = {TWO_TABLE_STATE_BITS} and K_b <= {TWO_TABLE_MAX_BITS}, "
                             f"got L = {self.state_bits}, K_b = {self.bits}")

    @property
    def words_per_tile(self) -> int:
        """32-bit words of one tile's bit stream: 256·K bits."""
        return TILE_WEIGHTS * self.bits // 32

    def to_tensor(self) -> torch.Tensor:
        vals = [self.version, self.bits, self.state_bits, self.code, self.mul, self.add]
        return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in vals], dtype=torch.int32)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "TrellisMeta":
        v = [int(x) & 0xFFFFFFFF for x in t.tolist()]
        if len(v) != 6:
            raise ValueError(f"tmeta must hold 6 int32 values, got {len(v)}")
        version, bits, state_bits, code, mul, add = v
        if version == 0:
            raise ValueError("trellis layout version 0 is not valid in a file")
        return cls(bits, state_bits, mul, add, code, version)


def is_trellis(t: dict) -> bool:
    """Whether a layer's tensors (by suffix) are trellis-coded (else scalar-coded, §1)."""
    return "trellis" in t


def two_table_default(code: int = CODE_TWO_TABLE) -> torch.Tensor:
    """The tables exl's quantizer writes as `P.tcode` for a two-table code (int8 [2n]: T_a then T_b).

    Both are the n Gaussian quantiles Φ⁻¹((i + ½)/n) (n = 128 for code 2, 64 for code 3), scaled to a
    largest magnitude of 127 and rounded, in two seeded random orders (torch.randperm, generator seed 0):
    near-Gaussian code values (σ ≈ 67.5 for code 2). Readers never rebuild them: they read `P.tcode`.
    """
    n = two_table_size(code)
    q = torch.special.ndtri((torch.arange(n, dtype=torch.float64) + 0.5) / n)
    q = torch.round(q * 127 / q.max()).to(torch.int8)
    g = torch.Generator().manual_seed(0)
    return torch.cat([q[torch.randperm(n, generator=g)], q[torch.randperm(n, generator=g)]])


def two_table_indices(states: torch.Tensor, code: int = CODE_TWO_TABLE) -> tuple[torch.Tensor, torch.Tensor]:
    """A two-table code's indices (§7.3): with n entries per table and b starting at bit `two_table_shift`,
    a = s mod n, b = (s >> shift) mod n -> ((a + b) mod n, (a − b) mod n)."""
    s = states.to(torch.int64)
    m = two_table_size(code) - 1
    a, b = s & m, (s >> two_table_shift(code)) & m
    return (a + b) & m, (a - b) & m


def check_tables(meta: TrellisMeta, tcode: torch.Tensor | None, who: str = "trellis layer") -> None:
    """A layer's `tcode` against its code (§7.1): required for codes 2 (int8 [256]) and 3 (int8 [128]),
    absent otherwise."""
    if meta.code in TWO_TABLE_CODES:
        size = 2 * two_table_size(meta.code)
        if tcode is None:
            raise ValueError(f"{who}: a code {meta.code} layer needs its tables, the tensor `tcode` (int8 [{size}]); "
                             "the file lacks P.tcode (docs/format.md §7.1)")
        if tcode.dtype != torch.int8 or tuple(tcode.shape) != (size,):
            raise ValueError(f"{who}: tcode of a code {meta.code} layer must be int8 [{size}] (T_a then T_b), "
                             f"got {tcode.dtype} {list(tcode.shape)}")
    elif tcode is not None:
        raise ValueError(f"{who}: tcode is only for code 2 and 3 layers; this layer is code {meta.code} "
                         "(its tmeta says so): drop P.tcode or fix tmeta")


def trellis_code(states: torch.Tensor, meta: TrellisMeta, tcode: torch.Tensor | None = None) -> torch.Tensor:
    """The code (§7.3): state s -> integer value.

    Code 1: x = (A·s + B) mod 2^32, value = byte0(x) + byte1(x) + byte2(x) + byte3(x) − 510 (in [−510, 510]);
    a sum of four near-uniform bytes is close to Gaussian (σ ≈ 147.8), which suits rotated weights.
    Code 2: value = T_a[(a + b) mod 128] + T_b[(a − b) mod 128] with a, b the state's bits 0–6 and 5–11 and
    T_a, T_b the two halves of `tcode` (int8 [256]; in [−256, 254]).
    Code 3: value = T_a[(a + b) mod 64] + T_b[(a − b) mod 64] with a, b the state's bits 0–5 and 6–11 and
    T_a, T_b the two halves of `tcode` (int8 [128]).
    """
    if meta.code in TWO_TABLE_CODES:
        check_tables(meta, tcode)
        t = tcode.to(torch.int32).reshape(-1)
        i, j = two_table_indices(states, meta.code)
        return t[i] + t[two_table_size(meta.code) + j]
    x = (states.to(torch.int64) * meta.mul + meta.add) & 0xFFFFFFFF
    return ((x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24) - CODE_CENTRE).to(torch.int32)


def trellis_codebook(meta: TrellisMeta, tcode: torch.Tensor | None = None) -> torch.Tensor:
    """Values of all 2^L states (int32 [2^L]): what a kernel computes, tabulated for the reference."""
    return trellis_code(torch.arange(2**meta.state_bits), meta, tcode)


def trellis_states(words: torch.Tensor, meta: TrellisMeta) -> torch.Tensor:
    """Unpack tile bit streams into the state of every weight.

    words: int32 [..., 8·K] (one tile's stream, LSB-first) -> int64 [..., 256] states, where
    s_t = Σ_{q<L} bit((t·K + q) mod 256K) · 2^q (a circular, tail-biting stream).
    """
    k, L = meta.bits, meta.state_bits
    shape = words.shape[:-1]
    w = words.to(torch.int64).reshape(-1, words.shape[-1]) & 0xFFFFFFFF
    bits = ((w.unsqueeze(-1) >> torch.arange(32)) & 1).reshape(w.shape[0], -1)  # [T, 256K], bit m at m
    pos = (torch.arange(TILE_WEIGHTS).unsqueeze(1) * k + torch.arange(L)) % (TILE_WEIGHTS * k)  # [256, L]
    states = (bits[:, pos] << torch.arange(L)).sum(-1)
    return states.reshape(*shape, TILE_WEIGHTS)


def trellis_pack(states: torch.Tensor, meta: TrellisMeta) -> torch.Tensor:
    """Inverse of trellis_states for a valid walk: int [..., 256] states -> int32 [..., 8·K] words.

    Chunk t of the stream (bits t·K .. t·K+K−1) is the low K bits of s_t. The walk must be consistent:
    s_{t+1} = (s_t >> K) | (new bits << (L − K)), circularly; a ValueError says where it is not.
    """
    k = meta.bits
    s = states.to(torch.int64)
    chunks = s & (2**k - 1)  # [..., 256]
    bits = ((chunks.unsqueeze(-1) >> torch.arange(k)) & 1).reshape(*s.shape[:-1], TILE_WEIGHTS * k)
    words = (bits.reshape(*s.shape[:-1], -1, 32) << torch.arange(32)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    if not torch.equal(trellis_states(words, meta), s):
        bad = (trellis_states(words, meta) != s).nonzero()[0].tolist()
        raise ValueError(f"states are not a valid trellis walk (first mismatch at index {bad})")
    return words


@functools.lru_cache(maxsize=None)
def _tile_order(layout: int) -> torch.Tensor:
    """For each of a tile's 256 walk positions t, its place row·16 + column in the 16×16 tile (§7.2)."""
    t = torch.arange(TILE_WEIGHTS)
    if layout == 1:  # column-major: row t mod 16, column t div 16
        return (t % TILE) * TILE + t // TILE
    if layout == 2:  # quad-row order: row (t div 4) mod 16, column 4·(t div 64) + t mod 4
        return ((t // 4) % TILE) * TILE + 4 * (t // 64) + t % 4
    raise ValueError(f"unknown trellis tile layout {layout}")


def trellis_tiles_to_matrix(tiles: torch.Tensor, layout: int = 1) -> torch.Tensor:
    """[N/16, K/16, 256] tile values in walk order (layout 1 or 2, §7.2) -> [N, K]."""
    nt, kt, _ = tiles.shape
    square = torch.empty_like(tiles)
    square[..., _tile_order(layout)] = tiles  # [N/16, K/16, 16·16] row-major inside the tile
    return square.view(nt, kt, TILE, TILE).permute(0, 2, 1, 3).reshape(nt * TILE, kt * TILE)


def trellis_matrix_to_tiles(q: torch.Tensor, layout: int = 1) -> torch.Tensor:
    """Inverse of trellis_tiles_to_matrix: [N, K] -> [N/16, K/16, 256] in walk order."""
    n, k = q.shape
    if n % TILE or k % TILE:
        raise ValueError(f"a trellis-coded matrix needs N and K multiples of {TILE}, got {n}x{k}")
    square = q.reshape(n // TILE, TILE, k // TILE, TILE).permute(0, 2, 1, 3).reshape(n // TILE, k // TILE, TILE_WEIGHTS)
    return square[..., _tile_order(layout)]


def trellis_decode(t: dict[str, torch.Tensor], dtype=torch.float32) -> torch.Tensor:
    """The rotated matrix Q̂ [N, K] = tscale[n] · code(state) of a trellis layer (before un-rotation)."""
    meta = TrellisMeta.from_tensor(t["tmeta"])
    values = trellis_code(trellis_states(t["trellis"], meta), meta, t.get("tcode"))
    q = trellis_tiles_to_matrix(values, meta.version).to(torch.float64)
    return (q * t["tscale"].to(torch.float64)[:, None]).to(dtype)


def _dequantize_trellis(t: dict[str, torch.Tensor], dtype) -> torch.Tensor:
    q = trellis_decode(t, torch.float64)
    n, k = q.shape
    w = fwht(q) * unpack_signs(t["su"], k, torch.float64)  # Ŵ = H_N D_v W D_u H_K, D_v H_N only with sv
    if "sv" in t:
        w = unpack_signs(t["sv"], n, torch.float64)[:, None] * fwht(w.T).T
    return w.to(dtype)


def _reference_forward_trellis(x: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    q = trellis_decode(t, torch.float32)
    n, k = q.shape
    u = fwht(x.to(torch.float32) * unpack_signs(t["su"], k))
    z = u @ q.T
    if "sv" in t:
        z = fwht(z) * unpack_signs(t["sv"], n)
    if "bias" in t:
        z = z + t["bias"].to(torch.float32)
    return z.to(x.dtype)
