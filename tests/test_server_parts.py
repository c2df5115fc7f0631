"""Server parts that need no running server: config and flags, key files, model paths, tool-call parsing."""

from __future__ import annotations

import argparse
import json
import stat
from pathlib import Path

import pytest
import yaml

from exl.server import tools
from exl.server.auth import load_keys
from exl.server.config import ConfigError, ServerConfig, add_arguments, load_config, sample_config
from exl.server.errors import APIError
from exl.server.manager import ModelManager

REPO = Path(__file__).resolve().parents[1]


def parse(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


# ---------------------------------------------------------------------------------------------------------------------
# config


def test_sample_config_in_repo_is_current_and_loads():
    text = (REPO / "config.sample.yml").read_text()
    assert text.strip() == sample_config().strip(), "regenerate with `exl serve --print-sample-config > config.sample.yml`"
    assert load_config(path=REPO / "config.sample.yml") == ServerConfig()


def test_every_key_has_a_flag_and_flags_override_yaml(tmp_path):
    cfg = tmp_path / "config.yml"
    cfg.write_text(yaml.safe_dump({"network": {"port": 6001, "host": "0.0.0.0"}, "model": {"name": "a"},
                                   "sampling": {"temperature": 0.5}}))
    c = load_config(parse("--config", str(cfg), "--port", "7000", "--model", "b", "--no-log-requests",
                          "--cors-origins", "http://x", "http://y", "--cache-mode", "q4"))
    assert (c.network.port, c.network.host, c.model.name, c.sampling.temperature) == (7000, "0.0.0.0", "b", 0.5)
    assert c.logging.requests is False and c.network.cors_origins == ["http://x", "http://y"]
    assert c.model.cache_mode == "q4"
    # each key of every section is reachable from the command line
    for section, cls in type(c).model_fields.items():
        for key, info in cls.default_factory.model_fields.items():
            flag = info.json_schema_extra["flag"]
            dest = f"cfg__{section}__{key}"
            assert dest in vars(parse(*_flag_args(flag, info))), flag


def _flag_args(flag, info):
    if info.annotation is bool:
        return [flag]
    if info.annotation == list[str]:
        return [flag, "x"]
    return [flag, "1"]


@pytest.mark.parametrize("data,needle", [
    ({"network": {"prot": 1}}, "network.prot"),
    ({"network": {"port": "abc"}}, "network.port (flag --port)"),
    ({"model": {"cache_mode": "q3"}}, "model.cache_mode (flag --cache-mode)"),
    ({"sampling": {"top_p": 0}}, "sampling.top_p"),
    ({"modle": {}}, "modle"),
])
def test_bad_config_names_the_key_and_flag(tmp_path, data, needle):
    cfg = tmp_path / "config.yml"
    cfg.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        load_config(path=cfg)
    assert needle in str(e.value) and str(cfg) in str(e.value)


def test_bad_flag_value_is_reported():
    with pytest.raises(ConfigError, match=r"network.port \(flag --port\)"):
        load_config(parse("--port", "99999"))


# ---------------------------------------------------------------------------------------------------------------------
# keys


def test_keys_file_created_once_private_and_reused(tmp_path):
    net = ServerConfig().network.model_copy(update={"api_tokens_file": str(tmp_path / "api_tokens.yml")})
    first = load_keys(net)
    path = tmp_path / "api_tokens.yml"
    assert first.created and path.is_file() and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(first.api_key) == 32 and first.api_key != first.admin_key
    again = load_keys(net)
    assert not again.created and (again.api_key, again.admin_key) == (first.api_key, first.admin_key)
    flags = load_keys(net.model_copy(update={"api_key": "u", "admin_key": "a"}))
    assert (flags.api_key, flags.admin_key) == ("u", "a")
    assert load_keys(net.model_copy(update={"disable_auth": True})).disabled


def test_broken_keys_file_is_a_clear_error(tmp_path):
    path = tmp_path / "api_tokens.yml"
    path.write_text("api_key: only-one\n")
    net = ServerConfig().network.model_copy(update={"api_tokens_file": str(path)})
    with pytest.raises(ConfigError, match="admin_key"):
        load_keys(net)


# ---------------------------------------------------------------------------------------------------------------------
# model paths


@pytest.fixture()
def model_root(tmp_path):
    root = tmp_path / "models"
    for name in ("good", "org/nested"):
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text("{}")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    (root / "link-out").symlink_to(outside, target_is_directory=True)
    (root / "link-in").symlink_to(root / "good", target_is_directory=True)
    (root / "half").mkdir()
    (root / "half" / "config.json").write_text("{}")
    (root / "half" / "weights.safetensors").symlink_to(outside / "config.json")
    (root / "empty").mkdir()
    return root


def manager(root):
    return ModelManager(ServerConfig(model={"model_dir": str(root)}))


@pytest.mark.parametrize("name,status", [
    ("../outside", 400), ("good/../../outside", 400), ("/etc", 400), ("C:\\Windows", 400), ("..\\outside", 400),
    ("", 400), ("a\x00b", 400),
    ("link-out", 403), ("half", 403),
    ("missing", 404), ("empty", 404),
])
def test_model_names_outside_the_directory_are_refused(model_root, name, status):
    with pytest.raises(APIError) as e:
        manager(model_root).resolve(name)
    assert e.value.status == status, e.value.message


def test_model_names_inside_resolve(model_root):
    m = manager(model_root)
    assert m.resolve("good") == (model_root / "good").resolve()
    assert m.resolve("org/nested") == (model_root / "org" / "nested").resolve()
    assert m.resolve("link-in") == (model_root / "good").resolve()  # a link that stays inside is fine
    assert m.available() == ["good", "half", "link-in", "org/nested"]


def test_missing_model_dir(tmp_path):
    with pytest.raises(APIError) as e:
        manager(tmp_path / "nope").resolve("x")
    assert e.value.status == 404 and "model directory" in e.value.message


# ---------------------------------------------------------------------------------------------------------------------
# tool calls


def test_parse_hermes():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>'
    content, calls = tools.parse_tool_calls(text, "hermes")
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2
    bad = "<tool_call>{not json}</tool_call> ok"
    assert tools.parse_tool_calls(bad, "hermes") == (bad, [])


def test_parse_llama3_and_mistral():
    _, calls = tools.parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", '
                                      '"parameters": {}}', "llama3")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert tools.parse_tool_calls("The answer is {x}", "llama3") == ("The answer is {x}", [])
    assert tools.parse_tool_calls('{"no_name": 1}', "llama3")[1] == []
    content, calls = tools.parse_tool_calls('Sure [TOOL_CALLS][{"name": "f", "arguments": {"a": [1, 2]}}]', "mistral")
    assert content == "Sure" and json.loads(calls[0].arguments) == {"a": [1, 2]}
    _, calls = tools.parse_tool_calls('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', "mistral")
    assert [c.name for c in calls] == ["f", "g"]


