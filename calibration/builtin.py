"""The default calibration corpus: real text and code that every Python installation carries.

Documents, in a seeded random order:

- the docstrings of the standard library's modules, classes and functions (English prose);
- the source code of standard library modules (Python code, comments included);
- chat conversations in the model's own chat template, where the user asks what a standard library
  function does and the assistant answers with its docstring (so the chat tokens are calibrated too).

Excluded: `pydoc_data` (the evaluation text, see `calibration.evaltext`), tests, `idlelib`,
`site-packages` and anything that is not UTF-8. Random-token rows are added by `calibration.rows`.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

EXCLUDED_PARTS = {"pydoc_data", "test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__",
                  "lib2to3", "turtledemo", "ensurepip"}
MAX_SOURCE_CHARS = 2500  # one source document is at most this long (many modules are long)


def stdlib_files() -> list[Path]:
    """The standard library's .py files, sorted (the same list on every run)."""
    import os

    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_PARTS and not d.startswith("test_")]  # prune: never walk
        for name in names:                                                                  # site-packages
            if name.endswith(".py") and not name.startswith("test_"):
                files.append(Path(folder) / name)
    return sorted(files)


def _read(f: Path) -> str | None:
    try:
        return f.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _docstrings(tree: ast.Module, module: str) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) for the module and its classes and functions."""
    doc = ast.get_docstring(tree)
    if doc:
        yield module, doc
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 80:
                yield f"{module}.{node.name}", doc


def documents(seed: int, chat=None) -> Iterator[tuple[str, str]]:
    """Endless stream of (kind, text) documents, kind in {'prose', 'code', 'chat'}.

    chat: a function messages -> text (the model's chat template), or None to skip chat documents.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    if not files:
        raise FileNotFoundError(f"no Python standard library sources under {root}")
    rng = random.Random(seed)
    order = files[:]
    while True:
        rng.shuffle(order)
        for f in order:
            src = _read(f)
            if not src:
                continue
            module = ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            try:
                tree = ast.parse(src)
            except (SyntaxError, ValueError):
                continue
            docs = list(_docstrings(tree, module))
            rng.shuffle(docs)
            for name, doc in docs[:4]:
                yield "prose", doc
            if docs and chat is not None:
                name, doc = docs[0]
                question = rng.choice(["What does `{}` do?", "Explain `{}` briefly.", "How do I use `{}`?"])
                yield "chat", chat([{"role": "user", "content": question.format(name)},
                                    {"role": "assistant", "content": doc}])
            start = rng.randrange(max(1, len(src) - MAX_SOURCE_CHARS)) if len(src) > MAX_SOURCE_CHARS else 0
            yield "code", src[start : start + MAX_SOURCE_CHARS]
