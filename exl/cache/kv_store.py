"""Where a paged cache keeps keys or values: float slots, or 8/6/4-bit codes.

A store holds one tensor family for every layer, laid out per layer as [kv_heads, slots, ...] so that
a run of consecutive slots is a strided view (attention reads it in place).

- `QuantStore` (values at any width, keys at 8 bits): each head vector is rotated by a fixed
  orthogonal matrix R (random signs + normalized Hadamard) and rounded with one fp16 scale per 32
  values. The rotation spreads outliers over all channels. Attention works in the rotated space:
  q·k = (qR)·(kR), and an output built from rotated values is rotated back with Rᵀ (see PagedContext).
- `ChannelQuantStore` (keys at 6 and 4 bits): keys have channels with large, steady offsets and outliers,
  which per-token rounding at 4 bits handles badly (+4-5% perplexity on SmolLM2, with or without a
  rotation). Keys are instead rounded per channel over blocks of 32 consecutive tokens, asymmetric
  (fp16 scale and offset per channel and block), as in KIVI. A block is rounded once its last token is
  committed; until then its values wait in a float staging row (at most a block or two per sequence).
"""

from __future__ import annotations

import math

import torch

FLOAT_BITS = {32: torch.float32, 16: torch.float16}
QUANT_BITS = (8, 6, 4)
GROUP = 32  # values per quantization scale (per-token stores)
BLOCK = 32  # tokens per block (per-channel key store)


def rotation_matrix(dim: int, seed: int = 0) -> torch.Tensor:
    """An orthogonal [dim, dim] matrix: Hadamard with random sign flips (dim a power of two), else random QR."""
    g = torch.Generator().manual_seed(seed)
    if dim & (dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < dim:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        signs = torch.randint(0, 2, (dim,), generator=g).float() * 2 - 1
        return (signs[:, None] * h) / math.sqrt(dim)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] (each < 2**bits) -> packed bytes [..., D * bits / 8]."""
    if bits == 8:
        return codes
    if bits == 4:
        return codes[..., 0::2] | (codes[..., 1::2] << 4)
    c0, c1, c2, c3 = (codes[..., i::4] for i in range(4))  # bits == 6: four codes in three bytes
    b0 = c0 | (c1 << 6)
    b1 = (c1 >> 2) | (c2 << 4)
    b2 = (c2 >> 4) | (c3 << 2)
    return torch.stack((b0, b1, b2), -1).flatten(-2)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: packed bytes [..., D * bits / 8] -> uint8 codes [..., D]."""
    if bits == 8:
        return packed
    if bits == 4:
        return torch.stack((packed & 15, packed >> 4), -1).flatten(-2)
    b = packed.unflatten(-1, (-1, 3))
    b0, b1, b2 = b[..., 0], b[..., 1], b[..., 2]
    c0 = b0 & 63
    c1 = (b0 >> 6) | ((b1 & 15) << 2)
    c2 = (b1 >> 4) | ((b2 & 3) << 4)
    c3 = b2 >> 2
    return torch.stack((c0, c1, c2, c3), -1).flatten(-2)


