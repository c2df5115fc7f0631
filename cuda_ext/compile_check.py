"""Compile-only check of the CUDA sources: `python -m cuda_ext.compile_check`.

Compiles every csrc/*.cu with nvcc for sm_75, 80, 86, 89, 90 and 120 (RTX 20/30/40/50 series and
A100/H100; those this nvcc supports) in one nvcc call per file, with `ptxas -v`, and fails on any
error, any warning or any kernel that spills registers. Also syntax-checks the CUDA bindings
(cuda_ops.cpp, cuda_trellis_ops.cpp) with the host compiler against torch's headers. Needs no GPU; `make test` runs it.
Without nvcc it skips (exit 0), or fails with --require-nvcc. `--resources` prints the per-kernel
table of registers, spills, shared memory and occupancy (bench/cuda_report.py writes the full
report with bytes moved and the decode roofline, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cuda_ext.build import CSRC, CXX_FLAGS, NVCC_FLAGS

ARCHS = ["75", "80", "86", "89", "90", "120"]


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM limits (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability")."""

    name: str
    max_warps: int
    max_blocks: int
    smem_per_sm: int  # bytes, the largest carve-out
    smem_reserved_per_block: int  # bytes the runtime keeps per block (sm_80 and later: 1 KiB)
    regs_per_sm: int = 65536
    reg_unit: int = 256  # registers are allocated per warp in units of 256


LIMITS = {
    "75": ArchLimits("Turing (RTX 20)", 32, 16, 64 * 1024, 0),
    "80": ArchLimits("A100", 64, 32, 164 * 1024, 1024),
    "86": ArchLimits("Ampere (RTX 30)", 48, 16, 100 * 1024, 1024),
    "89": ArchLimits("Ada (RTX 40)", 48, 24, 100 * 1024, 1024),
    "90": ArchLimits("H100", 64, 32, 228 * 1024, 1024),
    "120": ArchLimits("Blackwell (RTX 50)", 48, 32, 128 * 1024, 1024),
}


