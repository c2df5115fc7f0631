"""`exl chat`: an interactive chat in the terminal, using the model's chat template.

One Generator and its paged cache live for the whole conversation: each turn's prompt is the whole
conversation again, and the cache finds the pages of the earlier turns (prompt and reply) by their
tokens, so a turn computes only what is new: the last reply's end and the new message.
"""

from __future__ import annotations

import sys

from exl.commands.generate import add_sampling_arguments, check_sampling_arguments
from exl.errors import ExlError

DEFAULT_CACHE_TOKENS = 8192  # the conversation's room, capped by the model's context


def add_arguments(p):
    p.add_argument("-m", "--model", required=True, help="model folder (dense or exl-quantized)")
    p.add_argument("-s", "--system", default=None, help="system prompt")
    add_sampling_arguments(p)
    p.add_argument("--cache-size", type=int, default=None,
                   help=f"KV-cache size in tokens: the longest conversation (default: the model's context, at "
                        f"most {DEFAULT_CACHE_TOKENS})")
    p.set_defaults(max_new_tokens=512)
    from exl.parallel import add_parallel_arguments

    add_parallel_arguments(p)


def chat_turn(generator, messages, args, out=sys.stdout):
    """Generate the assistant's reply to `messages` on `generator`, streaming it to `out`; returns (text, stats),
    or (None, None) when the conversation no longer fits in the cache."""
    from exl.simple import Stats, stream

    tokenizer, model = generator.tokenizer, generator.model
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_bos=False)
    room = min(generator.cache.max_tokens + 1, model.config.max_position_embeddings) - len(ids)
    if room < 1:
        return None, None
    stats, parts = Stats(), []
    for chunk in stream(model, tokenizer, ids, min(args.max_new_tokens, room), args.temperature, args.top_k,
                        args.top_p, args.seed, stats=stats, generator=generator):
        parts.append(chunk)
        out.write(chunk)
        out.flush()
    out.write("\n")
    return "".join(parts), stats


def run(args) -> int:
    from exl.runtime import load_for_cli
    from exl.simple import make_generator
    from exl.tokenizer import Tokenizer

    check_sampling_arguments(args)
    if args.cache_size is not None and args.cache_size < 16:
        raise ExlError(f"--cache-size must be at least 16 tokens, got {args.cache_size}")
    tokenizer = Tokenizer.from_dir(args.model)
    model = load_for_cli(args.model, args)
    size = args.cache_size or min(model.config.max_position_embeddings, DEFAULT_CACHE_TOKENS)
    generator = make_generator(model, tokenizer, size, cache_mode=args.cache_mode)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print("exl chat — /exit, an empty line or Ctrl-D to quit; /reset to forget the conversation", file=sys.stderr)
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        command = line.strip()
        if command == "/exit" or (not command and interactive):
            break
        if not command:
            continue
        if command == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        if interactive:
            sys.stdout.write("assistant> ")
        reply, stats = chat_turn(generator, messages, args)
        if reply is None:
            messages.pop()
            print(f"[the conversation no longer fits in the cache ({generator.cache.max_tokens} tokens): /reset, or "
                  f"restart with a larger --cache-size]", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": reply})
        print(f"[{stats.new_tokens} tokens, {stats.decode_tps:.1f} tok/s; prompt {stats.prompt_tokens} tokens, "
              f"{stats.cached_tokens} from the cache]", file=sys.stderr)
    return 0
