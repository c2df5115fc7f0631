"""The fused CPU ops (cuda_ext/csrc/cpu_fused.cpp) against their plain-PyTorch references, and whole
models on the fused fast path against the reference path (exl.modules.fused.disabled()).

Tolerances are fp32 rounding: the fused ops sum in a different order than torch (and use a ~1 ulp
polynomial exp), so results differ by a few units in the last place, never by more.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

import exl
from cuda_ext import build
from exl.cache.contiguous import KVCache
from exl.config import RopeConfig
from exl.modules import fused
from exl.modules.attention import scaled_attention
from exl.modules.mlp import ACTIVATIONS
from exl.modules.norm import RMSNorm
from exl.modules.rope import RotaryEmbedding

pytestmark = pytest.mark.kernels  # CI runs these under a second torch too (.ci/run)
TOL = 3e-6  # relative to the largest magnitude of the reference


@pytest.fixture(scope="module")
def ext():
    return build.load_cpu()  # fails (not skips) when the extension cannot be built


def isas(ext):
    """Every instruction-set level this CPU runs (the GEMV's names; cpu_isa.h), so each fused table is tested."""
    return ext.isa_names()


def close(got, want, tol=TOL):
    assert got.shape == want.shape
    if want.numel() == 0:
        return
    scale = want.abs().max().clamp_min(1e-30)
    err = (got - want).abs().max()
    assert err <= tol * scale, f"max abs diff {err:.3e} > {tol} x scale {scale:.3e}"


def g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 17), (7,), (2, 0, 8)])
def test_rms_norm(ext, shape):
    x = torch.randn(*shape, generator=g(0)) * 3
    norm = RMSNorm(torch.randn(shape[-1], generator=g(1)), 1e-5)
    with fused.disabled():
        want = norm(x)
    close(ext.rms_norm(x, norm.weight, norm.eps), want)
    with torch.inference_mode():
        close(norm(x), want)  # the module takes the fused op
    strided = x.mT.contiguous().mT if x.dim() > 1 else x
    close(ext.rms_norm(strided, norm.weight, norm.eps), want)


@pytest.mark.parametrize("with_x_weight", [False, True])
@pytest.mark.parametrize("with_weight", [False, True])
def test_add_rms_norm(ext, with_x_weight, with_weight):
    x, r = torch.randn(2, 3, 40, generator=g(0)), torch.randn(2, 3, 40, generator=g(1))
    w = RMSNorm(torch.randn(40, generator=g(2)), 1e-6)
    xw = RMSNorm(torch.randn(40, generator=g(3)), 1e-6)
    with fused.disabled():
        s_want = (xw(x) if with_x_weight else x) + r
        y_want = w(s_want)
    xi = x.clone()
    s, y = ext.add_rms_norm(xi, r, w.weight if with_weight else None, 1e-6, xw.weight if with_x_weight else None)
    close(s, s_want)
    assert s.data_ptr() == xi.data_ptr()  # written over x
    if with_weight:
        close(y, y_want)
    else:
        assert y is None
    xt = x.transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous: a new tensor, x untouched
    before = xt.clone()
    s2, _ = ext.add_rms_norm(xt, r, w.weight, 1e-6, xw.weight if with_x_weight else None)
    close(s2, s_want)
    assert torch.equal(xt, before) and s2.data_ptr() != xt.data_ptr()


@pytest.mark.parametrize("b,t,hq,hk,d,partial,qk_norm",
                         [(1, 1, 9, 3, 64, 1.0, False), (2, 5, 4, 4, 32, 1.0, True), (3, 2, 6, 2, 80, 0.4, False),
                          (1, 7, 8, 1, 16, 0.5, True)])
