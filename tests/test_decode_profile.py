"""bench/decode_profile.py: the per-token counts it reports are the generator's real ones (CPU here; the
launch and sync columns only exist on cuda, where bench/gpu_check.sh runs it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import decode_profile  # noqa: E402

from test_generator import tiny_llama  # noqa: E402

pytestmark = pytest.mark.kernels


def test_profile_counts_one_sampled_token_per_step(tmp_path):
    model = tiny_llama(tmp_path / "m", vocab=211)  # exl.benchmark draws prompt tokens from 100 up
    r = decode_profile.profile_decode(model, 6)
    assert r["device"] == "cpu" and r["tokens"] == 6 and r["tok_s"] > 0
    assert r["item_per_token"] == pytest.approx(1.0, abs=0.2)  # the greedy token read back, once per step
    assert r["aten_ops_per_token"] > 1
    assert r["launches_per_token"] is None and r["syncs_per_token"] is None
    assert r["top_host_ops"] and all(o["calls_per_token"] > 0 for o in r["top_host_ops"])
