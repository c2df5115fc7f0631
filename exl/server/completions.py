"""POST /v1/completions: raw prompts (text or token ids, one or several), streaming and non-streaming."""

from __future__ import annotations

import json
import secrets
import time

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from exl.server import engine
from exl.server.engine import ChoiceResult, ChoiceSpec, Timing
from exl.server.errors import APIError, bad_request
from exl.server.manager import LoadedModel
from exl.server.schemas import MAX_N, CompletionRequest
from exl.server.sse import sse_response


def _prompts(req: CompletionRequest, lm: LoadedModel) -> list[tuple[str | None, list[int]]]:
    """(text, ids) of each prompt."""
    p = req.prompt
    if isinstance(p, str):
        items: list = [p]
    elif not p:
        raise bad_request("prompt must not be empty", "prompt")
    elif all(isinstance(x, int) for x in p):
        items = [list(p)]
    else:
        items = list(p)
    out = []
    for k, item in enumerate(items):
        if isinstance(item, str):
            ids = engine.encode_prompt(lm, item, "prompt" if isinstance(p, str) else f"prompt[{k}]")
            out.append((item, ids))
        else:
            if any(not 0 <= t < lm.vocab_limit for t in item):
                raise bad_request(f"prompt[{k}]: token ids must be in [0, {lm.vocab_limit})", "prompt")
            out.append((None, list(item)))
        if not out[-1][1]:
            raise bad_request(f"prompt[{k}] is empty (no tokens); give some text or token ids", "prompt")
    if len(out) * req.n > MAX_N * 4:
        raise bad_request(f"{len(out)} prompts x n={req.n} is more than {MAX_N * 4} completions in one request",
                          "prompt")
    return out


def prompt_logprobs(lm: LoadedModel, ids: list[int], chosen: list[float], tops: list, top_n: int) -> dict:
    """The echoed prompt's part of `logprobs`: its tokens, their log-probabilities given the tokens before
    (null for the first), the `top_n` most likely tokens at each position plus the prompt's own, offsets."""
    pieces = [pieces_of(lm, t) for t in ids]
    top_dicts: list = [None]
    for k, (lp, top) in enumerate(zip(chosen, tops)):
        if not top_n:
            top_dicts.append(None)
            continue
        d = {pieces_of(lm, t): float(v) for t, v in top[:top_n]}
        d.setdefault(pieces[k + 1], float(lp))
        top_dicts.append(d)
    offsets, pos = [], 0
    for piece in pieces:
        offsets.append(pos)
        pos += len(piece)
    return {"tokens": pieces, "token_logprobs": [None] + [float(x) for x in chosen], "top_logprobs": top_dicts,
            "text_offset": offsets}


def pieces_of(lm: LoadedModel, tid: int) -> str:
    return lm.tokenizer.id_to_piece(tid) if 0 <= tid < lm.tokenizer.vocab_size else ""


def _joined(first: dict | None, second: dict | None) -> dict | None:
    if first is None:
        return second
    if second is None:
        return first
    return {k: first[k] + second[k] for k in first}


def completion_logprobs(lm: LoadedModel, r: ChoiceResult, top_n: int, offset: int) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset
    for k, (tid, lp) in enumerate(zip(r.token_ids, r.logprobs)):
        piece = pieces_of(lm, tid)
        tokens.append(piece)
        lps.append(float(lp))
        top = r.top_logprobs[k] if k < len(r.top_logprobs) and r.top_logprobs[k] else {}
        tops.append({t: float(v) for t, v in list(top.items())[:top_n]} if top_n else None)
        offsets.append(pos)
        pos += len(piece)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


