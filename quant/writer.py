"""Write the converted model folder (docs/format.md §3): shards, index, config.json, tokenizer files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from exl.files import public_mode
from exl.format import FORMAT_VERSION
from quant.faults import before_commit

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json")


def stored_dtype(name: str, t: torch.Tensor) -> torch.Tensor:
    """Non-quantized tensors: norms float32, other floats float16, integers unchanged."""
    if not t.is_floating_point():
        return t
    return t.to(torch.float32) if "norm" in name else t.to(torch.float16)


def _atomic_save(tensors: dict, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    public_mode(tmp)  # safetensors creates files 0600; the model is as readable as every other file
    before_commit(path)
    os.replace(tmp, path)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    before_commit(path)
    os.replace(tmp, path)


def atomic_copy(src: Path, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.copyfile(src, tmp)
    before_commit(path)
    os.replace(tmp, path)


def write_text(path: Path, text: str) -> None:
    """Write an output file under a temporary name and rename it into place."""
    _atomic_text(path, text)


def write_shards(out: Path, items: list[tuple[str, int, object]], shard_bytes: int) -> list[str]:
    """items: (name, bytes, fetch) in output order, fetch() giving the tensor. Writes `model.safetensors`
    or `model-0000i-of-0000n.safetensors` + index, holding one shard in memory at a time."""
    plan: list[list] = [[]]
    size = 0
    for item in items:
        if plan[-1] and size + item[1] > shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append(item)
        size += item[1]
    n = len(plan)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for f in out.glob("model*.safetensors"):  # stale shards of an earlier run with another shard count
        if f.name not in names:
            f.unlink()
    for fname, shard in zip(names, plan):
        _atomic_save({name: fetch().contiguous() for name, _, fetch in shard}, out / fname)
    index = out / "model.safetensors.index.json"
    if n > 1:
        total = sum(b for shard in plan for _, b, _ in shard)
        weight_map = {name: fname for fname, shard in zip(names, plan) for name, _, _ in shard}
        _atomic_text(index, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    elif index.exists():
        index.unlink()
    return names


def write_config(src_dir: Path, out: Path, quantization: dict, untie: bool) -> None:
    config = json.loads((src_dir / "config.json").read_text())
    if untie:
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):
            config["text_config"]["tie_word_embeddings"] = False
    config["torch_dtype"] = "float16"
    config["quantization_config"] = {"quant_method": "exl", "version": FORMAT_VERSION, **quantization}  # 2 with trellis layers
    _atomic_text(out / "config.json", json.dumps(config, indent=2) + "\n")


def copy_tokenizer(src_dir: Path, out: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            atomic_copy(src_dir / name, out / name)
            copied.append(name)
    return copied
