"""Rotary position embeddings with the scaling variants of transformers' modeling_rope_utils."""

from __future__ import annotations

import math

import torch
from torch import nn

from exl.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, dim: int, max_pos: int, seq_len: int | None = None):
    """(inv_freq [dim/2], attention_factor) for a rope config, as transformers computes them."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = rope.theta
    if rope.type == "dynamic" and seq_len is not None and seq_len > max_pos:
        base = base * ((rope.factor * seq_len / max_pos) - (rope.factor - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (base**exponents)
    if rope.type == "linear":
        return inv / rope.factor, 1.0
    if rope.type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope.type == "yarn":
        return _yarn(rope, dim)
    return inv, 1.0


def _yarn(rope: RopeConfig, dim: int):
    factor, base, old = rope.factor, rope.theta, rope.original_max_position_embeddings

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations):
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of extrapolation
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Produces cos/sin for absolute positions; `apply` rotates q and k (rotate-half convention)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_pos: int):
        super().__init__()
        self.rope, self.max_pos = rope, max_pos
        self.dim = int(head_dim * rope.partial_rotary_factor)
        inv, self.attention_factor = inverse_frequencies(rope, self.dim, max_pos)
        self.register_buffer("inv_freq", inv, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        if self.rope.type != "dynamic" and positions.numel() <= 64:  # decode steps: rows of a table, not 6 ops
            table = self._table(int(positions.max()) + 1, dtype, positions.device)
            if table is not None:
                cos, sin = table
                return cos[positions], sin[positions]
        inv = self.inv_freq
        if self.rope.type == "dynamic":
            seq_len = int(positions.max()) + 1
            if seq_len > self.max_pos:
                inv, _ = inverse_frequencies(self.rope, self.dim, self.max_pos, seq_len)
                inv = inv.to(positions.device)
        freqs = positions.to(torch.float32)[..., None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)

    def _table(self, end: int, dtype, device):
        """cos/sin of positions [0, end) or more (the same values cos_sin computes), or None past max_pos."""
        if end > self.max_pos:
            return None
        t = self.__dict__.get("_tables", {}).get((dtype, device))
        if t is None or t[0].shape[0] < end:
            n = min(self.max_pos, max(end, 1024, 2 * (t[0].shape[0] if t is not None else 0)))
            inv = self.inv_freq
            freqs = torch.arange(n, device=device).to(torch.float32)[..., None] * inv
            emb = torch.cat((freqs, freqs), dim=-1)
            t = ((emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype))
            self.__dict__.setdefault("_tables", {})[(dtype, device)] = t
        return t

    def _apply(self, fn, *args, **kwargs):  # moved or converted: the tables are rebuilt
        self.__dict__.pop("_tables", None)
        return super()._apply(fn, *args, **kwargs)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H, D]; cos/sin: [B, T, rot_dim]."""
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        half = self.dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
