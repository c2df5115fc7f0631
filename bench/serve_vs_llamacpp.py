"""`exl serve` vs llama-cpp-python's OpenAI server, in one run, same machine, same thread count.

    python bench/serve_vs_llamacpp.py                 # the standard pair, 2 threads, full scenarios
    python bench/serve_vs_llamacpp.py --quick --json  # a smoke run (minutes)
    python bench/serve_vs_llamacpp.py --exl DIR --gguf FILE -t 1
    python bench/serve_vs_llamacpp.py --codes scalar  # the pair with exl's scalar codes only

The pair is bench/vs_llamacpp.py's `prepare()`: the rotated SmolLM2-135M-Instruct converted by exl at
4.0 bpw, and llama.cpp's Q4_0 GGUF of the same rotated model. Both servers start on free ports of
127.0.0.1 (`exl serve` with OMP_NUM_THREADS = T, `python -m llama_cpp.server` with n_threads = T) and are
stopped at the end, also on an error or Ctrl-C. One client (bench/serve.py) sends both the same
payload: streamed /v1/completions, text prompts of a fixed token count (llama-cpp-python's server takes
no token ids), greedy, a fixed output length (`ignore_eos` for exl, `min_tokens` for llama.cpp).

Scenarios:
  (a) single stream, 128 new tokens: each server's decode rate ((tokens - 1) / time after the first),
      beside `exl bench` tg128 (exl.benchmark's generator job, in a worker process, same threads); rounds
      interleave the three so that they share the machine's state; the table takes each one's median over
      the rounds (llama-cpp-python's server has rounds at ~40 instead of ~90 tok/s on the 2-core host);
  (b) time to first token of a 200-token prompt, one request at a time, the two servers alternating;
  (c) output throughput with 8 and 32 requests in flight (llama-cpp-python serves one at a time).
It prints a markdown table of the issue 11 targets (figure, exl, peer, ratio, target, met?) and the
vLLM `bench serve` figures of every run, with the thread count and the load average at start and end;
`--json` adds one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO))

import serve  # noqa: E402  (bench/serve.py: the client and its metrics)
from quant.options import CODES  # noqa: E402  (convert.py's --codes)

# issue 11, item 3
TARGETS = {"serve_vs_bench": 0.95, "decode_vs_llamacpp": 1.3, "ttft_vs_llamacpp": 1.0, "throughput_vs_llamacpp": 2.0}


@dataclass
class Plan:
    rounds: int  # (a): rounds of bench job + exl request + llama.cpp request
    decode_prompt: int  # (a): prompt tokens
    decode_tokens: int  # (a): new tokens
    ttft_requests: int  # (b): requests per server
    ttft_prompt: int
    concurrency: tuple[int, ...]  # (c)
    waves: int  # (c): requests = waves * concurrency
    conc_prompt: int
    conc_tokens: int


FULL = Plan(rounds=5, decode_prompt=16, decode_tokens=128, ttft_requests=8, ttft_prompt=200, concurrency=(8, 32),
            waves=2, conc_prompt=128, conc_tokens=128)
QUICK = Plan(rounds=2, decode_prompt=16, decode_tokens=128, ttft_requests=2, ttft_prompt=200, concurrency=(8, 32),
             waves=1, conc_prompt=128, conc_tokens=32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess in its own process group, its output in a log file; `stop()` ends the group."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path, url: str, ready_path: str, headers: dict):
        self.name, self.cmd, self.env, self.log, self.url = name, cmd, env, log, url
        self.ready_path, self.headers = ready_path, headers
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        self._log_file = open(self.log, "wb")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.log.parent)
        return self

    def wait_ready(self, timeout: float) -> None:
        """Poll `ready_path` until it answers 200 (and, for exl's /health, status ok)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready; its log "
                                   f"({self.log}) ends with:\n{self.tail()}")
            try:
                r = httpx.get(self.url + self.ready_path, headers=self.headers, timeout=5)
                if r.status_code == 200 and r.json().get("status", "ok") == "ok":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} was not ready after {timeout:.0f} s; its log ({self.log}) ends with:\n"
                           f"{self.tail()}")

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 20) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self._close_log()
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)  # the group this script created for the server
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self._close_log()

    def _close_log(self):
        if getattr(self, "_log_file", None):
            self._log_file.close()
            self._log_file = None


