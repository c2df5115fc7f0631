"""The FastAPI application: state (config, keys, model manager, metrics), middleware, routes, lifespan."""

from __future__ import annotations

import contextlib
import json
import logging

from fastapi import FastAPI

import exl
from exl.server import errors, routes
from exl.server.auth import Keys
from exl.server.config import ServerConfig
from exl.server.drain import Drain
from exl.server.manager import ModelManager
from exl.server.metrics import Metrics

log = logging.getLogger("exl.server")


class BodyLimit:
    """ASGI middleware: refuse request bodies above `limit` bytes (413) and count error responses."""

    def __init__(self, app, limit: int, metrics: Metrics):
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = errors.APIError(413, f"request body is larger than {self.limit} bytes (network.max_request_bytes)",
                                  code="request_too_large")
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    size = int(value)
                except ValueError:
                    size = 0
                if size > self.limit:
                    return await too_big.response()(scope, receive, send)
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooBig()
            return message

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    self.metrics.http_errors.labels(str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, limited_receive, counting_send)
        except _TooBig:
            if not started:
                await too_big.response()(scope, receive, send)


class _TooBig(BaseException):  # not Exception: FastAPI would turn it into "error parsing the body"
    pass


def create_app(config: ServerConfig, keys: Keys) -> FastAPI:
    """The app for `config`. The model named in config.model.name is loaded at startup (before serving)."""
    manager = ModelManager(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if config.model.name:
            try:
                await manager.load(config.model.name)
            except errors.APIError as e:
                log.error("cannot load model %r: %s", config.model.name, e.message)
                raise RuntimeError(f"cannot load model {config.model.name!r}: {e.message}") from None
        yield
        await manager.unload()

    app = FastAPI(
        title="exl", version=exl.__version__, lifespan=lifespan,
        description="OpenAI-compatible API of `exl serve`. Send the API key as `Authorization: Bearer <key>` or "
                    "`x-api-key`; model load/unload need the admin key.",
    )
    app.state.config = config
    app.state.keys = keys
    app.state.manager = manager
    app.state.metrics = Metrics(manager)
    app.state.drain = Drain(config.network.shutdown_grace)
    errors.install(app)
    app.include_router(routes.public)
    app.include_router(routes.user)
    app.include_router(routes.admin)
    if config.network.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=config.network.cors_origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(BodyLimit, limit=config.network.max_request_bytes, metrics=app.state.metrics)
    return app


def openapi_json(app: FastAPI) -> str:
    return json.dumps(app.openapi(), indent=2)
