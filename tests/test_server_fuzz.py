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
            "--checks", "not_a_server_error", "--request-timeout", "60", "--seed", "1", "--workers", "2",
            "--exclude-path", "/v1/model/unload",  # would only turn later requests into 404s
            "--report", "junit", "--report-dir", str(tmp_path), *args]
    env = {**os.environ, "NO_COLOR": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)


def _check(server, proc):
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "passed" in out
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "model": "tiny", "detail": None}
    log = server.log()
    assert "restarting" not in log, "the generator thread crashed during fuzzing:\n" + log[-4000:]
    assert "unexpected error" not in log, log[-4000:]


def _run(server, tmp_path, max_time: int, examples: int):
    # Coverage phase (boundary and negative values) everywhere but chat, whose nested schema trips an internal
    # generation error in schemathesis 4's coverage phase; then random fuzzing of every operation.
    cov = _schemathesis(server, tmp_path, "--phases", "examples,coverage", "--exclude-path", "/v1/chat/completions",
                        "--max-examples", str(examples), "--max-time", str(max_time // 3))
    _check(server, cov)
    fuzz = _schemathesis(server, tmp_path, "--phases", "fuzzing", "--max-examples", str(examples),
                         "--max-time", str(max_time - max_time // 3))
    _check(server, fuzz)


def test_schema_fuzz_short(server, tmp_path):
    _run(server, tmp_path, max_time=45, examples=15)


@pytest.mark.slow
def test_schema_fuzz_long(server, tmp_path):
    _run(server, tmp_path, max_time=600, examples=300)
