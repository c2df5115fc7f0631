"""Build the exl C++/CUDA extensions: JIT (torch.utils.cpp_extension.load + ninja, cached) or prebuilt.

The CPU library is compiled for baseline x86-64 with AVX2/AVX-VNNI/AVX-512 code in separately targeted
functions (see csrc/cpu_kernels.h), so one cached build runs on every machine of the architecture
and picks its instruction set at run time.

The C++ standard follows the installed torch (`cxx_standard()`: C++17 up to torch 2.13, C++20 from 2.14).

Builds are cached under ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/exl/torch_extensions``, one folder per
build key (`build_key()`): torch (version, CUDA tag, install folder), Python ABI, compilers (path and
version), flags, CUDA architectures, ISA tables and the bytes of every source and header. So two
environments never share or overwrite a build. A folder is used only when its stamp (written last,
after a successful build) names the same key and the library's checksum: a partial or stale build
is rebuilt, never loaded. A build failure raises ExtensionBuildError with the compiler's first error
and what to do about it. Every load marks its folder used; after a new build, the same extension's
other builds that no environment has loaded for `PRUNE_DAYS` days, and all but the `PRUNE_KEEP` most
recently used, are deleted (`prune_builds`), so editing or upgrading exl does not pile up builds.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from exl.errors import ExlError

CSRC = Path(__file__).resolve().parent / "csrc"
CPU_SOURCES = ["cpu_ops.cpp", "cpu_isa.cpp", "cpu_pool.cpp", "cpu_scalar.cpp", "cpu_avx2.cpp", "cpu_avxvnni.cpp",
               "cpu_avx512.cpp", "cpu_fused.cpp", "cpu_step.cpp", "cpu_trellis_ops.cpp", "cpu_trellis_scalar.cpp",
               "cpu_trellis_avx2.cpp", "cpu_trellis_avx512.cpp", "trellis_encode.cpp"]
CUDA_SOURCES = ["cuda_ops.cpp", "cuda_kernels.cu", "cuda_trellis_ops.cpp", "cuda_trellis.cu", "cuda_attention.cu"]
ISA_TABLES = ("scalar", "avx2", "avxvnni", "avx512vnni")  # what the CPU library carries (csrc/cpu_kernels.h)
BASE_CXX_FLAGS = ("-O3", "-fno-math-errno", "-Wno-unused-function")
# at::parallel_for is a header template: without -fopenmp it runs serially inside the extension.
# Linking libgomp.so.1 reuses the copy torch has already loaded (same soname), so one thread pool.
OPENMP_FLAGS = ("-fopenmp",) if sys.platform.startswith("linux") else ()
BASE_NVCC_FLAGS = ("-O3", "--use_fast_math", "-lineinfo")
CUDA_ARCHS = ["7.5", "8.0", "8.6", "8.9", "9.0", "12.0"]
KEY_VERSION = 1  # bump when the layout of a build folder or its stamp changes
STAMP = "exl_build.json"
PRUNE_DAYS = 30  # a build no environment has loaded for this long is deleted after the next new build
PRUNE_KEEP = 6  # and of the rest, only this many most recently used builds of one extension are kept
BUSY_SECONDS = 3600  # a build folder touched this recently may be in use or being built: never pruned


class ExtensionBuildError(ExlError):
    """The extension could not be compiled or loaded; the message says why and what to do."""


# -- what the installed torch wants ----------------------------------------------------------------


@functools.cache
def cxx_standard() -> str:
    """The C++ standard the installed torch's headers require ('c++17' or 'c++20').

    Read from ATen.h's `#if __cplusplus < 2020xxL / #error` guard; without it, torch >= 2.14 means C++20."""
    import torch

    head = Path(torch.__file__).parent / "include" / "ATen" / "ATen.h"
    m = re.search(r"__cplusplus\s*<\s*(\d{4})\d\dL", head.read_text()) if head.is_file() else None
    if m:
        return "c++20" if int(m.group(1)) >= 2020 else "c++17"
    major, minor = (int(p) for p in re.findall(r"\d+", torch.__version__)[:2])
    return "c++20" if (major, minor) >= (2, 14) else "c++17"


