"""POST /v1/chat/completions: chat template, tool calls, streaming and non-streaming responses."""

from __future__ import annotations

import json
import secrets
import time

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from exl.server import engine, tools
from exl.server.engine import ChoiceResult, ChoiceSpec, Timing
from exl.server.errors import APIError, bad_request
from exl.server.manager import LoadedModel
from exl.server.schemas import ChatCompletionRequest
from exl.server.sse import sse_response

_RESERVED_TEMPLATE_VARS = {"messages", "tools", "documents", "add_generation_prompt", "template"}


# ---------------------------------------------------------------------------------------------------------------------
# prompt


def _content_text(content, i: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise bad_request(f"messages[{i}].content[{j}]: content of type {part.type!r} is not supported by this "
                              f"text-only server; send text parts only", f"messages[{i}].content")
        parts.append(part.text)
    return "".join(parts)


def template_messages(messages) -> list[dict]:
    """Request messages as plain dicts for the chat template (OpenAI -> Hugging Face conventions)."""
    out = []
    for i, m in enumerate(messages):
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        msg = {**(m.model_extra or {}), "role": role, "content": _content_text(m.content, i)}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                args = c.function.arguments
                if isinstance(args, str):  # templates expect a dict (as transformers does); keep bad JSON as text
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        pass
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                            "arguments": args}})
            msg["tool_calls"] = calls
        if msg["content"] is None and role != "assistant":
            msg["content"] = ""
        out.append(msg)
    return out


