"""llama-bench-style speed measurement through the generator: pp (prompt processing) and tg (token
generation) tokens/s.

Both tests run jobs on the dynamic Generator over a PagedCache, the same path as every other door
(exl.simple, `exl generate`/`chat`, `exl serve`):
pp N: the prefill of one job with an N-token prompt (random tokens, nothing cached): N / its time to first token.
tg N: the decode rate of one job, greedy, from a 1-token prompt: N decode steps / their time (sampling included).
tg N @ dD (depth D, as llama-bench's -d): the same after a D-token prompt, so every step attends over D+ positions.
Each test runs once as warm-up, then `reps` times; results are mean ± std over the timed runs.
"""

from __future__ import annotations

import resource
import statistics

import torch

from exl.generator import Job, SamplerSettings


def _tokens(model, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, model.config.vocab_size, (n,), generator=g).tolist()


def _run(gen, ids: list[int], new: int):
    """One greedy job to the end (EOS ignored); its final event."""
    cache = gen.cache
    cache.clear()  # no prefix from an earlier run
    job = Job(ids, max_new_tokens=new, sampler=SamplerSettings.greedy(), ignore_eos=True)
    gen.enqueue(job)
    while True:
        for ev in gen.iterate():
            if ev.eos:
                if ev.eos_reason != "max_new_tokens":
                    raise RuntimeError(f"benchmark job ended early: {ev.eos_reason} {ev.error or ''}")
                return ev


def time_prompt(gen, n: int, seed: int = 0) -> float:
    """Prompt tokens/s of one n-token prefill."""
    ev = _run(gen, _tokens(gen.model, n, seed), 1)
    return n / ev.time_to_first_token


def time_generation(gen, n: int, seed: int = 0, depth: int = 0) -> float:
    """Decode tokens/s of one job over n decode steps, after a prompt of `depth` tokens (at least 1)."""
    ev = _run(gen, _tokens(gen.model, max(depth, 1), seed), n + 1)  # the first token comes from the prefill
    return ev.tokens_per_second


def make_generator(model, pp: int, tg: int, depth: int = 0, cache_mode: str = "auto"):
    """One job at a time, a cache for the longer test, prompts in one chunk (up to 2,048 tokens)."""
    from exl.simple import make_generator as make

    return make(model, None, max(pp, depth + tg + 1, 1), max_chunk_size=min(max(pp, depth, 1), 2048),
                cache_mode=cache_mode)


def model_bits_per_weight(model) -> float:
    q = model.config.quantization or {}
    if "measured_bpw" in q:
        return float(q["measured_bpw"])
    return torch.finfo(model.dtype).bits


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(model, pp: int = 512, tg: int = 128, reps: int = 3, progress=None, depth: int = 0,
        cache_mode: str = "auto") -> dict:
    """{'pp512': mean tok/s, 'pp512_std', 'tg128', 'tg128_std', 'bpw', 'peak_rss_mib', 'threads'}; with depth > 0
    the decode test is 'tg128@d1024' (its prompt `depth` tokens long). cache_mode: the KV cache's (exl.simple)."""
    gen = make_generator(model, pp, tg, depth, cache_mode)
    out = {}
    tg_name = f"tg{tg}@d{depth}" if depth > 0 else f"tg{tg}"
    decode = lambda gen, n, seed: time_generation(gen, n, seed, depth)  # noqa: E731
    for name, fn, n in ((f"pp{pp}", time_prompt, pp), (tg_name, decode, tg)):
        if n <= 0:
            continue
        fn(gen, n, seed=0)  # warm-up
        runs = []
        for i in range(reps):
            runs.append(fn(gen, n, seed=i + 1))
            if progress:
                progress(name, runs[-1])
        out[name] = statistics.mean(runs)
        out[f"{name}_std"] = statistics.stdev(runs) if len(runs) > 1 else 0.0
    out.update(bpw=model_bits_per_weight(model), peak_rss_mib=peak_rss_mib(), threads=torch.get_num_threads())
    return out
