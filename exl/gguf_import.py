"""Import a llama- or gemma3-architecture GGUF file (llama.cpp's format) as a Hugging Face model folder.

    from exl.gguf_import import import_gguf
    import_gguf("model.Q4_1.gguf", "model-hf")        # config.json, model.safetensors, tokenizer.json, ...

Quantized tensors are dequantized with the `gguf` package; llama.cpp's interleaved q/k row order is
undone (llama only: llama.cpp keeps Gemma's order), and Gemma's RMSNorm weights, which llama.cpp stores
with the +1 applied, get it taken off again, so the folder loads in `transformers` (and in exl) like
the original checkpoint. The folder is
written next to its destination under a temporary name and renamed at the end, so it is never half there.

CLI: `exl import-gguf FILE.gguf -o DIR [--dtype float32|float16|bfloat16] [--force]`
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from exl.errors import ExlError, ModelLoadError, UnsupportedModelError
from exl.gguf_reader import GGUFTensor, read_gguf

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_SHARD_SIZE = 5 * 2**30
IMPORT_VERSION = "1"  # bump when the written folder changes, so cached imports (exl.assets) are redone

# GGUF tensor name -> HF name ({i} is the layer index)
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GEMMA3_LAYER_NAMES = {
    **{k: v for k, v in LAYER_NAMES.items() if not k.endswith(".bias")},
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
ARCHITECTURES = ("llama", "gemma3")
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Pre-tokenizer split patterns per `tokenizer.ggml.pre`, as transformers' GGUF loader uses them.
# Any other value gets GPT-2's byte-level regex (what transformers does too).
_CL100K = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_PATTERNS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral"], _CL100K),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2),
}

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4


# ---------------------------------------------------------------------------------------------------------------
# metadata helpers


def _f32(x: float) -> float:
    """A float32 metadata value as the short decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _require_supported(path, meta) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: architecture {arch!r} is not supported; exl imports {' and '.join(ARCHITECTURES)} GGUF files"
        )
    return arch


# ---------------------------------------------------------------------------------------------------------------
# config


def llama3_rope_parameters(freqs: np.ndarray, head_dim: int, theta: float, context: int) -> dict | None:
    """Recover Llama-3 rope scaling parameters from llama.cpp's `rope_freqs.weight`, or None if none fit."""
    factor = float(freqs.max())
    for original in (8192, 4096, 2048, 16384, 32768, context):
        params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": original}
        if np.allclose(llama3_rope_freqs(params, head_dim, theta), freqs, rtol=1e-4, atol=1e-5):
            return params
    return None


