"""`exl convert` / `python convert.py`: quantize a model to a bits-per-weight target (see quant.convert)."""

from __future__ import annotations

import argparse


def whole_number(unit: str, bound: str):
    """An argparse type: a whole number of `unit` from 0 to quant.options' `bound` (QuantOptions checks it too)."""

    def parse(text: str) -> int:
        import quant.options

        top = getattr(quant.options, bound)
        if not text.strip().isdigit() or int(text) > top:
            raise argparse.ArgumentTypeError(f"takes a whole number of {unit} from 0 to {top}, not {text!r}")
        return int(text)

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.add_argument("-i", "--input", required=True, help="input model: a Hugging Face folder (config.json + *.safetensors)")
    p.add_argument("-o", "--output", required=True, help="output folder for the quantized model")
    p.add_argument("-b", "--bits", type=float, required=True,
                   help="target bits per weight over the decoder's linear layers (2.0-8.5), all stored bits counted")
    p.add_argument("-hb", "--head-bits", type=int, default=6, help="bits of the output head (2-8); 16 keeps it unquantized")
    p.add_argument("-w", "--work", default=None, help="work folder for resumable state (default: OUT/work, removed when done)")
    p.add_argument("-r", "--resume", action="store_true", help="resume the conversion in the work folder after a crash or kill")
    p.add_argument("-c", "--calibration", default=None,
                   help="calibration data: parquet, jsonl, json, txt, csv, arrow file or a saved `datasets` folder with a "
                        "text column (default: the built-in corpus of Python docstrings, code and chats)")
    p.add_argument("--calibration-column", default=None, help="text column of -c (default: 'text', else the first string column)")
    p.add_argument("-cr", "--calibration-rows", type=int, default=24, help="calibration rows")
    p.add_argument("-cl", "--calibration-length", type=int, default=512, help="tokens per calibration row")
    p.add_argument("-m", "--measurement", default=None,
                   help="reuse measurement.json (file, or the output folder of an earlier conversion of the same model) "
                        "to convert to another size without measuring again")
    p.add_argument("--seed", type=int, default=0, help="seed for the calibration corpus, random signs and the Fisher pass")
    p.add_argument("-ss", "--shard-size", type=int, default=4096, help="maximum shard size in MB")
    p.add_argument("--codes", choices=("auto", "scalar", "trellis"), default="auto",
                   help="weight codes: auto chooses per matrix between scalar and trellis codes by predicted quality at "
                        "the bit budget; scalar or trellis restricts to one kind (docs/format.md §1, §7)")
    p.add_argument("--trellis-passes", type=whole_number("passes", "MAX_TRELLIS_PASSES"), default=0, metavar="N",
                   help="refinement passes after block LDLQ for each trellis-coded matrix (one lowers its error by "
                        "~1-5%% and costs one more encoding; no KLD gain measured on SmolLM2, docs/quantization.md)")
    p.add_argument("--tune", type=whole_number("steps", "MAX_TUNE_STEPS"), default=0, metavar="N",
                   help="after quantizing, tune trellis row scales and norm weights end to end for N steps of 2 "
                        "calibration rows (KL to the original model; 72 lowered held-out KLD by 22%% at 2.0 bpw, 10%% "
                        "at 3.0 and 5%% at 4.0 and 5.0 on SmolLM2; ~10 min on 2 CPU cores; the float32 model must "
                        "fit the device)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars or final table")


def job_from_args(args):
    from quant.convert import Job
    from quant.options import QuantOptions

    options = QuantOptions(codes=getattr(args, "codes", "auto"), trellis_passes=getattr(args, "trellis_passes", 0),
                           tune_steps=getattr(args, "tune", 0))
    return Job(options=options, input=args.input, output=args.output, bits=args.bits, head_bits=args.head_bits, work=args.work,
               calibration=args.calibration, column=args.calibration_column, rows=args.calibration_rows,
               length=args.calibration_length, measurement=args.measurement, seed=args.seed,
               shard_mb=args.shard_size, device=args.device)


def run(args) -> int:
    import logging

    from quant.convert import convert  # the one place exl imports quant: only when converting

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    convert(job_from_args(args), resume=args.resume, progress=not args.quiet)
    return 0
