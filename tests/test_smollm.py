"""The real model end to end: SmolLM2-135M-Instruct imported from its GGUF, against transformers."""

import json
import math
import subprocess
import sys

import pytest
import torch
import transformers

import exl
from exl.eval import perplexity, windows
from exl.simple import generate
from exl.tokenizer import Tokenizer

pytestmark = pytest.mark.kernels  # the real model on the compiled kernels; CI runs these under a second torch too


def eval_text() -> str:
    """Held-out evaluation text: the Python docs' topic pages (not used for calibration)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


@pytest.fixture(scope="module")
def ours(smollm_dir):
    return exl.load_model(smollm_dir, progress=False)


@pytest.fixture(scope="module")
def theirs(smollm_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    return Tokenizer.from_dir(smollm_dir)


def test_greedy_continuation_matches_transformers(ours, theirs, tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name three primary colors."}])
    ids = tokenizer.encode(prompt, add_bos=False)
    with torch.no_grad():
        want = theirs.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    want = [t for t in want if t not in tokenizer.eos_token_ids]
    text = generate(ours, tokenizer, prompt, max_new_tokens=24)
    assert tokenizer.encode(text, add_bos=False) == want[: len(tokenizer.encode(text, add_bos=False))]
    assert text == tokenizer.decode(want)
    assert len(text) > 10


def test_logits_match_transformers(ours, theirs, tokenizer):
    ids = torch.tensor([tokenizer.encode(eval_text()[:3000], add_bos=False)[:256]])
    with torch.no_grad():
        want = theirs(ids).logits
    got = ours(ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_perplexity_matches_transformers(ours, theirs, tokenizer):
    tokens = tokenizer.encode(eval_text(), add_bos=False, special=False)
    result = perplexity(ours, tokens, ctx=256, max_windows=2, progress=False)
    nll, count = 0.0, 0
    for w in windows(tokens, 256, 2):
        with torch.no_grad():
            out = theirs(w[None], labels=w[None])  # mean NLL over tokens 2..ctx
        nll += out.loss.item() * 255
        count += 255
    assert result["tokens"] == count and result["windows"] == 2
    assert abs(result["ppl"] / math.exp(nll / count) - 1) < 1e-3
    assert 5 < result["ppl"] < 60


def test_kld_of_model_with_itself_is_zero(ours, tokenizer):
    tokens = tokenizer.encode(eval_text()[:20000], add_bos=False, special=False)
    r = perplexity(ours, tokens, ctx=64, max_windows=2, ref_model=ours, progress=False)
    assert abs(r["kld"]) < 1e-6


def test_eval_cli_json(smollm_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(eval_text()[:30000])
    out = subprocess.run([sys.executable, "-m", "exl.cli", "eval", "ppl", "-m", str(smollm_dir), "--text", str(text),
                          "--ctx", "128", "--max-windows", "2", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["windows"] == 2 and result["tokens"] == 2 * 127 and result["kld"] is None
    assert 1 < result["ppl"] < 100


def test_generate_cli(smollm_dir):
    out = subprocess.run([sys.executable, "-m", "exl.cli", "generate", "-m", str(smollm_dir), "--chat",
                          "-p", "What is the capital of France?", "--max-new-tokens", "12"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
