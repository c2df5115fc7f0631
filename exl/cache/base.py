"""Attention contexts: what a forward pass needs to know about positions and past keys/values.

A context is made for one forward pass. It gives each token's absolute position (for RoPE) and
performs attention for each layer, storing new keys/values wherever its cache keeps them.
"""

from __future__ import annotations

import torch

from exl.modules.attention import attention_mask, scaled_attention


class AttentionContext:
    """Base class: positions [B, T] plus per-forward caching of RoPE tables."""

    def __init__(self, positions: torch.Tensor):
        self.positions = positions
        self._rope_cache: dict = {}

    def rope(self, rotary, dtype):
        key = (id(rotary), dtype)
        if key not in self._rope_cache:
            self._rope_cache[key] = rotary.cos_sin(self.positions, dtype)
        return self._rope_cache[key]

    def attend(self, layer: int, q, k, v, *, scale, window=None, softcap=None) -> torch.Tensor:
        raise NotImplementedError

    def decode_batch(self):
        """What the one-call decode step (CausalLM.decode_step) reads, when this pass is one it serves:
        (k_store, v_store, page table [B, P], lengths [B], page_size); else None."""
        return None

    def finish(self) -> None:
        """Called once after the last layer."""

    on_launch = None  # set by the context's owner (the generator): run once by launching()

    def launching(self) -> None:
        """Called right before the pass's long GIL-free call (the one-call decode step), and by the owner after the
        pass in case there was none: runs `on_launch` once. What that hands to other threads (streamed tokens for
        the server's event loop) then runs while the kernels do, instead of taking the GIL between this thread's
        short Python steps and making it wait."""
        hook, self.on_launch = self.on_launch, None
        if hook is not None:
            hook()


class NoCache(AttentionContext):
    """Plain causal attention over the tokens of this forward pass only."""

    def __init__(self, batch: int, length: int, device="cpu", offset: int = 0):
        pos = torch.arange(offset, offset + length, device=device).expand(batch, length)
        super().__init__(pos)

    def attend(self, layer, q, k, v, *, scale, window=None, softcap=None):
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        t = q.shape[2]
        mask = attention_mask(self.positions, self.positions, window) if window is not None and window < t else None
        out = scaled_attention(q, k, v, scale=scale, mask=mask, causal=True, softcap=softcap)
        return out.transpose(1, 2)
