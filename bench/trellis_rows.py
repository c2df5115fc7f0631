"""What the output-side rotation costs trellis codes: every decoder matrix of the rotated SmolLM2 trellis-coded at
one width, (a) as format version 2 did it (su+sv: both sides rotated, every row of a tile weighing the same) and
(b) with the input-side rotation only and the Viterbi's cost per row times that row's Fisher weight, so a walk
puts its error where the output is least sensitive. Both are dequantized into dense copies of the model and
evaluated like bench/quality.py (12 windows of 512 tokens, KLD against the float32 run).

    python bench/trellis_rows.py                 # K = 3, rotation seeds 0 and 1
    python bench/trellis_rows.py --bits 2 --seeds 0

The experiment for issue 13 that led to format version 3 (docs/quantization.md, "Found later on 2026-12-07"):
(b) is what convert.py writes since then. Hessians come from the float model (not the
converter's sequential ones), the Fisher from the converter's own pass (4 calibration rows); no scale refit.
The weighted walks are `quant.trellis.ldlq(..., row_weights=...)`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import quality as Q  # noqa: E402
from exl.threads import fix_threads  # noqa: E402
from quant import trellis as TR  # noqa: E402
from quant.candidates import trellis_candidates  # noqa: E402
from quant.layer import factor, row_weights, unrotate  # noqa: E402
from quant.options import QuantOptions  # noqa: E402
from quant.transform import Transform, prepare  # noqa: E402

VARIANTS = {"su+sv (format version 2)": (Transform(True, True, False), False),
            "su, Fisher-weighted walks": (Transform(True, False, False), True)}


def hessians(rot: Path, tok, rows: int = 32, length: int = 512) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    from calibration.rows import builtin_rows

    model = AutoModelForCausalLM.from_pretrained(rot, dtype=torch.float32).eval()
    ids, _ = builtin_rows(tok, rows, length, 0)
    mods = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    h: dict[str, torch.Tensor] = {}

    def hook(name):
        def f(_, inp):
            x = inp[0].reshape(-1, inp[0].shape[-1]).float()
            h[name] = h.get(name, 0) + x.T @ x
        return f

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in mods.items()]
    with torch.no_grad():
        for i in range(0, ids.shape[0], 4):
            model(ids[i:i + 4])
    for x in handles:
        x.remove()
    return h


def fisher(rot: Path, work: Path) -> dict[str, torch.Tensor]:
    from calibration.rows import builtin_rows
    from exl.tokenizer import Tokenizer
    from quant import passes
    from quant.convert import SourceModel
    from quant.workdir import WorkDir

    src = SourceModel(str(rot), torch.device("cpu"))
    ids, _ = builtin_rows(Tokenizer.from_dir(rot), 4, 512, 0)
    return passes.fisher_pass(src, WorkDir(work), ids, 0, False)


def experiment_inputs(tmp: Path):
    """What the whole-model trellis experiments share: the rotated SmolLM2, the converter's Fisher, float-model
    Hessians, the float state dict and an evaluator (12 windows of 512 tokens) holding the float32 reference."""
    from safetensors.torch import load_file

    from calibration.evaltext import eval_tokens
    from exl.tokenizer import Tokenizer

    rot = Q.rotated_model(0)
    tok = Tokenizer.from_dir(rot)
    fw, hs = fisher(rot, tmp / "work"), hessians(rot, tok)
    ev = Q.Evaluator(eval_tokens(tok), 512, 12)
    ev.reference("exl", Q.exl_logits(rot), batch=4)
    return rot, fw, hs, load_file(str(rot / "model.safetensors")), ev


def evaluate_dense(rot: Path, ev, weights: dict[str, torch.Tensor], tmp: Path) -> dict:
    """ppl and KLD of a dense copy of the rotated model with these weights (written under tmp)."""
    from safetensors.torch import save_file

    folder = tmp / "model"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(rot, folder)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return ev.evaluate(Q.exl_logits(folder), "exl", batch=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, default=3, help="trellis bits per weight for every matrix (code 3 up to 4)")
    ap.add_argument("--seeds", default="0,1", help="rotation seeds (each a full pair of conversions)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    fix_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="exl-trellis-rows-"))
    try:
        rot, fw, hs, sd, ev = experiment_inputs(tmp)
        rows = []
        for seed in (int(s) for s in args.seeds.split(",")):
            for label, (t, weighted) in VARIANTS.items():
                t0, out = time.time(), dict(sd)
                for name, h in hs.items():
                    w = sd[name + ".weight"].float()
                    meta = trellis_candidates(*w.shape, (args.bits,), 12)[0].meta()
                    p = prepare(w, h.double(), t, seed, name)
                    u, _ = factor(p.h, QuantOptions())
                    rw = row_weights(fw[name].float(), t) if weighted else torch.ones(w.shape[0])
                    q = TR.ldlq(p.w, u, [meta], refit=False, want_words=False, row_weights=rw / rw.mean())[0].q
                    out[name + ".weight"] = unrotate(p, q).to(sd[name + ".weight"].dtype).contiguous()
                r = evaluate_dense(rot, ev, out, tmp)
                rows.append((seed, label, r["ppl"], r["kld"]))
                print(f"seed {seed}, {label}: ppl {r['ppl']:.3f}, KLD {r['kld']:.4f} ({time.time() - t0:.0f} s)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nEvery decoder matrix trellis K={args.bits} (code 3, L=12), {args.threads} threads:\n")
    print("| rotation seed | coding | ppl | KLD |\n|---|---|---|---|")
    for seed, label, ppl, kld in rows:
        print(f"| {seed} | {label} | {ppl:.3f} | {kld:.4f} |")


if __name__ == "__main__":
    main()