def start_servers(stack: ExitStack, exl_dir: Path, gguf: Path, threads: int, plan: Plan, workdir: Path,
                  ready_timeout: float) -> tuple[Server, Server]:
    key = secrets.token_hex(16)
    headers = {"Authorization": f"Bearer {key}"}
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    longest = max(plan.decode_prompt + plan.decode_tokens, plan.ttft_prompt + 8, plan.conc_prompt + plan.conc_tokens)
    page = 256
    per_request = -(-(longest + 1) // page) * page
    cache = max(plan.concurrency) * per_request  # every request of the widest scenario fits at once
    exl_port, llama_port = free_port(), free_port()
    exl = Server("exl serve", [sys.executable, "-m", "exl.cli", "serve", "--host", "127.0.0.1", "--port", str(exl_port),
                               "--model-dir", str(exl_dir.parent), "--model", exl_dir.name, "--api-key", key,
                               "--admin-key", secrets.token_hex(16), "--cache-size", str(cache),
                               "--max-batch-size", str(max(plan.concurrency)), "--page-size", str(page),
                               "--no-log-requests"],
                 env, workdir / "exl_serve.log", f"http://127.0.0.1:{exl_port}", "/health", headers)
    llama = Server("llama_cpp.server", [sys.executable, "-m", "llama_cpp.server", "--host", "127.0.0.1", "--port",
                                        str(llama_port), "--model", str(gguf), "--n_threads", str(threads),
                                        "--n_threads_batch", str(threads), "--n_ctx", str(max(2048, longest)),
                                        "--api_key", key, "--interrupt_requests", "False", "--verbose", "False"],
                   env, workdir / "llama_cpp_server.log", f"http://127.0.0.1:{llama_port}", "/v1/models", headers)
    for s in (exl, llama):
        stack.callback(s.stop)
        s.start()
    for s in (exl, llama):
        s.wait_ready(ready_timeout)
    return exl, llama


def requests(server: Server, prompts: list[str], output_len: int, concurrency: int,
             prompt_len: int = 0) -> tuple[list, float]:
    """Run the prompts against `server`; a server that reports no usage is credited `prompt_len` input tokens."""
    model = serve.server_model(server.url, server.headers)["id"]
    results, duration = asyncio.run(serve.run_benchmark(server.url, server.headers, model, prompts, output_len,
                                                        concurrency, quiet=True))
    for r in results:
        r.prompt_tokens = r.prompt_tokens or prompt_len
    return results, duration


def check(results: list, name: str) -> None:
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{name}: {len(bad)} request(s) failed: {bad[:3]}")


def _bench_worker(conn, exl_dir: str, threads: int, tokens: int) -> None:
    """`exl bench`'s tg job (exl.benchmark through the generator) on request, in its own session like the
    servers, so that the scheduler (autogroups) treats the three contenders alike."""
    os.setsid()
    import torch
    from exl.threads import fix_threads

    import exl
    from exl import benchmark

    fix_threads(threads)
    gen = benchmark.make_generator(exl.load_model(exl_dir, progress=False), 0, tokens)
    benchmark.time_generation(gen, tokens, seed=0)  # warm-up
    conn.send("ready")
    while (seed := conn.recv()) is not None:
        conn.send(benchmark.time_generation(gen, tokens, seed=seed))


def start_bench(stack: ExitStack, exl_dir: Path, threads: int, tokens: int):
    """A process running `_bench_worker`; send a seed, receive tok/s."""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_bench_worker, args=(child, str(exl_dir), threads, tokens), daemon=True)
    proc.start()

    def stop():
        try:
            conn.send(None)
        except OSError:
            pass
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    stack.callback(stop)
    if conn.recv() != "ready":
        raise RuntimeError("the exl bench worker did not start")
    return conn


