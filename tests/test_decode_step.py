"""The one-call decode step (cuda_ext/csrc/cpu_step.cpp, CausalLM.decode_step) over the paged cache.

Its logits are compared with the module-by-module path (the blocks' fused ops) and with the plain-PyTorch
reference (exl.modules.fused.disabled()) on tiny random models of every family (tests/test_models.py
builds them from transformers configs), float and with quantized layers, for one sequence and for several
concurrent sequences of different lengths whose pages interleave; and on the real SmolLM2.
"""

from __future__ import annotations

import pytest
import torch

import exl
from cuda_ext import build
from exl.cache.paged import PagedCache, PagedContext
from exl.modules import fused
from exl.modules.linear import Linear


@pytest.fixture(scope="module")
def ext():
    return build.load_cpu()  # fails (not skips) when the extension cannot be built


def g(seed):
    return torch.Generator().manual_seed(seed)


def close(got, want, tol):
    scale = want.abs().max()
    err = (got - want).abs().max()
    assert err <= tol * scale, f"max abs diff {err:.3e} > {tol} x scale {scale:.3e}"


# -- the paged attention op -------------------------------------------------------------------------------------------

def reference_paged_attention(q, k, v, ks, vs, pages, lengths, ps, scale, window, softcap):
    """Write each sequence's k, v at its last position, then attend over its kept positions (plain PyTorch)."""
    ks, vs = ks.clone(), vs.clone()
    hq, hk = q.shape[1], ks.shape[0]
    out = torch.empty_like(q)
    for b, n in enumerate(lengths.tolist()):
        slots = torch.tensor([pages[b, p // ps] * ps + p % ps for p in range(n)])
        ks[:, slots[-1]], vs[:, slots[-1]] = k[b], v[b]
        lo = max(0, n - window) if window > 0 else 0
        keys = ks[:, slots[lo:]].repeat_interleave(hq // hk, 0)  # [Hq, n, D]
        values = vs[:, slots[lo:]].repeat_interleave(hq // hk, 0)
        s = (keys @ q[b][:, :, None])[..., 0] * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        out[b] = (torch.softmax(s, -1)[:, None, :] @ values)[:, 0]
    return out, ks, vs


@pytest.mark.parametrize("d,hq,hk,window,softcap", [(64, 4, 2, 0, 0.0), (16, 6, 3, 5, 0.0), (128, 2, 2, 0, 20.0),
                                                    (24, 8, 2, 9, 0.0)])
def test_paged_step_attention_matches_reference(ext, d, hq, hk, window, softcap):
    ps, n_pages = 4, 16
    lengths = torch.tensor([1, 7, 13, 4])
    pages = torch.randperm(n_pages, generator=g(1)).view(4, 4)  # interleaved, out of order
    ks = torch.randn(hk, n_pages * ps, d, generator=g(2))
    vs = torch.randn(hk, n_pages * ps, d, generator=g(3))
    q, k, v = (torch.randn(4, h, d, generator=g(4 + i)) for i, h in enumerate((hq, hk, hk)))
    want, want_k, want_v = reference_paged_attention(q, k, v, ks, vs, pages, lengths, ps, 0.3, window, softcap)
    got = ext.paged_step_attention(q, k, v, ks, vs, pages, lengths, ps, 0.3, window, softcap)
    close(got, want, 3e-6)
    assert torch.equal(ks, want_k) and torch.equal(vs, want_v)  # the new keys and values, in their slots


def test_paged_step_attention_rejects_bad_tables(ext):
    ks = torch.zeros(2, 16, 8)
    q, k = torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        ext.paged_step_attention(q, k, k, ks, ks.clone(), torch.tensor([[9]]), torch.tensor([3]), 4, 1.0)
    with pytest.raises(RuntimeError, match="length 5"):
        ext.paged_step_attention(q, k, k, ks, ks.clone(), torch.tensor([[0]]), torch.tensor([5]), 4, 1.0)


def reference_rows(q, ks, vs, slots, positions, scale, window, softcap):
    """Plain PyTorch: query row r [Hq, D] attends over slots[:positions[r] + 1] (its sequence's slot of each
    position), keeping the last `window` when window > 0, in float64."""
    hq, hk = q.shape[1], ks.shape[0]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, p in enumerate(positions):
        lo = max(0, p + 1 - window) if window > 0 else 0
        keys = ks[:, slots[lo : p + 1]].double().repeat_interleave(hq // hk, 0)  # [Hq, n, D]
        values = vs[:, slots[lo : p + 1]].double().repeat_interleave(hq // hk, 0)
        sc = (keys @ q[r].double()[:, :, None])[..., 0] * scale
        if softcap > 0:
            sc = softcap * torch.tanh(sc / softcap)
        out[r] = (torch.softmax(sc, -1)[:, None, :] @ values)[:, 0]
    return out.float()


@pytest.mark.parametrize("d,hq,hk,window,softcap", [(64, 9, 3, 0, 0.0), (128, 4, 2, 6, 0.0), (40, 6, 2, 0, 30.0)])
def test_attention_rows_are_bit_identical_across_layouts_and_row_counts(ext, monkeypatch, d, hq, hk, window, softcap):
    """One summation order for a query row over its keys, on every ISA table: the same sequence's rows give the
    same bits whether its keys lie in consecutive pages or scattered ones, in a contiguous cache, whether a row
    decodes alone (the one-call step's op), shares the call with other sequences, or comes with the rows before it
    (a verified draft, a prompt chunk); and each agrees with the float64 reference within fp32 rounding."""
    ps, length, scale = 4, 23, d**-0.5
    keys, values = torch.randn(hk, length, d, generator=g(1)), torch.randn(hk, length, d, generator=g(2))
    q = torch.randn(length, hq, d, generator=g(3)) * 2
    n_pages = 16
    layouts = {"consecutive": torch.arange(6), "scattered": torch.randperm(n_pages, generator=g(4))[:6]}
    other = torch.randn(hk, n_pages * ps, d, generator=g(5))  # the rest of the store: another sequence's keys

    def store(pages):
        ks, vs = other.clone(), other.flip(1).clone()
        slots = torch.tensor([int(pages[p // ps]) * ps + p % ps for p in range(length)])
        ks[:, slots], vs[:, slots] = keys, values
        return ks, vs, slots

    want = reference_rows(q, *store(layouts["scattered"]), list(range(length)), scale, window, softcap)
    for isa in ext.isa_names():
        monkeypatch.setenv("EXL_CPU_ISA", isa)  # the paged ops run the "auto" table
        results = []
        for pages in layouts.values():
            ks, vs, slots = store(pages)
            table = torch.cat([pages, torch.zeros(2, dtype=torch.long)])[None]  # padded like the generator's
            seqs = lambda n: torch.zeros(n, dtype=torch.long)  # noqa: E731
            prompt = ext.paged_attention(q, ks, vs, table, seqs(length), torch.arange(length), ps, scale, window,
                                         softcap)  # every row in one call (a prompt chunk)
            drafts = ext.paged_attention(q[-5:], ks, vs, table, seqs(5), torch.arange(length - 5, length), ps, scale,
                                         window, softcap)  # the last five rows (a decode token and four drafts)
            # each row decoding alone: the one-call step's op, writing its own key and value first
            kv = [(keys[None, :, p].contiguous(), values[None, :, p].contiguous()) for p in range(length)]
            alone = torch.stack([ext.paged_step_attention(q[p : p + 1], *kv[p], ks, vs, table, torch.tensor([p + 1]),
                                                          ps, scale, window, softcap)[0] for p in range(length)])
            # beside another sequence of the same store (its pages reversed), both in one call
            both = torch.cat([table, torch.arange(n_pages - 1, n_pages - 9, -1)[None]])
            batched = ext.paged_attention(torch.cat([q[-3:], q[:4]]), ks, vs, both,
                                          torch.tensor([0, 0, 0, 1, 1, 1, 1]),
                                          torch.tensor([length - 3, length - 2, length - 1, 2, 9, 30, 31]), ps, scale,
                                          window, softcap)
            assert torch.equal(drafts, prompt[-5:]) and torch.equal(alone, prompt), isa
            assert torch.equal(batched[:3], prompt[-3:]), isa
            close(prompt, want, 3e-6)
            results.append(prompt)
        assert torch.equal(results[0], results[1]), isa  # consecutive vs scattered pages
        # a contiguous cache ([layers, batch, kv_heads, max_len, head_dim]): prompt in one call, then row by row
        kc, vc = torch.zeros(1, 1, hk, 32, d), torch.zeros(1, 1, hk, 32, d)
        k4, v4 = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # [1, T, Hk, D]
        cont = ext.decode_attention(q[None, :-4], k4[:, :-4], v4[:, :-4], kc, vc, 0, 0, scale, window, softcap, isa)
        rest = [ext.decode_attention(q[None, p : p + 1], k4[:, p : p + 1], v4[:, p : p + 1], kc, vc, 0, p, scale,
                                     window, softcap, isa) for p in range(length - 4, length)]
        assert torch.equal(torch.cat([cont, *rest], 1)[0], results[0]), isa


@pytest.mark.parametrize("d,hq,hk,window,softcap", [(64, 9, 3, 0, 0.0), (128, 4, 2, 6, 0.0), (40, 6, 2, 0, 30.0),
                                                    (24, 8, 2, 0, 0.0)])
def test_float16_store_gives_the_bits_of_its_values_in_float32(ext, monkeypatch, d, hq, hk, window, softcap):
    """A float16 cache store: attention converts its keys and values exactly, so on every ISA table it gives the
    bits a float32 store holding the same (fp16-rounded) values gives, prompt rows and decode steps alike; the step
    op stores the new key and value rounded to nearest, as Tensor.half() does."""
    ps, n_pages, length, scale = 4, 16, 23, d**-0.5
    table = torch.cat([torch.randperm(n_pages, generator=g(1))[:7], torch.zeros(1, dtype=torch.long)])[None]
    ks16 = torch.randn(hk, n_pages * ps, d, generator=g(2)).half()
    vs16 = torch.randn(hk, n_pages * ps, d, generator=g(3)).half()
    sub = torch.tensor([3e-6, -5.9e-8, 6e-5, -1e-5]).half()  # fp16 subnormals (and one just below the normals)
    ks16.view(-1)[::7] = sub.repeat(ks16.numel() // 28 + 1)[: ks16.view(-1)[::7].numel()]
    vs16.view(-1)[3::5] = sub.flip(0).repeat(vs16.numel() // 20 + 1)[: vs16.view(-1)[3::5].numel()]
    q = torch.randn(length, hq, d, generator=g(4)) * 2
    k, v = torch.randn(1, hk, d, generator=g(5)) * 3, torch.randn(1, hk, d, generator=g(6))
    seqs, pos = torch.zeros(length, dtype=torch.long), torch.arange(length)
    slot = int(table[0, length // ps]) * ps + length % ps  # where the step's new token goes
    for isa in ext.isa_names():
        monkeypatch.setenv("EXL_CPU_ISA", isa)
        got = ext.paged_attention(q, ks16, vs16, table, seqs, pos, ps, scale, window, softcap)
        want = ext.paged_attention(q, ks16.float(), vs16.float(), table, seqs, pos, ps, scale, window, softcap)
        assert torch.equal(got, want), isa
        a16, b16, a32, b32 = ks16.clone(), vs16.clone(), ks16.float(), vs16.float()
        got = ext.paged_step_attention(q[:1], k, v, a16, b16, table, torch.tensor([length + 1]), ps, scale, window,
                                       softcap)
        want = ext.paged_step_attention(q[:1], k.half().float(), v.half().float(), a32, b32, table,
                                        torch.tensor([length + 1]), ps, scale, window, softcap)
        assert torch.equal(got, want), isa
        assert torch.equal(a16[:, slot], k[0].half()) and torch.equal(b16[:, slot], v[0].half()), isa
        assert torch.equal(a16.float(), a32) and torch.equal(b16.float(), b32), isa
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        ext.paged_attention(q, ks16, vs16.float(), table, seqs, pos, ps, scale, window, softcap)


@pytest.mark.parametrize("d,hq,hk,n,window,softcap", [(64, 9, 3, 1203, 0, 0.0), (128, 8, 2, 1100, 0, 30.0),
                                                      (64, 9, 3, 2000, 1030, 0.0)])
def test_a_long_rows_attention_shared_by_the_threads_keeps_its_bits(ext, monkeypatch, d, hq, hk, n, window, softcap):
    """One decode row over a long context, with fewer tiles than twice the threads: the threads share its scores
    (key ranges), softmax (lanes) and output (column halves). On every ISA table, float32 and float16 stores, the
    row gives the bits it gives when it shares the call with another sequence's row (one tile per thread), and
    agrees with the float64 reference."""
    ps, scale = 16, d**-0.5
    pages = (n + 1 + ps - 1) // ps
    table = torch.randperm(2 * pages, generator=g(1))[None, :pages]
    store = [torch.randn(hk, 2 * pages * ps, d, generator=g(2)), torch.randn(hk, 2 * pages * ps, d, generator=g(3))]
    q = torch.randn(1, hq, d, generator=g(4)) * 2
    k, v = torch.randn(1, hk, d, generator=g(5)), torch.randn(1, hk, d, generator=g(6))
    other = torch.randn(1, hq, d, generator=g(7))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for isa in ext.isa_names():
            monkeypatch.setenv("EXL_CPU_ISA", isa)
            for dtype in (torch.float32, torch.float16):
                ks, vs = (t.to(dtype) for t in store)
                before = ext.split_attention_rows()
                alone = ext.paged_step_attention(q, k, v, ks, vs, table, torch.tensor([n]), ps, scale, window,
                                                 softcap)
                assert ext.split_attention_rows() == before + 1, (isa, dtype)  # it took the shared path
                both = ext.paged_attention(torch.cat([q, other]), ks, vs, torch.cat([table, table.flip(1)]),
                                           torch.tensor([0, 1]), torch.tensor([n - 1, n - 1]), ps, scale, window,
                                           softcap)
                assert ext.split_attention_rows() == before + 1, (isa, dtype)  # two rows: one tile per thread
                assert torch.equal(alone[0], both[0]), (isa, dtype)
                want, _, _ = reference_paged_attention(q, k.to(dtype).float(), v.to(dtype).float(),
                                                       store[0].to(dtype).float(), store[1].to(dtype).float(), table,
                                                       torch.tensor([n]), ps, scale, window, softcap)
                close(alone, want, 1e-5)
    finally:
        torch.set_num_threads(threads)


def test_paged_attention_rejects_bad_rows(ext):
    ks, q = torch.zeros(2, 16, 8), torch.zeros(2, 2, 8)
    pages = torch.tensor([[0, 1]])
    with pytest.raises(RuntimeError, match="sequence 1, out of range"):
        ext.paged_attention(q, ks, ks, pages, torch.tensor([0, 1]), torch.tensor([0, 1]), 4, 1.0)
    with pytest.raises(RuntimeError, match="position 8, sequence 0's page table holds"):
        ext.paged_attention(q, ks, ks, pages, torch.tensor([0, 0]), torch.tensor([0, 8]), 4, 1.0)
    with pytest.raises(RuntimeError, match="page 1 is 7"):
        ext.paged_attention(q, ks, ks, torch.tensor([[0, 7]]), torch.tensor([0, 0]), torch.tensor([0, 5]), 4, 1.0)
    with pytest.raises(RuntimeError, match="one per query row"):
        ext.paged_attention(q, ks, ks, pages, torch.tensor([0]), torch.tensor([0, 1]), 4, 1.0)


# -- whole models -------------------------------------------------------------------------------------------------------

FAMILIES = ["llama", "llama-tied-bias", "llama-rope-dynamic", "mistral-window", "qwen2-window", "qwen3", "gemma3",
            "gemma3-pattern", "mixtral", "qwen3-moe", "qwen2-moe-shared"]


def quantize_randomly(model):
    """Swap every dense linear of the blocks that the format can hold (inputs in groups of 32) for a random
    4-bit QuantLinear (act-order, both rotations); the others stay dense (a mixed model)."""
    from test_kernels import random_layer

    from exl.format import Segment
    from exl.modules.quant_linear import QuantLinear

    seed = 0
    for block in model.layers:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is Linear and child.in_features % 32 == 0 and child.out_features >= 8:
                    n, k = child.weight.shape
                    setattr(parent, name, QuantLinear(random_layer(n, [Segment(k, 4, 32)], bias=False, seed=seed)))
                    seed += 1
    model._step = None
    return model


def spy_step(model) -> list:
    """Record, per forward pass, whether the one-call step ran."""
    ran, original = [], model.decode_step

    def spy(h, ctx):
        out = original(h, ctx)
        ran.append(out is not None)
        return out

    model.decode_step = spy
    return ran


def decode_logits(model, prompts, steps: int, page_size: int = 4, num_pages: int = 48) -> torch.Tensor:
    """Prefill the prompts together, then decode `steps` given tokens for each: logits [steps, sequences, vocab]."""
    cache = PagedCache(model, num_pages=num_pages, page_size=page_size)
    tables = [cache.open(p, len(p) + steps) for p in prompts]
    # interleave the pages of the sequences: grow them a page at a time, in turn
    for t, p in zip(tables, prompts):
        cache.extend(t, len(p))
    ctx = PagedContext(cache, [(t, len(p)) for t, p in zip(tables, prompts)])
    model(torch.tensor([[i for p in prompts for i in p]]), ctx=ctx)
    for t, p in zip(tables, prompts):
        cache.commit(t, p)
    tokens = torch.randint(0, model.config.vocab_size, (steps, len(prompts)), generator=g(9))
    out = []
    for row in tokens:
        for t in tables:
            cache.extend(t, 1)
        ctx = PagedContext(cache, [(t, 1) for t in tables])
        out.append(model(row[None], ctx=ctx)[0])
        for t, tok in zip(tables, row.tolist()):
            cache.commit(t, [tok], share=False)
    return torch.stack(out)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "quant"])
@pytest.mark.parametrize("name", FAMILIES)
def test_decode_step_matches_module_path(tmp_path, ext, name, quantized):
    from test_models import BASE, make_model

    _, path = make_model(tmp_path, name)
    model = exl.load_model(path, progress=False)
    if quantized:
        quantize_randomly(model)
    ids = torch.randint(0, BASE["vocab_size"], (40,), generator=g(5)).tolist()
    for prompts in ([ids[:6]], [ids[:6], ids[6:17], ids[17:19]]):  # one sequence; three of different lengths
        ran = spy_step(model)
        got = decode_logits(model, prompts, steps=7)
        assert ran == [False] + [True] * 7  # the prefill ran block by block, every decode step in one call
        del model.decode_step
        model._step = False  # block by block on the fused ops
        fused_path = decode_logits(model, prompts, steps=7)
        model._step = None
        assert torch.equal(got, fused_path)  # the same kernels and ops in the same order
        if quantized:  # int8 activations round differently on the reference's inputs: compare in fp32
            set_exact(model, True)
            got = decode_logits(model, prompts, steps=7)
        with fused.disabled():  # the plain-PyTorch reference
            reference = decode_logits(model, prompts, steps=7)
        close(got, reference, 1e-4)
        set_exact(model, False)


def set_exact(model, exact: bool):
    from exl.modules.quant_linear import QuantLinear

    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.exact = exact
            m.gemm_min_rows = 8 if exact else 17
    model._step = None


def test_decode_step_steps_aside(tmp_path, ext):
    """Hooks, prompt chunks and drafts run block by block; a quantized KV cache is not the step's."""
    from test_models import make_model

    _, path = make_model(tmp_path, "llama")
    model = exl.load_model(path, progress=False)
    seen = []
    handle = model.layers[1].mlp.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    ran = spy_step(model)
    decode_logits(model, [[1, 2, 3]], steps=2)
    assert ran == [False, False, False] and len(seen) == 3
    handle.remove()
    ran.clear()
    decode_logits(model, [[1, 2, 3]], steps=2)
    assert ran == [False, True, True]
    cache = PagedCache(model, num_pages=8, page_size=4, k_bits=8, v_bits=8)
    t = cache.open([1, 2], 8)
    cache.extend(t, 2)
    ran.clear()
    model(torch.tensor([[1, 2]]), ctx=PagedContext(cache, [(t, 2)]))
    cache.commit(t, [1, 2])
    cache.extend(t, 1)
    model(torch.tensor([[3]]), ctx=PagedContext(cache, [(t, 1)]))
    assert ran == [False, False]


def test_decode_step_on_smollm2(smollm_dir, ext):
    """The real SmolLM2-135M: the one-call step gives the module path's logits for three concurrent sequences."""
    model = exl.load_model(smollm_dir, progress=False)
    prompts = [list(range(100, 113)), list(range(300, 305)), list(range(700, 740))]
    ran = spy_step(model)
    got = decode_logits(model, prompts, steps=4, page_size=16)
    assert ran[1:] == [True] * 4
    del model.decode_step
    model._step = False
    want = decode_logits(model, prompts, steps=4, page_size=16)
    assert torch.equal(got, want)


def test_decode_step_shares_a_long_rows_attention_on_smollm2(smollm_dir, ext):
    """One sequence past 1,024 positions on 2 threads: inside the one-call step (a thread team) each layer's
    attention row is shared by the threads, and the logits are the module path's bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = exl.load_model(smollm_dir, progress=False)
        prompt = torch.randint(0, 49152, (1100,), generator=g(8)).tolist()
        ran = spy_step(model)
        before = ext.split_attention_rows()
        got = decode_logits(model, [prompt], steps=2, page_size=16, num_pages=80)
        assert ran[1:] == [True] * 2
        assert ext.split_attention_rows() - before == 2 * model.config.num_layers
        del model.decode_step
        model._step = False
        want = decode_logits(model, [prompt], steps=2, page_size=16, num_pages=80)
        assert torch.equal(got, want)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["default", "yarn", "llama3"])
def test_rope_rows_from_the_table_equal_the_computed_ones(kind):
    """Decode steps take cos/sin rows from a cached table (grown on demand): the same values as computing them."""
    from exl.config import RopeConfig
    from exl.modules.rope import RotaryEmbedding

    cfg = RopeConfig(type=kind, factor=4.0, original_max_position_embeddings=16) if kind != "default" else RopeConfig()
    rope = RotaryEmbedding(cfg, 64, 4096)
    for pos in ([[0, 5, 1023]], [[1024, 3000, 4095]]):  # the second grows the table
        pos = torch.tensor(pos)
        got = rope.cos_sin(pos, torch.float32)
        want = RotaryEmbedding(cfg, 64, 4096).cos_sin(torch.cat([pos, torch.zeros(1, 70, dtype=torch.long)], 1),
                                                      torch.float32)  # 73 positions: computed
        assert torch.equal(got[0], want[0][:, :3]) and torch.equal(got[1], want[1][:, :3])
