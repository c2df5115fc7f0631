"""CPU trellis kernels (cuda_ext TrellisLinearCPU) and TrellisLinear against exl.format's reference (§7).

Random int32 words are always a valid trellis layer (every bit stream is a walk), so layers here are
random words, random fp16 scales and random signs; code 2 layers (two tables, tile layout 2) also get
random int8 tables holding both extremes -128 and 127. The decoded code values are exact integers and
must match bit for bit; outputs may differ from the fp64 result only by float summation error,
bounded as in test_kernels.py: |y - y_exact| <= 4 u (sqrt(K) + 8) c, c = |u| @ |Q|^T through |H_N|.
"""

from __future__ import annotations

import math

import pytest
import torch

from cuda_ext import build
from exl import format as F
from exl.modules.trellis_linear import TrellisLinear

U = 2.0**-24


@pytest.fixture(scope="module")
def ext():
    return build.load_cpu()  # fails (not skips) when the extension cannot be built


def isas():
    return build.load_cpu().isa_names()


CODES = (F.CODE_LCG_BYTESUM, F.CODE_TWO_TABLE, F.CODE_TWO_TABLE_64)


def random_tables(g, code=F.CODE_TWO_TABLE):
    t = torch.randint(-128, 128, (2 * F.two_table_size(code),), generator=g, dtype=torch.int64)
    t[torch.randperm(t.numel(), generator=g)[:4]] = torch.tensor([-128, 127, -128, 127])
    return t.to(torch.int8)


