"""Lazy, validated access to the tensors of a model folder (one or many safetensors shards)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from exl.errors import ModelLoadError


class TensorLoader:
    """Reads tensors one at a time from `*.safetensors` files, never whole files into RAM.

    Finds shards through `model.safetensors.index.json` when present, else by globbing.
    Every error names the folder, file and tensor involved.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.files: dict[str, Path] = {}  # tensor name -> file
        self._handles: dict[Path, object] = {}
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from e
            for shard in sorted(set(weight_map.values())):
                if not (self.path / shard).is_file():
                    raise ModelLoadError(f"{index} lists {shard}, which is missing from {self.path}. "
                                         "Download the missing shard or remove the index.")
            files = sorted({self.path / f for f in weight_map.values()})
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{self.path}: no *.safetensors files. exl loads safetensors weights "
                                 "(GGUF files: `exl import-gguf FILE -o DIR`).")
        for file in files:
            for name in self._open(file).keys():
                self.files[name] = file

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ModelLoadError(f"{file}: cannot read safetensors file ({e}). "
                                     "The file may be truncated or corrupt: download or convert it again.") from e
        return self._handles[file]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def keys(self):
        return self.files.keys()

    def with_prefix(self, prefix: str) -> list[str]:
        return [k for k in self.files if k.startswith(prefix)]

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype such as "F16") of a stored tensor, without reading its data."""
        if name not in self.files:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing.")
        sl = self._open(self.files[name]).get_slice(name)
        return tuple(sl.get_shape()), sl.get_dtype()

    def get(self, name: str, dtype: torch.dtype | None = None, shape: tuple | None = None,
            device: str | torch.device = "cpu") -> torch.Tensor:
        """One tensor, optionally converted and checked against an expected shape."""
        if name not in self.files:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing. The checkpoint does not match "
                                 "its config.json (wrong architecture or incomplete download?).")
        file = self.files[name]
        try:
            t = self._open(file).get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"{file}: cannot read tensor {name!r} ({e}). "
                                 "The file may be truncated or corrupt.") from e
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ModelLoadError(f"{file}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)} "
                                 "from config.json.")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        return t.to(device)

    def get_group(self, prefix: str, suffixes, device="cpu") -> dict[str, torch.Tensor]:
        """All tensors `prefix.suffix` that exist, keyed by suffix (used for quantized layers)."""
        return {s: self.get(f"{prefix}.{s}", device=device) for s in suffixes if f"{prefix}.{s}" in self}
