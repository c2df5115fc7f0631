"""Would trellis widths per 16-row tile row (not per matrix) pay? Since format version 3 a trellis matrix's rows are
its output channels, whose Fisher weights differ widely inside one matrix (q_proj: max/mean 34-82), so the bits
could follow the rows. This experiment encodes every decoder matrix of the rotated SmolLM2 at K = 1..6 (code 3 up
to 4, code 1 above, L = 12; input rotation, Fisher-weighted walks: what convert.py writes), prices every tile row
at every K by its Fisher-weighted error, and allocates the bits two ways at each target bpw with the same
Lagrangian rule: (a) one K per matrix (today's format), (b) one K per tile row. Both allocations are assembled from
the same encodings into dense copies of the model and evaluated like bench/quality.py (12 windows of 512 tokens,
KLD against the float32 run).

    python bench/trellis_tile_widths.py                     # 2.5, 3.0 and 4.0 bpw
    python bench/trellis_tile_widths.py --targets 3.0

An experiment for issue 13, not a runtime path: (b) needs a format with a width per tile row. Hessians come from
the float model (non-sequential, as bench/trellis_rows.py), the Fisher from the converter's own pass (4 rows);
bits count the walks only (scales, signs and tables are the same under (a) and (b)).
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

from exl import format as F  # noqa: E402
from exl.threads import fix_threads  # noqa: E402
from quant import trellis as TR  # noqa: E402
from quant.candidates import trellis_candidates  # noqa: E402
from quant.layer import TRELLIS_TRANSFORM, factor, unrotate, walk_weights  # noqa: E402
from quant.options import QuantOptions  # noqa: E402
from quant.transform import prepare  # noqa: E402
from trellis_rows import evaluate_dense, experiment_inputs  # noqa: E402

WIDTHS = (1, 2, 3, 4, 5, 6)


def encode(name: str, w: torch.Tensor, h: torch.Tensor, f: torch.Tensor, seed: int):
    """Per tile row and K: Fisher-weighted error [tiles, len(WIDTHS)] and the rotated codes per K (float16)."""
    t = TRELLIS_TRANSFORM
    p = prepare(w, h.double(), t, seed, name)
    u, _ = factor(p.h, QuantOptions())
    metas = [trellis_candidates(*w.shape, (k,), 12)[0].meta() for k in WIDTHS]
    results = TR.ldlq(p.w, u, metas, row_weights=walk_weights(f, t), want_words=False)
    err = torch.stack([(r.row_err.double().cpu() * f.double()).view(-1, F.TILE).sum(1) for r in results], 1)
    return p, err, [r.q.half() for r in results]


def allocate(errs: list[torch.Tensor], cols: list[int], budget: float) -> list[torch.Tensor]:
    """The K index of each item (row of errs[m], costing K * 16 * cols[m] bits) minimising the summed error with
    at most `budget` bits: each item takes argmin err + λ bits, λ bisected (the same rule at any granularity)."""
    widths = torch.tensor(WIDTHS, dtype=torch.float64)

    def pick(lam):
        choice = [torch.argmin(e + lam * widths * F.TILE * c, 1) for e, c in zip(errs, cols)]
        bits = sum(float(widths[k].sum()) * F.TILE * c for k, c in zip(choice, cols))
        return choice, bits

    lo, hi = 0.0, 1.0
    while pick(hi)[1] > budget:
        hi *= 4
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if pick(mid)[1] <= budget else (mid, hi)
    return pick(hi)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default="2.5,3.0,4.0", help="average trellis bits per weight (walks only)")
    ap.add_argument("--seed", type=int, default=0, help="rotation seed")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    fix_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="exl-trellis-tiles-"))
    rows = []
    try:
        rot, fw, hs, sd, ev = experiment_inputs(tmp)
        t0 = time.time()
        enc = {}
        for i, (name, h) in enumerate(hs.items()):
            enc[name] = encode(name, sd[name + ".weight"].float(), h, fw[name].float(), args.seed)
            print(f"\rencoded {i + 1}/{len(hs)} matrices ({time.time() - t0:.0f} s)", end="", flush=True)
        print()
        names = list(enc)
        cols = [sd[n + ".weight"].shape[1] for n in names]
        weights = sum(sd[n + ".weight"].numel() for n in names)
        ways = {"one K per matrix": ([enc[n][1].sum(0, keepdim=True) for n in names],  # a matrix's tile rows summed
                                     [c * enc[n][1].shape[0] for n, c in zip(names, cols)]),
                "one K per tile row": ([enc[n][1] for n in names], cols)}
        for target in (float(x) for x in args.targets.split(",")):
            for label, (errs, item_cols) in ways.items():
                choice = allocate(errs, item_cols, target * weights)
                out, predicted, bits = dict(sd), 0.0, 0.0
                for n, c, k in zip(names, cols, choice):
                    p, err, qs = enc[n]
                    kt = k.expand(err.shape[0])  # each tile row's K index (a matrix's one K, repeated)
                    tiles = torch.arange(err.shape[0])
                    predicted += float(err[tiles, kt].sum())
                    bits += float(torch.tensor(WIDTHS)[kt].sum()) * F.TILE * c
                    q = torch.stack(qs)[kt.repeat_interleave(F.TILE), torch.arange(err.shape[0] * F.TILE)].float()
                    out[n + ".weight"] = unrotate(p, q).to(sd[n + ".weight"].dtype).contiguous()
                r = evaluate_dense(rot, ev, out, tmp)
                rows.append((target, label, bits / weights, predicted, r["ppl"], r["kld"]))
                print(f"{target} bpw, {label}: {bits / weights:.3f} bpw of walks, Fisher-weighted error {predicted:.4g}, "
                      f"ppl {r['ppl']:.3f}, KLD {r['kld']:.4f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nTrellis widths per matrix or per tile row (K = 1..6, L = 12, rotation seed {args.seed}), "
          f"{args.threads} threads:\n")
    print("| target bpw | widths | walks bpw | Fisher-weighted error | ppl | KLD |\n|---|---|---|---|---|---|")
    for target, label, bpw, pred, ppl, kld in rows:
        print(f"| {target} | {label} | {bpw:.3f} | {pred:.4g} | {ppl:.3f} | {kld:.4f} |")


if __name__ == "__main__":
    main()