class CompletionRun:
    def __init__(self, req: CompletionRequest, lm: LoadedModel, config):
        if req.suffix:
            raise bad_request("suffix (fill-in-the-middle) is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        self.req, self.lm, self.config = req, lm, config
        self.id = "cmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.prompts = _prompts(req, lm)
        constraint = engine.constraint_for(req, lm)
        self.logprobs = req.logprobs is not None
        self.top_n = req.logprobs or 0
        self.score = req.echo and self.logprobs  # the prompt tokens' log-probabilities too
        self.specs, self.scored_only = [], []
        for p, (_, ids) in enumerate(self.prompts):
            if req.max_tokens == 0:  # nothing to generate: the choices are the (scored) prompt alone
                if len(ids) > lm.max_seq_len:
                    raise bad_request(f"prompt[{p}] is {len(ids)} tokens; this model's context is {lm.max_seq_len}",
                                      "prompt", code="context_length_exceeded")
                self.scored_only += [ChoiceSpec(p * req.n + j, ids, {}) for j in range(req.n)]
                continue
            max_tokens = engine.max_new_tokens(req, len(ids), lm, config.sampling, req.max_tokens)
            for j in range(req.n):
                self.specs.append(ChoiceSpec(p * req.n + j, ids, engine.job_args(
                    req, lm, config.sampling, max_tokens, logprobs=self.logprobs, top_logprobs=self.top_n,
                    constraint=constraint, seed_offset=j)))
        self.jobs = engine.make_jobs(lm, self.specs)
        self.prompt_logprobs: dict[int, dict] = {}

    @property
    def all_specs(self) -> list[ChoiceSpec]:
        return sorted(self.specs + self.scored_only, key=lambda s: s.index)

    def results(self) -> dict[int, ChoiceResult]:
        out = {s.index: ChoiceResult(s.index, prompt_tokens=len(s.input_ids)) for s in self.all_specs}
        for s in self.scored_only:
            out[s.index].finish_reason, out[s.index].exl_finish_reason = "length", "max_new_tokens"
        return out

    async def score_prompts(self) -> None:
        """With echo + logprobs: each prompt's token log-probabilities, computed on the generator's thread
        by the same forward pass `exl eval ppl` makes."""
        if not self.score:
            return
        from functools import partial

        from exl.eval import prompt_logprobs as score

        for p, (_, ids) in enumerate(self.prompts):
            try:
                chosen, tops = await self.lm.async_generator.call(partial(score, self.lm.model, ids, self.top_n))
            except RuntimeError as e:  # the generator was closed (unloaded) or failed
                raise APIError(503, f"cannot score the prompt: {e}", code="generator_unavailable") from None
            self.prompt_logprobs[p] = prompt_logprobs(self.lm, ids, chosen, tops, self.top_n)

    def echo_logprobs(self, index: int) -> dict | None:
        return self.prompt_logprobs.get(index // self.req.n)

    def echo_text(self, index: int) -> str:
        if not self.req.echo:
            return ""
        text, ids = self.prompts[index // self.req.n]
        return text if text is not None else self.lm.tokenizer.decode(ids)

    def usage(self, results, timing) -> dict:
        prompt = sum(len(ids) for _, ids in self.prompts)
        cached = sum(results[p * self.req.n].cached_tokens for p in range(len(self.prompts)))
        return engine.usage(prompt, cached, list(results.values()), timing)


async def completions(req: CompletionRequest, request: Request) -> Response:
    state = request.app.state
    arrival = time.perf_counter()
    state.drain.check()
    lm = state.manager.require(req.model)
    run = await anyio.to_thread.run_sync(CompletionRun, req, lm, state.config)  # tokenizer: off the loop
    timing = Timing(state.metrics, arrival)
    await run.score_prompts()
    events = engine.run_jobs(lm, run.jobs, state.metrics, timing, state.drain)
    if req.stream:
        return sse_response(_stream(run, events, timing), state.config)
    results = run.results()
    if not await engine.collect_response(request, events, results):
        return Response(status_code=499)  # the client went away
    choices = []
    for s in run.all_specs:
        r = results[s.index]
        echo = run.echo_text(s.index)
        logprobs = None
        if run.logprobs:
            logprobs = _joined(run.echo_logprobs(s.index), completion_logprobs(lm, r, run.top_n, len(echo)))
        choices.append({"index": s.index, "text": echo + r.text, "finish_reason": r.finish_reason or "stop",
                        "exl_finish_reason": r.exl_finish_reason, "logprobs": logprobs})
        if req.return_token_ids:
            choices[-1].update(token_ids=r.token_ids, prompt_token_ids=s.input_ids)
    use = run.usage(results, timing)
    engine.log_request(state.config, "completion", run.id, use, [c["finish_reason"] for c in choices],
                       [t for t, _ in run.prompts], [r.text for r in results.values()])
    return JSONResponse({"id": run.id, "object": "text_completion", "created": run.created, "model": lm.name,
                         "choices": choices, "usage": use, "system_fingerprint": None})


async def _stream(run: CompletionRun, events, timing):
    req, lm = run.req, run.lm
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    results = run.results()
    offsets = {s.index: 0 for s in run.all_specs}

    def chunk(choices, usage=None):
        body = {"id": run.id, "object": "text_completion", "created": run.created, "model": lm.name,
                "choices": choices}
        if include_usage:
            body["usage"] = usage
        return json.dumps(body, ensure_ascii=False)

    try:
        for s in run.all_specs:
            echo = run.echo_text(s.index)
            if echo:
                offsets[s.index] = len(echo)
                yield chunk([{"index": s.index, "text": echo, "logprobs": run.echo_logprobs(s.index),
                              "finish_reason": None}])
        for s in run.scored_only:
            yield chunk([{"index": s.index, "text": "", "logprobs": None, "finish_reason": "length",
                          "exl_finish_reason": "max_new_tokens"}])
        async for i, event in events:
            results[i].add(event)
            logprobs = None
            if run.logprobs and event.token_ids:
                part = ChoiceResult(i, token_ids=list(event.token_ids), logprobs=list(event.logprobs or []),
                                    top_logprobs=list(event.top_logprobs or []))
                logprobs = completion_logprobs(lm, part, run.top_n, offsets[i])
                offsets[i] += sum(len(t) for t in logprobs["tokens"])
            if event.text or logprobs or event.eos or (req.return_token_ids and event.token_ids):
                c = {"index": i, "text": event.text or "", "logprobs": logprobs,
                     "finish_reason": (results[i].finish_reason or "stop") if event.eos else None}
                if event.eos:
                    c["exl_finish_reason"] = results[i].exl_finish_reason
                if req.return_token_ids:
                    c["token_ids"] = list(event.token_ids or [])
                yield chunk([c])
        use = run.usage(results, timing)
        if include_usage:
            yield chunk([], use)
        engine.log_request(run.config, "completion", run.id, use, [r.finish_reason for r in results.values()],
                           [t for t, _ in run.prompts], [r.text for r in results.values()])
        yield "[DONE]"
    except APIError as e:
        shutdown = engine.is_shutdown(e)
        if shutdown:  # every open choice gets its end, then the error says why
            for i in engine.end_for_shutdown(results):
                yield chunk([{"index": i, "text": "", "logprobs": None, "finish_reason": "length",
                              "exl_finish_reason": "shutdown"}])
        yield json.dumps(e.body())
        if shutdown:
            yield "[DONE]"
