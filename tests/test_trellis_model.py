"""A tiny model whose decoder layers are trellis-coded loads and runs in exl, and computes what the
dense matrices its layers decode to (exl.format.dequantize) compute in transformers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import exl
from exl import format as F
from exl.cache.contiguous import KVCache
from exl.modules.trellis_linear import TrellisLinear
from test_models import BASE, check_close, make_model

_spec = importlib.util.spec_from_file_location("trellis_model", Path(__file__).parent.parent / "bench" / "trellis_model.py")
trellis_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trellis_model)


@pytest.mark.parametrize("code", [1, 2, 3])
def test_tiny_trellis_model_loads_runs_and_matches_its_decoded_weights(tmp_path, monkeypatch, code):
    monkeypatch.setenv("EXL_CPU_EXACT", "1")  # fp32 activations: only float summation separates the two
    ref, src = make_model(tmp_path, "llama")
    dst = tmp_path / "trellis"
    bpw = trellis_model.trellis_copy(src, dst, bits=3, state_bits=12, code=code)
    assert 3.0 < bpw < (3.5 if code == 1 else 3.9)  # codes 2, 3 store 256 / 128 bytes of tables per layer (tiny layers here)
    model = exl.load_model(dst, progress=False)
    layers = [m for m in model.modules() if isinstance(m, TrellisLinear)]
    assert len(layers) == 7 * BASE["num_hidden_layers"]
    # the reference: the same transformers model with every decoder linear set to its decoded matrix
    sd, stored = ref.state_dict(), load_file(dst / "model.safetensors")
    prefixes = [n[: -len(".trellis")] for n in stored if n.endswith(".trellis")]
    assert len(prefixes) == len(layers)
    with torch.no_grad():
        for p in prefixes:
            t = {s: stored[f"{p}.{s}"] for s in F.TRELLIS_SUFFIXES if f"{p}.{s}" in stored}
            sd[f"{p}.weight"].copy_(F.dequantize(t, torch.float32))
    ids = torch.randint(0, BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits.float()
    check_close(model(ids), want)
    # one token at a time equals the full forward
    one = ids[:1]
    full = model(one)
    cache = KVCache(model.config, batch=1, max_len=32)
    parts = [model(one[:, :9], cache=cache)] + [model(one[:, t:t + 1], cache=cache) for t in range(9, 24)]
    check_close(torch.cat(parts, dim=1), full, 1e-5)
    # decode over the paged cache: the one-call step (cpu_step.cpp) runs the trellis layers, and gives the same
    # bits as the module path
    from test_decode_step import decode_logits, spy_step

    prompts = [ids[0, :9].tolist(), ids[1, :5].tolist()]
    ran = spy_step(model)
    got = decode_logits(model, prompts, steps=5)
    assert ran == [False] + [True] * 5, "the one-call decode step should take trellis layers"
    del model.decode_step
    model._step = False  # block by block
    assert torch.equal(got, decode_logits(model, prompts, steps=5))


def test_a_trellis_model_on_a_cpu_without_avx512_warns_that_its_codes_are_slow_here(tmp_path):
    import warnings

    import cuda_ext
    from exl.loading import SlowCodesWarning

    _, src = make_model(tmp_path, "llama")
    dst = tmp_path / "trellis"
    trellis_model.trellis_copy(src, dst, bits=3, state_bits=12, code=3)
    slow_here = "avx512vnni" not in cuda_ext.cpu().isa_names()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        exl.load_model(dst, progress=False)
        exl.load_model(src, progress=False)  # not trellis-coded: never
    got = [w for w in seen if issubclass(w.category, SlowCodesWarning)]
    assert len(got) == int(slow_here)
    if slow_here:
        assert "--codes scalar" in str(got[0].message) and str(dst) in str(got[0].message)