def cxx_flags() -> tuple[str, ...]:
    return (*BASE_CXX_FLAGS[:1], f"-std={cxx_standard()}", *BASE_CXX_FLAGS[1:])


def nvcc_flags() -> tuple[str, ...]:
    return (*BASE_NVCC_FLAGS[:1], f"-std={cxx_standard()}", *BASE_NVCC_FLAGS[1:])


def __getattr__(name: str):
    """CXX_FLAGS / NVCC_FLAGS: the flags with the standard torch requires (computed on first use)."""
    if name == "CXX_FLAGS":
        return cxx_flags()
    if name == "NVCC_FLAGS":
        return nvcc_flags()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cuda_archs() -> list[str]:
    """The GPU architectures a CUDA build targets: $TORCH_CUDA_ARCH_LIST, else CUDA_ARCHS."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    return env.replace(" ", ";").split(";") if env else list(CUDA_ARCHS)


# -- tools -------------------------------------------------------------------------------------------


def cxx_command() -> str:
    return os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension runs


def nvcc_path() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return str(Path(CUDA_HOME) / "bin" / "nvcc")
    return None


@functools.cache
def tool_version(command: str | None) -> str:
    """'real path: version line' of a compiler (what the build key records), or '<command>: not found'."""
    path = shutil.which(command) if command else None
    if path is None:
        return f"{command}: not found"
    try:
        res = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
        lines = [ln.strip() for ln in (res.stdout or res.stderr).splitlines() if ln.strip()]
    except (OSError, subprocess.SubprocessError) as e:
        lines = [f"--version failed: {e}"]
    release = next((ln for ln in lines if "release" in ln), None)  # nvcc: 'Cuda compilation tools, release 13.0, V13.0.88'
    return f"{os.path.realpath(path)}: {release or (lines[0] if lines else '?')}"


# -- the build key --------------------------------------------------------------------------------------


def build_key(name: str, sources: list[Path], cuda: bool, cflags, ldflags, cuda_cflags=()) -> dict:
    """Everything that changes the binary of one extension build."""
    import torch

    files = sorted({*sources, *(p for p in CSRC.iterdir() if p.suffix in (".h", ".inc", ".cuh"))})
    key = {
        "exl_build": KEY_VERSION,
        "name": name,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or "none",
        "torch_dir": os.path.realpath(Path(torch.__file__).parent),
        "python": f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')} {sysconfig.get_platform()}",
        "cxx": tool_version(cxx_command()),
        "cflags": list(cflags),
        "ldflags": list(ldflags),
        "sources": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files},
    }
    if cuda:
        key["nvcc"] = tool_version(nvcc_path())
        key["cc"] = tool_version(os.environ["CC"]) if os.environ.get("CC") else "default"  # nvcc's -ccbin
        key["cuda_cflags"] = list(cuda_cflags)
        key["cuda_archs"] = cuda_archs()
    else:
        key["isa_tables"] = list(ISA_TABLES)
    return key


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cache_root() -> Path:
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "exl" / "torch_extensions"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_stamp(stamp: Path, key: dict, library: Path) -> None:
    """Record a finished build: its key and the library's checksum (written atomically, last)."""
    tmp = stamp.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "library": library.name, "sha256": _sha256(library)}, indent=1))
    os.replace(tmp, stamp)


def stamp_matches(stamp: Path, key: dict, library: Path) -> bool:
    """True when `library` is the finished build of exactly `key`."""
    try:
        data = json.loads(stamp.read_text())
        return data["key"] == key and library.is_file() and data["sha256"] == _sha256(library)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def mark_used(build_dir: Path) -> None:
    """Record that this build was just loaded (its folder's mtime), for `prune_builds`."""
    with contextlib.suppress(OSError):
        os.utime(build_dir)


