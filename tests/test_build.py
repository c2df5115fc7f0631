"""Building the extensions (cuda_ext/build.py): the C++ standard follows torch, the build key covers every
input of the binary, a build is loaded only after its stamp checks out, and a build failure is a clear
error (the reference path runs only with EXL_NO_EXT=1).

The stamp tests build a tiny C++ module through the same JIT path as the real kernels (seconds, not minutes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cuda_ext
from cuda_ext import build
from exl import format as F
from exl.modules.quant_linear import QuantLinear

pytestmark = pytest.mark.kernels
ROOT = Path(__file__).resolve().parent.parent

TINY = r"""
#include <Python.h>
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(ANSWER); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef def = {PyModuleDef_HEAD_INIT, "exl_tiny", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_exl_tiny() { return PyModule_Create(&def); }
"""

FAILING_CXX = """#!/bin/sh
case "$*" in *--version*|*-dumpversion*|*-dumpfullversion*) echo "brokencc 1.0"; exit 0;; esac
echo "tiny.cpp:1:1: error: this compiler fails on purpose" >&2
exit 1
"""


def run_py(code: str, env: dict, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def failing_compiler(tmp_path: Path) -> str:
    cxx = tmp_path / "brokencc"
    cxx.write_text(FAILING_CXX)
    cxx.chmod(0o755)
    return str(cxx)


# -- the C++ standard ---------------------------------------------------------------------------------


def test_cxx_standard_follows_the_torch_headers():
    aten = (Path(torch.__file__).parent / "include" / "ATen" / "ATen.h").read_text()
    want = "c++20" if "__cplusplus < 2020" in aten else "c++17"
    assert build.cxx_standard() == want
    assert f"-std={want}" in build.cxx_flags() and f"-std={want}" in build.nvcc_flags()
    assert build.CXX_FLAGS == build.cxx_flags()  # what compile_check imports
    for e in build.setup_extensions():  # setup.py gets the same standard
        args = e.extra_compile_args
        flags = args["cxx"] + args["nvcc"] if isinstance(args, dict) else args
        assert [f for f in flags if f.startswith("-std=")] in ([f"-std={want}"], [f"-std={want}"] * 2)


# -- the build key ------------------------------------------------------------------------------------


def key_of(monkeypatch, tmp_path, **change):
    """The digest of the CPU build key, after applying one change."""
    src = tmp_path / "src.cpp"
    src.write_text(change.get("source", "int f() { return 1; }"))
    if "torch" in change:
        monkeypatch.setattr(torch, "__version__", change["torch"])
    if "torch_cuda" in change:
        monkeypatch.setattr(torch.version, "cuda", change["torch_cuda"])
    if "ext_suffix" in change:
        real = build.sysconfig.get_config_var
        monkeypatch.setattr(build.sysconfig, "get_config_var",
                            lambda n: change["ext_suffix"] if n == "EXT_SUFFIX" else real(n))
    if "cxx" in change:
        monkeypatch.setenv("CXX", change["cxx"])
    if "archs" in change:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", change["archs"])
    flags = change.get("flags", ["-O3"])
    key = build.build_key("exl_x", [src], change.get("cuda", False), flags, [])
    monkeypatch.undo()
    return build.key_digest(key)


def test_build_key_changes_with_every_input(monkeypatch, tmp_path):
    base = key_of(monkeypatch, tmp_path)
    assert key_of(monkeypatch, tmp_path) == base  # deterministic
    changes = {
        "torch": dict(torch="2.99.0+cpu"),
        "torch cuda tag": dict(torch_cuda="99.9"),
        "python abi": dict(ext_suffix=".cpython-399-x86_64-linux-gnu.so"),
        "compiler": dict(cxx=failing_compiler(tmp_path)),
        "flags": dict(flags=["-O2"]),
        "source": dict(source="int f() { return 2; }"),
        "cuda (nvcc, archs)": dict(cuda=True),
    }
    digests = {name: key_of(monkeypatch, tmp_path, **c) for name, c in changes.items()}
    for name, d in digests.items():
        assert d != base, name
    assert len(set(digests.values())) == len(digests)
    cuda_a = key_of(monkeypatch, tmp_path, cuda=True, archs="8.0")
    assert cuda_a != key_of(monkeypatch, tmp_path, cuda=True, archs="8.0;9.0")


def test_build_key_covers_headers_and_torch_install(tmp_path):
    key = build.build_key("exl_cpu", build._sources(build.CPU_SOURCES), False, build.cxx_flags(), [])
    assert {"format.h", "cpu_kernels.h", "cpu_simd.inc"} <= set(key["sources"])
    assert key["torch_dir"] == os.path.realpath(Path(torch.__file__).parent)  # two venvs never share a folder
    assert key["isa_tables"] == list(build.ISA_TABLES)


# -- stamps: a build is loaded only when it is complete and matches -----------------------------------

def tiny_build(tmp_path: Path, answer: int = 42) -> subprocess.CompletedProcess:
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY.replace("ANSWER", str(answer)))
    code = (f"from pathlib import Path; from cuda_ext import build\n"
            f"m = build._jit('exl_tiny', [Path({str(src)!r})], cuda=False)\nprint('answer', m.answer(), m.__file__)")
    return run_py(code, {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})


def tiny_dir(tmp_path: Path) -> Path:
    (d,) = [p for p in (tmp_path / "ext").iterdir() if p.is_dir()]
    return d


def test_a_build_is_stamped_and_reused(tmp_path):
    first = tiny_build(tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "answer 42" in first.stdout and "compiling" in first.stderr
    d = tiny_dir(tmp_path)
    stamp = json.loads((d / build.STAMP).read_text())
    assert stamp["library"] == "exl_tiny.so" and stamp["key"]["name"] == "exl_tiny"
    again = tiny_build(tmp_path)
    assert again.returncode == 0 and "answer 42" in again.stdout
    assert "compiling" not in again.stderr  # loaded from the stamped folder


def test_stale_builds_are_pruned_and_recent_ones_kept(tmp_path):
    day, now = 86400.0, 1.8e9
    current = tmp_path / "exl_cpu_0000000000000000"
    ages = {  # folder -> days since an environment last loaded it
        "exl_cpu_1111111111111111": 0.01,  # used minutes ago: maybe being built or loaded elsewhere
        "exl_cpu_2222222222222222": 1, "exl_cpu_3333333333333333": 2, "exl_cpu_4444444444444444": 3,
        "exl_cpu_5555555555555555": 4, "exl_cpu_6666666666666666": 5,  # 6th most recent of the others
        "exl_cpu_7777777777777777": 40,  # unused for over PRUNE_DAYS
        "exl_cuda_8888888888888888": 400, "exl_cpu_host_9999999999999999": 400, "exl_cpu_notahash": 400,
    }
    for d in [current, *map(tmp_path.joinpath, ages)]:
        (d / "lib").mkdir(parents=True)
    (tmp_path / "exl_cpu_7777777777777777.lock").touch()
    for name, age in ages.items():
        os.utime(tmp_path / name, (now - age * day, now - age * day))
    removed = build.prune_builds("exl_cpu", current, now=now)
    assert build.PRUNE_KEEP == 6 and build.PRUNE_DAYS == 30
    assert sorted(d.name for d in removed) == ["exl_cpu_6666666666666666", "exl_cpu_7777777777777777"]
    left = sorted(d.name for d in tmp_path.iterdir())
    assert "exl_cpu_7777777777777777.lock" not in left and current.name in left
    assert {"exl_cpu_1111111111111111", "exl_cpu_5555555555555555", "exl_cuda_8888888888888888",
            "exl_cpu_host_9999999999999999", "exl_cpu_notahash"} <= set(left)  # other extensions, other names


def test_loading_marks_a_build_used_and_a_new_build_prunes_stale_ones(tmp_path):
    assert tiny_build(tmp_path).returncode == 0
    d = tiny_dir(tmp_path)
    long_ago = 1e9  # 2001
    os.utime(d, (long_ago, long_ago))
    assert tiny_build(tmp_path).returncode == 0  # loaded, not built: marked used now
    assert d.stat().st_mtime > long_ago + 86400
    os.utime(d, (long_ago, long_ago))
    res = tiny_build(tmp_path, answer=43)  # another source: a new build, which prunes the stale one
    assert res.returncode == 0 and "compiling" in res.stderr and "answer 43" in res.stdout
    assert tiny_dir(tmp_path) != d and not d.exists()


@pytest.mark.parametrize("damage", ["no stamp (killed mid-build)", "truncated library", "stamp of another key"])
def test_a_partial_or_stale_build_is_rebuilt_not_loaded(tmp_path, damage):
    assert tiny_build(tmp_path).returncode == 0
    d = tiny_dir(tmp_path)
    library, stamp = d / "exl_tiny.so", d / build.STAMP
    if damage.startswith("no stamp"):
        stamp.unlink()
        library.write_bytes(b"garbage: not a shared object")
    elif damage == "truncated library":
        library.write_bytes(library.read_bytes()[:1000])
    else:
        data = json.loads(stamp.read_text())
        data["key"]["torch"] = "0.0.1"
        stamp.write_text(json.dumps(data))
    res = tiny_build(tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "compiling" in res.stderr and "answer 42" in res.stdout


# -- failures are loud; the reference path runs only when asked ----------------------------------------


def test_first_error_picks_the_compiler_line():
    log = ("Error building extension 'exl_cpu': [1/7] c++ -MMD ... -c cpu_ops.cpp\nFAILED: cpu_ops.o\n"
           "In file included from cpu_ops.cpp:4:\n"
           "/x/torch/include/ATen/ATen.h:5:2: error: #error C++20 or later compatible compiler is required\n"
           "cpu_ops.cpp:9:1: error: second\nninja: build stopped: subcommand failed.")
    assert build.first_error(log) == ("/x/torch/include/ATen/ATen.h:5:2: error: #error C++20 or later compatible "
                                      "compiler is required")
    assert "python3-dev" in build.first_error("cpu_ops.cpp:1: fatal error: Python.h: No such file or directory")


def test_missing_compiler_is_an_error_not_a_fallback(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(build.ExtensionBuildError, match="(?s)no C\\+\\+ compiler: `no-such-compiler-xyz`.*EXL_NO_EXT=1"):
        build._jit("exl_cpu", build._sources(build.CPU_SOURCES), cuda=False)
    monkeypatch.setattr(cuda_ext, "load_cpu", lambda: build._jit("exl_cpu", build._sources(build.CPU_SOURCES), False))
    monkeypatch.setattr(cuda_ext, "_cache", {})
    for _ in range(2):  # the failure is remembered, and raised again
        with pytest.raises(build.ExtensionBuildError, match="no-such-compiler-xyz"):
            cuda_ext.cpu()
    monkeypatch.setenv("EXL_NO_EXT", "1")
    assert cuda_ext.cpu() is None


def test_reference_path_only_with_exl_no_ext(monkeypatch):
    segs = [F.Segment(64, 3, 32)]
    g = torch.Generator().manual_seed(2)
    t = {"qweight": F.pack_codes(torch.randint(0, 8, (8, 64), generator=g).to(torch.uint8), segs),
         "qscale": (torch.rand(8, 2, generator=g) * 0.1).half(), "qmeta": F.segments_to_meta(segs)}
    x = torch.randn(2, 64, generator=g)
    monkeypatch.setenv("EXL_NO_EXT", "1")
    layer = QuantLinear(t)
    assert layer.kernel() is None
    assert torch.equal(layer(x), F.reference_forward(x, t))
    monkeypatch.delenv("EXL_NO_EXT")
    assert QuantLinear(t).kernel() is not None  # the extension, without being asked


def test_loading_a_model_with_a_broken_compiler_fails_clearly(tmp_path, smollm_dir):
    """A compiler that fails: `exl generate` stops at load with the compiler's first error and the fixes;
    EXL_NO_EXT=1 runs the same command on the reference path."""
    env = {"CXX": failing_compiler(tmp_path), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    cmd = f"import sys; from exl.cli import main; sys.exit(main(['generate', '-m', {str(smollm_dir)!r}, '-p', 'Hi', " \
          f"'--max-new-tokens', '2', '--device', 'cpu']))"  # the CPU kernels, on a GPU box too
    res = run_py(cmd, env)
    assert res.returncode == 2, res.stderr[-3000:]
    err = res.stderr
    assert "building the exl CPU kernels failed" in err
    assert "first error: tiny.cpp:1:1: error: this compiler fails on purpose" in err
    assert "CXX=" in err and "EXL_NO_EXT=1" in err and "Traceback" not in err
    ok = run_py(cmd, {**env, "EXL_NO_EXT": "1"})
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert ok.stdout.strip() and "compiling" not in ok.stderr


def test_cuda_extension_links_and_imports_without_a_gpu():
    """Under a CUDA build of torch with a toolkit present (CI's second torch), the CUDA kernels build through
    the JIT path and import on a machine without a GPU."""
    import shutil

    if torch.version.cuda is None:
        pytest.skip("this PyTorch is a CPU-only build")
    if shutil.which("nvcc") is None and build.nvcc_path() is None:
        pytest.skip("no CUDA toolkit (nvcc) here")
    ext = build.load_cuda()
    assert {"QuantLinearCUDA", "fwht", "kv_quantize", "kv_dequantize"} <= set(dir(ext))
    assert build.status("cuda")["built"]