def random_trellis(n, k, bits, state_bits=16, *, bias=True, seed=0, mul=None, add=None, code=F.CODE_LCG_BYTESUM,
                   sv=True):
    """A random layer; codes 2 and 3 force L = 12 (their only state size); sv=False: no output rotation (§7.4)."""
    g = torch.Generator().manual_seed(seed)
    kw = {} if mul is None else {"mul": mul, "add": add}
    if code in F.TWO_TABLE_CODES:
        state_bits, kw = F.TWO_TABLE_STATE_BITS, {}
    meta = F.TrellisMeta(bits, state_bits, code=code, **kw)
    words = torch.randint(-(2**31), 2**31, (n // 16, k // 16, meta.words_per_tile), generator=g, dtype=torch.int64)
    t = {"trellis": words.to(torch.int32), "tscale": (torch.rand(n, generator=g) * 1e-3 + 1e-4).half(),
         "tmeta": meta.to_tensor(), "su": F.pack_signs(torch.where(torch.rand(k, generator=g) < 0.5, -1, 1)),
         "sv": F.pack_signs(torch.where(torch.rand(n, generator=g) < 0.5, -1, 1))}
    if not sv:
        del t["sv"]
    if code in F.TWO_TABLE_CODES:
        t["tcode"] = random_tables(g, code)
    if bias:
        t["bias"] = torch.randn(n, generator=g)
    return t


def kernel(ext, t, isa="auto"):
    return ext.TrellisLinearCPU(t["trellis"], t["tscale"], t["tmeta"], t["su"], t.get("sv"), t.get("bias"), isa,
                                tcode=t.get("tcode"))


def reference_values(t):
    meta = F.TrellisMeta.from_tensor(t["tmeta"])
    values = F.trellis_code(F.trellis_states(t["trellis"], meta), meta, t.get("tcode"))
    return F.trellis_tiles_to_matrix(values, meta.version)


def exact_and_scale(x, t):
    """fp64 result and the error scale c (module doc)."""
    q = F.trellis_decode(t, torch.float64)
    n, k = q.shape
    u = F.fwht(x.double() * F.unpack_signs(t["su"], k, torch.float64))
    z, c = u @ q.T, u.abs() @ q.abs().T
    bias = t.get("bias", torch.zeros(n)).double()
    if "sv" not in t:
        return z + bias, c
    h = F.hadamard_matrix(n).abs()
    return F.fwht(z) * F.unpack_signs(t["sv"], n, torch.float64) + bias, c @ h.T


def check(y, x, t):
    exact, c = exact_and_scale(x, t)
    k = t["trellis"].shape[1] * 16
    bound = 4 * U * (math.sqrt(k) + 8) * c + 1e-30
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), f"max err {float(err.max()):.3e}, ratio to bound {float((err / bound).max()):.2f}"


@pytest.mark.parametrize("bits", range(1, 9))
def test_decode_is_exact_for_every_k_l_and_isa(ext, bits):
    for L in sorted({max(8, bits), 11, 16}):
        t = random_trellis(48, 64, bits, L, seed=bits * 31 + L, mul=0x9E3779B1, add=0x7F4A7C15)
        ref = reference_values(t)
        for isa in isas():
            got = kernel(ext, t, isa).decode()
            assert torch.equal(got, ref.float()), f"K={bits} L={L} isa={isa}"


@pytest.mark.parametrize("code", F.TWO_TABLE_CODES)
@pytest.mark.parametrize("bits", range(1, 8))
def test_two_table_decode_is_exact_for_every_k_and_isa(ext, bits, code):
    for n, k in ((48, 64), (16, 16), (80, 48)):  # N, K multiples of 16, not all of 64
        t = random_trellis(n, k, bits, code=code, seed=bits * 7 + n)
        ref = reference_values(t)
        for isa in isas():
            got = kernel(ext, t, isa).decode()
            assert torch.equal(got, ref.float()), f"code {code} K={bits} {n}x{k} isa={isa}"


@pytest.mark.parametrize("code,bits", [(1, b) for b in range(1, 9)] + [(c, b) for c in (2, 3) for b in range(1, 8)])
def test_forward_matches_reference_for_rows_and_prefill(ext, code, bits):
    t = random_trellis(64, 96, bits, 16 if bits % 2 else max(8, bits), seed=bits, code=code)
    g = torch.Generator().manual_seed(100 + bits)
    for isa in isas():
        k = kernel(ext, t, isa)
        for rows in (1, 2, 3, 5, 9, 16):
            x = torch.randn(rows, 96, generator=g)
            check(k.forward(x, "fp32", 32, False), x, t)
        x = torch.randn(40, 96, generator=g)
        check(k.forward(x, "auto", 32, False), x, t)  # 40 >= 32 rows: tile decode + GEMM
        check(k.forward(x[:7], "gemm", 32, False), x[:7], t)
        check(k.forward(x[:20], "fp32", 32, False), x[:20], t)  # more than 16 rows through the GEMV


@pytest.mark.parametrize("code", CODES)
def test_one_sided_layers_match_reference_on_every_path(ext, code):
    """Format version 3: no `sv`, so y = z + bias (no output rotation) on the GEMVs, the GEMM and every table."""
    t = random_trellis(64, 96, 3, 12, seed=21, code=code, sv=False)
    g = torch.Generator().manual_seed(22)
    x = torch.randn(40, 96, generator=g)
    for isa in isas():
        k = kernel(ext, t, isa)
        for rows in (1, 5, 16):
            check(k.forward(x[:rows], "fp32", 32, False), x[:rows], t)
        check(k.forward(x, "gemm", 32, False), x, t)
        if k.has_int8:
            ref = F.reference_forward(x[:4], t)
            assert torch.allclose(k.forward(x[:4], "int8", 32, False), ref, rtol=0.05, atol=0.05 * float(ref.abs().max()))
    # the output rotation does change the result: the same layer with sv differs
    both = random_trellis(64, 96, 3, 12, seed=21, code=code)
    assert not torch.allclose(kernel(ext, both).forward(x[:2], "fp32", 32, False), kernel(ext, t).forward(x[:2], "fp32", 32, False))


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("exact", [True, False])
def test_batch_invariance_every_row_count_below_gemm_min_rows(ext, exact, code):
    t = random_trellis(96, 160, 3, 16, seed=7, code=code)
    x = torch.randn(31, 160, generator=torch.Generator().manual_seed(3))
    for isa in isas():
        k = kernel(ext, t, isa)
        full = k.forward(x, "auto", 32, exact)
        for rows in range(1, 31):
            part = k.forward(x[:rows], "auto", 32, exact)
            assert torch.equal(part, full[:rows]), f"isa={isa}: {rows} rows differ from the same rows among 31"
        # and a row's bits do not depend on its neighbours
        assert torch.equal(k.forward(x[5:6], "auto", 32, exact), full[5:6])


@pytest.mark.parametrize("code", CODES)
def test_isas_agree_and_threads_do_not_change_bits(ext, code):
    t = random_trellis(128, 256, 4, 14, seed=11, code=code)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    outs = {isa: kernel(ext, t, isa).forward(x, "fp32", 32, False) for isa in isas()}
    best = outs[isas()[-1]]
    for isa, y in outs.items():
        check(y, x, t)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(ext, t).forward(x, "fp32", 32, False)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, best)


