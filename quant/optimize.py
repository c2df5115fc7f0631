"""Choose one candidate setting per matrix: smallest predicted ΔKL of the whole model at a bit budget.

The problem is a multiple-choice knapsack: minimise Σ_i kl_i(c_i) subject to Σ_i bits_i(c_i) ≤ B with
B = target_bpw · Σ_i N_i K_i. Predicted ΔKL adds up over layers (small independent perturbations).
It is solved exactly by dynamic programming over the budget, discretised into `cells` units (bits
rounded to the nearest unit), then repaired on exact bit counts: while over budget, the downgrade
that costs the least ΔKL per saved bit is applied; while an upgrade fits, the one that buys the most
ΔKL per bit is applied.
"""

from __future__ import annotations

import numpy as np

from exl.errors import ExlError

TOLERANCE = 0.02  # bpw


class TargetError(ExlError):
    """The bits-per-weight target cannot be reached with the measured candidates."""


def pareto(cands: list[dict]) -> list[dict]:
    """Candidates not dominated by a cheaper-or-equal one with lower-or-equal ΔKL, by increasing bits."""
    out = []
    for c in sorted(cands, key=lambda c: (c["bits"], c["kl"])):
        if not out or c["kl"] < out[-1]["kl"]:
            out.append(c)
    return out


def _repair(choice: list[int], options: list[list[dict]], budget: float) -> list[int]:
    used = sum(options[i][c]["bits"] for i, c in enumerate(choice))
    while used > budget:  # cheapest downgrade (ΔKL per saved bit)
        best = None
        for i, c in enumerate(choice):
            for d in range(c):
                saved = options[i][c]["bits"] - options[i][d]["bits"]
                cost = (options[i][d]["kl"] - options[i][c]["kl"]) / saved
                if best is None or cost < best[0]:
                    best = (cost, i, d)
        if best is None:
            break
        _, i, d = best
        used -= options[i][choice[i]]["bits"] - options[i][d]["bits"]
        choice[i] = d
    while True:  # best upgrade that still fits
        best = None
        for i, c in enumerate(choice):
            for d in range(c + 1, len(options[i])):
                extra = options[i][d]["bits"] - options[i][c]["bits"]
                if used + extra > budget:
                    break
                gain = (options[i][c]["kl"] - options[i][d]["kl"]) / extra
                if best is None or gain > best[0]:
                    best = (gain, i, d)
        if best is None:
            return choice
        _, i, d = best
        used += options[i][d]["bits"] - options[i][choice[i]]["bits"]
        choice[i] = d


def optimize(layers: list[dict], target_bpw: float, cells: int = 40000) -> dict:
    """layers: measurement records ({name, shape, transform, candidates: [{setting, bits, kl}]}).

    Returns {"bpw", "predicted_kl", "bits", "weights", "choices": {name: {setting, transform, bits, kl}}}.
    """
    weights = sum(r["shape"][0] * r["shape"][1] for r in layers)
    budget = target_bpw * weights
    options = [pareto(r["candidates"]) for r in layers]
    lo = sum(o[0]["bits"] for o in options) / weights
    hi = sum(o[-1]["bits"] for o in options) / weights
    if target_bpw < lo - TOLERANCE or target_bpw > hi + TOLERANCE:
        raise TargetError(f"a target of {target_bpw:g} bits per weight is out of reach: the measured settings "
                          f"give {lo:.3f} to {hi:.3f} bpw for this model. Choose -b in that range.")
    base = sum(o[0]["bits"] for o in options)
    spare = budget - base
    if spare <= 0:
        choice = [0] * len(options)
    else:
        unit = max(spare, 1.0) / cells
        dp = np.zeros(cells + 1)  # dp[b]: least ΔKL with extra cost at most b units
        dp += sum(o[0]["kl"] for o in options)
        back = np.zeros((len(options), cells + 1), dtype=np.int16)
        for i, o in enumerate(options):
            new = np.full(cells + 1, np.inf)
            arg = np.zeros(cells + 1, dtype=np.int16)
            for c, cand in enumerate(o):
                cost = int(round((cand["bits"] - o[0]["bits"]) / unit))
                if cost > cells:
                    break
                val = np.full(cells + 1, np.inf)
                val[cost:] = dp[: cells + 1 - cost] + (cand["kl"] - o[0]["kl"])
                better = val < new
                new[better], arg[better] = val[better], c
            dp, back[i] = new, arg
        b = cells
        choice = [0] * len(options)
        for i in range(len(options) - 1, -1, -1):
            c = int(back[i, b])
            choice[i] = c
            b -= int(round((options[i][c]["bits"] - options[i][0]["bits"]) / unit))
    choice = _repair(choice, options, budget)
    chosen = {r["name"]: {"setting": options[i][c]["setting"], "transform": options[i][c].get("transform", r["transform"]),
                          "bits": options[i][c]["bits"], "kl": options[i][c]["kl"]}
              for i, (r, c) in enumerate(zip(layers, choice))}
    bits = sum(v["bits"] for v in chosen.values())
    return {"target": target_bpw, "bpw": bits / weights, "bits": bits, "weights": weights,
            "predicted_kl": sum(v["kl"] for v in chosen.values()), "choices": chosen}


def fixed_plan(layers: list[dict], setting: str) -> dict:
    """Every matrix at one setting (uniform baselines)."""
    chosen = {}
    for r in layers:
        c = next((c for c in r["candidates"] if c["setting"] == setting), None)
        if c is None:
            raise TargetError(f"setting {setting} was not measured for {r['name']}")
        chosen[r["name"]] = {"setting": setting, "transform": c.get("transform", r["transform"]), "bits": c["bits"],
                             "kl": c["kl"]}
    weights = sum(r["shape"][0] * r["shape"][1] for r in layers)
    bits = sum(v["bits"] for v in chosen.values())
    return {"target": bits / weights, "bpw": bits / weights, "bits": bits, "weights": weights,
            "predicted_kl": sum(v["kl"] for v in chosen.values()), "choices": chosen}
