"""Single-stream generation with a contiguous KV cache: greedy or temperature/top-k/top-p sampling.

The dynamic generator (exl.generator) serves many streams with a paged cache; this is the small,
dependable path behind `exl generate` and `exl chat` when one stream is all that is needed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from exl.cache.contiguous import KVCache


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> int:
    """One token id from logits [vocab]. temperature 0 means greedy."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix reaching top_p
        logits[order[drop]] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = ""
    token_ids: list[int] = field(default_factory=list)

    @property
    def decode_tps(self) -> float:
        return (self.new_tokens - 1) / self.decode_seconds if self.new_tokens > 1 and self.decode_seconds else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0


def stream(model, tokenizer, input_ids: list[int], max_new_tokens: int = 128, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop_ids=None,
           stats: Stats | None = None) -> Iterator[str]:
    """Yield text chunks as tokens are generated (UTF-8 safe). Fills `stats` if given."""
    from exl.tokenizer import StreamDecoder

    stats = stats if stats is not None else Stats()
    stop = set(tokenizer.eos_token_ids if stop_ids is None else stop_ids)
    limit = min(model.config.max_position_embeddings, len(input_ids) + max_new_tokens)
    cache = KVCache(model.config, batch=1, max_len=limit, dtype=model.dtype, device=model.device)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    decoder = StreamDecoder(tokenizer)
    ids = torch.tensor([input_ids], device=model.device)
    stats.prompt_tokens = len(input_ids)
    t0 = time.perf_counter()
    logits = model(ids, cache=cache, last_only=True)[0, -1]
    stats.prefill_seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    stats.stop_reason = "max_new_tokens"
    for _ in range(max_new_tokens):
        token = sample(logits.cpu(), temperature, top_k, top_p, gen)
        stats.new_tokens += 1
        if token in stop:
            stats.stop_reason = "stop_token"
            break
        stats.token_ids.append(token)
        text = decoder.feed(token)
        if text:
            yield text
        if cache.length >= cache.max_len:
            stats.stop_reason = "context_full"
            break
        logits = model(torch.tensor([[token]], device=model.device), cache=cache)[0, -1]
    stats.decode_seconds = time.perf_counter() - t1
    rest = decoder.flush()
    if rest:
        yield rest


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 128, **kwargs) -> str:
    """Complete a prompt (no chat template) and return the new text."""
    return "".join(stream(model, tokenizer, tokenizer.encode(prompt), max_new_tokens, **kwargs))
