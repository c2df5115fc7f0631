"""The work folder: everything a conversion needs to resume after being killed.

Every file is written under a temporary name and renamed into place, so a file either exists whole
or not at all; each pass records one block at a time. A resumed conversion reads back exactly the
bytes it wrote, which is why it finishes with the same output, bit for bit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from quant import faults


class WorkDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def file(self, name: str) -> Path:
        return self.path / name

    def exists(self, name: str) -> bool:
        return (self.path / name).is_file()

    def _tmp(self, target: Path) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        return target.with_name(f".{target.name}.tmp-{os.getpid()}")

    def save_json(self, name: str, obj) -> None:
        target = self.path / name
        tmp = self._tmp(target)
        tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
        faults.before_commit(target)
        os.replace(tmp, target)

    def load_json(self, name: str):
        return json.loads((self.path / name).read_text())

    def save_tensors(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
        target = self.path / name
        tmp = self._tmp(target)
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        faults.before_commit(target)
        os.replace(tmp, target)

    def load_tensors(self, name: str, device="cpu") -> dict[str, torch.Tensor]:
        return load_file(str(self.path / name), device=str(device))

    def remove(self, name: str) -> None:
        try:
            (self.path / name).unlink()
        except FileNotFoundError:
            pass

    def clean_tmp(self) -> None:
        """Remove half-written files left by a killed run."""
        faults.clean_tmp(self.path, recursive=True)
