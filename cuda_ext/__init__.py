"""exl's compiled kernels: CPU (C++: AVX-512 VNNI, AVX-VNNI or AVX2, chosen at run time, with a scalar fallback) and CUDA.

`cpu()` / `cuda()` return the extension module, building it on first use (cached), or None when
it cannot be built; then exl falls back to the plain-PyTorch reference path and warns once.
Set EXL_NO_EXT=1 to force that fallback.
"""

from __future__ import annotations

import os
import warnings

from cuda_ext.build import ExtensionBuildError, load_cpu, load_cuda

__all__ = ["cpu", "cuda", "ExtensionBuildError", "load_cpu", "load_cuda"]

_cache: dict[str, object] = {}


def _get(kind: str, loader):
    if kind not in _cache:
        if os.environ.get("EXL_NO_EXT") == "1":
            _cache[kind] = None
        else:
            try:
                _cache[kind] = loader()
            except ExtensionBuildError as e:
                warnings.warn(f"{e}. exl runs on the plain-PyTorch reference path instead (much slower).", stacklevel=3)
                _cache[kind] = None
    return _cache[kind]


def cpu():
    """The CPU extension module, or None (after one warning) if it cannot be built."""
    return _get("cpu", load_cpu)


def cuda():
    """The CUDA extension module, or None (after one warning) if it cannot be built."""
    return _get("cuda", load_cuda)
