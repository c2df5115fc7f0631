"""The serving benchmark's arithmetic (bench/serve.py, bench/serve_vs_llamacpp.py): percentiles, the vLLM
`bench serve` summary, the fixed-length text prompts and the target table. No server is started."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import serve  # noqa: E402
import serve_vs_llamacpp  # noqa: E402


def test_percentile_matches_numpy():
    rng = random.Random(0)
    for n in (1, 2, 7, 100, 1001):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 99.9, 100):
            assert serve.percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12, abs=1e-15)
    assert serve.percentile([], 99) == 0.0


def _result(ttft, gaps, tokens=None, prompt=10, ok=True):
    r = serve.Result(ok=ok, prompt_tokens=prompt, ttft=ttft, itl=list(gaps), finish_reason="length")
    r.output_tokens = len(gaps) + 1 if tokens is None else tokens
    r.latency = ttft + sum(gaps)
    return r


def test_summarize_follows_vllm_definitions():
    a = _result(0.5, [0.1, 0.2, 0.3])  # 4 tokens
    b = _result(1.0, [0.05] * 9)  # 10 tokens
    short = _result(0.2, [0.1], tokens=2)
    failed = serve.Result(ok=False, error="HTTP 500: boom")
    s = serve.summarize([a, b, short, failed], duration=4.0, output_len=4)
    assert s["successful_requests"] == 3 and s["failed_requests"] == 1 and s["errors"] == ["HTTP 500: boom"]
    assert s["total_generated_tokens"] == 16 and s["total_input_tokens"] == 30
    assert s["output_throughput"] == pytest.approx(16 / 4.0) and s["request_throughput"] == pytest.approx(3 / 4.0)
    assert s["short_requests"] == 1  # `short` stopped at 2 of 4 tokens; b's 10 are not short
    # TPOT: time after the first token over the tokens after it, per request
    tpot = [0.6 / 3 * 1000, 0.45 / 9 * 1000, 0.1 / 1 * 1000]
    assert s["mean_tpot_ms"] == pytest.approx(np.mean(tpot)) and s["median_tpot_ms"] == pytest.approx(np.median(tpot))
    # ITL: every gap of every request, pooled
    itl = [x * 1000 for x in [0.1, 0.2, 0.3] + [0.05] * 9 + [0.1]]
    assert s["p99_itl_ms"] == pytest.approx(np.percentile(itl, 99)) and s["mean_itl_ms"] == pytest.approx(np.mean(itl))
    assert s["median_ttft_ms"] == pytest.approx(500.0)
    assert a.decode_rate == pytest.approx(3 / 0.6) and serve.Result(output_tokens=1, latency=1.0).decode_rate is None


def test_text_prompts_have_the_exact_token_count(smollm_dir):
    from exl.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm_dir)
    prompts = serve.text_prompts(str(smollm_dir / "tokenizer.json"), 4, 200, seed=2)
    assert len(set(prompts)) == 4
    assert [len(tok.encode(p)) for p in prompts] == [200] * 4
    assert prompts == serve.text_prompts(str(smollm_dir / "tokenizer.json"), 4, 200, seed=2)
    assert set(prompts).isdisjoint(serve.text_prompts(str(smollm_dir / "tokenizer.json"), 4, 200, seed=3))


def test_target_table_direction_and_verdicts():
    summ = lambda **kw: {"median_ttft_ms": 0.0, "output_throughput": 0.0, **kw}  # noqa: E731
    res = {"plan": {"decode_tokens": 128, "ttft_prompt": 200},
           "decode": {"exl": {"median": 96.0}, "llamacpp": {"median": 80.0}, "exl_bench_tg": {"median": 100.0}},
           "ttft": {"exl": summ(median_ttft_ms=90.0), "llamacpp": summ(median_ttft_ms=100.0)},
           "concurrency": {8: {"exl": summ(output_throughput=250.0), "llamacpp": summ(output_throughput=100.0)},
                           32: {"exl": summ(output_throughput=150.0), "llamacpp": summ(output_throughput=100.0)}}}
    rows, table = serve_vs_llamacpp.targets_table(res, 2)
    got = [(round(r["ratio"], 3), r["met"]) for r in rows]
    assert got == [(0.96, True), (1.2, False), (0.9, True), (2.5, True), (1.5, False)]
    assert table.count("**no**") == 2 and "| 0.90x | ≤ 1x | yes |" in table
    res["ttft"]["exl"]["median_ttft_ms"] = 110.0  # slower first token than llama.cpp: missed
    assert not serve_vs_llamacpp.targets_table(res, 2)[0][2]["met"]
    assert not math.isnan(rows[0]["ratio"])
