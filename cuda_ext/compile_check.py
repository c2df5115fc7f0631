"""Compile-only check of the CUDA sources: `python -m cuda_ext.compile_check`.

Compiles every csrc/*.cu with nvcc for sm_80, sm_86, sm_89 and sm_90 (those this nvcc supports)
and syntax-checks the CUDA bindings (cuda_ops.cpp, cuda_trellis_ops.cpp) with the host compiler against torch's headers.
Needs no GPU. Exits non-zero on any error (and, with --require-nvcc, when nvcc is missing; without
it a machine with no CUDA toolkit skips the check); CI runs it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from cuda_ext.build import CSRC, CXX_FLAGS, NVCC_FLAGS

ARCHS = ["80", "86", "89", "90"]


def find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def supported_archs(nvcc: str) -> list[str]:
    out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True)
    listed = {line.strip().removeprefix("compute_") for line in out.stdout.split()}
    return [a for a in ARCHS if not listed or a in listed]


def run(cmd: list[str], what: str) -> bool:
    res = subprocess.run(cmd, capture_output=True, text=True)
    ok = res.returncode == 0
    print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        print(res.stdout + res.stderr, file=sys.stderr)
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", help="only these sm_XY (e.g. --arch 90); default all supported")
    ap.add_argument("--require-nvcc", action="store_true", help="fail (exit 2) instead of skipping without nvcc")
    args = ap.parse_args(argv)
    nvcc = find_nvcc()
    if nvcc is None:
        print("compile_check: skipped, nvcc not found (install the CUDA toolkit or set CUDA_HOME)", file=sys.stderr)
        return 2 if args.require_nvcc else 0
    archs = args.arch or supported_archs(nvcc)
    cu_files = sorted(CSRC.glob("*.cu"))
    print(f"compile_check: {len(cu_files)} .cu file(s) x sm_{', sm_'.join(archs)} with {nvcc}")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for cu in cu_files:
            for arch in archs:
                obj = Path(tmp) / f"{cu.stem}_{arch}.o"
                cmd = [nvcc, "-c", str(cu), "-o", str(obj), f"-I{CSRC}", *NVCC_FLAGS,
                       "-gencode", f"arch=compute_{arch},code=sm_{arch}", "-Werror", "all-warnings"]
                ok &= run(cmd, f"{cu.name} sm_{arch}")
        # host side of the CUDA extension, against torch's and the toolkit's headers
        from torch.utils.cpp_extension import include_paths

        from torch.utils.cpp_extension import CUDA_HOME

        homes = [CUDA_HOME, Path(nvcc).resolve().parent.parent, "/usr/local/cuda"]
        cuda_inc = next((Path(h) / "include" for h in homes if h and (Path(h) / "include" / "cuda_runtime_api.h").exists()),
                        None)
        if cuda_inc is None:
            print("compile_check: CUDA headers (cuda_runtime_api.h) not found; set CUDA_HOME", file=sys.stderr)
            return 2
        incs = [*include_paths(), str(cuda_inc), sysconfig.get_paths()["include"], str(CSRC)]
        # A CPU-only torch wheel lacks c10's generated CUDA config header; supply the stock one.
        if not any((Path(i) / "c10/cuda/impl/cuda_cmake_macros.h").exists() for i in incs):
            stub = Path(tmp) / "stub" / "c10/cuda/impl/cuda_cmake_macros.h"
            stub.parent.mkdir(parents=True)
            stub.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
            incs.append(str(Path(tmp) / "stub"))
        cxx = os.environ.get("CXX", "c++")
        for src in ["cuda_ops.cpp", "cuda_trellis_ops.cpp"]:
            cmd = [cxx, "-fsyntax-only", *CXX_FLAGS, "-DTORCH_EXTENSION_NAME=exl_cuda", "-DTORCH_API_INCLUDE_EXTENSION_H",
                   *[f"-I{i}" for i in incs], str(CSRC / src)]
            ok &= run(cmd, f"{src} (host syntax)")
    print("compile_check:", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