def test_stream_parser_holds_back_only_possible_calls():
    p = tools.ToolStreamParser("hermes")
    out = [p.feed(x) for x in ["Hello <", "tool", "_call>", '{"name": "f", ', '"arguments": {}}', "</tool_call>"]]
    assert "".join(out) == "Hello " and out[0] == "Hello "
    content, calls = p.finish()
    assert content == "" and calls[0].name == "f"
    p = tools.ToolStreamParser("hermes")
    out = [p.feed(x) for x in ["a <", "b> <tool", "ing"]]
    assert "".join(out) + p.finish()[0] == "a <b> <tooling"
    p = tools.ToolStreamParser("llama3")
    assert p.feed("Plain") == "Plain" and p.feed(" text") == " text"
    p = tools.ToolStreamParser("llama3")
    assert p.feed(' {"name": "f",') == "" and p.feed(' "parameters": {"q": 2}}') == ""
    assert json.loads(p.finish()[1][0].arguments) == {"q": 2}


def test_detect_format():
    assert tools.detect_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert tools.detect_format("[AVAILABLE_TOOLS]...[TOOL_CALLS]") == "mistral"
    assert tools.detect_format("<|start_header_id|>ipython{% for t in tools %}") == "llama3"
    assert tools.detect_format("{{ messages }}") == "none" and tools.detect_format(None) == "none"


