"""Calibration rows: a [rows, length] tensor of token ids from the built-in corpus or a user dataset."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from exl.errors import ExlError

BUILTIN = "builtin"


class CalibrationError(ExlError):
    """Calibration data is missing, unreadable or too small."""


def random_row_count(rows: int) -> int:
    """How many of the built-in rows are uniformly random tokens (1 in 12)."""
    return rows // 12


def _fill(texts: Iterable[str], tokenizer, n_tokens: int) -> tuple[list[int], int]:
    """Concatenate tokenized texts (blank line between) until n_tokens; returns (ids, texts used)."""
    sep = tokenizer.encode("\n\n", add_bos=False, add_eos=False)
    ids: list[int] = []
    used = 0
    for text in texts:
        if not text or not text.strip():
            continue
        ids.extend(tokenizer.encode(text, add_bos=False, add_eos=False))
        ids.extend(sep)
        used += 1
        if len(ids) >= n_tokens:
            break
    return ids[:n_tokens], used


def builtin_rows(tokenizer, rows: int, length: int, seed: int) -> tuple[torch.Tensor, dict]:
    from calibration import builtin

    n_random = random_row_count(rows)
    n_text = rows - n_random
    def render(messages):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=False)

    chat = render if getattr(tokenizer, "chat_template", None) else None
    docs = (text for _, text in builtin.documents(seed, chat))
    ids, used = _fill(docs, tokenizer, n_text * length)
    text = torch.tensor(ids, dtype=torch.long).view(n_text, length)
    g = torch.Generator().manual_seed(seed)
    rand = torch.randint(0, tokenizer.vocab_size, (n_random, length), generator=g)
    out = torch.cat([text, rand]) if n_random else text
    return out, {"source": BUILTIN, "rows": rows, "length": length, "random_rows": n_random,
                 "documents": used, "seed": seed}


def _load_dataset(path: Path):
    import datasets

    datasets.disable_progress_bars()
    kinds = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text", ".csv": "csv"}
    try:
        if path.is_dir():
            if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
                ds = datasets.load_from_disk(str(path))
                if isinstance(ds, datasets.DatasetDict):
                    ds = ds["train"] if "train" in ds else ds[sorted(ds)[0]]
                return ds
            files = sorted(f for f in path.rglob("*") if f.suffix in kinds or f.suffix == ".arrow")
            if not files:
                raise CalibrationError(f"{path}: no dataset files (parquet, jsonl, json, txt, csv, arrow) in this folder")
            return datasets.concatenate_datasets([_load_dataset(f) for f in files])
        if path.suffix == ".arrow":
            return datasets.Dataset.from_file(str(path))
        if path.suffix not in kinds:
            raise CalibrationError(f"{path}: unknown calibration file type {path.suffix!r}; use parquet, jsonl, "
                                   "json, txt, csv, arrow or a folder saved with datasets' save_to_disk")
        return datasets.load_dataset(kinds[path.suffix], data_files=str(path), split="train")
    except CalibrationError:
        raise
    except Exception as e:  # datasets raises many kinds of errors for bad files
        raise CalibrationError(f"{path}: cannot read calibration data ({type(e).__name__}: {e})") from e


def text_column(ds, path, column: str | None) -> str:
    names = list(ds.column_names)
    if column:
        if column not in names:
            raise CalibrationError(f"{path}: no column {column!r}; columns are {names}")
        return column
    if "text" in names:
        return "text"
    for name in names:
        if getattr(ds.features[name], "dtype", None) in ("string", "large_string"):
            return name
    raise CalibrationError(f"{path}: no text column among {names}; name one with --calibration-column")


def user_rows(path: str | Path, tokenizer, rows: int, length: int, seed: int,
              column: str | None = None) -> tuple[torch.Tensor, dict]:
    path = Path(path)
    if not path.exists():
        raise CalibrationError(f"calibration data {path} does not exist")
    ds = _load_dataset(path)
    col = text_column(ds, path, column)
    order = list(range(len(ds)))
    random.Random(seed).shuffle(order)

    def texts() -> Iterator[str]:
        for i in order:
            value = ds[i][col]
            if isinstance(value, str):
                yield value

    need = rows * length
    ids, used = _fill(texts(), tokenizer, need)
    if len(ids) < need:
        raise CalibrationError(
            f"{path}: column {col!r} holds {len(ids)} tokens, but {rows} rows x {length} tokens = {need} are needed. "
            f"Lower the rows (-cr) or row length (-cl), or add more text.")
    return torch.tensor(ids, dtype=torch.long).view(rows, length), {
        "source": str(path.resolve()), "column": col, "rows": rows, "length": length, "random_rows": 0,
        "documents": used, "seed": seed}


def calibration_rows(spec: str | None, tokenizer, rows: int, length: int, seed: int = 0,
                     column: str | None = None) -> tuple[torch.Tensor, dict]:
    """Token ids [rows, length] and a JSON-able description of where they came from."""
    if rows < 1 or length < 16:
        raise CalibrationError(f"calibration needs at least 1 row of 16 tokens (got {rows} x {length})")
    if spec in (None, "", BUILTIN):
        return builtin_rows(tokenizer, rows, length, seed)
    return user_rows(spec, tokenizer, rows, length, seed, column)


def describe(info: dict) -> str:
    src = "built-in corpus (Python docstrings, code, chat)" if info["source"] == BUILTIN else info["source"]
    extra = f", {info['random_rows']} random-token rows" if info.get("random_rows") else ""
    return f"{src}: {info['rows']} rows x {info['length']} tokens{extra}"
