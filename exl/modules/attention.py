"""Grouped-query self-attention. Where keys and values live is the attention context's business
(no cache, a contiguous cache, or the generator's paged cache): see `exl.cache`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from exl.modules import fused
from exl.modules.norm import RMSNorm
from exl.modules.rope import RotaryEmbedding


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean [B, 1, Tq, Tk]: key j is visible from query i if it is not in the future and,
    with a sliding window, fewer than `window` positions back."""
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask[:, None]


def scaled_attention(q, k, v, *, scale: float, mask: torch.Tensor | None = None, causal: bool = False,
                     softcap: float | None = None) -> torch.Tensor:
    """q: [B, Hq, Tq, D], k/v: [B, Hkv, Tk, D] -> [B, Hq, Tq, D]. GQA by head groups."""
    if q.shape[2] == 1 and mask is None and q.device.type == "cpu":
        # Decode: a single query row. Three small ops beat the CPU flash kernel, whose thread pool
        # costs more than the work at this size (and stalls badly when cores are oversubscribed).
        b, hq, _, d = q.shape
        hkv = k.shape[1]
        scores = (q.reshape(b, hkv, hq // hkv, d) @ k.transpose(-1, -2)) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        return (torch.softmax(scores, dim=-1) @ v).reshape(b, hq, 1, d)
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None and causal:
        tq, tk = q.shape[2], k.shape[2]
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


class Attention(nn.Module):
    """Project to q/k/v, optional q/k RMSNorm, RoPE, attend through the context, project out."""

    def __init__(self, layer: int, q_proj, k_proj, v_proj, o_proj, *, num_heads: int, num_kv_heads: int,
                 head_dim: int, rope: RotaryEmbedding, scale: float, window: int | None = None,
                 softcap: float | None = None, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None):
        super().__init__()
        self.layer = layer
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope, self.scale, self.window, self.softcap = rope, scale, window, softcap
        self.q_norm, self.k_norm = q_norm, k_norm

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        cos, sin = ctx.rope(self.rope, x.dtype)
        ext = fused.ops(x)
        if ext is not None:  # q/k norm and RoPE in one pass, in place
            qn, kn = self.q_norm, self.k_norm
            if qn is None:
                ext.rope_(q, k, cos, sin)
            else:
                ext.rope_(q, k, cos, sin, qn.weight, kn.weight, qn.eps)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        out = ctx.attend(self.layer, q, k, v, scale=self.scale, window=self.window, softcap=self.softcap)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))

    def cpu_step(self, ext, ropes: list):
        """This attention in the one-call decode step (exl.modules.fused.step), or None. ropes: the model's RoPE
        modules in the order the step receives their cos/sin tables (this one is added if new)."""
        linears = [fused.step(m, ext) for m in (self.q_proj, self.k_proj, self.v_proj, self.o_proj)]
        if None in linears:
            return None
        if not any(r is self.rope for r in ropes):
            ropes.append(self.rope)
        index = next(i for i, r in enumerate(ropes) if r is self.rope)
        qn, kn = self.q_norm, self.k_norm
        return ext.AttentionStep(self.layer, *linears, heads=self.num_heads, kv_heads=self.num_kv_heads,
                                 head_dim=self.head_dim, rope=index, scale=self.scale, window=self.window or 0,
                                 softcap=self.softcap or 0.0, q_norm=None if qn is None else qn.weight,
                                 k_norm=None if kn is None else kn.weight, qk_eps=1e-6 if qn is None else qn.eps)