def test_rope(ext, b, t, hq, hk, d, partial, qk_norm):
    rope = RotaryEmbedding(RopeConfig(theta=10000.0, partial_rotary_factor=partial), d, 4096)
    positions = torch.randint(0, 3000, (b, t), generator=g(0))
    cos, sin = rope.cos_sin(positions, torch.float32)
    qkv = torch.randn(b, t, (hq + 2 * hk) * d, generator=g(1))  # q and k are views of one projection
    q, k = qkv[..., : hq * d].view(b, t, hq, d), qkv[..., hq * d : (hq + hk) * d].view(b, t, hk, d)
    qn = RMSNorm(torch.randn(d, generator=g(2)), 1e-6) if qk_norm else None
    kn = RMSNorm(torch.randn(d, generator=g(3)), 1e-6) if qk_norm else None
    with fused.disabled():
        q_want, k_want = (qn(q), kn(k)) if qk_norm else (q, k)
        q_want, k_want = rope.apply(q_want, cos, sin), rope.apply(k_want, cos, sin)
    if qk_norm:
        ext.rope_(q, k, cos, sin, qn.weight, kn.weight, 1e-6)
    else:
        ext.rope_(q, k, cos, sin)
    close(q, q_want)
    close(k, k_want)


def reference_decode(q, kc, vc, layer, pos, scale, window, softcap):
    lo = 0 if not window else max(0, pos - window + 1)
    keys, values = kc[layer, :, :, lo : pos + 1], vc[layer, :, :, lo : pos + 1]
    return scaled_attention(q.transpose(1, 2), keys, values, scale=scale, softcap=softcap).transpose(1, 2)


@pytest.mark.parametrize("b,hq,hk,d", [(1, 9, 3, 64), (2, 4, 4, 128), (3, 8, 2, 40), (1, 6, 1, 16)])
@pytest.mark.parametrize("pos,window,softcap", [(0, 0, None), (37, 0, None), (37, 8, None), (20, 0, 5.0)])
def test_decode_attention(ext, b, hq, hk, d, pos, window, softcap):
    kc, vc = torch.randn(2, b, hk, 48, d, generator=g(0)), torch.randn(2, b, hk, 48, d, generator=g(1))
    q = torch.randn(b, 1, hq, d, generator=g(2)) * 2
    k, v = torch.randn(b, 1, hk, d, generator=g(3)), torch.randn(b, 1, hk, d, generator=g(4))
    for isa in isas(ext):
        kc2, vc2 = kc.clone(), vc.clone()
        out = ext.decode_attention(q, k, v, kc2, vc2, 1, pos, d**-0.5, window, softcap or 0.0, isa)
        assert torch.equal(kc2[1, :, :, pos], k[:, 0]) and torch.equal(vc2[1, :, :, pos], v[:, 0])
        kc2[1, :, :, pos], vc2[1, :, :, pos] = kc[1, :, :, pos], vc[1, :, :, pos]
        assert torch.equal(kc2, kc) and torch.equal(vc2, vc)  # nothing else written
        kc2[1, :, :, pos], vc2[1, :, :, pos] = k[:, 0], v[:, 0]
        close(out, reference_decode(q, kc2, vc2, 1, pos, d**-0.5, window, softcap), 1e-5)


@pytest.mark.parametrize("pos,t,window,softcap", [(0, 5, 0, None), (30, 4, 0, None), (30, 6, 3, 5.0)])
def test_decode_attention_of_several_rows_is_causal(ext, pos, t, window, softcap):
    """T new tokens (a prompt chunk, drafts): each row attends over the positions up to its own."""
    from exl.modules.attention import attention_mask

    b, hq, hk, d = 2, 6, 2, 64
    kc, vc = torch.randn(1, b, hk, 40, d, generator=g(0)), torch.randn(1, b, hk, 40, d, generator=g(1))
    q = torch.randn(b, t, hq, d, generator=g(2)) * 2
    k, v = torch.randn(b, t, hk, d, generator=g(3)), torch.randn(b, t, hk, d, generator=g(4))
    for isa in isas(ext):
        kc2, vc2 = kc.clone(), vc.clone()
        out = ext.decode_attention(q, k, v, kc2, vc2, 0, pos, d**-0.5, window, softcap or 0.0, isa)
        assert torch.equal(kc2[0, :, :, pos : pos + t], k.transpose(1, 2))
        assert torch.equal(vc2[0, :, :, pos : pos + t], v.transpose(1, 2))
        q_pos = torch.arange(pos, pos + t).expand(b, t)
        mask = attention_mask(q_pos, torch.arange(pos + t).expand(b, pos + t), window or None)
        want = scaled_attention(q.transpose(1, 2), kc2[0, :, :, : pos + t], vc2[0, :, :, : pos + t], scale=d**-0.5,
                                mask=mask, softcap=softcap).transpose(1, 2)
        close(out, want, 1e-5)


