"""The three passes over the model, block by block, each resumable after any block.

1. `fisher_pass`: a few calibration rows forward through the original model, a sampled next token per
   position, and the gradient of its log-likelihood backward, one block at a time: f_n for every
   output channel of every linear layer (how much an error there moves the model's output).
2. `measure_pass`: all calibration rows through the original model; every linear layer's Hessian and
   the predicted ΔKL and exact bits of every candidate setting (`quant.layer.measure`).
3. `quantize_pass`: all calibration rows through the model as it is being quantized: each layer is
   quantized the moment its input reaches it, from the outputs of the already-quantized layers before it.

Hidden states between blocks live in the work folder (only the current block's are in memory).
"""

from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from exl.cache.base import NoCache
from exl.errors import ExlError
from quant import layer as L
from quant.candidates import Setting, parse_setting
from quant.capture import HessianCache, hessian, taps
from quant.model_parts import SourceModel
from quant.options import QuantOptions
from quant.transform import Transform
from quant.workdir import WorkDir

log = logging.getLogger("exl.quant")


class CalibrationFailure(ExlError):
    """The calibration activations became unusable (NaN/inf in too many rows)."""


def no_cache(h: torch.Tensor) -> NoCache:
    """No KV cache: a whole-sequence forward of a block over calibration rows h [B, T, D]."""
    return NoCache(h.shape[0], h.shape[1], h.device)


