"""Model configuration: one normalized view of a Hugging Face `config.json` (transformers 4.x and 5.x)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from exl.errors import ModelLoadError
from exl.format import READABLE_VERSIONS


@dataclass
class RopeConfig:
    """Rotary embedding settings for one kind of layer (see transformers' modeling_rope_utils)."""

    type: str = "default"  # default | linear | dynamic | llama3 | yarn
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn
    truncate: bool = True  # yarn
    partial_rotary_factor: float = 1.0

    @classmethod
    def parse(cls, params: dict | None, theta: float | None, max_pos: int) -> "RopeConfig":
        p = dict(params or {})
        kind = p.get("rope_type") or p.get("type") or "default"
        if kind not in ("default", "linear", "dynamic", "llama3", "yarn"):
            raise ModelLoadError(f"unsupported rope type {kind!r} (supported: default, linear, dynamic, llama3, yarn)")
        base = p.get("rope_theta", theta)
        out = cls(type=kind, theta=float(base if base is not None else 10000.0))
        for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                     "mscale", "mscale_all_dim", "attention_factor", "partial_rotary_factor"):
            if p.get(name) is not None:
                setattr(out, name, float(p[name]))
        if "truncate" in p:
            out.truncate = bool(p["truncate"])
        if kind in ("llama3", "yarn"):
            out.original_max_position_embeddings = int(p.get("original_max_position_embeddings") or max_pos)
        return out


ROPE_KEYS = ("rope_type", "type", "rope_theta", "factor")


@dataclass
class ModelConfig:
    """The parts of config.json that exl's models use. `raw` keeps the whole file."""

    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    attention_bias: bool
    layer_types: list[str]
    rope: dict[str, RopeConfig]  # by layer type
    sliding_window: int | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # mixture of experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    quantization: dict | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        file = path / "config.json"
        if not path.is_dir():
            raise ModelLoadError(f"{path}: not a folder. Pass the model folder that holds config.json and *.safetensors.")
        if not file.is_file():
            raise ModelLoadError(f"{path}: no config.json in this folder. Is this a Hugging Face model folder? "
                                 "(GGUF files can be imported with `exl import-gguf FILE -o DIR`.)")
        try:
            raw = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{file}: not valid JSON ({e})") from e
        return cls.from_dict(raw, source=str(file))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        if "text_config" in raw and "hidden_size" not in raw:  # multimodal wrapper: use the text model
            raw = {**raw["text_config"], "architectures": raw.get("architectures")}
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else _ARCH_BY_TYPE.get(raw.get("model_type", ""), "")
        if not arch:
            raise ModelLoadError(f"{source}: no 'architectures' entry and unknown model_type {raw.get('model_type')!r}")

        def need(key, *alts):
            for k in (key, *alts):
                if raw.get(k) is not None:
                    return raw[k]
            raise ModelLoadError(f"{source}: missing required key {key!r}")

        _check_quantization(raw.get("quantization_config"), source)
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        layers = int(need("num_hidden_layers"))
        max_pos = int(raw.get("max_position_embeddings") or 2048)
        window = raw.get("sliding_window")
        layer_types = raw.get("layer_types") or _default_layer_types(raw, layers)
        rope = _parse_rope(raw, max_pos, set(layer_types))
        eos = raw.get("eos_token_id")
        experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
        return cls(
            architecture=arch,
            model_type=raw.get("model_type", ""),
            hidden_size=hidden,
            intermediate_size=int(raw.get("intermediate_size") or 0),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            vocab_size=int(need("vocab_size")),
            rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
            attention_bias=bool(raw.get("attention_bias", False)),
            layer_types=list(layer_types),
            rope=rope,
            sliding_window=int(window) if window else None,
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            attn_logit_softcapping=raw.get("attn_logit_softcapping"),
            num_experts=experts,
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or raw.get("intermediate_size") or 0),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
            decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
            mlp_only_layers=list(raw.get("mlp_only_layers") or []),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos if isinstance(eos, list) else ([eos] if eos is not None else []),
            quantization=raw.get("quantization_config"),
            raw=raw,
        )

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention" and self.sliding_window is not None

    def rope_for(self, layer: int) -> RopeConfig:
        kind = self.layer_types[layer]
        return self.rope.get(kind) or self.rope["full_attention"]


def _check_quantization(qc, source: str) -> None:
    """Refuse an exl folder written in a format version this exl cannot read (docs/format.md)."""
    if not isinstance(qc, dict) or qc.get("quant_method") != "exl":
        return
    version = qc.get("version")
    if version not in READABLE_VERSIONS:
        raise ModelLoadError(f"{source}: quantization_config.version is {version!r}; this exl reads exl format "
                             f"versions {', '.join(map(str, READABLE_VERSIONS))}. A newer exl wrote this folder: "
                             "update exl (pip install -U exl), or convert the model again with this one.")


_ARCH_BY_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def _default_layer_types(raw: dict, layers: int) -> list[str]:
    """Which layers use sliding-window attention, for configs that predate `layer_types`."""
    kind = raw.get("model_type", "")
    window = raw.get("sliding_window")
    if kind.startswith("gemma3"):
        pattern = int(raw.get("sliding_window_pattern") or 6)
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if kind in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if raw.get("use_sliding_window") and window:
            start = int(raw.get("max_window_layers") or layers)
            return ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
        return ["full_attention"] * layers
    if window:  # Mistral and friends: every layer slides
        return ["sliding_attention"] * layers
    return ["full_attention"] * layers


def _parse_rope(raw: dict, max_pos: int, kinds: set[str]) -> dict[str, RopeConfig]:
    theta = raw.get("rope_theta")
    params = raw.get("rope_parameters")
    if params is None:
        params = raw.get("rope_scaling") or {}
    if params and not any(k in params for k in ROPE_KEYS):  # nested by layer type (transformers 5)
        out = {k: RopeConfig.parse(v, theta, max_pos) for k, v in params.items() if isinstance(v, dict)}
    else:
        base = RopeConfig.parse(params, theta, max_pos)
        out = {"full_attention": base}
        if raw.get("rope_local_base_freq") is not None:  # Gemma 3 (transformers 4.x): local layers
            out["sliding_attention"] = RopeConfig(theta=float(raw["rope_local_base_freq"]))
    for kind in kinds:
        out.setdefault(kind, out.get("full_attention") or next(iter(out.values())))
    return out
