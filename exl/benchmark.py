"""llama-bench-style speed measurement: pp (prompt processing) and tg (token generation) tokens/s.

pp N: one forward pass of N tokens into an empty cache (logits for the last token only).
tg N: N single-token forward passes, one after another, from an empty cache.
Each test runs once as warm-up, then `reps` times; results are mean ± std over the timed runs.
"""

from __future__ import annotations

import resource
import statistics
import time

import torch

from exl.cache.contiguous import KVCache


def _tokens(model, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, model.config.vocab_size, (1, n), generator=g).to(model.device)


def _sync(model):
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def time_prompt(model, n: int) -> float:
    cache = KVCache(model.config, 1, n, model.dtype, model.device)
    ids = _tokens(model, n)
    _sync(model)
    t = time.perf_counter()
    model(ids, cache=cache, last_only=True)
    _sync(model)
    return n / (time.perf_counter() - t)


def time_generation(model, n: int) -> float:
    cache = KVCache(model.config, 1, n + 1, model.dtype, model.device)
    ids = _tokens(model, n)
    _sync(model)
    t = time.perf_counter()
    for i in range(n):
        model(ids[:, i : i + 1], cache=cache)
    _sync(model)
    return n / (time.perf_counter() - t)


def model_bits_per_weight(model) -> float:
    q = model.config.quantization or {}
    if "measured_bpw" in q:
        return float(q["measured_bpw"])
    return torch.finfo(model.dtype).bits


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(model, pp: int = 512, tg: int = 128, reps: int = 3, progress=None) -> dict:
    """{'pp512': mean tok/s, 'pp512_std', 'tg128', 'tg128_std', 'bpw', 'peak_rss_mib', 'threads'}"""
    out = {}
    for name, fn, n in ((f"pp{pp}", time_prompt, pp), (f"tg{tg}", time_generation, tg)):
        if n <= 0:
            continue
        fn(model, n)  # warm-up
        runs = []
        for _ in range(reps):
            runs.append(fn(model, n))
            if progress:
                progress(name, runs[-1])
        out[name] = statistics.mean(runs)
        out[f"{name}_std"] = statistics.stdev(runs) if len(runs) > 1 else 0.0
    out.update(bpw=model_bits_per_weight(model), peak_rss_mib=peak_rss_mib(), threads=torch.get_num_threads())
    return out
