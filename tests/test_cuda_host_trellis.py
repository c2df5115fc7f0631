"""The CUDA trellis kernels (cuda_trellis.cu, TrellisLinearCUDA) run on the CPU by the host harness
(docs/cuda_host.md), against exl.format's trellis reference (docs/format.md §7)."""

from __future__ import annotations

import pytest
import torch

from cuda_reference import assert_rel_close, random_trellis, random_two_table, trellis_reference

from exl import format as F

pytestmark = pytest.mark.kernels  # as tests/test_cuda_host.py

@pytest.fixture(scope="module")
def host():
    from cuda_ext.host_build import load_cuda_host

    return load_cuda_host()


def layer(host, t):
    return host.TrellisLinearCUDA(t["trellis"], t["tscale"], t["tmeta"], t["su"], t.get("sv"), t.get("bias"),
                                  tcode=t.get("tcode"))


@pytest.mark.parametrize("bits", range(1, 9))
def test_dequant_is_the_scaled_code_rounded_once(host, bits):
    t = random_trellis(48, 64, bits, 16 if bits % 2 else max(8, bits), seed=bits)
    want = F.trellis_decode(t, torch.float64).half()  # tscale * value, exact in fp32, rounded to fp16 once
    assert torch.equal(layer(host, t).dequantize(), want)


@pytest.mark.parametrize("bits", [1, 3, 4, 5, 8])
def test_forward_gemv_and_gemm_paths(host, bits):
    t = random_trellis(64, 96, bits, 12 if bits < 8 else 16, seed=10 + bits)
    lay = layer(host, t)
    assert (lay.in_features, lay.out_features) == (96, 64)
    g = torch.Generator().manual_seed(bits)
    for m, path, tol in ((1, "gemv", 3e-3), (2, "gemv", 3e-3), (3, "auto", 3e-3), (5, "gemv", 3e-3),
                         (9, "gemv", 3e-3), (12, "gemm", 1e-2), (10, "auto", 1e-2)):
        x = torch.randn(m, 96, generator=g).half()
        got = lay.forward(x, path)
        assert got.dtype == torch.float16 and got.shape == (m, 64)
        assert_rel_close(got, trellis_reference(x, t), tol, f"{path} m={m}")


@pytest.mark.parametrize("code", [1, 3])
def test_one_sided_layers_have_no_output_rotation(host, code):
    """Format version 3: a trellis layer without `sv` is y = z + bias on the GEMV and the GEMM."""
    t = random_trellis(64, 96, 3, 12, seed=31, code=code)
    del t["sv"]
    lay = layer(host, t)
    g = torch.Generator().manual_seed(31)
    for m, path, tol in ((1, "gemv", 3e-3), (5, "gemv", 3e-3), (12, "gemm", 1e-2)):
        x = torch.randn(m, 96, generator=g).half()
        assert_rel_close(lay.forward(x, path), trellis_reference(x, t), tol, f"no sv, code {code}, {path} m={m}")
    with pytest.raises(RuntimeError, match="sv must be uint8"):
        host.TrellisLinearCUDA(t["trellis"], t["tscale"], t["tmeta"], t["su"], t["su"][:1], tcode=t.get("tcode"))


def test_bad_tensors_are_named(host):
    t = random_trellis(32, 32, 2, 8)
    with pytest.raises(RuntimeError, match="words per tile"):
        host.TrellisLinearCUDA(t["trellis"][..., :8].contiguous(), t["tscale"], t["tmeta"], t["su"], t["sv"])
    with pytest.raises(RuntimeError, match="in_features=32"):
        layer(host, t).forward(torch.randn(2, 48).half(), "auto")


# Code 2 ("two tables", tile layout 2, L = 12, K <= 7: docs/format.md §7.3)


@pytest.mark.parametrize("bits", range(1, 8))
def test_two_table_dequant_is_the_scaled_code_rounded_once(host, bits):
    t = random_two_table(48, 64, bits, seed=100 + bits)
    assert torch.equal(layer(host, t).dequantize(), F.trellis_decode(t, torch.float64).half())


