"""API keys: a user key for generation and an admin key for model load/unload.

Keys come from `--api-key` / `--admin-key` or from api_tokens.yml, which is written with random keys
on first start (and printed once). A request presents a key as `Authorization: Bearer <key>`,
`x-api-key: <key>` or `x-admin-key: <key>`; the admin key also works wherever the user key does.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml
from fastapi import Request

from exl.server.config import ConfigError, NetworkConfig
from exl.server.errors import APIError

log = logging.getLogger("exl.server")

USER, ADMIN = "user", "admin"


@dataclass
class Keys:
    api_key: str | None
    admin_key: str | None
    disabled: bool = False  # --disable-auth
    created: bool = False  # written to the tokens file just now


def _new_key() -> str:
    return secrets.token_hex(16)


def user_config_dir() -> Path:
    """exl's per-user configuration folder: $XDG_CONFIG_HOME/exl, else ~/.config/exl."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "exl"


def tokens_path(net: NetworkConfig, base_dir: Path | None = None) -> Path:
    """Where the keys file is: network.api_tokens_file if set, else the per-user config folder (keys stay out of
    the working folder, where `git add .` could pick them up)."""
    if net.api_tokens_file:
        path = Path(net.api_tokens_file).expanduser()
        return base_dir / path if base_dir is not None and not path.is_absolute() else path
    return user_config_dir() / "api_tokens.yml"


def load_keys(net: NetworkConfig, base_dir: Path | None = None) -> Keys:
    """The keys in force: flags override the keys file (`tokens_path`), which is created (mode 0600, in a 0700
    folder) when missing."""
    if net.disable_auth:
        return Keys(net.api_key, net.admin_key, disabled=True)
    api_key, admin_key = net.api_key, net.admin_key
    if api_key and admin_key:
        return Keys(api_key, admin_key)
    path = tokens_path(net, base_dir)
    created = False
    if path.is_file():
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read API keys from {path}: {e}; fix it or delete it to make new keys") from e
        if not isinstance(data, dict) or not all(isinstance(data.get(k), str) and data.get(k)
                                                 for k in ("api_key", "admin_key")):
            raise ConfigError(f"{path} must hold `api_key: <key>` and `admin_key: <key>`; fix it or delete it to "
                              f"make new keys")
    else:
        data = {"api_key": _new_key(), "admin_key": _new_key()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write("# exl serve API keys. api_key: generation; admin_key: also model load/unload.\n")
                yaml.safe_dump(data, f)
        except OSError as e:
            raise ConfigError(f"cannot write new API keys to {path}: {e}; set --api-tokens-file to a "
                              f"writable path or pass --api-key and --admin-key") from e
        created = True
    return Keys(api_key or data["api_key"], admin_key or data["admin_key"], created=created)


def _presented(request: Request) -> list[str]:
    keys = []
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            keys.append(value.strip())
    for header in ("x-api-key", "x-admin-key"):
        value = request.headers.get(header)
        if value:
            keys.append(value.strip())
    return keys


def _matches(given: str, key: str | None) -> bool:
    return key is not None and hmac.compare_digest(given.encode(), key.encode())


def role_of(request: Request, keys: Keys) -> str | None:
    """ADMIN, USER or None for the keys a request presents."""
    given = _presented(request)
    if any(_matches(g, keys.admin_key) for g in given):
        return ADMIN
    if any(_matches(g, keys.api_key) for g in given):
        return USER
    return None


def check(request: Request, keys: Keys, need: str) -> None:
    """Raise 401 (no or wrong key) or 403 (user key on an admin endpoint) unless the request may go on."""
    if keys.disabled:
        return
    role = role_of(request, keys)
    if role is None:
        what = "no API key given" if not _presented(request) else "the API key is not valid"
        raise APIError(401, f"{what}: send `Authorization: Bearer <key>` (or an x-api-key header) with a key from "
                       f"the server's api_tokens.yml", "authentication_error", code="invalid_api_key")
    if need == ADMIN and role != ADMIN:
        raise APIError(403, "this endpoint needs the admin key (x-admin-key or Bearer); the user key may only "
                       "generate", "permission_error", code="admin_key_required")
