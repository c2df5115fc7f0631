"""Graceful shutdown. On the first SIGTERM / SIGINT the server stops admitting (503), running requests get
`network.shutdown_grace` seconds to finish; then every request still running ends: a stream with a final
chunk (finish_reason "length", exl_finish_reason "shutdown") and an error event, a non-streaming request with
what it has so far (or 503 if it has nothing yet). Then uvicorn closes. A second signal ends the grace at once.
"""

from __future__ import annotations

import asyncio
import logging

from exl.server.errors import APIError

log = logging.getLogger("exl.server")

SHUTTING_DOWN = "server_shutting_down"


def shutting_down(message: str) -> APIError:
    return APIError(503, message, code=SHUTTING_DOWN, headers={"Retry-After": "30"})


class Drain:
    def __init__(self, grace: float):
        self.grace = grace
        self.draining = False  # no new requests
        self.expired = False  # the grace is over: running requests end now
        self.active = 0  # generation requests running
        self._idle: asyncio.Event | None = None

    def check(self) -> None:
        """Refuse a new request while shutting down."""
        if self.draining:
            raise shutting_down("the server is shutting down and takes no new requests; retry on another instance "
                                "or after it restarts")

    def enter(self) -> None:
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0 and self._idle is not None:
            self._idle.set()

    async def run(self) -> None:
        """Stop admitting, wait for running requests (at most `grace` seconds), then end the rest."""
        self.draining = True
        self._idle = asyncio.Event()
        if self.active == 0:
            self._idle.set()
        log.info("shutting down: no new requests; %d running get up to %.0f s to finish", self.active, self.grace)
        try:
            await asyncio.wait_for(self._idle.wait(), self.grace)
        except asyncio.TimeoutError:
            self.end_now()
            try:
                await asyncio.wait_for(self._idle.wait(), 10)
            except asyncio.TimeoutError:
                log.warning("%d requests did not end after the shutdown grace", self.active)

    def end_now(self) -> None:
        if not self.expired:
            log.warning("shutdown grace over: ending %d running requests", self.active)
        self.expired = True
