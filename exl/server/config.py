"""Server configuration: built-in defaults < config.yml < command-line flags.

Every key of config.yml is also a command-line flag. The schema lives here once (pydantic models whose
fields carry their flag name and help text); `add_arguments` builds the argparse flags from it,
`load_config` merges the layers and validates the result, and `sample_config` writes the documented
config.sample.yml.

    config = load_config(args)          # args from `exl serve ...`
    config.network.port, config.model.name, config.sampling.temperature
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from exl.errors import ExlError

CacheMode = Literal["auto", "fp32", "fp16", "q8", "q6", "q4", "q8k4v"]  # exl.cache.paged.CACHE_MODES


class ConfigError(ExlError):
    """config.yml or a flag holds a bad value."""


def _opt(flag: str, help: str, default: Any = None, **kw) -> Any:
    """A config field with its command-line flag and help text."""
    return Field(default, description=help, json_schema_extra={"flag": flag}, **kw)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class NetworkConfig(_Section):
    """Where the server listens and who may use it."""

    host: str = _opt("--host", "address to listen on (0.0.0.0 for every interface: the LAN can reach it)", "127.0.0.1")
    port: int = _opt("--port", "TCP port", 5000, ge=0, le=65535)
    disable_auth: bool = _opt("--disable-auth", "accept requests without a key (only on a trusted LAN!)", False)
    api_key: str | None = _opt("--api-key", "the user key (overrides api_tokens.yml; for scripts and tests)")
    admin_key: str | None = _opt("--admin-key", "the admin key for model load/unload (overrides api_tokens.yml)")
    api_tokens_file: str | None = _opt("--api-tokens-file", "YAML file with api_key and admin_key, created (mode "
                                       "0600) with random keys on first start; default: $XDG_CONFIG_HOME/exl/"
                                       "api_tokens.yml (~/.config/exl/api_tokens.yml)")
    max_request_bytes: int = _opt("--max-request-bytes", "largest request body accepted (HTTP 413 above)",
                                  8 * 1024 * 1024, ge=1024)
    shutdown_grace: float = _opt("--shutdown-grace", "on Ctrl-C / SIGTERM, seconds running requests get to "
                                 "finish (new ones get 503) before they are ended with an error event", 30.0, ge=0)
    cors_origins: list[str] = _opt("--cors-origins", "browser origins allowed to call the API (e.g. "
                                   "http://localhost:3000; '*' for any); empty: no CORS headers", [])


class ModelSection(_Section):
    """The model loaded at start and how its cache is sized."""

    model_dir: str = _opt("--model-dir", "folder that holds the model folders; models load only from inside it",
                          "models")
    name: str | None = _opt("--model", "model folder (inside model_dir) loaded at start; requests name it in "
                            "their `model` field")
    max_seq_len: int | None = _opt("--max-seq-len", "longest sequence (prompt + completion) a request may use; "
                                   "default: the model's context, capped by the cache size", ge=16)
    cache_size: int | None = _opt("--cache-size", "KV-cache size in tokens, shared by all running requests; "
                                  "default: max_seq_len (or 8192 for models with longer context)", ge=16)
    cache_mode: CacheMode = _opt(
        "--cache-mode", "KV-cache precision: auto (fp16 on the CPU, else the model's dtype; as every exl command), "
        "fp32, fp16, q8, q6, q4 (bits per key/value) or q8k4v", "auto")
    page_size: int = _opt("--page-size", "tokens per KV-cache page", 256, ge=16)
    max_batch_size: int = _opt("--max-batch-size", "requests decoded together at most (more wait in a queue)",
                               32, ge=1)
    max_chunk_size: int = _opt("--max-chunk-size", "prompt tokens processed per forward pass at most", 2048, ge=16)
    device: str | None = _opt("--device", "torch device, e.g. cuda:0 or cpu (default: cuda if available)")
    tp: int = _opt("--tp", "tensor-parallel processes (one per GPU; see docs/parallel.md)", 1, ge=1, le=64)
    gpu_split: str | None = _opt("--gpu-split", "GiB per device, e.g. 10,24: layer split alone, or the tensor "
                                 "split's shares with --tp")
    tool_format: Literal["auto", "hermes", "llama3", "mistral", "none"] = _opt(
        "--tool-format", "how the model writes tool calls: hermes (<tool_call>{json}</tool_call>, Qwen, Hermes), "
        "llama3 ({\"name\", \"parameters\"}, <|python_tag|>), mistral ([TOOL_CALLS][...]), none; auto: guess from "
        "the chat template", "auto")
    chat_template: str | None = _opt("--chat-template", "a Jinja file to use instead of the model's chat template")


class DraftSection(_Section):
    """Speculative decoding: a small draft model (or n-gram drafting) proposes tokens the model checks."""

    name: str | None = _opt("--draft-model", "draft model folder (inside model_dir), same tokenizer as the model")
    num_draft_tokens: int = _opt("--num-draft-tokens", "tokens drafted per step", 4, ge=1, le=16)
    cache_mode: CacheMode = _opt("--draft-cache-mode", "draft KV-cache precision (as --cache-mode)", "auto")
    ngram: bool = _opt("--ngram-draft", "draft from n-grams of the context instead of a draft model", False)


class SamplingSection(_Section):
    """Sampling defaults for requests that do not set a value themselves."""

    max_tokens: int | None = _opt("--default-max-tokens", "completion length limit for requests that set no "
                                  "max_tokens (0: up to the context). Each request reserves cache pages for its "
                                  "whole length, so a bounded default lets more requests run at once", 2048, ge=0)
    temperature: float = _opt("--temperature", "default temperature (0 = greedy)", 1.0, ge=0)
    top_p: float = _opt("--top-p", "default nucleus mass", 1.0, gt=0, le=1)
    top_k: int = _opt("--top-k", "default top-k (0 = off)", 0, ge=0)
    min_p: float = _opt("--min-p", "default min-p (0 = off)", 0.0, ge=0, le=1)
    repetition_penalty: float = _opt("--repetition-penalty", "default repetition penalty (1 = off)", 1.0, gt=0)
    penalty_range: int = _opt("--penalty-range", "tokens the penalties look back over (0 = whole context)", 1024,
                              ge=0)


class LoggingSection(_Section):
    """What the server prints."""

    level: Literal["debug", "info", "warning", "error"] = _opt("--log-level", "log level", "info")
    requests: bool = _opt("--log-requests", "one line per finished request (tokens, speed, finish reason)", True)
    prompts: bool = _opt("--log-prompts", "also log prompt and completion text (private data!)", False)
    access_log: bool = _opt("--access-log", "uvicorn's per-HTTP-request access log", False)


class ServerConfig(_Section):
    """Everything `exl serve` reads from config.yml and flags."""

    network: NetworkConfig = Field(default_factory=NetworkConfig)
    model: ModelSection = Field(default_factory=ModelSection)
    draft: DraftSection = Field(default_factory=DraftSection)
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)


SECTIONS: dict[str, type[_Section]] = {
    name: field.default_factory for name, field in ServerConfig.model_fields.items()  # type: ignore[misc]
}


def _fields():
    """(section, key, pydantic FieldInfo, flag) for every config key."""
    for section, cls in SECTIONS.items():
        for key, info in cls.model_fields.items():
            yield section, key, info, info.json_schema_extra["flag"]


def _dest(section: str, key: str) -> str:
    return f"cfg__{section}__{key}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --config and one flag per config key. Flags default to 'not given' so config.yml values stand."""
    parser.add_argument("--config", default=None, help="YAML config file (default: ./config.yml if it exists); "
                        "see config.sample.yml")
    groups = {s: parser.add_argument_group(f"{s} (config.yml section '{s}')") for s in SECTIONS}
    for section, key, info, flag in _fields():
        kw: dict[str, Any] = dict(dest=_dest(section, key), default=argparse.SUPPRESS)
        default = info.get_default(call_default_factory=True)
        help_ = f"{info.description} [{section}.{key}, default: {default!r}]"
        annotation = info.annotation
        if annotation is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif annotation == list[str]:
            kw["nargs"] = "*"
            kw["metavar"] = key.upper()
        else:
            kw["metavar"] = key.upper()
        groups[section].add_argument(flag, help=help_, **kw)


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections ({', '.join(SECTIONS)}), "
                          f"got {type(data).__name__}")
    return data


