"""The trellis encoder (quant/trellis.py, cuda_ext/csrc/trellis_encode.cpp) against plain references."""

import itertools

import numpy as np
import pytest
import torch

from exl import format as F
from exl.format import TrellisMeta
from quant import trellis as T


def _kernels():
    return T._kernels()


def _walks(T_, k, L, s0_list=None):
    """Every walk of T_ steps (states) from every start state."""
    for s0 in s0_list if s0_list is not None else range(2**L):
        for news in itertools.product(range(2**k), repeat=T_ - 1):
            s, st = s0, [s0]
            for nb in news:
                s = (s >> k) | (nb << (L - k))
                st.append(s)
            yield np.array(st)


def _cpp(x, c, vals, k, L, isa, window=-1, overlap=None):
    out = _kernels().trellis_viterbi([torch.tensor(x)[None]], [torch.tensor(c)[None]], [torch.tensor(vals)], [k], [L],
                                     window, None if overlap is None else [torch.tensor([overlap], dtype=torch.int32)],
                                     isa)
    return out[0][0][0].numpy(), float(out[0][1][0])


@pytest.mark.parametrize("k,L,steps", [(1, 3, 8), (2, 4, 5), (1, 4, 6), (2, 6, 4), (3, 5, 4)])
def test_viterbi_finds_the_brute_force_optimum(k, L, steps):
    rng = np.random.default_rng(k * 100 + L)
    vals = (rng.normal(size=2**L) * 3).astype(np.float32)
    x = (rng.normal(size=steps) * 3).astype(np.float32)
    c = rng.uniform(0.5, 2, size=steps).astype(np.float32)
    free = min(T.walk_cost(w, x, c, vals) for w in _walks(steps, k, L))
    path, ref = T.viterbi_reference(x, c, vals, k, L)
    assert ref == pytest.approx(free, rel=1e-9)
    assert T.walk_cost(path, x, c, vals) == pytest.approx(free, rel=1e-9)
    o = 1  # a fixed overlap: s_0 & (2^(L-K) - 1) == o == s_{T-1} >> K
    circ = min(T.walk_cost(w, x, c, vals) for w in _walks(steps, k, L)
               if (w[0] & (2 ** (L - k) - 1)) == o and (w[-1] >> k) == o)
    _, ref_c = T.viterbi_reference(x, c, vals, k, L, overlap=o)
    assert ref_c == pytest.approx(circ, rel=1e-9)
    for isa in _kernels().trellis_encoder_isas():
        st, cost = _cpp(x, c, vals, k, L, isa)
        assert T.walk_cost(st, x, c, vals) == pytest.approx(free, rel=1e-5), isa
        assert cost == pytest.approx(free, rel=1e-5), isa
        st, cost = _cpp(x, c, vals, k, L, isa, overlap=o)
        assert st[0] & (2 ** (L - k) - 1) == o and st[-1] >> k == o
        assert T.walk_cost(st, x, c, vals) == pytest.approx(circ, rel=1e-5), isa


@pytest.mark.parametrize("k", [1, 2, 3])
def test_tail_biting_walks_are_valid_and_near_the_exact_circular_optimum(k):
    meta = TrellisMeta(k, 8)
    vals = T.codebook(meta).numpy()
    g = torch.Generator().manual_seed(k)
    x = torch.randn(20, 256, generator=g) * T.CODE_SIGMA
    c = torch.rand(20, 256, generator=g) + 0.5
    for isa in _kernels().trellis_encoder_isas():
        states, cost = T.encode_tiles([x], [c], [meta], isa=isa)[0]
        F.trellis_pack(states, meta)  # raises unless every walk is circular and consistent
        for b in range(3):
            got = T.walk_cost(states[b].numpy(), x[b].numpy(), c[b].numpy(), vals)
            assert float(cost[b]) == pytest.approx(got, rel=1e-4)
            exact = min(T.viterbi_reference(x[b].numpy(), c[b].numpy(), vals, k, 8, overlap=o)[1]
                        for o in range(2 ** (8 - k)))
            assert exact <= got * (1 + 1e-6) and got <= exact * 1.02, (isa, b, got, exact)


