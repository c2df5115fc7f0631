"""The evaluation text: Python's own documentation topics (`pydoc_data.topics`), held out from calibration.

It is English prose with code examples (the language reference and library topics that `help()`
shows), present in every CPython installation, and the built-in calibration corpus never reads it.
"""

from __future__ import annotations


def eval_text() -> str:
    """All pydoc topics, in sorted order, separated by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def eval_tokens(tokenizer) -> list[int]:
    """The evaluation text as token ids (no special tokens), for `exl.eval.perplexity`."""
    return tokenizer.encode(eval_text(), add_bos=False)
