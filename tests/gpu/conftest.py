"""Shared by the GPU-only tests (run by bench/gpu_check.sh on a machine with a CUDA device)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ext():
    """The CUDA extension, built through the real JIT path."""
    from cuda_ext import build

    return build.load_cuda()
