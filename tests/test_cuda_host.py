"""exl's CUDA kernels executed on the CPU by the host harness (docs/cuda_host.md), against exl.format.

The module `exl_cuda_host` is compiled from the same csrc/cuda_kernels.cu and cuda_ops.cpp as the GPU
build; every __global__ kernel is launched through its real launcher (grid sizing, dispatch by bits,
rows and dtypes) on real concurrent threads. Outputs go into views of guarded buffers (sentinels
around them must stay untouched) and inputs are followed by NaNs (a read past the end shows).
The last section checks that the harness itself catches races, deadlocks and CUDA launch errors.
"""

from __future__ import annotations

import math

import pytest
import torch
from cuda_reference import (LAYER_KEYS, check_forward, kv_reference, kv_unpack, paged_attention_reference, paged_case,
                            paged_decode, random_layer)

pytestmark = pytest.mark.kernels  # CI runs these under the newest torch too (.ci/run)

from exl import format as F

SENTINEL = -12345.0


@pytest.fixture(scope="module")
def host():
    from cuda_ext.host_build import load_cuda_host

    return load_cuda_host()


def guarded(shape, dtype, fill=SENTINEL, pad=64):
    """A view of `shape` inside a buffer padded with `fill` on both sides (16-byte aligned)."""
    n = math.prod(shape)
    buf = torch.full((n + 2 * pad,), fill, dtype=dtype)
    return buf, buf[pad : pad + n].view(shape)


def assert_guards(buf, n, pad=64):
    assert bool((buf[:pad] == SENTINEL).all()) and bool((buf[pad + n :] == SENTINEL).all()), "write out of bounds"


def nan_tail(x):
    """x copied into a buffer whose tail (past x) is NaN: a kernel reading past x yields NaN."""
    buf = torch.full((x.numel() + 64,), float("nan"), dtype=x.dtype)
    buf[: x.numel()] = x.flatten()
    return buf[: x.numel()].view(x.shape)


def layer_parts(t):
    return t["qweight"], t["qscale"], t["qmeta"]


def reference_q(t):
    segs = F.segments_from_meta(t["qmeta"])
    return F.dequantize_codes(F.unpack_codes(t["qweight"], segs), t["qscale"], segs, torch.float64)


def check_gemv(host, t, m, seed=0):
    q = reference_q(t)
    n, k = q.shape
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    buf, z = guarded((m, n), torch.float32)
    host.gemv(*layer_parts(t), nan_tail(x), z)
    assert_guards(buf, m * n)
    want = x.double() @ q.T
    bound = 2.0**-20 * (math.sqrt(k) + 8) * (x.double().abs() @ q.abs().T) + 1e-6
    assert bool(((z.double() - want).abs() <= bound).all()), f"gemv m={m}: worst {(z.double() - want).abs().max()}"


# ---------------------------------------------------------------------------------------------
# GEMV: every bit width, every row count 1..8 (all four MR instantiations), ragged rows and blocks


@pytest.mark.parametrize("bits", range(1, 9))
def test_gemv_every_bit_width_and_row_count(host, bits):
    # 37 blocks of 32 codes in the first segment: lanes 0-4 take two, the rest one; 9 output rows
    # leave the third thread block with one live warp of four. The second segment switches bits.
    segs = [F.Segment(37 * 32, bits, 32), F.Segment(256, bits % 8 + 1, 128)]
    t = random_layer(9, segs, perm=False, su=False, sv=False, bias=False, seed=bits)
    for m in range(1, 9):
        check_gemv(host, t, m, seed=m)


def test_gemv_all_widths_in_one_row(host):
    segs = [F.Segment(32 * (b + 1), b, 32 * (b % 2 + 1)) for b in range(1, 9)] + [F.Segment(256, 4, 128)]
    t = random_layer(7, segs, perm=False, su=False, sv=False, bias=False, seed=11)
    for m in (1, 3, 8):
        check_gemv(host, t, m, seed=m)


# ---------------------------------------------------------------------------------------------
# Tile dequantization


