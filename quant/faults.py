"""A test hook to kill a conversion at an exact point, so resume tests need no timing.

`EXL_KILL_BEFORE_COMMIT=<suffix>` makes the process SIGKILL itself right before the file whose path
ends with `<suffix>` is renamed into place: its temporary file is left behind, as after a real kill
during that write. Unset (always, outside tests), it does nothing.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

ENV = "EXL_KILL_BEFORE_COMMIT"


def before_commit(target: Path) -> None:
    suffix = os.environ.get(ENV)
    if suffix and Path(target).as_posix().endswith(suffix):
        os.kill(os.getpid(), signal.SIGKILL)


def clean_tmp(folder: Path, recursive: bool = False) -> None:
    """Remove half-written files (`.NAME.tmp-PID`) that a killed run left in `folder`."""
    folder = Path(folder)
    if folder.is_dir():
        for f in (folder.rglob if recursive else folder.glob)(".*.tmp-*"):
            if f.is_file():
                f.unlink(missing_ok=True)
