"""Splitting arithmetic without devices: shares, channel blocks, group-aligned cuts, layer placement
against fake device memory sizes, and slicing quantized tensors (checked against exl.format)."""

import argparse

import pytest
import torch

from exl import format as F
from exl.parallel import ParallelError, add_parallel_arguments, parse_gpu_split
from exl.parallel.plan import GiB, channel_unit, place_layers, proportional, snap_cuts, split
from exl.parallel.slicing import group_boundaries, quant_k_range, quant_rows


def test_proportional_shares():
    assert proportional(4, [1, 1]) == [2, 2]
    assert proportional(4, [1, 2]) == [1, 3]
    assert proportional(12, [10, 24]) == [4, 8]
    assert proportional(4, [1, 1, 2, 1]) == [1, 1, 1, 1]  # everyone gets at least one
    assert proportional(3, [100, 1, 1]) == [1, 1, 1]
    assert sum(proportional(1000, [3.3, 7.1, 1.9])) == 1000
    with pytest.raises(ParallelError, match="cannot split 2 KV heads over 4 devices"):
        proportional(2, [1] * 4, what="KV heads")
    with pytest.raises(ParallelError, match="positive"):
        proportional(4, [1, 0])


def test_channel_blocks_follow_quantization_alignment():
    assert channel_unit(1536, 2) == 128 and channel_unit(14336, 4) == 128
    assert channel_unit(96, 4) == 16  # a tiny model still gives each of 4 devices a block
    assert split(1536, [1, 2], 128) == [(0, 512), (512, 1536)]
    with pytest.raises(ParallelError, match="multiple"):
        split(100, [1, 1], 128)


def test_snap_cuts_lands_on_group_boundaries():
    bounds = [0, 64, 128, 192, 256, 384, 512]
    assert snap_cuts(512, [1, 1], bounds) == [(0, 256), (256, 512)]
    assert snap_cuts(512, [1, 3], bounds) == [(0, 128), (128, 512)]
    cuts = snap_cuts(512, [1, 1, 1, 1], bounds)
    assert [a for a, _ in cuts] == sorted({a for a, _ in cuts}) and all(a < b for a, b in cuts)
    assert snap_cuts(64, [1, 1, 1, 1], [0, 32, 64]) == [(0, 32), (32, 64), (64, 64), (64, 64)]  # idle parts


def test_layer_placement_against_fake_device_memory():
    layers = [3 * GiB] * 10  # e.g. a 30 GiB model; embedding + head 2 GiB on the first device
    # manual split: fill in order, like ExLlama's gpu_split
    p = place_layers(layers, [10 * GiB, 24 * GiB], fixed=[2 * GiB, 0])
    assert p.layers == [range(0, 2), range(2, 10)] and p.used_bytes == [8 * GiB, 24 * GiB]
    assert p.device_of(1) == 0 and p.device_of(2) == 1
    # automatic (balanced by free memory): 8 GB card and 24 GB card
    p = place_layers(layers, [12 * GiB, 24 * GiB], fixed=[2 * GiB, 0], balanced=True)
    assert [len(r) for r in p.layers] == [3, 7] and all(u <= b for u, b in zip(p.used_bytes, [12 * GiB, 24 * GiB]))
    p = place_layers([1] * 12, [100, 100, 100, 100], balanced=True)
    assert [len(r) for r in p.layers] == [3, 3, 3, 3]
    # balanced would strand the tail on a small last device: falls back to filling in order
    p = place_layers([4, 4, 4, 4], [12, 5], balanced=True)
    assert p.layers == [range(0, 3), range(3, 4)]
    # uneven layers (a MoE model with dense first layers) stay in order and within budget
    sizes = [1, 1, 5, 5, 5, 5]
    p = place_layers(sizes, [8, 10, 10])
    assert p.layers == [range(0, 3), range(3, 5), range(5, 6)] and p.used_bytes == [7, 10, 5]
    with pytest.raises(ParallelError, match="layers 5..5 do not fit"):
        place_layers(sizes, [8, 8, 8])
    with pytest.raises(ParallelError, match="needs"):
        place_layers(layers, [10 * GiB, 10 * GiB])
    with pytest.raises(ParallelError, match="do not fit"):
        place_layers([6, 6, 6], [10, 10])  # 18 ≤ 20 in total, but no device holds two layers


def test_gpu_split_arguments():
    assert parse_gpu_split("10, 24") == [10.0, 24.0]
    for bad in ("", "a,b", "10,-1"):
        with pytest.raises(ValueError):
            parse_gpu_split(bad)
    parser = argparse.ArgumentParser()
    add_parallel_arguments(parser)
    args = parser.parse_args(["--tp", "2", "--gpu-split", "8,16", "--parallel-mode", "expert"])
    assert (args.tp, args.gpu_split, args.parallel_mode) == (2, [8.0, 16.0], "expert")
    assert parser.parse_args([]).parallel_mode == "auto"


def _quant_layer(n, k, segs, seed=0, **parts):
    g = torch.Generator().manual_seed(seed)
    codes = torch.cat([torch.randint(0, 2**s.bits, (n, s.k_len), generator=g) for s in segs], 1).to(torch.uint8)
    t = {"qweight": F.pack_codes(codes, segs), "qmeta": F.segments_to_meta(segs),
         "qscale": (torch.rand(n, sum(s.n_groups for s in segs), generator=g) * 0.1 + 0.01).half()}
    if parts.get("perm"):
        t["perm"] = torch.randperm(k, generator=g).to(F.perm_dtype(k))
    for name, size in (("su", k), ("sv", n)):
        if parts.get(name):
            t[name] = F.pack_signs(torch.randint(0, 2, (size,), generator=g) * 2 - 1)
    return t


def test_quantized_slices_match_the_reference():
    segs = [F.Segment(64, 6, 32), F.Segment(128, 3, 64), F.Segment(64, 8, 64)]
    t = _quant_layer(40, 256, segs, perm=True, su=True)
    plain = {k: t[k] for k in ("qweight", "qscale", "qmeta")}
    q = F.dequantize(plain)  # the permuted, unrotated matrix Q
    assert group_boundaries(t["qmeta"]) == [0, 32, 64, 128, 192, 256]
    for j0, j1 in [(0, 64), (64, 192), (32, 256), (128, 192)]:
        part = quant_k_range(t, j0, j1)
        assert int(part["qmeta"][:, 0].sum()) == j1 - j0
        assert torch.equal(F.dequantize(part), q[:, j0:j1])
    with pytest.raises(ParallelError, match="cuts a quantization group"):
        quant_k_range(t, 96, 256)
    rows = quant_rows(t, 8, 24)
    assert torch.equal(F.dequantize(rows), F.dequantize(t)[8:24])  # su and perm are shared by all rows
    # The row split of a full layer is exact: partial products over permuted ranges sum to the whole.
    x = torch.randn(3, 256)
    u = F.fwht(x * F.unpack_signs(t["su"], 256))[:, t["perm"].long()]
    total = sum(u[:, a:b] @ F.dequantize(quant_k_range(t, a, b)).T for a, b in [(0, 64), (64, 192), (192, 256)])
    assert torch.allclose(total, F.reference_forward(x, t), atol=1e-5)
