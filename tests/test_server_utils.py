"""Helpers for the server tests: model folders, a real `exl serve` process on a free port.

(Collected by pytest like any test module; the one test here checks the helpers themselves.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]

# A Qwen-2.5-style chat template that renders `tools` and asks for <tool_call>{json}</tool_call> replies.
TOOL_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}


# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{% for message in messages %}
{% if message.role == 'system' and loop.first %}
{% elif message.role == 'assistant' and message.tool_calls %}
<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{% for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}
<|im_end|>
{% elif message.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""


def link_model(src: Path, dst: Path) -> Path:
    """A copy of model folder `src` at `dst`, hard-linking the files where possible (same file system)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file() and not f.name.startswith("."):
            target = dst / f.name
            try:
                os.link(f, target)
            except OSError:
                shutil.copy2(f, target)
    return dst


def make_tool_model(src: Path, dst: Path) -> Path:
    """SmolLM2 with the Qwen-style tool template above."""
    link_model(src, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    (dst / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return dst


def make_tiny_model(tokenizer_src: Path, dst: Path, layers: int = 1, hidden: int = 32, ctx: int = 1024) -> Path:
    """A tiny random llama with SmolLM2's tokenizer: a real model for tests where the weights do not matter."""
    import torch
    import transformers

    cfg = json.loads((Path(tokenizer_src) / "config.json").read_text())
    config = transformers.LlamaConfig(
        vocab_size=cfg["vocab_size"], hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=ctx, tie_word_embeddings=True,
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "generation_config.json"):
        if (Path(tokenizer_src) / name).is_file():
            shutil.copy2(Path(tokenizer_src) / name, dst / name)
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`exl serve` in a subprocess on a free localhost port, with known keys."""

    api_key = "test-user-key"
    admin_key = "test-admin-key"

    def __init__(self, model_dir: Path, model: str | None, workdir: Path, extra: list[str] = (), log_name="server"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(workdir) / f"{log_name}.log"
        cmd = [sys.executable, "-m", "exl.cli", "serve", "--model-dir", str(model_dir), "--port", str(self.port),
               *extra]
        if self.api_key:
            cmd += ["--api-key", self.api_key, "--admin-key", self.admin_key]
        if model:
            cmd += ["--model", model]
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=workdir, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180, want=("ok",)) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exl serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200 and r.json()["status"] in want:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"exl serve not ready after {timeout} s:\n{self.log()[-4000:]}")

    def headers(self, admin: bool = False) -> dict:
        return {"Authorization": f"Bearer {self.admin_key if admin else self.api_key}"}

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics as {name: value}."""
        text = httpx.get(self.url + "/metrics", headers=self.headers(), timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
