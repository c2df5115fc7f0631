"""Calibration data for the quantizer, and the held-out evaluation text.

- `builtin`: the default corpus, built offline from the Python installation (docstrings, source code,
  chat-formatted docstring questions) plus a few random-token rows.
- `user`: a user's dataset (parquet, jsonl, txt, arrow or a saved `datasets` folder).
- `evaltext`: the evaluation text (Python's `pydoc_data` topics), never used for calibration.

`calibration_rows(spec, tokenizer, rows, length, seed)` is the one entry point the converter uses.
"""

from calibration.rows import CalibrationError, calibration_rows, describe

__all__ = ["CalibrationError", "calibration_rows", "describe"]
