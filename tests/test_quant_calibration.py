"""Calibration data: the built-in corpus (deterministic, held out from the evaluation text), user
datasets in every supported format, and clear errors for bad data."""

import json
import random

import pytest
import torch

from calibration import CalibrationError, calibration_rows
from calibration.builtin import documents, stdlib_files
from calibration.evaltext import eval_text
from calibration.rows import random_row_count


class CharTokenizer:
    """One token per character (enough to test row building without a model)."""

    vocab_size = 512
    chat_template = "x"

    def encode(self, text, add_bos=False, add_eos=False):
        return [min(ord(c), 511) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=False):
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>\n" for m in messages)


TOK = CharTokenizer()


def test_builtin_rows_are_deterministic_and_mixed():
    a, info = calibration_rows(None, TOK, 24, 256, seed=5)
    b, _ = calibration_rows("builtin", TOK, 24, 256, seed=5)
    c, _ = calibration_rows(None, TOK, 24, 256, seed=6)
    assert a.shape == (24, 256) and a.dtype == torch.long and torch.equal(a, b) and not torch.equal(a, c)
    assert info["random_rows"] == random_row_count(24) == 2 and info["source"] == "builtin"
    text = "".join(TOK.decode(r.tolist()) for r in a[:-2])
    assert "def " in text and "<assistant>" in text  # code and chat rows
    words = sum(text.count(w) for w in (" the ", " of ", " is "))
    assert words > 20  # prose


def test_builtin_corpus_is_held_out_from_the_evaluation_text():
    assert not any("pydoc_data" in f.parts for f in stdlib_files())
    text = eval_text()
    assert len(text) > 100_000
    rng = random.Random(0)
    checked = 0
    for _, (kind, doc) in zip(range(300), documents(0, None)):
        if len(doc) < 300:
            continue
        for _ in range(3):
            a = rng.randrange(len(doc) - 120)
            assert doc[a : a + 120] not in text
            checked += 1
    assert checked > 300


def _texts(n=60):
    rng = random.Random(1)
    return [" ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(40)) for _ in range(n)]


@pytest.mark.parametrize("fmt", ["jsonl", "txt", "parquet", "arrow", "saved", "csv"])
def test_user_datasets(tmp_path, fmt):
    import datasets

    texts = _texts()
    ds = datasets.Dataset.from_dict({"id": list(range(len(texts))), "body": texts})
    if fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(texts)))
    elif fmt == "txt":
        path = tmp_path / "d.txt"
        path.write_text("\n".join(texts))
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        ds.to_parquet(str(path))
    elif fmt == "csv":
        path = tmp_path / "d.csv"
        ds.to_csv(str(path))
    elif fmt == "arrow":
        ds.save_to_disk(str(tmp_path / "saved"))
        path = next((tmp_path / "saved").glob("*.arrow"))
    else:
        path = tmp_path / "saved"
        ds.save_to_disk(str(path))
    ids, info = calibration_rows(str(path), TOK, 4, 128, seed=0)
    assert ids.shape == (4, 128) and info["random_rows"] == 0
    assert info["column"] == ("text" if fmt == "txt" else "body")
    words = set(TOK.decode(ids.flatten().tolist()).split())
    assert words <= {"alpha", "beta", "gamma", "delta", ""} | {w for w in words if len(w) < 5}


def test_user_dataset_errors(tmp_path):
    path = tmp_path / "small.jsonl"
    path.write_text(json.dumps({"text": "tiny"}) + "\n")
    with pytest.raises(CalibrationError, match="tokens, but 4 rows x 128"):
        calibration_rows(str(path), TOK, 4, 128)
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text(json.dumps({"a": 1}) + "\n")
    with pytest.raises(CalibrationError, match="no text column"):
        calibration_rows(str(numbers), TOK, 1, 16)
    with pytest.raises(CalibrationError, match="no column 'nope'"):
        calibration_rows(str(path), TOK, 1, 16, column="nope")
    with pytest.raises(CalibrationError, match="does not exist"):
        calibration_rows(str(tmp_path / "missing.parquet"), TOK, 1, 16)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not a parquet file")
    with pytest.raises(CalibrationError, match="cannot read"):
        calibration_rows(str(bad), TOK, 1, 16)
    with pytest.raises(CalibrationError, match="unknown calibration file type"):
        calibration_rows(str(_touch(tmp_path / "d.xml")), TOK, 1, 16)
    with pytest.raises(CalibrationError, match="at least 1 row"):
        calibration_rows(None, TOK, 0, 128)


def _touch(p):
    p.write_text("<x/>")
    return p
