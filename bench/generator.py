"""Benchmark the dynamic generator on one model folder (dense or exl-quantized).

    python bench/generator.py -m MODEL_DIR [--json] [--draft DRAFT_DIR] [--threads N] [--quick]

Measures, on this machine:
  batch16_speedup      aggregate decode tokens/s of 16 concurrent jobs / a single job's decode tokens/s
                       (batch16_speedup_cpu: the same per CPU second of this process, steadier on a shared machine)
  prefix_ttft_ratio    time to first token of a job whose 1,500-token prefix is cached / the same job cold
  ngram_speedup        n-gram speculative decode tokens/s / plain decode tokens/s on an input-copying task
  spec_greedy_identical  speculative greedy output == plain greedy output, token for token
  q4_cache_ppl_ratio   perplexity with a Q4 KV cache / with an FP16 KV cache (Python docs text)
  cache_memory_ok      pages in use never exceeded tokens held + one page per sequence
plus perplexity for every cache mode and (with --draft) draft-model acceptance and speed-up.
With --json the last line printed is one JSON object with these keys.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from exl.threads import fix_threads

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import exl  # noqa: E402
from exl.cache.paged import CACHE_MODES, PagedCache, PagedContext, cache_bits  # noqa: E402
from exl.generator import Generator, Job, SamplerSettings  # noqa: E402
from exl.tokenizer import Tokenizer  # noqa: E402

GREEDY = SamplerSettings.greedy()


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def doc_text() -> str:
    """English prose with code: Python's pydoc topics (shipped with CPython)."""
    try:
        from calibration.evaltext import eval_text

        return eval_text()
    except ImportError:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k].strip() for k in sorted(topics))


def decode_rate(gen: Generator, prompts: list[list[int]], new_tokens: int, cpu: bool = False) -> float | tuple:
    """Aggregate tokens/s while every job decodes (prefill excluded): all jobs start, then the clock runs.
    cpu: return (per wall second, per CPU second of this process): on a shared machine the CPU-time rate does not
    count the time other processes held the core."""
    jobs = [Job(p, max_new_tokens=new_tokens, sampler=GREEDY, ignore_eos=True) for p in prompts]
    gen.enqueue(jobs)
    while any(j.status in ("waiting", "prefill") for j in jobs):
        gen.iterate()
    start_tokens = sum(len(j.generated) for j in jobs)
    t0, c0 = time.perf_counter(), time.process_time()
    while any(j.status != "done" for j in jobs):
        gen.iterate()
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    n = sum(len(j.generated) for j in jobs) - start_tokens
    return (n / dt, n / dc) if cpu else n / dt


def memory_check(gen: Generator, prompts: list[list[int]], new_tokens: int) -> float:
    """Run jobs to the end, checking after every step that pages in use <= tokens held + one page per
    sequence. Returns the worst (pages in use * page size) / (tokens held + page size * sequences)."""
    cache = gen.cache
    jobs = [Job(p, max_new_tokens=new_tokens, sampler=GREEDY, ignore_eos=True) for p in prompts]
    gen.enqueue(jobs)
    worst = 0.0
    while gen.has_work():
        gen.iterate()
        tables = [j._run.table for j in gen.running]
        if not tables:
            continue
        held = {}  # page -> tokens it holds (shared pages counted once)
        for t in tables:
            for i, p in enumerate(t.pages):
                held[p] = max(held.get(p, 0), max(0, min(cache.page_size, t.length - i * cache.page_size)))
        bound = sum(held.values()) + cache.page_size * len(tables)
        worst = max(worst, cache.pages_in_use * cache.page_size / bound)
    return worst


def time_to_first_token(gen: Generator, ids: list[int]) -> tuple[float, int]:
    job = Job(ids, max_new_tokens=1, sampler=GREEDY)
    gen.enqueue(job)
    final = None
    while final is None:
        for e in gen.iterate():
            if e.job is job and e.eos:
                final = e
    return final.time_to_first_token, final.cached_tokens


def spec_run(gen: Generator, ids: list[int], new_tokens: int) -> tuple[list[int], float, dict]:
    job = Job(ids, max_new_tokens=new_tokens, sampler=GREEDY, ignore_eos=True)
    gen.enqueue(job)
    while job.status in ("waiting", "prefill"):
        gen.iterate()
    start = len(job.generated)
    t0 = time.perf_counter()
    while job.status != "done":
        gen.iterate()
    return job.generated, (len(job.generated) - start) / (time.perf_counter() - t0), dict(gen.stats)