def test_dequant_row_range_is_exact(host):
    segs = [F.Segment(64, 6, 32), F.Segment(96, 3, 32), F.Segment(256, 8, 128), F.Segment(64, 1, 64)]
    t = random_layer(14, segs, perm=False, su=False, sv=False, bias=False, seed=3)
    q = reference_q(t)
    k = q.shape[1]
    for n0, n1 in ((0, 14), (3, 12), (13, 14)):
        buf, out = guarded((n1 - n0, k), torch.float16)
        host.dequant(*layer_parts(t), n0, n1, out)
        assert_guards(buf, (n1 - n0) * k)
        # (q - c) * s is exact in fp32 (a half-integer times an fp16), so the fp16 result is too
        assert torch.equal(out, q[n0:n1].half())
    host.dequant(*layer_parts(t), 5, 5, torch.empty(0, dtype=torch.float16))  # empty range: no launch


# ---------------------------------------------------------------------------------------------
# Hadamard (all four dtype pairs, with and without the act-order permutation)


@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float16), (torch.float16, torch.float32),
                                    (torch.float32, torch.float16), (torch.float32, torch.float32)])
def test_hadamard_dtypes_chunks_signs_bias(host, dtypes):
    tin, tout = dtypes
    g = torch.Generator().manual_seed(4)
    # n = 2240: two chunks of the 2048-value shared buffer, the second ragged (192), block 64
    for n, block, signs_first in ((2240, 64, True), (384, 128, False), (96, 1, True)):
        x = torch.randn(3, n, generator=g).to(tin)
        s = torch.where(torch.rand(n, generator=g) < 0.5, -1, 1)
        bias = torch.randn(n, generator=g)
        buf, out = guarded((3, n), tout)
        host.hadamard(nan_tail(x), out, block, F.pack_signs(s), signs_first, bias)
        assert_guards(buf, 3 * n)
        xd, sd = x.double(), s.double()
        want = (F.fwht(xd * sd, block) if signs_first else F.fwht(xd, block) * sd) + bias.double()
        tol = 2.0**-10 if torch.float16 in dtypes else 2.0**-20
        assert torch.allclose(out.double(), want, rtol=tol, atol=tol * 4), f"n={n} {dtypes}"


def test_hadamard_with_permutation_fused(host):
    """Step 1+2 of the forward pass in one launch: u' = (H D_u x)[perm] via the inverse permutation."""
    g = torch.Generator().manual_seed(6)
    n = 2240
    x = torch.randn(2, n, generator=g).half()
    s = torch.where(torch.rand(n, generator=g) < 0.5, -1, 1)
    perm = torch.randperm(n, generator=g)
    buf, out = guarded((2, n), torch.float32)
    host.hadamard(nan_tail(x), out, 64, F.pack_signs(s), True, None, perm.argsort().to(torch.int32))
    assert_guards(buf, 2 * n)
    want = F.fwht(x.double() * s.double(), 64)[:, perm]
    assert torch.allclose(out.double(), want, rtol=2.0**-20, atol=2.0**-20)


