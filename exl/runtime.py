"""Loading models for the command line: one place that turns CLI arguments into a model."""

from __future__ import annotations

import torch

from exl.errors import ExlError


def pick_device(name: str | None = None) -> str:
    if name:
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_for_cli(path: str, args=None, progress: bool = True):
    """A model from a folder, honouring --tp / --gpu-split / --device when the command has them."""
    from exl import load_model

    tp = getattr(args, "tp", None) or 1
    split = getattr(args, "gpu_split", None)
    if tp > 1 or split:
        from exl.parallel import load_parallel

        return load_parallel(path, tp=tp, gpu_split=split, mode=getattr(args, "parallel_mode", None) or "tensor")
    try:
        return load_model(path, device=pick_device(getattr(args, "device", None)), progress=progress)
    except ExlError:
        raise
    except FileNotFoundError as e:
        raise ExlError(str(e)) from e
