"""Serving benchmark for `exl serve` (or any OpenAI-compatible server), reporting like vLLM's
benchmark_serving: request throughput, output tokens/s, TTFT, TPOT, ITL and end-to-end latency
(mean / median / p99).

Each request streams a /v1/completions call whose prompt is `--input-len` random token ids (or, with
`--tokenizer`, a text of that many tokens, for servers that take no token ids) and which generates
exactly `--output-len` tokens (`ignore_eos`, and `min_tokens` for servers without it), greedy, at most
`--max-concurrency` at a time. Afterwards the KV-cache must be empty again (checked through /metrics
on exl), and with `--disconnect-check` a client that drops a stream mid-way must have its pages freed.
bench/serve_vs_llamacpp.py drives `exl serve` and llama-cpp-python's server with these functions. The streaming
client is aiohttp (the `[bench]` extra), as in vLLM's benchmark: it shares the server's cores, and it costs a
third of an httpx client's CPU time per streamed token.

    exl serve --model-dir models --model SmolLM2-135M-Instruct-4.0bpw --api-key K &
    python bench/serve.py --base-url http://127.0.0.1:5000 --api-key K --num-prompts 200 \\
        --max-concurrency 32 --disconnect-check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def decode_rate(self) -> float | None:
        """Tokens/s after the first one (the definition of exl.benchmark's tg), None for < 2 tokens."""
        if self.output_tokens < 2 or self.latency <= self.ttft:
            return None
        return (self.output_tokens - 1) / (self.latency - self.ttft)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low = min(1000, vocab // 4)  # skip the special and byte tokens at the start of most vocabularies
    return [[rng.randrange(low, vocab) for _ in range(length)] for _ in range(n)]


def text_prompts(tokenizer_file: str, n: int, length: int, seed: int) -> list[str]:
    """n texts of random words that `tokenizer_file` (a tokenizer.json) encodes to exactly `length` tokens.

    For servers that take only text prompts (llama-cpp-python's): the words are single vocabulary
    tokens (a space and 2+ ASCII letters), so the text encodes back to the sampled tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    words = []
    for i in range(tok.get_vocab_size()):
        w = tok.decode([i])
        if len(w) > 2 and w[0] == " " and w[1:].isascii() and w[1:].isalpha():
            words.append(w)
    if not words:
        raise ValueError(f"{tokenizer_file}: no vocabulary entry is a space + letters; use token-id prompts")
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        for _ in range(100):
            text = "".join(rng.choice(words) for _ in range(length))
            if len(tok.encode(text, add_special_tokens=False).ids) == length:
                out.append(text)
                break
        else:
            raise ValueError(f"{tokenizer_file}: could not build a {length}-token text prompt")
    return out


def request_body(model: str, prompt: list[int] | str, output_len: int) -> dict:
    """A streamed greedy completion of exactly `output_len` tokens, understood by exl and llama.cpp alike:
    `ignore_eos` (exl, vLLM) or `min_tokens` (llama-cpp-python, which only blocks EOS) keep it going,
    and `repeat_penalty` 1 turns off llama-cpp-python's default penalty of 1.1 (exl's default is off).
    Servers ignore the fields they do not know."""
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "min_tokens": output_len,
            "ignore_eos": True, "temperature": 0.0, "repeat_penalty": 1.0, "stream": True,
            "stream_options": {"include_usage": True}}


async def one_request(session, url: str, headers: dict, model: str, prompt: list[int] | str,
                      output_len: int) -> Result:
    """One streamed request (on an aiohttp session), timed at each chunk that carries text. Token counts come
    from the final `usage` chunk; a server that sends none (llama-cpp-python) is credited `output_len` tokens
    when it stopped for `length` (max_tokens reached), else the number of text chunks."""
    import aiohttp

    body = request_body(model, prompt, output_len)
    r = Result()
    chunks = 0
    start = last = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", headers=headers, json=body) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:200]}"
                return r
            async for line in resp.content:  # one SSE line at a time
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    r.error = chunk["error"].get("message", "error")
                    return r
                if chunk.get("usage"):
                    r.output_tokens = chunk["usage"]["completion_tokens"]
                    r.prompt_tokens = chunk["usage"]["prompt_tokens"]
                for c in chunk.get("choices", []):
                    r.finish_reason = c.get("finish_reason") or r.finish_reason
                if any(c.get("text") for c in chunk.get("choices", [])):
                    chunks += 1
                    now = time.perf_counter()
                    if r.ttft == 0.0:
                        r.ttft = now - start
                    else:
                        r.itl.append(now - last)
                    last = now
        r.latency = time.perf_counter() - start
        if r.output_tokens == 0:  # no usage chunk
            r.output_tokens = output_len if r.finish_reason == "length" else chunks
        r.ok = r.output_tokens > 0
        if not r.ok:
            r.error = "no tokens"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # ValueError: bad JSON, a line too long
        r.error = f"{type(e).__name__}: {e}"
    return r


async def run_benchmark(base_url: str, headers: dict, model: str, prompts: list, output_len: int,
                        max_concurrency: int, request_rate: float = float("inf"), timeout: float = 900,
                        quiet: bool = False) -> tuple[list[Result], float]:
    """Send every prompt (at most `max_concurrency` in flight); the results and the wall time.

    The client is aiohttp, as in vLLM's benchmark: it runs on the same cores as the server, and per streamed
    token it takes about a third of the CPU time of an httpx client (measured on 2 cores: ~0.15 vs ~0.5 ms),
    time that a 2-core server would otherwise lose from its decode."""
    import aiohttp

    sem = asyncio.Semaphore(max_concurrency)
    bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=quiet)
    connector = aiohttp.TCPConnector(limit=max_concurrency + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout),
                                     read_bufsize=1 << 20) as session:

        async def limited(p):
            async with sem:
                res = await one_request(session, base_url, headers, model, p, output_len)
                bar.update(1)
                return res

        start = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if request_rate != float("inf"):
                await asyncio.sleep(random.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return results, duration


def metrics(url: str, headers: dict) -> dict[str, float]:
    """exl's Prometheus metrics ({} for a server without /metrics)."""
    resp = httpx.get(url + "/metrics", headers=headers, timeout=30)
    if resp.status_code != 200:
        return {}
    out = {}
    for line in resp.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def wait_cache_empty(url: str, headers: dict, timeout: float) -> tuple[bool | None, float, dict]:
    """(whether exl's KV cache emptied within `timeout` (None: the server has no metrics), seconds, metrics)."""
    start = time.perf_counter()
    m = {}
    while time.perf_counter() - start < timeout:
        m = metrics(url, headers)
        if not m:
            return None, 0.0, m
        if m.get("exl_cache_pages_in_use", 0) == 0 and m.get("exl_num_requests_running", 0) == 0:
            return True, time.perf_counter() - start, m
        time.sleep(0.1)
    return False, time.perf_counter() - start, m


def disconnect_check(args, model: str, headers: dict, vocab: int) -> dict:
    """Start a long streamed request, drop it after a few chunks, and time until its pages are free."""
    prompt = random_prompts(1, args.input_len, vocab, args.seed + 1)[0]
    body = {"model": model, "prompt": prompt, "max_tokens": 4096 if args.max_seq_len is None else
            max(1, args.max_seq_len - args.input_len), "ignore_eos": True, "temperature": 0.0, "stream": True}
    during = {}
    with httpx.Client(timeout=args.timeout) as client:
        with client.stream("POST", args.base_url + "/v1/completions", headers=headers, json=body) as resp:
            resp.raise_for_status()
            seen = 0
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    seen += 1
                    if seen == 5:
                        during = metrics(args.base_url, headers)  # still streaming
                        break  # leaving the iterator closes the connection: the client is gone
    freed, after_s, m = wait_cache_empty(args.base_url, headers, 30)
    return {"pages_in_use_while_streaming": during.get("exl_cache_pages_in_use"),
            "freed": freed, "seconds_until_free": round(after_s, 3),
            "pages_in_use_after": m.get("exl_cache_pages_in_use"),
            "cancelled_total": m.get('exl_requests_total{finish_reason="cancelled"}', 0.0)}


def summarize(results: list[Result], duration: float, output_len: int | None = None) -> dict:
    """vLLM `bench serve` figures over the successful requests (times in ms); with `output_len`, also
    how many requests stopped short of it."""
    good = [r for r in results if r.ok]
    ttft = [r.ttft * 1000 for r in good]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in good if r.output_tokens > 1]
    itl = [x * 1000 for r in good for x in r.itl]
    e2el = [r.latency * 1000 for r in good]
    out_tokens = sum(r.output_tokens for r in good)
    in_tokens = sum(r.prompt_tokens for r in good)
    s = {"successful_requests": len(good), "failed_requests": len(results) - len(good),
         "duration_s": duration, "total_input_tokens": in_tokens, "total_generated_tokens": out_tokens,
         "request_throughput": len(good) / duration, "output_throughput": out_tokens / duration,
         "total_token_throughput": (in_tokens + out_tokens) / duration}
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2el_ms", e2el)):
        s[f"mean_{name}"] = statistics.fmean(values) if values else 0.0
        s[f"median_{name}"] = statistics.median(values) if values else 0.0
        s[f"p99_{name}"] = percentile(values, 99)
    if output_len is not None:
        s["short_requests"] = sum(r.output_tokens < output_len for r in good)
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        s["errors"] = errors[:10]
    return s