def prune_builds(name: str, current: Path, now: float | None = None) -> list[Path]:
    """Delete the cached builds of extension `name` other than `current` that were last used over
    PRUNE_DAYS days ago or are not among the PRUNE_KEEP most recently used; never one used in the last
    BUSY_SECONDS (another process may hold it). Returns the deleted folders."""
    now = time.time() if now is None else now
    pattern = re.compile(re.escape(name) + r"_[0-9a-f]{16}")
    builds = []
    for d in current.parent.iterdir():
        if d != current and d.is_dir() and pattern.fullmatch(d.name):
            with contextlib.suppress(OSError):
                builds.append((d.stat().st_mtime, d))
    builds.sort(reverse=True)  # most recently used first
    removed = []
    for rank, (used, d) in enumerate(builds, start=1):  # `current` is the most recent of all
        if now - used < BUSY_SECONDS or (rank < PRUNE_KEEP and now - used < PRUNE_DAYS * 86400):
            continue
        shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            d.with_name(d.name + ".lock").unlink()
        removed.append(d)
    return removed


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock between processes (released by the OS if the holder dies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            import fcntl
        except ImportError:  # Windows: no lock; torch's own build lock still guards the compile
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# -- building -----------------------------------------------------------------------------------------


def _import_so(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _missing_tool(cuda: bool) -> str | None:
    cxx = cxx_command()
    if shutil.which(cxx) is None:
        return f"no C++ compiler: `{cxx}` is not on PATH (install g++, e.g. `apt-get install g++`, or set CXX)"
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401  (the pip package puts `ninja` next to python)
        except ImportError:
            return "ninja is missing: `pip install ninja`"
    if cuda:
        import torch

        if torch.version.cuda is None:
            return f"this PyTorch ({torch.__version__}) is a CPU-only build: install a CUDA build of PyTorch"
        from torch.utils.cpp_extension import CUDA_HOME

        if nvcc_path() is None:
            return (f"no CUDA toolkit: nvcc not found under CUDA_HOME={CUDA_HOME} (install the CUDA toolkit or "
                    f"set CUDA_HOME to its folder{_cuda_home_hint()})")
        if not (Path(CUDA_HOME) / "include" / "cuda_runtime_api.h").is_file():
            return (f"CUDA_HOME={CUDA_HOME} has no include/cuda_runtime_api.h: set CUDA_HOME to the CUDA toolkit's "
                    f"folder{_cuda_home_hint()}")
    return None


def _cuda_home_hint() -> str:
    found = sorted(str(p.parent.parent) for p in Path("/usr/local").glob("cuda*/include/cuda_runtime_api.h"))
    return f", e.g. CUDA_HOME={found[0]}" if found else ""


_NOT_ERRORS = re.compile(r"Error building extension|ninja: build stopped|subprocess\.CalledProcessError")


def first_error(log: str) -> str:
    """The compiler's first error line in a build log (what a user should read first)."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip() and not _NOT_ERRORS.search(ln)]
    for pattern in (r"\berror\b\s*:|#error", r"\berror\b|FAILED"):
        hit = next((ln for ln in lines if re.search(pattern, ln, re.IGNORECASE)), None)
        if hit:
            m = re.search(r"fatal error: ([^\s:]+): No such file", hit)
            if m and m.group(1).startswith("Python"):
                hit += " (the Python headers are missing: install python3-dev)"
            return hit[:500]
    return lines[-1][:500] if lines else "no compiler output"


def _how_to_fix(cuda: bool) -> str:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    need = cxx_standard().replace("c++", "C++")
    fixes = [f"a C++ compiler with {need} support (torch {torch.__version__} requires it); "
             f"now {tool_version(cxx_command())}; choose one with CXX=..."]
    if cuda:
        fixes.append(f"a CUDA toolkit matching torch's CUDA {torch.version.cuda}; now CUDA_HOME={CUDA_HOME}, "
                     f"{tool_version(nvcc_path())}; choose one with CUDA_HOME=...")
    fixes.append("or set EXL_NO_EXT=1 to run exl on the slow plain-PyTorch reference path on purpose")
    return "To fix:\n" + "\n".join(f"  - {f}" for f in fixes)


def _jit(name: str, sources: list, cuda: bool, verbose: bool = False, extra_cflags=(), extra_ldflags=()):
    """Import the cached build of `sources` (paths, or names in csrc/) for this environment, building it first
    if needed. Other builds (e.g. a test harness) pass their own extra flags and get the same key and stamp."""
    sources = [CSRC / s for s in sources]  # a name joins csrc/; an absolute path stays itself
    cflags = [*cxx_flags(), *OPENMP_FLAGS, *extra_cflags]
    ldflags = [*OPENMP_FLAGS, *extra_ldflags]
    cuda_cflags = [*nvcc_flags()] if cuda else []
    key = build_key(name, sources, cuda, cflags, ldflags, cuda_cflags)
    build_dir = cache_root() / f"{name}_{key_digest(key)}"
    library, stamp = build_dir / f"{name}.so", build_dir / STAMP
    if stamp_matches(stamp, key, library):
        mark_used(build_dir)
        return _import_so(name, library)
    what = "CUDA" if cuda else "CPU"
    problem = _missing_tool(cuda)
    if problem:
        raise ExtensionBuildError(f"cannot build the exl {what} kernels: {problem}.\n"
                                  f"Or set EXL_NO_EXT=1 to run exl on the slow plain-PyTorch reference path on purpose.")
    with _locked(build_dir.with_name(build_dir.name + ".lock")):
        if stamp_matches(stamp, key, library):  # another process built it while we waited
            return _import_so(name, library)
        shutil.rmtree(build_dir, ignore_errors=True)  # a partial or stale build: start clean
        build_dir.mkdir(parents=True)
        print(f"exl: compiling the {what} kernels into {build_dir} (once; about a minute)...", file=sys.stderr,
              flush=True)
        module = _build(name, sources, cuda, build_dir, cflags, ldflags, cuda_cflags, verbose)
        write_stamp(stamp, key, library)
    prune_builds(name, build_dir)
    return module


def _build(name, sources, cuda, build_dir, cflags, ldflags, cuda_cflags, verbose):
    import torch.utils.cpp_extension as ext

    what = "CUDA" if cuda else "CPU"
    kwargs = dict(
        name=name,
        sources=[str(s) for s in sources],
        extra_cflags=list(cflags),  # fresh lists: torch's load() appends to them
        extra_ldflags=list(ldflags),
        extra_include_paths=[str(CSRC)],
        build_directory=str(build_dir),
        verbose=verbose,
    )
    if cuda:
        kwargs["extra_cuda_cflags"] = list(cuda_cflags)
    before = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if cuda:
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(cuda_archs())
    try:
        return ext.load(**kwargs)
    except Exception as e:  # the compiler's output is in the exception text
        log = build_dir / "build.log"
        log.write_text(str(e))
        raise ExtensionBuildError(
            f"building the exl {what} kernels failed (torch {_torch_version()}, -std={cxx_standard()}):\n"
            f"  first error: {first_error(str(e))}\n"
            f"  full compiler output: {log}\n{_how_to_fix(cuda)}") from e
    finally:
        if cuda and before is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)


def _torch_version() -> str:
    import torch

    return torch.__version__


# -- prebuilt extensions (setup.py) -------------------------------------------------------------------


def _prebuilt(name: str, sources: list[str], cuda: bool):
    """The extension `EXL_BUILD_EXT=1 pip install` built, if present and built for exactly this environment."""
    spec = importlib.util.find_spec(f"cuda_ext.{name}")
    if spec is None or not spec.origin:
        return None
    library = Path(spec.origin)
    if not stamp_matches(library.with_name(f"{name}.{STAMP}"), setup_key(name, sources, cuda), library):
        print(f"exl: ignoring the prebuilt {library} (not built for this torch, compiler or sources); "
              f"building a matching one instead", file=sys.stderr, flush=True)
        return None
    return _import_so(f"cuda_ext.{name}", library)


def setup_key(name: str, sources: list[str], cuda: bool) -> dict:
    cflags, ldflags = [*cxx_flags(), *OPENMP_FLAGS], [*OPENMP_FLAGS]
    return build_key(f"cuda_ext.{name}", _sources(sources), cuda, cflags, ldflags, nvcc_flags() if cuda else ())


def _sources(names: list[str]) -> list[Path]:
    return [CSRC / n for n in names]


@functools.cache
def load_cpu(verbose: bool = False):
    """Import the prebuilt CPU extension, or JIT-compile (cached) and import it."""
    return _prebuilt("_exl_cpu", CPU_SOURCES, False) or _jit("exl_cpu", _sources(CPU_SOURCES), False, verbose)


@functools.cache
def load_cuda(verbose: bool = False):
    """Import the prebuilt CUDA extension, or JIT-compile (cached) and import it."""
    return _prebuilt("_exl_cuda", CUDA_SOURCES, True) or _jit("exl_cuda", _sources(CUDA_SOURCES), True, verbose)


def status(kind: str) -> dict:
    """Where the `kind` ('cpu' or 'cuda') extension of this environment lives and whether it is built."""
    cuda = kind == "cuda"
    names = CUDA_SOURCES if cuda else CPU_SOURCES
    name = "exl_cuda" if cuda else "exl_cpu"
    spec = importlib.util.find_spec(f"cuda_ext._{name}")
    if spec is not None and spec.origin:
        library = Path(spec.origin)
        if stamp_matches(library.with_name(f"_{name}.{STAMP}"), setup_key(f"_{name}", names, cuda), library):
            return {"built": True, "prebuilt": True, "path": str(library)}
    cflags, ldflags = [*cxx_flags(), *OPENMP_FLAGS], [*OPENMP_FLAGS]
    key = build_key(name, _sources(names), cuda, cflags, ldflags, nvcc_flags() if cuda else ())
    build_dir = cache_root() / f"{name}_{key_digest(key)}"
    return {"built": stamp_matches(build_dir / STAMP, key, build_dir / f"{name}.so"), "prebuilt": False,
            "path": str(build_dir)}


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
            extra_compile_args=[*cxx_flags(), *OPENMP_FLAGS],
            extra_link_args=[*OPENMP_FLAGS],
        )
    ]
    if with_cuda is None:
        import torch

        with_cuda = CUDA_HOME is not None and torch.version.cuda is not None  # a CPU-only torch cannot link it
    if with_cuda:
        exts.append(
            CUDAExtension(
                "cuda_ext._exl_cuda",
                rel(CUDA_SOURCES),
                include_dirs=inc,
                extra_compile_args={"cxx": [*cxx_flags(), *OPENMP_FLAGS], "nvcc": [*nvcc_flags()]},
                extra_link_args=[*OPENMP_FLAGS],
            )
        )
    return exts


def stamped_build_ext():
    """setup.py's build_ext: torch's BuildExtension that stamps each library it builds (see _prebuilt)."""
    from torch.utils.cpp_extension import BuildExtension

    class StampedBuildExtension(BuildExtension):
        def build_extension(self, ext):
            if ext.name.endswith("_exl_cuda"):
                os.environ.setdefault("TORCH_CUDA_ARCH_LIST", ";".join(cuda_archs()))
            super().build_extension(ext)
            short = ext.name.rsplit(".", 1)[-1]
            library = Path(self.get_ext_fullpath(ext.name))
            names = CUDA_SOURCES if short == "_exl_cuda" else CPU_SOURCES
            write_stamp(library.with_name(f"{short}.{STAMP}"), setup_key(short, names, short == "_exl_cuda"), library)

        def copy_extensions_to_source(self):  # --inplace / editable installs: the stamps travel with the libraries
            super().copy_extensions_to_source()
            for ext in self.extensions:
                short, inplace = ext.name.rsplit(".", 1)[-1], self.inplace
                self.inplace = 0
                built = Path(self.get_ext_fullpath(ext.name)).with_name(f"{short}.{STAMP}")
                self.inplace = 1
                target = Path(self.get_ext_fullpath(ext.name)).with_name(f"{short}.{STAMP}")
                self.inplace = inplace
                if built.is_file() and built != target:
                    shutil.copyfile(built, target)

    return StampedBuildExtension
