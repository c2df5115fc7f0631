"""One runtime: exl.simple, the Generator, `exl generate`, `exl chat`, `exl bench` and `exl serve` all run the
dynamic generator over a paged cache, with one sampler, so one seed gives the same tokens through every door.

The real SmolLM2 (fp32), one thread everywhere (the thread count changes the order of sums in the matmuls).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

import exl
from exl.generator import Generator, Job, PagedCache, SamplerSettings
from exl.simple import Stats, generate, make_generator
from exl.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time, in a small village by the sea,"
SEED = 1234
TEMPERATURE, TOP_P, TOP_K = 1.1, 0.95, 60  # non-greedy: the seed decides
N = 20


@pytest.fixture(scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def smol(smollm_dir, one_thread):
    return exl.load_model(smollm_dir, progress=False), Tokenizer.from_dir(smollm_dir)


def run_cli(*args, stdin: str | None = None, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "exl.cli", *map(str, args)], input=stdin, capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=REPO)


def test_same_seed_same_tokens_on_every_door(smol, smollm_dir, tmp_path, monkeypatch):
    from test_server_utils import Server, link_model

    model, tok = smol
    # exl.simple
    stats = Stats()
    simple = generate(model, tok, PROMPT, N, temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, seed=SEED,
                      stats=stats)
    tokens = stats.token_ids
    assert len(tokens) >= 5 and simple == tok.decode(tokens)
    # the Generator, as docs/generator.md shows it
    gen = Generator(model, PagedCache(model, max_tokens=1024), tok)
    job = Job(tok.encode(PROMPT), max_new_tokens=N, seed=SEED,
              sampler=SamplerSettings(temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K))
    gen.enqueue(job)
    while gen.has_work():
        gen.iterate()
    assert job.text == simple and job.generated[: len(tokens)] == tokens
    # a different seed gives other tokens (the test can fail)
    assert generate(model, tok, PROMPT, N, temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, seed=SEED + 1) != simple
    # `exl generate`
    out = run_cli("generate", "-m", smollm_dir, "-p", PROMPT, "--max-new-tokens", N, "--temperature", TEMPERATURE,
                  "--top-p", TOP_P, "--top-k", TOP_K, "--seed", SEED)
    assert out.returncode == 0, out.stderr
    assert out.stdout == simple + "\n"
    # `exl serve`: a completion with the same seed
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    link_model(smollm_dir, tmp_path / "models" / "smol")
    server = Server(tmp_path / "models", "smol", tmp_path, ["--max-seq-len", "512", "--cache-size", "1024"])
    try:
        server.wait_ready()
        r = httpx.post(server.url + "/v1/completions", headers=server.headers(), timeout=300, json=dict(
            model="smol", prompt=PROMPT, max_tokens=N, temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K, seed=SEED,
            return_token_ids=True))
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
    finally:
        server.stop()
    assert choice["text"] == simple
    assert choice["token_ids"][: len(tokens)] == tokens


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_chat_reuses_the_conversation_pages(smol):
    """The second turn's prefill covers only what is new: the cache holds turn 1's prompt and reply."""
    from argparse import Namespace
    from io import StringIO

    from exl.commands.chat import chat_turn

    model, tok = smol
    gen = make_generator(model, tok, 2048)
    args = Namespace(max_new_tokens=24, temperature=0.0, top_k=0, top_p=1.0, seed=None)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids1 = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_bos=False)
    reply, s1 = chat_turn(gen, messages, args, out=StringIO())
    assert s1.cached_tokens == 0 and s1.prefilled_tokens == len(ids1) and reply
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the capital of Italy?"}]
    ids2 = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_bos=False)
    prefill_before = gen.stats["prefill_tokens"]
    _, s2 = chat_turn(gen, messages, args, out=StringIO())
    # what the cache held after turn 1: its prompt and every generated token but the last (never fed back)
    held = ids1 + s1.token_ids[: len(s1.token_ids) - (s1.stop_reason == "max_new_tokens")]
    assert s2.prompt_tokens == len(ids2)
    assert s2.cached_tokens == min(lcp(ids2, held), len(ids2) - 1)
    assert gen.stats["prefill_tokens"] - prefill_before == s2.prefilled_tokens
    # the reply came back as the same tokens, so only the new message and the template around it are computed
    assert s2.cached_tokens >= len(ids1) + len(s1.token_ids) - 1
    new = tok.encode("And the capital of Italy?", add_bos=False)
    assert s2.prefilled_tokens <= len(new) + 12, (s2.prefilled_tokens, len(ids2))


def test_chat_cli_exit_and_eof(smollm_dir):
    out = run_cli("chat", "-m", smollm_dir, "--max-new-tokens", 6, stdin="Hello!\nHow are you?\n/exit\nNot read.\n")
    assert out.returncode == 0, out.stderr
    turns = [line for line in out.stderr.splitlines() if line.startswith("[") and "from the cache" in line]
    assert len(turns) == 2, out.stderr  # /exit ended the chat before the third line
    cached = [int(line.split(", ")[-1].split()[0]) for line in turns]
    assert cached[0] == 0 and cached[1] > 10, turns
    out = run_cli("chat", "-m", smollm_dir, "--max-new-tokens", 4, stdin="Hello!\n")  # EOF ends it
    assert out.returncode == 0 and out.stderr.count("from the cache") == 1, out.stderr


def test_bench_runs_through_the_generator(smol, monkeypatch):
    from exl import benchmark

    model, _ = smol
    jobs = []
    real = Generator.enqueue
    monkeypatch.setattr(Generator, "enqueue", lambda self, job: (jobs.append(job), real(self, job))[1])
    r = benchmark.run(model, pp=32, tg=8, reps=2)
    assert set(r) >= {"pp32", "pp32_std", "tg8", "tg8_std", "bpw", "peak_rss_mib", "threads"}
    assert r["pp32"] > 0 and r["tg8"] > 0 and r["bpw"] == 32
    # warm-up + 2 runs per test: 32-token prompts for pp; one-token prompts decoding 8 steps for tg
    assert [len(j.input_ids) for j in jobs] == [32] * 3 + [1] * 3
    assert all(len(j.generated) == 1 for j in jobs[:3]) and all(len(j.generated) == 9 for j in jobs[3:])


def test_auto_cache_is_fp16_on_the_cpu_and_the_model_dtype_elsewhere(smol):
    """Cache mode "auto", every door's default: fp16 stores for a CPU model (which the C++ attention and the one-call
    decode read in place), the model's dtype (None) on other devices or without a device."""
    from exl.cache.paged import PagedContext, cache_bits

    model, tok = smol
    assert cache_bits("auto", "cpu") == (16, 16) and cache_bits("auto", torch.device("cpu")) == (16, 16)
    assert cache_bits("auto", "cuda") == (None, None) and cache_bits("auto") == (None, None)
    assert cache_bits("fp32", "cpu") == (32, 32)
    gen = make_generator(model, tok, 512)
    assert gen.cache.k.data.dtype == torch.float16 and gen.cache.v.data.dtype == torch.float16
    table = gen.cache.open([5, 6, 7], max_tokens=8)
    gen.cache.extend(table, 1)
    assert PagedContext(gen.cache, [(table, 1)]).decode_batch() is not None  # the one-call decode serves it
    gen.cache.close(table)


