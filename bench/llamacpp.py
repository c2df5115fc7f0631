"""llama.cpp (through llama-cpp-python) as a peer: quantize a GGUF and time it like llama-bench.

Shared by bench/vs_llamacpp.py (speed) and bench/quality.py (quality). Needs the `[bench]` extra.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from pathlib import Path


def _lib():
    try:
        import llama_cpp
    except ImportError as e:  # pragma: no cover - depends on the bench extra
        raise SystemExit("llama-cpp-python is not installed: pip install -e '.[bench]'") from e
    return llama_cpp


GGML_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
              "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20}
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15,
          "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25}


def quantize(src: str | Path, dst: str | Path, ftype: str, embedding="F16", head="Q8_0", threads: int = 2) -> Path:
    """llama_model_quantize src -> dst at `ftype`, token embedding and output head at the given types."""
    lib = _lib()
    params = lib.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = FTYPES[ftype]
    if embedding:
        params.token_embedding_type = GGML_TYPES[embedding]
    if head:
        params.output_tensor_type = GGML_TYPES[head]
    rc = lib.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {ftype} failed ({rc})")
    return Path(dst)


def load(path: str | Path, threads: int = 2, n_ctx: int = 1024, n_batch: int = 512, logits_all: bool = False):
    lib = _lib()
    return lib.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                     n_batch=n_batch, n_ubatch=n_batch, logits_all=logits_all, verbose=False)


def bench(llm, pp: int = 512, tg: int = 128, reps: int = 3, vocab: int = 49152, depth: int = 0) -> dict:
    """pp/tg tokens/s, same definitions as exl.benchmark (one warm-up, then `reps` timed runs); depth > 0: the decode
    test runs after an untimed `depth`-token prompt ('tg128@d1024', as llama-bench -d)."""
    import random

    rng = random.Random(0)
    tokens = [rng.randrange(100, vocab) for _ in range(max(pp, tg + depth))]

    def prompt():
        llm.reset()
        llm._ctx.memory_clear(True) if hasattr(llm._ctx, "memory_clear") else None
        t = time.perf_counter()
        llm.eval(tokens[:pp])
        return pp / (time.perf_counter() - t)

    def generation():
        llm.reset()
        llm._ctx.memory_clear(True) if hasattr(llm._ctx, "memory_clear") else None
        if depth:
            llm.eval(tokens[:depth])
        t = time.perf_counter()
        for tok in tokens[depth : depth + tg]:
            llm.eval([tok])
        return tg / (time.perf_counter() - t)

    out = {}
    for name, fn, n in ((f"pp{pp}", prompt, pp), (f"tg{tg}@d{depth}" if depth else f"tg{tg}", generation, tg)):
        if n <= 0:
            continue
        fn()
        runs = [fn() for _ in range(reps)]
        out[name] = statistics.mean(runs)
        out[f"{name}_std"] = statistics.stdev(runs) if reps > 1 else 0.0
    return out
