"""Gemma 3 (text).

Sandwich norms around both sub-blocks, GeGLU MLP, q/k RMSNorm, embeddings scaled by √d,
RMSNorm weights stored as (w - 1), interleaved sliding-window (local RoPE base) and global
layers, attention scale 1/√query_pre_attn_scalar, optional final-logit soft-capping (the
attention soft-capping of Gemma 2 is not used by Gemma 3, as in transformers).

    h   = x + PostAttnNorm(Attn(PreAttnNorm(x)))
    out = h + PostFFNorm(MLP(PreFFNorm(h)))
"""

from torch import nn

from exl.models.base import Builder, CausalLM, register
from exl.modules import fused


class Gemma3Block(nn.Module):
    def __init__(self, pre_attn, attn, post_attn, pre_ff, mlp, post_ff):
        super().__init__()
        self.pre_attn, self.attn, self.post_attn = pre_attn, attn, post_attn
        self.pre_ff, self.mlp, self.post_ff = pre_ff, mlp, post_ff

    def forward(self, x, ctx):
        ext = fused.ops(x)
        if ext is None:
            x = x + self.post_attn(self.attn(self.pre_attn(x), ctx))
            return x + self.post_ff(self.mlp(self.pre_ff(x)))
        # Fused: each post-norm, residual add and the next pre-norm in one pass (all norms share eps).
        eps = self.pre_attn.eps
        a = self.attn(ext.rms_norm(x, self.pre_attn.weight, eps), ctx)
        x, h = ext.add_rms_norm(a, x, self.pre_ff.weight, eps, self.post_attn.weight)
        return ext.add_rms_norm(self.mlp(h), x, None, eps, self.post_ff.weight)[0]

    def cpu_step(self, ext, ropes: list):
        """This block in the one-call decode step (exl.modules.fused.step), or None."""
        attn, ffn = fused.step(self.attn, ext, ropes), fused.step(self.mlp, ext)
        if attn is None or ffn is None:
            return None
        eps = self.pre_attn.eps
        return ext.BlockStep(self.pre_attn.weight, eps, attn, self.post_attn.weight, self.pre_ff.weight, eps, ffn,
                             self.post_ff.weight)


@register("Gemma3ForCausalLM")
class Gemma3(CausalLM):
    norm_offset = 1.0

    def __init__(self, config, *args, **kwargs):
        self.embed_scale = config.hidden_size**0.5
        super().__init__(config, *args, **kwargs)

    def build_block(self, b: Builder, layer: int, prefix: str):
        c = self.config
        scale = (c.query_pre_attn_scalar or c.head_dim) ** -0.5
        norm = lambda name: b.norm(f"{prefix}.{name}.weight", offset=1.0)  # noqa: E731
        return Gemma3Block(
            norm("input_layernorm"),
            b.attention(f"{prefix}.self_attn", layer, qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                        qk_norm=True, norm_offset=1.0, scale=scale),  # Gemma 3 ignores attn_logit_softcapping
            norm("post_attention_layernorm"),
            norm("pre_feedforward_layernorm"),
            b.mlp(f"{prefix}.mlp"),
            norm("post_feedforward_layernorm"),
        )