def test_two_table_dequant_launcher_stays_in_bounds(host):
    """Row ranges of the GEMM path's tile loop, each into a guarded buffer."""
    t = random_two_table(80, 48, 3, seed=7)
    lay, want = layer(host, t), F.trellis_decode(t, torch.float64).half()
    for n0, n1 in ((0, 80), (16, 48), (64, 80)):
        buf = torch.full(((n1 - n0) * 48 + 128,), -7.0, dtype=torch.float16)
        host.trellis_dequant(lay, n0, n1, buf[64 : 64 + (n1 - n0) * 48].view(n1 - n0, 48))
        assert bool((buf[:64] == -7).all()) and bool((buf[64 + (n1 - n0) * 48 :] == -7).all()), "write out of bounds"
        assert torch.equal(buf[64 : 64 + (n1 - n0) * 48].view(n1 - n0, 48), want[n0:n1])


def test_gemv_split_of_k(host):
    """K-slices of at least 4 tiles, about 2048 warps, none empty; the shape alone decides."""
    assert host.trellis_gemv_split(80, 48) == (1, 3)  # 3 tiles: no split
    assert host.trellis_gemv_split(48, 416) == (6, 5)  # 26 tiles: 5 + 5 + 5 + 5 + 5 + 1
    assert host.trellis_gemv_split(576, 576) == (9, 4)  # 36 rows: 2048 warps would want 57 slices
    assert host.trellis_gemv_split(4096, 4096) == (8, 32)  # 256 rows x 8 slices = 2048 warps


@pytest.mark.parametrize("code,bits,n,k", [(2, b, 80, 48) for b in (1, 2, 3, 4, 7)] + [(1, 3, 80, 48)]
                         + [(3, b, 80, 48) for b in (1, 3, 6, 7)]
                         + [(c, b, 48, 416) for c, b in ((2, 2), (2, 7), (3, 3), (1, 3), (1, 8))])
def test_gemv_every_row_count(host, code, bits, n, k):
    """The raw GEMV (fp32 in, fp32 out) for every row count it takes against Q̂ u in float64: every template
    instantiation with live rows below the template's; N = 80 (the second block has one warp), K = 48;
    N = 48, K = 416 (six K-slices, the last of one tile, added by the second launch)."""
    t = (random_two_table(n, k, bits, seed=20 + bits, bias=False, code=code) if code in F.TWO_TABLE_CODES
         else random_trellis(n, k, bits, 16 if bits < 8 else 8, seed=20 + bits, bias=False))
    lay = layer(host, t)
    assert lay.gemv_max_rows == (16 if code in F.TWO_TABLE_CODES else 8)
    q = F.trellis_decode(t, torch.float64)
    g = torch.Generator().manual_seed(bits)
    for m in range(1, lay.gemv_max_rows + 1):
        u = torch.randn(m, k, generator=g)
        buf = torch.full((m * k + 64,), float("nan"))  # reading past the M rows gives NaN
        buf[: m * k] = u.flatten()
        zbuf = torch.full((m * n + 128,), -7.0)
        host.trellis_gemv(lay, buf[: m * k].view(m, k), zbuf[64 : 64 + m * n].view(m, n))
        assert bool((zbuf[:64] == -7).all()) and bool((zbuf[64 + m * n :] == -7).all()), "write out of bounds"
        want = u.double() @ q.T
        err = (zbuf[64 : 64 + m * n].view(m, n).double() - want).abs().max()
        assert err <= 1e-5 * float(want.abs().max()), f"m={m}: max err {float(err):.3e}"


@pytest.mark.parametrize("code,bits,shape,bias", [(2, 2, (64, 96), True), (2, 3, (16, 16), False),
                                                  (2, 4, (80, 48), True), (2, 7, (32, 144), True),
                                                  (3, 2, (64, 96), True), (3, 5, (16, 16), False),
                                                  (3, 7, (32, 144), True)])
def test_two_table_forward_paths(host, code, bits, shape, bias):
    n, k = shape
    t = random_two_table(n, k, bits, seed=30 + bits, bias=bias, code=code)
    lay = layer(host, t)
    assert (lay.in_features, lay.out_features) == (k, n)
    g = torch.Generator().manual_seed(bits)
    for m, path, tol in ((1, "gemv", 3e-3), (3, "auto", 3e-3), (8, "gemv", 3e-3), (16, "auto", 3e-3),
                         (21, "gemv", 3e-3), (17, "auto", 1e-2), (5, "gemm", 1e-2)):
        x = torch.randn(m, k, generator=g).half()
        got = lay.forward(x, path)
        assert got.dtype == torch.float16 and got.shape == (m, n)
        assert_rel_close(got, trellis_reference(x, t), tol, f"{path} m={m}")
    x = torch.randn(2, 3, k, generator=g).half()  # leading dimensions are kept
    assert lay.forward(x, "auto").shape == (2, 3, n)


