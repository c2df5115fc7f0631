"""The CUDA trellis kernels (cuda_trellis.cu, TrellisLinearCUDA) run on the CPU by the host harness
(docs/cuda_host.md), against exl.format's trellis reference (docs/format.md §7)."""

from __future__ import annotations

import pytest
import torch

from exl import format as F


@pytest.fixture(scope="module")
def host():
    from cuda_ext.host_build import load_cuda_host

    return load_cuda_host()


def random_trellis(n, k, bits, state_bits, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    meta = F.TrellisMeta(bits, state_bits, mul=0x9E3779B1, add=0x7F4A7C15)
    words = torch.randint(-(2**31), 2**31, (n // 16, k // 16, meta.words_per_tile), generator=g, dtype=torch.int64)
    t = {"trellis": words.to(torch.int32), "tscale": (torch.rand(n, generator=g) * 1e-3 + 1e-4).half(),
         "tmeta": meta.to_tensor(), "su": F.pack_signs(torch.where(torch.rand(k, generator=g) < 0.5, -1, 1)),
         "sv": F.pack_signs(torch.where(torch.rand(n, generator=g) < 0.5, -1, 1))}
    if bias:
        t["bias"] = torch.randn(n, generator=g) * 0.1
    return t


def layer(host, t):
    return host.TrellisLinearCUDA(t["trellis"], t["tscale"], t["tmeta"], t["su"], t["sv"], t.get("bias"))


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
        want = F.reference_forward(x.double(), {k: v.double() if v.is_floating_point() and k == "bias" else v
                                                for k, v in t.items()})
        got = lay.forward(x, path)
        assert got.dtype == torch.float16 and got.shape == (m, 64)
        err = float((got.double() - want).abs().max())
        assert err <= tol * float(want.abs().max()), f"{path} m={m}: max err {err:.3e} vs scale {float(want.abs().max()):.3e}"


def test_bad_tensors_are_named(host):
    t = random_trellis(32, 32, 2, 8)
    with pytest.raises(RuntimeError, match="words per tile"):
        host.TrellisLinearCUDA(t["trellis"][..., :8].contiguous(), t["tscale"], t["tmeta"], t["su"], t["sv"])
    with pytest.raises(RuntimeError, match="in_features=32"):
        layer(host, t).forward(torch.randn(2, 48).half(), "auto")
