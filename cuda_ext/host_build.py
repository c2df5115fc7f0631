"""Build the host harness: exl's CUDA kernels compiled as C++ and run on the CPU (docs/cuda_host.md).

`load_cuda_host()` JIT-compiles (torch.utils.cpp_extension + ninja, cached) a test-only module,
`exl_cuda_host`, from the same `csrc/cuda_kernels.cu` and `csrc/cuda_ops.cpp` as the CUDA build, with
`csrc/host/` first on the include path: its `cuda_runtime.h`, `cuda_fp16.h` and `c10/cuda/*` stand in
for the toolkit's and give CUDA's semantics on CPU threads (`csrc/host/cuda_host.h`). Never used by
exl at run time.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import sysconfig
from pathlib import Path

from cuda_ext.build import CSRC, ExtensionBuildError, cache_root, mark_used, prune_builds

HOST = CSRC / "host"
SOURCES = ["host/host_ops.cpp", "host/host_kernels.cpp", "host/host_toy.cpp"]


def _cxx_std() -> str:
    """The C++ standard the installed torch's headers need (C++20 from torch 2.14, C++17 before)."""
    import torch

    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 14) else "-std=c++17"


def flags() -> list[str]:
    return ["-O2", _cxx_std(), "-pthread", "-fno-math-errno", "-Wno-unknown-pragmas", "-Wno-unused-function"]


def _digest(flag_list: list[str]) -> str:
    """Everything that changes the binary: every source and header it may include, flags, torch, Python."""
    import torch

    h = hashlib.sha256()
    files = [p for p in sorted(CSRC.rglob("*")) if p.is_file() and p.suffix in (".h", ".cuh", ".cu", ".cpp", ".inc")]
    for p in files:
        h.update(str(p.relative_to(CSRC)).encode() + b"\0" + p.read_bytes())
    h.update(" ".join(flag_list).encode())
    h.update(f"{torch.__version__} {torch.version.cuda} {sys.version} {sysconfig.get_platform()}".encode())
    return h.hexdigest()[:16]


@functools.cache
def load_cuda_host(verbose: bool = False):
    """Import the harness module, compiling it first if this source/flag/torch combination is new."""
    import importlib.util

    import torch.utils.cpp_extension as ext

    name = "exl_cuda_host"
    fl = flags()
    build_dir = cache_root() / f"{name}_{_digest(fl)}"
    so = build_dir / f"{name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    for candidate in (so, build_dir / f"{name}.so"):
        if candidate.exists():
            spec = importlib.util.spec_from_file_location(name, candidate)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            mark_used(build_dir)
            return mod
    build_dir.mkdir(parents=True, exist_ok=True)
    print(f"exl: compiling the CUDA host harness into {build_dir} (once; about a minute)...", file=sys.stderr,
          flush=True)
    try:
        module = ext.load(
            name=name,
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=fl,
            extra_ldflags=["-pthread"],
            extra_include_paths=[str(HOST), str(CSRC)],  # host/ first: its cuda_runtime.h etc. win
            build_directory=str(build_dir),
            verbose=verbose,
        )
    except Exception as e:
        raise ExtensionBuildError(f"building the CUDA host harness failed: {e}") from e
    prune_builds(name, build_dir)
    return module
