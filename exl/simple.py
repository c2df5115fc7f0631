"""The convenience API: a prompt in, text out. A thin wrapper over the dynamic generator (exl.generator),
which is exl's one generation path: the same paged cache, sampler and seeds as `exl generate`, `exl chat`,
`exl bench` and `exl serve`, so one seed gives the same tokens through every door.

    text = generate(model, tokenizer, "The capital of France is", max_new_tokens=16)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from exl.generator import Event, Generator, Job, PagedCache, SamplerSettings

PAGE_SIZE = 256  # tokens per cache page, as in `exl serve`
CHUNK_SIZE = 2048  # prompt tokens per forward pass, as in `exl serve`


def sampler(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> SamplerSettings:
    """Sampler settings from the command line's three knobs (temperature 0: greedy)."""
    return SamplerSettings(temperature=temperature, top_k=top_k, top_p=top_p)


def make_generator(model, tokenizer, max_tokens: int, *, cache_mode: str = "auto", max_batch_size: int = 1,
                   **kwargs) -> Generator:
    """A Generator over a new paged cache of at least `max_tokens` tokens (whole pages). cache_mode: "auto" (fp16 on
    the CPU, else the model's dtype; as `exl serve` by default), "fp32", "fp16", "q8", "q6", "q4" or "q8k4v"."""
    from exl.cache.paged import cache_bits

    k_bits, v_bits = cache_bits(cache_mode, model.device)
    cache = PagedCache(model, max_tokens=max_tokens, page_size=PAGE_SIZE, k_bits=k_bits, v_bits=v_bits)
    kwargs.setdefault("max_chunk_size", CHUNK_SIZE)
    return Generator(model, cache, tokenizer, max_batch_size=max_batch_size, **kwargs)


@dataclass
class Stats:
    """What one generation did, from the generator's final event."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys/values were already in the cache (prefix reuse)
    new_tokens: int = 0  # a stop token included
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = ""
    token_ids: list[int] = field(default_factory=list)  # generated tokens, the stop token excluded

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens computed by this generation (the rest came from the cache)."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def decode_tps(self) -> float:
        return (self.new_tokens - 1) / self.decode_seconds if self.new_tokens > 1 and self.decode_seconds else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    def record(self, ev: Event) -> None:
        self.prompt_tokens, self.cached_tokens, self.new_tokens = ev.prompt_tokens, ev.cached_tokens, ev.new_tokens
        self.prefill_seconds = ev.time_to_first_token or 0.0
        self.decode_seconds = (ev.time_total or 0.0) - self.prefill_seconds
        self.stop_reason = ev.eos_reason


def stream(model, tokenizer, input_ids: list[int], max_new_tokens: int = 128, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop_ids=None,
           stats: Stats | None = None, generator: Generator | None = None) -> Iterator[str]:
    """Yield text chunks as tokens are generated (UTF-8 safe). Fills `stats` if given.

    stop_ids: token ids that end the generation (default: the tokenizer's EOS ids). generator: run on this
    Generator (its cache keeps earlier prompts for reuse, as `exl chat` does); default: a new one sized for
    this prompt. Generation stops at the model's context length ("context_full").
    """
    stats = stats if stats is not None else Stats()
    room = model.config.max_position_embeddings - len(input_ids)
    if room < 1:
        raise ValueError(f"the prompt ({len(input_ids)} tokens) fills the model's context "
                         f"({model.config.max_position_embeddings} tokens)")
    n = min(max_new_tokens, room)
    if generator is None:
        generator = make_generator(model, tokenizer, len(input_ids) + n)
    job = Job(input_ids, max_new_tokens=n, sampler=sampler(temperature, top_k, top_p), seed=seed,
              stop_conditions=None if stop_ids is None else [int(t) for t in stop_ids],
              ignore_eos=stop_ids is not None)
    generator.enqueue(job)
    try:
        while not job.done:
            for ev in generator.iterate():
                if ev.job is not job:
                    continue
                stats.token_ids.extend(ev.token_ids)
                if ev.text:
                    yield ev.text
                if ev.eos:
                    stats.record(ev)
                    if ev.eos_reason == "error":
                        raise RuntimeError(f"generation failed: {ev.error}")
    finally:
        if not job.done:  # the caller stopped early: free the job's pages
            generator.cancel(job)
    if stats.stop_reason == "max_new_tokens" and n < max_new_tokens:
        stats.stop_reason = "context_full"


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 128, **kwargs) -> str:
    """Complete a prompt (no chat template) and return the new text."""
    return "".join(stream(model, tokenizer, tokenizer.encode(prompt), max_new_tokens, **kwargs))