def test_bad_tensors_are_named(ext):
    t = random_trellis(32, 32, 2)
    with pytest.raises(RuntimeError, match="words per tile"):
        ext.TrellisLinearCPU(t["trellis"][..., :8], t["tscale"], t["tmeta"], t["su"], t["sv"])
    with pytest.raises(RuntimeError, match="tscale must be float16"):
        ext.TrellisLinearCPU(t["trellis"], t["tscale"].float(), t["tmeta"], t["su"], t["sv"])
    with pytest.raises(RuntimeError, match="sv must be uint8"):
        ext.TrellisLinearCPU(t["trellis"], t["tscale"], t["tmeta"], t["su"], t["su"][:1])
    k = kernel(ext, t)
    with pytest.raises(RuntimeError, match="in_features=32"):
        k.forward(torch.randn(2, 48), "auto", 32, False)
    with pytest.raises(RuntimeError, match="unknown path"):
        k.forward(torch.randn(2, 32), "q4", 32, False)
    t = random_trellis(32, 48, 2)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        kernel(ext, t).forward(torch.randn(2, 48), "int8", 32, False)


def int8_check(y, x, t):
    """The int8-activation GEMV: within the activation-rounding bound of test_kernels.py plus the fp32 one."""
    exact, c = exact_and_scale(x, t)
    q = F.trellis_decode(t, torch.float64)
    n, k = q.shape
    u = F.fwht(x.double() * F.unpack_signs(t["su"], k, torch.float64))
    step = (u.view(u.shape[0], k // 32, 32).abs().amax(-1) / 127).repeat_interleave(32, dim=1)
    e = ((0.5 * 1.001 * step) @ q.abs().T) @ F.hadamard_matrix(n).abs().T
    bound = e + 4 * U * (math.sqrt(k) + 8) * c + 1e-30
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), f"max err {float(err.max()):.3e}, ratio to bound {float((err / bound).max()):.2f}"
    rel = float((y.double() - exact).norm() / exact.norm())
    assert rel < 0.02, f"relative RMS error {rel:.4f} of the int8 path"


@pytest.mark.parametrize("code,bits,n,k", [(1, 1, 64, 128), (1, 3, 64, 128), (1, 4, 64, 128), (1, 8, 64, 128),
                                           (2, 1, 64, 128), (2, 2, 80, 96), (2, 3, 48, 160), (2, 4, 64, 128),
                                           (2, 5, 112, 32), (2, 7, 64, 128),
                                           (3, 1, 64, 128), (3, 2, 80, 96), (3, 3, 48, 160), (3, 4, 64, 128),
                                           (3, 5, 112, 32), (3, 6, 64, 64), (3, 7, 64, 128)])
def test_int8_gemv_is_within_its_bound_and_the_same_bits_on_every_table(ext, code, bits, n, k):
    # two-table shapes: K a multiple of 32 but not of 64, tile-row counts that leave tails of the 4/2-row kernels
    t = random_trellis(n, k, bits, 16 if bits == 3 else 12, seed=40 + bits, bias=False, code=code)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(bits))
    with_int8 = [isa for isa in isas() if kernel(ext, t, isa).has_int8]
    assert "scalar" in with_int8
    outs = {}
    for isa in with_int8:
        k = kernel(ext, t, isa)
        full = k.forward(x, "int8", 48, False)
        int8_check(full, x, t)
        for rows in range(1, 16):
            assert torch.equal(k.forward(x[:rows], "int8", 48, False), full[:rows]), f"{isa}: {rows} rows"
        outs[isa] = full
    for isa, y in outs.items():
        assert torch.equal(y, outs["scalar"]), f"int8 GEMV of {isa} differs from the scalar table's"
    assert with_int8 == isas(), "every table has the int8 GEMV for every code"
    assert torch.equal(kernel(ext, t).forward(x[:3], "auto", 48, False),
                       kernel(ext, t).forward(x[:3], "int8" if kernel(ext, t).has_int8 else "fp32", 48, False))


