"""`exl eval ppl`: perplexity (and KL-divergence from a reference model) over a text file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from exl.errors import ExlError


def add_arguments(parser):
    sub = parser.add_subparsers(dest="metric", metavar="METRIC", required=True)
    p = sub.add_parser("ppl", help="perplexity over non-overlapping windows of a text",
                       description="Perplexity over consecutive non-overlapping windows of --ctx tokens "
                                   "(remainder dropped); NLL and KL averaged over tokens 2..ctx of each window.")
    p.add_argument("-m", "--model", required=True, help="model folder (dense or exl-quantized)")
    p.add_argument("--text", required=True, help="UTF-8 text file to evaluate on")
    p.add_argument("--ctx", type=int, default=512, help="window length in tokens (default 512)")
    p.add_argument("--max-windows", type=int, default=None, help="evaluate only the first N windows")
    p.add_argument("--ref", default=None, help="reference model folder: also report mean KL-divergence from it")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward pass")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    from exl.parallel import add_parallel_arguments

    add_parallel_arguments(p)


def run(args) -> int:
    from exl.eval import perplexity
    from exl.runtime import load_for_cli
    from exl.tokenizer import Tokenizer

    text_path = Path(args.text)
    if not text_path.is_file():
        raise ExlError(f"--text {text_path}: no such file")
    if args.ctx < 2:
        raise ExlError(f"--ctx must be at least 2, got {args.ctx}")
    try:
        text = text_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ExlError(f"--text {text_path}: not UTF-8 text ({e})") from e
    model = load_for_cli(args.model, args)
    tokens = Tokenizer.from_dir(args.model).encode(text, add_bos=False, special=False)
    ref = load_for_cli(args.ref, args) if args.ref else None
    try:
        result = perplexity(model, tokens, args.ctx, args.max_windows, ref, args.batch_size,
                            progress=sys.stderr.isatty())
    except ValueError as e:
        raise ExlError(f"--text {text_path}: {e}") from e
    print(f"perplexity {result['ppl']:.4f} over {result['tokens']} tokens ({result['windows']} windows of {args.ctx})")
    if result["kld"] is not None:
        print(f"mean KL-divergence from {args.ref}: {result['kld']:.6f}")
    if args.json:
        print(json.dumps({k: result[k] for k in ("ppl", "kld", "tokens", "windows", "nll", "ctx")}))
    return 0
