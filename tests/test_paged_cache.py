"""The paged KV cache: attention over pages equals plain attention, quantized storage is accurate,
pages are shared by prefix hash, reserved, released and reused as documented."""

import pytest
import torch

import exl
from exl.cache.kv_store import QuantStore, pack, rotation_matrix, unpack
from exl.cache.paged import CacheCapacityError, PagedCache, PagedContext, chain_hashes
from test_models import BASE, check_close, make_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("paged")
    return {name: exl.load_model(make_model(tmp, name)[1], progress=False)
            for name in ("llama", "mistral-window", "gemma3", "qwen3-moe")}


def fragment(cache):
    """Leave every other page of the cache taken, so that new sequences get scattered pages."""
    tables = []
    for i in range(cache.num_pages):
        t = cache.open([i], 1)
        cache.extend(t, 1)
        tables.append(t)
    for t in sorted(tables, key=lambda t: t.pages[0])[::2]:
        cache.close(t, share=False)


def run_chunks(model, cache, ids, chunks):
    """Forward ids through a paged cache in chunks."""
    table = cache.open(ids[0].tolist(), ids.shape[1])
    outs = []
    for a, b in chunks:
        cache.extend(table, b - a)
        outs.append(model(ids[:, a:b], ctx=PagedContext(cache, [(table, b - a)])))
        cache.commit(table, ids[0, a:b].tolist())
    return torch.cat(outs, 1), table


@pytest.mark.parametrize("name", ["llama", "mistral-window", "gemma3", "qwen3-moe"])
def test_paged_forward_matches_full_forward(models, name):
    model = models[name]
    ids = torch.randint(0, BASE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(3))
    cache = PagedCache(model, num_pages=40, page_size=4)
    fragment(cache)
    got, table = run_chunks(model, cache, ids, [(0, 9), (9, 10), (10, 11), (11, 23), (23, 24), (24, 40)])
    assert len(table.runs(40)) == 10, "the test should cover attention over several page runs"
    check_close(got, model(ids), 1e-5)


def test_packed_batch_matches_separate_sequences(models):
    """Several sequences in one [1, total] forward: each gets the logits it would get alone."""
    model = models["gemma3"]  # sliding window + softcap
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, BASE["vocab_size"], (1, n), generator=g) for n in (7, 19, 12)]
    cache = PagedCache(model, num_pages=30, page_size=4)
    fragment(cache)
    tables = [cache.open(s[0].tolist(), s.shape[1]) for s in seqs]
    # first a prefill of different lengths for each, then one packed step with 1, 3 and 2 new tokens
    cut = [4, 16, 10]
    for t, s, c in zip(tables, seqs, cut):
        cache.extend(t, c)
        model(s[:, :c], ctx=PagedContext(cache, [(t, c)]))
        cache.commit(t, s[0, :c].tolist())
    segs = [(t, s.shape[1] - c) for t, s, c in zip(tables, seqs, cut)]
    for t, n in segs:
        cache.extend(t, n)
    flat = torch.cat([s[:, c:] for s, c in zip(seqs, cut)], 1)
    out = model(flat, ctx=PagedContext(cache, segs))
    off = 0
    for s, c in zip(seqs, cut):
        n = s.shape[1] - c
        check_close(out[:, off : off + n], model(s)[:, c:], 1e-5)
        off += n


@pytest.mark.parametrize("name,bits,drafts", [("mistral-window", None, True), ("gemma3", None, True),
                                               ("gemma3", None, False), ("llama", None, False), ("llama", (4, 8), True)])