def _format_errors(e: ValidationError, where: str) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        flag = ""
        if len(err["loc"]) >= 2 and err["loc"][0] in SECTIONS:
            info = SECTIONS[err["loc"][0]].model_fields.get(str(err["loc"][1]))
            if info is not None:
                flag = f" (flag {info.json_schema_extra['flag']})"
        lines.append(f"  {loc}{flag}: {err['msg']}" + (f", got {err['input']!r}" if "input" in err and
                                                          err["type"] != "extra_forbidden" else ""))
    return f"bad server configuration in {where}:\n" + "\n".join(lines)


def load_config(args: argparse.Namespace | None = None, path: str | Path | None = None) -> ServerConfig:
    """Defaults, then the YAML file (`path`, args.config, or ./config.yml if present), then flags in `args`."""
    path = path or getattr(args, "config", None)
    where = "defaults"
    data: dict = {}
    if path is None and Path("config.yml").is_file():
        path = "config.yml"
    if path is not None:
        data = _read_yaml(Path(path))
        where = str(path)
    merged = {s: dict(v) if isinstance(v, dict) else v for s, v in data.items()}
    given = []
    for section, key, _, flag in _fields():
        dest = _dest(section, key)
        if args is not None and hasattr(args, dest):
            section_data = merged.setdefault(section, {})
            if not isinstance(section_data, dict):
                raise ConfigError(f"{where}: section '{section}' must be a mapping, got {type(section_data).__name__}")
            section_data[key] = getattr(args, dest)
            given.append(flag)
    if given:
        where += " and flags " + " ".join(given)
    try:
        return ServerConfig.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, where)) from None


def cache_bits(mode: str, device=None) -> tuple[int | None, int | None]:
    """(k_bits, v_bits) of a cache mode name for a model on `device` (exl.cache.paged.cache_bits)."""
    from exl.cache.paged import cache_bits as bits

    return bits(mode, device)


def sample_config() -> str:
    """The documented config.sample.yml: every key, its default and its flag."""
    out = ["# exl serve configuration. Copy to config.yml and edit; every key is also a command-line flag",
           "# (shown in brackets). Precedence: built-in defaults < this file < flags.", ""]
    for section, cls in SECTIONS.items():
        out.append(f"# {cls.__doc__.strip()}")
        out.append(f"{section}:")
        for key, info in cls.model_fields.items():
            default = info.get_default(call_default_factory=True)
            out.append(f"  # {info.description} [{info.json_schema_extra['flag']}]")
            dumped = yaml.safe_dump({key: default}, default_flow_style=True, width=1000).strip()
            out.append(f"  {dumped[1:-1]}")
        out.append("")
    return "\n".join(out)
