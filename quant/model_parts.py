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
from exl.models.base import Builder, CausalLM
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
    """A Builder that remembers which checkpoint name each linear layer and norm came from. Linears named in
    `unread` get a weight on the meta device (nothing read): their caller replaces them."""

    def __init__(self, *args, unread: frozenset[str] = frozenset()):
        super().__init__(*args)
        self.unread = unread
        self.made: list[tuple[str, nn.Module]] = []
        self.norms: list[tuple[str, RMSNorm]] = []

    def linear(self, prefix, k, n, bias=False):
        m = Linear(torch.empty((n, k), device="meta")) if prefix in self.unread else super().linear(prefix, k, n, bias)
        self.made.append((prefix, m))
        return m

    def norm(self, name, dim=None, offset=0.0):
        m = super().norm(name, dim, offset)
        self.norms.append((name, m))
        return m


class SourceModel:
    """Lazy access to a dense Hugging Face model folder, block by block: a lazily loaded CausalLM
    (`CausalLM.lazy`) whose pieces are built on request by the model's own code (embedding and its scale,
    blocks, final norm, head tying, logit soft-capping)."""

    def __init__(self, path: str | Path, device="cpu"):
        self.path = Path(path)
        self.config = ModelConfig.from_dir(self.path)
        if self.config.quantization:
            raise UnsupportedModelError(f"{self.path}: this model is already quantized "
                                        f"({self.config.quantization.get('quant_method')}); convert the original "
                                        "float16/bfloat16/float32 model instead.")
        self.device = torch.device(device)
        self.model = CausalLM.lazy(self.path, torch.float32, self.device)
        self.loader = self.model.builder.loader

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Block 0's input (float32) for token ids [B, T]; the embedding is read for this call only."""
        m = self.model
        return m.embed(ids.to(self.device), m.build_embedding(m.builder))

    def block(self, i: int) -> tuple[nn.Module, list[LinearRef]]:
        """Block i (float32, on the device) and the linear layers to quantize, in execution order."""
        block, refs, _ = self.tunable_block(i)
        return block, refs

    def tunable_block(self, i: int, unread: frozenset[str] = frozenset()
                      ) -> tuple[nn.Module, list[LinearRef], list[tuple[str, RMSNorm]]]:
        """`block(i)` plus the block's RMSNorms by checkpoint name (what quant.tune moves). The linears named in
        `unread` are not read from the checkpoint (meta-device placeholders for the caller to replace)."""
        b = _RecordingBuilder(self.config, self.loader, torch.float32, self.device, unread=unread)
        block = self.model.build_block(b, i, f"model.layers.{i}").eval()
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
        return block, refs, b.norms

    def final_norm(self) -> RMSNorm:
        return self.model.build_norm(self.model.builder)

    def head_weight(self) -> torch.Tensor:
        """The output head's weight [vocab, hidden] in float32: `lm_head`, or the embedding it is tied to."""
        return self.model.builder.head().weight.data

    def logits(self, h: torch.Tensor, norm: RMSNorm, head: torch.Tensor) -> torch.Tensor:
        """The model's logits (soft-capped where it caps them) of final hidden states h, with this head weight."""
        return self.model.logits(h, norm, Linear(head))
