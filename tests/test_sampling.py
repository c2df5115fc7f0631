"""Each sampler against a direct reference computation on small hand-checkable distributions."""

import math

import numpy as np
import pytest
import torch

from exl.generator.sampling import SamplerSettings, SamplerState, draw, process
from exl.generator.speculative import NgramIndex, accept_draft


def dist(logits, settings, context=(), rng_seed=0, mask=None, extra_banned=None, tokenizer=None):
    logits = torch.tensor(logits, dtype=torch.float32)
    state = SamplerState(settings, logits.numel(), tokenizer)
    return process(logits, state, np.asarray(context, dtype=np.int64), torch.Generator().manual_seed(rng_seed),
                   mask=mask, extra_banned=extra_banned)


LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]


def softmax(x):
    return torch.softmax(torch.tensor(x, dtype=torch.float32), 0)


def test_plain_temperature_and_greedy():
    assert torch.allclose(dist(LOGITS, SamplerSettings()), softmax(LOGITS))
    assert torch.allclose(dist(LOGITS, SamplerSettings(temperature=0.5)), softmax([x / 0.5 for x in LOGITS]))
    g = dist(LOGITS, SamplerSettings.greedy())
    assert g.tolist() == [1, 0, 0, 0, 0, 0]


def test_top_k_top_p_min_p():
    p = softmax(LOGITS)
    k = dist(LOGITS, SamplerSettings(top_k=2))
    assert torch.allclose(k, torch.cat([p[:2] / p[:2].sum(), torch.zeros(4)]))
    # top_p: smallest prefix (by probability) whose mass reaches 0.8
    cum = torch.cumsum(p, 0)
    n = int((cum < 0.8).sum()) + 1
    tp = dist(LOGITS, SamplerSettings(top_p=0.8))
    assert (tp > 0).sum() == n and torch.allclose(tp[:n], p[:n] / p[:n].sum())
    mp = dist(LOGITS, SamplerSettings(min_p=0.2))
    keep = p >= 0.2 * p.max()
    assert torch.equal(mp > 0, keep) and torch.allclose(mp[keep], p[keep] / p[keep].sum())


def test_typical():
    p = softmax(LOGITS)
    entropy = -(p * p.log()).sum()
    order = torch.argsort((-p.log() - entropy).abs())
    cum = torch.cumsum(p[order], 0)
    n = int((cum < 0.5).sum()) + 1
    t = dist(LOGITS, SamplerSettings(typical=0.5))
    assert set(torch.nonzero(t).flatten().tolist()) == set(order[:n].tolist())


def test_temperature_last_changes_the_order():
    s_first = SamplerSettings(temperature=3.0, min_p=0.3)
    s_last = SamplerSettings(temperature=3.0, min_p=0.3, temperature_last=True)
    first, last = dist(LOGITS, s_first), dist(LOGITS, s_last)
    # min_p on the sharp distribution keeps fewer tokens; temperature then flattens only those
    assert (last > 0).sum() < (first > 0).sum()
    keep = (softmax(LOGITS) >= 0.3 * softmax(LOGITS).max())
    want = torch.softmax(torch.tensor(LOGITS)[keep] / 3.0, 0)
    assert torch.allclose(last[keep], want)


def test_repetition_frequency_presence_penalties_with_range():
    ctx = [0, 0, 4, 1]  # penalty_range=3 sees [0, 4, 1]
    s = SamplerSettings(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, penalty_range=3)
    want = list(LOGITS)
    for t, count in ((0, 1), (4, 1), (1, 1)):
        x = want[t]
        x = x / 2.0 if x > 0 else x * 2.0
        want[t] = x - 0.5 * count - 0.25
    assert torch.allclose(dist(LOGITS, s, ctx), softmax(want))
    s_all = s.replace(penalty_range=0)
    want_all = list(LOGITS)
    for t, count in ((0, 2), (4, 1), (1, 1)):
        x = want_all[t]
        want_all[t] = (x / 2.0 if x > 0 else x * 2.0) - 0.5 * count - 0.25
    assert torch.allclose(dist(LOGITS, s_all, ctx), softmax(want_all))


def test_dry_penalizes_the_token_that_extends_a_repeat():
    # context: 1 2 3 4 ... 1 2 3 -> continuing with 4 would repeat "1 2 3 4"; the match length is 3
    ctx = [1, 2, 3, 4, 5, 0, 1, 2, 3]
    s = SamplerSettings(dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=2)
    got = dist([0.0] * 6, s, ctx)
    want = [0.0] * 6
    want[4] -= 0.8 * 2.0 ** (3 - 2)
    assert torch.allclose(got, softmax(want))
    # below the allowed length nothing happens
    assert torch.allclose(dist([0.0] * 6, s.replace(dry_allowed_length=4), ctx), softmax([0.0] * 6))