class FloatStore:
    """Plain float slots: [layers][kv_heads, slots, head_dim]. Reads of the compute dtype are views."""

    rotated = False

    def __init__(self, layers: int, heads: int, slots: int, dim: int, dtype: torch.dtype, compute_dtype, device):
        self.data = torch.zeros(layers, heads, slots, dim, dtype=dtype, device=device)
        self.compute_dtype = compute_dtype

    def write(self, layer: int, slots: torch.Tensor, x: torch.Tensor) -> None:
        """x: [T, heads, dim] -> the given slot indices [T]."""
        self.data[layer].index_copy_(1, slots, x.transpose(0, 1).to(self.data.dtype))

    def read(self, layer: int, start: int, end: int) -> torch.Tensor:
        """[heads, end - start, dim] in the compute dtype (a view when no conversion is needed)."""
        x = self.data[layer, :, start:end]
        return x if x.dtype == self.compute_dtype else x.to(self.compute_dtype)

    def gather(self, layer: int, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Slots in any order ([N] long): [heads, N, dim] in the compute dtype, a copy (into `out` if given:
        a [heads, N, dim] buffer of the compute dtype, reused to spare an allocation per layer)."""
        src = self.data[layer]
        if src.dtype != self.compute_dtype:
            return src.index_select(1, slots).to(self.compute_dtype)
        return src.index_select(1, slots) if out is None else torch.index_select(src, 1, slots, out=out)

    def copy_slots(self, src: int, dst: int, n: int) -> None:
        self.data[:, :, dst : dst + n] = self.data[:, :, src : src + n]

    @property
    def bytes_per_slot(self) -> int:
        layers, heads, _, dim = self.data.shape
        return layers * heads * dim * self.data.element_size()


class QuantStore:
    """`bits`-bit codes (8, 6 or 4) of rotated vectors, one fp16 scale per group of 32 values."""

    rotated = True

    def __init__(self, layers: int, heads: int, slots: int, dim: int, bits: int, rotation: torch.Tensor,
                 compute_dtype, device):
        if dim % 4:
            raise ValueError(f"a {bits}-bit KV cache needs head_dim divisible by 4, got {dim}")
        self.bits, self.dim, self.compute_dtype = bits, dim, compute_dtype
        self.group = GROUP if dim % GROUP == 0 else dim
        self.codes = torch.zeros(layers, heads, slots, dim * bits // 8, dtype=torch.uint8, device=device)
        self.scales = torch.zeros(layers, heads, slots, dim // self.group, dtype=torch.float16, device=device)
        self.rotation = rotation.to(device)
        self.offset = (2**bits - 1) / 2  # codes 0 .. 2^b - 1 stand for (code - offset) * scale

    def write(self, layer: int, slots: torch.Tensor, x: torch.Tensor) -> None:
        """x: [T, heads, dim], not yet rotated."""
        x = (x.float() @ self.rotation).transpose(0, 1).unflatten(-1, (-1, self.group))  # [H, T, G, group]
        scale = (x.abs().amax(-1, keepdim=True) / self.offset).clamp_min(1e-8).half()
        codes = torch.round(x / scale.float() + self.offset).clamp_(0, 2**self.bits - 1).to(torch.uint8)
        self.codes[layer].index_copy_(1, slots, pack(codes.flatten(-2), self.bits))
        self.scales[layer].index_copy_(1, slots, scale.squeeze(-1))

    def read(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Dequantized rotated vectors [heads, end - start, dim] in the compute dtype."""
        return self._dequant(self.codes[layer, :, start:end], self.scales[layer, :, start:end])

    def gather(self, layer: int, slots: torch.Tensor, out=None) -> torch.Tensor:
        """Dequantized rotated vectors of slots in any order ([N] long): [heads, N, dim] (`out` is ignored)."""
        return self._dequant(self.codes[layer].index_select(1, slots), self.scales[layer].index_select(1, slots))

    def _dequant(self, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        x = unpack(packed, self.bits).to(self.compute_dtype).unflatten(-1, (-1, self.group)) - self.offset
        return (x * scales[..., None].to(self.compute_dtype)).flatten(-2)

    def copy_slots(self, src: int, dst: int, n: int) -> None:
        self.codes[:, :, dst : dst + n] = self.codes[:, :, src : src + n]
        self.scales[:, :, dst : dst + n] = self.scales[:, :, src : src + n]

    @property
    def bytes_per_slot(self) -> int:
        layers, heads, _, nbytes = self.codes.shape
        return layers * heads * (nbytes + self.scales.shape[-1] * 2)


def make_store(bits: int | None, layers: int, heads: int, slots: int, dim: int, compute_dtype, device,
               rotation: torch.Tensor | None = None, what: str = "k_bits", block: int = BLOCK):
    """A store for `bits`: None (the compute dtype), 32/16 (float), or 8/6/4 (quantized; 6- and 4-bit keys
    per channel)."""
    if bits is None:
        return FloatStore(layers, heads, slots, dim, compute_dtype, compute_dtype, device)
    if bits in FLOAT_BITS:
        return FloatStore(layers, heads, slots, dim, FLOAT_BITS[bits], compute_dtype, device)
    if bits in (6, 4) and what == "k_bits":
        return ChannelQuantStore(layers, heads, slots, dim, bits, block, compute_dtype, device)
    if bits in QUANT_BITS:
        return QuantStore(layers, heads, slots, dim, bits, rotation, compute_dtype, device)
    raise ValueError(f"PagedCache: {what}={bits!r} is not supported; use 32, 16, 8, 6 or 4 (None: the model's dtype)")


class ChannelQuantStore:
    """`bits`-bit codes rounded per channel over blocks of `block` consecutive slots (asymmetric, fp16 scale
    and offset per channel and block). Open blocks (not fully committed) live in float staging rows.

    The paged cache drives the block life cycle: `open_blocks` before writing into a block, `close_blocks`
    once every slot of it is final (rounds it), `discard_blocks` when its page is released unfinished.
    """

    rotated = False

    def __init__(self, layers: int, heads: int, slots: int, dim: int, bits: int, block: int, compute_dtype, device):
        if slots % block:
            raise ValueError(f"ChannelQuantStore: {slots} slots is not a multiple of the block size {block}")
        self.bits, self.dim, self.block, self.compute_dtype = bits, dim, block, compute_dtype
        self.layers, self.heads = layers, heads
        nb = slots // block
        self.codes = torch.zeros(layers, heads, slots, dim * bits // 8, dtype=torch.uint8, device=device)
        self.scale = torch.zeros(layers, heads, nb, dim, dtype=torch.float16, device=device)
        self.zero = torch.zeros(layers, heads, nb, dim, dtype=torch.float16, device=device)
        self.stage = torch.zeros(layers, heads, 0, block, dim, dtype=compute_dtype, device=device)
        self.stage_of = torch.full((nb,), -1, dtype=torch.long, device=device)  # block -> staging row, -1: closed
        self._free_rows: list[int] = []

    # -- block life cycle (called by PagedCache) ------------------------------------------------------------------

    def is_open(self, b: int) -> bool:
        return int(self.stage_of[b]) >= 0

    def open_blocks(self, blocks, restore: bool = False) -> None:
        """Give blocks a staging row; restore: fill it with the block's dequantized values (reopening)."""
        for b in blocks:
            if self.is_open(b):
                continue
            if not self._free_rows:  # grow the staging area (a normal tensor even inside inference_mode)
                n = max(4, self.stage.shape[2])
                with torch.inference_mode(False):
                    extra = torch.zeros(self.layers, self.heads, n, self.block, self.dim, dtype=self.stage.dtype,
                                        device=self.stage.device)
                    self._free_rows = list(range(self.stage.shape[2] + n - 1, self.stage.shape[2] - 1, -1))
                    self.stage = torch.cat((self.stage, extra), 2)
            row = self._free_rows.pop()
            self.stage_of[b] = row
            if restore:
                for layer in range(self.layers):
                    self.stage[layer, :, row] = self._dequant(layer, b, b + 1)
            else:
                self.stage[:, :, row] = 0

    def close_blocks(self, blocks, valid: int | None = None) -> None:
        """Round open blocks into codes (only their first `valid` slots are meaningful) and free their rows."""
        for b in blocks:
            row = int(self.stage_of[b])
            if row < 0:
                continue
            x = self.stage[:, :, row].float()  # [L, H, block, D]
            v = x[:, :, : (valid or self.block)]
            lo, hi = v.amin(2, keepdim=True), v.amax(2, keepdim=True)
            levels = 2**self.bits - 1
            scale = ((hi - lo) / levels).clamp_min(1e-8).half()
            lo = lo.half()
            codes = torch.round((x - lo.float()) / scale.float()).clamp_(0, levels).to(torch.uint8)
            s0 = b * self.block
            self.codes[:, :, s0 : s0 + self.block] = pack(codes, self.bits)
            self.scale[:, :, b], self.zero[:, :, b] = scale[:, :, 0], lo[:, :, 0]
            self._release(b, row)

    def discard_blocks(self, blocks) -> None:
        for b in blocks:
            row = int(self.stage_of[b])
            if row >= 0:
                self._release(b, row)

    def _release(self, b: int, row: int) -> None:
        self.stage_of[b] = -1
        self._free_rows.append(row)

    # -- data -----------------------------------------------------------------------------------------------------

    def write(self, layer: int, slots: torch.Tensor, x: torch.Tensor) -> None:
        """x: [T, heads, dim] into open blocks."""
        rows = self.stage_of[slots // self.block]
        if bool((rows < 0).any()):
            raise RuntimeError("ChannelQuantStore: write into a block that is not open (PagedCache.extend first)")
        self.stage[layer][:, rows, slots % self.block] = x.transpose(0, 1).to(self.stage.dtype)

    def _dequant(self, layer: int, b0: int, b1: int) -> torch.Tensor:
        """Blocks [b0, b1) from their codes: [heads, (b1 - b0) * block, dim]."""
        codes = unpack(self.codes[layer, :, b0 * self.block : b1 * self.block], self.bits)
        x = codes.to(self.compute_dtype).unflatten(1, (b1 - b0, self.block))
        scale = self.scale[layer, :, b0:b1, None].to(self.compute_dtype)
        zero = self.zero[layer, :, b0:b1, None].to(self.compute_dtype)
        return (x * scale + zero).flatten(1, 2)

    def read(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Keys of slots [start, end): [heads, end - start, dim] (open blocks from their staging rows)."""
        b0, b1 = start // self.block, -(-end // self.block)
        out = self._dequant(layer, b0, b1)
        rows = self.stage_of[b0:b1]
        is_open = rows >= 0
        if bool(is_open.any()):
            view = out.view(self.heads, b1 - b0, self.block, self.dim)
            view[:, is_open] = self.stage[layer][:, rows[is_open]].to(out.dtype)
        return out[:, start - b0 * self.block : end - b0 * self.block]

    def gather(self, layer: int, slots: torch.Tensor, out=None) -> torch.Tensor:
        """Keys of slots in any order ([N] long): [heads, N, dim], each as `read` gives it (open blocks from their
        staging rows; `out` is ignored)."""
        blocks = slots // self.block
        codes = unpack(self.codes[layer].index_select(1, slots), self.bits).to(self.compute_dtype)
        scale = self.scale[layer].index_select(1, blocks).to(self.compute_dtype)
        zero = self.zero[layer].index_select(1, blocks).to(self.compute_dtype)
        out = codes * scale + zero
        rows = self.stage_of[blocks]
        is_open = rows >= 0
        if bool(is_open.any()):
            pick = torch.nonzero(is_open).flatten()
            staged = self.stage[layer][:, rows[pick], slots[pick] % self.block]  # [heads, open slots, dim]
            out.index_copy_(1, pick, staged.to(out.dtype))
        return out

    def copy_slots(self, src: int, dst: int, n: int) -> None:
        """Copy slots [src, src + n) to [dst, dst + n) (block aligned; the destination's blocks are open):
        whole blocks are copied as codes and closed, a trailing partial block as values into its staging row."""
        full, rest = divmod(n, self.block)
        bs, bd = src // self.block, dst // self.block
        if full:
            self.codes[:, :, dst : dst + full * self.block] = self.codes[:, :, src : src + full * self.block]
            self.scale[:, :, bd : bd + full] = self.scale[:, :, bs : bs + full]
            self.zero[:, :, bd : bd + full] = self.zero[:, :, bs : bs + full]
            self.discard_blocks(range(bd, bd + full))
        if rest:
            b_src, b_dst = bs + full, bd + full
            self.open_blocks([b_dst])
            row = int(self.stage_of[b_dst])
            for layer in range(self.layers):
                vals = self.read(layer, b_src * self.block, b_src * self.block + rest)
                self.stage[layer, :, row, :rest] = vals.to(self.stage.dtype)

    @property
    def bytes_per_slot(self) -> int:
        layers, heads, _, nbytes = self.codes.shape
        return layers * heads * nbytes + 2 * layers * heads * self.dim * 2 // self.block