@pytest.mark.parametrize("sv", [True, False])
@pytest.mark.parametrize("code", CODES)
def test_module_forward_equals_reference(ext, code, sv):
    t = random_trellis(80, 112, 3, 12, seed=5, code=code, sv=sv)
    m = TrellisLinear(t, exact=True)
    assert m.kernel() is not None and m.in_features == 112 and m.out_features == 80
    assert abs(m.bits_per_weight - F.bits_per_weight(t)) < 1e-12
    for shape in ((1, 1, 112), (2, 3, 112), (50, 112)):
        x = torch.randn(*shape)
        y = m(x)
        assert y.shape == (*shape[:-1], 80)
        check(y.reshape(-1, 80), x.reshape(-1, 112), t)
    ref = F.reference_forward(x, t)
    assert torch.allclose(m(x), ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))
    # no dense copy: the module holds exactly the stored tensors
    assert {n for n, _ in m.named_buffers()} == set(t)


@pytest.mark.parametrize("code", CODES)
def test_gemm_min_rows_default_per_table_and_cpu(ext, code):
    t = random_trellis(64, 64, 3, 12, code=code, bias=False)
    for isa in isas():
        k = kernel(ext, t, isa)
        every = k.int8_every_batch
        avx512 = k.trellis_isa == "avx512vnni"
        assert every == (code in F.TWO_TABLE_CODES and avx512), isa
        # codes 2 and 3: never on the AVX-512 trellis table, 17 on the AVX2 one (compute-bound lookups), else 64;
        # code 1: 96 on the AVX-512 table, else 17 (measured over a whole model, docs/benchmarks.md)
        if code not in F.TWO_TABLE_CODES:
            want = 96 if avx512 else 17
        else:
            want = 2**63 - 1 if every else 17 if k.trellis_isa == "avx2" else 64
        assert k.int8_gemm_min_rows == want, isa
    m = TrellisLinear(t)
    m.kernel()
    assert m.gemm_min_rows == kernel(ext, t).int8_gemm_min_rows
    assert TrellisLinear(t, exact=True).gemm_min_rows == 32
    assert TrellisLinear(t, gemm_min_rows=5).gemm_min_rows == 5
    m.gemm_min_rows = 9
    assert m.gemm_min_rows == 9
    # a batch past the default goes where the default says: the int8 GEMV's bits, or the GEMM's
    x = torch.randn(80, 64)
    k = kernel(ext, t)
    path = "int8" if k.int8_gemm_min_rows > 80 else "gemm"
    assert torch.equal(TrellisLinear(t)(x), k.forward(x, path, 10**9, False))


def test_module_reference_path_when_asked(monkeypatch):
    import cuda_ext

    t = random_trellis(32, 48, 2, 9, seed=2)
    monkeypatch.setattr(cuda_ext, "_cache", {})
    monkeypatch.setenv("EXL_NO_EXT", "1")
    m = TrellisLinear(t, exact=True)
    x = torch.randn(3, 48)
    assert m.kernel() is None
    assert torch.equal(m(x), F.reference_forward(x, t))


def test_module_rejects_bad_words():
    t = random_trellis(32, 48, 2)
    t["trellis"] = t["trellis"][..., :4]
    with pytest.raises(ValueError, match=r"trellis must be int32 \[2, 3, 16\]"):
        TrellisLinear(t)