@dataclass(frozen=True)
class KernelUsage:
    """One kernel on one architecture, as ptxas reports it."""

    kernel: str  # demangled, without namespaces and parameters, e.g. "gemv_kernel<8>"
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    smem: int  # static shared memory, bytes

    def occupancy(self, threads: int, dyn_smem: int = 0) -> tuple[float, int, str]:
        """Theoretical occupancy (resident warps / max warps), resident warps per SM, and the limiter."""
        lim = LIMITS[self.arch]
        warps = -(-threads // 32)
        per_warp_regs = -(-max(self.registers, 1) * 32 // lim.reg_unit) * lim.reg_unit
        by = {
            "warps": lim.max_warps // warps,
            "blocks": lim.max_blocks,
            "registers": (lim.regs_per_sm // per_warp_regs) // warps,
        }
        smem = self.smem + dyn_smem
        if smem:
            by["shared memory"] = lim.smem_per_sm // (smem + lim.smem_reserved_per_block)
        blocks = min(by.values())
        limiter = min(by, key=by.get)
        return blocks * warps / lim.max_warps, blocks * warps, limiter


def find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def supported_archs(nvcc: str) -> list[str]:
    out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True)
    listed = {line.strip().removeprefix("compute_") for line in out.stdout.split()}
    return [a for a in ARCHS if not listed or a in listed]


def _short_name(mangled: str) -> str:
    name = mangled
    if shutil.which("c++filt"):
        name = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip() or mangled
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"\w+::|\(anonymous namespace\)::", "", name)
    depth, out = 0, []
    for ch in name:  # drop the parameter list, keep template arguments
        if ch == "(" and depth == 0:
            break
        depth += (ch == "<") - (ch == ">")
        out.append(ch)
    return "".join(out).replace("short", "int16_t").replace("<int>", "<int32_t>")


def parse_ptxas(log: str) -> list[KernelUsage]:
    """KernelUsage for every entry function in `nvcc -Xptxas -v` output."""
    usages, cur = [], None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for 'sm_(\d+)'", line)
        if m:
            cur = {"kernel": _short_name(m.group(1)), "arch": m.group(2), "stack": 0, "spill_stores": 0,
                   "spill_loads": 0}
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            sm = re.search(r"(\d+) bytes smem", line)
            usages.append(KernelUsage(registers=int(m.group(1)), smem=int(sm.group(1)) if sm else 0, **cur))
            cur = None
    return usages


def compile_cu(nvcc: str, cu: Path, archs: list[str], out_dir: str) -> tuple[bool, str]:
    """One nvcc call for all archs with ptxas -v: (ok, compiler output)."""
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    cmd = [nvcc, "-c", str(cu), "-o", str(Path(out_dir) / f"{cu.stem}.o"), f"-I{CSRC}", *NVCC_FLAGS, *gencode,
           "-Xptxas", "-v", "-Werror", "all-warnings"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    return res.returncode == 0, res.stdout + res.stderr


def kernel_usages(archs: list[str] | None = None) -> list[KernelUsage]:
    """Compile every csrc/*.cu and return what ptxas reports (raises if nvcc is missing or fails)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (install the CUDA toolkit or set CUDA_HOME)")
    archs = archs or supported_archs(nvcc)
    usages = []
    with tempfile.TemporaryDirectory() as tmp:
        for cu in sorted(CSRC.glob("*.cu")):
            ok, log = compile_cu(nvcc, cu, archs, tmp)
            if not ok:
                raise RuntimeError(f"nvcc failed on {cu.name}:\n{log}")
            usages += parse_ptxas(log)
    return usages


def resource_table(usages: list[KernelUsage]) -> str:
    """Markdown: registers / spills / static smem per kernel and arch."""
    archs = sorted({u.arch for u in usages}, key=int)
    kernels = sorted({u.kernel for u in usages})
    by = {(u.kernel, u.arch): u for u in usages}
    head = "| kernel | " + " | ".join(f"sm_{a}" for a in archs) + " |\n|---|" + "---|" * len(archs) + "\n"
    rows = []
    for k in kernels:
        cells = []
        for a in archs:
            u = by.get((k, a))
            spill = 0 if u is None else u.spill_stores + u.spill_loads
            cells.append("–" if u is None else f"{u.registers} r" + (f", {u.smem} B smem" if u.smem else "")
                         + (f", **{spill} B spill**" if spill else ""))
        rows.append(f"| `{k}` | " + " | ".join(cells) + " |")
    return head + "\n".join(rows) + "\n"


def _host_syntax_check(nvcc: str, tmp: str) -> bool:
    """The host side of the CUDA extension, against torch's and the toolkit's headers."""
    from torch.utils.cpp_extension import CUDA_HOME, include_paths

    homes = [CUDA_HOME, Path(nvcc).resolve().parent.parent, "/usr/local/cuda"]
    cuda_inc = next((Path(h) / "include" for h in homes if h and (Path(h) / "include" / "cuda_runtime_api.h").exists()),
                    None)
    if cuda_inc is None:
        print("compile_check: CUDA headers (cuda_runtime_api.h) not found; set CUDA_HOME", file=sys.stderr)
        return False
    incs = [*include_paths(), str(cuda_inc), sysconfig.get_paths()["include"], str(CSRC)]
    # A CPU-only torch wheel lacks c10's generated CUDA config header; supply the stock one.
    if not any((Path(i) / "c10/cuda/impl/cuda_cmake_macros.h").exists() for i in incs):
        stub = Path(tmp) / "stub" / "c10/cuda/impl/cuda_cmake_macros.h"
        stub.parent.mkdir(parents=True)
        stub.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        incs.append(str(Path(tmp) / "stub"))
    cxx = os.environ.get("CXX", "c++")
    ok = True
    for src in ("cuda_ops.cpp", "cuda_trellis_ops.cpp"):
        cmd = [cxx, "-fsyntax-only", *CXX_FLAGS, "-DTORCH_EXTENSION_NAME=exl_cuda", "-DTORCH_API_INCLUDE_EXTENSION_H",
               *[f"-I{i}" for i in incs], str(CSRC / src)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        print(f"  {'ok  ' if res.returncode == 0 else 'FAIL'} {src} (host syntax)", flush=True)
        if res.returncode:
            print(res.stdout + res.stderr, file=sys.stderr)
        ok &= res.returncode == 0
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", help="only these sm_XY (e.g. --arch 90); default all supported")
    ap.add_argument("--require-nvcc", action="store_true", help="fail (exit 2) instead of skipping without nvcc")
    ap.add_argument("--resources", action="store_true", help="print registers / spills / smem per kernel and arch")
    args = ap.parse_args(argv)
    nvcc = find_nvcc()
    if nvcc is None:
        print("compile_check: skipped, nvcc not found (install the CUDA toolkit or set CUDA_HOME)", file=sys.stderr)
        return 2 if args.require_nvcc else 0
    archs = args.arch or supported_archs(nvcc)
    missing = [a for a in ARCHS if a not in archs]
    cu_files = sorted(CSRC.glob("*.cu"))
    print(f"compile_check: {len(cu_files)} .cu file(s) x sm_{', sm_'.join(archs)} with {nvcc}"
          + (f" (this nvcc lacks sm_{', sm_'.join(missing)})" if missing and not args.arch else ""))
    ok, usages = True, []
    with tempfile.TemporaryDirectory() as tmp:
        for cu in cu_files:
            good, log = compile_cu(nvcc, cu, archs, tmp)
            print(f"  {'ok  ' if good else 'FAIL'} {cu.name}", flush=True)
            if not good:
                print(log, file=sys.stderr)
            ok &= good
            usages += parse_ptxas(log)
        for u in usages:
            if u.spill_stores or u.spill_loads:
                print(f"  FAIL {u.kernel} spills on sm_{u.arch}: {u.spill_stores} B stored, {u.spill_loads} B loaded "
                      "(see docs/benchmarks.md: kernels must not spill)", file=sys.stderr)
                ok = False
        if ok and not usages:
            print("  FAIL ptxas -v reported no kernels", file=sys.stderr)
            ok = False
        ok &= _host_syntax_check(nvcc, tmp)
    if args.resources:
        print(resource_table(usages))
    print("compile_check:", "passed" if ok else "FAILED", f"({len(usages)} kernel builds, no spills)" if ok else "")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
