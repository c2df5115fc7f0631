"""exl vs llama.cpp speed on the same model, in one run, same thread count (llama-bench style).

    python bench/vs_llamacpp.py                       # builds the standard pair (see below), then measures
    python bench/vs_llamacpp.py --exl DIR --gguf FILE # measure a given pair
    python bench/vs_llamacpp.py --codes scalar        # the pair with exl's scalar codes only
    python bench/vs_llamacpp.py --pp 16,32,64,512     # prefill of several prompt lengths (chat turns are short)
    python bench/vs_llamacpp.py --depth 0,1024        # decode also after a 1,024-token prompt (llama-bench -d)

The standard pair (issue 4): the function-preserving rotated copy of SmolLM2-135M-Instruct,
converted by exl at 4.0 bpw (`convert.py`'s default `--codes auto`: the optimizer picks scalar or trellis codes per
matrix, and at 4.0 bpw it picks trellis codes for every matrix; `--codes scalar|trellis` builds the pair with only
those codes), and llama.cpp's Q4_0 of the same rotated model (token embedding F16,
untied head Q8_0) quantized from an F32 GGUF written by exl's exporter. Artifacts are cached in
$EXL_CACHE/bench. exl is measured through its generator (exl.benchmark: pp = one 512-token prompt job's
prefill, tg = one job's decode rate), the path `exl serve` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from exl.threads import fix_threads

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llamacpp  # noqa: E402

import exl  # noqa: E402
from exl import benchmark  # noqa: E402
from exl.assets import cache_dir, smollm2_dir  # noqa: E402
from quant.options import CODES  # noqa: E402  (convert.py's --codes)


def prepare(bits: float = 4.0, seed: int = 0, codes: str = "auto") -> tuple[Path, Path]:
    """(exl folder, llama.cpp GGUF) for the rotated SmolLM2, built once and cached. codes: convert.py's --codes
    (auto: the default conversion, folder exl-BITS; scalar / trellis: folder scalar-BITS / trellis-BITS, the names
    bench/quality.py gives its scalar-vs-trellis conversions)."""
    if codes not in CODES:
        raise ValueError(f"codes must be one of {', '.join(CODES)}, not {codes!r}")
    from exl.gguf_export import export_gguf
    from quant.rotate import rotate_model

    root = cache_dir() / "bench"
    rotated = root / f"smollm2-rotated-s{seed}"
    if not (rotated / "config.json").is_file():
        rotate_model(smollm2_dir(), rotated, seed=seed)
    exl_dir = root / "quality" / f"{'exl' if codes == 'auto' else codes}-{bits}"  # bench/quality.py's names
    if not (exl_dir / "config.json").is_file():
        subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "convert.py"), "-i", str(rotated),
                        "-o", str(exl_dir), "-b", str(bits), "--codes", codes], check=True)
    f32 = root / f"smollm2-rotated-s{seed}-f32.gguf"
    if not f32.is_file():
        export_gguf(rotated, f32, "f32")
    q4 = root / f"smollm2-rotated-s{seed}-Q4_0-embF16-headQ8_0.gguf"  # shared with bench/quality.py
    if not q4.is_file():
        llamacpp.quantize(f32, q4, "Q4_0", embedding="F16", head="Q8_0")
    return exl_dir, q4


def lengths(ap, flag: str, text: str, lo: int, hi: int, example: str, why: str = "") -> list[int]:
    """The sorted distinct token counts of a comma-separated flag value, each in lo..hi (else ap.error)."""
    try:
        values = sorted({int(v) for v in text.split(",")})
    except ValueError:
        ap.error(f"{flag} takes prompt lengths separated by commas, e.g. {example}; got {text!r}")
    if not values or min(values) < lo or max(values) > hi:
        ap.error(f"{flag} lengths must lie in {lo}..{hi}{why}; got {text!r}")
    return values


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exl", help="exl model folder (default: build the standard pair)")
    ap.add_argument("--gguf", help="llama.cpp GGUF file")
    ap.add_argument("--bits", type=float, default=4.0, help="exl bits per weight for the standard pair")
    ap.add_argument("--codes", choices=CODES, default="auto",
                    help="exl codes for the standard pair (convert.py --codes)")
    ap.add_argument("--pp", default="512", help="prompt lengths to time, comma-separated (default 512)")
    ap.add_argument("--depth", default="0", help="decode (tg128) after prompts of these lengths, comma-separated "
                    "(0: a 1-token prompt; 'tg128@d1024' as llama-bench -d)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    if bool(args.exl) != bool(args.gguf):
        ap.error("give both --exl and --gguf, or neither")
    pps = lengths(ap, "--pp", args.pp, 1, 2048, "16,32,512", " (the benchmark's cache and llama.cpp's context)")
    depths = lengths(ap, "--depth", args.depth, 0, 8192, "0,1024")
    exl_dir, gguf = (Path(args.exl), Path(args.gguf)) if args.exl else prepare(args.bits, codes=args.codes)

    fix_threads(args.threads)
    os.environ["EXL_THREADS"] = str(args.threads)  # asked for: no automatic choice at load
    model = exl.load_model(exl_dir, progress=False)
    ours = benchmark.run(model, pps[-1], 128, args.repetitions, depth=depths[0])
    for pp in pps[:-1]:
        ours.update(benchmark.run(model, pp, 0, args.repetitions))
    for depth in depths[1:]:
        ours.update(benchmark.run(model, 0, 128, args.repetitions, depth=depth))
    del model
    llm = llamacpp.load(gguf, threads=args.threads, n_ctx=max(2048, pps[-1] + 128, depths[-1] + 128))
    theirs = llamacpp.bench(llm, pps[-1], 128, args.repetitions, depth=depths[0])
    for pp in pps[:-1]:
        theirs.update(llamacpp.bench(llm, pp, 0, args.repetitions))
    for depth in depths[1:]:
        theirs.update(llamacpp.bench(llm, 0, 128, args.repetitions, depth=depth))
    del llm

    print(f"\n{args.threads} threads, {args.repetitions} timed runs each (mean ± std)\n")
    print("| test | exl tok/s | llama.cpp tok/s | exl / llama.cpp |")
    print("|---|---|---|---|")
    ratios = {}
    for test in [f"pp{pp}" for pp in pps] + [f"tg128@d{d}" if d else "tg128" for d in depths]:
        ratios[test] = ours[test] / theirs[test]
        print(f"| {test} | {ours[test]:.1f} ± {ours[test + '_std']:.1f} | {theirs[test]:.1f} ± "
              f"{theirs[test + '_std']:.1f} | {ratios[test]:.2f}x |")
    print(f"\nexl: {exl_dir} ({ours['bpw']:.2f} bpw, peak RSS {ours['peak_rss_mib']:.0f} MiB)\nllama.cpp: {gguf}")
    if args.json:
        print(json.dumps({"exl": ours, "llamacpp": theirs, **{f"{t}_ratio": r for t, r in ratios.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