def decode_scenario(exl, llama, bench_conn, plan: Plan, prompts: list[str], log) -> dict:
    """(a) rounds of one `exl bench` tg job, one exl serve request and one llama.cpp request, rotated."""
    bench, results = [], {"exl": [], "llamacpp": []}
    for r in range(plan.rounds):
        order = ["bench", "exl", "llamacpp"]
        order = order[r % 3:] + order[:r % 3]
        for who in order:
            if who == "bench":
                bench_conn.send(r + 1)
                bench.append(bench_conn.recv())
            else:
                res, _ = requests(exl if who == "exl" else llama, [prompts[r]], plan.decode_tokens, 1,
                                  plan.decode_prompt)
                check(res, who)
                results[who] += res
        log(f"  round {r + 1}/{plan.rounds}: exl bench {bench[-1]:.1f}, exl serve {results['exl'][-1].decode_rate:.1f}, "
            f"llama.cpp server {results['llamacpp'][-1].decode_rate:.1f} tok/s")
    out = {"exl_bench_tg": _stats(bench)}
    for who, res in results.items():
        out[who] = _stats([r.decode_rate for r in res])
        out[who + "_serving"] = serve.summarize(res, sum(r.latency for r in res), plan.decode_tokens)
    return out


def ttft_scenario(exl, llama, plan: Plan, prompts: list[str], log) -> dict:
    """(b) one request at a time, the servers alternating; TTFT of each."""
    results = {"exl": [], "llamacpp": []}
    for i, p in enumerate(prompts):
        for who in (("exl", "llamacpp") if i % 2 == 0 else ("llamacpp", "exl")):
            res, _ = requests(exl if who == "exl" else llama, [p], 8, 1, plan.ttft_prompt)
            check(res, who)
            results[who] += res
    out = {}
    for who, res in results.items():
        out[who] = serve.summarize(res, sum(r.latency for r in res), 8)
    log(f"  median TTFT: exl {out['exl']['median_ttft_ms']:.1f} ms, llama.cpp {out['llamacpp']['median_ttft_ms']:.1f} ms")
    return out


def concurrency_scenario(exl, llama, plan: Plan, concurrency: int, prompts: list[str], first: str, log) -> dict:
    """(c) `len(prompts)` requests, `concurrency` in flight, one server after the other."""
    out = {}
    for who in ((first, "llamacpp" if first == "exl" else "exl")):
        res, duration = requests(exl if who == "exl" else llama, prompts, plan.conc_tokens, concurrency,
                                 plan.conc_prompt)
        check(res, who)
        out[who] = serve.summarize(res, duration, plan.conc_tokens)
        log(f"  concurrency {concurrency}, {who}: {out[who]['output_throughput']:.1f} output tok/s "
            f"({duration:.1f} s)")
    return out


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "runs": values}


def targets_table(res: dict, threads: int) -> tuple[list[dict], str]:
    a, b = res["decode"], res["ttft"]
    rows = [
        {"figure": f"single-stream decode tok/s: exl serve vs `exl bench` tg{res['plan']['decode_tokens']}",
         "exl": a["exl"]["median"], "peer": a["exl_bench_tg"]["median"], "target": TARGETS["serve_vs_bench"], "op": ">="},
        {"figure": "single-stream decode tok/s: exl serve vs llama.cpp server",
         "exl": a["exl"]["median"], "peer": a["llamacpp"]["median"], "target": TARGETS["decode_vs_llamacpp"], "op": ">="},
        {"figure": f"median TTFT ms, {res['plan']['ttft_prompt']}-token prompt: exl serve vs llama.cpp server",
         "exl": b["exl"]["median_ttft_ms"], "peer": b["llamacpp"]["median_ttft_ms"],
         "target": TARGETS["ttft_vs_llamacpp"], "op": "<="},
    ]
    for c, r in res["concurrency"].items():
        rows.append({"figure": f"output tok/s at concurrency {c}: exl serve vs llama.cpp server",
                     "exl": r["exl"]["output_throughput"], "peer": r["llamacpp"]["output_throughput"],
                     "target": TARGETS["throughput_vs_llamacpp"], "op": ">="})
    lines = ["| figure | exl | peer | exl / peer | target | met? |", "|---|---|---|---|---|---|"]
    for row in rows:
        row["ratio"] = row["exl"] / row["peer"] if row["peer"] else float("nan")
        row["met"] = row["ratio"] >= row["target"] if row["op"] == ">=" else row["ratio"] <= row["target"]
        lines.append(f"| {row['figure']} | {row['exl']:.1f} | {row['peer']:.1f} | {row['ratio']:.2f}x | "
                     f"{row['op'].replace('>=', '≥').replace('<=', '≤')} {row['target']:g}x | "
                     f"{'yes' if row['met'] else '**no**'} |")
    return rows, "\n".join(lines)


