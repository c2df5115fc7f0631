"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

The Llama block with its MLP replaced by a router choosing the top-k of E expert MLPs per token
(weights = softmax of router logits over the chosen experts); Qwen2-MoE adds an always-on shared
expert scaled by a sigmoid gate. Qwen MoE models may keep dense MLPs on some layers.
"""

from exl.models.base import Builder, CausalLM, register
from exl.models.llama import DecoderBlock
from exl.modules.mlp import SparseMoE


@register("MixtralForCausalLM")
class Mixtral(CausalLM):
    def build_block(self, b: Builder, layer: int, prefix: str):
        c = self.config
        moe = f"{prefix}.block_sparse_moe"
        experts = [b.mlp(f"{moe}.experts.{e}", names=("w1", "w3", "w2")) for e in range(c.num_experts)]
        return DecoderBlock(
            b.norm(f"{prefix}.input_layernorm.weight"),
            b.attention(f"{prefix}.self_attn", layer),
            b.norm(f"{prefix}.post_attention_layernorm.weight"),
            SparseMoE(b.linear(f"{moe}.gate", c.hidden_size, c.num_experts), experts, c.num_experts_per_tok),
        )


@register("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
class QwenMoe(CausalLM):
    def build_block(self, b: Builder, layer: int, prefix: str):
        c = self.config
        qwen3 = c.architecture.startswith("Qwen3")
        sparse = c.num_experts > 0 and layer not in c.mlp_only_layers and (layer + 1) % c.decoder_sparse_step == 0
        if sparse:
            experts = [b.mlp(f"{prefix}.mlp.experts.{e}", c.moe_intermediate_size) for e in range(c.num_experts)]
            shared = shared_gate = None
            if c.shared_expert_intermediate_size:
                shared = b.mlp(f"{prefix}.mlp.shared_expert", c.shared_expert_intermediate_size)
                shared_gate = b.linear(f"{prefix}.mlp.shared_expert_gate", c.hidden_size, 1)
            mlp = SparseMoE(b.linear(f"{prefix}.mlp.gate", c.hidden_size, c.num_experts), experts,
                            c.num_experts_per_tok, c.norm_topk_prob, shared, shared_gate)
        else:
            mlp = b.mlp(f"{prefix}.mlp")
        return DecoderBlock(
            b.norm(f"{prefix}.input_layernorm.weight"),
            b.attention(f"{prefix}.self_attn", layer, qkv_bias=not qwen3 or c.attention_bias,
                        o_bias=qwen3 and c.attention_bias, qk_norm=qwen3),
            b.norm(f"{prefix}.post_attention_layernorm.weight"),
            mlp,
        )