def test_bench_depth_decodes_after_a_long_prompt(smol, smollm_dir, monkeypatch):
    """tg at depth D (llama-bench -d): the decode test's jobs bring a D-token prompt; the CLI names it tgN@dD and
    refuses a depth past the model's context."""
    from exl import benchmark

    model, _ = smol
    jobs = []
    real = Generator.enqueue
    monkeypatch.setattr(Generator, "enqueue", lambda self, job: (jobs.append(job), real(self, job))[1])
    r = benchmark.run(model, pp=0, tg=4, reps=1, depth=300)
    assert r["tg4@d300"] > 0 and "tg4" not in r
    assert [len(j.input_ids) for j in jobs] == [300, 300] and all(len(j.generated) == 5 for j in jobs)
    for mode in ("auto", "fp32"):
        out = run_cli("bench", "-m", smollm_dir, "-p", 0, "-n", 4, "-d", 64, "-r", 1, "-t", 1, "--cache-mode", mode)
        assert out.returncode == 0 and "| tg4@d64 |" in out.stdout, out.stderr
    out = run_cli("bench", "-m", smollm_dir, "-p", 0, "-n", 4, "-d", 10**6, "-r", 1, "-t", 1)
    assert out.returncode != 0 and "exceeds the model's context" in out.stderr


def test_bench_cli_json(smollm_dir):
    out = run_cli("bench", "-m", smollm_dir, "-p", 16, "-n", 4, "-r", 1, "-t", 1, "--json")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "| model | bpw | threads | test | tok/s |"
    assert any("| pp16 |" in x and " ± " in x for x in lines) and any("| tg4 |" in x for x in lines)
    result = json.loads(lines[-1])
    assert result["threads"] == 1 and result["pp16"] > 0 and result["tg4"] > 0


def test_no_door_uses_the_contiguous_cache():
    """Generation is the generator's: nothing user-facing builds the contiguous KVCache."""
    doors = ["exl/simple.py", "exl/benchmark.py", "exl/demo.py", "bench/vs_llamacpp.py", "bench/quality.py",
             *[str(p.relative_to(REPO)) for p in (REPO / "exl" / "commands").glob("*.py")],
             *[str(p.relative_to(REPO)) for p in (REPO / "exl" / "server").glob("*.py")]]
    for name in doors:
        text = (REPO / name).read_text()
        assert "KVCache" not in text and "cache.contiguous" not in text, name
        assert "def sample(" not in text, f"{name} has its own sampler"


def test_simple_stops_at_the_context_and_frees_pages_when_abandoned(smol, tmp_path):
    from test_models import make_model

    from exl.simple import stream

    _, path = make_model(tmp_path, "llama")  # max_position_embeddings 64, no tokenizer
    tiny = exl.load_model(path, progress=False)
    stats = Stats()
    assert list(stream(tiny, None, list(range(1, 61)), 10, stats=stats)) == []
    assert stats.stop_reason == "context_full" and stats.new_tokens == 4 and len(stats.token_ids) == 4
    with pytest.raises(ValueError, match="fills the model's context"):
        list(stream(tiny, None, list(range(1, 65)), 10))
    # a caller that stops reading mid-way: the job is cancelled and its pages freed at once
    model, tok = smol
    gen = make_generator(model, tok, 512)
    for _ in stream(model, tok, tok.encode(PROMPT), 50, generator=gen):
        assert gen.cache.pages_in_use > 0
        break
    assert gen.cache.pages_in_use == 0 and not gen.num_running
