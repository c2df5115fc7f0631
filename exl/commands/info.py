"""`exl info`: what a bug report needs. Versions (exl, torch, CUDA, Python), the compilers, each kernel
extension (built or not, and where), the CPU instruction set the kernels picked, the GPUs seen, and the
environment variables in force. `--json` prints the same as one JSON object; `--build` builds missing
extensions first (a build failure is reported, not raised)."""

from __future__ import annotations

import json
import platform
import sys


def add_arguments(p):
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--build", action="store_true", help="build the extensions now if they are not built yet")


def collect(build_missing: bool = False) -> dict:
    """Everything `exl info` prints, as a dict."""
    import torch

    import exl
    from cuda_ext import build
    from exl import env

    info = {
        "exl": exl.__version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cxx_standard": build.cxx_standard(),
        "compilers": {"cxx": build.tool_version(build.cxx_command()),
                      "nvcc": build.tool_version(build.nvcc_path()) if torch.version.cuda else None},
        "extension_cache": str(build.cache_root()),
        "extensions": {"cpu": _extension("cpu", build_missing), "cuda": _extension("cuda", build_missing)},
        "gpus": _gpus(),
        "env": env.in_force(),
        "env_unknown": env.unknown(),
    }
    return info


def _extension(kind: str, build_missing: bool) -> dict:
    import torch

    import cuda_ext
    from cuda_ext import build

    if kind == "cuda" and torch.version.cuda is None:
        return {"built": False, "note": "this PyTorch is a CPU-only build"}
    out = build.status(kind)
    if not out["built"] and not build_missing:
        out["note"] = "builds on first use (or now: exl info --build)"
        return out
    try:
        ext = build.load_cpu() if kind == "cpu" else build.load_cuda()
    except cuda_ext.ExtensionBuildError as e:
        return {**out, "error": str(e)}
    out.update(build.status(kind))
    if kind == "cpu":
        out.update(_cpu_isa(ext))
    return out


def _cpu_isa(ext) -> dict:
    """Ask the extension which instruction set a quantized linear gets here (EXL_CPU_ISA or the best)."""
    import torch

    from exl import format as F
    from exl.modules.quant_linear import GEMM_NEVER

    segs = [F.Segment(32, 4, 32)]
    t = {"qweight": F.pack_codes(torch.zeros(1, 32, dtype=torch.uint8), segs),
         "qscale": torch.ones(1, 1, dtype=torch.float16), "qmeta": F.segments_to_meta(segs)}
    out = {"isa_available": list(ext.isa_names())}
    try:
        layer = ext.QuantLinearCPU(t["qweight"], t["qscale"], t["qmeta"])
    except RuntimeError as e:  # EXL_CPU_ISA names a table this CPU lacks
        out["isa_error"] = str(e).splitlines()[0]
        return out
    out["isa"] = layer.isa
    if hasattr(layer, "int8_gemm_min_rows"):  # where scalar-coded layers switch from the int8 GEMV to the GEMM
        rows = layer.int8_gemm_min_rows
        out["gemm_min_rows"] = None if rows == GEMM_NEVER else rows  # None: the int8 GEMV at every size
    if hasattr(ext, "TrellisLinearCPU"):  # where trellis codes 2 and 3 switch from the int8 GEMV to the GEMM
        from exl.modules.trellis_linear import TrellisLinear

        meta = F.TrellisMeta(4, F.TWO_TABLE_STATE_BITS, code=3)
        layer = TrellisLinear({"trellis": torch.zeros(1, 1, meta.words_per_tile, dtype=torch.int32),
                               "tscale": torch.ones(16, dtype=torch.float16), "tmeta": meta.to_tensor(),
                               "su": F.pack_signs(torch.ones(16)), "sv": F.pack_signs(torch.ones(16)),
                               "tcode": F.two_table_default(3)})
        layer.kernel()
        rows = layer.gemm_min_rows
        out["trellis_gemm_min_rows"] = None if rows == GEMM_NEVER else rows  # None: the int8 GEMV at every size
    if hasattr(ext, "amx_supported"):
        out["amx"] = {"supported": bool(ext.amx_supported()), "enabled": bool(ext.amx_enabled()),
                      "min_rows": int(ext.amx_min_rows), "min_rows_code1": int(ext.amx_min_rows_code1)}
    return out


def _gpus() -> list[dict]:
    import torch

    from cuda_ext import build

    if not torch.cuda.is_available():
        return []
    archs = {a.split("+")[0] for a in build.cuda_archs()}
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        cc = f"{p.major}.{p.minor}"
        gpus.append({"index": i, "name": p.name, "compute_capability": cc,
                     "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count,
                     "exl_builds_for_it": cc in archs})
    return gpus


def run(args) -> int:
    info = collect(args.build)
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"exl {info['exl']}   Python {info['python']}")
    print(f"torch {info['torch']}   CUDA {info['torch_cuda'] or 'none (CPU-only build)'}   "
          f"C++ standard {info['cxx_standard']}   {info['platform']}")
    print(f"C++ compiler: {info['compilers']['cxx']}")
    if info["compilers"]["nvcc"]:
        print(f"nvcc: {info['compilers']['nvcc']}")
    print(f"extension cache: {info['extension_cache']}")
    for kind, e in info["extensions"].items():
        state = "built" if e.get("built") else "NOT built"
        line = f"{kind} kernels: {state}" + (" (prebuilt)" if e.get("prebuilt") else "")
        if e.get("path"):
            line += f" at {e['path']}"
        print(line + (f"; {e['note']}" if e.get("note") else ""))
        if kind == "cpu" and "isa_available" in e:
            chosen = e.get("isa") or f"error: {e.get('isa_error')}"
            print(f"  CPU instruction set: {chosen}   (available: {', '.join(e['isa_available'])})")
            if "gemm_min_rows" in e:
                rows = e["gemm_min_rows"]
                print("  scalar codes, batches (prefill): " + ("int8 GEMV at every size" if rows is None
                                                               else f"dequant + fp32 GEMM from {rows} rows, int8 GEMV below"))
            if "trellis_gemm_min_rows" in e:
                rows = e["trellis_gemm_min_rows"]
                print("  trellis codes 2 and 3, batches (prefill): " + (
                    "int8 GEMV at every size (the AVX-512 trellis table)" if rows is None
                    else f"tile decode + fp32 GEMM from {rows} rows, int8 GEMV below"))
            if "amx" in e:
                amx = e["amx"]
                print("  AMX int8 tiles: " + (f"in use (trellis int8 GEMV from {amx['min_rows']} rows, code 1 from "
                                              f"{amx['min_rows_code1']})" if amx["enabled"]
                                              else "available, off (EXL_CPU_AMX=0)" if amx["supported"]
                                              else "not on this CPU or OS"))
        if e.get("error"):
            print("  " + e["error"].replace("\n", "\n  "))
    if not info["gpus"]:
        print("GPUs: none seen by torch")
    for g in info["gpus"]:
        print(f"GPU {g['index']}: {g['name']}, compute capability {g['compute_capability']}, {g['memory_gib']} GiB, "
              f"{g['multiprocessors']} SMs" + ("" if g["exl_builds_for_it"] else "  (not in exl's CUDA arch list)"))
    print("environment:" + ("" if info["env"] else " no EXL_* or build variables set"))
    for k, v in info["env"].items():
        print(f"  {k}={v}" + ("   <- not a variable exl reads (see docs/env.md)" if k in info["env_unknown"] else ""))
    return 0
