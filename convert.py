"""Quantize a model: `python convert.py -i MODEL -o OUT -b 4.25` (same as `exl convert`; --help for options)."""

import argparse
import sys

from exl.commands.convert import add_arguments, run
from exl.errors import ExlError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="convert.py", description="quantize a model to a bits-per-weight target")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ExlError as e:
        print(f"convert.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted (resume with -r)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