@pytest.mark.parametrize("code", [1, 2, 3])
def test_gemv_is_batch_invariant(host, code):
    """A row's output is bit for bit the same whatever the row count of the GEMV (code 1 up to 8, codes 2
    and 3 up to 16; checked at 1, 2, 3, 5, half, all but one and all rows, as the first or the last rows), with
    a K split (3 slices)."""
    two = code in F.TWO_TABLE_CODES
    t = random_two_table(64, 192, 3, seed=5, code=code) if two else random_trellis(64, 192, 3, 12, seed=5)
    lay = layer(host, t)
    assert host.trellis_gemv_split(64, 192) == (3, 4)
    rows = lay.gemv_max_rows
    assert rows == (16 if two else 8)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(code)).half()
    full = lay.forward(x, "auto")
    for m in (1, 2, 3, 5, rows // 2 + 1, rows - 1):
        assert torch.equal(lay.forward(x[:m], "auto"), full[:m]), f"m={m}"
        assert torch.equal(lay.forward(x[rows - m :], "gemv"), full[rows - m :]), f"last {m} rows"


@pytest.mark.parametrize("code", F.TWO_TABLE_CODES)
def test_two_table_default_tables(host, code):
    """The quantizer's tables (exl.format.two_table_default) through every path."""
    t = random_two_table(32, 64, 2, seed=3, code=code)
    t["tcode"] = F.two_table_default(code)
    lay = layer(host, t)
    assert torch.equal(lay.dequantize(), F.trellis_decode(t, torch.float64).half())
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)).half()
    assert_rel_close(lay.forward(x, "gemv"), trellis_reference(x, t), 3e-3, "gemv")
    assert_rel_close(lay.forward(x, "gemm"), trellis_reference(x, t), 1e-2, "gemm")


def meta(version, bits, state_bits, code, mul=0, add=0):
    return torch.tensor([version, bits, state_bits, code, mul, add], dtype=torch.int32)


def test_two_table_bad_tensors_are_named(host):
    t = random_two_table(32, 32, 3, seed=1)
    args = (t["trellis"], t["tscale"], t["tmeta"], t["su"], t["sv"])
    with pytest.raises(RuntimeError, match="needs its tables: pass tcode"):
        host.TrellisLinearCUDA(*args)
    with pytest.raises(RuntimeError, match=r"must be int8 \[256\]"):
        host.TrellisLinearCUDA(*args, tcode=t["tcode"].to(torch.int16))
    with pytest.raises(RuntimeError, match=r"must be int8 \[256\]"):
        host.TrellisLinearCUDA(*args, tcode=t["tcode"][:128])
    with pytest.raises(RuntimeError, match="tcode is on meta"):
        host.TrellisLinearCUDA(*args, tcode=t["tcode"].to("meta"))
    for bad, msg in ((meta(1, 3, 12, 2), "layout version 1 / code 2 unsupported"),
                     (meta(2, 3, 12, 1, 1, 0), "layout version 2 / code 1 unsupported"),
                     (meta(3, 3, 12, 2), "layout version 3 / code 2 unsupported"),
                     (meta(2, 3, 16, 2), "code 2 needs L = 12 state bits and K <= 7 bits per weight, got L = 16"),
                     (meta(2, 8, 12, 2), "got L = 12, K = 8")):
        words = torch.zeros(2, 2, 8 * int(bad[1]), dtype=torch.int32)
        with pytest.raises(RuntimeError, match=msg):
            host.TrellisLinearCUDA(words, t["tscale"], bad, t["su"], t["sv"], tcode=t["tcode"])
    t3 = random_two_table(32, 32, 3, seed=1, code=3)
    with pytest.raises(RuntimeError, match=r"tcode of a code 3 layer must be int8 \[128\]"):
        host.TrellisLinearCUDA(t3["trellis"], t3["tscale"], t3["tmeta"], t3["su"], t3["sv"], tcode=t["tcode"])
    with pytest.raises(RuntimeError, match="layout version 1 / code 3 unsupported"):
        host.TrellisLinearCUDA(t3["trellis"], t3["tscale"], meta(1, 3, 12, 3), t3["su"], t3["sv"], tcode=t3["tcode"])
    c1 = random_trellis(32, 32, 3, 12, seed=1)
    with pytest.raises(RuntimeError, match="tcode given for a code 1 layer"):
        host.TrellisLinearCUDA(c1["trellis"], c1["tscale"], c1["tmeta"], c1["su"], c1["sv"], tcode=t["tcode"])