def test_forced_call_schema_compiles_and_accepts_a_call(smollm_dir):
    """The schema that forces a call is one llguidance compiles, and the call it describes parses back."""
    from exl.generator.constraints import JsonSchemaConstraint
    from exl.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm_dir)
    defs = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
        {"type": "function", "function": {"name": "g"}}]
    for fmt in ("hermes", "llama3", "mistral"):
        schema = tools.call_schema(defs, fmt)
        c = JsonSchemaConstraint(tok, schema)
        state = c.start()
        key = "parameters" if fmt == "llama3" else "arguments"
        body = json.dumps({"name": "f", key: {"x": 3}}, separators=(",", ":"))
        if fmt == "mistral":
            body = f"[{body}]"
        for t in tok.encode(body):
            state.advance(t)
        assert state.accepting
        text = tools.prefix(fmt) + body + tools.suffix(fmt)
        _, calls = tools.parse_tool_calls(text, fmt)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 3})]
    named = tools.call_schema(defs, "hermes", "g")
    assert named["properties"]["name"]["enum"] == ["g"] and named["properties"]["arguments"] == {"type": "object"}


def test_openapi_document_lists_every_endpoint():
    from exl.server.app import create_app
    from exl.server.auth import Keys

    doc = create_app(ServerConfig(), Keys("u", "a")).openapi()
    paths = set(doc["paths"])
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/model", "/v1/model/load",
            "/v1/model/unload", "/v1/token/encode", "/v1/token/decode", "/health", "/metrics"} <= paths
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    assert {"401", "403", "400"} <= set(chat["responses"])


def test_cli_prints_sample_config(capsys):
    from exl.cli import main

    assert main(["serve", "--print-sample-config"]) == 0
    assert capsys.readouterr().out.strip() == sample_config().strip()


def test_body_limit_applies_to_chunked_uploads_too():
    from fastapi.testclient import TestClient

    from exl.server.app import create_app
    from exl.server.auth import Keys

    app = create_app(ServerConfig(network={"max_request_bytes": 100_000}), Keys("u", "a"))
    chunks = (b"x" * 10_000 for _ in range(20))  # no Content-Length: the limit is counted while reading
    with TestClient(app) as client:
        r = client.post("/v1/completions", content=chunks, headers={"Authorization": "Bearer u"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer u"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"  # no model loaded
        assert client.get("/health").json()["status"] == "no_model"


def test_first_start_writes_and_prints_keys_once(tmp_path, monkeypatch):
    """A real `exl serve` without a model: keys are made on first start, printed, and enforced (that a second
    start reuses them without printing is `test_keys_file_created_once_private_and_reused`)."""
    import httpx

    from test_server_utils import Server

    class NoKeys(Server):
        api_key = admin_key = None

    def start():
        return NoKeys(tmp_path / "models", None, tmp_path, log_name=f"run{len(list(tmp_path.glob('*.log')))}")

    (tmp_path / "models").mkdir()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    first = start()
    try:
        first.wait_ready(want=("no_model",), timeout=120)
        path = tmp_path / "config" / "exl" / "api_tokens.yml"  # per user, private; never in the working folder
        assert not (tmp_path / "api_tokens.yml").exists()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        keys = yaml.safe_load(path.read_text())
        assert keys["api_key"] in first.log() and keys["admin_key"] in first.log()
        r = httpx.get(first.url + "/v1/models")
        assert r.status_code == 401
        r = httpx.get(first.url + "/v1/models", headers={"x-api-key": keys["api_key"]})
        assert r.status_code == 200 and r.json()["data"] == []
    finally:
        first.stop()