@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (8, 2, 128), (4, 1, 64), (6, 2, 40)])
def test_a_rows_attention_does_not_depend_on_its_tile(ext, hq, hk, d):
    """Bit for bit: each row of a T-row call (wide tiles: rows x heads share the lanes) equals the same row
    decoded alone (a narrow tile: the AVX-512 table turns 16 keys at a time around), so speculative drafts
    verify to exactly what plain decoding computes."""
    b, t, pos = 2, 5, 37
    kc, vc = torch.randn(1, b, hk, 64, d, generator=g(0)), torch.randn(1, b, hk, 64, d, generator=g(1))
    q = torch.randn(b, t, hq, d, generator=g(2)) * 2
    k, v = torch.randn(b, t, hk, d, generator=g(3)), torch.randn(b, t, hk, d, generator=g(4))
    for isa in isas(ext):
        kc2, vc2 = kc.clone(), vc.clone()
        out = ext.decode_attention(q, k, v, kc2, vc2, 0, pos, d**-0.5, 0, 0.0, isa)
        for i in range(t):
            one = ext.decode_attention(q[:, i : i + 1].contiguous(), k[:, i : i + 1].contiguous(),
                                       v[:, i : i + 1].contiguous(), kc2, vc2, 0, pos + i, d**-0.5, 0, 0.0, isa)
            assert torch.equal(one[:, 0], out[:, i]), (isa, i)


@pytest.mark.parametrize("act", sorted(set(fused.ACT_KINDS)))
def test_act_mul(ext, act):
    gate = torch.cat([torch.linspace(-30, 30, 1001), torch.randn(2 * 3 * 333 - 1001, generator=g(0)) * 4])
    gate, up = gate.view(2, 3, 333), torch.randn(2, 3, 333, generator=g(1))
    want = ACTIVATIONS[act](gate) * up
    for isa in isas(ext):
        gi = gate.clone()
        out = ext.act_mul(gi, up, fused.ACT_KINDS[act], isa)
        assert out.data_ptr() == gi.data_ptr()
        close(out, want)
        gt = gate.transpose(0, 2).contiguous().transpose(0, 2)
        close(ext.act_mul(gt, up, fused.ACT_KINDS[act], isa), want)
        # elementwise against float64: a few ulp of the output, plus for GELU an ulp of its (1 + erf/tanh)
        # factor, which cancels for negative x (torch's own float32 GELU is off by more there)
        exact = (ACTIVATIONS[act](gate.double()) * up.double())
        assert ((out.double() - exact).abs() <= 2e-6 * exact.abs() + 1.2e-7 * (gate * up).abs()).all()


def test_fused_tables_follow_the_shared_isa_levels(ext, monkeypatch):
    """One detection layer (cpu_isa.h): each GEMV level picks the best fused table at or below it, 'auto' and
    EXL_CPU_ISA mean what they mean for the GEMV, and every fused table is reachable where the CPU has it."""
    want = {"scalar": "scalar", "avx2": "avx2", "avxvnni": "avx2", "avx512vnni": "avx512"}
    names = ext.isa_names()
    for isa in names:
        assert ext.fused_isa(isa) == want[isa], isa
    monkeypatch.delenv("EXL_CPU_ISA", raising=False)
    assert ext.fused_isa("auto") == want[names[-1]]
    monkeypatch.setenv("EXL_CPU_ISA", "scalar")
    assert ext.fused_isa("auto") == "scalar"
    assert ext.fused_isa(names[-1]) == want[names[-1]]  # an explicit level wins over the variable
    monkeypatch.setenv("EXL_CPU_ISA", "avx9")
    with pytest.raises(RuntimeError, match=r"isa must be .*got 'avx9' \(from EXL_CPU_ISA\)"):
        ext.fused_isa("auto")
    for level in {"avx2", "avxvnni", "avx512vnni"} - set(names):
        with pytest.raises(RuntimeError, match="not available on this CPU"):
            ext.fused_isa(level)