def check_rows(h: torch.Tensor, valid: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop calibration rows whose hidden states went NaN/inf (zeroed, masked from then on)."""
    finite = torch.isfinite(h.sum(dim=tuple(range(1, h.dim())))).cpu()  # a row with NaN/inf sums to NaN/inf
    bad = valid & ~finite
    if bool(bad.any()):
        valid = valid & finite
        log.warning("%s: %d calibration row(s) produced NaN/inf and are dropped (%d left)", where,
                    int(bad.sum()), int(valid.sum()))
        h = torch.where(finite.to(h.device)[:, None, None], h, torch.zeros((), dtype=h.dtype, device=h.device))
    if int(valid.sum()) < max(1, (valid.numel() + 1) // 2):
        raise CalibrationFailure(
            f"{where}: {int((~valid).sum())} of {valid.numel()} calibration rows produce NaN/inf activations. "
            "The model overflows on this data even in float32: check the checkpoint (corrupt or wrongly "
            "converted weights?) or calibrate with other data (-c).")
    return h, valid


def token_mask(valid: torch.Tensor, length: int) -> torch.Tensor:
    return valid[:, None].expand(-1, length).reshape(-1)


def _bar(it, desc: str, total: int, initial: int = 0, progress: bool = True):
    return tqdm(it, desc=desc, total=total, initial=initial, unit="block", disable=not progress, dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------------------------
# 1. Fisher


def fisher_pass(src: SourceModel, wd: WorkDir, ids: torch.Tensor, seed: int, progress=True) -> dict[str, torch.Tensor]:
    """Mean squared output gradient f [N] of every linear layer (sampled-label Fisher on `ids` rows)."""
    if wd.exists("fisher.safetensors"):
        return wd.load_tensors("fisher.safetensors")
    n = src.num_layers
    dev = src.device
    # forward: keep every block's input (a few rows only)
    start = next((i for i in range(n, -1, -1) if wd.exists(f"fisher/in_{i:03d}.safetensors")), None)
    if start is None:
        wd.save_tensors("fisher/in_000.safetensors", {"h": src.embed(ids)})
        start = 0
    h = wd.load_tensors(f"fisher/in_{start:03d}.safetensors", dev)["h"]
    for i in _bar(range(start, n), "fisher: forward", n, start, progress):
        block, _ = src.block(i)
        with torch.inference_mode():
            h = block(h, no_cache(h))
        if not bool(torch.isfinite(h.sum())):
            raise CalibrationFailure(f"block {i}: NaN/inf activations on the calibration rows used for the Fisher "
                                     "pass; the checkpoint looks broken (or use other calibration data, -c)")
        wd.save_tensors(f"fisher/in_{i + 1:03d}.safetensors", {"h": h})
        del block
    # backward, top block first; g is the gradient at the current block's output
    done = next((i for i in range(n + 1) if wd.exists(f"fisher/grad_{i:03d}.safetensors")), None)
    if done is None:
        h = wd.load_tensors(f"fisher/in_{n:03d}.safetensors", dev)["h"].requires_grad_()
        with torch.enable_grad():
            logits = src.logits(h, src.final_norm(), src.head_weight()).float()
            gen = torch.Generator(device=logits.device).manual_seed(seed)
            probs = torch.softmax(logits.detach().view(-1, logits.shape[-1]), dim=-1)
            y = torch.multinomial(probs, 1, generator=gen).view(logits.shape[:-1])
            torch.log_softmax(logits, -1).gather(-1, y[..., None]).sum().backward()
        wd.save_tensors(f"fisher/grad_{n:03d}.safetensors", {"g": h.grad})
        done = n
        del logits, probs
    g = wd.load_tensors(f"fisher/grad_{done:03d}.safetensors", dev)["g"]
    tokens = ids.numel()
    for i in _bar(range(done - 1, -1, -1), "fisher: backward", n, n - done, progress):
        block, refs = src.block(i)
        f: dict[str, torch.Tensor] = {}

        def tap(ref, x, f=f):
            y = ref.module(x)
            if y.requires_grad:
                def keep(grad, name=ref.name):
                    sq = grad.float().pow(2).reshape(-1, grad.shape[-1]).sum(0) / tokens
                    f[name] = f[name] + sq if name in f else sq
                y.register_hook(keep)
            return y

        h = wd.load_tensors(f"fisher/in_{i:03d}.safetensors", dev)["h"].requires_grad_()
        with torch.enable_grad(), taps(refs, tap):
            block(h, no_cache(h)).backward(g)
        for r in refs:  # a layer no token reached (an unused expert) has zero sensitivity
            f.setdefault(r.name, torch.zeros(r.shape[0], device=dev))
        g = h.grad
        wd.save_tensors(f"fisher/f_{i:03d}.safetensors", f)
        wd.save_tensors(f"fisher/grad_{i:03d}.safetensors", {"g": g})
        del block
    out = {}
    for i in range(n):
        out.update(wd.load_tensors(f"fisher/f_{i:03d}.safetensors"))
    wd.save_tensors("fisher.safetensors", out)
    return out


# ---------------------------------------------------------------------------------------------------------------
# 2. Measurement


def _states(wd: WorkDir, kind: str, i: int) -> str:
    return f"states/{kind}_{i:03d}.safetensors"


def _resume_point(wd: WorkDir, kind: str, n: int, done) -> int:
    """First block whose result is missing and whose input states exist."""
    i = 0
    while i < n and done(i):
        i += 1
    while i > 0 and not wd.exists(_states(wd, kind, i)):
        i -= 1  # the states after block i-1 were not written: redo that block
    return i


def measure_pass(src: SourceModel, wd: WorkDir, ids: torch.Tensor, fisher: dict[str, torch.Tensor],
                 options: QuantOptions, seed: int, progress=True) -> list[dict]:
    """Per-layer measurement records (see quant.layer.measure), all blocks in order."""
    n, dev = src.num_layers, src.device
    rec = lambda i: f"measure/block_{i:03d}.json"  # noqa: E731
    i0 = _resume_point(wd, "measure", n, lambda i: wd.exists(rec(i)))
    if i0 < n:
        if i0 == 0 and not wd.exists(_states(wd, "measure", 0)):
            wd.save_tensors(_states(wd, "measure", 0), {"h": src.embed(ids),
                                                        "valid": torch.ones(ids.shape[0], dtype=torch.bool)})
        st = wd.load_tensors(_states(wd, "measure", i0), dev)
        h, valid = st["h"], st["valid"].cpu()
    for i in _bar(range(i0, n), "measure", n, i0, progress):
        block, refs = src.block(i)
        cache = HessianCache(token_mask(valid, ids.shape[1]))
        records = []

        def tap(ref, x):
            hm, tokens = cache(x, ref.name)
            f = fisher[ref.name].to(dev) if options.sensitivity == "fisher" else torch.ones(ref.shape[0], device=dev)
            records.append(L.measure(ref.name, ref.module.weight, hm.to(dev), tokens, f, options, seed))
            return ref.module(x)

        with torch.inference_mode(), taps(refs, tap):
            h = block(h, no_cache(h))
        seen = {r["name"] for r in records}
        for ref in refs:  # layers that saw no token (unused experts): identity Hessian
            if ref.name not in seen:
                k = ref.shape[1]
                records.append(L.measure(ref.name, ref.module.weight, torch.eye(k, dtype=torch.float64, device=dev),
                                         1, torch.zeros(ref.shape[0], device=dev), options, seed))
        h, valid = check_rows(h, valid, f"block {i}")
        wd.save_json(rec(i), records)
        wd.save_tensors(_states(wd, "measure", i + 1), {"h": h, "valid": valid})
        wd.remove(_states(wd, "measure", i))
        del block
    wd.remove(_states(wd, "measure", n))
    return [r for i in range(n) for r in wd.load_json(rec(i))]


# ---------------------------------------------------------------------------------------------------------------
# 3. Quantization


def quantize_pass(src: SourceModel, wd: WorkDir, ids: torch.Tensor, eval_rows: int, plan: dict[str, dict],
                  options: QuantOptions, seed: int, fisher: dict[str, torch.Tensor] | None,
                  progress=True) -> None:
    """Quantize every block (results in work/quant/block_###.safetensors and .json).

    plan: layer name -> {"setting": str, "transform": str}. Also carries the original model's hidden
    states for the first `eval_rows` rows ("ref"), for the final check.
    """
    n, dev = src.num_layers, src.device
    i0 = _resume_point(wd, "quant", n, lambda i: wd.exists(f"quant/block_{i:03d}.json"))
    if i0 < n:
        if i0 == 0 and not wd.exists(_states(wd, "quant", 0)):
            h = src.embed(ids)
            wd.save_tensors(_states(wd, "quant", 0), {"h": h, "ref": h[:eval_rows].clone(),
                                                      "valid": torch.ones(ids.shape[0], dtype=torch.bool)})
        st = wd.load_tensors(_states(wd, "quant", i0), dev)
        h, ref, valid = st["h"], st["ref"], st["valid"].cpu()
    for i in _bar(range(i0, n), "quantize", n, i0, progress):
        block, refs = src.block(i)
        mask = token_mask(valid, ids.shape[1])
        orig_h: dict = {}
        with torch.inference_mode():
            ref = block(ref, no_cache(ref))
            if not options.sequential:  # ablation: Hessians from the original model's activations
                orig_cache = HessianCache(mask)

                def grab(r, x):
                    orig_h[r.name] = orig_cache(x, r.name)
                    return r.module(x)

                with taps(refs, grab):
                    block(h, no_cache(h))
        cache = HessianCache(mask)
        tensors, stats = {}, []

        def tap(r, x):
            hm, tokens = cache(x, r.name) if options.sequential else orig_h[r.name]
            choice = plan[r.name]
            f = fisher.get(r.name) if fisher is not None else None
            q = L.quantize(r.name, r.module.weight, hm.to(dev), parse_setting(choice["setting"]),
                           Transform.parse(choice["transform"]), options, seed, r.module.bias,
                           None if f is None else f.to(dev), tokens)
            for k, v in q.tensors.items():
                tensors[f"{r.name}.{k}"] = v
            stats.append({"name": r.name, "setting": choice["setting"], "transform": choice["transform"],
                          "bits": q.bits, "bpw": q.bits / (r.shape[0] * r.shape[1]), "rel": q.rel})
            y = torch.nn.functional.linear(x, q.weight.to(x.dtype), r.module.bias)
            return y

        with torch.inference_mode(), taps(refs, tap):
            h = block(h, no_cache(h))
        missing = [r for r in refs if r.name not in {s["name"] for s in stats}]
        for r in missing:  # never reached by a token: round-to-nearest on an identity Hessian
            k = r.shape[1]
            eye = torch.eye(k, dtype=torch.float64, device=dev)
            choice = plan[r.name]
            q = L.quantize(r.name, r.module.weight, eye, parse_setting(choice["setting"]),
                           Transform.parse(choice["transform"]), options, seed, r.module.bias)
            tensors.update({f"{r.name}.{k2}": v for k2, v in q.tensors.items()})
            stats.append({"name": r.name, "setting": choice["setting"], "transform": choice["transform"],
                          "bits": q.bits, "bpw": q.bits / (r.shape[0] * r.shape[1]), "rel": q.rel})
        h, valid = check_rows(h, valid, f"block {i}")
        wd.save_tensors(f"quant/block_{i:03d}.safetensors", tensors)
        wd.save_json(f"quant/block_{i:03d}.json", stats)
        wd.save_tensors(_states(wd, "quant", i + 1), {"h": h, "ref": ref, "valid": valid})
        wd.remove(_states(wd, "quant", i))
        del block


def quantized_head(wd: WorkDir, device="cpu") -> dict[str, torch.Tensor]:
    """The head's tensors `quantize_head` saved, by format name without the `lm_head.` prefix."""
    return {k.split(".", 1)[1]: v for k, v in wd.load_tensors("quant/head.safetensors", device).items()}


def quantize_head(src: SourceModel, wd: WorkDir, bits: int, options: QuantOptions, seed: int) -> dict:
    """Quantize the output head from the quantized model's final hidden states; evaluate on the eval rows.

    Returns {"head": stats or None, "eval": {...}} and saves the head's tensors to quant/head.safetensors.
    """
    n, dev = src.num_layers, src.device
    st = wd.load_tensors(_states(wd, "quant", n), dev)
    h, ref, valid = st["h"], st["ref"], st["valid"].cpu()
    norm, w = src.final_norm(), src.head_weight()
    head_stats = None
    wq = w
    if bits < 16:
        with torch.inference_mode():
            hm, tokens = hessian(norm(h), token_mask(valid, h.shape[1]), "lm_head")
        setting = Setting(bits, options.head_group)
        t = Transform(True, False, True)
        q = L.quantize("lm_head", w, hm.to(dev), setting, t, options, seed)
        wd.save_tensors("quant/head.safetensors", {f"lm_head.{k}": v for k, v in q.tensors.items()})
        wq = q.weight
        head_stats = {"setting": setting.name, "transform": t.name, "bits": q.bits, "rel": q.rel,
                      "bpw": q.bits / w.numel()}
    with torch.inference_mode():
        e = h[: ref.shape[0]]
        lr = torch.log_softmax(src.logits(ref, norm, w).float(), -1)
        lq = torch.log_softmax(src.logits(e, norm, wq).float(), -1)
        lb = torch.log_softmax(src.logits(e, norm, w).float(), -1)  # quantized body, original head
        ids = wd.load_tensors("calibration.safetensors")["ids"][: ref.shape[0]].to(dev)

        def nll(lp):
            return float(-lp[:, :-1].gather(-1, ids[:, 1:, None]).mean())

        def kl(lp):
            return float((lr.exp() * (lr - lp)).sum(-1).mean())

        ev = {"rows": int(ref.shape[0]), "tokens": int(ref.shape[0] * ref.shape[1]),
              "ppl_reference": float(torch.tensor(nll(lr)).exp()), "ppl": float(torch.tensor(nll(lq)).exp()),
              "kl": kl(lq), "kl_body": kl(lb)}
    return {"head": head_stats, "eval": ev}
