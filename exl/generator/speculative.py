"""Speculative decoding: propose several tokens cheaply, verify them with one target forward pass.

Proposals come from a draft model (the same family at fewer bits) or from n-gram prompt lookup (the
continuation of the latest earlier occurrence of the last few tokens; free, and very good when the
output copies from the input). Verification uses the standard acceptance rule (Leviathan et al.,
Chen et al.): draft token d with draft probability q(d) is kept with probability min(1, p(d) / q(d)) under
the target distribution p; at the first rejection the replacement is drawn from max(0, p - q)
renormalized; if every draft is kept, one bonus token is drawn from p. The output is distributed
exactly as p. For greedy settings p and q are one-hot, so a draft is kept iff it is the target's argmax
and the output is token for token that of plain greedy decoding.
"""

from __future__ import annotations

import numpy as np
import torch


class NgramIndex:
    """Where each n-gram (n = min_n..max_n) of a token sequence last occurred, for prompt lookup."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.seen: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0  # n-grams ending before this index are recorded

    def update(self, ids: np.ndarray) -> None:
        """Record n-grams that end at positions [indexed, len(ids) - 2] (each has a known continuation)."""
        end = len(ids) - 1
        for e in range(self.indexed, end):
            for n in self.seen:
                if e - n + 1 >= 0:
                    self.seen[n][tuple(ids[e - n + 1 : e + 1].tolist())] = e
        self.indexed = max(self.indexed, end)

    def reset(self) -> None:
        for d in self.seen.values():
            d.clear()
        self.indexed = 0

    def propose(self, ids: np.ndarray, k: int) -> list[int]:
        """Up to k tokens continuing the longest recent n-gram match of the sequence's tail."""
        self.update(ids)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(ids) < n:
                continue
            e = self.seen[n].get(tuple(ids[-n:].tolist()))
            if e is not None:
                return ids[e + 1 : e + 1 + k].tolist()
        return []


def accept_draft(p: torch.Tensor, q: torch.Tensor | None, token: int, greedy: bool, rng: torch.Generator) -> int | None:
    """Verify one draft token. p: target distribution; q: draft distribution (None: a deterministic proposal,
    i.e. one-hot on `token`). Returns None if the draft is accepted, else the replacement token."""
    if greedy:
        best = int(torch.argmax(p))
        return None if best == token else best
    pd = float(p[token])
    qd = 1.0 if q is None else float(q[token])
    u = float(torch.rand((), generator=rng, dtype=torch.float64))
    if qd > 0 and u < min(1.0, pd / qd):
        return None
    if q is None:
        residual = p.clone()
        residual[token] = 0
    else:
        residual = (p - q).clamp_min(0)
    if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p is exact
        residual = p
    from exl.generator.sampling import draw

    return draw(residual / residual.sum(), rng)
