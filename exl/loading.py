"""The one way to load a model: `exl.load_model(path, ...)`.

It sits above both `exl.models` (one device) and `exl.parallel` (several devices, one process each),
so that neither has to know about the other: exl.models never imports exl.parallel.
"""

from __future__ import annotations

from pathlib import Path

import torch

from exl.errors import ModelLoadError


def pick_device(name: str | None = None) -> str:
    """`name`, or "cuda" when a GPU is visible, else "cpu"."""
    if name:
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(path: str | Path, *, device: str | None = None, dtype: torch.dtype | None = None, tp: int | None = 1,
               gpu_split=None, progress: bool = True, **parallel):
    """Load a Hugging Face or exl-quantized model folder.

    device: a torch device (default: the CPU; the commands and the server pick cuda when a GPU is visible,
    see pick_device). dtype: compute dtype (default: float16 on GPUs, float32 on the CPU).
    tp=N (N >= 2) or gpu_split=[GiB, ...] (or "8,12"): split the model over several devices, one process
    each, and return an exl.parallel.ParallelModel, used like a single model; other keywords (mode="expert",
    shares=[...], ...) go to exl.parallel.load_parallel (docs/parallel.md).
    """
    if (tp and tp > 1) or gpu_split:
        from exl.parallel import load_parallel

        return load_parallel(path, tp=tp if tp and tp > 1 else None, gpu_split=gpu_split, dtype=dtype,
                             device=device, progress=progress, **parallel)
    if parallel:
        raise TypeError(f"load_model: {', '.join(sorted(parallel))} only apply with tp >= 2 or gpu_split")
    from exl.models import CausalLM

    try:
        return CausalLM.load(path, dtype=dtype, device=device or "cpu", progress=progress)
    except FileNotFoundError as e:  # a file the folder's index names is missing
        raise ModelLoadError(f"{path}: {e}") from e
