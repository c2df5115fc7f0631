"""The CUDA trellis kernels (TrellisLinearCUDA, both codes) on a GPU against exl.format's reference
(docs/format.md §7). Run on a GPU box: `bench/gpu_check.sh` or `python -m pytest -m gpu tests/gpu`.
The same kernels run on the CPU under the host harness in tests/test_cuda_host_trellis.py.

Bounds as there: the GEMV accumulates fp32 products of exact integer code values (relative 3e-3 covers
the fp16 input and output roundings); the GEMM path also rounds Q̂ to fp16 and cuBLAS may reduce in fp16.
"""

from __future__ import annotations

import pytest
import torch

from cuda_reference import assert_rel_close, random_trellis, random_two_table, trellis_reference

from exl import format as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def layer(ext, t):
    g = {k: v.cuda() for k, v in t.items()}
    return ext.TrellisLinearCUDA(g["trellis"], g["tscale"], g["tmeta"], g["su"], g.get("sv"), g.get("bias"),
                                 tcode=g.get("tcode"))


def layers():
    """(name, tensors): code 1 at every K, code 2 at every K it allows, odd tile-row counts, one layer without sv."""
    out = [(f"code1-K{b}", random_trellis(80, 144, b, 16 if b % 2 else max(8, b), seed=b)) for b in range(1, 9)]
    out += [(f"code2-K{b}", random_two_table(80, 144, b, seed=50 + b)) for b in range(1, 8)]
    one_sided = random_two_table(80, 144, 3, seed=70, code=F.CODE_TWO_TABLE_64)
    del one_sided["sv"]  # format version 3: no output rotation
    return out + [("code3-K3-no-sv", one_sided)]


@pytest.mark.parametrize("name,t", layers(), ids=lambda v: v if isinstance(v, str) else "")
def test_dequant_exact_and_forward_paths(ext, name, t):
    lay = layer(ext, t)
    assert torch.equal(lay.dequantize().cpu(), F.trellis_decode(t, torch.float64).half()), name
    g = torch.Generator().manual_seed(1)
    rows = lay.gemv_max_rows
    for m, path, tol in ((1, "gemv", 3e-3), (3, "auto", 3e-3), (rows, "auto", 3e-3), (rows + 5, "gemv", 3e-3),
                         (rows + 1, "auto", 1e-2), (64, "gemm", 1e-2)):
        x = torch.randn(m, 144, generator=g).half()
        got = lay.forward(x.cuda(), path)
        assert got.dtype == torch.float16 and got.shape == (m, 80)
        assert_rel_close(got, trellis_reference(x, t), tol, f"{name} {path} m={m}")


@pytest.mark.parametrize("code", [1, 2, 3])
def test_gemv_batch_invariant(ext, code):
    t = random_two_table(576, 576, 3, seed=9, code=code) if code in F.TWO_TABLE_CODES else random_trellis(576, 576, 3, 16, seed=9)
    lay = layer(ext, t)
    rows = lay.gemv_max_rows
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(code)).half().cuda()
    full = lay.forward(x, "auto")
    for m in range(1, rows):
        assert torch.equal(lay.forward(x[:m], "auto"), full[:m]), f"m={m}"


@pytest.mark.parametrize("code", (2, 3))
def test_two_table_large_layer(ext, code):
    """A SmolLM2 MLP shape (1536 x 576) with the quantizer's tables: many blocks, long K loops."""
    t = random_two_table(1536, 576, 2, seed=4, code=code)
    t["tcode"] = F.two_table_default(code)
    lay = layer(ext, t)
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(4)).half()
    assert_rel_close(lay.forward(x.cuda(), "gemv"), trellis_reference(x, t), 3e-3, "gemv")
    assert_rel_close(lay.forward(x.cuda(), "gemm"), trellis_reference(x, t), 1e-2, "gemm")
