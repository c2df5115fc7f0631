"""Turn a quantizer result into the tensors of docs/format.md §1 (and back, for checks)."""

from __future__ import annotations

import torch

from exl import format as F
from exl.format import Segment
from quant.gptq import Result
from quant.transform import Prepared


def layer_tensors(p: Prepared, r: Result, segments: list[Segment], bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """qweight/qscale/qmeta (+ perm, su, sv, bias) for one quantized linear layer, on the CPU."""
    k = r.codes.shape[1]
    t = {
        "qweight": F.pack_codes(r.codes.cpu(), segments),
        "qscale": r.scales.cpu().to(torch.float16).contiguous(),
        "qmeta": F.segments_to_meta(segments),
    }
    if p.perm is not None:
        t["perm"] = p.perm.cpu().to(F.perm_dtype(k))
    if p.su is not None:
        t["su"] = F.pack_signs(p.su.cpu())
    if p.sv is not None:
        t["sv"] = F.pack_signs(p.sv.cpu())
    if bias is not None:
        t["bias"] = bias.detach().cpu().to(torch.float16)
    return t
