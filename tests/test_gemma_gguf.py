"""Gemma 3 GGUF import (Gemma-3-270M Q4_K_M) against transformers, and chat that stops on <end_of_turn>."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

IDS = [[2, 9259, 1902, 236888, 669, 3823]]  # <bos>Hello world! The quick
TEXTS = [
    "Hello world! The quick brown fox, 1234 emoji 🤖 and  spaces\n\ttab <start_of_turn>user",
    " leading space, Grüße aus München — ça va? Привет, мир! 你好，世界。\n\n\n  indented   3.14159 1,000,000",
    "<table><tr>x</tr></table> <end_of_turn>\r\n naïve café \u00a0nbsp\u200bzw",
]


def test_gemma3_config(gemma3_dir):
    config = json.loads((gemma3_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"], config["vocab_size"]) == (18, 640, 256, 262144)
    assert config["layer_types"].count("full_attention") == 3 and config["layer_types"][5] == "full_attention"
    assert (config["rope_theta"], config["rope_local_base_freq"], config["sliding_window"]) == (1e6, 1e4, 512)
    generation = json.loads((gemma3_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 106]  # <eos>, <end_of_turn>


def test_gemma3_logits_match_transformers(gemma3_dir):
    """exl's Gemma 3 on the imported folder == transformers' Gemma 3 on the same folder (float32)."""
    from exl.loading import load_model

    ids = torch.tensor(IDS)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref_model(ids).logits
    del ref_model
    got = load_model(gemma3_dir, progress=False)(ids)
    got = got if torch.is_tensor(got) else got.logits
    assert torch.allclose(got, expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_gemma3_chat_stops_on_end_of_turn(gemma3_dir):
    """A chat turn through exl's Generator ends at <end_of_turn> (106), an EOS id of the imported folder.

    gemma-3-270m is the base (pretrained) model: greedy, it never picks <end_of_turn> on its own (transformers
    gives the same tokens), so a grammar makes the reply "Hello!" followed by token 106; the job must stop there.
    """
    from exl.generator.constraints import GrammarConstraint
    from exl.generator.job import Job
    from exl.generator.sampling import SamplerSettings
    from exl.loading import load_model
    from exl.simple import make_generator
    from exl.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(gemma3_dir)
    assert tok.eos_token_ids == [1, 106]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hello in one word."}])
    assert prompt == "<bos><start_of_turn>user\nSay hello in one word.<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(prompt, add_bos=False)
    assert ids[:3] == [2, 105, 2364] and ids[-5:] == [106, 107, 105, 4368, 107]  # <bos><start_of_turn>user ... model\n
    generator = make_generator(load_model(gemma3_dir, progress=False), tok, len(ids) + 16)
    job = Job(ids, max_new_tokens=12, sampler=SamplerSettings.greedy(),
              constraint=GrammarConstraint(tok, 'start: "Hello!" <[106]>'))
    generator.enqueue(job)
    events = []
    while not job.done:
        events.extend(generator.iterate())
    assert (events[-1].eos_reason, events[-1].stop_token) == ("stop_token", 106)
    assert "".join(e.text or "" for e in events) == "Hello!"


@pytest.mark.slow
def test_gemma3_import_matches_transformers_gguf_loader(gemma3_gguf, gemma3_dir):
    """transformers' own GGUF loader (dequantizes, subtracts 1 from norms): same logits and same token ids."""
    from tokenizers import Tokenizer

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name, dtype=torch.float32).eval()
    ours = transformers.AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    ours_state = ours.state_dict()
    for name, tensor in ref.state_dict().items():
        assert torch.equal(ours_state[name], tensor), name
    ids = torch.tensor(IDS)
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)

    ref_tok = transformers.AutoTokenizer.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name)
    our_tok = Tokenizer.from_file(str(gemma3_dir / "tokenizer.json"))
    for text in TEXTS:
        expected = ref_tok(text)["input_ids"]
        assert our_tok.encode(text).ids == expected, text
        assert our_tok.decode(expected[1:], skip_special_tokens=False) == ref_tok.decode(expected[1:]), text
