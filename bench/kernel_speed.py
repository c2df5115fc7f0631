"""Fused dequant-matmul timing on SmolLM2-135M-sized matrices vs dense F.linear.

    python bench/kernel_speed.py              # CPU kernels (float32 activations) vs dense fp32 F.linear
    python bench/kernel_speed.py --cuda       # CUDA kernels (float16) vs dense fp16 F.linear
    python bench/kernel_speed.py --isas avxvnni,avx512vnni [--model DIR]   # int8 GEMV per instruction set
    python bench/kernel_speed.py --trellis [--isas avx2,avx512vnni]   # trellis GEMV vs 4-bit scalar, per ISA
    python bench/kernel_speed.py --crossover DIR [--rows 4,8,16,32,64,128]   # int8 GEMV vs GEMM over a model
    python bench/kernel_speed.py --attention [--threads 2]   # CPU paged decode attention: fp32 vs fp16 cache
    python bench/kernel_speed.py [--cuda] --json   # one JSON line: decode GEMV GB/s against the device's bandwidth
                                              # (with --cuda also the trellis GEMV, codes 1, 2 and 3, and the
                                              # paged decode attention against torch's SDPA)

The --isas mode times the int8-activation GEMV of each instruction set on SmolLM2's real segment
mixes (hot, one row; the cost of each extra activation row from 2 to 16 rows) and, with --model,
a cold decode step: every QuantLinear of the model once, one after another. It uses thread CPU
time (best of several runs), which a busy machine disturbs less than wall time.

The --crossover mode runs every quantized layer of an exl model once, one after another (cold weights, as a
prefill does), at each batch size in --rows, once through the int8 GEMV and once through dequant (tile decode)
+ BLAS GEMM, interleaved, and prints the time of each per kind of layer (scalar codes; trellis code c) and the
ratio. Where the ratio passes 1 is where a kernel table's `int8_gemm_min_rows` belongs (wall time, median of 5).

Shapes are N x K (out x in): q/o_proj 576x576, gate/up 1536x576, down 576x1536, lm_head 49152x576.
Prints the best of repeated runs, the speed ratio to F.linear and the rate at which the packed
weights (qweight + qscale) are streamed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from exl.threads import fix_threads

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


# (N, segments) of SmolLM2-135M's layers at 4.0 bpw: 576 = 512 + a 64-channel tail segment
ISA_SHAPES = [
    (1536, [(512, 4, 128), (64, 4, 64)]),  # gate/up, 4-bit
    (1536, [(576, 4, 32)]),
    (1536, [(512, 3, 128), (64, 3, 64)]),
    (1536, [(512, 5, 128), (64, 5, 64)]),
    (1536, [(576, 6, 64)]),
    (576, [(1536, 4, 128)]),  # down
    (576, [(128, 4, 128), (384, 3, 128), (64, 3, 64)]),  # o_proj-like mix
    (49152, [(576, 6, 64)]),  # lm_head
]


def mixed_layer(n, segs, seed=0):
    g = torch.Generator().manual_seed(seed)
    segs = [F.Segment(*s) for s in segs]
    codes = torch.cat([torch.randint(0, 2**s.bits, (n, s.k_len), generator=g) for s in segs], 1).to(torch.uint8)
    ng = sum(s.n_groups for s in segs)
    return {"qweight": F.pack_codes(codes, segs), "qscale": (torch.rand(n, ng, generator=g) * 0.02).half(),
            "qmeta": F.segments_to_meta(segs)}


def cpu_time(fn, reps, rounds=9):
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.thread_time() - t0) / reps)
    return best


def bench_isas(args):
    import cuda_ext

    ext = cuda_ext.build.load_cpu()
    isas = [i for i in args.isas if i in ext.isa_names()]
    print(f"CPU int8 GEMV, {torch.get_num_threads()} thread(s); instruction sets {', '.join(isas)} "
          f"(available: {', '.join(ext.isa_names())})")
    print("hot, one activation row, us per call:")
    print(f"{'N x K':>12} {'segments':<42}" + "".join(f"{i:>12}" for i in isas))
    for n, segs in ISA_SHAPES:
        t = mixed_layer(n, segs)
        k = sum(s[0] for s in segs)
        x = torch.randn(1, k)
        row = []
        for isa in isas:
            q = ext.QuantLinearCPU(t["qweight"], t["qscale"], t["qmeta"], None, None, None, None, isa)
            row.append(cpu_time(lambda: q.forward(x, "int8"), 50 if n < 10000 else 3))
        print(f"{n:>6}x{k:<5} {str(segs):<42}" + "".join(f"{v * 1e6:>12.1f}" for v in row), flush=True)
    print("several activation rows: us per call for M rows, and per extra row from 2 to 16:")
    for n, segs in [ISA_SHAPES[0], ISA_SHAPES[2], ISA_SHAPES[5]]:
        t = mixed_layer(n, segs)
        k = sum(s[0] for s in segs)
        for isa in isas:
            q = ext.QuantLinearCPU(t["qweight"], t["qscale"], t["qmeta"], None, None, None, None, isa)
            xs = {m: torch.randn(m, k) for m in (1, 2, 4, 8, 16)}
            ts = {m: cpu_time(lambda: q.forward(xs[m], "int8"), 20) for m in xs}
            per = (ts[16] - ts[2]) / 14
            print(f"{n:>6}x{k:<5} {isa:>11}: " + " ".join(f"M{m}={v * 1e6:.0f}" for m, v in ts.items())
                  + f"  extra row {per * 1e6:.1f} us", flush=True)
    if args.model:
        import exl
        from exl.modules.quant_linear import KernelLinear

        model = exl.load_model(args.model, progress=False)
        qls = [mod for mod in model.modules() if isinstance(mod, KernelLinear)]  # scalar and trellis layers
        xs = [torch.randn(1, 1, mod.in_features) for mod in qls]
        for mod, x in zip(qls, xs):
            mod(x)

        def step():
            for mod, x in zip(qls, xs):
                mod(x)

        res = {}
        for _ in range(3):  # interleaved rounds: drifting machine load hits every ISA alike
            for isa in isas:
                for mod in qls:
                    mod._kernel.isa = isa
                res[isa] = min(res.get(isa, float("inf")), cpu_time(step, 5, rounds=3))
        print(f"cold decode step (all {len(qls)} quantized layers of {Path(args.model).name} once each), ms per token:")
        for isa in isas:
            print(f"{isa:>11}: {res[isa] * 1e3:.2f}")


TRELLIS_SHAPES = [(576, 576), (1536, 576), (576, 1536)]


def trellis_layer(n, k, bits, state_bits=16, seed=0, code=F.CODE_LCG_BYTESUM):
    """Random walks; codes 2 and 3 (L = 12) with the quantizer's default tables."""
    g = torch.Generator().manual_seed(seed)
    if code in F.TWO_TABLE_CODES:
        state_bits = F.TWO_TABLE_STATE_BITS
    meta = F.TrellisMeta(bits, state_bits, code=code)
    words = torch.randint(-(2**31), 2**31, (n // 16, k // 16, meta.words_per_tile), generator=g, dtype=torch.int64)
    t = {"trellis": words.to(torch.int32), "tscale": (torch.rand(n, generator=g) * 1e-3).half(),
         "tmeta": meta.to_tensor(), "su": F.pack_signs(torch.ones(k)), "sv": F.pack_signs(torch.ones(n))}
    if code in F.TWO_TABLE_CODES:
        t["tcode"] = F.two_table_default(code)
    return t


def trellis_kernel(ext, t, isa):
    return ext.TrellisLinearCPU(t["trellis"], t["tscale"], t["tmeta"], t["su"], t["sv"], None, isa,
                                tcode=t.get("tcode"))


def bench_trellis(args):
    """Trellis decode-and-dot GEMV per instruction set, against the scalar 4-bit int8 GEMV (both with
    both-side rotations) in the same run: hot, one row; per extra row; GEMV vs GEMM for larger batches."""
    import cuda_ext

    ext = cuda_ext.build.load_cpu()
    isas = [i for i in (args.isas or ext.isa_names()) if i in ext.isa_names()]
    print(f"CPU trellis GEMV, {torch.get_num_threads()} thread(s); instruction sets {', '.join(isas)}")
    print("hot, one activation row: us per call (GB/s of stored bytes: trellis + tscale, or qweight + qscale)")
    print(f"{'N x K':>12} {'layer':<20}" + "".join(f"{i:>20}" for i in isas))
    for n, k in TRELLIS_SHAPES:
        segs = [(k, 4, 128)] if k % 128 == 0 else [(512, 4, 128), (k - 512, 4, 64)]
        sc = mixed_layer(n, segs)
        sc["su"], sc["sv"] = F.pack_signs(torch.ones(k)), F.pack_signs(torch.ones(n))
        x = torch.randn(1, k)
        rows = [("scalar 4-bit", sc, lambda t, isa: ext.QuantLinearCPU(t["qweight"], t["qscale"], t["qmeta"], None,
                                                                         t["su"], t["sv"], None, isa), "int8",
                 sc["qweight"].numel() + 2 * sc["qscale"].numel())]
        for code in args.codes:
            for bits in args.trellis_bits:
                t = trellis_layer(n, k, bits, args.state_bits, code=code)
                for path in ("fp32", "int8"):
                    rows.append((f"c{code} K={bits} {path}", t, lambda t, isa: trellis_kernel(ext, t, isa), path,
                                 4 * t["trellis"].numel() + 2 * n))
        for name, t, make, path, nbytes in rows:
            cells = []
            for isa in isas:
                q = make(t, isa)
                if path == "int8" and not getattr(q, "has_int8", True):
                    cells.append("—")
                    continue
                us = cpu_time(lambda: q.forward(x, path), 50)
                cells.append(f"{us * 1e6:9.1f} ({nbytes / us / 1e9:5.2f})")
            print(f"{n:>6}x{k:<5} {name:<20}" + "".join(f"{c:>20}" for c in cells), flush=True)
    print("several rows, trellis K=3, best ISA: us per call for M rows; extra row = (M16 - M2) / 14; gemm for M rows")
    for n, k in TRELLIS_SHAPES:
        for code in args.codes:
            t = trellis_layer(n, k, 3, args.state_bits, code=code)
            q = trellis_kernel(ext, t, isas[-1])
            xs = {m: torch.randn(m, k) for m in (1, 2, 4, 8, 16, 24, 32, 48)}
            for path in ("fp32", "int8") if q.has_int8 else ("fp32",):
                gemv = {m: cpu_time(lambda: q.forward(xs[m], path), 10) for m in xs}
                print(f"{n:>6}x{k:<5} c{code} {path} " + " ".join(f"M{m}={v * 1e6:.0f}" for m, v in gemv.items())
                      + f"  extra row {(gemv[16] - gemv[2]) / 14 * 1e6:.1f} us", flush=True)
            gemm = {m: cpu_time(lambda: q.forward(xs[m], "gemm"), 10) for m in xs if m >= 8}
            print(f"{'':>12} c{code} gemm " + " ".join(f"M{m}={v * 1e6:.0f}" for m, v in gemm.items()), flush=True)


def graph_time(fn, calls=20, replays=10):
    """Device time of one fn() call with the host out of the way: `calls` calls captured in a CUDA graph,
    replayed `replays` times between two CUDA events. None when fn cannot be captured."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()  # warm-up outside the capture (allocator, lazy init)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / (calls * replays)
    except RuntimeError as e:  # a host sync or allocation the capture refuses: say so, keep the other figures
        print(f"kernel_speed: CUDA graph capture failed ({str(e).splitlines()[0]})", file=sys.stderr)
        return None


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


# Memory bandwidth by datasheet, GB/s (matched against the device name; the measured copy rate is reported too).
SPEC_GBS = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039, "A100": 1555,
            "RTX 5090": 1792, "RTX 4090": 1008, "RTX 3090": 936, "L40S": 864, "L4": 300}


TRELLIS_CUDA_SHAPES = [(576, 576), (4096, 4096), (14336, 4096), (4096, 14336)]
TRELLIS_CUDA_CASES = [(1, 3), (2, 3), (3, 2), (3, 3), (3, 4)]  # (code, K): the quantizer writes code 3 for K <= 4


def trellis_gemv_rates(ext, sync, dev="cuda", shapes=TRELLIS_CUDA_SHAPES, cases=TRELLIS_CUDA_CASES):
    """One-row TrellisLinearCUDA forward (rotations included, "gemv" path) per shape, code and K: microseconds
    and GB/s of stored bytes (trellis + tscale + tcode). Random streams, the quantizer's tables."""
    out = []
    for n, k in shapes:
        for code, bits in cases:
            g = torch.Generator().manual_seed(bits)
            meta = F.TrellisMeta(bits, F.TWO_TABLE_STATE_BITS, code=code)
            words = torch.randint(-(2**31), 2**31, (n // 16, k // 16, meta.words_per_tile), generator=g,
                                  dtype=torch.int64).to(torch.int32)
            tcode = F.two_table_default(code).to(dev) if code in F.TWO_TABLE_CODES else None
            q = ext.TrellisLinearCUDA(words.to(dev), (torch.rand(n, generator=g) * 1e-3).half().to(dev),
                                      meta.to_tensor(), F.pack_signs(torch.ones(k)).to(dev),
                                      F.pack_signs(torch.ones(n)).to(dev), None, tcode=tcode)
            x = torch.randn(1, k, generator=g).half().to(dev)
            secs = best_time(lambda: q.forward(x, "gemv"), sync)
            nbytes = 4 * words.numel() + 2 * n + (tcode.numel() if tcode is not None else 0)
            graph_secs = graph_time(lambda: q.forward(x, "gemv")) if dev == "cuda" else None
            out.append({"shape": f"{n}x{k}", "code": code, "bits": bits, "us": round(secs * 1e6, 2),
                        "gbs": round(nbytes / secs / 1e9, 1),
                        "graph_gbs": round(nbytes / graph_secs / 1e9, 1) if graph_secs else None})
    return out


ATTENTION_CUDA_CASES = [(1, 512), (1, 4096), (1, 16384), (8, 4096)]  # (sequences, context) of one decode step


def attention_rates(ext, sync, cases=ATTENTION_CUDA_CASES, hq=32, hk=8, d=128, page_size=256):
    """One decode step's paged attention (cuda_attention.cu, float16, Llama-3-8B heads) per (sequences, context):
    microseconds, GB/s of keys and values read, and the same read through torch's SDPA over contiguous K/V
    (the peer: what a non-paged cache would cost)."""
    out = []
    for b, ctx in cases:
        pages_per_seq = -(-ctx // page_size)
        n_slots = b * pages_per_seq * page_size
        k = torch.randn(hk, n_slots, d, device="cuda").half()
        v = torch.randn(hk, n_slots, d, device="cuda").half()
        pages = torch.randperm(b * pages_per_seq, device="cuda").view(b, pages_per_seq)  # scattered pages
        seqs = torch.arange(b, device="cuda")
        pos = torch.full((b,), ctx - 1, device="cuda")
        q = torch.randn(b, hq, d, device="cuda").half()
        fn = lambda: ext.paged_attention(q, k, v, pages, seqs, pos, page_size, d**-0.5)  # noqa: E731
        secs = best_time(fn, sync)
        graph_secs = graph_time(fn)
        kc = k[:, : b * ctx].view(hk, b, ctx, d).transpose(0, 1)  # [b, hk, ctx, d]
        vc = v[:, : b * ctx].view(hk, b, ctx, d).transpose(0, 1)
        qs = q.view(b, hq, 1, d)
        sdpa = best_time(lambda: torch.nn.functional.scaled_dot_product_attention(qs, kc, vc, enable_gqa=True), sync)
        nbytes = 2 * b * ctx * hk * d * 2
        out.append({"sequences": b, "context": ctx, "us": round(secs * 1e6, 1), "gbs": round(nbytes / secs / 1e9, 1),
                    "graph_us": round(graph_secs * 1e6, 1) if graph_secs else None,
                    "graph_gbs": round(nbytes / graph_secs / 1e9, 1) if graph_secs else None,
                    "sdpa_contiguous_us": round(sdpa * 1e6, 1)})
    return out


def bench_cpu_attention(args, layers=30, hq=9, hk=3, d=64, page_size=256,
                        cases=((1, 1024), (1, 4096), (16, 64), (16, 1024))):
    """One decode step's CPU paged attention (cpu_fused.cpp, SmolLM2-135M's heads) over `layers` layers' stores
    (cold, as in a real step), per (sequences, context): a float32 cache against a float16 one (the default on the
    CPU), and torch's SDPA over contiguous float32 K/V as the peer (what a non-paged float cache costs). Wall time,
    best of 5; GB/s of keys and values read."""
    ext = cuda_ext_cpu()
    print(f"{torch.get_num_threads()} threads; {layers} layers x ({hq} query / {hk} kv heads of {d}), "
          f"{page_size}-slot pages in scattered order")
    print("| sequences x context | fp32 cache µs (GB/s) | fp16 cache µs (GB/s) | fp32 / fp16 | SDPA fp32 µs "
          "| SDPA / fp16 |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for b, ctx in cases:
        per_seq = -(-ctx // page_size)
        n_slots = b * per_seq * page_size
        pages = torch.randperm(b * per_seq, generator=g).view(b, per_seq)
        seqs, pos = torch.arange(b), torch.full((b,), ctx - 1)
        q = torch.randn(b, hq, d, generator=g)
        times, rates = {}, {}
        for dtype in (torch.float32, torch.float16):
            ks = [torch.randn(hk, n_slots, d, generator=g).to(dtype) for _ in range(layers)]
            vs = [torch.randn(hk, n_slots, d, generator=g).to(dtype) for _ in range(layers)]

            def step():
                for i in range(layers):
                    ext.paged_attention(q, ks[i], vs[i], pages, seqs, pos, page_size, d**-0.5, 0, 0.0)

            times[dtype] = best_time(step, min_reps=5)
            rates[dtype] = 2 * layers * b * ctx * hk * d * (4 if dtype == torch.float32 else 2) / times[dtype] / 1e9
            del ks, vs
        kc = [torch.randn(b, hk, ctx, d, generator=g) for _ in range(layers)]
        vc = [torch.randn(b, hk, ctx, d, generator=g) for _ in range(layers)]
        qs = q.view(b, hq, 1, d)

        def sdpa():
            for i in range(layers):
                torch.nn.functional.scaled_dot_product_attention(qs, kc[i], vc[i], enable_gqa=True)

        t_sdpa = best_time(sdpa, min_reps=5)
        del kc, vc
        f32, f16 = times[torch.float32], times[torch.float16]
        print(f"| {b} x {ctx} | {f32 * 1e6:.0f} ({rates[torch.float32]:.1f}) | {f16 * 1e6:.0f} "
              f"({rates[torch.float16]:.1f}) | {f32 / f16:.2f}x | {t_sdpa * 1e6:.0f} | {t_sdpa / f16:.2f}x |",
              flush=True)


def cuda_ext_cpu():
    from cuda_ext import build

    return build.load_cpu()


def gemv_json(args):
    """One JSON line: the one-row GEMV (decode) of each shape, in GB/s of packed weights streamed, and the
    largest shape's rate as a fraction of the device's copy bandwidth (read + write) and of its datasheet.
    On cuda each shape also has graph_us / graph_gbs: the call replayed from a CUDA graph (no host cost,
    no per-call synchronize), i.e. what the kernels themselves take."""
    cuda = args.cuda
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    big = torch.empty((1 << 30) if cuda else (1 << 28), dtype=torch.uint8, device=dev)
    copy = 2 * big.numel() / best_time(lambda: big.clone(), sync) / 1e9
    del big
    from cuda_ext import build

    ext = build.load_cuda() if cuda else build.load_cpu()
    shapes = args.shapes or SHAPES + ([(14336, 4096), (4096, 14336), (128256, 4096)] if cuda else [])
    rows = []
    for n, k in shapes:
        t = {key: v.to(dev) for key, v in layer(n, k, args.bits, args.group).items()}
        if cuda:
            q, x = ext.QuantLinearCUDA(t["qweight"], t["qscale"], t["qmeta"]), torch.randn(1, k, device=dev).half()
            fn = lambda: q.forward(x)  # noqa: E731
        else:
            q, x = ext.QuantLinearCPU(t["qweight"], t["qscale"], t["qmeta"]), torch.randn(1, k)
            fn = lambda: q.forward(x, "auto", 17, False)  # noqa: E731
        secs = best_time(fn, sync)
        row = {"shape": f"{n}x{k}", "bytes": packed_bytes(t), "us": round(secs * 1e6, 2),
               "gbs": round(packed_bytes(t) / secs / 1e9, 1)}
        if cuda:  # the same call without host overhead: launches replayed from a CUDA graph
            graph_secs = graph_time(fn)
            row.update(graph_us=round(graph_secs * 1e6, 2) if graph_secs else None,
                       graph_gbs=round(packed_bytes(t) / graph_secs / 1e9, 1) if graph_secs else None)
        rows.append(row)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    spec = next((v for key, v in SPEC_GBS.items() if key in name), None)
    largest = max(rows, key=lambda r: r["bytes"])
    trellis = trellis_gemv_rates(ext, sync) if cuda else None  # the CPU trellis kernels: --trellis
    attention, attention_error = None, None
    if cuda:
        try:  # a failure here must not cost the GEMV figures above
            attention = attention_rates(ext, sync)
        except Exception as e:  # noqa: BLE001 - reported in the JSON line
            attention_error = f"{type(e).__name__}: {e}"
    print(json.dumps({"device": name, "bits": args.bits, "copy_gbs": round(copy, 1), "spec_gbs": spec,
                      "largest": largest["shape"], "gbs": largest["gbs"], "graph_gbs": largest.get("graph_gbs"),
                      "fraction_of_copy": round(largest["gbs"] / copy, 3),
                      "fraction_of_spec": round(largest["gbs"] / spec, 3) if spec else None, "shapes": rows,
                      "trellis": trellis, "attention": attention, "attention_error": attention_error}))


def bench_crossover(args):
    """int8 GEMV vs dequant + GEMM over every quantized layer of a model, per layer kind and batch size."""
    import statistics

    import exl
    from exl.modules.quant_linear import KernelLinear

    model = exl.load_model(args.crossover, progress=False)
    kinds: dict[str, list] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, KernelLinear) and name.startswith("layers"):  # the blocks' layers (not the head)
            meta = getattr(mod, "meta", None)
            kinds.setdefault("scalar codes" if meta is None else f"trellis code {meta.code}", []).append(mod)
    first = next(iter(kinds.values()))[0].kernel()
    print(f"{args.crossover}: {torch.get_num_threads()} threads, kernel table {first.isa}; ms per pass over the "
          "layers (median of 5), int8 GEMV / dequant + GEMM")
    print("| rows | " + " | ".join(f"{k} ({len(v)}): int8 / GEMM / ratio" for k, v in kinds.items()) + " |")
    print("|---|" + "---|" * len(kinds))

    def run(calls, path):
        t = time.perf_counter()
        for k, x in calls:
            k.forward(x, path, 1 << 62, False)
        return (time.perf_counter() - t) * 1e3

    for m in args.rows:
        cells = []
        for layers in kinds.values():
            calls = [(mod.kernel(), torch.randn(m, mod.in_features)) for mod in layers]
            times = {"int8": [], "gemm": []}
            for rep in range(6):
                for path in times:
                    elapsed = run(calls, path)
                    if rep:  # the first round warms up
                        times[path].append(elapsed)
            a, b = statistics.median(times["int8"]), statistics.median(times["gemm"])
            cells.append(f"{a:.1f} / {b:.1f} / {a / b:.2f}")
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", action="store_true", help="benchmark the CUDA kernels")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16, 512])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--shapes", type=lambda s: [tuple(int(d) for d in v.split("x")) for v in s.split(",")],
                    default=None, help="N x K list, e.g. 576x1536,49152x576 (default: the SmolLM2 shapes)")
    ap.add_argument("--isas", type=lambda s: s.split(","), default=None,
                    help="compare the int8 GEMV of these instruction sets, e.g. avxvnni,avx512vnni")
    ap.add_argument("--model", default=None, help="with --isas: an exl model folder for the cold decode step")
    ap.add_argument("--paths", type=lambda s: s.split(","), default=None, help="e.g. int8,gemm (default by rows)")
    ap.add_argument("--trellis", action="store_true", help="trellis GEMV per instruction set vs scalar 4-bit")
    ap.add_argument("--trellis-bits", type=lambda s: [int(v) for v in s.split(",")], default=[2, 3, 4])
    ap.add_argument("--state-bits", type=int, default=12, help="trellis L for --trellis (the quantizer's choice: 12)")
    ap.add_argument("--codes", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 3],
                    help="trellis codes for --trellis (codes 2 and 3 always at L = 12, with the default tables)")
    ap.add_argument("--json", action="store_true", help="one JSON line: decode GEMV GB/s vs the device's bandwidth")
    ap.add_argument("--attention", action="store_true", help="CPU paged decode attention, float32 vs float16 cache")
    ap.add_argument("--crossover", metavar="DIR", default=None,
                    help="an exl model folder: int8 GEMV vs dequant + GEMM over its layers at each of --rows")
    args = ap.parse_args()
    if args.threads:
        fix_threads(args.threads)
    if args.json:
        return gemv_json(args)
    if args.crossover:
        return bench_crossover(args)
    if args.attention:
        return bench_cpu_attention(args)
    (bench_cuda if args.cuda else bench_trellis if args.trellis else bench_isas if args.isas else bench_cpu)(args)


if __name__ == "__main__":
    main()
