"""Linear layers: dense, or quantized in the exl format (docs/format.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from exl.errors import ModelLoadError
from exl.loader import TensorLoader

QUANT_TENSORS = ("qweight", "qscale", "qmeta", "perm", "su", "sv", "bias")


class Linear(nn.Module):
    """A dense linear layer y = x Wᵀ + b."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def cpu_step(self, ext):
        """This layer in the one-call decode step (exl.modules.fused.step): float32 CPU weights only."""
        w = self.weight
        if w.dtype is not torch.float32 or w.device.type != "cpu":
            return None
        return ext.LinearStep.dense(w, self.bias)


def is_quantized(loader: TensorLoader, prefix: str) -> bool:
    return f"{prefix}.qweight" in loader


def load_linear(loader: TensorLoader, prefix: str, in_features: int, out_features: int, *,
                bias: bool = False, dtype=torch.float32, device="cpu") -> nn.Module:
    """The layer stored under `prefix`: a QuantLinear if it was quantized, else a dense Linear."""
    if is_quantized(loader, prefix):
        from exl.modules.quant_linear import QuantLinear

        tensors = loader.get_group(prefix, QUANT_TENSORS, device=device)
        n, k = tensors["qweight"].shape[0], int(tensors["qmeta"][:, 0].sum())
        if (n, k) != (out_features, in_features):
            raise ModelLoadError(f"{loader.path}: quantized layer {prefix!r} is {n}x{k}, "
                                 f"expected {out_features}x{in_features} from config.json")
        if bias and "bias" not in tensors:
            raise ModelLoadError(f"{loader.path}: tensor {prefix + '.bias'!r} is missing")
        if "bias" in tensors:
            tensors["bias"] = tensors["bias"].to(dtype)
        return QuantLinear(tensors)
    weight = loader.get(f"{prefix}.weight", dtype, (out_features, in_features), device)
    b = loader.get(f"{prefix}.bias", dtype, (out_features,), device) if bias else None
    return Linear(weight, b)
