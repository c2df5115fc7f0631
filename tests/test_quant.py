"""The quantizer's parts against plain-PyTorch references: settings and bit costs, GPTQ, transforms,
packing into the format, Hessians with bad data, and the optimizer against brute force."""

import itertools
import logging
import math

import pytest
import torch

from exl import format as F
from exl.modules.quant_linear import QuantLinear
from quant.candidates import Setting, TrellisSetting, candidates, storage_bits, trellis_candidates, trellis_storage_bits
from quant.capture import hessian
from quant.gptq import HessianError, gptq, inverse_cholesky, search_scales
from quant.layer import TRELLIS_TRANSFORM, measure, quantize, walk_weights
from quant.optimize import TargetError, optimize
from quant.options import QuantOptions
from quant.transform import Transform, prepare


def problem(n=96, k=256, tokens=2048, seed=0):
    """A weight matrix and a correlated, anisotropic Hessian like a real layer's."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    x = torch.randn(tokens, k, generator=g) @ mix * torch.linspace(0.2, 3.0, k)
    w = torch.randn(n, k, generator=g) * 0.05
    return w, (x.T @ x).double(), x


def test_setting_names_and_segments():
    for s in candidates(576) + candidates(1536):
        assert Setting.parse(s.name) == s
        segs = s.segments(576)
        assert sum(x.k_len for x in segs) == 576
    assert Setting(4, 128).segments(576) == [F.Segment(512, 4, 128), F.Segment(64, 4, 64)]
    mixed = Setting(4, 128, 5, 0.25).segments(1536)
    assert mixed[0] == F.Segment(384, 5, 128) and sum(x.k_len for x in mixed) == 1536


@pytest.mark.parametrize("setting,t", [(Setting(4, 64), Transform()), (Setting(3, 128, 4, 0.25), Transform(True, True, True)),
                                       (Setting(1, 128, 2, 0.5), Transform(False, False, False)),
                                       (Setting(8, 32), Transform(False, True, True))])
def test_bit_cost_equals_stored_tensors(setting, t):
    w, h, _ = problem()
    q = quantize("layer", w, h, setting, t, QuantOptions(), seed=1)
    assert q.bits == F.storage_bits(q.tensors) == storage_bits(96, 256, setting.segments(256), t.perm, t.su, t.sv)


def rtn_reference(w, bits, group):
    """Round-to-nearest on the centred grid with max-abs scales, written out plainly."""
    n, k = w.shape
    c = (2**bits - 1) / 2
    out = torch.empty_like(w)
    for g0 in range(0, k, group):
        blk = w[:, g0 : g0 + group]
        s = (blk.abs().amax(1) / c).clamp_min(2**-20).half().float()[:, None]
        out[:, g0 : g0 + group] = s * (torch.clamp(torch.round(blk / s + c), 0, 2 * c) - c)
    return out


def test_identity_hessian_is_round_to_nearest():
    w, _, _ = problem()
    segs = Setting(3, 64).segments(256)
    r = gptq(w, torch.eye(256), [segs], alphas=(1.0,))[0]
    got = F.dequantize_codes(r.codes, r.scales, segs)
    assert torch.allclose(got, rtn_reference(w, 3, 64), atol=1e-6)


def test_gptq_error_is_the_hessian_weighted_error_and_beats_rtn():
    w, h, _ = problem()
    segs = Setting(3, 64).segments(256)
    u, damp = inverse_cholesky(h, damp=1e-6)
    r = gptq(w, u, [segs])[0]
    dw = (F.dequantize_codes(r.codes, r.scales, segs) - w).double()
    exact = ((dw @ h) * dw).sum(1)
    assert torch.allclose(r.row_err.double(), exact, rtol=1e-3)
    rtn = gptq(w, torch.eye(256), [segs], alphas=(1.0,))[0]
    dr = (F.dequantize_codes(rtn.codes, rtn.scales, segs) - w).double()
    assert float(exact.sum()) < 0.7 * float(((dr @ h) * dr).sum())


def test_batched_settings_equal_separate_runs():
    w, h, _ = problem()
    u, _ = inverse_cholesky(h)
    sets = [Setting(2, 128).segments(256), Setting(5, 32).segments(256), Setting(3, 64, 4, 0.25).segments(256)]
    together = gptq(w, u, sets)
    for segs, r in zip(sets, together):
        alone = gptq(w, u, [segs])[0]
        assert torch.equal(alone.codes, r.codes) and torch.equal(alone.scales, r.scales)


def test_scale_search_never_worse_than_max_abs():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 500, generator=g) ** 3  # heavy tails: clipping pays
    bits = torch.full((500,), 3)
    weight = torch.ones(64)
    s_max = search_scales(w, bits, weight, alphas=(1.0,))
    s = search_scales(w, bits, weight)

    def err(scale):
        q = torch.clamp(torch.round(w / scale + 3.5), 0, 7)
        return ((w - scale * (q - 3.5)) ** 2).sum(0)

    assert (err(s) <= err(s_max) + 1e-6).all() and err(s).sum() < 0.9 * err(s_max).sum()
    assert torch.equal(s, s.half().float())  # scales are exactly representable in float16


@pytest.mark.parametrize("t", [Transform(False, False, False), Transform(True, False, False), Transform(False, True, False),
                               Transform(False, False, True), Transform(True, True, True)])
def test_quantized_layer_matches_format_reference_and_kernel(t):
    w, h, x = problem()
    bias = torch.randn(96) * 0.1
    q = quantize("model.layers.0.mlp.up_proj", w, h, Setting(4, 64, 6, 0.25), t, QuantOptions(), seed=7, bias=bias)
    assert set(q.tensors) == {"qweight", "qscale", "qmeta", "bias"} | {n for n, on in (("su", t.su), ("sv", t.sv), ("perm", t.perm)) if on}
    assert torch.allclose(F.dequantize(q.tensors), q.weight, atol=1e-6)
    xs = x[:40]
    want = xs @ q.weight.T + bias.half().float()
    assert torch.allclose(F.reference_forward(xs, q.tensors), want, atol=1e-4, rtol=1e-4)
    layer = QuantLinear(dict(q.tensors), exact=True)
    assert torch.allclose(layer(xs), want, atol=1e-3, rtol=1e-3)
    assert q.rel < 0.02


def test_hadamard_lowers_error_on_outlier_channels():
    w, h, _ = problem()
    w[:, 5] *= 40  # one outlier input channel: max-abs scales waste their range elsewhere
    errs = {}
    for t in (Transform(False, False, True), Transform(True, False, True)):
        errs[t.name] = quantize("l", w, h, Setting(3, 64), t, QuantOptions(), seed=0).rel
    assert errs["su+perm"] < 0.7 * errs["perm"]


def test_transform_is_consistent_with_format():
    """W on the grid after rotation is recovered exactly: prepare() and the format agree on the maths."""
    w, h, _ = problem(n=64, k=128)
    t = Transform(True, True, True)
    p = prepare(w, h, t, seed=3, name="x")
    back = torch.empty_like(p.w)
    back[:, p.perm] = p.w
    back = F.fwht(back.double()) * p.su.double()
    back = p.sv.double()[:, None] * F.fwht(back.T).T
    assert torch.allclose(back.float(), w, atol=1e-5)
    hh = F.hadamard_matrix(128) @ torch.diag(p.su.double())
    assert torch.allclose(p.h, (hh @ h @ hh.T)[p.perm][:, p.perm], rtol=1e-9, atol=1e-6)


def test_non_positive_definite_hessian_gets_damped_or_refused(caplog):
    w, h, _ = problem(k=64)
    evals, evecs = torch.linalg.eigh(h)
    evals[:3] = -evals[-1] * 1e-4  # slightly indefinite: damping fixes it
    u, damp = inverse_cholesky(evecs @ torch.diag(evals) @ evecs.T, damp=1e-8)
    assert damp > 1e-8 and torch.isfinite(u).all()
    with pytest.raises(HessianError):
        inverse_cholesky(-h)  # hopeless
    with pytest.raises(HessianError):
        inverse_cholesky(torch.zeros(64, 64, dtype=torch.float64))
    with caplog.at_level(logging.WARNING, logger="exl.quant"):
        q = quantize("bad", w[:, :64], -h, Setting(4, 64), Transform(), QuantOptions(), seed=0)
    assert "round-to-nearest" in caplog.text and torch.isfinite(q.weight).all()


def test_dead_input_channels():
    w, h, _ = problem(k=64)
    h[7, :] = 0
    h[:, 7] = 0
    q = quantize("dead", w[:, :64], h, Setting(4, 32), Transform(), QuantOptions(), seed=0)
    assert torch.isfinite(q.weight).all() and q.rel < 0.02


def test_hessian_skips_non_finite_tokens(caplog):
    x = torch.randn(2, 10, 32)
    x[0, 3, 5] = float("nan")
    x[1, 2, 0] = float("inf")
    with caplog.at_level(logging.WARNING, logger="exl.quant"):
        h, n = hessian(x, name="layer")
    assert n == 18 and "NaN/inf" in caplog.text
    keep = torch.ones(20, dtype=torch.bool)
    keep[[3, 12]] = False
    flat = x.reshape(20, 32)[keep].double()
    assert torch.allclose(h, flat.T @ flat, rtol=1e-5, atol=1e-4)


def test_measure_prices_every_candidate():
    w, h, _ = problem()
    f = torch.rand(96) + 0.5
    rec = measure("layer", w, h, 2048, f, QuantOptions(measure_rows=48), seed=0)
    by = {c["setting"]: c for c in rec["candidates"]}
    assert len(by) == len(candidates(256)) + len(trellis_candidates(96, 256, QuantOptions().trellis_widths))
    # more bits, less error; kl is the Fisher-weighted error
    assert by["2b/g128"]["kl"] > by["3b/g128"]["kl"] > by["4b/g128"]["kl"] > by["6b/g128"]["kl"] > by["8b/g128"]["kl"]
    assert by["4b/g32"]["rel"] < by["4b/g128"]["rel"]
    # the prediction agrees with an actual quantization (rows subsampled: within 25%)
    t = Transform.parse(rec["transform"])
    q = quantize("layer", w, h, Setting(4, 64), t, QuantOptions(), seed=0, fisher=f, tokens=2048)
    assert abs(q.kl / by["4b/g64"]["kl"] - 1) < 0.25
    assert by["4b/g64"]["bits"] == q.bits


def test_measure_prices_trellis_candidates_and_the_prediction_holds():
    w, h, _ = problem()
    f = torch.rand(96) + 0.5
    rec = measure("layer", w, h, 2048, f, QuantOptions(measure_rows=48, trellis_bits=(2, 3, 4)), seed=0)
    by = {c["setting"]: c for c in rec["candidates"]}
    assert by["trellis2/L12"]["kl"] > by["trellis3/L12"]["kl"] > by["trellis4/L12"]["kl"]
    assert all(by[f"trellis{b}/L12"]["transform"] == "su" for b in (2, 3, 4))  # format v3: no output rotation
    for b in (2, 3, 4):  # fewer bits and less error than scalar codes of the same width in groups of 128
        assert by[f"trellis{b}/L12"]["bits"] < by[f"{b}b/g128"]["bits"]
        assert by[f"trellis{b}/L12"]["kl"] < by[f"{b}b/g128"]["kl"]
    s = TrellisSetting(3, 12)
    q = quantize("layer", w, h, s, Transform(), QuantOptions(), seed=0, fisher=f, tokens=2048)
    assert abs(q.kl / by[s.name]["kl"] - 1) < 0.25
    assert q.bits == by[s.name]["bits"] == F.storage_bits(q.tensors) == trellis_storage_bits(96, 256, 3)
    assert "sv" not in q.tensors and "su" in q.tensors
    # the stored tensors are a §7 layer that stands for the matrix the quantizer returned
    torch.testing.assert_close(F.dequantize(q.tensors), q.weight, rtol=1e-4, atol=1e-5)
    x = torch.randn(5, 256)
    torch.testing.assert_close(F.reference_forward(x, q.tensors), x @ q.weight.T, rtol=1e-3, atol=1e-4)
    refined = quantize("layer", w, h, s, Transform(), QuantOptions(trellis_passes=1), seed=0, fisher=f, tokens=2048)
    assert refined.rel < q.rel and refined.bits == q.bits  # --trellis-passes 1: same format, less error
    torch.testing.assert_close(F.dequantize(refined.tensors), refined.weight, rtol=1e-4, atol=1e-5)
    only = measure("layer", w, h, 2048, f, QuantOptions(measure_rows=48, codes="trellis", trellis_bits=(2, 3)), seed=0)
    assert [c["setting"] for c in only["candidates"]] == ["trellis2/L12", "trellis3/L12"]
    scalar = measure("layer", w, h, 2048, f, QuantOptions(measure_rows=48, codes="scalar"), seed=0)
    assert not any(c["setting"].startswith("trellis") for c in scalar["candidates"])


def test_trellis_walks_put_the_error_on_rows_the_fisher_says_matter_least():
    """Format version 3: trellis matrices are rotated on the input side only, and each row's cost in a walk is
    weighted by its Fisher, so the Fisher-weighted error (the predicted ΔKL) falls against unweighted walks;
    a choice measured with both rotations (before version 3) still gets them, sv stored and counted."""
    w, h, _ = problem()
    g = torch.Generator().manual_seed(5)
    f = torch.exp(3 * torch.randn(96, generator=g))  # sensitivities spread over orders of magnitude, as in q/k
    s, o = TrellisSetting(3, 12), QuantOptions()
    plain = quantize("layer", w, h, s, TRELLIS_TRANSFORM, o, seed=0)
    weighted = quantize("layer", w, h, s, TRELLIS_TRANSFORM, o, seed=0, fisher=f, tokens=2048)

    def fisher_error(q):  # Σ_n f_n (ΔW H ΔWᵀ)_nn
        d = (q.weight - w).double()
        return float((((d @ h.double()) * d).sum(1) * f.double()).sum())

    assert fisher_error(weighted) < 0.9 * fisher_error(plain)  # the Fisher-weighted error falls
    assert weighted.kl == pytest.approx(0.5 * fisher_error(weighted) / 2048, rel=1e-3)
    assert weighted.rel > plain.rel  # paid for with more unweighted error
    torch.testing.assert_close(F.dequantize(weighted.tensors), weighted.weight, rtol=1e-4, atol=1e-5)
    both = quantize("layer", w, h, s, Transform(True, True, False), o, seed=0, fisher=f, tokens=2048)
    assert "sv" in both.tensors and both.bits == F.storage_bits(both.tensors) == trellis_storage_bits(96, 256, 3, sv=True)
    torch.testing.assert_close(F.dequantize(both.tensors), both.weight, rtol=1e-4, atol=1e-5)
    # weights floor at WALK_WEIGHT_FLOOR x the mean: a row of zero Fisher is still encoded
    ww = walk_weights(torch.tensor([0.0, 1.0, 3.0]), TRELLIS_TRANSFORM)
    assert ww[0] > 0 and torch.equal(ww[1:], torch.tensor([1.0, 3.0]))


# ------------------------------------------------------------------------------------------------ optimizer


def synthetic_layers(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    layers = []
    for i, (n, k) in enumerate(shapes):
        sens = float(torch.rand(1, generator=g)) * 10 + 0.1
        cands = []
        for s in candidates(k):
            bits = storage_bits(n, k, s.segments(k), True, True, False)
            b = bits / (n * k)
            cands.append({"setting": s.name, "bits": bits, "kl": sens * 4.0 ** (-b) * (1 + 0.1 * float(torch.rand(1, generator=g)))})
        layers.append({"name": f"l{i}", "shape": [n, k], "transform": "su+perm", "candidates": cands})
    return layers


def test_optimizer_matches_brute_force():
    layers = synthetic_layers([(64, 64), (32, 128), (96, 64)], seed=1)
    for layer in layers:
        layer["candidates"] = layer["candidates"][::3]  # small enough to enumerate
    weights = sum(r["shape"][0] * r["shape"][1] for r in layers)
    for target in (2.6, 3.3, 4.1, 5.7):
        plan = optimize(layers, target, cells=20000)
        best = None
        for combo in itertools.product(*[r["candidates"] for r in layers]):
            bits = sum(c["bits"] for c in combo)
            if bits <= target * weights:
                kl = sum(c["kl"] for c in combo)
                best = kl if best is None else min(best, kl)
        assert plan["bits"] <= target * weights
        assert plan["predicted_kl"] <= best * (1 + 1e-9)


def test_optimizer_hits_targets_across_range():
    shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30
    layers = synthetic_layers(shapes)
    for target in (2.0, 2.25, 2.5, 3.0, 3.37, 4.0, 4.25, 4.5, 5.0, 5.5, 6.0, 7.0, 8.0):
        plan = optimize(layers, target)
        assert target - 0.02 <= plan["bpw"] <= target, (target, plan["bpw"])
        assert plan["bits"] == sum(c["bits"] for c in plan["choices"].values())
    with pytest.raises(TargetError, match="out of reach"):
        optimize(layers, 1.2)
    with pytest.raises(TargetError, match="out of reach"):
        optimize(layers, 9.5)


def test_more_bits_never_predicts_more_loss():
    layers = synthetic_layers([(128, 256)] * 12, seed=4)
    kls = [optimize(layers, b)["predicted_kl"] for b in (2.5, 3.0, 3.5, 4.0, 5.0, 6.0)]
    assert all(a > b for a, b in zip(kls, kls[1:]))
    assert math.isfinite(kls[0])


def test_matmul_hadamard_equals_format_fwht():
    from quant.hadamard import fwht

    for n in (32, 96, 576, 1536, 4096):
        x = torch.randn(3, n, dtype=torch.float64)
        assert torch.allclose(fwht(x), F.fwht(x), atol=1e-12)


def test_prepare_reuses_the_rotated_hessian_exactly():
    w, h, _ = problem()
    base = prepare(w, h, Transform(True, False, True), seed=2, name="m")
    fresh = prepare(w, h, Transform(True, True, True), seed=2, name="m")
    shared = prepare(w, h, Transform(True, True, True), seed=2, name="m", h_from=base)
    assert torch.equal(fresh.w, shared.w) and torch.equal(fresh.h, shared.h) and torch.equal(fresh.perm, shared.perm)


def test_float32_hessians_for_very_wide_layers(monkeypatch):
    """Layers wider than 16384 inputs keep H in float32 (memory); the code paths must agree on dtypes."""
    import quant.capture
    import quant.gptq
    import quant.transform

    for mod in (quant.gptq, quant.transform, quant.capture):
        monkeypatch.setattr(mod, "hessian_dtype", lambda k: torch.float32)
    w, h, x = problem()
    h32, _ = quant.capture.hessian(x)
    assert h32.dtype == torch.float32
    rec = measure("wide", w, h32, x.shape[0], torch.ones(96), QuantOptions(measure_rows=32), seed=0)
    q = quantize("wide", w, h32, Setting(4, 64), Transform.parse(rec["transform"]), QuantOptions(), seed=0)
    assert q.rel < 0.01 and all(math.isfinite(c["kl"]) for c in rec["candidates"])


def test_default_trellis_code_is_two_tables_up_to_4_bits_on_matrices_where_tables_are_cheap():
    big = {s.bits: s.code for s in trellis_candidates(576, 1536)}
    assert big == {1: 3, 2: 3, 3: 3, 4: 3, 5: 1, 6: 1, 7: 1, 8: 1}
    assert {s.code for s in trellis_candidates(192, 576)} == {1, 3}  # SmolLM2's smallest (k_proj): 0.009 bpw of tables
    assert {s.code for s in trellis_candidates(64, 64)} == {1}  # 128 bytes would be 0.25 bpw here
    assert all(s.state_bits == 12 for s in trellis_candidates(576, 1536) if s.code == 3)
    assert trellis_storage_bits(64, 64, 3, 3) - trellis_storage_bits(64, 64, 3, 1) == 8 * 128
    assert trellis_storage_bits(64, 64, 3, 2) - trellis_storage_bits(64, 64, 3, 1) == 8 * 256
    assert TrellisSetting.parse("trellis3/L12/c3") == TrellisSetting(3, 12, 3)
    assert TrellisSetting.parse("trellis3/L12/c2").code == 2  # older measurements keep their meaning