def test_isas_agree_on_real_sizes():
    meta = TrellisMeta(3, 10)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(3)) * T.CODE_SIGMA
    c = torch.ones_like(x)
    costs = [T.encode_tiles([x], [c], [meta], isa=isa)[0][1] for isa in _kernels().trellis_encoder_isas()]
    for other in costs[1:]:
        torch.testing.assert_close(other, costs[0], rtol=1e-4, atol=0)


def _hessian(k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * k, k, generator=g, dtype=torch.float64) @ (torch.eye(k, dtype=torch.float64)
                                                                     + 0.3 * torch.randn(k, k, generator=g, dtype=torch.float64))
    return x.T @ x


def test_ldlq_feedback_lowers_the_hessian_error_and_reports_it_exactly():
    from quant.gptq import inverse_cholesky

    n, k = 32, 64
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    h = _hessian(k)
    u, damp = inverse_cholesky(h, 0.01)
    hd = h + damp * h.diagonal().mean() * torch.eye(k, dtype=torch.float64)
    meta = TrellisMeta(2, 10)
    fed, = T.ldlq(w, u, [meta])
    plain, = T.ldlq(w, torch.eye(k), [meta])

    def energy(q):
        d = (q - w).double()
        return float(((d @ hd) * d).sum())

    assert float(fed.row_err.sum()) == pytest.approx(energy(fed.q), rel=1e-3)
    assert energy(fed.q) < 0.8 * energy(plain.q)
    # the stored streams and scales decode to the same matrix
    t = {"trellis": fed.words, "tscale": fed.scales, "tmeta": meta.to_tensor()}
    torch.testing.assert_close(F.trellis_decode(t), fed.q, rtol=1e-6, atol=1e-6)


