"""`exl info` (exl/commands/info.py) and the one table of EXL_* variables (exl/env.py, docs/env.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cuda_ext import build
from exl import env
from exl import format as F

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.kernels


def exl_info(*args, **environ) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(ROOT), **environ}
    return subprocess.run([sys.executable, "-m", "exl.cli", "info", *args], env=e, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def ext():
    return build.load_cpu()  # so that `exl info` finds the extension built


def test_info_json_reports_versions_builds_and_the_chosen_isa(ext):
    res = exl_info("--json", EXL_CPU_ISA="scalar", EXL_TYPO_XYZ="1")
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads(res.stdout)
    assert info["torch"] == torch.__version__ and info["torch_cuda"] == torch.version.cuda
    assert info["cxx_standard"] == build.cxx_standard()
    cpu = info["extensions"]["cpu"]
    assert cpu["built"] is True and Path(cpu["path"]).exists()
    assert cpu["isa"] == "scalar" and cpu["isa_available"] == list(ext.isa_names())  # the extension's own answer
    assert info["env"]["EXL_CPU_ISA"] == "scalar" and info["env_unknown"] == ["EXL_TYPO_XYZ"]
    assert info["gpus"] == [] if not torch.cuda.is_available() else len(info["gpus"]) == torch.cuda.device_count()


def test_info_text_names_the_isa_and_a_bad_choice(ext):
    best = ext.isa_names()[-1]
    res = exl_info()
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"CPU instruction set: {best}" in res.stdout and "cpu kernels: built" in res.stdout
    assert "trellis codes 2 and 3, batches (prefill): " in res.stdout
    # the batch size from which trellis codes 2 and 3 take the GEMM: the kernel's own default (None: never)
    cpu = json.loads(exl_info("--json").stdout)["extensions"]["cpu"]
    meta = F.TrellisMeta(4, F.TWO_TABLE_STATE_BITS, code=3)
    layer = ext.TrellisLinearCPU(torch.zeros(1, 1, meta.words_per_tile, dtype=torch.int32),
                                 torch.ones(16, dtype=torch.float16), meta.to_tensor(), F.pack_signs(torch.ones(16)),
                                 F.pack_signs(torch.ones(16)), None, tcode=F.two_table_default(3))
    every = layer.int8_every_batch
    assert cpu["trellis_gemm_min_rows"] == (None if every else layer.int8_gemm_min_rows)
    assert every == ("trellis codes 2 and 3, batches (prefill): int8 GEMV at every size" in res.stdout)
    # scalar codes: the table's own cutover (None: never, on AVX-512 VNNI), said in words too
    assert cpu["gemm_min_rows"] == {"avx2": 128, "avxvnni": 64, "avx512vnni": None, "scalar": 17}[best]
    if cpu["gemm_min_rows"] is None:
        assert "scalar codes, batches (prefill): int8 GEMV at every size" in res.stdout
    else:
        assert f"scalar codes, batches (prefill): dequant + fp32 GEMM from {cpu['gemm_min_rows']} rows" in res.stdout
    bad = exl_info("--json", EXL_CPU_ISA="avx9000")
    assert "instruction set 'avx9000' is not available" in json.loads(bad.stdout)["extensions"]["cpu"]["isa_error"]


def test_env_doc_lists_every_variable_the_code_reads():
    doc = (ROOT / "docs" / "env.md").read_text()
    documented = set(re.findall(r"^\| `(EXL_[A-Z0-9_]+)` \|", doc, re.M))
    assert documented == set(env.EXL_VARS)
    read = set()
    for folder in ("exl", "quant", "calibration", "cuda_ext", "bench"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".cpp", ".cu", ".h", ".sh"):
                text = path.read_text(errors="replace")
                read |= set(re.findall(r"""(?:environ(?:\.get)?\(?\[?|getenv\()\s*["'](EXL_[A-Z0-9_]+)""", text))
                read |= set(re.findall(r"\$\{?(EXL_[A-Z0-9_]+)", text)) if path.suffix == ".sh" else set()
    for name in ("setup.py", "convert.py"):
        read |= set(re.findall(r"""environ(?:\.get)?\(?\[?\s*["'](EXL_[A-Z0-9_]+)""", (ROOT / name).read_text()))
    assert read and read <= set(env.EXL_VARS), sorted(read - set(env.EXL_VARS))
