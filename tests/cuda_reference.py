"""Plain-PyTorch references and random layers for the CUDA kernel tests (on a GPU, tests/gpu, and on
the host harness, tests/test_cuda_host.py). Built on exl.format, the format's executable reference."""

from __future__ import annotations

import math

import torch

from exl import format as F

LAYER_KEYS = ("qweight", "qscale", "qmeta", "perm", "su", "sv", "bias")


def random_layer(n, segs, *, perm=True, su=True, sv=True, bias=True, seed=0, perm_dtype=None):
    g = torch.Generator().manual_seed(seed)
    k = sum(s.k_len for s in segs)
    codes = torch.cat([torch.randint(0, 2**s.bits, (n, s.k_len), generator=g) for s in segs], 1).to(torch.uint8)
    scale = torch.rand(n, sum(s.n_groups for s in segs), generator=g) * 0.1 + 0.01
    t = {"qweight": F.pack_codes(codes, segs), "qscale": scale.half(), "qmeta": F.segments_to_meta(segs)}
    if perm:
        t["perm"] = torch.randperm(k, generator=g).to(perm_dtype or F.perm_dtype(k))
    if su:
        t["su"] = F.pack_signs(torch.where(torch.rand(k, generator=g) < 0.5, -1, 1))
    if sv:
        t["sv"] = F.pack_signs(torch.where(torch.rand(n, generator=g) < 0.5, -1, 1))
    if bias:
        t["bias"] = torch.randn(n, generator=g)
    return t


def abs_rotate(v):
    """|H_N| v over the last dim: what a Hadamard rotation can do to a bound on |v|."""
    n = v.shape[-1]
    b = F.hadamard_block(n)
    return v.view(-1, n // b, b).sum(-1, keepdim=True).expand(-1, -1, b).reshape(v.shape) / math.sqrt(b)


def exact_and_scale(x, t):
    """fp64 forward z, c = |u'| @ |Q|^T (rotated domain, through |H_N|) for error bounds, and u', Q."""
    segs = F.segments_from_meta(t["qmeta"])
    q = F.dequantize_codes(F.unpack_codes(t["qweight"], segs), t["qscale"], segs, torch.float64)
    n, k = q.shape
    u = x.double()
    if "su" in t:
        u = F.fwht(u * F.unpack_signs(t["su"], k, torch.float64))
    if "perm" in t:
        u = u[:, t["perm"].long()]
    z, c = u @ q.T, u.abs() @ q.abs().T
    if "sv" in t:
        z = F.fwht(z) * F.unpack_signs(t["sv"], n, torch.float64)
        c = abs_rotate(c)
    if "bias" in t:
        z = z + t["bias"].double()
    return z, c, u, q


def abs_bound(x, t):
    """fp64 reference of the forward pass and c = |u'| @ |Q|^T (rotated domain) for error bounds."""
    return exact_and_scale(x, t)[:2]


def check_forward(layer, t, m, path, seed=1):
    """layer.forward(x, path) on fp16 x [m, K] against abs_bound, with the bounds of tests/gpu."""
    k = sum(int(r[0]) for r in t["qmeta"])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).half()
    dev = t["qweight"].device
    got = layer.forward(x.to(dev), path).double().cpu()
    want, c = abs_bound(x.float(), {kk: v.cpu() for kk, v in t.items()})
    # GEMM ("auto" above 8 rows): fp16 activations and weights, and cuBLAS may reduce in fp16
    gemm = path == "gemm" or (path == "auto" and m > 8)
    rel = 2.0**-8 if gemm else 2.0**-20 * (math.sqrt(k) + 8)
    bound = rel * c + 2.0**-11 * want.abs() + 1e-6
    err = (got - want).abs()
    assert bool((err <= bound).all()), f"{path}: worst err/bound {(err / bound).max():.3g}"


def kv_reference(x, bits, signs=None):
    """Plain-PyTorch docs/format.md §6 quantizer: rotate, per-32 fp16 scales, LSB-first bit stream."""
    d = x.shape[-1]
    y = x.float() * (F.unpack_signs(signs, d) if signs is not None else 1.0)
    y = F.fwht(y, block=d).unflatten(-1, (-1, 32))
    c = (2**bits - 1) / 2
    scale = (y.abs().amax(-1, keepdim=True) / c).clamp_min(1e-8).half()
    codes = torch.round(y / scale.float() + c).clamp(0, 2**bits - 1).to(torch.int64).flatten(-2)
    bitpos = torch.arange(d) * bits
    stream = torch.zeros(*codes.shape[:-1], d * bits, dtype=torch.int64)
    for j in range(bits):
        stream[..., bitpos + j] = (codes >> j) & 1
    packed = (stream.unflatten(-1, (-1, 8)) << torch.arange(8)).sum(-1).to(torch.uint8)
    return packed, scale.squeeze(-1), y.flatten(-2)


def kv_unpack(packed, bits, d):
    bits_ = ((packed.to(torch.int64).unsqueeze(-1) >> torch.arange(8)) & 1).flatten(-2)
    return (bits_.unflatten(-1, (d, bits)) << torch.arange(bits)).sum(-1)


