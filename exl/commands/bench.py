"""`exl bench`: prompt-processing and generation speed in the style of llama-bench, measured through the
generator (the path every other command and the server use; see exl.benchmark)."""

from __future__ import annotations

import json
import sys

from exl.errors import ExlError


def add_arguments(p):
    p.add_argument("-m", "--model", required=True, help="model folder (dense or exl-quantized)")
    p.add_argument("-p", "--n-prompt", type=int, default=512,
                   help="prompt tokens for the pp test: one job's prefill (default 512, 0 skips)")
    p.add_argument("-n", "--n-gen", type=int, default=128,
                   help="tokens for the tg test: one job's decode steps (default 128, 0 skips)")
    p.add_argument("-d", "--depth", type=int, default=0,
                   help="prompt tokens before the tg test's decode steps (llama-bench -d: 'tg128@d1024'; default 0)")
    from exl.commands.generate import add_cache_arguments

    add_cache_arguments(p)
    p.add_argument("-r", "--repetitions", type=int, default=3, help="timed runs per test after one warm-up (default 3)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    from exl.parallel import add_parallel_arguments

    add_parallel_arguments(p)


def run(args) -> int:
    from exl.threads import fix_threads

    from exl import benchmark
    from exl.runtime import load_for_cli

    if args.repetitions < 1:
        raise ExlError(f"--repetitions must be at least 1, got {args.repetitions}")
    if args.n_prompt < 0 or args.n_gen < 0 or args.n_prompt + args.n_gen == 0:
        raise ExlError("--n-prompt and --n-gen must be >= 0 and not both 0")
    if args.depth < 0:
        raise ExlError(f"--depth must be >= 0, got {args.depth}")
    if args.threads:
        fix_threads(args.threads)
    model = load_for_cli(args.model, args, progress=sys.stderr.isatty())
    if args.depth + args.n_gen + 1 > model.config.max_position_embeddings:
        raise ExlError(f"--depth {args.depth} + --n-gen {args.n_gen} exceeds the model's context "
                       f"({model.config.max_position_embeddings} positions)")
    result = benchmark.run(model, args.n_prompt, args.n_gen, args.repetitions, depth=args.depth,
                           cache_mode=args.cache_mode,
                           progress=lambda name, v: print(f"  {name}: {v:8.1f} tok/s", file=sys.stderr))
    print("| model | bpw | threads | test | tok/s |\n|---|---|---|---|---|")
    for test in (f"pp{args.n_prompt}", f"tg{args.n_gen}@d{args.depth}" if args.depth else f"tg{args.n_gen}"):
        if test in result:
            print(f"| {args.model} | {result['bpw']:.2f} | {result['threads']} | {test} | "
                  f"{result[test]:.1f} ± {result[test + '_std']:.1f} |")
    print(f"peak RSS {result['peak_rss_mib']:.0f} MiB")
    if args.json:
        print(json.dumps(result))
    return 0
