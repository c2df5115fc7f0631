"""Llama 2/3.x, SmolLM2 and Mistral.

A pre-norm decoder block:  h = x + Attn(RMSNorm(x));  out = h + SwiGLU(RMSNorm(h)),
with grouped-query attention and rotary embeddings (any rope scaling; Mistral's sliding window).
"""

from torch import nn

from exl.models.base import Builder, CausalLM, register
from exl.modules import fused


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

    def cpu_step(self, ext, ropes: list):
        """This block in the one-call decode step (exl.modules.fused.step), or None."""
        attn, ffn = fused.step(self.attn, ext, ropes), fused.step(self.mlp, ext)
        if attn is None or ffn is None:
            return None
        return ext.BlockStep(self.attn_norm.weight, self.attn_norm.eps, attn, None, self.mlp_norm.weight,
                             self.mlp_norm.eps, ffn, None)


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