def test_batched_decode_attention_matches_per_sequence(models, name, bits, drafts, monkeypatch):
    """Many short segments (decode steps, drafts) attend together over gathered keys: the same outputs as one
    sequence at a time, and (float cache) as the full forward; over scattered pages, windows and softcap, and with
    4-bit per-channel keys (open and closed blocks) and 8-bit rotated values."""
    import exl.cache.paged as paged

    model = models[name]
    kb, vb = bits or (None, None)
    g = torch.Generator().manual_seed(6)
    lengths = [3, 9, 17, 30, 33, 12]
    new = [1, 1, 4, 1, 2, 1] if drafts else [1] * 6  # 4 and 2: a decode token plus drafts
    seqs = [torch.randint(0, BASE["vocab_size"], (1, n + k), generator=g) for n, k in zip(lengths, new)]

    def run(batched: bool):
        monkeypatch.setattr(paged, "BATCHED_MAX_QUERIES", 16 if batched else 0)
        cache = PagedCache(model, num_pages=64, page_size=4, k_bits=kb, v_bits=vb)
        fragment(cache)
        tables = [cache.open(s[0].tolist(), s.shape[1]) for s in seqs]
        for t, s, n in zip(tables, seqs, lengths):
            cache.extend(t, n)
            model(s[:, :n], ctx=PagedContext(cache, [(t, n)]))
            cache.commit(t, s[0, :n].tolist())
        segs = [(t, k) for t, k in zip(tables, new)]
        for t, k in segs:
            cache.extend(t, k)
        ctx = PagedContext(cache, segs)
        out = model(torch.cat([s[:, n:] for s, n in zip(seqs, lengths)], 1), ctx=ctx)
        assert (ctx._batch() is not None) == batched
        if batched:
            assert len(ctx._batch().members) == len(seqs)
            assert max(len(t.runs(t.length + k)) for t, k in segs) > 1, "the test should cover scattered pages"
        return out

    got, alone = run(True), run(False)
    check_close(got, alone, 1e-5)
    if bits is None:
        off = 0
        for s, n, k in zip(seqs, lengths, new):
            check_close(got[:, off : off + k], model(s)[:, n:], 1e-5)
            off += k


@pytest.mark.parametrize("k_bits,v_bits", [(None, 16), (4, 8), (6, 4)])
def test_store_gather_equals_read(models, k_bits, v_bits):
    """gather(layer, slots) gives each slot's vector exactly as read() does, open (staged) blocks included."""
    model = models["llama"]
    cache = PagedCache(model, num_pages=8, page_size=32, k_bits=k_bits, v_bits=v_bits)
    ids = list(range(70))
    t = cache.open(ids, 80)
    cache.extend(t, 70)
    model(torch.tensor([ids]), ctx=PagedContext(cache, [(t, 70)]))
    cache.commit(t, ids[:70])  # two closed blocks of 32 keys, one open block of 6
    slots = torch.tensor([t.slot(p) for p in (69, 0, 5, 33, 64, 31, 68)])
    for store in (cache.k, cache.v):
        for layer in range(model.config.num_layers):
            want = torch.cat([store.read(layer, s, s + 1) for s in slots.tolist()], 1)
            assert torch.equal(store.gather(layer, slots), want)
            buf = torch.empty_like(want)
            assert torch.equal(store.gather(layer, slots, buf), want)


def test_pack_roundtrip_and_quantization_error():
    g = torch.Generator().manual_seed(0)
    for bits, bound in ((8, 0.006), (6, 0.025), (4, 0.10)):
        codes = torch.randint(0, 2**bits, (5, 3, 64), generator=g).to(torch.uint8)
        assert torch.equal(unpack(pack(codes, bits), bits), codes)
        rot = rotation_matrix(64)
        store = QuantStore(1, 3, 16, 64, bits, rot, torch.float32, "cpu")
        x = torch.randn(16, 3, 64, generator=g)
        x[:, :, 7] *= 20  # an outlier channel: the rotation spreads it
        store.write(0, torch.arange(16), x)
        back = (store.read(0, 0, 16) @ rot.T).transpose(0, 1)
        rel = ((back - x).norm() / x.norm()).item()
        assert rel < bound, f"{bits}-bit relative error {rel:.4f} > {bound}"
    assert torch.allclose(rot @ rot.T, torch.eye(64), atol=1e-6)


