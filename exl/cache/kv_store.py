"""Where a paged cache keeps keys or values: float slots, or 8/6/4-bit codes after a rotation.

A store holds one tensor family for every layer, laid out per layer as [kv_heads, slots, ...] so that
a run of consecutive slots is a strided view (attention reads it in place). Quantized stores rotate
each head vector by a fixed orthogonal matrix R (random signs + normalized Hadamard) before rounding:
the rotation spreads outliers over all channels, so one scale per group of 32 fits every value well.
Attention then works in the rotated space: q·k = (qR)·(kR), and an output built from rotated values
is rotated back with Rᵀ (see PagedContext).
"""

from __future__ import annotations

import math

import torch

FLOAT_BITS = {32: torch.float32, 16: torch.float16}
QUANT_BITS = (8, 6, 4)
GROUP = 32  # values per quantization scale


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
        self.data[layer][:, slots] = x.transpose(0, 1).to(self.data.dtype)

    def read(self, layer: int, start: int, end: int) -> torch.Tensor:
        """[heads, end - start, dim] in the compute dtype (a view when no conversion is needed)."""
        x = self.data[layer, :, start:end]
        return x if x.dtype == self.compute_dtype else x.to(self.compute_dtype)

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
        self.codes[layer][:, slots] = pack(codes.flatten(-2), self.bits)
        self.scales[layer][:, slots] = scale.squeeze(-1)

    def read(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Dequantized rotated vectors [heads, end - start, dim] in the compute dtype."""
        codes = unpack(self.codes[layer, :, start:end], self.bits)
        x = codes.to(self.compute_dtype).unflatten(-1, (-1, self.group)) - self.offset
        return (x * self.scales[layer, :, start:end, :, None].to(self.compute_dtype)).flatten(-2)

    def copy_slots(self, src: int, dst: int, n: int) -> None:
        self.codes[:, :, dst : dst + n] = self.codes[:, :, src : src + n]
        self.scales[:, :, dst : dst + n] = self.scales[:, :, src : src + n]

    @property
    def bytes_per_slot(self) -> int:
        layers, heads, _, nbytes = self.codes.shape
        return layers * heads * (nbytes + self.scales.shape[-1] * 2)


def make_store(bits: int | None, layers: int, heads: int, slots: int, dim: int, compute_dtype, device,
               rotation: torch.Tensor | None = None, what: str = "k_bits"):
    """A store for `bits`: None (the compute dtype), 32/16 (float), or 8/6/4 (quantized)."""
    if bits is None:
        return FloatStore(layers, heads, slots, dim, compute_dtype, compute_dtype, device)
    if bits in FLOAT_BITS:
        return FloatStore(layers, heads, slots, dim, FLOAT_BITS[bits], compute_dtype, device)
    if bits in QUANT_BITS:
        return QuantStore(layers, heads, slots, dim, bits, rotation, compute_dtype, device)
    raise ValueError(f"PagedCache: {what}={bits!r} is not supported; use 32, 16, 8, 6 or 4 (None: the model's dtype)")
