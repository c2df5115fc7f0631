"""exl's compiled kernels: CPU (C++: AVX-512 VNNI, AVX-VNNI or AVX2, chosen at run time, with a scalar fallback) and CUDA.

`cpu()` / `cuda()` return the extension module, building it on first use (cached, see build.py).
When it cannot be built they raise ExtensionBuildError (an ExlError: what failed, the compiler's
first error line, how to fix it); the failure is remembered, so it is not retried in this process.
The plain-PyTorch reference path runs only when asked for: with EXL_NO_EXT=1 both return None.
"""

from __future__ import annotations

import os

from cuda_ext.build import ExtensionBuildError, load_cpu, load_cuda

__all__ = ["cpu", "cuda", "reference_only", "ExtensionBuildError", "load_cpu", "load_cuda"]

_cache: dict[str, object] = {}  # kind -> module, or the ExtensionBuildError it raised


def reference_only() -> bool:
    """True when the user asked for the slow plain-PyTorch reference path (EXL_NO_EXT=1)."""
    return os.environ.get("EXL_NO_EXT") == "1"


def _get(kind: str, loader):
    if reference_only():
        return None
    if kind not in _cache:
        try:
            _cache[kind] = loader()
        except ExtensionBuildError as e:
            _cache[kind] = e
    got = _cache[kind]
    if isinstance(got, ExtensionBuildError):
        raise got
    return got


def cpu():
    """The CPU extension module; None only with EXL_NO_EXT=1. Raises ExtensionBuildError if it cannot be built."""
    return _get("cpu", load_cpu)


def cuda():
    """The CUDA extension module; None only with EXL_NO_EXT=1. Raises ExtensionBuildError if it cannot be built."""
    return _get("cuda", load_cuda)