def _tool_mode(req: ChatCompletionRequest, lm: LoadedModel) -> tuple[list[dict] | None, str, str | None]:
    """(tools for the template, mode "none" | "auto" | "forced", forced function name)."""
    if not req.tools:
        if req.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None, "none", None
    tool_dicts = [t.model_dump(exclude_none=True) for t in req.tools]
    choice = req.tool_choice or "auto"
    if choice == "none":
        return None, "none", None
    if lm.tool_format == "none":
        raise bad_request(f"model {lm.name!r} has no tool-call format (its chat template renders no tools); load a "
                          f"model with tool support or set tool_format (--tool-format)", "tools",
                          code="tools_not_supported")
    if choice == "auto":
        return tool_dicts, "auto", None
    if choice == "required":
        return tool_dicts, "forced", None
    name = choice.function.name
    if name not in {t["function"]["name"] for t in tool_dicts}:
        raise bad_request(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")
    return tool_dicts, "forced", name


def build_prompt(req: ChatCompletionRequest, lm: LoadedModel, tool_dicts) -> str:
    from exl.tokenizer import ChatTemplateError

    extra = dict(req.chat_template_kwargs or {})
    clash = _RESERVED_TEMPLATE_VARS & extra.keys()
    if clash:
        raise bad_request(f"chat_template_kwargs may not set {sorted(clash)}", "chat_template_kwargs")
    messages = template_messages(req.messages)
    cont = req.continue_final_message
    if cont and messages[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs an assistant message last", "continue_final_message")
    try:
        prompt = lm.tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt and not cont, tools=tool_dicts,
            template=lm.chat_template, **extra)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages", code="chat_template_error") from None
    except (TypeError, ValueError, RecursionError) as e:
        raise bad_request(f"chat template failed: {e}", "messages", code="chat_template_error") from None
    if cont:  # cut the end-of-turn markup after the last message's text
        last = messages[-1]["content"] or ""
        at = prompt.rfind(last) if last else -1
        if at >= 0:
            prompt = prompt[: at + len(last)]
    return prompt


# ---------------------------------------------------------------------------------------------------------------------
# response pieces


def token_logprobs(lm: LoadedModel, ids, lps, tops, top_n: int) -> list[dict]:
    out = []
    for k, (tid, lp) in enumerate(zip(ids, lps)):
        piece = lm.tokenizer.id_to_piece(tid) if 0 <= tid < lm.tokenizer.vocab_size else ""
        top = tops[k] if k < len(tops) and tops[k] else {}
        out.append({"token": piece, "logprob": float(lp), "bytes": list(piece.encode("utf-8")),
                    "top_logprobs": [{"token": t, "logprob": float(v), "bytes": list(t.encode("utf-8"))}
                                     for t, v in list(top.items())[:top_n]]})
    return out


def _finish(result_finish: str | None, calls) -> str:
    if calls:
        return "tool_calls"
    return result_finish or "stop"


class ChatRun:
    """One chat request, prepared: prompt ids, choice specs, tool mode."""

    def __init__(self, req: ChatCompletionRequest, lm: LoadedModel, config):
        self.req, self.lm, self.config = req, lm, config
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.tool_dicts, self.tool_mode, forced_name = _tool_mode(req, lm)
        self.prompt = build_prompt(req, lm, self.tool_dicts)
        forced_schema = None
        self.prefill = ""
        if self.tool_mode == "forced":
            self.prefill = tools.prefix(lm.tool_format)
            forced_schema = tools.call_schema(self.tool_dicts, lm.tool_format, forced_name)
        self.ids = engine.encode_prompt(lm, self.prompt + self.prefill, "messages", add_bos=False)
        requested = req.max_completion_tokens or req.max_tokens
        max_tokens = engine.max_new_tokens(req, len(self.ids), lm, config.sampling, requested)
        constraint = engine.constraint_for(req, lm, forced_schema)
        self.top_n = (req.top_logprobs or 0) if req.logprobs else 0
        self.specs = [ChoiceSpec(i, self.ids, engine.job_args(
            req, lm, config.sampling, max_tokens, logprobs=req.logprobs, top_logprobs=self.top_n,
            constraint=constraint, seed_offset=i)) for i in range(req.n)]
        self.jobs = engine.make_jobs(lm, self.specs)

    def split(self, text: str):
        """(content, tool calls) of a finished choice's text."""
        if self.tool_mode == "forced":
            content, calls = tools.parse_tool_calls(self.prefill + text + tools.suffix(self.lm.tool_format),
                                                    self.lm.tool_format)
            return (content or None, calls) if calls else (text, [])
        if self.tool_mode == "auto":
            content, calls = tools.parse_tool_calls(text, self.lm.tool_format)
            return (content or None) if calls else content, calls
        return text, []

    def usage(self, results, timing) -> dict:
        cached = results[0].cached_tokens if results else 0
        return engine.usage(len(self.ids), cached, results, timing)


async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    state = request.app.state
    arrival = time.perf_counter()
    state.drain.check()
    lm = state.manager.require(req.model)
    run = await anyio.to_thread.run_sync(ChatRun, req, lm, state.config)  # template + tokenizer: off the loop
    timing = Timing(state.metrics, arrival)
    events = engine.run_jobs(lm, run.jobs, state.metrics, timing, state.drain)
    if req.stream:
        return sse_response(_stream(run, events, timing), state.config)
    results = {i: ChoiceResult(i, prompt_tokens=len(run.ids)) for i in range(req.n)}
    if not await engine.collect_response(request, events, results):
        return Response(status_code=499)  # the client went away
    choices = []
    for i in range(req.n):
        r = results[i]
        content, calls = run.split(r.text)
        choice = {"index": i, "message": {"role": "assistant", "content": content,
                                          "tool_calls": [c.as_dict() for c in calls] or None},
                  "logprobs": None, "finish_reason": _finish(r.finish_reason, calls),
                  "exl_finish_reason": r.exl_finish_reason}
        if req.logprobs:
            choice["logprobs"] = {"content": token_logprobs(lm, r.token_ids, r.logprobs, r.top_logprobs, run.top_n)}
        if req.return_token_ids:
            choice["token_ids"] = r.token_ids
        choices.append(choice)
    use = run.usage(list(results.values()), timing)
    engine.log_request(state.config, "chat", run.id, use, [c["finish_reason"] for c in choices], run.prompt,
                       [r.text for r in results.values()])
    body = {"id": run.id, "object": "chat.completion", "created": run.created, "model": lm.name,
            "choices": choices, "usage": use, "system_fingerprint": None}
    if req.return_token_ids:
        body["prompt_token_ids"] = run.ids
    return JSONResponse(body)


async def _stream(run: ChatRun, events, timing):
    req, lm = run.req, run.lm
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(choices, usage=None):
        body = {"id": run.id, "object": "chat.completion.chunk", "created": run.created, "model": lm.name,
                "choices": choices}
        if include_usage:
            body["usage"] = usage
        return json.dumps(body, ensure_ascii=False)

    parsers = {i: tools.ToolStreamParser(lm.tool_format) for i in range(req.n)} if run.tool_mode == "auto" else {}
    results = {i: ChoiceResult(i, prompt_tokens=len(run.ids)) for i in range(req.n)}
    finish = {}
    try:
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(req.n)])
        async for i, event in events:
            r = results[i]
            r.add(event)
            text = event.text or ""
            if run.tool_mode == "auto":
                text = parsers[i].feed(text)
            elif run.tool_mode == "forced":
                text = ""  # the whole reply is the call: sent at the end
            logprobs = None
            if req.logprobs and event.token_ids:
                logprobs = {"content": token_logprobs(lm, event.token_ids, event.logprobs or [],
                                                      event.top_logprobs or [], run.top_n)}
            if text or logprobs or (req.return_token_ids and event.token_ids):
                c = {"index": i, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}
                if req.return_token_ids:
                    c["token_ids"] = list(event.token_ids or [])
                yield chunk([c])
            if event.eos:
                calls = []
                if run.tool_mode == "auto":
                    rest, calls = parsers[i].finish()
                    if rest:
                        yield chunk([{"index": i, "delta": {"content": rest}, "logprobs": None,
                                      "finish_reason": None}])
                elif run.tool_mode == "forced":
                    content, calls = run.split(r.text)
                    if content:
                        yield chunk([{"index": i, "delta": {"content": content}, "logprobs": None,
                                      "finish_reason": None}])
                if calls:
                    deltas = [{"index": k, "id": c.id, "type": "function",
                               "function": {"name": c.name, "arguments": c.arguments}} for k, c in enumerate(calls)]
                    yield chunk([{"index": i, "delta": {"tool_calls": deltas}, "logprobs": None,
                                  "finish_reason": None}])
                finish[i] = _finish(r.finish_reason, calls)
                yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish[i],
                              "exl_finish_reason": r.exl_finish_reason}])
        use = run.usage(list(results.values()), timing)
        if include_usage:
            yield chunk([], use)
        engine.log_request(run.config, "chat", run.id, use, list(finish.values()), run.prompt,
                           [r.text for r in results.values()])
        yield "[DONE]"
    except APIError as e:
        shutdown = engine.is_shutdown(e)
        if shutdown:  # every open choice gets its end, then the error says why
            for i in engine.end_for_shutdown(results):
                yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": "length",
                              "exl_finish_reason": "shutdown"}])
        yield json.dumps(e.body())
        if shutdown:
            yield "[DONE]"
