"""Writing files so that a crash never leaves a half-written one in place."""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


@contextmanager
def atomic_open(path: Path) -> Iterator[BinaryIO]:
    """Open `path` for writing in binary mode; the file appears under its name only once it is
    complete. The bytes go to a temporary file beside it, which is flushed to disk and then renamed
    over `path` (a rename within one filesystem is atomic); the folder is flushed too, so the new
    name survives a power cut. If writing fails (a full disk, a kill), `path` is untouched."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _sync_folder(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _sync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename) to disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
