"""Build the exl C++/CUDA extensions: JIT (torch.utils.cpp_extension.load + ninja, cached) or prebuilt.

The CPU library is compiled for baseline x86-64 with AVX2/AVX-VNNI/AVX-512 code in separately targeted
functions (see csrc/cpu_kernels.h), so one cached build runs on every machine of the architecture
and picks its instruction set at run time. Builds are cached under ``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/exl/torch_extensions``, in a folder named after a hash of the sources and flags.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
CPU_SOURCES = ["cpu_ops.cpp", "cpu_scalar.cpp", "cpu_avx2.cpp", "cpu_avxvnni.cpp", "cpu_avx512.cpp", "cpu_fused.cpp",
               "cpu_trellis_ops.cpp", "cpu_trellis_scalar.cpp", "cpu_trellis_avx2.cpp", "cpu_trellis_avx512.cpp",
               "trellis_encode.cpp"]
CUDA_SOURCES = ["cuda_ops.cpp", "cuda_kernels.cu"]
CXX_FLAGS = ("-O3", "-std=c++17", "-fno-math-errno", "-Wno-unused-function")
# at::parallel_for is a header template: without -fopenmp it runs serially inside the extension.
# Linking libgomp.so.1 reuses the copy torch has already loaded (same soname), so one thread pool.
OPENMP_FLAGS = ("-fopenmp",) if sys.platform.startswith("linux") else ()
NVCC_FLAGS = ("-O3", "-std=c++17", "--use_fast_math", "-lineinfo")
CUDA_ARCHS = ["8.0", "8.6", "8.9", "9.0"]


class ExtensionBuildError(RuntimeError):
    """The extension could not be compiled or loaded; the message says why and what to do."""


def cache_root() -> Path:
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "exl" / "torch_extensions"


def _sources(names: list[str]) -> list[str]:
    return [str(CSRC / n) for n in names]


def _digest(names: list[str], flags: list[str]) -> str:
    import torch

    h = hashlib.sha256()
    for p in sorted(CSRC.iterdir()):  # the sources of this extension and every header
        if p.name in names or p.suffix in (".h", ".inc", ".cuh"):
            h.update(p.name.encode() + p.read_bytes())
    h.update(" ".join(names + flags).encode())
    h.update(f"{torch.__version__} {sys.version_info[:2]} {sysconfig.get_platform()}".encode())
    return h.hexdigest()[:16]


def _import_so(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _missing_tool(cuda: bool) -> str | None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler: `{cxx}` is not on PATH (install g++, e.g. `apt-get install g++`, or set CXX)"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401  (the pip package puts `ninja` next to python)
        except ImportError:
            return "ninja is missing: `pip install ninja`"
    if cuda:
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None or shutil.which("nvcc") is None and not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
            return "no CUDA toolkit: nvcc not found (install the CUDA toolkit or set CUDA_HOME)"
    return None


def _explain(log: str) -> str:
    m = re.search(r"fatal error: ([^\s:]+): No such file", log)
    if m:
        hint = " (Python headers: install python3-dev)" if m.group(1).startswith("Python") else ""
        return f"missing header {m.group(1)}{hint}"
    lines = [ln for ln in log.splitlines() if "error" in ln.lower()]
    return "; ".join(lines[:3]) if lines else log.strip().splitlines()[-1] if log.strip() else "unknown error"


def _jit(name: str, sources: list[str], cuda: bool, verbose: bool):
    import torch.utils.cpp_extension as ext

    flags = [*CXX_FLAGS, *OPENMP_FLAGS, *(NVCC_FLAGS if cuda else ())]
    build_dir = cache_root() / f"{name}_{_digest(sources, flags)}"
    so = build_dir / f"{name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    alt = build_dir / f"{name}.so"
    for candidate in (so, alt):
        if candidate.exists():
            return _import_so(name, candidate)
    problem = _missing_tool(cuda)
    if problem:
        raise ExtensionBuildError(f"cannot build the exl {'CUDA' if cuda else 'CPU'} kernels: {problem}")
    build_dir.mkdir(parents=True, exist_ok=True)
    what = "CUDA" if cuda else "CPU"
    print(f"exl: compiling the {what} kernels into {build_dir} (once; about a minute)...", file=sys.stderr, flush=True)
    kwargs = dict(
        name=name,
        sources=_sources(sources),
        extra_cflags=[*CXX_FLAGS, *OPENMP_FLAGS],  # fresh lists: torch's load() appends to them
        extra_ldflags=[*OPENMP_FLAGS],
        extra_include_paths=[str(CSRC)],
        build_directory=str(build_dir),
        verbose=verbose,
    )
    if cuda:
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if not arch:
            os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(CUDA_ARCHS)
        kwargs["extra_cuda_cflags"] = [*NVCC_FLAGS]
    try:
        return ext.load(**kwargs)
    except Exception as e:  # compiler output is in the exception text
        raise ExtensionBuildError(f"building the exl {what} kernels failed: {_explain(str(e))}") from e


@functools.cache
def load_cpu(verbose: bool = False):
    """Import the prebuilt CPU extension, or JIT-compile (cached) and import it."""
    try:
        from cuda_ext import _exl_cpu  # built by `EXL_BUILD_EXT=1 pip install .`

        return _exl_cpu
    except ImportError:
        pass
    return _jit("exl_cpu", CPU_SOURCES, cuda=False, verbose=verbose)


@functools.cache
def load_cuda(verbose: bool = False):
    """Import the prebuilt CUDA extension, or JIT-compile (cached) and import it."""
    try:
        from cuda_ext import _exl_cuda

        return _exl_cuda
    except ImportError:
        pass
    return _jit("exl_cuda", CUDA_SOURCES, cuda=True, verbose=verbose)


def setup_extensions(with_cuda: bool | None = None) -> list:
    """Extension objects for setup.py: the CPU library always, the CUDA one when a toolkit is present."""
    from torch.utils.cpp_extension import CUDA_HOME, CppExtension, CUDAExtension

    root = Path(__file__).resolve().parent.parent
    rel = lambda names: [str((CSRC / n).relative_to(root)) for n in names]  # noqa: E731
    inc = [str(CSRC.relative_to(root))]
    exts = [
        CppExtension(
            "cuda_ext._exl_cpu",
            rel(CPU_SOURCES),
            include_dirs=inc,
            extra_compile_args=[*CXX_FLAGS, *OPENMP_FLAGS],
            extra_link_args=[*OPENMP_FLAGS],
        )
    ]
    if with_cuda is None:
        with_cuda = CUDA_HOME is not None
    if with_cuda:
        exts.append(
            CUDAExtension(
                "cuda_ext._exl_cuda",
                rel(CUDA_SOURCES),
                include_dirs=inc,
                extra_compile_args={"cxx": [*CXX_FLAGS, *OPENMP_FLAGS], "nvcc": [*NVCC_FLAGS]},
                extra_link_args=[*OPENMP_FLAGS],
            )
        )
    return exts
