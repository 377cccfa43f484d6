"""Writing files so that a crash never leaves a half-written one in place, and locks so that two
processes never write the same files at once."""

import fcntl
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, TextIO


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


class FileLock:
    """An exclusive lock that one process at a time holds: fcntl.flock on a file kept open while it
    is held. The operating system drops the lock when the process ends, however it ends (a crash,
    SIGKILL), so a lock is never left stuck. The file holds the pid and host of its holder, for the
    message of a process that finds it taken; it is removed on release."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.file: TextIO | None = None

    def acquire(self, wait: bool = False) -> str | None:
        """Take the lock and return None; or, without wait, return at once "pid N on HOST" (or "another
        process") of the holder when another process holds it."""
        while True:
            file = open(self.path, "a+", encoding="utf-8")  # created if missing, never truncated before locking
            try:
                fcntl.flock(file, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                file.seek(0)
                holder = file.read().strip()
                file.close()
                return holder or "another process"
            if self._locks_current_file(file):
                break
            file.close()  # the holder removed the file we locked while releasing: lock the one there now
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        file.flush()
        self.file = file
        return None

    def release(self) -> None:
        """Remove the file, then unlock (in that order: a process waiting on the removed file learns
        that it is gone and locks a new one)."""
        if self.file is None:
            return
        self.path.unlink(missing_ok=True)
        self.file.close()
        self.file = None

    def __enter__(self) -> "FileLock":
        self.acquire(wait=True)
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _locks_current_file(self, file: TextIO) -> bool:
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            return False
        opened = os.fstat(file.fileno())
        return (on_disk.st_dev, on_disk.st_ino) == (opened.st_dev, opened.st_ino)