# ---------------------------------------------------------------------------------------------
# Quantized KV cache (docs/format.md §6)


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("d", [32, 64, 256])
def test_kv_quantize_and_dequantize(host, bits, d):
    rows = 7  # two thread blocks of four warps, the second with three live ones
    x = torch.randn(rows, d, generator=torch.Generator().manual_seed(d + bits)).half()
    signs = F.pack_signs(torch.where(torch.rand(d, generator=torch.Generator().manual_seed(bits)) < 0.5, -1, 1))
    pbuf, packed = guarded((rows, d * bits // 8), torch.uint8, fill=0xA5)
    sbuf, scales = guarded((rows, d // 32), torch.float16)
    host.kv_quantize_into(nan_tail(x), bits, signs, packed, scales)
    assert bool((pbuf[:64] == 0xA5).all() and (pbuf[64 + packed.numel() :] == 0xA5).all())
    assert_guards(sbuf, scales.numel())
    ref_packed, ref_scales, y = kv_reference(x, bits, signs)
    if d in (64, 256):  # 1/sqrt(d) exact: the kernel's fp32 arithmetic is the reference's, bit for bit
        assert torch.equal(packed, ref_packed) and torch.equal(scales, ref_scales)
    else:
        assert torch.allclose(scales.float(), ref_scales.float(), rtol=2.0**-10)
        diff = (kv_unpack(packed, bits, d) - kv_unpack(ref_packed, bits, d)).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01  # ties may round either way
    # rotated domain: (q - c) * s is exact, so fp16 equals the reference exactly
    codes = kv_unpack(packed, bits, d)
    exact_rot = (codes - (2**bits - 1) / 2) * scales.double().repeat_interleave(32, -1)
    want_rot = exact_rot.half()
    buf, rot = guarded((rows, d), torch.float16)
    host.kv_dequantize_into(packed, scales, bits, False, None, rot)
    assert_guards(buf, rows * d)
    assert torch.equal(rot, want_rot)
    back = host.kv_dequantize(packed, scales, bits, True, signs).double()
    want_back = F.fwht(exact_rot, block=d) * F.unpack_signs(signs, d, torch.float64)
    assert torch.allclose(back, want_back, rtol=2.0**-10, atol=2.0**-16)


def test_kv_bindings_shapes_and_empty_input(host):
    x = torch.randn(2, 3, 128).half()
    packed, scales = host.kv_quantize(x, 6)
    assert packed.shape == (2, 3, 96) and scales.shape == (2, 3, 4)
    assert host.kv_dequantize(packed, scales, 6).shape == (2, 3, 128)
    # an empty batch must not launch (a grid of zero blocks is a CUDA launch error)
    p0, s0 = host.kv_quantize(torch.zeros(0, 64).half(), 4)
    assert p0.shape == (0, 32) and host.kv_dequantize(p0, s0, 4).shape == (0, 64)
    big = torch.randn(5, 1024).half()  # the largest head dim: 16 KiB of dynamic shared memory
    p, s = host.kv_quantize(big, 8)
    assert torch.equal(p, kv_reference(big, 8)[0])


# ---------------------------------------------------------------------------------------------
# The whole layer through cuda_ops.cpp (the torch bindings): hadamard+perm -> gemv / dequant+mm -> hadamard


@pytest.mark.parametrize("flags", [(False, False, False, False), (True, True, True, True), (True, False, True, False)])
def test_quant_linear_pipeline(host, flags):
    perm, su, sv, bias = flags
    segs = [F.Segment(64, 6, 32), F.Segment(192, 4, 64)]
    t = random_layer(40, segs, perm=perm, su=su, sv=sv, bias=bias, seed=5, perm_dtype=torch.int32 if su else None)
    layer = host.QuantLinearCUDA(*[t.get(n) for n in LAYER_KEYS])
    assert (layer.in_features, layer.out_features) == (256, 40)
    for m, path in ((1, "gemv"), (9, "gemv"), (3, "auto"), (12, "gemm"), (10, "auto")):  # 9: two GEMV launches
        check_forward(layer, t, m, path, seed=m)
    q = reference_q(t)
    assert torch.equal(layer.dequantize(), q.half())


def test_fwht_binding_and_errors(host):
    x = torch.randn(4, 192)
    signs = F.pack_signs(torch.where(torch.rand(192) < 0.5, -1, 1))
    got = host.fwht(x, 0, signs, False)
    assert torch.allclose(got, F.fwht(x) * F.unpack_signs(signs, 192), atol=1e-6)
    got16 = host.fwht(x.half(), 64)
    assert torch.allclose(got16.float(), F.fwht(x.half().float()), rtol=2.0**-10, atol=2.0**-10)
    t = random_layer(8, [F.Segment(64, 4, 32)], seed=1)
    layer = host.QuantLinearCUDA(*[t.get(n) for n in LAYER_KEYS])
    with pytest.raises(RuntimeError, match="input must be float16"):
        layer.forward(torch.randn(1, 64), "gemv")
    with pytest.raises(RuntimeError, match="in_features=64"):
        layer.forward(torch.randn(1, 32).half(), "gemv")
    with pytest.raises(RuntimeError, match="must be a power of two <= 128"):
        host.fwht(x, 3)


# ---------------------------------------------------------------------------------------------
# Paged attention (cuda_attention.cu) over a paged store, in place


# (query heads, KV heads, head size, dtype, window, softcap): every GQA group and head-size template, both dtypes
@pytest.mark.parametrize("hq,hk,d,dtype,window,softcap", [
    (3, 1, 64, torch.float32, 0, 0.0), (9, 3, 64, torch.float16, 7, 0.0), (4, 4, 16, torch.float32, 0, 5.0),
    (2, 1, 256, torch.float16, 0, 0.0), (10, 2, 80, torch.float16, 5, 30.0), (16, 2, 128, torch.float32, 0, 0.0)])
def test_paged_attention_matches_the_reference(host, hq, hk, d, dtype, window, softcap):
    q, k, v, pages, seqs, pos = paged_case(hq, hk, d, dtype, seed=hq + d)
    scale = d**-0.5
    got = host.paged_attention(q, k, v, pages, seqs, pos, 8, scale, window, softcap)
    want = paged_attention_reference(q, k, v, pages, seqs, pos, 8, scale, window, softcap)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 2e-6 if dtype == torch.float32 else 2e-3
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol), (got.double() - want).abs().max()


def test_paged_attention_row_does_not_depend_on_the_batch(host):
    """Each row is computed alone, in one order: the same bits alone, batched or in a chunk (speculative
    verification must equal plain decoding)."""
    q, k, v, pages, seqs, pos = paged_case(9, 3, 64, torch.float16, lengths=(30, 17, 3), seed=3)
    every = host.paged_attention(q, k, v, pages, seqs, pos, 8, 0.125)
    for r in (0, 4, len(seqs) - 1):
        alone = host.paged_attention(q[r : r + 1].contiguous(), k, v, pages, seqs[r : r + 1].contiguous(),
                                     pos[r : r + 1].contiguous(), 8, 0.125)
        assert torch.equal(alone[0], every[r])


def test_paged_attention_over_several_chunks(host):
    """Tables longer than one chunk (256 positions) split each row's keys over blocks and combine them: the same as
    the reference, with windows across chunk borders, and the same bits whatever the table's width (a row's chunks
    are absolute positions; chunks it does not reach add zeros), so also the same as a one-chunk launch."""
    g = torch.Generator().manual_seed(11)
    ps, hq, hk, d = 16, 4, 2, 32
    n_pages = 48
    k = torch.randn(hk, n_pages * ps, d, generator=g).half()
    v = torch.randn(hk, n_pages * ps, d, generator=g).half()
    pages = torch.randperm(n_pages, generator=g)[:40].view(2, 20)  # 2 sequences of up to 320 positions
    seqs, pos = torch.tensor([0, 1, 1]), torch.tensor([300, 250, 319])
    q = torch.randn(3, hq, d, generator=g).half()
    for window in (0, 100):
        got = host.paged_attention(q, k, v, pages, seqs, pos, ps, 0.2, window)
        want = paged_attention_reference(q, k, v, pages, seqs, pos, ps, 0.2, window)
        assert torch.allclose(got.double(), want, rtol=2e-3, atol=2e-3), (got.double() - want).abs().max()
    # row 1 (position 250) alone with a table of one chunk (16 pages): the same bits as in the 2-chunk launch
    one = host.paged_attention(q[1:2].contiguous(), k, v, pages[:, :16].contiguous(), seqs[1:2].contiguous(),
                               pos[1:2].contiguous(), ps, 0.2)
    assert torch.equal(one[0], host.paged_attention(q, k, v, pages, seqs, pos, ps, 0.2)[1])
    bad = pages.clone()
    bad[1, 17] = 99  # a page of sequence 1 in its second chunk: its rows that reach it are NaN
    got = host.paged_attention(q, k, v, bad, seqs, pos, ps, 0.2)
    assert not bool(got[:2].isnan().any()) and bool(got[2].isnan().all())


def test_paged_attention_bad_tables_give_nan_rows_and_bad_arguments_errors(host):
    q, k, v, pages, seqs, pos = paged_case(4, 2, 32, torch.float32, seed=4)
    bad_pages = pages.clone()
    bad_pages[2, 0] = 99  # sequence 2 (row 2) reads a page the store does not have
    bad_pos = pos.clone()
    bad_pos[0] = pages.shape[1] * 8  # past sequence 0's page table
    got = host.paged_attention(q, k, v, bad_pages, seqs, bad_pos, 8, 0.2)
    want = paged_attention_reference(q, k, v, pages, seqs, pos, 8, 0.2)
    assert bool(got[0].isnan().all()) and bool(got[2].isnan().all())
    assert torch.allclose(got[1].double(), want[1], atol=2e-6) and not bool(got[3:].isnan().any())
    assert bool(host.paged_attention(q, k, v, pages[:, :0].contiguous(), seqs, pos, 8, 0.2).isnan().all())  # no pages
    with pytest.raises(RuntimeError, match="all float16 or all float32"):
        host.paged_attention(q.half(), k, v, pages, seqs, pos, 8, 0.2)
    with pytest.raises(RuntimeError, match="at most 8 and 256"):
        host.paged_attention(torch.randn(1, 18, 32), k, v, pages, seqs[:1], pos[:1], 8, 0.2)
    with pytest.raises(RuntimeError, match="pages must be a contiguous int64"):
        host.paged_attention(q, k, v, pages.int(), seqs, pos, 8, 0.2)
    with pytest.raises(RuntimeError, match="must divide"):
        host.paged_attention(q, k, v, pages, seqs, pos, 7, 0.2)
    assert host.paged_attention(q[:0], k, v, pages, seqs[:0], pos[:0], 8, 0.2).shape == (0, 4, 32)


def test_paged_cache_attends_through_the_cuda_kernel(host, tmp_path, monkeypatch):
    """The paged cache's GPU path (PagedContext: tables to the device, the binding's arguments) run here with the
    harness standing in for the GPU: decode steps of three sequences (Gemma 3: sliding windows, softcap, GQA)
    give the reference path's logits."""
    import exl
    from exl.cache import paged
    from exl.modules import fused
    from test_models import check_close, make_model

    model = exl.load_model(make_model(tmp_path, "gemma3")[1], progress=False)
    calls = []

    class Harness:
        def paged_attention(self, *args):
            calls.append(len(args[4]))  # query rows
            return host.paged_attention(*args)

    monkeypatch.setattr(paged, "_cuda_ext", lambda: Harness())
    monkeypatch.setattr(paged.PagedContext, "_in_place", lambda self, q: False)  # not the CPU kernel,
    monkeypatch.setattr(paged.PagedContext, "decode_batch", lambda self: None)  # nor the CPU one-call decode step
    monkeypatch.setattr(paged.PagedContext, "_cuda_in_place", lambda self, q: self._cuda_kernel_fits(q))

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (9, 3, 6)]
    steps = torch.randint(0, 200, (3, 3), generator=g).tolist()
    got = paged_decode(model, prompts, steps)
    layers = model.config.num_layers  # every layer of every prompt (9, 3, 6 rows) and decode step (3 rows)
    assert calls == [9] * layers + [3] * layers + [6] * layers + [3] * 3 * layers
    with fused.disabled():
        want = paged_decode(model, prompts, steps)
    check_close(got, want, 1e-5)


# ---------------------------------------------------------------------------------------------
# The harness itself: CUDA semantics it models, and failures it must catch


def test_fp16_conversion_rounds_like_the_hardware(host):
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    as_f32 = host.f16_bits_to_f32(bits)
    want = bits.view(torch.float16).float()
    assert torch.equal(as_f32.isnan(), want.isnan()) and torch.equal(as_f32[~want.isnan()], want[~want.isnan()])
    g = torch.Generator().manual_seed(0)
    # every magnitude: normals, subnormals, overflow, exact ties (midpoints between fp16 neighbours)
    f = torch.cat([torch.randn(200000, generator=g) * 2.0 ** torch.randint(-30, 18, (200000,), generator=g),
                   (want[:-1:7] + want[1::7]) / 2, torch.tensor([65504.0, 65520.0, 65519.99, 2.0**-25, 2.0**-24 * 1.5,
                                                             float("inf"), -float("inf"), 0.0, -0.0])])
    f = f[~f.isnan()]
    got = host.f32_to_f16_bits(f.float())
    assert torch.equal(got, f.float().half().view(torch.int16))


def shuffle_model(kind, arg, width, n):
    out = []
    for t in range(n):
        lane, base = t % 32, t - t % 32
        seg = (lane // width) * width
        if kind == 0:
            src = seg + arg % width
        elif kind == 1:
            src = lane ^ arg if (lane ^ arg) // width == lane // width else lane
        elif kind == 2:
            src = lane + arg if lane % width + arg < width else lane
        else:
            src = lane - arg if lane % width >= arg else lane
        out.append(100 * (base + src) + 7)
    return out


@pytest.mark.parametrize("kind", [0, 1, 2, 3])
def test_shuffles_follow_cuda(host, kind):
    for arg, width in ((1, 32), (5, 32), (3, 8), (16, 32), (2, 4)):
        assert host.toy_shuffle(kind, arg, width, 64).tolist() == shuffle_model(kind, arg, width, 64)


def test_ballot_and_atomics(host):
    want = sum(1 << i for i in range(0, 32, 3))
    second = sum(1 << i for i in range(1, 32, 3))  # thread 32 + l: (32 + l) % 3 == 0 for l = 1, 4, ...
    assert host.toy_ballot(64).tolist() == [want] * 32 + [second] * 32
    assert host.toy_atomics(6) == (6 * 256, 6 * 256 * 0.5)


def test_missing_syncthreads_is_caught(host):
    x = torch.arange(3 * 256, dtype=torch.float32)
    want = x.view(3, 256).flip(1)
    out = torch.zeros_like(x)
    for _ in range(3):
        host.toy_reverse(x, out, 256, True)
        assert torch.equal(out.view(3, 256), want)
    wrong = 0
    for _ in range(5):  # the race is certain in practice: threads start one by one
        host.toy_reverse(x, out, 256, False)
        wrong += not torch.equal(out.view(3, 256), want)
    assert wrong > 0, "a reverse through shared memory without __syncthreads went unnoticed"


def test_missing_syncwarp_is_caught(host):
    x = torch.arange(64, dtype=torch.float32)
    out = torch.zeros_like(x)
    want = x.view(-1, 2).flip(1).flatten()
    host.toy_warp_exchange(x, out, True)
    assert torch.equal(out, want)
    wrong = 0
    for _ in range(5):  # warp-synchronous code without __syncwarp (wrong since Volta)
        host.toy_warp_exchange(x, out, False)
        wrong += not torch.equal(out, want)
    assert wrong > 0


def test_cuda_errors_are_reported(host):
    with pytest.raises(RuntimeError, match="misaligned address"):
        host.toy_ldg4(torch.zeros(16), 1)
    assert host.toy_ldg4(torch.arange(16.0), 4) == 4.0
    with pytest.raises(RuntimeError, match="exited"):
        host.toy_shuffle_from_exited()
    with pytest.raises(RuntimeError, match="invalid configuration"):
        host.toy_launch_shape(0, 32, 0)
    with pytest.raises(RuntimeError, match="invalid configuration"):
        host.toy_launch_shape(1, 2048, 0)
    with pytest.raises(RuntimeError, match="dynamic shared memory"):
        host.toy_launch_shape(1, 32, 64 * 1024)
    host.set_barrier_timeout(0.5)
    try:
        with pytest.raises(RuntimeError, match="deadlock"):
            host.toy_divergent_barrier()
    finally:
        host.set_barrier_timeout(20.0)
    host.toy_launch_shape(1, 32, 0)  # and the harness still runs kernels afterwards
