"""Where a decode token's time goes, through the generator (the path `exl bench`, `exl generate` and the server
use): torch.profiler over one greedy job's decode steps, reported per token.

    python bench/decode_profile.py -m MODEL [--device cuda] [-n 32] [--json]

Per token: wall time (profiler off, then on), PyTorch ops called, and on cuda the kernel launches, host
synchronizations (cudaStreamSynchronize / cudaDeviceSynchronize, and aten::_local_scalar_dense, i.e.
.item()/int()/bool() of a GPU tensor), device-to-host copies and the device's busy time; then the ops with the
most host time. On a GPU, wall time far above the device's busy time means decode is bound by the host
(Python, dispatch, launches), which CUDA graphs or a fused step remove; syncs per token above one (the
sampled token) are stalls to remove first. On the CPU the launch columns are empty and op counts still say
how much dispatch a token costs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

LAUNCH = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profile_decode(model, n: int, top: int = 12) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from exl import benchmark

    gen = benchmark.make_generator(model, 0, n)
    cuda = next(model.parameters()).device.type == "cuda"
    benchmark.time_generation(gen, 8, seed=0)  # warm-up: kernels built, allocator primed
    plain = benchmark.time_generation(gen, n, seed=1)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        profiled = benchmark.time_generation(gen, n, seed=1)
        wall = time.perf_counter() - t0
    events = prof.key_averages()

    def count(names):
        return sum(e.count for e in events if e.key in names)

    def device_us(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0

    steps = n + 1  # the job's prefill of one token, then n decode steps
    ops = sum(e.count for e in events if e.key.startswith("aten::"))
    top_ops = sorted((e for e in events if not e.key.startswith(("cuda", "cu"))), key=lambda e: -e.self_cpu_time_total)
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "tokens": n, "tok_s": round(plain, 1), "tok_s_profiled": round(profiled, 1),
        "ms_per_token": round(1e3 / plain, 3),
        "aten_ops_per_token": round(ops / steps, 1),
        "launches_per_token": round(count(LAUNCH) / steps, 1) if cuda else None,
        "syncs_per_token": round(count(SYNC) / steps, 2) if cuda else None,
        "item_per_token": round(count(("aten::_local_scalar_dense",)) / steps, 2),
        "d2h_copies_per_token": round(count(("cudaMemcpyAsync", "cudaMemcpy")) / steps, 2) if cuda else None,
        "device_busy_ms_per_token": round(sum(device_us(e) for e in events) / 1e3 / steps, 3) if cuda else None,
        "profiled_wall_ms_per_token": round(wall * 1e3 / steps, 3),
        "top_host_ops": [{"op": e.key, "calls_per_token": round(e.count / steps, 1),
                          "host_us_per_token": round(e.self_cpu_time_total / steps, 1)} for e in top_ops[:top]],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, help="model folder (dense or exl-quantized)")
    ap.add_argument("--device", default=None, help="torch device (default: cuda if a GPU is visible, else cpu)")
    ap.add_argument("-n", "--n-gen", type=int, default=32, help="decode steps profiled (default 32)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    import exl
    from exl.runtime import pick_device

    model = exl.load_model(args.model, device=pick_device(args.device), progress=False)
    r = profile_decode(model, args.n_gen)
    print(f"{r['device']}: {r['tok_s']} tok/s ({r['ms_per_token']} ms/token; {r['tok_s_profiled']} profiled)",
          file=sys.stderr)
    for key in ("aten_ops_per_token", "launches_per_token", "syncs_per_token", "item_per_token",
                "d2h_copies_per_token", "device_busy_ms_per_token", "profiled_wall_ms_per_token"):
        print(f"  {key:28} {r[key]}", file=sys.stderr)
    print(f"  {'op':40} {'calls/token':>12} {'host us/token':>14}", file=sys.stderr)
    for o in r["top_host_ops"]:
        print(f"  {o['op'][:40]:40} {o['calls_per_token']:>12} {o['host_us_per_token']:>14}", file=sys.stderr)
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
