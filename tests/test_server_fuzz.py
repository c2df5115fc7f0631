"""Schema fuzzing: schemathesis generates requests from our own OpenAPI document; no answer may be a 5xx and
the server (and its generator thread) must survive.

The server runs a tiny random llama with SmolLM2's tokenizer (the weights do not matter here, speed does).
The default run is bounded to about a minute; `-m slow` runs a longer one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
import xml.etree.ElementTree as ET

import httpx
import pytest

from test_server_utils import Server, make_tiny_model

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(smollm_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    make_tiny_model(smollm_dir, root / "models" / "tiny", ctx=256)
    srv = Server(root / "models", "tiny", root, ["--max-seq-len", "128", "--cache-size", "4096", "--page-size", "64",
                                                 "--no-log-requests", "--log-level", "warning"])
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _schemathesis(server, tmp_path, *args) -> subprocess.CompletedProcess:
    exe = shutil.which("st") or shutil.which("schemathesis")
    cmd = [exe] if exe else [sys.executable, "-m", "schemathesis.cli"]
    cmd += ["run", server.url + "/openapi.json", "-H", f"Authorization: Bearer {server.admin_key}",
            "--checks", "not_a_server_error", "--request-timeout", "180", "--seed", "1", "--workers", "2",
            "--exclude-path", "/v1/model/unload",  # would only turn later requests into 404s
            "--report", "junit", "--report-dir", str(tmp_path), *args]
    env = {**os.environ, "NO_COLOR": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)


_INTERNAL = ("schemathesis/specs/openapi/coverage", "hypothesis/", "Inconsistent results")


def _check(server, proc, report_dir):
    """No check failed (a 5xx is a failure), no request errored, and the server is healthy afterwards.

    Errors that schemathesis raises while *generating* test data (its coverage phase trips over some nested
    schemas: "Inconsistent results", recursion errors, always with a traceback inside schemathesis or
    hypothesis) are reported but do not fail the test; network errors and timeouts do. The request timeout, 180 s,
    catches a hung server; a request for n=15 completions of 2 prompts up to the 128-token context took over 60 s on a
    2-core host that another 2-thread job shared (CI of 2026-12-07).
    """
    out = proc.stdout + proc.stderr
    reports = sorted(report_dir.glob("junit*.xml"), key=lambda p: p.stat().st_mtime)
    assert reports, out[-4000:]
    root = ET.parse(reports[-1]).getroot()
    failures = [(c.get("name"), f.text or "") for c in root.iter("testcase") for f in c.findall("failure")]
    errors = [(c.get("name"), e.text or "") for c in root.iter("testcase") for e in c.findall("error")]
    assert not failures, "\n\n".join(f"{n}:\n{t[:2000]}" for n, t in failures)
    internal = [(n, t) for n, t in errors if t.startswith("Runtime Error") and any(k in t for k in _INTERNAL)]
    real = [e for e in errors if e not in internal]
    assert not real, "\n\n".join(f"{n}:\n{t[:2000]}" for n, t in real)
    for name, text in internal:
        warnings.warn(f"schemathesis could not generate data for {name}: {text.splitlines()[2][:200]}")
    assert "generated" in out
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "model": "tiny", "detail": None}
    log = server.log()
    assert "restarting" not in log, "the generator thread crashed during fuzzing:\n" + log[-4000:]
    assert "unexpected error" not in log, log[-4000:]


def _run(server, tmp_path, max_time: int, examples: int):
    # Coverage phase (boundary and negative values) everywhere but chat, whose nested schema trips an internal
    # generation error in schemathesis 4's coverage phase; then random fuzzing of every operation.
    cov = _schemathesis(server, tmp_path, "--phases", "examples,coverage", "--exclude-path", "/v1/chat/completions",
                        "--max-examples", str(examples), "--max-time", str(max_time // 3))
    _check(server, cov, tmp_path)
    fuzz = _schemathesis(server, tmp_path, "--phases", "fuzzing", "--max-examples", str(examples),
                         "--max-time", str(max_time - max_time // 3))
    _check(server, fuzz, tmp_path)


def test_schema_fuzz_short(server, tmp_path):
    _run(server, tmp_path, max_time=45, examples=15)


@pytest.mark.slow
def test_schema_fuzz_long(server, tmp_path):
    _run(server, tmp_path, max_time=600, examples=300)
