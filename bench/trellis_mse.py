"""Mean squared error per weight of the trellis code on iid Gaussian data (docs/quantization.md).

    python bench/trellis_mse.py                    # the table: K x L, scalar Lloyd-Max and uniform grids
    python bench/trellis_mse.py --constants 40     # the code constants A, B: 40 random pairs and the known ones

Data: N(0, 1) samples cut into 256-weight tiles, each one circular walk (tail-biting, the encoder's
two passes). A tile's scale is alpha / CODE_SIGMA; alpha is searched per (K, L). Relative MSE = MSE / 1.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from exl.threads import fix_threads

from exl.format import TrellisMeta
from quant import trellis as T

KNOWN_CONSTANTS = {  # (A, B): name
    (0x2C6FE96B, 0x1B873593): "exl default",
    (34038481, 76625530): "QTIP 1MAD",
}


def trellis_mse(k: int, L: int, tiles: int, alphas=None, mul=None, add=None, seed=0) -> tuple[float, float, float]:
    """(best relative MSE, its alpha, encode seconds) for K bits, L state bits."""
    meta = TrellisMeta(k, L, **({} if mul is None else {"mul": mul, "add": add}))
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(tiles, 256, generator=g)
    vals = T.codebook(meta)
    best = (float("inf"), 0.0, 0.0)
    for a in alphas or (0.8, 0.9, 1.0, 1.1):
        t0 = time.time()
        states, _ = T.encode_tiles([data * T.CODE_SIGMA / a], [torch.ones_like(data)], [meta])[0]
        dt = time.time() - t0
        mse = float(((vals[states.long()] * a / T.CODE_SIGMA - data) ** 2).mean())
        if mse < best[0]:
            best = (mse, a, dt)
    return best


def lloyd_max(k: int, n: int = 1_000_000, iters: int = 1000, seed=0) -> float:
    """MSE of the 2^k-level Lloyd-Max quantizer of N(0,1) (fitted on n samples; converges slowly for many levels,
    hence the many iterations: 2.499e-3 at 5 bits, Max's table)."""
    x = np.random.default_rng(seed).standard_normal(n)
    levels = np.quantile(x, (np.arange(2**k) + 0.5) / 2**k)
    for _ in range(iters):
        edges = (levels[1:] + levels[:-1]) / 2
        idx = np.searchsorted(edges, x)
        cnt = np.bincount(idx, minlength=2**k)
        levels = np.where(cnt > 0, np.bincount(idx, weights=x, minlength=2**k) / np.maximum(cnt, 1), levels)
    edges = (levels[1:] + levels[:-1]) / 2
    return float(((x - levels[np.searchsorted(edges, x)]) ** 2).mean())


def uniform_grid(k: int, n: int = 400_000, seed=0) -> float:
    """MSE of the format's centred uniform grid s·(q − (2^k−1)/2) on N(0,1) at the best step s."""
    x = np.random.default_rng(seed).standard_normal(n)
    c = (2**k - 1) / 2
    best = float("inf")
    for s in np.linspace(0.02, 2.0, 400):
        q = np.clip(np.round(x / s + c), 0, 2**k - 1)
        best = min(best, float(((x - s * (q - c)) ** 2).mean()))
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", type=int, default=64)
    ap.add_argument("--bits", default="1,2,3,4,5,6")
    ap.add_argument("--state-bits", default="8,10,12,14,16")
    ap.add_argument("--constants", type=int, default=0, metavar="N",
                    help="compare the known and N random code constants (K=2, 3 at L=12), then the best five "
                         "again on fresh data")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    fix_threads(args.threads)
    if args.constants:
        rng = np.random.default_rng(1)
        cands = dict(KNOWN_CONSTANTS)
        for _ in range(args.constants):
            cands[(int(rng.integers(0, 2**31)) * 2 + 1, int(rng.integers(0, 2**32)))] = "random"
        scores = {}
        for (a, b), name in cands.items():
            scores[(a, b)] = sum(trellis_mse(k, 12, args.tiles, (1.1,), a, b)[0] / ref
                                 for k, ref in ((2, 0.0755), (3, 0.0201)))
        keep = sorted(scores, key=scores.get)[:5] + [c for c in KNOWN_CONSTANTS if c not in sorted(scores, key=scores.get)[:5]]
        print(f"{len(cands)} constants screened on {args.tiles} tiles; the best five and the known ones on "
              f"{4 * args.tiles} fresh tiles (seed 7):")
        print("| A | B | source | K=2 L=12 | K=3 L=12 | K=4 L=12 | K=2 L=14 |\n|---|---|---|---|---|---|---|")
        for a, b in keep:
            ms = [trellis_mse(k, L, 4 * args.tiles, (1.1,), a, b, seed=7)[0] for k, L in ((2, 12), (3, 12), (4, 12), (2, 14))]
            print(f"| 0x{a:08X} | 0x{b:08X} | {cands[(a, b)]} | " + " | ".join(f"{m:.4f}" for m in ms) + " |", flush=True)
        return
    bits = [int(b) for b in args.bits.split(",")]
    ls = [int(v) for v in args.state_bits.split(",")]
    print(f"relative MSE on N(0,1), {args.tiles} tiles x 256 weights; best alpha in parentheses")
    print("| K | " + " | ".join(f"trellis L={L}" for L in ls) + " | Lloyd-Max | uniform grid | D(R)=2^-2K |")
    print("|---" * (len(ls) + 4) + "|")
    for k in bits:
        cells = []
        for L in ls:
            if L <= k:
                cells.append("—")
                continue
            mse, a, dt = trellis_mse(k, L, args.tiles, (0.9, 1.0, 1.1, 1.2, 1.3))
            cells.append(f"{mse:.4f} ({a:g}; {args.tiles * 256 / dt / 1e6:.2f} Mw/s)")
        print(f"| {k} | " + " | ".join(cells) + f" | {lloyd_max(k):.4f} | {uniform_grid(k):.4f} | {2.0 ** (-2 * k):.4f} |",
              flush=True)


if __name__ == "__main__":
    main()
