"""The fused CPU fast path: float32 CPU tensors go through the one-call ops of the exl CPU
extension (cuda_ext/csrc/cpu_fused.cpp) instead of chains of small torch ops.

Each module keeps its plain-PyTorch code as the reference and asks `ops(x)` first: it returns
the extension module when x is a float32 CPU tensor, autograd is off (the fused ops have no
backward; `CausalLM.forward` runs in inference mode) and the fast path is on, else None (then the
reference code runs). An extension that cannot be built raises (cuda_ext.ExtensionBuildError);
EXL_NO_EXT=1 (no extension at all) also turns the fast path off. `disabled()` turns the fast path off for a block
of code (tests and benchmarks compare both paths); EXL_NO_FUSED=1 turns it off for the process. The same switch
turns off the paged cache's CUDA attention (exl.cache.paged), so `disabled()` is the reference path on a GPU too.
"""

from __future__ import annotations

import contextlib
import os

import torch

_ext = None  # the extension module, resolved on first use
_enabled = os.environ.get("EXL_NO_FUSED") != "1"

# ACTIVATIONS names (exl.modules.mlp) -> the extension's act_mul_ kinds
ACT_KINDS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
             "gelu_new": "gelu_tanh", "relu": "relu"}


def _load():
    global _ext
    import cuda_ext

    _ext = cuda_ext.cpu()  # raises when it cannot be built; None only with EXL_NO_EXT=1
    return _ext


def ops(x: torch.Tensor):
    """The extension module when the fused ops apply to x (float32, CPU, no autograd, built, on)."""
    if not _enabled or x.dtype is not torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
        return None
    return _ext if _ext is not None else _load()


def enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def disabled():
    """Run the plain-PyTorch reference path inside this block."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def step(module, ext, *args):
    """The module's part of the one-call decode step (its `cpu_step(ext, ...)`, cuda_ext/csrc/cpu_step.cpp),
    or None when it has none: then the model decodes module by module."""
    make = getattr(module, "cpu_step", None)
    return None if make is None else make(ext, *args)
