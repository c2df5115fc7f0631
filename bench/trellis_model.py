"""A SPEED-ONLY trellis-coded copy of an exl or float model folder (docs/format.md §7).

    python bench/trellis_model.py -i ~/.cache/exl/bench/smol-4.0 -o /tmp/smol-trellis-3 -b 3 [--code 3]

Every decoder linear layer (`model.layers.N.*_proj`, stored dense as `.weight` or scalar-coded as
`.qweight`...) is replaced by a trellis layer of the same shape whose tiles are RANDOM walks (random
words; code 3 by default, with the quantizer's tables, at L = 12; `--code 1` for code 1), scaled per
output channel to the RMS of the original (rotated) row. Everything else
(embeddings, norms, the head) is copied unchanged. The result runs at the speed of a real
trellis model of that size, but its weights are noise: its text is garbage. Use it to time
kernels and decode (`exl bench`) before a real trellis quantizer is available, never for quality.
Tests use it too (`trellis_copy`), comparing exl against the dense matrices its layers decode to.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from exl import format as F  # noqa: E402
from quant import trellis as TR  # noqa: E402

DECODER_LINEAR = re.compile(r"^(model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj)\.(weight|qweight)$")


def _rotated_rows(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The rotated matrix whose row RMS the copy keeps: Ŵ of a dense weight, Q of a scalar layer."""
    if "weight" in tensors:
        w = tensors["weight"].double()
        n, k = w.shape
        su = torch.where(torch.rand(k) < 0.5, -1.0, 1.0).double()
        sv = torch.where(torch.rand(n) < 0.5, -1.0, 1.0).double()
        return F.fwht((F.fwht(w * su) * sv[:, None]).T).T, su, sv  # H_N D_v W D_u H_K
    segs = F.segments_from_meta(tensors["qmeta"])
    q = F.dequantize_codes(F.unpack_codes(tensors["qweight"], segs), tensors["qscale"], segs, torch.float64)
    n, k = q.shape
    su = F.unpack_signs(tensors["su"], k, torch.float64) if "su" in tensors else torch.ones(k, dtype=torch.float64)
    sv = F.unpack_signs(tensors["sv"], n, torch.float64) if "sv" in tensors else torch.ones(n, dtype=torch.float64)
    return q, su, sv


def random_walk_layer(tensors: dict[str, torch.Tensor], bits: int, state_bits: int, gen: torch.Generator,
                      code: int = F.CODE_TWO_TABLE_64) -> dict:
    """Trellis tensors with random tiles, each row scaled to the RMS of the source's rotated row (codes 2, 3: L = 12)."""
    q, su, sv = _rotated_rows(tensors)
    n, k = q.shape
    if n % F.TILE or k % F.TILE:
        raise ValueError(f"a {n}x{k} layer cannot be trellis-coded (N and K must be multiples of {F.TILE})")
    meta = F.TrellisMeta(bits, F.TWO_TABLE_STATE_BITS if code in F.TWO_TABLE_CODES else state_bits, code=code)
    words = torch.randint(-(2**31), 2**31, (n // F.TILE, k // F.TILE, meta.words_per_tile), generator=gen,
                          dtype=torch.int64).to(torch.int32)
    rms = q.pow(2).mean(dim=1).sqrt()
    out = {"trellis": words, "tscale": (rms / TR.code_sigma(meta)).clamp_min(1e-7).half(), "tmeta": meta.to_tensor(),
           "su": F.pack_signs(su), "sv": F.pack_signs(sv)}
    if TR.tables(meta) is not None:
        out["tcode"] = TR.tables(meta)
    if "bias" in tensors:
        out["bias"] = tensors["bias"]
    return out


def trellis_copy(src: Path, dst: Path, bits: int = 3, state_bits: int = 16, seed: int = 0,
                 code: int = F.CODE_TWO_TABLE_64) -> float:
    """Write the speed-only trellis copy of folder src into dst; returns the decoder layers' bpw."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    bits_total = weights_total = 0
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            continue
        if f.is_file():
            shutil.copy(f, dst / f.name)
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(shard, "pt") as fh:
            names = list(fh.keys())
            tensors = {n: fh.get_tensor(n) for n in names}
        out = {}
        prefixes = {m.group(1) for n in names if (m := DECODER_LINEAR.match(n))}
        for name, t in tensors.items():
            if not any(name.startswith(p + ".") for p in prefixes):
                out[name] = t
        for p in sorted(prefixes):
            layer = {n[len(p) + 1:]: t for n, t in tensors.items() if n.startswith(p + ".")}
            tl = random_walk_layer(layer, bits, state_bits, gen, code)
            bits_total += F.storage_bits(tl)
            weights_total += tl["trellis"].shape[0] * tl["trellis"].shape[1] * F.TILE_WEIGHTS
            out.update({f"{p}.{s}": v.contiguous() for s, v in tl.items()})
        save_file(out, dst / shard.name, metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    q = cfg.get("quantization_config") or {"quant_method": "exl"}
    if code in F.TWO_TABLE_CODES:
        state_bits = F.TWO_TABLE_STATE_BITS
    q.update(version=2, speed_only_random_trellis=True, trellis_bits=bits, trellis_state_bits=state_bits,
             trellis_code=code, measured_bpw=round(bits_total / max(weights_total, 1), 4))
    cfg["quantization_config"] = q
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return bits_total / max(weights_total, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-i", "--input", required=True, help="exl (scalar-coded) or float model folder")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("-b", "--bits", type=int, default=3, help="trellis bits per weight K (1..8)")
    ap.add_argument("-L", "--state-bits", type=int, default=16, help="L for code 1 (code 2 is always L = 12)")
    ap.add_argument("--code", type=int, choices=(1, 2, 3), default=3, help="trellis code (docs/format.md §7.3)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    bpw = trellis_copy(Path(a.input), Path(a.output), a.bits, a.state_bits, a.seed, a.code)
    print(f"wrote {a.output}: SPEED-ONLY random trellis model, decoder layers at {bpw:.3f} bpw")


if __name__ == "__main__":
    main()
