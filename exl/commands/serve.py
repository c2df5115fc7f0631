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


def _draining_server_class():
    import asyncio

    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn, but the first SIGTERM / SIGINT drains the app (exl.server.drain) before uvicorn shuts down;
        a second one ends the grace at once."""

        def __init__(self, drain, config):
            super().__init__(config)
            self.drain, self._loop, self._draining = drain, None, False

        async def serve(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig, frame):
            if self._loop is None or self.should_exit:
                return super().handle_exit(sig, frame)
            if self._draining:  # a second signal: end the running requests now
                self._loop.call_soon_threadsafe(self.drain.end_now)
                return
            self._draining = True

            async def drain_then_exit():
                await self.drain.run()
                super(DrainingServer, self).handle_exit(sig, None)

            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(drain_then_exit()))

    return DrainingServer


def _DrainingServer(drain, config):
    return _draining_server_class()(drain, config)


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
        from exl.server.auth import tokens_path

        print(f"exl serve: new API keys written to {tokens_path(net)} (shown only this once):\n"
              f"  api_key:   {keys.api_key}\n  admin_key: {keys.admin_key}", file=sys.stderr, flush=True)
    if config.model.name:
        from exl.errors import ExlError
        from exl.server.errors import APIError

        try:
            ModelManager(config).resolve(config.model.name)  # a clear error before anything starts
        except APIError as e:
            raise ExlError(f"--model {config.model.name!r}: {e.message}") from None
    app = create_app(config, keys)
    server = _DrainingServer(app.state.drain, uvicorn.Config(
        app, host=net.host, port=net.port, log_level=config.logging.level, access_log=config.logging.access_log,
        timeout_graceful_shutdown=10, lifespan="on"))
    log.info("exl serve on http://%s:%d/v1", net.host, net.port)
    server.run()
    return 0 if server.started else 1
