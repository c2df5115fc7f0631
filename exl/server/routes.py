"""The HTTP endpoints: generation (user key), model admin (admin key), tokens, models, health and metrics."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from fastapi.security import APIKeyHeader, HTTPBearer

from exl.server import auth
from exl.server.chat import chat_completions, template_messages
from exl.server.completions import completions
from exl.server.errors import APIError, bad_request
from exl.server.metrics import CONTENT_TYPE
from exl.server.schemas import (
    ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, ErrorResponse, Health, ModelCard,
    ModelList, ModelLoadRequest, TokenDecodeRequest, TokenDecodeResponse, TokenEncodeRequest, TokenEncodeResponse,
    UnloadResponse,
)

# Declared so the OpenAPI document lists the ways to send a key; checking happens in `auth.check`.
_bearer = HTTPBearer(auto_error=False, description="the user or admin key")
_api_key = APIKeyHeader(name="x-api-key", auto_error=False, description="the user or admin key")
_admin_key = APIKeyHeader(name="x-admin-key", auto_error=False, description="the admin key")


async def user_key(request: Request, _b=Depends(_bearer), _k=Depends(_api_key), _a=Depends(_admin_key)) -> None:
    auth.check(request, request.app.state.keys, auth.USER)


async def admin_key(request: Request, _b=Depends(_bearer), _k=Depends(_api_key), _a=Depends(_admin_key)) -> None:
    auth.check(request, request.app.state.keys, auth.ADMIN)


_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409, 413, 503)}
_STREAM = {"content": {"text/event-stream": {"schema": {"type": "string"}}},
           "description": "with stream=true: server-sent events, one JSON chunk per `data:` line, then [DONE]"}

public = APIRouter()
user = APIRouter(dependencies=[Depends(user_key)], responses=_ERRORS)
admin = APIRouter(dependencies=[Depends(admin_key)], responses=_ERRORS)


@user.post("/v1/chat/completions", response_model=ChatCompletion, responses={200: _STREAM}, tags=["generation"],
           summary="Chat completion (OpenAI-compatible)")
async def post_chat(req: ChatCompletionRequest, request: Request):
    return await chat_completions(req, request)


@user.post("/v1/completions", response_model=Completion, responses={200: _STREAM}, tags=["generation"],
           summary="Text completion (OpenAI-compatible)")
async def post_completions(req: CompletionRequest, request: Request):
    return await completions(req, request)


@user.get("/v1/models", response_model=ModelList, tags=["models"], summary="Models in the model directory")
async def get_models(request: Request):
    manager = request.app.state.manager
    current = manager.current
    names = manager.available()
    if current is not None and current.name not in names:
        names.insert(0, current.name)
    cards = [current.card() if current is not None and n == current.name else {"id": n} for n in names]
    return {"object": "list", "data": [ModelCard(**c) for c in cards]}


@user.get("/v1/model", response_model=ModelCard, tags=["models"], summary="The loaded model")
async def get_model(request: Request):
    return ModelCard(**request.app.state.manager.require(None).card())


@admin.post("/v1/model/load", response_model=ModelCard, tags=["admin"],
            summary="Load a model from the model directory (unloads the current one)")
async def load_model(req: ModelLoadRequest, request: Request):
    request.app.state.drain.check()
    options = req.model_dump(exclude={"name"}, exclude_none=True)
    loaded = await request.app.state.manager.load(req.name, **options)
    return ModelCard(**loaded.card())


@admin.post("/v1/model/unload", response_model=UnloadResponse, tags=["admin"],
            summary="Unload the model (running requests are cancelled)")
async def unload_model(request: Request):
    return {"unloaded": await request.app.state.manager.unload()}


@user.post("/v1/token/encode", response_model=TokenEncodeResponse, tags=["tokens"], summary="Text to token ids")
async def encode(req: TokenEncodeRequest, request: Request):
    lm = request.app.state.manager.require(None)
    ids = await anyio.to_thread.run_sync(_encode, req, lm)
    return {"tokens": ids, "length": len(ids)}


def _encode(req: TokenEncodeRequest, lm) -> list[int]:
    tok = lm.tokenizer
    if isinstance(req.text, str):
        return tok.encode(req.text, add_bos=req.add_bos_token, special=req.encode_special_tokens)
    from exl.tokenizer import ChatTemplateError

    if not req.text:
        raise bad_request("text: give a string or at least one message", "text")
    try:
        prompt = tok.apply_chat_template(template_messages(req.text), add_generation_prompt=req.add_generation_prompt,
                                         template=lm.chat_template)
    except ChatTemplateError as e:
        raise bad_request(str(e), "text", code="chat_template_error") from None
    return tok.encode(prompt, add_bos=False, special=True)


@user.post("/v1/token/decode", response_model=TokenDecodeResponse, tags=["tokens"], summary="Token ids to text")
async def decode(req: TokenDecodeRequest, request: Request):
    lm = request.app.state.manager.require(None)
    bad = [t for t in req.tokens if not 0 <= t < lm.tokenizer.vocab_size]
    if bad:
        raise bad_request(f"token ids must be in [0, {lm.tokenizer.vocab_size}), got {bad[:5]}", "tokens")
    text = await anyio.to_thread.run_sync(lambda: lm.tokenizer.decode(req.tokens,
                                                                       skip_special=not req.decode_special_tokens))
    return {"text": text}


@public.get("/health", response_model=Health, tags=["status"], summary="Liveness (no key needed)",
            responses={503: {"model": Health}})
async def health(request: Request):
    manager = request.app.state.manager
    if request.app.state.drain.draining:
        return JSONResponse(Health(status="shutting_down", model=getattr(manager.current, "name", None))
                            .model_dump(), status_code=503)
    if manager.loading:
        return Health(status="loading", model=manager.loading)
    current = manager.current
    if current is None:
        return Health(status="no_model")
    try:
        current.stack.heal()  # a crashed generator thread is restarted here or by the next request
    except Exception as e:  # noqa: BLE001 - reported as unhealthy
        return JSONResponse(Health(status="unhealthy", model=current.name, detail=f"{type(e).__name__}: {e}")
                            .model_dump(), status_code=503)
    restarts = current.stack.restarts
    return Health(status="ok", model=current.name,
                  detail=f"the generator was restarted {restarts} time(s) after failures" if restarts else None)


@user.get("/metrics", tags=["status"], summary="Prometheus metrics",
          responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}})
async def metrics(request: Request):
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


__all__ = ["public", "user", "admin", "APIError"]
