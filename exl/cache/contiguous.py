"""A contiguous KV cache: one [batch, kv_heads, max_len, head_dim] buffer per layer.

Enough for single-stream generation and evaluation; the generator's paged cache (exl.cache.paged)
serves many sequences at once.
"""

from __future__ import annotations

import torch

from exl.cache.base import AttentionContext
from exl.modules import fused
from exl.modules.attention import attention_mask, scaled_attention


class KVCache:
    """Keys and values of `batch` sequences that advance together, up to `max_len` tokens."""

    def __init__(self, config, batch: int = 1, max_len: int | None = None, dtype=torch.float32, device="cpu"):
        self.max_len = max_len or config.max_position_embeddings
        shape = (config.num_layers, batch, config.num_kv_heads, self.max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch, self.length = batch, 0

    def context(self, length: int) -> "KVCacheContext":
        if self.length + length > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; {self.length} used, {length} more requested")
        return KVCacheContext(self, length)

    def reset(self) -> None:
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget everything after the first `length` tokens (e.g. rejected draft tokens)."""
        self.length = min(self.length, length)


class KVCacheContext(AttentionContext):
    def __init__(self, cache: KVCache, length: int):
        start = cache.length
        pos = torch.arange(start, start + length, device=cache.k.device).expand(cache.batch, length)
        super().__init__(pos)
        self.cache, self.start, self.end = cache, start, start + length

    def attend(self, layer, q, k, v, *, scale, window=None, softcap=None):
        c = self.cache
        if c.k.dtype is torch.float32:  # store and attend in one call (the paged cache's kernel and order)
            ext = fused.ops(q)
            if ext is not None:
                return ext.decode_attention(q, k, v, c.k, c.v, layer, self.start, scale, window or 0, softcap or 0.0)
        c.k[layer, :, :, self.start : self.end] = k.transpose(1, 2)
        c.v[layer, :, :, self.start : self.end] = v.transpose(1, 2)
        lo = 0 if window is None else max(0, self.start - window + 1)
        keys, values = c.k[layer, :, :, lo : self.end], c.v[layer, :, :, lo : self.end]
        q = q.transpose(1, 2)
        t = q.shape[2]
        if t == 1:
            mask = None  # one query sees every kept key
        elif window is None and self.start == 0:
            return scaled_attention(q, keys, values, scale=scale, causal=True, softcap=softcap).transpose(1, 2)
        else:
            k_pos = torch.arange(lo, self.end, device=q.device).expand(q.shape[0], -1)
            mask = attention_mask(self.positions, k_pos, window)
        return scaled_attention(q, keys, values, scale=scale, mask=mask, softcap=softcap).transpose(1, 2)

    def finish(self):
        self.cache.length = self.end
