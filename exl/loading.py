"""The one way to load a model: `exl.load_model(path, ...)`.

It sits above both `exl.models` (one device) and `exl.parallel` (several devices, one process each),
so that neither has to know about the other: exl.models never imports exl.parallel.
"""

from __future__ import annotations

import warnings
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
    see pick_device). dtype: compute dtype (default: float16 on GPUs, float32 on the CPU). On the CPU, unless
    the user fixed the thread count (EXL_THREADS, OMP_NUM_THREADS, torch.set_num_threads), cores that other
    processes keep busy are left out (exl/threads.py).
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

    if torch.device(device or "cpu").type == "cpu":  # leave out cores other processes keep busy (exl/threads.py)
        from exl.threads import apply_auto_threads

        apply_auto_threads()
    try:
        model = CausalLM.load(path, dtype=dtype, device=device or "cpu", progress=progress)
    except FileNotFoundError as e:  # a file the folder's index names is missing
        raise ModelLoadError(f"{path}: {e}") from e
    if model.device.type == "cpu":
        warn_slow_trellis(model, path)
    return model


class SlowCodesWarning(UserWarning):
    """The model's codes decode far slower on this CPU than a model of the same size with other codes."""


def warn_slow_trellis(model, path) -> bool:
    """Warn (SlowCodesWarning) when a CPU model has trellis-coded layers and this CPU has no AVX-512 VBMI
    kernels: there the trellis decode is compute-bound (table lookups by vpshufb) and runs at about 0.4-0.5x the
    rate of a scalar-coded model of the same size (docs/benchmarks.md, "2026-12-06"). True when it warned."""
    from exl.modules.trellis_linear import TrellisLinear

    n = sum(isinstance(m, TrellisLinear) for m in model.modules())
    if not n:
        return False
    import cuda_ext

    ext = cuda_ext.cpu()
    if ext is None or "avx512vnni" in ext.isa_names():
        return False
    warnings.warn(f"{path}: {n} trellis-coded layers, and this CPU has no AVX-512 (kernels: "
                  f"{', '.join(ext.isa_names())}): their decode runs at about 0.4-0.5x the speed of a scalar-coded "
                  "model of the same size here. For CPU inference on this machine, convert with `--codes scalar`.",
                  SlowCodesWarning, stacklevel=4)
    return True
