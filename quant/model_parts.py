"""The source model, one piece at a time: embedding, block i, final norm, head.

Only the piece being worked on is in memory (weights are read lazily from the safetensors files),
which is what keeps a conversion's memory bounded by one block.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from exl.config import ModelConfig
from exl.errors import UnsupportedModelError
from exl.format import BLOCK
from exl.loader import TensorLoader
from exl.models.base import ARCHITECTURES, Builder
from exl.modules.linear import Linear
from exl.modules.mlp import SparseMoE
from exl.modules.norm import RMSNorm


@dataclass
class LinearRef:
    """A linear layer of a block: its checkpoint prefix and the module that runs it."""

    name: str  # checkpoint prefix, e.g. model.layers.3.mlp.down_proj
    module: Linear
    parent: nn.Module
    attr: str

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.module.weight.shape)


class _RecordingBuilder(Builder):
    """A Builder that remembers which checkpoint prefix each linear layer came from."""

    def __init__(self, *args):
        super().__init__(*args)
        self.made: list[tuple[str, nn.Module]] = []

    def linear(self, prefix, k, n, bias=False):
        m = super().linear(prefix, k, n, bias)
        self.made.append((prefix, m))
        return m


class SourceModel:
    """Lazy access to a dense Hugging Face model folder, block by block."""

    def __init__(self, path: str | Path, device="cpu"):
        import exl.models  # noqa: F401  (registers the families)

        self.path = Path(path)
        self.config = ModelConfig.from_dir(self.path)
        if self.config.quantization:
            raise UnsupportedModelError(f"{self.path}: this model is already quantized "
                                        f"({self.config.quantization.get('quant_method')}); convert the original "
                                        "float16/bfloat16/float32 model instead.")
        self.family = ARCHITECTURES.get(self.config.architecture)
        if self.family is None:
            raise UnsupportedModelError(f"{self.path / 'config.json'}: architecture {self.config.architecture!r} "
                                        f"is not supported. Supported: {', '.join(sorted(ARCHITECTURES))}.")
        self.loader = TensorLoader(self.path)
        self.device = torch.device(device)
        self._shell = object.__new__(self.family)
        nn.Module.__init__(self._shell)
        self._shell.config = self.config

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def embedding(self) -> torch.Tensor:
        c = self.config
        return self.loader.get("model.embed_tokens.weight", torch.float32, (c.vocab_size, c.hidden_size), self.device)

    def embed_scale(self) -> float | None:
        return self.config.hidden_size**0.5 if self.config.model_type.startswith("gemma") else None

    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = nn.functional.embedding(ids.to(table.device), table)
        scale = self.embed_scale()
        if scale is not None:
            h = h * torch.tensor(scale, dtype=torch.float32)
        return h

    def block(self, i: int) -> tuple[nn.Module, list[LinearRef]]:
        """Block i (float32, on the device) and the linear layers to quantize, in execution order."""
        b = _RecordingBuilder(self.config, self.loader, torch.float32, self.device)
        block = self.family.build_block(self._shell, b, i, f"model.layers.{i}").eval()
        routers = set()
        for m in block.modules():
            if isinstance(m, SparseMoE):
                routers.update(id(x) for x in (m.router, m.shared_gate) if x is not None)
        parents = {id(child): (parent, attr) for parent in block.modules() for attr, child in parent.named_children()}
        refs = []
        for prefix, m in b.made:
            if id(m) in routers or not isinstance(m, Linear) or m.in_features % BLOCK:
                continue  # routers stay dense; K must be a multiple of 32 to be quantized
            parent, attr = parents[id(m)]
            refs.append(LinearRef(prefix, m, parent, attr))
        return block, refs

    def final_norm(self) -> RMSNorm:
        return RMSNorm(self.loader.get("model.norm.weight", torch.float32, (self.config.hidden_size,), self.device),
                       self.config.rms_norm_eps, self.family.norm_offset)

    def head_weight(self) -> torch.Tensor:
        c = self.config
        name = "lm_head.weight" if "lm_head.weight" in self.loader else "model.embed_tokens.weight"
        return self.loader.get(name, torch.float32, (c.vocab_size, c.hidden_size), self.device)

    @property
    def tied(self) -> bool:
        return "lm_head.weight" not in self.loader

    def logits(self, h: torch.Tensor, norm: RMSNorm, head: torch.Tensor) -> torch.Tensor:
        z = norm(h) @ head.T
        cap = self.config.final_logit_softcapping
        return cap * torch.tanh(z / cap) if cap else z
