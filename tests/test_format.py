"""The format reference: packing round-trips, plane layout, rotations, bpw accounting."""

import pytest
import torch

from exl import format as F


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_roundtrip(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (5, 128), generator=g, dtype=torch.int32).to(torch.uint8)
    seg = [F.Segment(128, bits, 64)]
    packed = F.pack_codes(codes, seg)
    assert packed.shape == (5, 128 // 32 * 4 * bits)
    assert torch.equal(F.unpack_codes(packed, seg), codes)


def test_plane_layout_matches_spec():
    # 4-bit: byte j holds codes j (low nibble) and j+16 (high nibble), as in llama.cpp Q4_0
    codes = torch.arange(32, dtype=torch.uint8).remainder(16).view(1, 32)
    p = F.pack_codes(codes, [F.Segment(32, 4, 32)])[0]
    for j in range(16):
        assert p[j] & 15 == codes[0, j] and p[j] >> 4 == codes[0, j + 16]
    # 5-bit: 16 nibble bytes then 4 bytes of bit 4, code i in byte i%4 at bit i//4
    codes = torch.randint(0, 32, (1, 32), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    p = F.pack_codes(codes, [F.Segment(32, 5, 32)])[0].tolist()
    for i in range(32):
        lo = (p[i % 16] >> (4 * (i // 16))) & 15
        hi = (p[16 + i % 4] >> (i // 4)) & 1
        assert lo | (hi << 4) == codes[0, i]


def test_mixed_segments_roundtrip():
    segs = [F.Segment(64, 6, 32), F.Segment(128, 3, 64), F.Segment(64, 8, 64)]
    codes = torch.cat([torch.randint(0, 2**s.bits, (7, s.k_len)) for s in segs], 1).to(torch.uint8)
    packed = F.pack_codes(codes, segs)
    assert packed.shape[1] == sum(s.n_bytes for s in segs)
    assert torch.equal(F.unpack_codes(packed, segs), codes)
    meta = F.segments_to_meta(segs)
    assert F.segments_from_meta(meta) == segs


def test_fwht_is_orthogonal_sylvester():
    h = F.hadamard_matrix(8)
    sylvester = torch.tensor([[1.0]], dtype=torch.float64)
    for _ in range(3):
        sylvester = torch.cat([torch.cat([sylvester, sylvester], 1), torch.cat([sylvester, -sylvester], 1)], 0)
    assert torch.allclose(h, sylvester / 8**0.5)
    h = F.hadamard_matrix(576)
    assert F.hadamard_block(576) == 64
    assert torch.allclose(h @ h.T, torch.eye(576, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(h, h.T)


def test_signs_roundtrip():
    s = torch.where(torch.rand(37) < 0.5, -1.0, 1.0)
    assert torch.equal(F.unpack_signs(F.pack_signs(s), 37), s)


def _random_layer(n, k, segs, rotate=True, perm=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.cat([torch.randint(0, 2**s.bits, (n, s.k_len), generator=g) for s in segs], 1).to(torch.uint8)
    t = {
        "qweight": F.pack_codes(codes, segs),
        "qscale": (torch.rand(n, sum(s.n_groups for s in segs), generator=g) * 0.1).half(),
        "qmeta": F.segments_to_meta(segs),
    }
    if perm:
        t["perm"] = torch.randperm(k, generator=g).to(F.perm_dtype(k))
    if rotate:
        t["su"] = F.pack_signs(torch.where(torch.rand(k, generator=g) < 0.5, -1, 1))
        t["sv"] = F.pack_signs(torch.where(torch.rand(n, generator=g) < 0.5, -1, 1))
    t["bias"] = torch.randn(n, generator=g)
    return t


def test_reference_forward_equals_dense_dequantize():
    segs = [F.Segment(64, 6, 32), F.Segment(128, 4, 64)]
    t = _random_layer(96, 192, segs)
    x = torch.randn(3, 192, dtype=torch.float64)
    w = F.dequantize(t, torch.float64)
    want = x @ w.T + t["bias"].double()
    got = F.reference_forward(x.float(), t).double()
    assert (got - want).abs().max() < 1e-4 * want.abs().max()


def test_bits_per_weight_accounting():
    segs = [F.Segment(128, 4, 128)]
    t = _random_layer(64, 128, segs, rotate=False, perm=False)
    # 4 bits per code + one fp16 scale per 128 weights + 12 bytes of qmeta
    assert F.storage_bits(t) == 64 * 128 * 4 + 64 * 16 + 3 * 32
    assert abs(F.bits_per_weight(t) - (4 + 16 / 128 + 96 / (64 * 128))) < 1e-12