def test_ldlq_refits_each_row_scale_by_hessian_least_squares():
    """The refit keeps the walks, gives each row the float16 scale s = (w H vᵀ)/(v H vᵀ) of its code values v
    where that lowers the row's error tr(ΔW H ΔWᵀ), and reports the new errors exactly."""
    from quant.gptq import inverse_cholesky

    n, k = 48, 64
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.5, 2.0, k)
    h = _hessian(k)
    u, damp = inverse_cholesky(h, 0.01)
    hd = h + damp * h.diagonal().mean() * torch.eye(k, dtype=torch.float64)
    meta = TrellisMeta(2, 10)
    plain, = T.ldlq(w, u, [meta], refit=False)
    fit, = T.ldlq(w, u, [meta])
    assert torch.equal(plain.words, fit.words)

    def rows(q):
        d = (q - w).double()
        return ((d @ hd) * d).sum(1)

    v = plain.q.double() / plain.scales.double()[:, None]
    vh = v @ hd
    s_ref = ((vh * w.double()).sum(1) / (vh * v).sum(1)).half()
    e_plain, e_fit = rows(plain.q), rows(fit.q)
    changed = fit.scales != plain.scales
    assert torch.equal(fit.scales[changed], s_ref[changed])
    assert bool((e_fit <= e_plain * (1 + 1e-5)).all())
    assert float(e_fit.sum()) < 0.99 * float(e_plain.sum())  # a real gain on this Hessian
    torch.testing.assert_close(fit.row_err.double(), e_fit, rtol=1e-3, atol=1e-6)
    t = {"trellis": fit.words, "tscale": fit.scales, "tmeta": meta.to_tensor()}
    torch.testing.assert_close(F.trellis_decode(t), fit.q, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("code", [1, 3])
def test_refinement_passes_lower_the_error_tile_by_tile_and_report_it_exactly(code):
    """quant.trellis.refine: each pass re-encodes every strip against its optimum given the other strips and
    keeps a tile's new walk only where it lowers tr(ΔW H ΔWᵀ): no tile row gets worse, the whole matrix gets
    better, the reported row errors are exact, and the packed walks decode to what it reports."""
    from quant.gptq import inverse_cholesky

    n, k = 64, 96
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(4))
    h = _hessian(k, seed=2)
    u, damp = inverse_cholesky(h, 0.01)
    hd = h + damp * h.diagonal().mean() * torch.eye(k, dtype=torch.float64)
    meta = TrellisMeta(2, 10 if code == 1 else 12, code=code)

    def tile_rows(q):  # the error of each 16-row tile row
        d = (q - w).double()
        return ((d @ hd) * d).sum(1).view(n // 16, 16).sum(1)

    runs = [T.ldlq(w, u, [meta], refit=False, passes=p)[0] for p in (0, 1, 2)]
    errs = [tile_rows(r.q) for r in runs]
    for before, after in zip(errs, errs[1:]):
        assert bool((after <= before * (1 + 1e-6)).all())
    assert float(errs[1].sum()) < 0.99 * float(errs[0].sum())  # a real gain on this Hessian
    assert float(errs[2].sum()) <= float(errs[1].sum())
    for r in runs:
        torch.testing.assert_close(r.row_err.double().view(n // 16, 16).sum(1), tile_rows(r.q), rtol=1e-3, atol=1e-6)
        t = {"trellis": r.words, "tscale": r.scales, "tmeta": meta.to_tensor(), "tcode": T.tables(meta)}
        torch.testing.assert_close(F.trellis_decode(t), r.q, rtol=1e-6, atol=1e-6)
    refit, = T.ldlq(w, u, [meta], passes=1)  # the scale refit runs on the refined walks
    assert torch.equal(refit.words, runs[1].words) and float(tile_rows(refit.q).sum()) <= float(errs[1].sum())


@pytest.mark.parametrize("passes", [0, 1])
def test_row_weights_move_the_error_onto_the_light_rows(passes):
    """ldlq(row_weights=...): the walks' cost weighs each row (a tile's 16 rows share one walk), so heavy rows get
    less error and the weighted error falls; the reported row errors stay the plain ones, exactly."""
    from quant.gptq import inverse_cholesky

    n, k = 64, 64
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(6))
    h = _hessian(k, seed=3)
    u, damp = inverse_cholesky(h, 0.01)
    hd = h + damp * h.diagonal().mean() * torch.eye(k, dtype=torch.float64)
    rw = torch.ones(n)
    rw[::4] = 20.0  # one row in four matters 20x more
    meta = TrellisMeta(2, 12, code=3)
    plain, = T.ldlq(w, u, [meta], refit=False, passes=passes)
    weighted, = T.ldlq(w, u, [meta], refit=False, passes=passes, row_weights=rw)

    def rows(q):
        d = (q - w).double()
        return ((d @ hd) * d).sum(1)

    e0, e1 = rows(plain.q), rows(weighted.q)
    assert float((e1 * rw).sum()) < 0.85 * float((e0 * rw).sum())  # the weighted error, the one that counts
    assert float(e1[::4].sum()) < 0.7 * float(e0[::4].sum())  # heavy rows: less error
    torch.testing.assert_close(weighted.row_err.double(), e1, rtol=1e-3, atol=1e-6)
    assert torch.equal(T.ldlq(w, u, [meta], refit=False, passes=passes, row_weights=torch.ones(n))[0].q, plain.q)


def test_ldlq_several_settings_at_once_equal_one_at_a_time():
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    u = torch.eye(32)
    metas = [TrellisMeta(2, 9), TrellisMeta(4, 9)]
    both = T.ldlq(w, u, metas)
    for m, r in zip(metas, both):
        one, = T.ldlq(w, u, [m])
        assert torch.equal(one.words, r.words)


def test_viterbi_uses_the_threads_one_thread_replaced(monkeypatch):
    from quant.gptq import one_thread

    seen = []
    real = T._kernels()

    class Spy:
        def trellis_viterbi(self, *a):
            seen.append(torch.get_num_threads())
            return real.trellis_viterbi(*a)

    monkeypatch.setattr(T, "_kernels", lambda: Spy())
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_thread(torch.device("cpu")):
            T.ldlq(torch.randn(16, 32), torch.eye(32), [TrellisMeta(2, 8)])
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(n)
    assert seen == [2, 2]


def test_ldlq_without_words_prices_the_same():
    """The measurement skips packing the walks; its errors, scales and matrix must not change."""
    g = torch.Generator().manual_seed(7)
    w, k = torch.randn(32, 64, generator=g), 64
    a = torch.randn(k, k, generator=g)
    u = torch.linalg.cholesky(torch.linalg.inv(a @ a.T / k + torch.eye(k)), upper=True)
    metas = [TrellisMeta(2, 8), TrellisMeta(3, 10)]
    packed, bare = T.ldlq(w, u, metas), T.ldlq(w, u, metas, want_words=False)
    for p, b in zip(packed, bare):
        assert b.words is None and p.words is not None
        assert torch.equal(p.row_err, b.row_err) and torch.equal(p.scales, b.scales) and torch.equal(p.q, b.q)


@pytest.mark.parametrize("k,L", [(1, 12), (2, 12), (2, 11), (3, 12), (4, 12)])
def test_viterbi_matches_the_reference_at_real_sizes_on_both_step_orders(k, L):
    """2^(L-K) >= 512 groups take the one-sweep step (trellis_encode.cpp kFusedGroups), fewer the two-pass
    one: both must find the exact constrained optimum of the NumPy reference, at the format's sizes."""
    meta = TrellisMeta(k, L)
    vals = T.codebook(meta).numpy()
    g = torch.Generator().manual_seed(k * 31 + L)
    x = torch.randn(3, 256, generator=g) * T.CODE_SIGMA
    c = torch.rand(3, 256, generator=g) + 0.5
    ov = torch.randint(0, 2 ** (L - k), (3,), generator=g, dtype=torch.int32)
    for isa in _kernels().trellis_encoder_isas():
        states, cost = T.encode_tiles([x], [c], [meta], overlaps=[ov], isa=isa)[0]
        for b in range(3):
            _, ref = T.viterbi_reference(x[b].numpy(), c[b].numpy(), vals, k, L, overlap=int(ov[b]))
            got = T.walk_cost(states[b].numpy(), x[b].numpy(), c[b].numpy(), vals)
            assert got == pytest.approx(ref, rel=1e-5) and float(cost[b]) == pytest.approx(ref, rel=1e-5), (isa, b)


@pytest.mark.parametrize("code", F.TWO_TABLE_CODES)
@pytest.mark.parametrize("bits", [2, 3])
def test_ldlq_two_table_walks_decode_to_what_it_reports(bits, code):
    """Codes 2 and 3 (two tables, layout 2): the packed walks decode (exl.format's reference) to exactly
    Result.q, and the error is close to code 1's on the same matrix (within 10%)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 64, generator=g)
    u = torch.eye(64)
    m1, m2 = F.TrellisMeta(bits, 12), F.TrellisMeta(bits, 12, code=code)
    r1, r2 = T.ldlq(w, u, [m1, m2])
    t = {"trellis": r2.words, "tscale": r2.scales, "tmeta": m2.to_tensor(), "tcode": T.tables(m2)}
    assert torch.equal(F.trellis_decode(t), r2.q)
    e1, e2 = float(((w - r1.q) ** 2).mean()), float(((w - r2.q) ** 2).mean())
    assert e2 < 1.1 * e1 and e2 < [0.3, 0.12, 0.04][bits - 1]