def llama3_rope_freqs(params: dict, head_dim: int, theta: float) -> np.ndarray:
    """llama.cpp's per-frequency rope divisors (`rope_freqs.weight`) for Llama-3 rope scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low, original / high
    smooth = (original / wavelen - low) / (high - low)
    out = np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, factor, 1 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def _metadata_getter(path, meta: dict, arch: str):
    """get(key, default=None): the value of `arch.key`; an error naming the key when it is missing and has no default."""
    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata key '{arch}.{key}' is missing; the file is not a complete {arch} GGUF")
        return value
    return get


def build_config(path, meta: dict, tensors: dict, dtype: torch.dtype) -> dict:
    """config.json for LlamaForCausalLM from GGUF metadata and tensors."""
    get = _metadata_getter(path, meta, "llama")

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(meta.get("llama.attention.key_length", meta.get("llama.rope.dimension_count", hidden // heads)))
    context = int(get("context_length"))
    theta = _f32(get("rope.freq_base", 10000.0))
    vocab = meta.get("llama.vocab_size") or len(meta.get("tokenizer.ggml.tokens", [])) or tensors["token_embd.weight"].shape[0]

    rope_scaling = None
    kind = meta.get("llama.rope.scaling.type")
    if "rope_freqs.weight" in tensors:
        freqs = tensors["rope_freqs.weight"].dequantize()
        rope_scaling = llama3_rope_parameters(freqs, head_dim, theta, context)
        if rope_scaling is None:
            raise UnsupportedModelError(f"{path}: its rope_freqs.weight does not match Llama-3 rope scaling; not supported")
    elif kind in ("linear", "yarn"):
        rope_scaling = {"rope_type": kind, "factor": _f32(get("rope.scaling.factor"))}
        if kind == "yarn":
            rope_scaling["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    elif kind not in (None, "none"):
        raise UnsupportedModelError(f"{path}: rope scaling type {kind!r} is not supported (linear, yarn, llama3 are)")

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": context,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "vocab_size": int(vocab),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensors,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    return config | _special_token_ids(meta)


GEMMA3_SLIDING_PATTERN = 6  # Gemma 3: five sliding-window layers, then one global layer
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # rope base of the sliding-window layers (not stored in GGUF)


def build_gemma3_config(path, meta: dict, tensors: dict, dtype: torch.dtype) -> dict:
    """config.json for Gemma3ForCausalLM (text) from GGUF metadata.

    llama.cpp does not store the layer pattern, the local rope base nor query_pre_attn_scalar: it hard-codes
    Gemma 3's values (every 6th layer global, local base 10000, scale 1/sqrt(head_dim)), and so do we.
    """
    get = _metadata_getter(path, meta, "gemma3")

    layers = int(get("block_count"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length"))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError(f"{path}: gemma3 with key_length != value_length is not supported")
    if meta.get("gemma3.rope.scaling.type") not in (None, "none"):
        raise UnsupportedModelError(f"{path}: rope scaling {meta['gemma3.rope.scaling.type']!r} on gemma3 is not supported")
    vocab = len(meta.get("tokenizer.ggml.tokens", [])) or tensors["token_embd.weight"].shape[0]
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 1000000.0)),
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
        "rope_scaling": None,
        "sliding_window": int(get("attention.sliding_window")),
        "sliding_window_pattern": GEMMA3_SLIDING_PATTERN,
        "layer_types": ["full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                        for i in range(layers)],
        "query_pre_attn_scalar": head_dim,
        "final_logit_softcapping": meta.get("gemma3.final_logit_softcapping"),
        "attn_logit_softcapping": None,
        "vocab_size": int(vocab),
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "tie_word_embeddings": "output.weight" not in tensors,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    return config | _special_token_ids(meta)


def stop_token_ids(meta: dict) -> list[int]:
    """EOS ids for generation: the GGUF's eos and eot, plus Gemma's chat turn end `<end_of_turn>`."""
    tokens = list(meta.get("tokenizer.ggml.tokens", []))
    ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    ids += [i for i, t in enumerate(tokens[:1024]) if t == "<end_of_turn>"]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


# ---------------------------------------------------------------------------------------------------------------
# tensors


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor; None for tensors HF does not store (rope_freqs)."""
    layer_names = GEMMA3_LAYER_NAMES if arch == "gemma3" else LAYER_NAMES
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    if gguf_name == "rope_freqs.weight":
        return None
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}"
    raise UnsupportedModelError(f"tensor {gguf_name!r} is not part of a {arch} model")


def _special_token_ids(meta) -> dict:
    """config.json's bos/eos/pad token ids from the GGUF tokenizer metadata, where present."""
    return {f"{name.replace('padding', 'pad')}_token_id": int(meta[f"tokenizer.ggml.{name}_token_id"])
            for name in ("bos", "eos", "padding") if f"tokenizer.ggml.{name}_token_id" in meta}


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (rotary pairs interleaved per head) -> HF's half-split order."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's q/k row order -> llama.cpp's (inverse of `unpermute_rows`)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_tensor(t: GGUFTensor, config: dict) -> torch.Tensor:
    """Dequantize one GGUF tensor to a float32 torch tensor in HF layout."""
    try:
        values = t.dequantize()
    except NotImplementedError as e:
        raise UnsupportedModelError(f"tensor {t.name!r} has type {t.type.name}, which cannot be dequantized: {e}")
    w = torch.from_numpy(np.array(values))  # a writable copy
    if config["model_type"] == "gemma3_text":  # q/k rows kept in HF order; norms stored as 1 + w
        return w - 1.0 if t.name.endswith("norm.weight") else w
    if t.name.startswith("blk.") and ".attn_q." in t.name:
        w = unpermute_rows(w, config["num_attention_heads"])
    elif t.name.startswith("blk.") and ".attn_k." in t.name:
        w = unpermute_rows(w, config["num_key_value_heads"])
    return w