def test_bad_inputs_are_explained(ext):
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="float32 CPU tensor"):
        ext.rms_norm(x.double(), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match=r"contiguous \[8\] vector"):
        ext.rms_norm(x, torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match="residual has shape"):
        ext.add_rms_norm(x, torch.randn(2, 9))
    with pytest.raises(RuntimeError, match="unknown activation 'tanh'"):
        ext.act_mul(x, x, "tanh")
    with pytest.raises(RuntimeError, match="isa must be"):
        ext.act_mul(x, x, "silu", "avx9")
    q, kc = torch.randn(1, 1, 4, 8), torch.zeros(1, 1, 2, 4, 8)
    k = torch.randn(1, 1, 2, 8)
    with pytest.raises(RuntimeError, match=r"position 4 out of range \[0, 4\)"):
        ext.decode_attention(q, k, k, kc, kc.clone(), 0, 4, 1.0)
    with pytest.raises(RuntimeError, match="layer 1 out of range"):
        ext.decode_attention(q, k, k, kc, kc.clone(), 1, 0, 1.0)
    with pytest.raises(RuntimeError, match="does not fit q"):
        ext.decode_attention(torch.randn(1, 1, 3, 8), k, k, kc, kc.clone(), 0, 0, 1.0)
    cos = torch.randn(1, 3, 6)
    with pytest.raises(RuntimeError, match="rotary_dim"):
        ext.rope_(torch.randn(1, 3, 2, 4), torch.randn(1, 3, 1, 4), cos, cos)


def test_ops_apply_only_to_float32_cpu_without_autograd():
    with torch.no_grad():
        assert fused.ops(torch.zeros(2)) is not None
        assert fused.ops(torch.zeros(2, dtype=torch.float16)) is None
        with fused.disabled():
            assert fused.ops(torch.zeros(2)) is None
        assert fused.ops(torch.zeros(2)) is not None
    assert fused.ops(torch.zeros(2)) is None  # grad mode: the differentiable reference path


def test_block_gradients_use_the_reference_path(tmp_path):
    """Under autograd (the quantizer's Fisher pass) a block must give the reference gradients."""
    from test_models import make_model

    from exl.cache.base import NoCache

    _, path = make_model(tmp_path, "llama")
    block = exl.load_model(path, progress=False).layers[1]
    x = torch.randn(2, 5, 64, generator=g(0))

    def grad():
        h = x.clone().requires_grad_()
        with torch.enable_grad():
            block(h, NoCache(2, 5)).square().sum().backward()
        return h.grad

    got = grad()
    with fused.disabled():
        want = grad()
    assert torch.equal(got, want)


# Whole models: fused fast path vs reference path, prefill and decode steps through a KV cache.
class CountingOps:
    """The extension module, counting which ops the model looks up (to check the fast path ran)."""

    def __init__(self, ext):
        self.ext, self.calls = ext, collections.Counter()

    def __getattr__(self, name):
        self.calls[name] += 1
        return getattr(self.ext, name)


@pytest.mark.parametrize("name", ["llama", "mistral-window", "qwen3", "gemma3", "qwen3-moe"])
def test_model_fused_matches_reference(tmp_path, monkeypatch, name):
    from test_models import BASE, make_model

    counting = CountingOps(build.load_cpu())
    monkeypatch.setattr(fused, "_ext", counting)
    _, path = make_model(tmp_path, name)
    model = exl.load_model(path, progress=False)
    ids = torch.randint(0, BASE["vocab_size"], (2, 16), generator=g(5))

    def run():
        cache = KVCache(model.config, batch=2, max_len=20)
        parts = [model(ids[:, :9], cache=cache)]
        parts += [model(ids[:, t : t + 1], cache=cache) for t in range(9, 16)]  # decode steps
        return torch.cat([model(ids)] + parts, dim=1)

    got = run()
    assert {"rms_norm", "add_rms_norm", "rope_", "decode_attention", "act_mul"} <= set(counting.calls)
    with fused.disabled():
        want = run()
    close(got, want, 2e-5)
