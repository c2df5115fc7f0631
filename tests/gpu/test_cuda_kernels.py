"""CUDA kernels against the plain-PyTorch reference (exl.format). Run on a GPU box: `bench/gpu_check.sh`
or `python -m pytest -m gpu tests/gpu`.

Bounds: fp16 activations and outputs carry relative rounding 2^-11; the GEMV accumulates in fp32
(same bound as the CPU fp32 path plus the fp16 rounding of input and output); the GEMM path also
rounds dequantized weights to fp16 (2^-11 relative each) and cuBLAS may reduce in fp16, so its
bound is 2^-8 * c, with c the sum of absolute products (see tests/test_kernels.py).
"""

from __future__ import annotations

import pytest
import torch

from cuda_reference import LAYER_KEYS, check_forward, kv_reference, kv_unpack, random_layer

from exl import format as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def on_gpu(t):
    return {k: v.cuda() for k, v in t.items()}


def check(ext, t, m, path, seed=1):
    layer = ext.QuantLinearCUDA(*[t.get(n) for n in LAYER_KEYS])
    check_forward(layer, t, m, path, seed)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("group", [32, 64, 128])
def test_gemv_and_gemm_every_bit_width(ext, bits, group):
    t = on_gpu(random_layer(67, [F.Segment(512, bits, group)], seed=bits * group))
    for m in (1, 2, 3, 5, 8):
        check(ext, t, m, "gemv")
    check(ext, t, 33, "gemm")
    check(ext, t, 4, "auto")


@pytest.mark.parametrize("n", [1, 7, 33, 577, 4096])
def test_mixed_segments_odd_n(ext, n):
    segs = [F.Segment(32 * (b + 1), b, 32 * (b % 2 + 1)) for b in range(1, 9)] + [F.Segment(1024, 4, 128)]
    t = on_gpu(random_layer(n, segs, seed=n))
    for m, path in ((1, "gemv"), (7, "gemv"), (16, "gemm"), (64, "auto")):
        check(ext, t, m, path)


@pytest.mark.parametrize("flags", [(False, False, False), (True, False, False), (False, True, True), (True, True, True)])
def test_rotations_and_perm(ext, flags):
    perm, su, sv = flags
    t = on_gpu(random_layer(192, [F.Segment(64, 6, 32), F.Segment(512, 4, 64)], perm=perm, su=su, sv=sv, seed=5))
    for m, path in ((1, "gemv"), (4, "gemv"), (40, "gemm")):
        check(ext, t, m, path)


def test_dequantize_matches_reference(ext):
    segs = [F.Segment(64, 6, 32), F.Segment(128, 3, 64), F.Segment(256, 8, 128)]
    t = random_layer(50, segs, seed=3)
    want = F.dequantize_codes(F.unpack_codes(t["qweight"], segs), t["qscale"], segs, torch.float32)
    layer = ext.QuantLinearCUDA(*[on_gpu(t)[n] for n in ("qweight", "qscale", "qmeta")])
    got = layer.dequantize().float().cpu()
    assert torch.allclose(got, want, rtol=2.0**-11, atol=1e-7)


def test_quant_linear_module_on_gpu():
    from exl.modules.quant_linear import QuantLinear

    t = random_layer(96, [F.Segment(256, 4, 64)], seed=9)
    layer = QuantLinear(t).cuda()
    x = torch.randn(2, 5, 256)
    got = layer(x.half().cuda()).float().cpu()
    want = F.reference_forward(x.half().float(), t)
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("n", [64, 576, 1536, 4096])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fwht(ext, n, dtype):
    x = torch.randn(5, n)
    signs = F.pack_signs(torch.where(torch.rand(n) < 0.5, -1, 1))
    s = F.unpack_signs(signs, n)
    got = ext.fwht(x.to(dtype).cuda(), 0, signs.cuda(), True).float().cpu()
    want = F.fwht(x.to(dtype).float() * s)
    tol = 2.0**-10 if dtype == torch.float16 else 1e-5
    assert torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item())


# ---------------------------------------------------------------------------------------------
# quantized KV cache (docs/format.md §6)


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_kv_quantize_roundtrip(ext, bits, d):
    x = torch.randn(3, 5, d).half()
    signs = F.pack_signs(torch.where(torch.rand(d) < 0.5, -1, 1))
    packed, scales = ext.kv_quantize(x.cuda(), bits, signs.cuda())
    ref_packed, ref_scales, y = kv_reference(x, bits, signs)
    assert packed.shape == (3, 5, d * bits // 8) and scales.shape == (3, 5, d // 32)
    assert torch.allclose(scales.float().cpu(), ref_scales.float(), rtol=2.0**-10)
    codes, ref_codes = kv_unpack(packed.cpu(), bits, d), kv_unpack(ref_packed, bits, d)
    diff = (codes - ref_codes).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01  # ties may round either way
    rot = ext.kv_dequantize(packed, scales, bits).float().cpu()  # rotated domain
    step = scales.float().cpu().repeat_interleave(32, -1)
    # half a step, plus the fp16 rounding of scale and output
    assert bool(((rot - y).abs() <= 0.5 * step * 1.01 + 2.0**-9 * y.abs() + 1e-4).all())
    back = ext.kv_dequantize(packed, scales, bits, True, signs.cuda()).float().cpu()
    assert (back - x.float()).norm() / x.float().norm() < {4: 0.15, 6: 0.04, 8: 0.01}[bits]


def test_kv_layout_matches_cache_store():
    """The CUDA layout is the one exl.cache.kv_store packs on the CPU (4/6/8-bit LSB-first streams)."""
    kv_store = pytest.importorskip("exl.cache.kv_store")
    for bits in (4, 6, 8):
        codes = torch.randint(0, 2**bits, (2, 64))
        packed = kv_store.pack(codes.to(torch.uint8), bits)
        assert torch.equal(kv_unpack(packed, bits, 64), codes)
