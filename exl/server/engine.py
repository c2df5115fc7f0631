"""From an API request to generator jobs and back: sampler settings, limits, running n choices together.

`run_choices` submits one `exl.generator.Job` per choice to the shared `AsyncGenerator` (so requests from
all clients batch continuously) and yields `(choice index, event)` as events arrive. When the consumer
stops early (client gone, server shutting down) every job still running is cancelled, which frees its
cache pages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import anyio

from exl.server.drain import SHUTTING_DOWN, shutting_down
from exl.server.errors import APIError, bad_request
from exl.server.manager import LoadedModel
from exl.server.schemas import MAX_STOP, SamplingRequest

log = logging.getLogger("exl.server")

# finish_reason takes OpenAI's values only; exl's own reason (the generator's eos_reason, or "shutdown") goes in
# `exl_finish_reason`. A job cut short (model unloaded, server shutting down) is "length": its output is
# incomplete. A job that failed ("error") is never reported as finished: the request gets an error instead.
FINISH = {"stop_token": "stop", "stop_string": "stop", "constraint": "stop", "max_new_tokens": "length",
          "cancelled": "length", "shutdown": "length"}


def finish_reason(eos_reason: str | None) -> str:
    return FINISH.get(eos_reason or "", "stop")


@dataclass
class ChoiceSpec:
    """One job to run: its prompt and the Job keyword arguments."""

    index: int
    input_ids: list[int]
    job_args: dict


@dataclass
class ChoiceResult:
    """Everything one choice produced, gathered from its events."""

    index: int
    prompt_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    exl_finish_reason: str | None = None
    cached_tokens: int = 0
    new_tokens: int = 0
    time_to_first_token: float | None = None
    time_total: float | None = None

    def add(self, event) -> None:
        self.text += event.text or ""
        self.token_ids += list(event.token_ids or [])
        if event.logprobs:
            self.logprobs += list(event.logprobs)
        if event.top_logprobs:
            self.top_logprobs += list(event.top_logprobs)
        if event.eos:
            self.finish_reason = finish_reason(event.eos_reason)
            self.exl_finish_reason = event.eos_reason
            self.cached_tokens = event.cached_tokens or 0
            self.new_tokens = event.new_tokens if event.new_tokens is not None else len(self.token_ids)
            if event.prompt_tokens is not None:
                self.prompt_tokens = event.prompt_tokens


# ---------------------------------------------------------------------------------------------------------------------
# request -> job settings


def _str_list(value, param: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        if param == "dry_sequence_breakers" and value.strip().startswith("["):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise bad_request(f"{param}: not a JSON list of strings ({e})", param) from None
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise bad_request(f"{param} must be a list of strings", param)
            return value
        return [value]
    return list(value)


def sampler_settings(req: SamplingRequest, lm: LoadedModel, defaults) -> "object":
    """SamplerSettings from a request, falling back to the server's sampling defaults."""
    from exl.generator import SamplerSettings

    def pick(name, default):
        value = getattr(req, name, None)
        return default if value is None else value

    temperature = pick("temperature", defaults.temperature)
    top_p = pick("top_p", defaults.top_p)
    if top_p <= 0:  # OpenAI allows top_p=0: only the most likely token
        temperature, top_p = 0.0, 1.0
    top_k = pick("top_k", defaults.top_k)
    typical = pick("typical", 1.0)
    penalty_range = pick("penalty_range", defaults.penalty_range)
    vocab = lm.vocab_limit
    logit_bias = None
    if req.logit_bias:
        logit_bias = {}
        for key, value in req.logit_bias.items():
            try:
                tid = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if not 0 <= tid < vocab:
                raise bad_request(f"logit_bias: token id {tid} is out of range [0, {vocab})", "logit_bias")
            if not -100 <= value <= 100:
                raise bad_request(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
            logit_bias[tid] = float(value)
    banned = req.banned_tokens or None
    if banned and any(not 0 <= t < vocab for t in banned):
        raise bad_request(f"banned_tokens: ids must be in [0, {vocab})", "banned_tokens")
    kw = dict(
        temperature=float(temperature), top_k=max(0, int(top_k)), top_p=float(top_p),
        min_p=float(pick("min_p", defaults.min_p)), typical=float(typical) if typical > 0 else 1.0,
        repetition_penalty=float(pick("repetition_penalty", defaults.repetition_penalty)),
        frequency_penalty=float(req.frequency_penalty or 0.0), presence_penalty=float(req.presence_penalty or 0.0),
        penalty_range=max(0, int(penalty_range)),
        dry_multiplier=float(req.dry_multiplier or 0.0),
        xtc_probability=float(req.xtc_probability or 0.0),
        logit_bias=logit_bias, banned_tokens=banned, temperature_last=bool(req.temperature_last),
    )
    for name in ("dry_base", "dry_allowed_length", "dry_range", "xtc_threshold"):
        if getattr(req, name, None) is not None:
            kw[name] = getattr(req, name)
    if req.dry_sequence_breakers is not None:
        kw["dry_sequence_breakers"] = _str_list(req.dry_sequence_breakers, "dry_sequence_breakers")
    settings = SamplerSettings(**kw)
    try:
        settings.validate()
    except ValueError as e:
        raise bad_request(str(e)) from None
    return settings


def stop_conditions(req: SamplingRequest, lm: LoadedModel) -> list:
    stops = _str_list(req.stop, "stop")
    if len(stops) > MAX_STOP:
        raise bad_request(f"stop takes at most {MAX_STOP} strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise bad_request("stop strings must not be empty", "stop")
    ids = list(req.stop_token_ids or [])
    if any(not 0 <= t < lm.vocab_limit for t in ids):
        raise bad_request(f"stop_token_ids must be in [0, {lm.vocab_limit})", "stop_token_ids")
    return stops + ids


def constraint_for(req: SamplingRequest, lm: LoadedModel, forced_schema: dict | None = None):
    """The output constraint a request asks for (response_format, json_schema, regex_pattern, grammar_string)."""
    from exl.generator import constraints as C

    try:
        if forced_schema is not None:
            return C.JsonSchemaConstraint(lm.tokenizer, forced_schema)
        rf = req.response_format
        if rf is not None and rf.type == "json_object":
            return C.JsonSchemaConstraint(lm.tokenizer, {"type": "object"})
        if rf is not None and rf.type == "json_schema":
            return C.JsonSchemaConstraint(lm.tokenizer, rf.json_schema.schema_ or {"type": "object"})
        if req.json_schema is not None:
            return C.JsonSchemaConstraint(lm.tokenizer, req.json_schema)
        if req.regex_pattern is not None:
            return C.RegexConstraint(lm.tokenizer, req.regex_pattern)
        if req.grammar_string is not None:
            return C.GrammarConstraint(lm.tokenizer, req.grammar_string)
    except APIError:
        raise
    except Exception as e:  # llguidance rejects a schema/regex/grammar in many ways
        param = "response_format" if req.response_format is not None else None
        raise bad_request(f"cannot use this output constraint: {e}", param, code="invalid_constraint") from None
    return None


def encode_prompt(lm: LoadedModel, text: str, param: str, **kw) -> list[int]:
    """Token ids of a prompt; a text certainly longer than the context is refused before it is tokenized (400),
    so a huge request costs neither the tokenizer's time nor its memory. Call it off the event loop."""
    least = lm.tokenizer.min_tokens(text)
    if least > lm.max_seq_len:
        raise bad_request(f"{param}: the prompt is {len(text)} characters, at least {least} tokens; this model's "
                          f"context is {lm.max_seq_len} tokens. Shorten the prompt.", param,
                          code="context_length_exceeded")
    return lm.tokenizer.encode(text, **kw)


def max_new_tokens(req: SamplingRequest, prompt_len: int, lm: LoadedModel, defaults,
                   requested: int | None = None) -> int:
    """max_tokens, bounded by the context: 400 if the prompt (plus an explicit max_tokens) does not fit."""
    room = lm.max_seq_len - prompt_len
    if room < 1:
        raise bad_request(f"the prompt is {prompt_len} tokens; this model's context is {lm.max_seq_len} tokens, "
                          f"which leaves no room for a completion. Shorten the prompt.", "messages",
                          code="context_length_exceeded")
    if requested is not None:
        if requested > room:
            raise bad_request(
                f"this model's context is {lm.max_seq_len} tokens; you asked for {prompt_len + requested} "
                f"({prompt_len} in the prompt, {requested} for the completion). Lower max_tokens or shorten "
                f"the prompt.", "max_tokens", code="context_length_exceeded")
        return requested
    return min(room, defaults.max_tokens) if defaults.max_tokens else room


def job_args(req: SamplingRequest, lm: LoadedModel, defaults, max_tokens: int, *, logprobs: bool,
             top_logprobs: int, constraint, seed_offset: int = 0) -> dict:
    seed = None
    if req.seed is not None:
        seed = (int(req.seed) + seed_offset) % (2**63)
    if req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) is larger than max_tokens ({max_tokens})", "min_tokens")
    return dict(
        max_new_tokens=max_tokens, min_new_tokens=req.min_tokens, sampler=sampler_settings(req, lm, defaults),
        seed=seed, stop_conditions=stop_conditions(req, lm), banned_strings=_str_list(req.banned_strings,
                                                                                      "banned_strings") or None,
        return_logprobs=logprobs, return_top_tokens=top_logprobs, constraint=constraint, ignore_eos=req.ignore_eos,
        decode_special_tokens=not req.skip_special_tokens,
    )


# ---------------------------------------------------------------------------------------------------------------------
# running


class Timing:
    """Per-choice first-token and inter-token times, recorded into the metrics."""

    def __init__(self, metrics, arrival: float):
        self.metrics, self.arrival = metrics, arrival
        self.last: dict[int, float] = {}
        self.first: dict[int, float] = {}

    def tokens(self, index: int, count: int) -> None:
        if count <= 0:
            return
        now = time.perf_counter()
        if index not in self.last:
            self.first[index] = now - self.arrival
            self.metrics.ttft.observe(now - self.arrival)
        else:
            dt = (now - self.last[index]) / count
            for _ in range(count):
                self.metrics.itl.observe(dt)
        self.last[index] = now


def make_jobs(lm: LoadedModel, specs: list[ChoiceSpec]) -> list:
    """Jobs for the specs; a job the generator would refuse is a 400 before anything is streamed."""
    from exl.errors import ExlError
    from exl.generator import Job

    jobs = []
    for spec in specs:
        try:
            job = Job(spec.input_ids, identifier=spec.index, **spec.job_args)
            lm.generator.validate(job)
        except (ValueError, TypeError, ExlError) as e:
            raise bad_request(str(e)) from None
        jobs.append(job)
    return jobs


async def run_jobs(lm: LoadedModel, jobs: list, metrics, timing: "Timing", drain=None) -> AsyncIterator[tuple]:
    """Run jobs on the shared generator; yield (job identifier, event). Cancels every unfinished job on exit.
    drain (exl.server.drain.Drain): counts this request as running; when its shutdown grace is over, raises 503
    `server_shutting_down`.

    Every job delivers into one queue (AsyncJob's sink), read here: per token, one wake-up of this coroutine.
    A watchdog task, not a timeout per wait, notices the end of the shutdown grace and a dead generator."""
    from exl.generator import AsyncJob

    if lm.async_generator is None or lm.jobs is None:
        raise APIError(404, "the model was unloaded", code="model_not_found")
    events: asyncio.Queue = asyncio.Queue()
    async_jobs = []
    async_generator = lm.async_generator
    watchdog = None
    ended: set = set()
    if drain is not None:
        drain.enter()
    try:
        for job in jobs:
            try:
                async_job = AsyncJob(async_generator, job, sink=events, tag=job.identifier)
            except RuntimeError as e:  # unloaded (closed) or failed generator
                raise APIError(503, f"cannot run the request: {e}", code="generator_unavailable") from None
            async_jobs.append(async_job)
            lm.jobs.add(async_job)
        watchdog = asyncio.create_task(_watch(events, async_generator, drain))
        remaining = len(async_jobs)
        while remaining:
            index, event = await events.get()
            if index is _WATCHDOG:
                raise event
            if drain is not None and drain.expired:  # before this event: a queued job that starts now ends with 503
                raise _grace_over()
            if isinstance(event, BaseException):
                if event is getattr(async_generator, "error", None) and not isinstance(event, APIError):
                    raise _generator_failed(event)
                raise _generation_error(event)
            timing.tokens(index, len(event.token_ids or []))
            if event.eos:
                remaining -= 1
                ended.add(index)
                if event.eos_reason == "error":
                    message = getattr(event, "error", None) or "unknown error"
                    if event.error_code is not None:  # the request asked for what cannot be done: a 4xx
                        metrics.requests.labels("error").inc()
                        raise APIError(400, f"choice {index}: {message}", code=event.error_code)
                    log.warning("choice %d failed in the generator: %s", index, message)
                    metrics.requests.labels("error").inc()
                    raise APIError(500, f"generation of choice {index} failed: {message}", "server_error",
                                   code="generation_failed")
                reason = event.eos_reason if event.eos_reason in ("cancelled", "shutdown") else None
                metrics.requests.labels(reason or finish_reason(event.eos_reason)).inc()
                metrics.generation_tokens.inc(event.new_tokens or 0)
                metrics.prompt_tokens.inc(max(0, (event.prompt_tokens or 0) - (event.cached_tokens or 0)))
                metrics.cached_tokens.inc(event.cached_tokens or 0)
                metrics.e2e.observe(time.perf_counter() - timing.arrival)
            yield index, event
    finally:
        with anyio.CancelScope(shield=True):
            if watchdog is not None:
                watchdog.cancel()
            for async_job in async_jobs:
                lm.jobs.discard(async_job)
                if async_job.job.identifier not in ended:
                    metrics.requests.labels("cancelled").inc()
                if not _finished(async_job):
                    try:
                        await async_job.cancel()
                    except Exception:
                        log.debug("cancel failed", exc_info=True)
            if watchdog is not None:
                await asyncio.gather(watchdog, return_exceptions=True)
            if drain is not None:
                drain.leave()


_WATCHDOG = object()  # the tag of what the watchdog puts into a request's event queue


async def _watch(events: asyncio.Queue, async_generator, drain) -> None:
    """Put an APIError into `events` when the shutdown grace ends (checked every 0.25 s while draining) or when
    the generator's worker thread has died (checked every second; its jobs normally get error events first,
    this covers jobs it never took)."""
    while True:
        await asyncio.sleep(0.25 if drain is not None and drain.draining else 1.0)
        if drain is not None and drain.expired:
            events.put_nowait((_WATCHDOG, _grace_over()))
            return
        dead = getattr(async_generator, "error", None)
        if dead is not None:
            events.put_nowait((_WATCHDOG, _generator_failed(dead)))
            return


def _grace_over() -> APIError:
    return shutting_down("the server is shutting down: the shutdown grace period (network.shutdown_grace) ended "
                         "before this request finished")


def _generator_failed(error: BaseException) -> APIError:
    return APIError(503, f"the generator stopped ({type(error).__name__}: {error}); it is restarted for the next "
                    f"request, try again", code="generator_failed")


def _finished(async_job) -> bool:
    job = getattr(async_job, "job", None)
    return bool(job is not None and getattr(job, "done", False))


def _generation_error(e: Exception) -> APIError:
    from exl.errors import ExlError

    if isinstance(e, APIError):
        return e
    if isinstance(e, (ExlError, ValueError)):
        return bad_request(f"generation failed: {e}")
    log.error("generation failed", exc_info=e)
    return APIError(500, f"generation failed ({type(e).__name__}: {e}); see the server log", "server_error")


# ---------------------------------------------------------------------------------------------------------------------
# collecting, usage


def is_shutdown(e: Exception) -> bool:
    return isinstance(e, APIError) and e.code == SHUTTING_DOWN


def end_for_shutdown(results: dict) -> list[int]:
    """Mark every unfinished choice as cut by the shutdown; returns their indices."""
    cut = [i for i, r in results.items() if r.finish_reason is None]
    for i in cut:
        results[i].finish_reason, results[i].exl_finish_reason = "length", "shutdown"
    return cut


class ClientGone(Exception):
    """The client disconnected before its response was ready (its jobs were cancelled)."""


async def collect(request, events: AsyncIterator[tuple], results: dict[int, ChoiceResult],
                  poll: float = 0.5) -> None:
    """Feed every event into `results`; if the client disconnects meanwhile, cancel and raise ClientGone."""

    async def consume():
        async for index, event in events:
            results[index].add(event)

    task = asyncio.create_task(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)


async def collect_response(request, events: AsyncIterator[tuple], results: dict[int, ChoiceResult]) -> bool:
    """A non-streaming request's events, all into `results`. False when the client went away (answer 499). A
    shutdown mid-way keeps what was generated, cut ("length", exl_finish_reason "shutdown")."""
    try:
        await collect(request, events, results)
    except ClientGone:
        return False
    except APIError as e:
        if not is_shutdown(e) or not any(r.token_ids for r in results.values()):
            raise
        end_for_shutdown(results)
    return True


def usage(prompt_tokens: int, cached_tokens: int, results, timing: Timing) -> dict:
    """OpenAI usage plus timing: time to first token, seconds and tokens/s for prompt and completion."""
    completion = sum(r.new_tokens or len(r.token_ids) for r in results)
    end = time.perf_counter()
    total = end - timing.arrival
    ttft = min(timing.first.values()) if timing.first else total
    gen_time = max(total - ttft, 0.0)
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
           "prompt_tokens_details": {"cached_tokens": cached_tokens},
           "time_to_first_token": round(ttft, 4), "prompt_time": round(ttft, 4), "completion_time": round(gen_time, 4),
           "total_time": round(total, 4),
           "prompt_tokens_per_second": round(prompt_tokens / ttft, 2) if ttft > 0 else None,
           "completion_tokens_per_second": round(max(completion - len(results), 0) / gen_time, 2)
           if gen_time > 0 and completion > len(results) else None}
    return out


def log_request(config, kind: str, request_id: str, use: dict, finish: list, prompt_text=None, outputs=None) -> None:
    if not config.logging.requests:
        return
    tps = use.get("completion_tokens_per_second")
    log.info("%s %s: %d prompt tokens (%d cached), %d generated, first token %.3f s, %s tok/s, finish %s", kind,
             request_id, use["prompt_tokens"], use["prompt_tokens_details"]["cached_tokens"], use["completion_tokens"],
             use["time_to_first_token"], f"{tps:.1f}" if tps else "-", ",".join(str(f) for f in finish))
    if config.logging.prompts:
        log.info("%s %s prompt: %r", kind, request_id, prompt_text)
        for i, text in enumerate(outputs or []):
            log.info("%s %s output %d: %r", kind, request_id, i, text)
