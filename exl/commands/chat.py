"""`exl chat`: an interactive chat in the terminal, using the model's chat template."""

from __future__ import annotations

import sys

from exl.commands.generate import add_sampling_arguments, check_sampling_arguments


def add_arguments(p):
    p.add_argument("-m", "--model", required=True, help="model folder (dense or exl-quantized)")
    p.add_argument("-s", "--system", default=None, help="system prompt")
    add_sampling_arguments(p)
    p.set_defaults(max_new_tokens=512)
    try:
        from exl.parallel import add_parallel_arguments
    except ImportError:
        pass
    else:
        add_parallel_arguments(p)


def chat_turn(model, tokenizer, messages, args, out=sys.stdout):
    """Generate the assistant's reply to `messages`, streaming it to `out`; returns (text, stats)."""
    from exl.simple import Stats, stream

    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_bos=False)
    stats, parts = Stats(), []
    for chunk in stream(model, tokenizer, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                        args.seed, stats=stats):
        parts.append(chunk)
        out.write(chunk)
        out.flush()
    out.write("\n")
    return "".join(parts), stats


def run(args) -> int:
    from exl.runtime import load_for_cli
    from exl.tokenizer import Tokenizer

    check_sampling_arguments(args)
    tokenizer = Tokenizer.from_dir(args.model)
    model = load_for_cli(args.model, args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print("exl chat — empty line or Ctrl-D to quit, /reset to forget the conversation", file=sys.stderr)
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        if not line.strip():
            if interactive:
                break
            continue
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        if interactive:
            sys.stdout.write("assistant> ")
        reply, stats = chat_turn(model, tokenizer, messages, args)
        messages.append({"role": "assistant", "content": reply})
        print(f"[{stats.new_tokens} tokens, {stats.decode_tps:.1f} tok/s]", file=sys.stderr)
    return 0