def serving_table(res: dict) -> str:
    runs = [(f"(a) 1 stream, {res['plan']['decode_tokens']} tokens", res["decode"][w + "_serving"], w)
            for w in ("exl", "llamacpp")]
    runs += [(f"(b) TTFT, {res['plan']['ttft_prompt']}-token prompt", res["ttft"][w], w) for w in ("exl", "llamacpp")]
    runs += [(f"(c) concurrency {c}", r[w], w) for c, r in res["concurrency"].items() for w in ("exl", "llamacpp")]
    lines = ["| run | server | ok / failed / short | req/s | output tok/s | TTFT mean / median / p99 ms | "
             "TPOT mean / median / p99 ms | ITL mean / median / p99 ms |", "|---|---|---|---|---|---|---|---|"]
    for name, s, who in runs:
        trio = lambda k: " / ".join(f"{s[f'{m}_{k}']:.1f}" for m in ("mean", "median", "p99"))  # noqa: E731
        lines.append(f"| {name} | {'exl serve' if who == 'exl' else 'llama.cpp server'} | {s['successful_requests']} "
                     f"/ {s['failed_requests']} / {s.get('short_requests', 0)} | {s['request_throughput']:.2f} | "
                     f"{s['output_throughput']:.1f} | {trio('ttft_ms')} | {trio('tpot_ms')} | {trio('itl_ms')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exl", help="exl model folder (default: build the standard pair)")
    ap.add_argument("--gguf", help="llama.cpp GGUF file")
    ap.add_argument("--bits", type=float, default=4.0, help="exl bits per weight for the standard pair")
    ap.add_argument("--codes", choices=CODES, default="auto",
                    help="exl codes for the standard pair (convert.py --codes; see bench/vs_llamacpp.py)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads of each server and of `exl bench`")
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer rounds and requests, shorter outputs")
    ap.add_argument("--rounds", type=int, help="(a) rounds (default 5; --quick 2)")
    ap.add_argument("--waves", type=int, help="(c) requests per concurrency level = waves x concurrency (default 2)")
    ap.add_argument("--ready-timeout", type=float, default=900, help="seconds to wait for a server to load")
    ap.add_argument("--keep-logs", action="store_true", help="keep the servers' logs (their folder is printed)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    if bool(args.exl) != bool(args.gguf):
        ap.error("give both --exl and --gguf, or neither")
    plan = QUICK if args.quick else FULL
    plan = Plan(**{**plan.__dict__, **{k: v for k, v in (("rounds", args.rounds), ("waves", args.waves)) if v}})

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # for the servers and the bench worker
    from vs_llamacpp import prepare

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    exl_dir, gguf = ((Path(args.exl).resolve(), Path(args.gguf).resolve()) if args.exl
                     else prepare(args.bits, codes=args.codes))
    load_start = os.getloadavg()
    started = time.time()
    # distinct random texts everywhere, so that no request finds another's prefix in a cache
    tokenizer = str(exl_dir / "tokenizer.json")
    warmup, *decode_prompts = serve.text_prompts(tokenizer, plan.rounds + 1, plan.decode_prompt, seed=1)
    ttft_prompts = serve.text_prompts(tokenizer, plan.ttft_requests, plan.ttft_prompt, seed=2)
    conc_prompts = {c: serve.text_prompts(tokenizer, plan.waves * c, plan.conc_prompt, seed=3 + c)
                    for c in plan.concurrency}
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the servers too
    workdir = Path(tempfile.mkdtemp(prefix="serve_vs_llamacpp-"))
    res = {"threads": args.threads, "exl_model": str(exl_dir), "gguf": str(gguf), "plan": plan.__dict__,
           "loadavg_start": load_start}
    try:
        with ExitStack() as stack:
            log(f"starting exl serve and llama_cpp.server ({args.threads} thread(s) each; logs in {workdir})")
            exl_server, llama = start_servers(stack, exl_dir, gguf, args.threads, plan, workdir, args.ready_timeout)
            import llama_cpp

            res["llama_cpp_python"] = llama_cpp.__version__
            for s in (exl_server, llama):  # warm-up: the first request of a server pays for lazy setup
                check(requests(s, [warmup], 8, 1)[0], s.name)
            res["prompt_tokens"] = _prompt_tokens(exl_server, llama, ttft_prompts[0])
            bench_conn = start_bench(stack, exl_dir, args.threads, plan.decode_tokens)
            log(f"(a) single stream, {plan.decode_tokens} tokens, {plan.rounds} rounds")
            res["decode"] = decode_scenario(exl_server, llama, bench_conn, plan, decode_prompts, log)
            log(f"(b) TTFT, {plan.ttft_prompt}-token prompts, {plan.ttft_requests} per server")
            res["ttft"] = ttft_scenario(exl_server, llama, plan, ttft_prompts, log)
            res["concurrency"] = {}
            for i, c in enumerate(plan.concurrency):
                log(f"(c) concurrency {c}, {plan.waves * c} requests of {plan.conc_prompt} + {plan.conc_tokens} tokens")
                res["concurrency"][c] = concurrency_scenario(
                    exl_server, llama, plan, c, conc_prompts[c], "exl" if i % 2 == 0 else "llamacpp", log)
    except KeyboardInterrupt:
        log("interrupted: both servers stopped")
        return 130
    finally:
        if not args.keep_logs:
            for f in workdir.iterdir():
                f.unlink()
            workdir.rmdir()
    res["loadavg_end"] = os.getloadavg()
    res["seconds"] = time.time() - started
    rows, table = targets_table(res, args.threads)
    res["targets"] = rows
    print(f"\nexl serve vs llama-cpp-python {res['llama_cpp_python']} server, {args.threads} thread(s) each, "
          f"same client and prompts; load average {_load(load_start)} at start, {_load(res['loadavg_end'])} at end "
          f"({os.cpu_count()} CPUs); {res['seconds']:.0f} s{' (--quick)' if args.quick else ''}\n")
    print(table)
    print("\nvLLM `bench serve` figures per run (TPOT/ITL exclude the first token; short: fewer tokens than asked)\n")
    print(serving_table(res))
    pt = res["prompt_tokens"]
    print(f"\nexl: {exl_dir}\nllama.cpp: {gguf}\n{plan.ttft_prompt}-token prompt as the servers count it: "
          f"exl {pt['exl']}, llama.cpp {pt['llamacpp']}")
    if args.json:
        print(json.dumps(res, default=float))
    return 0


def _prompt_tokens(exl_server: Server, llama: Server, prompt: str) -> dict:
    """How many tokens each server makes of `prompt` (they should agree: same tokenizer, no BOS added)."""
    e = httpx.post(exl_server.url + "/v1/token/encode", headers=exl_server.headers, json={"text": prompt}, timeout=30)
    ll = httpx.post(llama.url + "/extras/tokenize/count", headers=llama.headers, json={"input": prompt}, timeout=30)
    return {"exl": e.json().get("length") if e.status_code == 200 else None,
            "llamacpp": ll.json().get("count") if ll.status_code == 200 else None}


def _interrupt(*_):
    raise KeyboardInterrupt


def _load(avg) -> str:
    return " / ".join(f"{x:.1f}" for x in avg)


if __name__ == "__main__":
    sys.exit(main())
