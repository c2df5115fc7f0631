"""Export a Llama-family Hugging Face folder (dense weights) as a llama-architecture GGUF file.

    from exl.gguf_export import export_gguf
    export_gguf("SmolLM2-135M-Instruct", "smollm2-f16.gguf", dtype="f16")

This is how benchmarks hand the very same weights and tokenizer to llama.cpp. Tensors are written as
F32 or F16 (norms and biases always F32, as llama.cpp does), with llama.cpp's q/k row order; the
byte-level BPE tokenizer, special tokens and chat template go into the metadata. The inverse of
`exl.gguf_import.import_gguf`: importing an exported file gives back the same tensors and tokenizer.

CLI: `python -m exl.gguf_export HF_DIR OUT.gguf [--dtype f32|f16]`
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from exl.errors import ExlError, ModelLoadError, UnsupportedModelError
from exl.gguf_import import (GLOBAL_NAMES, LAYER_NAMES, SPLIT_PATTERNS, TOKEN_CONTROL, TOKEN_NORMAL,
                             TOKEN_USER_DEFINED, llama3_rope_freqs, permute_rows)

TOKEN_UNUSED = 5
GGUF_NAMES = {v: k for k, v in GLOBAL_NAMES.items()}
GGUF_LAYER_NAMES = {v: k for k, v in LAYER_NAMES.items()}
SUPPORTED = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}


def _load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing; a Hugging Face model folder needs it") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


# ---------------------------------------------------------------------------------------------------------------
# config


def check_config(hf_dir: Path, config: dict) -> None:
    """Raise UnsupportedModelError unless `config` describes a dense Llama-family model."""
    kind = config.get("model_type")
    if kind not in SUPPORTED:
        raise UnsupportedModelError(f"{hf_dir}: model_type {kind!r} cannot be exported; supported: {sorted(SUPPORTED)}")
    if config.get("quantization_config"):
        raise UnsupportedModelError(f"{hf_dir}: the weights are quantized; export_gguf needs a dense (float) model")
    if config.get("sliding_window"):
        raise UnsupportedModelError(f"{hf_dir}: sliding-window attention has no llama-architecture GGUF equivalent")
    if config.get("hidden_act", "silu") != "silu" or config.get("mlp_bias"):
        raise UnsupportedModelError(f"{hf_dir}: only SiLU MLPs without bias are supported by the llama GGUF format")


def rope_settings(config: dict) -> tuple[float, dict]:
    """(rope theta, scaling parameters) from a config written by transformers 4 (rope_scaling) or 5 (rope_parameters)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(config.get("rope_theta") or params.get("rope_theta") or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return theta, params


def add_model_metadata(writer, hf_dir: Path, config: dict, file_type: int) -> dict:
    """Write the llama.* keys; returns the derived sizes needed for the tensors."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    theta, rope = rope_settings(config)

    writer.add_name(hf_dir.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if rope["rope_type"] in ("linear", "yarn"):
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope["rope_type"] not in ("default", "llama3"):
        raise UnsupportedModelError(f"{hf_dir}: rope type {rope['rope_type']!r} cannot be written to GGUF")
    writer.add_file_type(file_type)
    return {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "theta": theta, "rope": rope}


# ---------------------------------------------------------------------------------------------------------------
# tokenizer


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _pre_tokenizer_name(hf_dir: Path, pre: dict | None) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a tokenizer.json pre-tokenizer."""
    parts = pre.get("pretokenizers", [pre]) if pre else []
    types = [p["type"] for p in parts]
    if types == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"  # llama.cpp's name for GPT-2's split regex
    if types == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "smollm"
    if types == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        pattern = parts[0].get("pattern", {}).get("Regex")
        for name, regex in SPLIT_PATTERNS.items():
            if regex == pattern:
                return name
    raise UnsupportedModelError(f"{hf_dir}/tokenizer.json: pre-tokenizer {types} has no llama.cpp equivalent known to exl")


def _adds_token(post: dict | None, token_id: int | None, first: bool) -> bool:
    """Whether a tokenizer.json post-processor puts `token_id` at the start (first) or end of a single text."""
    if not post or token_id is None:
        return False
    for proc in post.get("processors", [post]):
        if proc.get("type") == "TemplateProcessing" and proc.get("single"):
            piece = proc["single"][0 if first else -1]
            if "SpecialToken" in piece:
                ids = proc.get("special_tokens", {}).get(piece["SpecialToken"]["id"], {}).get("ids", [])
                return token_id in ids
    return False


def add_tokenizer_metadata(writer, hf_dir: Path, vocab_size: int) -> None:
    """Write the tokenizer.* keys from tokenizer.json, tokenizer_config.json and the chat template."""
    tok = _load_json(hf_dir / "tokenizer.json")
    tok_config = _load_json(hf_dir / "tokenizer_config.json") if (hf_dir / "tokenizer_config.json").is_file() else {}
    model = tok.get("model", {})
    if model.get("type") != "BPE" or (tok.get("decoder") or {}).get("type") != "ByteLevel":
        raise UnsupportedModelError(
            f"{hf_dir}/tokenizer.json: only byte-level BPE tokenizers can be exported (found model "
            f"{model.get('type')!r}, decoder {(tok.get('decoder') or {}).get('type')!r})"
        )
    ids = dict(model["vocab"])
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    for i, a in added.items():
        ids.setdefault(a["content"], i)
    size = max(vocab_size, max(ids.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [TOKEN_UNUSED] * size
    for text, i in model["vocab"].items():
        tokens[i], types[i] = text, TOKEN_NORMAL
    for i, a in added.items():
        tokens[i], types[i] = a["content"], TOKEN_CONTROL if a.get("special") else TOKEN_USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer_name(hf_dir, tok.get("pre_tokenizer")))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)

    def token_id(name):
        text = _token_text(tok_config.get(name))
        return ids.get(text) if text is not None else None

    special = {k: token_id(f"{k}_token") for k in ("bos", "eos", "unk", "pad")}
    setters = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
               "unk": writer.add_unk_token_id, "pad": writer.add_pad_token_id}
    for name, i in special.items():
        if i is not None:
            setters[name](i)
    post = tok.get("post_processor")
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token", _adds_token(post, special["bos"], True))))
    writer.add_add_eos_token(bool(tok_config.get("add_eos_token", _adds_token(post, special["eos"], False))))

    template = None
    if (hf_dir / "chat_template.jinja").is_file():
        template = (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
    elif tok_config.get("chat_template"):
        template = tok_config["chat_template"]
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if template:
        writer.add_chat_template(template)


# ---------------------------------------------------------------------------------------------------------------
# tensors


def gguf_name(name: str) -> str | None:
    """The GGUF name of an HF tensor; None for buffers llama.cpp does not store (rotary inv_freq)."""
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    if name.endswith("rotary_emb.inv_freq"):
        return None
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in GGUF_LAYER_NAMES:
        return f"blk.{m.group(1)}.{GGUF_LAYER_NAMES[m.group(2)]}"
    raise UnsupportedModelError(f"tensor {name!r} is not part of a Llama model; cannot export it to GGUF")


def weight_files(hf_dir: Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file that holds it."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return {name: hf_dir / f for name, f in _load_json(index)["weight_map"].items()}
    single = hf_dir / "model.safetensors"
    if not single.is_file():
        raise ModelLoadError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json; export needs safetensors weights")
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


def _order(gguf: str) -> tuple:
    m = re.match(r"blk\.(\d+)\.", gguf)
    return (1, int(m.group(1)), gguf) if m else (0 if gguf == "token_embd.weight" else 2, 0, gguf)


def export_gguf(hf_dir: str | os.PathLike, out_path: str | os.PathLike, dtype: str = "f32") -> Path:
    """Write the Llama-family HF folder `hf_dir` as a llama-architecture GGUF at `out_path`; returns `out_path`.

    dtype: "f32" or "f16" for the matrices (1-D tensors stay F32). An existing `out_path` is replaced.
    """
    import gguf
    from safetensors import safe_open
    from tqdm import tqdm

    if dtype not in ("f32", "f16"):
        raise ExlError(f"dtype {dtype!r} is not supported; use 'f32' or 'f16'")
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    config = _load_json(hf_dir / "config.json")
    check_config(hf_dir, config)

    files = weight_files(hf_dir)
    names = {}
    for name in files:
        g = gguf_name(name)
        if g is not None:
            names[g] = name
    if config.get("tie_word_embeddings"):
        names.pop("output.weight", None)  # a tied head is the embedding; llama.cpp reuses token_embd
    elif "output.weight" not in names:
        raise ModelLoadError(f"{hf_dir}: lm_head.weight is missing but tie_word_embeddings is false")

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, "llama")
    try:
        file_type = gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16
        sizes = add_model_metadata(writer, hf_dir, config, int(file_type))
        add_tokenizer_metadata(writer, hf_dir, config["vocab_size"])

        handles = {}

        def load(name) -> torch.Tensor:
            path = files[name]
            if path not in handles:
                handles[path] = safe_open(path, "pt")
            return handles[path].get_tensor(name)

        def shape_of(name):
            path = files[name]
            if path not in handles:
                handles[path] = safe_open(path, "pt")
            return handles[path].get_slice(name).get_shape()

        plan = []  # (gguf name, hf name or None, numpy dtype, shape)
        for g in sorted(names, key=_order):
            shape = shape_of(names[g])
            np_dtype = np.float16 if dtype == "f16" and len(shape) > 1 else np.float32
            plan.append((g, names[g], np_dtype, shape))
        if sizes["rope"]["rope_type"] == "llama3":
            plan.insert(1, ("rope_freqs.weight", None, np.float32, [sizes["head_dim"] // 2]))
        for g, _, np_dtype, shape in plan:
            nbytes = int(np.prod(shape)) * np.dtype(np_dtype).itemsize
            writer.add_tensor_info(g, shape, np.dtype(np_dtype), nbytes)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for g, name, np_dtype, _ in tqdm(plan, desc="exporting tensors", unit="tensor"):
            if name is None:
                array = llama3_rope_freqs(sizes["rope"], sizes["head_dim"], sizes["theta"])
            else:
                w = load(name)
                if not w.is_floating_point():
                    raise UnsupportedModelError(f"{files[name]}: tensor {name!r} has dtype {w.dtype}; only float weights can be exported")
                w = w.float()
                if g.endswith((".attn_q.weight", ".attn_q.bias")):
                    w = permute_rows(w, sizes["heads"])
                elif g.endswith((".attn_k.weight", ".attn_k.bias")):
                    w = permute_rows(w, sizes["kv_heads"])
                array = w.contiguous().numpy().astype(np_dtype)
            writer.write_tensor_data(array)
        writer.close()
        os.replace(tmp, out_path)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return out_path


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m exl.gguf_export", description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir", help="Llama-family Hugging Face folder")
    parser.add_argument("out", help="GGUF file to write")
    parser.add_argument("--dtype", choices=["f32", "f16"], default="f32")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {export_gguf(args.hf_dir, args.out, args.dtype)}")
    except ExlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
