"""Llama 2/3.x, SmolLM2 and Mistral.

A pre-norm decoder block:  h = x + Attn(RMSNorm(x));  out = h + SwiGLU(RMSNorm(h)),
with grouped-query attention and rotary embeddings (any rope scaling; Mistral's sliding window).
"""

import torch
from torch import nn

from exl.cache.contiguous import KVCacheContext
from exl.models.base import Builder, CausalLM, register
from exl.modules import fused
from exl.modules.mlp import GatedMLP
from exl.modules.quant_linear import KernelLinear


class DecoderBlock(nn.Module):
    def __init__(self, attn_norm, attn, mlp_norm, mlp):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp

    def forward(self, x, ctx):
        ext = fused.ops(x)
        if ext is None:
            x = x + self.attn(self.attn_norm(x), ctx)
            return x + self.mlp(self.mlp_norm(x))
        # Fused: the residual adds are written over the sublayer outputs (fresh tensors), never over x.
        a = self.attn(ext.rms_norm(x, self.attn_norm.weight, self.attn_norm.eps), ctx)
        x, h = ext.add_rms_norm(a, x, self.mlp_norm.weight, self.mlp_norm.eps)
        return self.mlp(h).add_(x)


@register("LlamaForCausalLM", "MistralForCausalLM")
class Llama(CausalLM):
    def build_block(self, b: Builder, layer: int, prefix: str):
        bias = self.config.attention_bias
        return DecoderBlock(
            b.norm(f"{prefix}.input_layernorm.weight"),
            b.attention(f"{prefix}.self_attn", layer, qkv_bias=bias, o_bias=bias),
            b.norm(f"{prefix}.post_attention_layernorm.weight"),
            b.mlp(f"{prefix}.mlp"),
        )

    # -- decode in one call (Llama, Mistral, SmolLM2, and Qwen2/3, which reuse this block) --------------------
    # One new token of one sequence with a contiguous float32 cache: every block runs inside the CPU extension's
    # DecoderStackCPU (the same kernels and fused ops as the blocks' fused path, without the Python between them).
    # Quantized models only; anything else (prefill, batches, the paged cache, hooks, autograd) runs block by block.

    _stack = None  # the DecoderStackCPU, False where it does not apply; built on first use

    def decode_blocks(self, h, ctx):
        if (h.shape[0] != 1 or h.shape[1] != 1 or type(ctx) is not KVCacheContext
                or ctx.cache.k.dtype is not torch.float32):
            return None
        ext = fused.ops(h)
        if ext is None:
            return None
        if self._stack is None:
            self._stack = self._build_stack(ext)
        if not self._stack or self._hooked():
            return None
        cos, sin = ctx.rope(self.layers[0].attn.rope, h.dtype)
        return self._stack.forward(h, ctx.cache.k, ctx.cache.v, ctx.start, cos, sin)

    def _build_stack(self, ext):
        if not hasattr(ext, "DecoderStackCPU") or not len(self.layers):
            return False
        first = self.layers[0]
        stack, rope = ext.DecoderStackCPU(), first.attn.rope
        for block in self.layers:
            a, m = block.attn, block.mlp
            linears = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, getattr(m, "gate", None), getattr(m, "up", None),
                       getattr(m, "down", None)]
            if (type(block) is not DecoderBlock or type(m) is not GatedMLP or m.act_kind is None or a.rope is not rope
                    or block.attn_norm.eps != block.mlp_norm.eps
                    or not all(isinstance(q, KernelLinear) and q.kernel() is not None for q in linears)
                    or {(q.gemm_min_rows, q.exact) for q in linears} != {(a.q_proj.gemm_min_rows, a.q_proj.exact)}):
                return False
            stack.add_block(a.layer, block.attn_norm.weight, block.mlp_norm.weight, block.attn_norm.eps,
                            *[q.kernel() for q in linears], heads=a.num_heads, kv_heads=a.num_kv_heads,
                            head_dim=a.head_dim, scale=a.scale, window=a.window or 0, softcap=a.softcap or 0.0,
                            act=m.act_kind, gemm_min_rows=a.q_proj.gemm_min_rows, exact=a.q_proj.exact,
                            q_norm=a.q_norm.weight if a.q_norm is not None else None,
                            k_norm=a.k_norm.weight if a.k_norm is not None else None,
                            qk_eps=a.q_norm.eps if a.q_norm is not None else 1e-6)
        self._hook_targets = [mod for block in self.layers for mod in block.modules()]
        return stack

    def _hooked(self) -> bool:
        """Forward hooks anywhere in the blocks (or global ones) need the module-by-module path."""
        g = nn.modules.module
        return bool(g._global_forward_hooks or g._global_forward_pre_hooks) or any(
            m._forward_hooks or m._forward_pre_hooks for m in self._hook_targets)

    def _apply(self, fn, *args, **kwargs):  # moved or converted: the kernels are rebuilt, so is the stack
        self._stack = None
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        self._stack = None
        return super()._load_from_state_dict(*args, **kwargs)
