"""Fused dequant-matmul timing on SmolLM2-135M-sized matrices vs dense F.linear.

    python bench/kernels.py              # CPU kernels (float32 activations) vs dense fp32 F.linear
    python bench/kernels.py --cuda       # CUDA kernels (float16) vs dense fp16 F.linear

Shapes are N x K (out x in): q/o_proj 576x576, gate/up 1536x576, down 576x1536, lm_head 49152x576.
Prints the best of repeated runs, the speed ratio to F.linear and the rate at which the packed
weights (qweight + qscale) are streamed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exl import format as F  # noqa: E402

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]


def layer(n, k, bits, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    segs = [F.Segment(k, bits, group)]
    codes = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    return {
        "qweight": F.pack_codes(codes, segs),
        "qscale": (torch.rand(n, k // group, generator=g) * 0.02).half(),
        "qmeta": F.segments_to_meta(segs),
    }


def best_time(fn, sync=lambda: None, budget=0.4, min_reps=5):
    fn()
    sync()
    times, t_end = [], time.perf_counter() + budget
    while len(times) < min_reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def packed_bytes(t):
    return t["qweight"].numel() + 2 * t["qscale"].numel()


def bench_cpu(args):
    import cuda_ext

    ext = cuda_ext.build.load_cpu()
    print(f"CPU: {torch.get_num_threads()} threads, kernels {ext.isa_names()[-1]}, {args.bits}-bit codes, "
          f"group {args.group}")
    print(f"{'N x K':>12} {'rows':>5} {'path':>5} {'exl us':>9} {'F.linear us':>12} {'speedup':>8} {'GB/s':>7}")
    for n, k in args.shapes or SHAPES:
        t = layer(n, k, args.bits, args.group)
        q = ext.QuantLinearCPU(t["qweight"], t["qscale"], t["qmeta"])
        w = torch.randn(n, k) * 0.02
        for m in args.rows:
            if n * m > 49152 * 64 and m > 64:
                continue  # lm_head runs on the last position only
            x = torch.randn(m, k)
            paths = args.paths or (["int8", "fp32"] if m < 8 else ["int8", "gemm"] if m <= 32 else ["gemm"])
            dense = best_time(lambda: torch.nn.functional.linear(x, w))
            for p in paths:
                ours = best_time(lambda: q.forward(x, p))
                gbs = packed_bytes(t) / ours / 1e9
                print(f"{n:>6}x{k:<5} {m:>5} {p:>5} {ours * 1e6:>9.1f} {dense * 1e6:>12.1f} {dense / ours:>7.2f}x {gbs:>7.2f}",
                      flush=True)


def bench_cuda(args):
    import cuda_ext

    ext = cuda_ext.build.load_cuda()
    sync = torch.cuda.synchronize
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy = best_time(lambda: big.clone(), sync)
    peak = 2 * big.numel() / copy / 1e9  # read + write
    del big
    print(f"CUDA: {torch.cuda.get_device_name()}, copy bandwidth {peak:.0f} GB/s (reference for the fractions)")
    print(f"{'N x K':>12} {'rows':>5} {'exl us':>9} {'F.linear us':>12} {'speedup':>8} {'GB/s':>7} {'of copy':>8}")
    shapes = SHAPES + [(14336, 4096), (4096, 14336), (128256, 4096)]
    for n, k in shapes:
        t = {kk: v.cuda() for kk, v in layer(n, k, args.bits, args.group).items()}
        q = ext.QuantLinearCUDA(t["qweight"], t["qscale"], t["qmeta"])
        w = (torch.randn(n, k, device="cuda") * 0.02).half()
        for m in (1, 4, 8, 64, 512):
            x = torch.randn(m, k, device="cuda").half()
            dense = best_time(lambda: torch.nn.functional.linear(x, w), sync)
            ours = best_time(lambda: q.forward(x), sync)
            gbs = packed_bytes(t) / ours / 1e9
            print(f"{n:>6}x{k:<5} {m:>5} {ours * 1e6:>9.1f} {dense * 1e6:>12.1f} {dense / ours:>7.2f}x {gbs:>7.0f} "
                  f"{gbs / peak:>7.0%}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", action="store_true", help="benchmark the CUDA kernels")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16, 512])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--shapes", type=lambda s: [tuple(int(d) for d in v.split("x")) for v in s.split(",")],
                    default=None, help="N x K list, e.g. 576x1536,49152x576 (default: the SmolLM2 shapes)")
    ap.add_argument("--paths", type=lambda s: s.split(","), default=None, help="e.g. int8,gemm (default by rows)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    (bench_cuda if args.cuda else bench_cpu)(args)


if __name__ == "__main__":
    main()