@torch.inference_mode()
def cache_perplexity(model, tokens: list[int], k_bits, v_bits, ctx: int, windows: int, chunk: int) -> float:
    """Perplexity over `windows` windows of `ctx` tokens, each run through a paged cache in chunks: every
    query attends to keys and values as stored (and read back) in the cache mode."""
    cache = PagedCache(model, max_tokens=ctx, page_size=min(256, ctx), k_bits=k_bits, v_bits=v_bits)
    nll, count = 0.0, 0
    for w in range(windows):
        ids = tokens[w * ctx : (w + 1) * ctx]
        table = cache.open(ids, ctx, announce=False)
        for a in range(0, ctx, chunk):
            part = ids[a : a + chunk]
            cache.extend(table, len(part))
            logits = model(torch.tensor([part]), ctx=PagedContext(cache, [(table, len(part))]))[0]
            cache.commit(table, part, share=False)
            logp = torch.log_softmax(logits.float(), -1)
            targets = ids[a + 1 : a + 1 + len(part)]
            nll -= logp[torch.arange(len(targets)), torch.tensor(targets)].sum().item()
            count += len(targets)
        cache.close(table, share=False)
    return math.exp(nll / count)


def copy_task_prompt(tok: Tokenizer, text: str) -> list[int]:
    msg = ("Correct the spelling in the following text and return the whole text, unchanged otherwise:\n\n"
           + text.replace(" the ", " teh ").replace(" and ", " adn "))
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": msg}]))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True, help="model folder (Hugging Face or exl-quantized)")
    ap.add_argument("--draft", help="draft model folder for draft-model speculative decoding")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: stable on a shared box; 0 = torch's choice)")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--cache-mode", choices=list(CACHE_MODES), default="auto",
                    help="the generators' KV cache (default auto, as the doors: fp16 on the CPU)")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and windows (a smoke run)")
    ap.add_argument("--only", choices=("batching",), help="run only this part (batching: batch16_speedup and the cache "
                                                         "memory check)")
    args = ap.parse_args(argv)
    if args.threads:
        fix_threads(args.threads)
        os.environ["EXL_THREADS"] = str(args.threads)  # asked for: no automatic choice at load
    q = args.quick
    model = exl.load_model(args.model, progress=False)
    tok = Tokenizer.from_dir(args.model)
    text = doc_text()
    doc = tok.encode(text, add_bos=False)
    g = torch.Generator().manual_seed(0)
    res: dict = {"model": str(args.model), "threads": torch.get_num_threads(), "page_size": args.page_size}

    def new_gen(**kw):
        k_bits, v_bits = cache_bits(args.cache_mode, model.device)  # auto: the doors' cache (exl serve, exl.simple)
        cache = PagedCache(model, max_tokens=kw.pop("max_tokens", 16384), page_size=args.page_size, k_bits=k_bits,
                           v_bits=v_bits)
        return Generator(model, cache, tok, **kw)

    # -- batching ------------------------------------------------------------------------------------------------
    n_new = 16 if q else 48
    starts = torch.randint(0, len(doc) - 200, (16,), generator=g).tolist()
    prompts = [doc[s : s + 64] for s in starts]
    gen = new_gen(max_batch_size=16)
    decode_rate(gen, prompts[:1], 4)  # warm-up
    singles, batches = [], []
    for r in range(2):  # interleaved, so that load from other processes hits both alike
        singles += [decode_rate(gen, prompts[i : i + 1], n_new, cpu=True) for i in (2 * r, 2 * r + 1)]
        batches.append(decode_rate(gen, prompts, n_new, cpu=True))
    single, batch = statistics.median(s[0] for s in singles), statistics.median(b[0] for b in batches)
    single_c, batch_c = max(s[1] for s in singles), max(b[1] for b in batches)  # CPU time: best is least disturbed
    res.update(single_decode_tps=round(single, 2), batch16_decode_tps=round(batch, 2),
               batch16_speedup=round(batch / single, 2), single_decode_tps_cpu=round(single_c, 2),
               batch16_decode_tps_cpu=round(batch_c, 2), batch16_speedup_cpu=round(batch_c / single_c, 2))
    log(f"decode: 1 job {single:.1f} tok/s, 16 jobs {batch:.1f} tok/s -> x{batch / single:.2f} "
        f"(per CPU second: {single_c:.1f}, {batch_c:.1f} -> x{batch_c / single_c:.2f})")
    mem_gen = Generator(model, PagedCache(model, max_tokens=8192, page_size=16), tok, max_batch_size=16)
    worst = memory_check(mem_gen, [doc[s : s + 20 + 7 * i] for i, s in enumerate(starts)], 12 if q else 40)
    res.update(cache_memory_ratio=round(worst, 3), cache_memory_ok=worst <= 1.0)
    log(f"cache memory: worst in-use / (held + one page per sequence) = {worst:.3f}")
    if args.only == "batching":
        return report(res, args.json)

    # -- prefix reuse ----------------------------------------------------------------------------------------------
    prefix = doc[5000:6500]
    question = tok.encode("\n\nQuestion: what is this text about? Answer:", add_bos=False)
    gen = new_gen(max_batch_size=4)
    cold = []
    for i in range(1 if q else 2):
        gen.cache.clear()
        t, cached = time_to_first_token(gen, prefix + question)
        assert cached == 0
        cold.append(t)
    warm = []
    for i in range(3):
        t, cached = time_to_first_token(gen, prefix + question)  # the prefix (and more) is now cached
        warm.append(t)
    other_q = tok.encode("\n\nQuestion: who would read this? Answer:", add_bos=False)
    t_other, cached_other = time_to_first_token(gen, prefix + other_q)
    res.update(ttft_cold_s=round(min(cold), 4), ttft_cached_s=round(statistics.median(warm), 4),
               prefix_ttft_ratio=round(statistics.median(warm) / min(cold), 4),
               ttft_other_question_s=round(t_other, 4), other_question_cached_tokens=cached_other)
    log(f"TTFT: cold {min(cold) * 1e3:.0f} ms, prefix cached {statistics.median(warm) * 1e3:.0f} ms "
        f"(ratio {res['prefix_ttft_ratio']:.3f}); new question after the same prefix {t_other * 1e3:.0f} ms "
        f"({cached_other} tokens reused)")

    # -- speculative decoding --------------------------------------------------------------------------------------
    para = text[text.index("The \"if\" statement"):][:900] if "The \"if\" statement" in text else text[:900]
    ids = copy_task_prompt(tok, para)
    n_spec = 48 if q else 160
    plain_t, ngram_t = [], []
    for r in range(1 if q else 2):  # interleaved runs
        plain_ids, tps, _ = spec_run(new_gen(), ids, n_spec)
        plain_t.append(tps)
        ngen = new_gen(ngram_draft=True, num_draft_tokens=6)
        ngram_ids, tps, st = spec_run(ngen, ids, n_spec)
        ngram_t.append(tps)
    plain_tps, ngram_tps = statistics.median(plain_t), statistics.median(ngram_t)
    identical = ngram_ids == plain_ids
    res.update(plain_decode_tps=round(plain_tps, 2), ngram_decode_tps=round(ngram_tps, 2),
               ngram_speedup=round(ngram_tps / plain_tps, 2),
               ngram_acceptance=round(st["accepted"] / max(1, st["drafted"]), 3),
               ngram_tokens_per_forward=round(n_spec / max(1, st["forward_passes"] - 1), 2))
    log(f"n-gram speculation: {plain_tps:.1f} -> {ngram_tps:.1f} tok/s (x{ngram_tps / plain_tps:.2f}), "
        f"acceptance {res['ngram_acceptance']:.2f}, identical greedy output: {identical}")
    if args.draft:
        draft = exl.load_model(args.draft, progress=False)
        dgen = new_gen(draft_model=draft, num_draft_tokens=4)
        draft_ids, draft_tps, st = spec_run(dgen, ids, n_spec)
        identical = identical and draft_ids == plain_ids
        res.update(draft_decode_tps=round(draft_tps, 2), draft_speedup=round(draft_tps / plain_tps, 2),
                   draft_acceptance=round(st["accepted"] / max(1, st["drafted"]), 3),
                   draft_identical=draft_ids == plain_ids)
        log(f"draft-model speculation: {plain_tps:.1f} -> {draft_tps:.1f} tok/s (x{draft_tps / plain_tps:.2f}), "
            f"acceptance {res['draft_acceptance']:.2f}, identical: {draft_ids == plain_ids}")
    res["spec_greedy_identical"] = identical

    # -- quantized cache perplexity -------------------------------------------------------------------------------
    ctx, windows = (256, 2) if q else (512, 8)
    modes = {"FP32": (32, 32), "FP16": (16, 16), "Q8": (8, 8), "Q6": (6, 6), "Q4": (4, 4), "K8V4": (8, 4)}
    ppl = {}
    for name, (kb, vb) in modes.items():
        ppl[name] = cache_perplexity(model, doc, kb, vb, ctx, windows, chunk=128)
        log(f"cache {name:5s} ppl {ppl[name]:.4f}")
    res["cache_ppl"] = {k: round(v, 4) for k, v in ppl.items()}
    res["q4_cache_ppl_ratio"] = round(ppl["Q4"] / ppl["FP16"], 4)
    log(f"Q4 / FP16 cache perplexity: {res['q4_cache_ppl_ratio']:.4f}")
    return report(res, args.json)


def report(res: dict, as_json: bool) -> dict:
    if as_json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:32s} {v}")
    return res


if __name__ == "__main__":
    main()
