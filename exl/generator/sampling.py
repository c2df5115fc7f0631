"""Token samplers: turn one position's logits into a probability distribution, then draw from it.

`process` applies, in order: logit bias, banned / masked tokens, repetition / frequency / presence
penalties over the last `penalty_range` tokens, DRY, then (unless greedy) temperature, top-k, top-p,
min-p, typical, XTC (temperature after the truncations when `temperature_last`). It returns the final
distribution as probabilities; `draw` picks a token from it with an exponential race driven by a
`torch.Generator`, so a seed reproduces a run bit for bit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class SamplerSettings:
    """How to pick the next token. The defaults sample from the model's plain distribution (temperature 1).

    temperature: 0 means greedy (argmax). top_k: 0 off. top_p, typical: 1.0 off. min_p: 0 off.
    repetition_penalty (1.0 off; > 1 discourages), frequency_penalty / presence_penalty (0 off) look at the
    last `penalty_range` tokens (prompt included; 0 = all). DRY (dry_multiplier > 0) penalizes a token that
    would extend a repeat of an earlier sequence longer than dry_allowed_length: multiplier * base^(len -
    allowed); dry_sequence_breakers stop the match; dry_range limits how far back (0 = all).
    XTC: with probability xtc_probability, drop every token above xtc_threshold except the least likely one.
    logit_bias: {token id: added logit}. banned_tokens: ids never sampled.
    temperature_last: apply temperature after the truncation samplers instead of before.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_range: int = 1024
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: list[str] = field(default_factory=lambda: ["\n", ":", '"', "*"])
    dry_range: int = 0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    logit_bias: dict[int, float] | None = None
    banned_tokens: list[int] | None = None
    temperature_last: bool = False

    @classmethod
    def greedy(cls, **kw) -> "SamplerSettings":
        return cls(temperature=0.0, **kw)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0 or self.top_k == 1

    def replace(self, **kw) -> "SamplerSettings":
        return dataclasses.replace(self, **kw)

    def validate(self) -> None:
        """Raise ValueError naming the first setting out of range."""
        checks = [
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_k", self.top_k >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("typical", 0 < self.typical <= 1, "in (0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("penalty_range", self.penalty_range >= 0, ">= 0"),
            ("dry_multiplier", self.dry_multiplier >= 0, ">= 0"),
            ("dry_base", self.dry_base >= 1, ">= 1"),
            ("dry_allowed_length", self.dry_allowed_length >= 0, ">= 0"),
            ("dry_range", self.dry_range >= 0, ">= 0"),
            ("xtc_probability", 0 <= self.xtc_probability <= 1, "in [0, 1]"),
            ("xtc_threshold", 0 <= self.xtc_threshold <= 1, "in [0, 1]"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"SamplerSettings.{name}={getattr(self, name)!r}: must be {rule}")


class SamplerState:
    """Per-job data derived once from the settings and the tokenizer (DRY breaker ids, bias tensors)."""

    def __init__(self, settings: SamplerSettings, vocab: int, tokenizer=None, device="cpu"):
        settings.validate()
        self.s, self.vocab = settings, vocab
        self.bias_ids = self.bias_vals = None
        if settings.logit_bias:
            ids = [int(k) for k in settings.logit_bias]
            bad = [i for i in ids if not 0 <= i < vocab]
            if bad:
                raise ValueError(f"SamplerSettings.logit_bias: token ids {bad[:5]} out of range [0, {vocab})")
            self.bias_ids = torch.tensor(ids, device=device)
            self.bias_vals = torch.tensor([float(settings.logit_bias[k]) for k in settings.logit_bias], device=device)
        self.banned = None
        if settings.banned_tokens:
            bad = [i for i in settings.banned_tokens if not 0 <= int(i) < vocab]
            if bad:
                raise ValueError(f"SamplerSettings.banned_tokens: token ids {bad[:5]} out of range [0, {vocab})")
            self.banned = torch.tensor([int(i) for i in settings.banned_tokens], device=device)
        self.breakers: set[int] = set()
        if settings.dry_multiplier > 0 and tokenizer is not None:
            pieces = tokenizer.pieces()
            for i, p in enumerate(pieces):
                if any(b in p for b in settings.dry_sequence_breakers):
                    self.breakers.add(i)


def _penalties(logits: torch.Tensor, context: np.ndarray, s: SamplerSettings) -> None:
    if s.repetition_penalty == 1.0 and s.frequency_penalty == 0.0 and s.presence_penalty == 0.0:
        return
    recent = context[-s.penalty_range :] if s.penalty_range else context
    if len(recent) == 0:
        return
    ids, counts = np.unique(recent, return_counts=True)
    ids_t = torch.from_numpy(ids).to(logits.device)
    vals = logits[ids_t]
    if s.repetition_penalty != 1.0:
        vals = torch.where(vals > 0, vals / s.repetition_penalty, vals * s.repetition_penalty)
    vals = vals - s.frequency_penalty * torch.from_numpy(counts).to(vals) - s.presence_penalty
    logits[ids_t] = vals


def _dry(logits: torch.Tensor, context: np.ndarray, s: SamplerSettings, breakers: set[int]) -> None:
    """DRY: for each earlier occurrence of the last token, the repeat length ending there predicts the token
    that followed it; penalize that token by multiplier * base^(length - allowed_length)."""
    ctx = context[-s.dry_range :] if s.dry_range else context
    n = len(ctx)
    if n < 2 or int(ctx[-1]) in breakers:
        return
    best: dict[int, int] = {}
    for i in np.flatnonzero(ctx[:-1] == ctx[-1]):
        nxt = int(ctx[i + 1])
        if nxt in breakers:
            continue
        length = 1
        while length <= i and ctx[i - length] == ctx[n - 1 - length] and int(ctx[i - length]) not in breakers:
            length += 1
        if length > best.get(nxt, 0):
            best[nxt] = length
    for tok, length in best.items():
        if length >= s.dry_allowed_length:
            logits[tok] -= s.dry_multiplier * s.dry_base ** (length - s.dry_allowed_length)


def _truncate(probs: torch.Tensor, s: SamplerSettings, rng: torch.Generator) -> torch.Tensor:
    """Apply top-k, top-p, min-p, typical and XTC to a distribution (returns unnormalized probabilities)."""
    if s.top_k > 0 and s.top_k < probs.numel():
        kth = torch.topk(probs, s.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if s.top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sp, 0) / sp.sum()
        drop = (cum - sp / sp.sum()) >= s.top_p  # tokens entirely beyond the top_p mass
        probs = probs.scatter(0, idx[drop], 0.0)
    if s.min_p > 0.0:
        probs = torch.where(probs >= s.min_p * probs.max(), probs, 0.0)
    if s.typical < 1.0:
        p = probs / probs.sum()
        logp = torch.log(p.clamp_min(1e-30))
        entropy = -(p * logp).sum()
        dev = torch.where(p > 0, (-logp - entropy).abs(), torch.inf)
        order = torch.argsort(dev)
        cum = torch.cumsum(p[order], 0)
        keep_n = int(torch.searchsorted(cum, torch.tensor(s.typical, dtype=cum.dtype))) + 1
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[:keep_n]] = True
        probs = torch.where(mask, probs, 0.0)
    if s.xtc_probability > 0.0:
        if float(torch.rand((), generator=rng)) < s.xtc_probability:
            p = probs / probs.sum()
            above = torch.nonzero(p >= s.xtc_threshold).flatten()
            if above.numel() >= 2:
                keep = above[torch.argmin(p[above])]
                drop = above[above != keep]
                probs = probs.scatter(0, drop, 0.0)
    return probs


def process(logits: torch.Tensor, state: SamplerState, context: np.ndarray, rng: torch.Generator | None,
            mask: torch.Tensor | None = None, extra_banned=None) -> torch.Tensor:
    """The final distribution over the vocabulary ([V] float32, sums to 1) for one position.

    logits: [V'] raw logits (V' >= state.vocab; ids past the tokenizer's vocabulary are never sampled).
    context: every token id before this position (prompt included). mask: bool [V], False = not allowed
    (a constraint, or stop tokens held back by min_new_tokens). extra_banned: more ids to exclude here.
    Greedy settings give a one-hot distribution on the argmax.
    """
    s = state.s
    x = logits[: state.vocab].float().clone()
    if state.bias_ids is not None:
        x.index_add_(0, state.bias_ids, state.bias_vals)
    _penalties(x, context, s)
    if s.dry_multiplier > 0:
        _dry(x, context, s, state.breakers)
    if state.banned is not None:
        x[state.banned] = -torch.inf
    if extra_banned:
        x[torch.tensor(list(extra_banned), dtype=torch.long, device=x.device)] = -torch.inf
    x = torch.nan_to_num(x, nan=-torch.inf)  # a NaN (from the logits or inf - inf in a penalty) would poison softmax
    if mask is not None:  # and let argmax pick any token, one the constraint forbids included
        x = x.masked_fill(~mask[: state.vocab], -torch.inf)
    if not torch.isfinite(x).any():
        x = torch.zeros_like(x) if mask is None else torch.where(mask[: state.vocab], 0.0, -torch.inf)
    if s.is_greedy:
        out = torch.zeros_like(x)
        out[torch.argmax(x)] = 1.0
        return out
    if not s.temperature_last:
        x = x / s.temperature
    probs = _truncate(torch.softmax(x, 0), s, rng)
    if s.temperature_last:
        keep = probs > 0
        x = torch.where(keep, x / s.temperature, -torch.inf)
        return torch.softmax(x, 0)
    return probs / probs.sum()


def draw(probs: torch.Tensor, rng: torch.Generator) -> int:
    """A token from `probs` by an exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) drawn from rng, which picks
    token i with probability exactly p_i (deterministic per seed). Unlike inverse CDF over a cumulative sum (where
    rounding differences pile up across the whole vocabulary), a last-bit change in the probabilities, such as
    logits of a cached vs an uncached prefill or of another batch shape, only changes the choice when the two
    leading contenders tie to that precision, so such reruns almost always draw the same token."""
    e = -torch.log(torch.rand(probs.shape, generator=rng, dtype=torch.float64))  # u == 0 gives inf: never wins
    return int(torch.argmax(probs.double() / e))


def sample(probs: torch.Tensor, greedy: bool, rng: torch.Generator) -> int:
    return int(torch.argmax(probs)) if greedy else draw(probs, rng)