def random_trellis(n, k, bits, state_bits, seed=0, bias=True, code=1):
    """Random bit streams (every stream is a valid tail-biting walk); codes 2, 3 with random full-range tables."""
    g = torch.Generator().manual_seed(seed)
    if code in F.TWO_TABLE_CODES:
        meta = F.TrellisMeta(bits, state_bits, code=code)
    else:
        meta = F.TrellisMeta(bits, state_bits, mul=0x9E3779B1, add=0x7F4A7C15)
    words = torch.randint(-(2**31), 2**31, (n // 16, k // 16, meta.words_per_tile), generator=g, dtype=torch.int64)
    t = {"trellis": words.to(torch.int32), "tscale": (torch.rand(n, generator=g) * 1e-3 + 1e-4).half(),
         "tmeta": meta.to_tensor(), "su": F.pack_signs(torch.where(torch.rand(k, generator=g) < 0.5, -1, 1)),
         "sv": F.pack_signs(torch.where(torch.rand(n, generator=g) < 0.5, -1, 1))}
    if code in F.TWO_TABLE_CODES:
        size = F.two_table_size(code)
        tcode = torch.randint(-128, 128, (2 * size,), generator=g, dtype=torch.int8)
        extremes = torch.tensor([-128, 127], dtype=torch.int8)
        tcode[:2], tcode[size:size + 2] = extremes, extremes.flip(0)  # both tables' extremes, either sign
        t["tcode"] = tcode
    if bias:
        t["bias"] = torch.randn(n, generator=g) * 0.1
    return t


def random_two_table(n, k, bits, seed=0, bias=True, code=F.CODE_TWO_TABLE):
    """A random two-table layer (code 2 or 3; L = 12, tile layout 2)."""
    return random_trellis(n, k, bits, F.TWO_TABLE_STATE_BITS, seed, bias, code=code)


def trellis_reference(x, t):
    """exl.format's forward of a trellis layer in float64 (x, bias and output), on the CPU."""
    return F.reference_forward(x.double().cpu(), {k: (v.double() if k == "bias" else v).cpu() for k, v in t.items()})


def assert_rel_close(got, want, tol, what):
    """max |got - want| <= tol * max |want|."""
    err = float((got.double().cpu() - want).abs().max())
    assert err <= tol * float(want.abs().max()), f"{what}: max err {err:.3e} vs scale {float(want.abs().max()):.3e}"


def paged_attention_reference(q, k_store, v_store, pages, seqs, positions, page_size, scale, window=0, softcap=0.0):
    """Plain-PyTorch paged attention (float64): row r of q [T, Hq, D] (sequence seqs[r], at positions[r]) attends
    over positions max(0, pos - window + 1) .. pos of its sequence (from 0 when window <= 0); position p of
    sequence s lies at slot pages[s, p // page_size] * page_size + p % page_size of k_store / v_store [Hk, slots, D]."""
    t, hq, d = q.shape
    hk = k_store.shape[0]
    out = torch.empty(t, hq, d, dtype=torch.float64)
    for r in range(t):
        s, p = int(seqs[r]), int(positions[r])
        lo = max(0, p - window + 1) if window > 0 else 0
        ps = torch.arange(lo, p + 1)
        slots = pages[s, ps // page_size] * page_size + ps % page_size
        for h in range(hq):
            kh = h // (hq // hk)
            keys, values = k_store[kh, slots].double(), v_store[kh, slots].double()
            scores = keys @ q[r, h].double() * scale
            if softcap > 0:
                scores = softcap * torch.tanh(scores / softcap)
            out[r, h] = torch.softmax(scores, 0) @ values
    return out


def paged_case(hq, hk, d, dtype, *, page_size=8, lengths=(13, 21, 1), chunk=3, seed=0):
    """A store of 12 pages per head, sequences with scattered (and one shared) pages, one query row per sequence
    at its last position, plus the second sequence's last `chunk` positions again (a chunk, or drafts)."""
    g = torch.Generator().manual_seed(seed)
    n_slots = 12 * page_size
    k = torch.randn(hk, n_slots, d, generator=g).to(dtype)
    v = torch.randn(hk, n_slots, d, generator=g).to(dtype)
    order = torch.randperm(12, generator=g)
    p = -(-max(lengths) // page_size)
    pages = torch.stack([order[(3 * i + torch.arange(p)) % 12] for i in range(len(lengths))])
    pages[2, 0] = pages[0, 0]  # a shared page
    seqs = [*range(len(lengths)), *[1] * chunk]
    pos = [n - 1 for n in lengths] + list(range(lengths[1] - chunk, lengths[1]))
    q = torch.randn(len(seqs), hq, d, generator=g).to(dtype)
    return q, k, v, pages, torch.tensor(seqs), torch.tensor(pos)


def paged_decode(model, prompts, steps, device="cpu"):
    """Logits of each decode step through a paged cache: prefill every prompt, then feed the given tokens
    [steps][sequences], all sequences together in each step."""
    from exl.cache.paged import PagedCache, PagedContext

    cache = PagedCache(model, num_pages=64, page_size=4)
    tables, out = [], []
    for p in prompts:
        t = cache.open(p, len(p) + len(steps))
        cache.extend(t, len(p))
        model(torch.tensor([p], device=device), ctx=PagedContext(cache, [(t, len(p))]))
        cache.commit(t, p)
        tables.append(t)
    for last in steps:
        for t in tables:
            cache.extend(t, 1)
        out.append(model(torch.tensor([last], device=device), ctx=PagedContext(cache, [(t, 1) for t in tables])))
        for t, tok in zip(tables, last):
            cache.commit(t, [tok])
    return torch.stack(out).float().cpu()
