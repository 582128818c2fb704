"""The log folders of local runs (`afd up`, `afd generate`): one per run, and only the newest few of
finished runs kept, so that /tmp does not fill with `afd-local-*` folders.

A run holds an advisory lock on its folder's `.lock` file while it lives (the kernel drops it when the
process ends, however it ends), so pruning never touches the folder of a run still going, in this
process or another. Folders of older versions have no lock file: they count as finished.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "afd-local-"
KEEP = 5  # folders of finished runs kept besides the running ones (afd up --help and the README say so)
LOCK = ".lock"


class LogFolder:
    """A fresh `afd-local-*` folder under `root` (the temp folder), locked until `release`; making one
    prunes the folders of finished runs beyond the newest `keep`."""

    def __init__(self, root: str | Path | None = None, keep: int = KEEP):
        self.root = Path(root or tempfile.gettempdir())
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=self.root))
        self._lock = open(self.path / LOCK, "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # blocking: a pruner may test it this very moment
        prune(self.root, keep, spare=self.path)

    def release(self) -> None:
        """The run is over: its folder may be pruned by later runs."""
        self._lock.close()


def in_use(folder: Path) -> bool:
    """True while the run that made `folder` holds its lock."""
    try:
        handle = open(folder / LOCK)
    except OSError:  # no lock file: an older version's folder, or one vanishing now
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def prune(root: Path, keep: int = KEEP, spare: Path | None = None) -> list[Path]:
    """Remove this user's `afd-local-*` folders of finished runs under `root` beyond the newest `keep`
    (by modification time); `spare` (the caller's own) is never removed. Returns those removed."""
    finished = []
    for folder in root.glob(PREFIX + "*"):
        try:
            stat = folder.stat()
        except OSError:
            continue
        if folder != spare and folder.is_dir() and stat.st_uid == os.getuid() and not in_use(folder):
            finished.append((stat.st_mtime, folder))
    finished.sort(reverse=True)
    removed = [folder for _, folder in finished[keep:]]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    return removed
