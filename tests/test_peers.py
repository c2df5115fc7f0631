"""bench/quality.py --peers without the peer tools: the stored-bit count of a peer row, the grid check on its
dequantized weights, and the evaluation folder made from them."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


peer = _load("peer_quantize", ROOT / "bench" / "peers" / "quantize.py")


def test_stored_bits_counts_codes_scales_zeros_and_padded_groups():
    # GPTQ 4-bit, symmetric, group 64, a 576-wide row: 9 groups, one float16 scale each
    assert peer.stored_bits(1, 576, 4, 64) == 576 * 4 + 9 * 16
    assert peer.stored_bits(1536, 576, 4, 64) / (1536 * 576) == 4.25
    assert peer.stored_bits(576, 1536, 3, 64) / (576 * 1536) == 3.25
    # HQQ: float16 scale and zero per group
    assert peer.stored_bits(10, 576, 4, 64, zero_bits=16) / 5760 == 4.5
    # AutoRound at group 128: 576 = 4.5 groups, the tool pads to 5 (one scale each), codes for the real weights
    assert peer.stored_bits(1, 576, 4, 128) == 576 * 4 + 5 * 16
    assert peer.stored_bits(1, 1536, 4, 128) == 1536 * 4 + 12 * 16
    # the whole SmolLM2 decoder at AutoRound 4-bit g128: q,k,v,o,gate,up at 576 in, down at 1536 in
    h, kv, f, layers = 576, 192, 1536, 30
    mats = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]
    bits = layers * sum(peer.stored_bits(r, c, 4, 128) for r, c in mats)
    elems = layers * sum(r * c for r, c in mats)
    rows_576 = h + kv + kv + h + f + f  # matrices 576 wide: 5 groups per row; down_proj: 12 per row
    assert bits == layers * (rows_576 * (576 * 4 + 5 * 16) + h * (1536 * 4 + 12 * 16))
    assert 4.125 < bits / elems < 4 + 5 * 16 / 576


def _grid(rows=8, cols=200, bits=3, group=64, sym=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = math.ceil(cols / group)
    scale = torch.rand(rows, n, generator=g) + 0.1
    if sym:
        q = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (rows, n * group), generator=g).double()
        zero = None
        w = q.view(rows, n, group) * scale.double()[..., None]
    else:
        zero = torch.rand(rows, n, generator=g) * 2 ** bits
        q = torch.randint(0, 2 ** bits, (rows, n * group), generator=g).double()
        w = (q.view(rows, n, group) - zero.double()[..., None]) * scale.double()[..., None]
    return w.reshape(rows, -1)[:, :cols].float(), scale, zero


@pytest.mark.parametrize("sym", [True, False])
def test_check_on_grid_accepts_dequantized_and_rejects_float_weights(sym):
    w, scale, zero = _grid(sym=sym)
    peer.check_on_grid("m", w, scale, zero, 3, 64)  # short last group (200 = 3 x 64 + 8) included
    with pytest.raises(ValueError, match="not on the tool's grid"):
        peer.check_on_grid("m", w + 0.2 * scale[0, 0], scale, zero, 3, 64)
    with pytest.raises(ValueError, match="levels in a group"):
        peer.check_on_grid("m", w, scale, zero, 2, 64)  # 8 levels do not fit 2 bits


def test_peer_eval_folder_replaces_decoder_weights_only(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    quality = _load("quality_bench", ROOT / "bench" / "quality.py")
    rot, out = tmp_path / "rot", tmp_path / "peer"
    rot.mkdir()
    out.mkdir()
    g = torch.Generator().manual_seed(1)
    names = [f"model.layers.0.{m}.weight" for m in peer.DECODER]
    tensors = {n: torch.randn(4, 8, generator=g) for n in names}
    tensors |= {"model.embed_tokens.weight": torch.randn(16, 8, generator=g) * 1.001,
                "lm_head.weight": torch.randn(16, 8, generator=g), "model.norm.weight": torch.ones(8)}
    save_file(tensors, str(rot / "model.safetensors"))
    (rot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    new = {n: torch.full((4, 8), float(i)) for i, n in enumerate(names)}
    save_file(dict(list(new.items())[:-1]), str(out / "weights.safetensors"))
    with pytest.raises(quality.PeerError, match="1 decoder matrices missing"):
        quality.peer_eval_folder(rot, out)
    save_file(new, str(out / "weights.safetensors"))
    folder = quality.peer_eval_folder(rot, out)
    got = load_file(str(folder / "model.safetensors"))
    for n in names:
        assert torch.equal(got[n], new[n])
    assert torch.equal(got["lm_head.weight"], tensors["lm_head.weight"])
    assert torch.equal(got["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"].half().float())
    assert not torch.equal(got["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert (folder / "config.json").is_file()


def test_peer_record_keeps_earlier_rows_and_is_used_only_with_the_same_evaluation(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    quality = _load("quality_bench", ROOT / "bench" / "quality.py")
    monkeypatch.setattr(quality, "PEER_RECORD", tmp_path / "peers.json")
    setup = {"windows": 12, "ctx": 512, "threads": 2, "load": (1.0, 1.0, 1.0)}
    ref = dict(kind="reference", label="exl float32", bpw=32.0, ppl=14.849, kld=0.0)
    gptq = dict(kind="peer", label="gptq-4b-g64", tool="gptq", bits=4, group=64, bpw=4.25, ppl=16.4, kld=0.114,
                version="llmcompressor 0.14", seconds=4101.0, peer_threads=2)
    quality.save_peer_record({"setup": setup, "rows": [ref, gptq, dict(kind="exl scalar", label="scalar-4.25",
                                                                     target=4.25, bpw=4.25, ppl=15.7, kld=0.07)]})
    ar = dict(gptq, label="autoround-4b-g128", tool="autoround", group=128, bpw=4.1389, kld=0.0977, seconds=2258.0)
    quality.save_peer_record({"setup": setup, "rows": [ref, ar, dict(gptq, kld=0.2, recorded="2026-01-01")]})
    rec = json.loads((tmp_path / "peers.json").read_text())
    assert [r["label"] for r in rec["rows"]] == ["scalar-4.25", "autoround-4b-g128", "gptq-4b-g64"]
    assert next(r for r in rec["rows"] if r["label"] == "gptq-4b-g64")["kld"] == 0.114  # a recorded row is not rewritten
    quality.save_peer_record({"setup": dict(setup, load=(9.0, 9.0, 9.0)), "rows": [ref, ar]})  # evaluated again
    assert json.loads((tmp_path / "peers.json").read_text()) == rec  # the same result keeps its date and load

    got = [r for r in quality.recorded_rows(setup, 14.8491) if r["label"] == "gptq-4b-g64"]
    assert len(got) == 1 and got[0]["kld"] == 0.114 and got[0]["recorded"] == rec["rows"][0]["date"]
    assert quality.recorded_rows(setup, 15.2) == []  # another reference: another model
    assert quality.recorded_rows(dict(setup, windows=4), 14.849) == []

    trellis = dict(kind="exl trellis", label="trellis-4.1389", target=4.1389, bpw=4.1387, ppl=15.5, kld=0.05)
    rows = [ref, ar, *got, *[r for r in quality.recorded_rows(setup, 14.849) if r["label"] == "scalar-4.25"], trellis]
    text = quality.peers_markdown({"setup": setup, "rows": rows})
    line = next(x for x in text.splitlines() if x.startswith("| gptq-4b-g64"))
    assert "*recorded" in line and "| 0.0700 | 0.61 |" in line and "trellis-4.1389 (4.139): 0.0500 | 0.44 |" in line
    line = next(x for x in text.splitlines() if x.startswith("| autoround-4b-g128 |"))
    assert "trellis-4.1389 (4.139): 0.0500 | 0.51 |" in line


def test_peer_rows_reuse_a_saved_measurement_only_when_it_was_made_with_their_options(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    quality = _load("quality_bench", ROOT / "bench" / "quality.py")
    from quant.options import QuantOptions

    path = tmp_path / "measurement.json"
    assert quality.reusable_measurement(path, {"codes": "scalar"}) is None  # none saved
    path.write_text(json.dumps({"version": 2, "layers": [], "options": QuantOptions().measurement_key()}))
    assert QuantOptions().codes != "scalar"  # the default measurement prices trellis settings too
    assert quality.reusable_measurement(path, {"codes": "scalar"}) is None
    assert quality.reusable_measurement(path, {}) == path
    path.write_text(json.dumps({"version": 2, "layers": [], "options": QuantOptions(codes="scalar").measurement_key()}))
    assert quality.reusable_measurement(path, {"codes": "scalar"}) == path
