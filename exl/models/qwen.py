"""Qwen2 / Qwen2.5 (bias on q, k, v) and Qwen3 (RMSNorm on each query and key head).

Otherwise the Llama block: pre-norm, grouped-query attention with RoPE, SwiGLU MLP.
"""

from exl.models.base import Builder, register
from exl.models.llama import DecoderBlock, Llama


@register("Qwen2ForCausalLM")
class Qwen2(Llama):  # the Llama block
    def build_block(self, b: Builder, layer: int, prefix: str):
        return DecoderBlock(
            b.norm(f"{prefix}.input_layernorm.weight"),
            b.attention(f"{prefix}.self_attn", layer, qkv_bias=True),
            b.norm(f"{prefix}.post_attention_layernorm.weight"),
            b.mlp(f"{prefix}.mlp"),
        )


@register("Qwen3ForCausalLM")
class Qwen3(Llama):
    def build_block(self, b: Builder, layer: int, prefix: str):
        bias = self.config.attention_bias
        return DecoderBlock(
            b.norm(f"{prefix}.input_layernorm.weight"),
            b.attention(f"{prefix}.self_attn", layer, qkv_bias=bias, o_bias=bias, qk_norm=True),
            b.norm(f"{prefix}.post_attention_layernorm.weight"),
            b.mlp(f"{prefix}.mlp"),
        )
