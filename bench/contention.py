"""Decode speed under CPU contention: exl beside llama.cpp, quiet and with a busy process on one core.

    python bench/contention.py                          # models of bench/vs_llamacpp.py (built if missing)
    python bench/contention.py --exl DIR --gguf FILE    # a given pair
    python bench/contention.py --exl DIR --no-llamacpp  # exl only

"Loaded" runs start a deliberate CPU hog first: a Python busy loop pinned to the last usable core,
bounded in time and killed at the end. Each measurement runs in a fresh process, so exl's automatic
thread count (exl/threads.py, applied at model load) sees the load as a user's process would. Rows:

  exl default        threads as exl picks them (EXL_THREADS unset): the number that matters
  exl N forced       EXL_THREADS=N (all cores) under the same load: what the automatic choice avoids
  exl 1              EXL_THREADS=1: the quiet single-thread rate the target is measured against
  llama.cpp N / 1    llama-cpp-python with n_threads = N / 1, same load

tg tokens/s as `exl bench` (one generator job, the paged cache's one-call decode step). Target (issue 11): exl default
loaded >= 0.5x exl 1 quiet. Timings are wall time: say what else ran on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_exl(args) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    import exl
    from exl.benchmark import make_generator, time_generation

    gen = make_generator(exl.load_model(args.exl, progress=False), 0, args.tokens)
    time_generation(gen, 16)  # warm-up
    runs = [time_generation(gen, args.tokens) for _ in range(args.reps)]
    return {"tps": max(runs), "runs": runs, "threads": torch.get_num_threads()}


def child_llama(args) -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    import llamacpp

    llm = llamacpp.load(args.gguf, threads=args.threads, n_ctx=args.tokens + 32)
    r = llamacpp.bench(llm, pp=0, tg=args.tokens, reps=args.reps)
    return {"tps": r[f"tg{args.tokens}"], "threads": args.threads}


def measure(args, kind: str, threads: int | None) -> dict:
    """One measurement in a fresh process; threads None: exl's own choice."""
    env = dict(os.environ)
    env.pop("EXL_THREADS", None)
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, __file__, "--child", kind, "--tokens", str(args.tokens), "--reps", str(args.reps)]
    if kind == "exl":
        cmd += ["--exl", str(args.exl)]
        if threads:
            env["EXL_THREADS"] = str(threads)
    else:
        cmd += ["--gguf", str(args.gguf), "--threads", str(threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise SystemExit(f"{kind} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class Hog:
    """A busy loop pinned to one core, bounded by `seconds`, killed on exit."""

    def __init__(self, cpu: int, seconds: float):
        code = ("import os, time\nos.sched_setaffinity(0, {%d})\nend = time.time() + %f\nwhile time.time() < end:\n"
                "    pass\n" % (cpu, seconds))
        self.proc = subprocess.Popen([sys.executable, "-c", code])

    def __enter__(self):
        time.sleep(0.5)  # running before the measured process starts
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exl", help="exl model folder")
    ap.add_argument("--gguf", help="llama.cpp GGUF file")
    ap.add_argument("--no-llamacpp", action="store_true", help="exl rows only")
    ap.add_argument("--bits", type=float, default=4.0, help="without --exl: the bench/vs_llamacpp.py model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--hog-seconds", type=float, default=900, help="upper bound on the hog's life")
    ap.add_argument("--timeout", type=float, default=900, help="per measurement")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--child", choices=("exl", "llama"), help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child_exl(args) if args.child == "exl" else child_llama(args)))
        return 0

    if not args.exl or (not args.gguf and not args.no_llamacpp):
        sys.path.insert(0, str(ROOT / "bench"))
        from vs_llamacpp import prepare

        exl_dir, gguf = prepare(args.bits)
        args.exl, args.gguf = args.exl or exl_dir, args.gguf or gguf
    cpus = sorted(os.sched_getaffinity(0))
    n = len(cpus)
    with open("/proc/loadavg") as f:
        print(f"{n} usable cores; load average before: {f.read().split()[:3]}")

    rows = [("exl default", "exl", None), (f"exl {n} forced", "exl", n), ("exl 1", "exl", 1)]
    if not args.no_llamacpp:
        rows += [(f"llama.cpp {n}", "llama", n), ("llama.cpp 1", "llama", 1)]
    res: dict = {"cores": n, "hog_cpu": cpus[-1], "tokens": args.tokens}
    for cond in ("quiet", "loaded"):
        for name, kind, threads in rows:
            if cond == "loaded" and name.endswith(" 1") and kind == "exl":
                continue  # the 1-thread rows matter quiet (the reference); loaded they repeat the default row
            if cond == "loaded":
                with Hog(cpus[-1], args.hog_seconds):
                    r = measure(args, kind, threads)
            else:
                r = measure(args, kind, threads)
            res[f"{name} {cond}"] = r
            print(f"  {cond:6s} {name:16s} {r['tps']:7.1f} tok/s ({r['threads']} threads)", flush=True)

    ref = res["exl 1 quiet"]["tps"]
    print(f"\ntg{args.tokens} tokens/s; loaded = a busy process pinned to cpu {cpus[-1]}")
    print(f"{'':18s} {'quiet':>8s} {'loaded':>8s} {'loaded/quiet':>13s} {'loaded / exl 1 quiet':>21s}")
    for name, kind, threads in rows:
        q, l_ = res.get(f"{name} quiet"), res.get(f"{name} loaded")
        if q is None:
            continue
        loaded = f"{l_['tps']:8.1f} {l_['tps'] / q['tps']:12.2f}x {l_['tps'] / ref:20.2f}x" if l_ else f"{'-':>8s}"
        print(f"{name:18s} {q['tps']:8.1f} {loaded}")
    res["exl_loaded_vs_quiet_1thread"] = round(res["exl default loaded"]["tps"] / ref, 3)
    print(f"\nexl default under load / exl 1 thread quiet: {res['exl_loaded_vs_quiet_1thread']:.2f} (target >= 0.5)")
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
