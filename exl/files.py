"""File permissions: files we write get the mode the user's umask gives any new file."""

from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    """The process umask, read without changing it (Linux), else by setting and restoring it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def public_mode(path: str | os.PathLike) -> None:
    """Give a file the mode open() would (0666 minus the umask: 0644 usually); for writers that make 0600 files."""
    os.chmod(path, 0o666 & ~umask())
