"""Linear layers: dense, or quantized in the exl format (docs/format.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from exl.errors import ModelLoadError
from exl.format import layer_shape as F_layer_shape
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


TRELLIS_TENSORS = ("trellis", "tscale", "tmeta", "tcode", "su", "sv", "bias")


def is_quantized(loader: TensorLoader, prefix: str) -> bool:
    return f"{prefix}.qweight" in loader or is_trellis(loader, prefix)


def is_trellis(loader: TensorLoader, prefix: str) -> bool:
    return f"{prefix}.trellis" in loader


def load_linear(loader: TensorLoader, prefix: str, in_features: int, out_features: int, *,
                bias: bool = False, dtype=torch.float32, device="cpu") -> nn.Module:
    """The layer stored under `prefix`: a TrellisLinear if it was trellis-coded, a QuantLinear if it was
    scalar-quantized, else a dense Linear."""
    if is_trellis(loader, prefix):
        from exl.modules.trellis_linear import TrellisLinear

        tensors = loader.get_group(prefix, TRELLIS_TENSORS, device=device)
        _check_quantized(loader, prefix, tensors, bias, dtype, in_features, out_features)
        return TrellisLinear(tensors)
    if is_quantized(loader, prefix):
        from exl.modules.quant_linear import QuantLinear

        tensors = loader.get_group(prefix, QUANT_TENSORS, device=device)
        _check_quantized(loader, prefix, tensors, bias, dtype, in_features, out_features)
        return QuantLinear(tensors)
    weight = loader.get(f"{prefix}.weight", dtype, (out_features, in_features), device)
    b = loader.get(f"{prefix}.bias", dtype, (out_features,), device) if bias else None
    return Linear(weight, b)


def _check_quantized(loader, prefix, tensors, bias, dtype, in_features, out_features):
    """Shape and bias checks of a quantized layer's tensors (converts the bias to dtype in place)."""
    from exl.modules.quant_linear import QuantLinear
    from exl.modules.trellis_linear import TrellisLinear

    kind = TrellisLinear if "trellis" in tensors else QuantLinear
    missing = [k for k in kind.REQUIRED if k not in tensors]
    if missing:
        raise ModelLoadError(f"{loader.path}: quantized layer {prefix!r} lacks tensors "
                             f"{[prefix + '.' + k for k in missing]}")
    n, k = F_layer_shape(tensors)
    if (n, k) != (out_features, in_features):
        raise ModelLoadError(f"{loader.path}: quantized layer {prefix!r} is {n}x{k}, "
                             f"expected {out_features}x{in_features} from config.json")
    if bias and "bias" not in tensors:
        raise ModelLoadError(f"{loader.path}: tensor {prefix + '.bias'!r} is missing")
    if "bias" in tensors:
        tensors["bias"] = tensors["bias"].to(dtype)