@pytest.mark.parametrize("bits,tol", [(16, 2e-3), (8, 0.05), (4, 0.4)])
def test_quantized_cache_forward_is_close(models, bits, tol):
    model = models["llama"]
    ids = torch.randint(0, BASE["vocab_size"], (1, 30), generator=torch.Generator().manual_seed(5))
    cache = PagedCache(model, num_pages=10, page_size=8, k_bits=bits, v_bits=bits)
    got, _ = run_chunks(model, cache, ids, [(0, 12), (12, 13), (13, 30)])
    want = model(ids)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < tol
    if bits == 8:  # and close enough that the argmax rarely moves
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_k_and_v_bits_are_independent(models):
    model = models["llama"]
    cache = PagedCache(model, num_pages=4, page_size=8, k_bits=8, v_bits=4)
    assert cache.k.bits == 8 and cache.v.bits == 4
    full = PagedCache(model, num_pages=4, page_size=8, k_bits=16, v_bits=16)
    assert cache.bytes_per_token < full.bytes_per_token
    with pytest.raises(ValueError, match="k_bits=5"):
        PagedCache(model, num_pages=4, k_bits=5)


def test_prefix_pages_shared_reserved_released_and_reused(models):
    model = models["llama"]
    ps = 4
    cache = PagedCache(model, num_pages=12, page_size=ps)
    prompt = list(range(10, 23))  # 13 tokens: 3 full pages
    a = cache.open(prompt, 20)
    assert a.length == 0 and cache.pages_in_use == 0 and cache.reserved == 5
    cache.extend(a, len(prompt))
    assert cache.pages_in_use == 4  # allocated on demand: ceil(13 / 4)
    # while a's prompt pages are being written, a prompt sharing them is told to wait
    assert cache.pending_prefix(prompt[:9] + [99, 98])
    cache.commit(a, prompt)
    a_pages = list(a.pages)
    assert not cache.pending_prefix(prompt[:9] + [99, 98])

    b = cache.open(prompt[:9] + [99, 98], 16)  # shares a's first 2 pages, copies 1 token of the 3rd
    assert b.length == 9 and b.pages[:2] == a.pages[:2] and b.pages[2] != a.pages[2]
    cache.extend(b, 2)
    cache.commit(b, [99, 98])
    assert cache.pages_in_use == 4 + 1  # only one new page for b
    same = cache.open(prompt, 20)  # identical prompt: reuses 3 pages (<= len - 1 tokens), computes the last token
    assert same.length == 12
    cache.close(same)

    cache.close(a)
    # b keeps 2 of a's pages; a's 3rd page (full) and its partial last page are kept for reuse
    assert cache.pages_in_use == 3 and cache.pages_cached == 2
    cache.close(b)
    assert cache.pages_in_use == 0 and cache.pages_cached == 5 and cache.reserved == 0
    c = cache.open(prompt + [1, 2, 3], 24)  # after both ended: 3 full pages + 1 token of a's last page
    assert c.length == 13 and c.pages[:3] == a_pages[:3] and cache.pages_cached == 2
    cache.close(c)


def test_reservation_queues_instead_of_overcommitting(models):
    model = models["llama"]
    cache = PagedCache(model, num_pages=6, page_size=4)
    a = cache.open([1, 2, 3], 12)  # 3 pages reserved
    b = cache.open([4, 5, 6], 12)  # 3 more: the cache is now fully reserved
    assert a is not None and b is not None
    assert cache.open([7, 8, 9], 4) is None  # must wait
    cache.close(a)
    assert cache.open([7, 8, 9], 4) is not None
    with pytest.raises(CacheCapacityError, match="holds 24"):
        cache.open(list(range(20)), 25)


def test_cached_pages_are_recycled_least_recent_first(models):
    model = models["llama"]
    cache = PagedCache(model, num_pages=4, page_size=2)
    for prompt in ([1, 2], [4, 5]):
        t = cache.open(prompt, 2)
        cache.extend(t, 2)
        cache.commit(t, prompt)
        cache.close(t)
    assert cache.pages_cached == 2
    t = cache.open([7, 8, 9, 10, 11, 12, 13], 8)  # needs all 4 pages: evicts the cached ones, oldest first
    cache.extend(t, 5)
    cache.commit(t, [7, 8, 9, 10, 11], share=False)
    assert cache.pages_cached == 1 and cache.open([4, 5, 6], 3) is None
    assert len(cache.match([4, 5, 6])[0]) == 1 and len(cache.match([1, 2, 3])[0]) == 0  # the older one went first
    cache.extend(t, 2)
    assert cache.pages_cached == 0 and cache.pages_in_use == 4


