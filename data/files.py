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
    over `path` (a rename within one filesystem is atomic). If writing fails, `path` is untouched."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
