"""The `exl` command line: one subcommand per module, imported lazily so `exl --help` is instant.

Each command module defines `add_arguments(parser)` and `run(args) -> int | None`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from exl.errors import ExlError

COMMANDS = {
    "import-gguf": ("exl.gguf_import", "convert a llama or gemma3 GGUF file into a Hugging Face folder"),
    "generate": ("exl.commands.generate", "complete a prompt"),
    "chat": ("exl.commands.chat", "chat interactively with a model"),
    "eval": ("exl.commands.eval", "evaluate perplexity and KL-divergence"),
    "convert": ("exl.commands.convert", "quantize a model (same as convert.py)"),
    "bench": ("exl.commands.bench", "measure prompt and generation speed (llama-bench style)"),
    "serve": ("exl.commands.serve", "run the OpenAI-compatible server"),
    "info": ("exl.commands.info", "print versions, kernel builds, GPUs and settings (for bug reports)"),
}


def _available():
    out = {}
    for name, (module, help_) in COMMANDS.items():
        if importlib.util.find_spec(module) is not None:
            out[name] = (module, help_)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="exl", description="exl: quantize and run LLMs locally")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in _available().items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == chosen:  # only import the module actually used
            importlib.import_module(module).add_arguments(p)
            p.set_defaults(_module=module)
        else:
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return importlib.import_module(args._module).run(args) or 0
    except ExlError as e:
        print(f"exl {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
