"""Server-sent events for streamed responses (sse-starlette), with keep-alive pings and graceful shutdown."""

from __future__ import annotations

from sse_starlette.sse import EventSourceResponse


def sse_response(events, config) -> EventSourceResponse:
    """Stream `events` (JSON strings; "[DONE]" last) as `data: ...` lines.

    A client that disconnects cancels the iterator (and so its generator jobs). Shutdown is handled before
    uvicorn's (exl.server.drain): streams have ended by the time sse-starlette would cancel them.
    """
    return EventSourceResponse(events, ping=15, sep="\n",
                               shutdown_grace_period=5)
