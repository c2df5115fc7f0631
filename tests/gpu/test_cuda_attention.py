"""The CUDA paged attention (cuda_attention.cu) on a GPU: the kernel against the plain-PyTorch reference, and
the paged cache's decode through it against the reference path (fused.disabled()). Run by bench/gpu_check.sh."""

from __future__ import annotations

import pytest
import torch

from cuda_reference import paged_attention_reference, paged_case, paged_decode

import exl
from exl.modules import fused

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("hq,hk,d,dtype,window,softcap", [
    (9, 3, 64, torch.float16, 0, 0.0), (4, 1, 256, torch.float16, 5, 0.0), (8, 1, 128, torch.float32, 0, 30.0),
    (10, 2, 80, torch.float16, 0, 0.0), (4, 4, 16, torch.float32, 3, 0.0)])
def test_kernel_matches_the_reference(ext, hq, hk, d, dtype, window, softcap):
    q, k, v, pages, seqs, pos = paged_case(hq, hk, d, dtype, lengths=(70, 41, 1), chunk=5, seed=d)
    want = paged_attention_reference(q, k, v, pages, seqs, pos, 8, d**-0.5, window, softcap)
    got = ext.paged_attention(*(t.cuda() for t in (q, k, v, pages, seqs, pos)), 8, d**-0.5, window, softcap).cpu()
    tol = 2e-6 if dtype == torch.float32 else 2e-3
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol), (got.double() - want).abs().max()
    alone = ext.paged_attention(*(t.cuda() for t in (q[1:2], k, v, pages, seqs[1:2], pos[1:2])), 8, d**-0.5, window,
                                softcap).cpu()
    assert torch.equal(alone[0], got[1])  # a row's bits do not depend on the batch


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from test_models import make_model

    tmp = tmp_path_factory.mktemp("cuda-attention")
    return {name: exl.load_model(make_model(tmp, name)[1], device="cuda", progress=False)
            for name in ("llama", "mistral-window", "gemma3")}


@pytest.mark.parametrize("name", ["llama", "mistral-window", "gemma3"])
def test_paged_decode_through_the_kernel_matches_the_reference_path(models, name):
    model = models[name]
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (11, 23, 5)]
    steps = torch.randint(0, 200, (6, len(prompts)), generator=g).tolist()
    got = paged_decode(model, prompts, steps, "cuda")
    with fused.disabled():
        want = paged_decode(model, prompts, steps, "cuda")
    scale = want.abs().max()
    assert (got - want).abs().max() <= 2e-2 * scale
