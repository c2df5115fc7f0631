"""A generation request (Job) and what the generator reports about it (Event)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from exl.generator.sampling import SamplerSettings

EOS_REASONS = ("stop_token", "stop_string", "max_new_tokens", "cancelled", "constraint", "error")
_ids = itertools.count()


class Job:
    """One prompt to continue.

    input_ids: prompt token ids (a list, or a [T] / [1, T] tensor).
    max_new_tokens / min_new_tokens: bounds on generated tokens (stop tokens are suppressed below the minimum).
    sampler: SamplerSettings (default: plain sampling at temperature 1; SamplerSettings.greedy() for argmax).
    seed: makes sampling reproducible bit for bit (None: a random seed, kept in `job.seed`).
    stop_conditions: token ids and/or strings that end the job. The tokenizer's EOS ids are added unless
        ignore_eos. A stop string is not part of the output; text that could still become one is held back.
    banned_strings: strings that must not appear in the output: when one does, generation rewinds to the token
        where it began and samples again without that token there.
    return_logprobs: report each new token's log-probability under the model; return_top_tokens: also the
        top-n alternatives per position as {token text: logprob}.
    constraint: an exl.generator.constraints Constraint (JSON schema, regex, grammar).
    identifier: anything; echoed in events.
    decode_special_tokens: include special tokens (other than the stop tokens) in the text.
    """

    def __init__(self, input_ids, max_new_tokens: int = 256, min_new_tokens: int = 0,
                 sampler: SamplerSettings | None = None, seed: int | None = None, stop_conditions=None,
                 banned_strings: list[str] | None = None, return_logprobs: bool = False, return_top_tokens: int = 0,
                 constraint=None, identifier: Any = None, ignore_eos: bool = False,
                 decode_special_tokens: bool = False):
        if isinstance(input_ids, torch.Tensor):
            if input_ids.dim() == 2 and input_ids.shape[0] == 1:
                input_ids = input_ids[0]
            if input_ids.dim() != 1:
                raise ValueError(f"Job: input_ids must be a list or a [T] / [1, T] tensor, got shape {tuple(input_ids.shape)}")
            input_ids = input_ids.tolist()
        try:
            self.input_ids = [int(t) for t in input_ids]
        except (TypeError, ValueError) as e:
            raise ValueError(f"Job: input_ids must be a sequence of token ids ({e})") from e
        if not self.input_ids:
            raise ValueError("Job: input_ids is empty; a prompt needs at least one token (e.g. BOS)")
        if max_new_tokens < 1:
            raise ValueError(f"Job: max_new_tokens must be >= 1, got {max_new_tokens}")
        if not 0 <= min_new_tokens <= max_new_tokens:
            raise ValueError(f"Job: min_new_tokens must be in [0, max_new_tokens={max_new_tokens}], got {min_new_tokens}")
        if return_top_tokens < 0:
            raise ValueError(f"Job: return_top_tokens must be >= 0, got {return_top_tokens}")
        self.max_new_tokens, self.min_new_tokens = int(max_new_tokens), int(min_new_tokens)
        self.sampler = sampler if sampler is not None else SamplerSettings()
        if not isinstance(self.sampler, SamplerSettings):
            raise TypeError(f"Job: sampler must be a SamplerSettings, got {type(self.sampler).__name__}")
        self.sampler.validate()
        self.seed = seed
        self.stop_tokens: set[int] = set()
        self.stop_strings: list[str] = []
        for s in stop_conditions or []:
            if isinstance(s, str):
                if s:
                    self.stop_strings.append(s)
            elif isinstance(s, int) and not isinstance(s, bool):
                self.stop_tokens.add(s)
            else:
                raise ValueError(f"Job: stop_conditions holds token ids and strings, got {s!r}")
        self.banned_strings = [b for b in (banned_strings or []) if b]
        self.return_logprobs, self.return_top_tokens = bool(return_logprobs), int(return_top_tokens)
        self.constraint, self.identifier = constraint, identifier
        self.ignore_eos, self.decode_special_tokens = ignore_eos, decode_special_tokens
        self.serial = next(_ids)
        # Filled in by the generator.
        self.status = "new"  # new -> waiting -> prefill -> decode -> done
        self.generated: list[int] = []
        self.eos_reason: str | None = None
        self.error: str | None = None  # why the job ended with eos_reason "error"
        self.error_code: str | None = None  # and, when it is the request's to change, a code for it
        self.text = ""  # all text emitted so far

    @property
    def done(self) -> bool:
        return self.status == "done"

    def __repr__(self) -> str:
        ident = f", identifier={self.identifier!r}" if self.identifier is not None else ""
        return f"Job(#{self.serial}, {len(self.input_ids)} prompt tokens, {self.status}{ident})"


@dataclass
class Event:
    """What happened to one job in one `iterate()`: new text and tokens, and on the last event the end reason
    and timings (eos_reason "error": this job failed on its own, e.g. a constraint, and `error` says why).
    Readable as attributes or like a dict (`event["text"]`)."""

    job: Job
    identifier: Any = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[str, float]] | None = None
    eos: bool = False
    eos_reason: str | None = None
    stop_string: str | None = None
    stop_token: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    new_tokens: int | None = None
    time_to_first_token: float | None = None
    time_total: float | None = None
    tokens_per_second: float | None = None
    drafted_tokens: int | None = None
    accepted_draft_tokens: int | None = None
    error: str | None = None  # with eos_reason "error": what went wrong (only this job ended)
    error_code: str | None = None  # set when the request caused it, e.g. "constraint_unsatisfiable"

    def __getitem__(self, key: str):
        return getattr(self, key)

    def get(self, key: str, default=None):
        return getattr(self, key, default)

    def keys(self):
        return [f.name for f in fields(self)]

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.keys() if k != "job"}