def test_tables_are_required_for_code2_and_refused_for_code1(ext):
    t2 = random_trellis(32, 48, 3, code=F.CODE_TWO_TABLE)
    with pytest.raises(ValueError, match="code 2 layer needs its tables"):
        TrellisLinear({k: v for k, v in t2.items() if k != "tcode"})
    with pytest.raises(ValueError, match=r"must be int8 \[256\]"):
        TrellisLinear({**t2, "tcode": t2["tcode"].to(torch.int16)})
    t1 = random_trellis(32, 48, 3)
    with pytest.raises(ValueError, match="tcode is only for code 2 and 3 layers; this layer is code 1"):
        TrellisLinear({**t1, "tcode": t2["tcode"]})
    a = (t2["trellis"], t2["tscale"], t2["tmeta"], t2["su"], t2["sv"])
    with pytest.raises(RuntimeError, match="needs its tables: pass tcode"):
        ext.TrellisLinearCPU(*a)
    with pytest.raises(RuntimeError, match=r"must be int8 \[256\]"):
        ext.TrellisLinearCPU(*a, tcode=t2["tcode"][:128])
    with pytest.raises(RuntimeError, match="tcode was given for a code 1 layer"):
        ext.TrellisLinearCPU(t1["trellis"], t1["tscale"], t1["tmeta"], t1["su"], t1["sv"], tcode=t2["tcode"])
    bad = t2["tmeta"].clone()
    bad[0] = 1  # code 2 in layout 1
    with pytest.raises(RuntimeError, match="layout version 1 with code 2"):
        ext.TrellisLinearCPU(a[0], a[1], bad, a[3], a[4], tcode=t2["tcode"])
    t3 = random_trellis(32, 48, 3, code=F.CODE_TWO_TABLE_64)
    with pytest.raises(ValueError, match=r"tcode of a code 3 layer must be int8 \[128\]"):
        TrellisLinear({**t3, "tcode": t2["tcode"]})
    with pytest.raises(RuntimeError, match=r"tcode of a code 3 layer must be int8 \[128\]"):
        ext.TrellisLinearCPU(t3["trellis"], t3["tscale"], t3["tmeta"], t3["su"], t3["sv"], tcode=t2["tcode"])


@pytest.mark.parametrize("code,bits,n,k,state_bits", [(3, 2, 64, 576, 12), (3, 4, 48, 160, 12), (2, 3, 80, 96, 12),
                                                      (3, 7, 32, 64, 12), (1, 5, 64, 576, 16), (1, 6, 48, 160, 16),
                                                      (1, 3, 32, 96, 12), (1, 8, 16, 64, 16)])
def test_amx_gemv_gives_the_vpdpbusd_kernels_bits(ext, code, bits, n, k, state_bits):
    """Where AMX runs, the AVX-512 table's int8 GEMV multiplies groups of up to 16 rows on tiles (from 9 rows, code 1
    from 5): bit for bit the results without AMX (and so the scalar table's), whole groups of 16 and short tails."""
    if not ext.amx_supported():
        pytest.skip("this CPU or OS runs no AMX int8 tile multiplies")
    t = random_trellis(n, k, bits, state_bits, seed=60 + bits, bias=False, code=code)
    x = torch.randn(41, k, generator=torch.Generator().manual_seed(bits)) * 3
    lin = kernel(ext, t, "avx512vnni")
    was = ext.amx_enabled()
    try:
        assert ext.set_amx(False) is False and not ext.amx_enabled()
        plain = {rows: lin.forward(x[:rows], "int8", 10**9, False) for rows in (4, 5, 8, 9, 16, 17, 21, 25, 32, 41)}
        assert ext.set_amx(True) is True
        for rows, want in plain.items():
            assert torch.equal(lin.forward(x[:rows], "int8", 10**9, False), want), f"{rows} rows"
        scalar = kernel(ext, t, "scalar").forward(x, "int8", 10**9, False)
        assert torch.equal(lin.forward(x, "int8", 10**9, False), scalar)
    finally:
        ext.set_amx(was)
