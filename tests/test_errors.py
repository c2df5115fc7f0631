"""Bad model folders give a clear error naming the file and the problem (and exit code 2 in the CLI)."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import exl
from exl.errors import ModelLoadError, UnsupportedModelError
from test_models import make_model


@pytest.fixture
def tiny(tmp_path):
    _, path = make_model(tmp_path, "llama")
    return path


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        exl.load_model(tmp_path)


def test_not_a_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="not a folder"):
        exl.load_model(tmp_path / "nope")


def test_invalid_json(tiny):
    (tiny / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: not valid JSON"):
        exl.load_model(tiny)


def test_unknown_architecture(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["architectures"] = ["FancyNetForCausalLM"]
    (tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"'FancyNetForCausalLM' is not supported.*LlamaForCausalLM"):
        exl.load_model(tiny)


def test_exl_format_version_this_exl_cannot_read(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "exl", "version": 9}
    (tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"quantization_config\.version is 9; this exl reads exl format versions 1, 2, 3"):
        exl.load_model(tiny)
    cfg["quantization_config"] = {"quant_method": "gptq", "version": 9}  # another tool's: not ours to judge
    (tiny / "config.json").write_text(json.dumps(cfg))
    exl.load_model(tiny)


def test_no_weights(tiny):
    (tiny / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        exl.load_model(tiny)


def test_missing_tensor(tiny):
    sd = load_file(tiny / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, tiny / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        exl.load_model(tiny)


def test_misshaped_tensor(tiny):
    sd = load_file(tiny / "model.safetensors")
    sd["model.layers.2.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(sd, tiny / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight' has shape \(16, 64\), expected \(32, 64\)"):
        exl.load_model(tiny)


def test_truncated_safetensors(tiny):
    f = tiny / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*truncated or corrupt"):
        exl.load_model(tiny)


def test_index_lists_missing_shard(tiny):
    (tiny / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors, which is missing"):
        exl.load_model(tiny)


def test_cli_reports_error_and_exit_code(tmp_path):
    out = subprocess.run([sys.executable, "-m", "exl.cli", "generate", "-m", str(tmp_path), "-p", "hi"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "error:" in out.stderr and "Traceback" not in out.stderr


def test_cli_bad_argument_value(tiny):
    out = subprocess.run([sys.executable, "-m", "exl.cli", "generate", "-m", str(tiny), "-p", "hi", "--top-p", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--top-p must be in (0, 1]" in out.stderr