def plan_shards(names_sizes: list[tuple[str, int]], shard_size: int) -> list[list[str]]:
    """Group tensors (in order) into shards of at most `shard_size` bytes (a bigger tensor gets its own)."""
    shards, current, used = [], [], 0
    for name, size in names_sizes:
        if current and used + size > shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        shards.append(current)
    return shards


def write_weights(tensors: dict[str, GGUFTensor], config: dict, out: Path, dtype: torch.dtype, shard_size: int) -> None:
    """Dequantize all tensors into model.safetensors, or shards plus model.safetensors.index.json."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    itemsize = torch.empty(0, dtype=dtype).element_size()
    by_hf = {}
    arch = "gemma3" if config["model_type"] == "gemma3_text" else "llama"
    for t in tensors.values():
        name = hf_name(t.name, arch)
        if name is not None:
            by_hf[name] = t
    shards = plan_shards([(n, int(t.n_elements) * itemsize) for n, t in by_hf.items()], shard_size)
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    weight_map, total = {}, 0
    with tqdm(total=len(by_hf), desc="importing tensors", unit="tensor") as bar:
        for names, filename in zip(shards, files):
            tensors = {}
            for name in names:
                tensors[name] = read_tensor(by_hf[name], config).to(dtype).contiguous()
                weight_map[name] = filename
                total += tensors[name].numel() * itemsize
                bar.update(1)
            save_file(tensors, out / filename, metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# tokenizer


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (printable bytes map to themselves, others to U+0100...)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece-BPE vocabulary (GGUF stores only pieces and scores).

    SentencePiece merges the pair whose joined piece scores highest; as ordered merges that is every split
    (left, right) of every normal piece into two pieces of the vocabulary, ranked by the joined piece's score.
    """
    ids = {t: i for i, t in enumerate(tokens) if types[i] == TOKEN_NORMAL}
    ranked = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, ids[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_spm_tokenizer(path, meta: dict):
    """A `tokenizers.Tokenizer` for a SentencePiece-BPE vocabulary with byte fallback (`tokenizer.ggml.model == "llama"`,
    as Gemma's): spaces become "▁", no prefix space unless `add_space_prefix`, control/user tokens matched whole."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    tokens = list(meta["tokenizer.ggml.tokens"])
    scores = list(meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))])
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, types), fuse_unk=True, byte_fallback=True,
                               unk_token=tokens[unk] if unk is not None else None))
    steps = [normalizers.Replace(" ", "▁")]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED])
    _add_post_processor(tok, meta, tokens)
    return tok


def build_tokenizer(path, meta: dict):
    """A `tokenizers.Tokenizer` from the GGUF vocabulary: byte-level BPE ("gpt2") or SentencePiece BPE ("llama")."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        return build_spm_tokenizer(path, meta)
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"{path}: tokenizer type {kind!r} is not supported; exl imports byte-level BPE ('gpt2') and "
            f"SentencePiece ('llama') vocabularies"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    spelled = [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {}
    for i, t in enumerate(spelled):
        vocab.setdefault(t, i)

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               continuing_subword_prefix="", end_of_word_suffix=""))
    split = SPLIT_PATTERNS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()

    # control tokens are special; user-defined ones are matched whole but not special
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
               if k == TOKEN_CONTROL and set(t) <= letters]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
            if k == TOKEN_USER_DEFINED and t in vocab]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    _add_post_processor(tok, meta, tokens)
    return tok


def _add_post_processor(tok, meta: dict, tokens: list[str]) -> None:
    """BOS/EOS added around encoded text as `tokenizer.ggml.add_bos_token`/`add_eos_token` say."""
    from tokenizers import processors

    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    prefix = [(tokens[bos], bos)] if meta.get("tokenizer.ggml.add_bos_token") and bos is not None else []
    suffix = [(tokens[eos], eos)] if meta.get("tokenizer.ggml.add_eos_token") and eos is not None else []
    p, s = " ".join(t for t, _ in prefix), " ".join(t for t, _ in suffix)
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(x for x in (p, "$A:0", s) if x),
        pair=" ".join(x for x in (p, "$A:0", s, p, "$B:1", s) if x),
        special_tokens=list(dict(prefix + suffix).items()),
    )


