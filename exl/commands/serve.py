"""`exl serve`: the OpenAI-compatible HTTP server (see docs/server.md).

    exl serve --model-dir models --model SmolLM2-135M-Instruct-4.25bpw
    exl serve --config config.yml
"""

from __future__ import annotations

import ipaddress
import logging
import sys


def add_arguments(p):
    from exl.server.config import add_arguments as add_config_arguments

    add_config_arguments(p)
    p.add_argument("--print-sample-config", action="store_true",
                   help="print a documented config.yml with every key and its default, then exit")
    p.add_argument("--print-openapi", action="store_true", help="print the OpenAPI document (JSON), then exit")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args) -> int:
    from exl.server.config import load_config, sample_config

    if args.print_sample_config:
        print(sample_config())
        return 0
    config = load_config(args)
    logging.basicConfig(level=config.logging.level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("exl.server")

    import uvicorn

    from exl.server.app import create_app, openapi_json
    from exl.server.auth import load_keys
    from exl.server.manager import ModelManager

    if args.print_openapi:
        from exl.server.auth import Keys

        print(openapi_json(create_app(config, Keys(None, None, disabled=True))))
        return 0
    net = config.network
    keys = load_keys(net)
    if keys.disabled:
        where = "anyone on the network" if not _is_loopback(net.host) else "any local program"
        log.warning("authentication is DISABLED (--disable-auth): %s can generate and load/unload models. Use this "
                    "only on a trusted LAN.", where)
    elif keys.created:
        print(f"exl serve: new API keys written to {net.api_tokens_file} (shown only this once):\n"
              f"  api_key:   {keys.api_key}\n  admin_key: {keys.admin_key}", file=sys.stderr, flush=True)
    if config.model.name:
        from exl.errors import ExlError
        from exl.server.errors import APIError

        try:
            ModelManager(config).resolve(config.model.name)  # a clear error before anything starts
        except APIError as e:
            raise ExlError(f"--model {config.model.name!r}: {e.message}") from None
    app = create_app(config, keys)
    server = uvicorn.Server(uvicorn.Config(
        app, host=net.host, port=net.port, log_level=config.logging.level, access_log=config.logging.access_log,
        timeout_graceful_shutdown=net.shutdown_timeout + 2, lifespan="on"))
    log.info("exl serve on http://%s:%d/v1", net.host, net.port)
    server.run()
    return 0 if server.started else 1
