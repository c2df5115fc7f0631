"""`exl generate`: complete one prompt and stream the text."""

from __future__ import annotations

import sys

from exl.errors import ExlError


def add_sampling_arguments(p):
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--seed", type=int, default=None,
                   help="random seed for reproducible sampling (the same tokens as exl.simple, the Generator and "
                        "`exl serve` with this seed)")
    add_cache_arguments(p)


def add_cache_arguments(p):
    from exl.cache.paged import CACHE_MODES

    p.add_argument("--cache-mode", choices=list(CACHE_MODES), default="auto",
                   help="KV-cache precision (default auto: fp16 on the CPU, else the model's dtype; as `exl serve`)")


def check_sampling_arguments(args):
    if args.max_new_tokens < 1:
        raise ExlError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise ExlError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ExlError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise ExlError(f"--top-k must be >= 0, got {args.top_k}")


def add_arguments(p):
    p.add_argument("-m", "--model", required=True, help="model folder (dense or exl-quantized)")
    p.add_argument("-p", "--prompt", required=True, help="text to complete (use - to read stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_arguments(p)
    p.add_argument("--stats", action="store_true", help="print speed to stderr at the end")
    from exl.parallel import add_parallel_arguments

    add_parallel_arguments(p)


def run(args) -> int:
    from exl.runtime import load_for_cli
    from exl.simple import Stats, make_generator, stream
    from exl.tokenizer import Tokenizer

    check_sampling_arguments(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    tokenizer = Tokenizer.from_dir(args.model)
    model = load_for_cli(args.model, args, progress=sys.stderr.isatty())
    if args.chat:
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]),
                               add_bos=False)
    else:
        ids = tokenizer.encode(prompt)
    ctx = model.config.max_position_embeddings
    if len(ids) >= ctx:
        raise ExlError(f"the prompt is {len(ids)} tokens; this model's context is {ctx}")
    gen = make_generator(model, tokenizer, min(ctx, len(ids) + args.max_new_tokens), cache_mode=args.cache_mode)
    stats = Stats()
    for chunk in stream(model, tokenizer, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                        args.seed, stats=stats, generator=gen):
        sys.stdout.write(chunk)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.stats:
        print(f"[{stats.prompt_tokens} prompt tokens at {stats.prefill_tps:.1f} tok/s, "
              f"{stats.new_tokens} new at {stats.decode_tps:.1f} tok/s, stop: {stats.stop_reason}]", file=sys.stderr)
    return 0
