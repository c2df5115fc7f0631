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


def test_dequantize_follows_the_codes_device():
    """convert --device cuda dequantizes GPU codes with scales and segment tables made on the CPU: the
    result lands on the codes' device (the meta device stands in for a GPU here)."""
    segs = [F.Segment(64, 4, 32), F.Segment(32, 8, 32)]
    codes = torch.randint(0, 16, (8, 96), dtype=torch.uint8)
    scales = torch.rand(8, 3).half()
    q = F.dequantize_codes(codes.to("meta"), scales, segs)
    assert q.device.type == "meta" and q.shape == (8, 96)
    assert F.dequantize_codes(codes, scales, segs).device.type == "cpu"


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


# -- trellis-coded layers (§7) ------------------------------------------------------------------


def _random_trellis(n=32, k=48, bits=3, state_bits=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    meta = F.TrellisMeta(bits=bits, state_bits=state_bits)
    words = torch.randint(-2**31, 2**31 - 1, (n // 16, k // 16, meta.words_per_tile), generator=g).to(torch.int32)
    return meta, {"trellis": words, "tscale": (torch.rand(n, generator=g) / 100).half(), "tmeta": meta.to_tensor(),
                  "su": F.pack_signs(torch.randn(k, generator=g).sign()),
                  "sv": F.pack_signs(torch.randn(n, generator=g).sign())}


@pytest.mark.parametrize("bits,state_bits", [(1, 8), (2, 16), (3, 12), (4, 16), (8, 8), (8, 16)])
def test_trellis_states_follow_the_spec_and_pack_back(bits, state_bits):
    meta, t = _random_trellis(bits=bits, state_bits=state_bits)
    words = t["trellis"]
    states = F.trellis_states(words, meta)
    w = words[1, 2].to(torch.int64) & 0xFFFFFFFF
    stream = [(int(w[m // 32]) >> (m % 32)) & 1 for m in range(256 * bits)]
    for tt in (0, 1, 17, 255):  # the window definition of §7.2, bit by bit, wrapping around
        want = sum(stream[(tt * bits + q) % (256 * bits)] << q for q in range(state_bits))
        assert int(states[1, 2, tt]) == want
    nxt = (states[..., :-1] >> bits) == (states[..., 1:] & (2 ** (state_bits - bits) - 1))
    assert nxt.all()  # consecutive states overlap in L - K bits
    assert torch.equal(F.trellis_pack(states, meta), words)


def test_trellis_pack_rejects_an_inconsistent_walk():
    meta, t = _random_trellis()
    states = F.trellis_states(t["trellis"], meta).clone()
    states[0, 0, 5] ^= 1 << 11
    with pytest.raises(ValueError, match="not a valid trellis walk"):
        F.trellis_pack(states, meta)


def test_trellis_code_is_a_centred_near_gaussian():
    cb = F.trellis_codebook(F.TrellisMeta(bits=2, state_bits=16)).double()
    assert abs(cb.mean()) < 2 and 140 < cb.std() < 156 and cb.abs().max() <= 510
    x = (12345 * 0xB9D2F219 + 0x29207D73) & 0xFFFFFFFF  # the default constants (A, B)
    assert int(cb[12345]) == sum((x >> s) & 255 for s in (0, 8, 16, 24)) - 510


def test_trellis_tile_order_is_column_major():
    q = torch.arange(32 * 48).view(32, 48)
    tiles = F.trellis_matrix_to_tiles(q)
    assert int(tiles[1, 2, 3 * 16 + 5]) == int(q[16 + 5, 32 + 3])
    assert torch.equal(F.trellis_tiles_to_matrix(tiles), q)


def test_trellis_layout_2_is_quad_rows():
    q = torch.arange(32 * 48).view(32, 48)
    tiles = F.trellis_matrix_to_tiles(q, 2)
    # walk position t: row (t div 4) mod 16, column 4 (t div 64) + t mod 4
    for t, (r, c) in {0: (0, 0), 3: (0, 3), 5: (1, 1), 63: (15, 3), 64: (0, 4), 255: (15, 15)}.items():
        assert int(tiles[1, 2, t]) == int(q[16 + r, 32 + c])
    assert torch.equal(F.trellis_tiles_to_matrix(tiles, 2), q)


@pytest.mark.parametrize("code, n, shift, std_max", [(2, 128, 5, 75), (3, 64, 6, 80)])
def test_two_table_code_is_the_sum_of_two_table_lookups(code, n, shift, std_max):
    tc = F.two_table_default(code)
    assert tc.dtype == torch.int8 and tc.shape == (2 * n,)
    assert torch.equal(tc, F.two_table_default(code))  # deterministic
    assert sorted(tc[:n].tolist()) == sorted(tc[n:].tolist()) and int(tc.abs().max()) == 127
    meta = F.TrellisMeta(3, 12, code=code)
    assert (meta.version, meta.mul, meta.add) == (2, 0, 0)
    cb = F.trellis_codebook(meta, tc).double()
    assert abs(cb.mean()) < 2 and 60 < cb.std() < std_max
    for s in (0, 1, 2**shift - 1, 2**shift, 2047, 4095):
        a, b = s & (n - 1), (s >> shift) & (n - 1)
        assert int(cb[s]) == int(tc[(a + b) % n]) + int(tc[n + (a - b) % n])
    assert F.TrellisMeta.from_tensor(meta.to_tensor()) == meta
    with pytest.raises(ValueError, match="needs its tables"):
        F.trellis_codebook(meta)
    other = F.two_table_default(5 - code)  # the other two-table code's tables: the wrong size
    with pytest.raises(ValueError, match=rf"tcode of a code {code} layer must be int8 \[{2 * n}\]"):
        F.trellis_codebook(meta, other)
    # the 4096 states take many distinct values: the code behaves like a random one, not an n-level grid
    assert len(set(cb.tolist())) > 300


def test_trellis_code_3_layer_counts_its_128_bytes_of_tables():
    meta = F.TrellisMeta(2, 12, code=F.CODE_TWO_TABLE_64)
    _, t = _random_trellis(bits=2)
    t["tmeta"], t["tcode"] = meta.to_tensor(), F.two_table_default(3)
    values = F.trellis_code(F.trellis_states(t["trellis"], meta), meta, t["tcode"])
    q = F.trellis_decode(t, torch.float64)
    assert float(q[17, 38]) == float(values[1, 2, 70]) * float(t["tscale"][17])  # layout 2, as code 2
    n, k = 32, 48
    assert F.storage_bits(t) == 8 * (2 * n * k // 8 + 2 * n + 24 + 128 + k // 8 + n // 8)


@pytest.mark.parametrize("kw,msg", [
    ({"bits": 3, "state_bits": 14, "code": 2}, "code 2 needs L = 12"),
    ({"bits": 8, "state_bits": 12, "code": 2}, "code 2 needs L = 12"),
    ({"bits": 3, "state_bits": 12, "code": 2, "version": 1}, "stored in tile layout 2"),
    ({"bits": 3, "state_bits": 12, "code": 1, "version": 2}, "stored in tile layout 1"),
    ({"bits": 3, "state_bits": 12, "code": 4}, "unknown trellis code id 4"),
    ({"bits": 3, "state_bits": 16, "code": 3}, "code 3 needs L = 12"),
    ({"bits": 3, "state_bits": 12, "code": 3, "version": 1}, "stored in tile layout 2"),
    ({"bits": 3, "state_bits": 12, "version": 3}, "layout version 3 is not supported"),
])
def test_trellis_meta_refuses_what_the_format_does_not_define(kw, msg):
    with pytest.raises(ValueError, match=msg):
        F.TrellisMeta(**kw)


def test_trellis_code_2_layer_decodes_and_counts_its_tables():
    meta = F.TrellisMeta(2, 12, code=F.CODE_TWO_TABLE)
    _, t = _random_trellis(bits=2)
    t["tmeta"], t["tcode"] = meta.to_tensor(), F.two_table_default()
    values = F.trellis_code(F.trellis_states(t["trellis"], meta), meta, t["tcode"])
    q = F.trellis_decode(t, torch.float64)
    # weight t = 70 of tile (1, 2): row 16 + (70 // 4) % 16 = 17, column 32 + 4 + 2 = 38
    assert float(q[17, 38]) == float(values[1, 2, 70]) * float(t["tscale"][17])
    n, k = 32, 48
    assert F.storage_bits(t) == 8 * (2 * n * k // 8 + 2 * n + 24 + 256 + k // 8 + n // 8)


def test_trellis_dequantize_forward_and_bits():
    meta, t = _random_trellis(n=32, k=48, bits=3)
    w = F.dequantize(t, torch.float64)
    q = F.trellis_decode(t, torch.float64)
    hk, hn = F.hadamard_matrix(48), F.hadamard_matrix(32)
    du, dv = torch.diag(F.unpack_signs(t["su"], 48, torch.float64)), torch.diag(F.unpack_signs(t["sv"], 32, torch.float64))
    torch.testing.assert_close(hn @ dv @ w @ du @ hk, q)  # Ŵ = H_N D_v W D_u H_K (§7.4)
    x = torch.randn(3, 48)
    torch.testing.assert_close(F.reference_forward(x, t), (x.double() @ w.T).float(), atol=1e-4, rtol=1e-4)
    assert F.storage_bits(t) == 8 * (32 * 48 * 3 // 8 + 32 * 2 + 24 + 6 + 4)
    assert F.layer_shape(t) == (32, 48)
