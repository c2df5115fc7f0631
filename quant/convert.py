"""The conversion pipeline: calibrate, measure, optimize, quantize, write.

    from quant.convert import Job, convert
    report = convert(Job("SmolLM2-135M-Instruct", "smol-4.25", bits=4.25))

Stages (each resumable, see quant.workdir): calibration rows -> Fisher pass -> measurement pass
(`measurement.json`) -> optimizer (`strategy.json`) -> quantization pass -> head -> output folder.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from exl import format as F
from exl.errors import ExlError
from quant import passes, tune
from quant.candidates import TRELLIS_PREFIX, TrellisSetting
from quant.faults import clean_tmp
from quant.model_parts import SourceModel
from quant.optimize import fixed_plan, optimize
from quant.options import QuantOptions
from quant.report import format_report
from quant.transform import Transform
from quant.workdir import WorkDir
from quant.writer import atomic_copy, copy_tokenizer, stored_dtype, write_config, write_shards, write_text

log = logging.getLogger("exl.quant")
MEASUREMENT_VERSION = 2  # 2: trellis candidates may appear (each with its own "transform"); 1 is read as scalar-only
MIN_TOKENS_PER_CHANNEL = 0.25  # refuse calibration with fewer tokens than this x the widest layer input
WARN_TOKENS_PER_CHANNEL = 2.0


class ConvertError(ExlError):
    """A conversion cannot start or continue (bad arguments, mismatched work folder or measurement)."""


@dataclass
class Job:
    input: str
    output: str
    bits: float
    head_bits: int = 6
    work: str | None = None
    calibration: str | None = None  # None: the built-in corpus
    column: str | None = None
    rows: int = 24
    length: int = 512
    measurement: str | None = None  # reuse a measurement.json (file or folder holding one)
    seed: int = 0
    shard_mb: int = 4096
    device: str | None = None
    options: QuantOptions = field(default_factory=QuantOptions)

    def work_dir(self) -> Path:
        return Path(self.work) if self.work else Path(self.output) / "work"

    def record(self) -> dict:
        """What must match for `-r` to continue this job."""
        d = asdict(self)
        d["options"] = self.options.to_dict()
        d["input"] = str(Path(self.input).resolve())
        d.pop("device")
        d.pop("work")
        d.pop("output")
        return d


def check_job(job: Job) -> None:
    if not 1.5 <= job.bits <= 9.0:
        raise ConvertError(f"-b {job.bits}: the target must be between 1.5 and 9.0 bits per weight "
                           "(2.0 to 8.5 is the useful range)")
    if job.head_bits != 16 and not 2 <= job.head_bits <= 8:
        raise ConvertError(f"-hb {job.head_bits}: head bits must be 2..8, or 16 to keep the head unquantized")
    if job.rows < 1 or job.length < 16:
        raise ConvertError(f"calibration of {job.rows} rows x {job.length} tokens is too small (-cr >= 1, -cl >= 16)")
    if job.shard_mb < 1:
        raise ConvertError("-ss: the shard size must be at least 1 MB")
    if not Path(job.input).is_dir():
        raise ConvertError(f"-i {job.input}: not a folder. Pass a Hugging Face model folder (config.json + *.safetensors).")


def _device(job: Job) -> torch.device:
    if job.device:
        return torch.device(job.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _prepare_work(job: Job, resume: bool) -> WorkDir:
    out, work = Path(job.output), job.work_dir()
    record = job.record()
    if (work / "job.json").is_file():
        old = json.loads((work / "job.json").read_text())
        if not resume:
            raise ConvertError(f"{work} holds an unfinished conversion. Add -r to resume it, or delete the folder "
                               "(or choose another -w) to start over.")
        if old != record:
            diff = sorted(k for k in set(old) | set(record) if old.get(k) != record.get(k))
            raise ConvertError(f"-r: the conversion in {work} was started with different arguments ({', '.join(diff)}). "
                               "Resume with the same arguments, or delete the work folder to start over.")
    elif out.is_dir() and any(p for p in out.iterdir() if p.resolve() != work.resolve()) and not resume:
        raise ConvertError(f"-o {out} is not empty. Choose a new folder, delete it, or add -r to resume into it.")
    wd = WorkDir(work)
    wd.clean_tmp()
    clean_tmp(out)  # a run killed while writing the output folder left its half-written file there
    wd.save_json("job.json", record)
    return wd


def _calibration(job: Job, wd: WorkDir, src: SourceModel) -> tuple[torch.Tensor, dict]:
    if wd.exists("calibration.safetensors"):
        return wd.load_tensors("calibration.safetensors")["ids"], wd.load_json("calibration.json")
    from calibration import calibration_rows
    from exl.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(job.input)
    ids, info = calibration_rows(job.calibration, tokenizer, job.rows, job.length, job.seed, job.column)
    _check_vocab(ids, src)
    widest = max(src.config.hidden_size, src.config.intermediate_size, src.config.moe_intermediate_size or 0,
                 src.config.num_heads * src.config.head_dim)
    tokens = ids.numel()
    if tokens < MIN_TOKENS_PER_CHANNEL * widest:
        raise ConvertError(f"calibration has {tokens} tokens ({job.rows} rows x {job.length}); this model's widest "
                           f"layer has {widest} inputs and needs at least {math.ceil(MIN_TOKENS_PER_CHANNEL * widest)} "
                           f"(better {int(WARN_TOKENS_PER_CHANNEL * widest)}+). Raise -cr or -cl.")
    if tokens < WARN_TOKENS_PER_CHANNEL * widest:
        log.warning("calibration has only %d tokens for layers with %d inputs: Hessians are rank-deficient and "
                    "held together by damping; quality will suffer (raise -cr/-cl)", tokens, widest)
    wd.save_tensors("calibration.safetensors", {"ids": ids})
    wd.save_json("calibration.json", info)
    return ids, info


def _tune_rows(job: Job, src: SourceModel) -> torch.Tensor:
    """The rows of the tuning stage: 2 per step from the calibration source (its first rows are the Hessians')."""
    from calibration import CalibrationError, calibration_rows
    from exl.tokenizer import Tokenizer

    rows = tune.BATCH * job.options.tune_steps
    try:
        ids, _ = calibration_rows(job.calibration, Tokenizer.from_dir(job.input), rows, job.length, job.seed, job.column)
    except CalibrationError as e:
        raise ConvertError(f"--tune {job.options.tune_steps} needs {rows} calibration rows of {job.length} tokens: {e} "
                           "(or tune for fewer steps)") from e
    _check_vocab(ids, src)
    return ids


def _check_tune_memory(job: Job, src: SourceModel) -> None:
    """Refuse --tune now, before the long stages, when the tuning stage cannot fit the device."""
    try:
        tune.memory_plan(src, job.options.tune_steps, job.length)
    except tune.TuneMemoryError as e:
        raise ConvertError(f"--tune {job.options.tune_steps}: {e}. Tune on a device with more memory (--device), for "
                           "shorter rows (-cl), or convert without --tune") from e


def _check_vocab(ids: torch.Tensor, src: SourceModel) -> None:
    if int(ids.max()) >= src.config.vocab_size:
        raise ConvertError(f"calibration token id {int(ids.max())} is outside the model's vocabulary "
                           f"({src.config.vocab_size}); the tokenizer does not match the model")


def load_measurement(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "measurement.json"
    if not p.is_file():
        raise ConvertError(f"-m {path}: no measurement.json there. Pass the file, or the output/work folder of an "
                           "earlier conversion of the same model.")
    try:
        m = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConvertError(f"-m {p}: not valid JSON ({e})") from e
    if m.get("version") not in (1, MEASUREMENT_VERSION) or "layers" not in m:
        raise ConvertError(f"-m {p}: not an exl measurement (version 1 or {MEASUREMENT_VERSION})")
    return m


def serves_one_kind(key: dict, options: QuantOptions) -> bool:
    """Whether a measurement made with --codes auto (key: its options) serves a conversion with --codes scalar or
    --codes trellis: it priced both kinds of code under the same options, so the asked kind's candidates are
    there (trellis: the widths it measured; explicit --trellis widths must be among them)."""
    if key.get("codes") != "auto" or options.codes == "auto":
        return False
    want = options.measurement_key()
    if any(key.get(k) != v for k, v in want.items() if k not in ("codes", "trellis_bits", "state_bits")):
        return False
    if options.codes == "trellis":
        measured = set(key.get("trellis_bits") or ())
        asked = set(options.trellis_bits) if options.trellis_bits is not None else measured
        return key.get("state_bits") == options.state_bits and bool(asked) and asked <= measured
    return True


def one_kind(m: dict, options: QuantOptions) -> dict:
    """The measurement with only the candidates of --codes scalar / trellis (see `serves_one_kind`); a matrix
    that cannot be trellis-coded keeps its scalar candidates, as a --codes trellis measurement gives it."""
    if options.codes == "auto" or (m.get("options") or {}).get("codes") != "auto":
        return m
    trellis = options.codes == "trellis"
    widths = set(options.trellis_bits) if trellis and options.trellis_bits is not None else None

    def keep(c):
        name = c["setting"]
        if not name.startswith(TRELLIS_PREFIX):
            return False
        return widths is None or TrellisSetting.parse(name).bits in widths

    layers = []
    for r in m["layers"]:
        cands = [c for c in r["candidates"] if keep(c)] if trellis else \
            [c for c in r["candidates"] if not c["setting"].startswith(TRELLIS_PREFIX)]
        layers.append({**r, "candidates": cands or r["candidates"]})
    return {**m, "layers": layers}


def _check_measurement(m: dict, src: SourceModel, options: QuantOptions, path) -> None:
    for r in m["layers"]:
        name = f"{r['name']}.weight"
        if name not in src.loader or list(src.loader.info(name)[0]) != list(r["shape"]):
            raise ConvertError(f"-m {path}: it was measured on another model ({r['name']} "
                               f"{'is missing' if name not in src.loader else 'has another shape'} in {src.path})")
    if m.get("options") != options.measurement_key() and not serves_one_kind(m.get("options") or {}, options):
        hint = ""
        if "codes" not in (m.get("options") or {}) and options.codes != "scalar":
            hint = " It holds scalar settings only (made before trellis codes, or with --codes scalar): add --codes scalar."
        raise ConvertError(f"-m {path}: measured with other quantizer options ({m.get('options')}); "
                           f"measure again without -m.{hint}")


def convert(job: Job, resume: bool = False, progress: bool = True) -> dict:
    """Run (or resume) a conversion; returns the report dict (also written to OUT/quantization_report.json)."""
    t_start = time.time()
    check_job(job)
    dev = _device(job)
    src = SourceModel(job.input, dev)
    given = None
    if job.measurement:  # checked before anything is written: a refused -m leaves no work folder behind
        given = load_measurement(job.measurement)
        _check_measurement(given, src, job.options, job.measurement)
    wd = _prepare_work(job, resume)
    options = job.options
    timings = wd.load_json("timings.json") if wd.exists("timings.json") else {}

    def lap(stage, t0):
        timings[stage] = timings.get(stage, 0.0) + time.time() - t0
        wd.save_json("timings.json", timings)

    t0 = time.time()
    ids, calib_info = _calibration(job, wd, src)
    text_rows = ids.shape[0] - calib_info.get("random_rows", 0)
    eval_rows = max(1, min(options.fisher_rows, text_rows))
    tune_ids = _tune_rows(job, src) if options.tune_steps else None  # refused now, not after the long stages
    if options.tune_steps and not wd.exists("tune.safetensors"):  # a resume whose tuning is done needs no memory
        _check_tune_memory(job, src)
    lap("calibration", t0)

    # measurement
    if given is not None:
        measurement = one_kind(given, options)
    elif wd.exists("measurement.json"):
        measurement = wd.load_json("measurement.json")
    else:
        t0 = time.time()
        fisher = None
        if options.sensitivity == "fisher":
            fisher = passes.fisher_pass(src, wd, ids[:eval_rows], job.seed, progress)
        lap("fisher", t0)
        t0 = time.time()
        layers = passes.measure_pass(src, wd, ids, fisher or {}, options, job.seed, progress)
        measurement = {"version": MEASUREMENT_VERSION, "model": src.config.architecture,
                       "seed": job.seed, "options": options.measurement_key(), "calibration": calib_info,
                       "layers": layers}
        wd.save_json("measurement.json", measurement)
        lap("measure", t0)

    # optimizer
    if options.fixed:
        plan = fixed_plan(measurement["layers"], options.fixed)
    else:
        plan = optimize(measurement["layers"], job.bits)
    wd.save_json("strategy.json", plan)

    # quantization
    seed = measurement.get("seed", job.seed)
    fisher = None
    if options.sensitivity == "fisher" and any(map(_weighted_walks, plan["choices"].values())):
        t0 = time.time()  # the walks weight rows by the Fisher: this run's (cached in the work folder), or made now
        fisher = passes.fisher_pass(src, wd, ids[:eval_rows], seed, progress)
        lap("fisher", t0)
    t0 = time.time()
    passes.quantize_pass(src, wd, ids, eval_rows, plan["choices"], options, seed, fisher, progress)
    if not wd.exists("head.json"):
        wd.save_json("head.json", passes.quantize_head(src, wd, job.head_bits, options, seed))
    head = wd.load_json("head.json")
    lap("quantize", t0)

    tuned = {}
    if options.tune_steps:
        t0 = time.time()
        try:
            tuned = tune.tune_pass(src, wd, tune_ids, options.tune_steps, head, progress)
        except tune.TuneMemoryError as e:
            raise ConvertError(f"--tune {options.tune_steps}: {e} now (the earlier stages are kept: resume with -r "
                               "when more memory is free)") from e
        lap("tune", t0)

    t0 = time.time()
    report = _write_output(job, wd, src, measurement, plan, head, calib_info, tuned)
    lap("write", t0)
    report["timings"] = {k: round(v, 1) for k, v in timings.items()}
    report["timings"]["total"] = round(sum(timings.values()), 1)
    out = Path(job.output)
    qc, untie = report.pop("quantization_config"), report.pop("untie")
    write_text(out / "quantization_report.json", json.dumps(report, indent=1) + "\n")
    write_config(src.path, out, qc, untie=untie)  # last: a folder with config.json is complete
    if progress:
        print(format_report(report))
    if job.work is None:  # the default work folder lives inside the output: clean it up
        shutil.rmtree(job.work_dir(), ignore_errors=True)
    else:
        for sub in ("states", "fisher"):
            shutil.rmtree(wd.file(sub), ignore_errors=True)
    log.info("converted in %.0f s", time.time() - t_start)
    return report


def _write_output(job: Job, wd: WorkDir, src: SourceModel, measurement: dict, plan: dict, head: dict,
                  calib_info: dict, tuned: dict[str, torch.Tensor]) -> dict:
    out = Path(job.output)
    out.mkdir(parents=True, exist_ok=True)
    loader = src.loader
    n = src.num_layers
    quantized = set(plan["choices"])
    items: list[tuple[str, int, object]] = []
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}

    def source_item(name):
        shape, dt = loader.info(name)
        elem = sizes.get(dt, 4)
        if dt in ("F32", "F16", "BF16", "F64"):
            elem = 4 if "norm" in name else 2
        return (name, math.prod(shape) * elem,
                lambda: stored_dtype(name, tuned[name] if name in tuned else loader.get(name)))

    def owner(name):  # "model.layers.3.mlp.down_proj.weight" -> "model.layers.3.mlp.down_proj"
        return name.rsplit(".", 1)[0]

    all_names = sorted(loader.keys())
    layer_names = {i: [] for i in range(n)}
    other = []
    for name in all_names:
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            if i < n:
                layer_names[i].append(name)
                continue
        other.append(name)
    head_quant = head["head"] is not None
    if "model.embed_tokens.weight" in other:
        items.append(source_item("model.embed_tokens.weight"))
    bits, trellis_layers, one_sided = 0, 0, 0
    for i in range(n):
        for name in layer_names[i]:
            if owner(name) in quantized and name.rsplit(".", 1)[1] in ("weight", "bias"):
                continue
            items.append(source_item(name))
        block = wd.load_tensors(f"quant/block_{i:03d}.safetensors")
        block.update((k, v) for k, v in tuned.items() if k in block)  # tuned row scales (quant.tune)
        for k in sorted(block):
            t = block[k]
            items.append((k, t.numel() * t.element_size(), (lambda t=t: t)))
        for name in quantized:
            if name.startswith(f"model.layers.{i}."):
                tensors = {s: block[f"{name}.{s}"] for s in F.QUANT_SUFFIXES + F.TRELLIS_SUFFIXES
                           if f"{name}.{s}" in block}
                bits += F.storage_bits(tensors)
                trellis_layers += F.is_trellis(tensors)
                one_sided += F.is_trellis(tensors) and "sv" not in tensors
    for name in other:
        if name == "model.embed_tokens.weight" or (head_quant and name == "lm_head.weight"):
            continue
        items.append(source_item(name))
    head_bits = 0
    if head_quant:
        ht = passes.quantized_head(wd)
        for k in sorted(ht):
            items.append((f"lm_head.{k}", ht[k].numel() * ht[k].element_size(), (lambda t=ht[k]: t)))
        head_bits = F.storage_bits(ht)
    shard_bytes = job.shard_mb * 1024 * 1024
    files = write_shards(out, items, shard_bytes)
    weights = plan["weights"]
    measured_bpw = bits / weights
    head_bpw = head_bits / (src.config.vocab_size * src.config.hidden_size) if head_quant else 16.0
    qc = {"bits": job.bits if not job.options.fixed else round(measured_bpw, 4), "measured_bpw": round(measured_bpw, 4),
          "head_bits": job.head_bits, "head_bpw": round(head_bpw, 4),
          "calibration": {k: calib_info[k] for k in ("source", "rows", "length", "random_rows") if k in calib_info}}
    if job.options != QuantOptions():
        qc["options"] = job.options.to_dict()
    copy_tokenizer(src.path, out)
    atomic_copy(wd.file("measurement.json") if wd.exists("measurement.json") else
                _measurement_path(job.measurement), out / "measurement.json")
    stats = [s for i in range(n) for s in wd.load_json(f"quant/block_{i:03d}.json")]
    predicted = {c: plan["choices"][c]["kl"] for c in plan["choices"]}
    for s in stats:
        s["predicted_kl"] = predicted.get(s["name"], 0.0)
    if trellis_layers:
        # readers of version 1 must refuse trellis layers, those of version 2 layers without sv (§7.4, §7.6)
        qc["version"] = F.ONE_SIDED_TRELLIS_VERSION if one_sided else F.TRELLIS_FORMAT_VERSION
        qc["trellis_layers"] = trellis_layers
    return {"quantization_config": qc, "untie": head_quant,
            "input": str(src.path), "output": str(out), "files": files, "target_bpw": job.bits,
            "measured_bpw": measured_bpw, "head_bpw": head_bpw, "head": head["head"],
            "predicted_kl": plan["predicted_kl"], "eval": head["eval"], "layers": stats,
            "calibration": calib_info, "options": job.options.to_dict()}


def _weighted_walks(choice: dict) -> bool:
    """Whether a plan's choice is a trellis setting whose walks weight rows by their Fisher (no output rotation)."""
    return choice["setting"].startswith(TRELLIS_PREFIX) and not Transform.parse(choice["transform"]).sv


def _measurement_path(m) -> Path:
    p = Path(m)
    return p / "measurement.json" if p.is_dir() else p
