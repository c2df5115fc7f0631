"""The final conversion table: per-layer chosen setting, error and bits; totals; the prediction check."""

from __future__ import annotations


def format_report(r: dict) -> str:
    lines = [f"{'layer':<40} {'setting':<16} {'transform':<11} {'bpw':>6} {'rel.err':>9} {'pred.ΔKL':>9}"]
    lines.append("-" * len(lines[0]))
    for s in r["layers"]:
        n = s["name"].replace("model.layers.", "")
        lines.append(f"{n:<40} {s['setting']:<16} {s['transform']:<11} {s.get('bpw', 0):>6.3f} "
                     f"{s['rel']:>9.2e} {s['predicted_kl']:>9.2e}")
    ev = r["eval"]
    head = r["head"]
    lines.append("-" * len(lines[0]))
    lines.append(f"decoder linears: {r['measured_bpw']:.4f} bpw (target {r['target_bpw']:g})   "
                 f"head: {r['head_bpw']:.3f} bpw" + (f" ({head['setting']})" if head else " (unquantized)"))
    lines.append(f"predicted KL (decoder): {r['predicted_kl']:.4f}   measured KL on {ev['tokens']} calibration tokens: "
                 f"{ev['kl_body']:.4f} (decoder only), {ev['kl']:.4f} (with head)")
    lines.append(f"calibration perplexity: {ev['ppl']:.3f} (unquantized {ev['ppl_reference']:.3f})")
    if "timings" in r:
        lines.append("time: " + ", ".join(f"{k} {v:.0f}s" for k, v in r["timings"].items()))
    return "\n".join(lines)