def print_report(s: dict, file=sys.stdout) -> None:
    line = lambda k, v: print(f"{k:<40}{v:>12}", file=file)  # noqa: E731
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=52, c="="), file=file)
    line("Successful requests:", s["successful_requests"])
    line("Failed requests:", s["failed_requests"])
    line("Benchmark duration (s):", f"{s['duration_s']:.2f}")
    line("Total input tokens:", s["total_input_tokens"])
    line("Total generated tokens:", s["total_generated_tokens"])
    line("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    line("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}")
    line("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")
    for title, key in (("Time to First Token", "ttft_ms"), ("Time per Output Token (excl. 1st token)", "tpot_ms"),
                       ("Inter-token Latency", "itl_ms"), ("End-to-end Latency", "e2el_ms")):
        print("{s:{c}^{n}}".format(s=title, n=52, c="-"), file=file)
        short = key.split("_")[0].upper()
        line(f"Mean {short} (ms):", f"{s['mean_' + key]:.2f}")
        line(f"Median {short} (ms):", f"{s['median_' + key]:.2f}")
        line(f"P99 {short} (ms):", f"{s['p99_' + key]:.2f}")
    print("=" * 52, file=file)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:5000", help="server address (without /v1)")
    p.add_argument("--api-key", default=None, help="the server's API key")
    p.add_argument("--model", default=None, help="model name (default: the loaded one, from GET /v1/model)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json: send text prompts of --input-len tokens "
                   "(for servers that take no token ids, e.g. llama-cpp-python's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="per-request timeout (s)")
    p.add_argument("--disconnect-check", action="store_true",
                   help="also check that a client dropping a stream frees its cache pages (via /metrics)")
    p.add_argument("--max-seq-len", type=int, default=None, help="for --disconnect-check: the server's context")
    p.add_argument("--result-json", default=None, help="write the results here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        card = server_model(args.base_url, headers)
    except httpx.HTTPError as e:
        print(f"bench/serve.py: cannot reach {args.base_url} ({e}); start `exl serve` first", file=sys.stderr)
        return 2
    except LookupError as e:
        print(f"bench/serve.py: {e}", file=sys.stderr)
        return 2
    model = args.model or card["id"]
    if args.max_seq_len is None:
        args.max_seq_len = card.get("max_seq_len")
    if args.tokenizer:
        vocab = None
        prompts = text_prompts(args.tokenizer, args.num_prompts, args.input_len, args.seed)
    else:
        vocab = _vocab_size(args.base_url, headers)
        prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    if not args.quiet:
        print(f"{args.num_prompts} requests, {args.input_len} prompt + {args.output_len} generated tokens each, "
              f"concurrency {args.max_concurrency}, model {model}", file=sys.stderr)
    results, duration = asyncio.run(run_benchmark(args.base_url, headers, model, prompts, args.output_len,
                                                  args.max_concurrency, args.request_rate, args.timeout, args.quiet))
    summary = summarize(results, duration, args.output_len)
    summary.update(model=model, num_prompts=args.num_prompts, max_concurrency=args.max_concurrency,
                   input_len=args.input_len, output_len=args.output_len)
    freed, secs, m = wait_cache_empty(args.base_url, headers, 30)
    summary["cache_empty_after_run"] = freed
    if args.disconnect_check:
        if vocab is None:
            vocab = _vocab_size(args.base_url, headers)
        summary["disconnect"] = disconnect_check(args, model, headers, vocab)
    print_report(summary)
    if args.disconnect_check:
        d = summary["disconnect"]
        print(f"client disconnect: {d['pages_in_use_while_streaming']:.0f} pages in use while streaming, "
              f"{'freed' if d['freed'] else 'NOT freed'} {d['seconds_until_free']} s after the client left")
    print(f"KV cache empty after the run: {'unknown (no /metrics)' if freed is None else freed}")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=2)
    ok = summary["failed_requests"] == 0 and freed is not False and (not args.disconnect_check or summary["disconnect"]["freed"])
    return 0 if ok else 1


def server_model(url: str, headers: dict) -> dict:
    """The loaded model's card: exl's GET /v1/model, or the first of GET /v1/models (other servers)."""
    card = httpx.get(url + "/v1/model", headers=headers, timeout=30)
    if card.status_code == 200:
        return card.json()
    models = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    if models.status_code == 200 and models.json().get("data"):
        return models.json()["data"][0]
    raise LookupError(f"GET {url}/v1/model: {card.status_code} {card.text[:200]}; GET /v1/models: "
                      f"{models.status_code} {models.text[:200]}")


def _vocab_size(url: str, headers: dict) -> int:
    """The largest valid token id + 1, found by asking the server to decode (binary search on a 400 answer)."""
    lo, hi = 1, 1 << 20
    while lo < hi:
        mid = (lo + hi) // 2
        r = httpx.post(url + "/v1/token/decode", headers=headers, json={"tokens": [mid]}, timeout=30)
        if r.status_code == 200:
            lo = mid + 1
        else:
            hi = mid
    return lo


if __name__ == "__main__":
    sys.exit(main())
