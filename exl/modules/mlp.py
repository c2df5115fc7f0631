"""Feed-forward blocks: the gated MLP and the sparse mixture of experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from exl.modules import fused

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) — SwiGLU / GeGLU."""

    def __init__(self, gate, up, down, act: str = "silu"):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.act = ACTIVATIONS[act]
        self.act_kind = fused.ACT_KINDS.get(act)  # None: no fused form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ext = fused.ops(x) if self.act_kind else None
        if ext is not None:
            return self.down(ext.act_mul(self.gate(x), self.up(x), self.act_kind))
        return self.down(self.act(self.gate(x)) * self.up(x))

    def cpu_step(self, ext):
        """This MLP in the one-call decode step (exl.modules.fused.step), or None."""
        parts = [fused.step(m, ext) for m in (self.gate, self.up, self.down)]
        if self.act_kind is None or None in parts:
            return None
        return ext.MLPStep(*parts, self.act_kind)


class SparseMoE(nn.Module):
    """Top-k routed experts (Mixtral, Qwen2/3-MoE), plus an optional gated shared expert."""

    def __init__(self, router, experts: list[GatedMLP], top_k: int, normalize: bool = True,
                 shared: GatedMLP | None = None, shared_gate=None):
        super().__init__()
        self.router, self.experts = router, nn.ModuleList(experts)
        self.top_k, self.normalize = top_k, normalize
        self.shared, self.shared_gate = shared, shared_gate

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [n, k], expert ids [n, k]) for flattened tokens x [n, d]."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            token, slot = torch.nonzero(ids == e, as_tuple=True)
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x)) * s
            out = out + s
        return out.view(shape)

    def cpu_step(self, ext):
        """This mixture in the one-call decode step (exl.modules.fused.step), or None."""
        router = fused.step(self.router, ext)
        experts = [fused.step(e, ext) for e in self.experts]
        shared = fused.step(self.shared, ext) if self.shared is not None else None
        gate = fused.step(self.shared_gate, ext) if self.shared_gate is not None else None
        if router is None or None in experts or (shared is None) != (self.shared is None) \
                or (gate is None) != (self.shared_gate is None):
            return None
        return ext.MoEStep(router, experts, self.top_k, self.normalize, shared, gate)