# Gemma's turn format, for gemma3 GGUF files that carry no `tokenizer.chat_template`: a system message is put
# in front of the first user turn, the assistant's role is called "model", every turn ends with <end_of_turn>.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none -%}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{%- if (message['role'] == 'user') != loop.index0 is even -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{%- if loop.first and system is not none -%}{{ system | trim + '\n\n' }}{%- endif -%}"
    "{{ message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def tokenizer_files(meta: dict, context: int) -> dict[str, str]:
    """tokenizer_config.json, special_tokens_map.json and chat_template.jinja contents."""
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    special = {name: token(key) for name, key in
               (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding"))}
    special = {k: v for k, v in special.items() if v is not None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        **special,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
    }
    files = {"special_tokens_map.json": json.dumps(special, indent=2, ensure_ascii=False) + "\n"}
    template = meta.get("tokenizer.chat_template")
    if not template and meta.get("general.architecture") == "gemma3":
        template = GEMMA_CHAT_TEMPLATE
    if template:
        config["chat_template"] = template
        files["chat_template.jinja"] = template
    files["tokenizer_config.json"] = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    return files


# ---------------------------------------------------------------------------------------------------------------
# the whole folder


def _prepare_output(out_dir: Path, force: bool) -> Path:
    """Check the destination and make an empty temp dir next to it."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ExlError(f"output {out_dir} exists and is not a folder; choose another path")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ExlError(f"output folder {out_dir} is not empty; choose another path or pass --force (force=True) to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))


def _commit_output(tmp: Path, out_dir: Path) -> None:
    """Give the temp folder normal permissions and move it to `out_dir` (replacing what is there)."""
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    for f in tmp.iterdir():
        f.chmod(0o666 & ~umask)
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)


def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype | str = torch.float32,
                shard_size: int = DEFAULT_SHARD_SIZE, force: bool = False) -> Path:
    """Convert a llama- or gemma3-architecture GGUF file into a Hugging Face folder at `out_dir`; returns `out_dir`.

    dtype: torch dtype (or "float32"/"float16"/"bfloat16") of the written weights.
    shard_size: most bytes per safetensors file; more than that gives shards plus an index.
    force: replace a non-empty `out_dir` (otherwise that is an error).
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ExlError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    gguf_file = read_gguf(gguf_path)
    meta, tensors = gguf_file.metadata, gguf_file.tensors
    arch = _require_supported(gguf_path, meta)
    for name in tensors:
        try:
            hf_name(name, arch)
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"{gguf_path}: {e}") from None
    config = (build_gemma3_config if arch == "gemma3" else build_config)(gguf_path, meta, tensors, dtype)
    tokenizer = build_tokenizer(gguf_path, meta)

    tmp = _prepare_output(out_dir, force)
    try:
        write_weights(tensors, config, tmp, dtype, shard_size)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        if len(stop_token_ids(meta)) > 1:
            generation["eos_token_id"] = stop_token_ids(meta)
        (tmp / "generation_config.json").write_text(json.dumps({"_from_model_config": True, **generation}, indent=2) + "\n")
        tokenizer.save(str(tmp / "tokenizer.json"))
        for name, text in tokenizer_files(meta, config["max_position_embeddings"]).items():
            (tmp / name).write_text(text)
        _commit_output(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def parse_size(text: str) -> int:
    """'500MB', '2GB', '1.5GiB' or a plain byte count -> bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise ExlError(f"cannot read size {text!r}; write it like 500MB or 2GB")
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def add_arguments(parser) -> None:
    parser.add_argument("gguf", help="llama- or gemma3-architecture .gguf file")
    parser.add_argument("-o", "--output", required=True, help="folder to write the Hugging Face model into")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weight dtype (default float32)")
    parser.add_argument("--shard-size", default="5GB", help="largest safetensors file, e.g. 2GB (default 5GB)")
    parser.add_argument("--force", action="store_true", help="replace the output folder if it is not empty")


def run(args) -> int:
    out = import_gguf(args.gguf, args.output, dtype=args.dtype, shard_size=parse_size(args.shard_size), force=args.force)
    print(f"wrote {out}")
    return 0