def test_memory_bound_and_contiguous_runs(models):
    """In-use pages never exceed tokens held plus one page per sequence; sequences growing side by side keep
    long runs of consecutive pages."""
    model = models["llama"]
    ps = 4
    cache = PagedCache(model, num_pages=64, page_size=ps)
    tables = [cache.open([i], 60) for i in range(4)]
    for step in range(50):
        for t in tables:
            cache.extend(t, 1)
            cache.commit(t, [step], share=False)
        held = sum(t.length for t in tables)
        assert cache.pages_in_use * ps <= held + ps * len(tables)
    assert max(len(t.runs(t.length)) for t in tables) <= 3


def test_chain_hash_depends_on_whole_prefix():
    a = chain_hashes([1, 2, 3, 4, 5, 6], 3)
    b = chain_hashes([9, 2, 3, 4, 5, 6], 3)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second page, different history
    assert chain_hashes([1, 2, 3, 4, 5], 3) == a[:1]


def test_partial_page_is_copied_from_a_known_page(models):
    """Past the last whole shared page, the longest common part of a known page is copied, not recomputed."""
    model = models["llama"]
    ps = 8
    cache = PagedCache(model, num_pages=16, page_size=ps)
    ids = torch.randint(0, BASE["vocab_size"], (1, 21), generator=torch.Generator().manual_seed(6))
    prompt = ids[0].tolist()
    _, a = run_chunks(model, cache, ids[:, :19], [(0, 19)])  # 2 full pages + 3 tokens
    cache.close(a)
    assert cache.pages_cached == 3  # the partial last page is kept too
    b = cache.open(prompt, 21)  # same 19 tokens, then 2 new ones: reuses 16 + 3 copied
    assert b.length == 19 and b.pages[:2] == a_pages(cache, prompt)[:2] and cache.pages_in_use == 3
    cache.extend(b, 2)
    out = model(ids[:, 19:], ctx=PagedContext(cache, [(b, 2)]))
    check_close(out, model(ids)[:, 19:], 1e-5)
    cache.close(b)
    c = cache.open(prompt[:12] + [1, 2, 3], 15)  # diverges inside page 2: copies the 4 tokens in common
    assert c.length == 12
    cache.close(c)


def a_pages(cache, prompt):
    return cache.match(prompt)[0]


def test_4bit_keys_rounded_per_block_and_reopened_on_truncate(models):
    """4-bit keys wait in float staging until their block is committed; truncating into a rounded block
    brings it back to staging; released pages leave no staging behind."""
    model = models["llama"]
    cache = PagedCache(model, num_pages=8, page_size=8, k_bits=4, v_bits=16)
    st = cache.k
    assert cache.block == 8 and not st.rotated
    ids = torch.randint(0, BASE["vocab_size"], (1, 30), generator=torch.Generator().manual_seed(7))
    table = cache.open(ids[0].tolist(), 30)
    cache.extend(table, 20)
    model(ids[:, :20], ctx=PagedContext(cache, [(table, 20)]))
    assert sum(st.is_open(b) for b in range(st.stage_of.numel())) == 3  # blocks of positions 0-7, 8-15, 16-19
    cache.commit(table, ids[0, :20].tolist(), share=False)
    assert [st.is_open(table.slot(p) // 8) for p in (0, 8, 16)] == [False, False, True]
    cache.truncate(table, 13)  # cuts into the rounded block 8-15: reopened from its codes
    assert st.is_open(table.slot(8) // 8)
    cache.extend(table, 17)
    got = model(ids[:, 13:], ctx=PagedContext(cache, [(table, 17)]))
    cache.commit(table, ids[0, 13:].tolist(), share=False)
    want = model(ids)[:, 13:]
    assert ((got - want).abs().max() / want.abs().max()).item() < 0.4
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.6
    cache.close(table, share=False)
    assert int(st.stage_of.max()) < 0 and cache.pages_in_use == 0
