"""RMSNorm, computed in float32."""

import torch
from torch import nn

from exl.modules import fused


class RMSNorm(nn.Module):
    """y = x / rms(x) * (offset + weight). Gemma stores weight - 1 and uses offset = 1."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter((weight.float() + offset), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ext = fused.ops(x)
        if ext is not None:
            return ext.rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight).to(x.dtype)
