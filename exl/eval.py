"""Perplexity and KL-divergence over fixed windows of a text — the judge of every quantization.

Definition (so results compare across tools): tokenize the whole text once without special
tokens, cut it into consecutive non-overlapping windows of `ctx` tokens (drop the remainder),
keep the first `max_windows`, and average the negative log-likelihood (and the KL-divergence
KL(P_ref ‖ P_model)) over tokens 2..ctx of every window.
"""

from __future__ import annotations

import math

import torch
from tqdm import tqdm


def windows(tokens, ctx: int, max_windows: int | None = None) -> torch.Tensor:
    """[n_windows, ctx] consecutive non-overlapping windows; the remainder is dropped."""
    tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
    n = tokens.numel() // ctx
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"the text has {tokens.numel()} tokens, fewer than one window of {ctx}")
    return tokens[: n * ctx].view(n, ctx)


def next_token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """[batch, len - 1, vocab] float32 log-probabilities of each next token given the ones before it."""
    return torch.log_softmax(model(ids)[:, :-1].float(), dim=-1)


@torch.inference_mode()
def prompt_logprobs(model, ids: list[int], top_k: int = 0) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """For tokens 2..n of `ids`: the log-probability of each given the ones before it (the numbers `perplexity`
    averages), and the `top_k` most likely tokens at each position as (id, logprob)."""
    if len(ids) < 2:
        return [], []
    logp = next_token_logprobs(model, torch.tensor([ids], dtype=torch.long))[0]
    target = torch.tensor(ids[1:], dtype=torch.long, device=logp.device)
    chosen = logp.gather(-1, target[:, None])[:, 0].tolist()
    if top_k <= 0:
        return chosen, [[] for _ in chosen]
    values, indices = logp.topk(top_k, dim=-1)
    tops = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    return chosen, tops


@torch.inference_mode()
def perplexity(model, tokens, ctx: int = 512, max_windows: int | None = None, ref_model=None,
               batch_size: int = 1, progress: bool = True) -> dict:
    """{'ppl', 'kld' (None without ref_model), 'tokens', 'windows', 'nll'} over the text's windows."""
    w = windows(tokens, ctx, max_windows)
    nll_sum, kld_sum, count = 0.0, 0.0, 0
    bar = tqdm(range(0, len(w), batch_size), desc="eval", unit="window", disable=not progress, leave=False)
    for i in bar:
        ids = w[i : i + batch_size]
        logp = next_token_logprobs(model, ids)
        target = ids[:, 1:].to(logp.device)
        nll_sum += -logp.gather(-1, target[..., None]).sum().item()
        if ref_model is not None:
            ref = torch.log_softmax(ref_model(ids)[:, :-1].float(), dim=-1).to(logp.device)
            kld_sum += (ref.exp() * (ref - logp)).sum().item()
        count += target.numel()
        bar.set_postfix(ppl=f"{math.exp(nll_sum / count):.3f}")
    return {
        "ppl": math.exp(nll_sum / count),
        "nll": nll_sum / count,
        "kld": kld_sum / count if ref_model is not None else None,
        "tokens": count,
        "windows": len(w),
        "ctx": ctx,
    }