def test_dry_sequence_breakers_stop_the_match():
    class Tok:
        def pieces(self):
            return ["a", "b", "\n", "c", "d", "e"]

    ctx = [0, 1, 2, 3, 4, 0, 1, 2, 3]  # the repeat "0 1 \n 3" is broken at "\n": match length 1 ("3")
    s = SamplerSettings(dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=1)
    got = dist([0.0] * 6, s, ctx, tokenizer=Tok())
    want = [0.0] * 6
    want[4] -= 1.0 * 2.0 ** (1 - 1)
    assert torch.allclose(got, softmax(want))


def test_xtc_removes_top_choices_but_the_least_likely():
    s = SamplerSettings(xtc_probability=1.0, xtc_threshold=0.15)
    p = softmax(LOGITS)
    above = [i for i in range(6) if p[i] >= 0.15]
    assert len(above) >= 2
    got = dist(LOGITS, s)
    keep = [i for i in range(6) if i not in above[:-1]]
    assert set(torch.nonzero(got).flatten().tolist()) == set(keep)
    assert torch.allclose(dist(LOGITS, s.replace(xtc_probability=0.0)), p)


def test_logit_bias_banned_tokens_and_mask():
    s = SamplerSettings(logit_bias={5: 10.0}, banned_tokens=[0])
    want = list(LOGITS)
    want[5] += 10.0
    want[0] = -math.inf
    assert torch.allclose(dist(LOGITS, s), softmax(want))
    mask = torch.tensor([True, True, False, False, False, False])
    m = dist(LOGITS, SamplerSettings(), mask=mask, extra_banned={0})
    assert m.tolist()[1] == pytest.approx(1.0) and m.sum() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="out of range"):
        dist(LOGITS, SamplerSettings(banned_tokens=[99]))


def test_draw_is_reproducible_and_follows_the_distribution():
    p = softmax(LOGITS)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    a = [draw(p, g1) for _ in range(4000)]
    assert a == [draw(p, g2) for _ in range(4000)]
    freq = torch.bincount(torch.tensor(a), minlength=6).float() / len(a)
    assert (freq - p).abs().max() < 0.03
    zero = torch.tensor([0.0, 0.5, 0.0, 0.5])
    assert set(draw(zero, g1) for _ in range(200)) == {1, 3}


@pytest.mark.parametrize("use_q", [True, False])
def test_speculative_acceptance_rule_preserves_the_target_distribution(use_q):
    """Drafting from q (or a fixed proposal) and accepting with min(1, p/q) yields exactly p."""
    p = softmax([1.0, 0.2, -0.5, 0.7, -2.0])
    q = softmax([-1.0, 1.5, 0.3, 0.0, 0.5])
    rng = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    n = 6000
    for _ in range(n):
        d = draw(q, rng) if use_q else 1
        r = accept_draft(p, q if use_q else None, d, False, rng)
        counts[d if r is None else r] += 1
    assert (counts / n - p).abs().max() < 0.025


def test_ngram_index_proposes_the_latest_continuation():
    idx = NgramIndex(max_n=3, min_n=1)
    ids = np.array([5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 4, 5, 6, 7])
    assert idx.propose(ids, 3) == [2, 3, 4]  # the latest earlier "5 6 7" continued with 2 3 4
    assert idx.propose(np.array([1, 2, 3]), 2) == []


@pytest.mark.parametrize("settings", [SamplerSettings.greedy(), SamplerSettings(temperature=0.7, top_p=0.8, min_p=0.05)])
def test_nan_logits_never_let_a_masked_token_through(settings):
    """A NaN logit (a broken model row, or inf - inf in a penalty) must not poison the distribution: softmax would
    turn every probability into NaN and argmax would pick any token, one a constraint forbids included (the
    schemathesis fuzz of /v1/completions once got a 500 that way)."""
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0))
    logits[[3, 40]] = torch.nan
    mask = torch.zeros(64, dtype=torch.bool)
    mask[[5, 7, 40]] = True
    for seed in range(20):
        probs = dist(logits.tolist(), settings, rng_seed=seed, mask=mask)
        assert not torch.isnan(probs).any()
        assert set(torch.nonzero(probs).flatten().tolist()) <= {5, 7}
        assert draw(probs, torch.Generator().manual_seed(seed)) in (5, 7)
