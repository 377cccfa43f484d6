"""Reading text files one way everywhere, writing files so that a crash never leaves a half-written
one in place, locks so that two processes never write the same files at once, and the one rule for
the paths a command writes: nothing it did not write is replaced or removed."""

import fcntl
import json
import os
import re
import secrets
import socket
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, TextIO

from errors import UserError

# How every text file the programs read is decoded (configs, prompt files, corpora, meta.json,
# metrics.jsonl): UTF-8, with a leading byte-order mark, which some Windows editors write, skipped
# rather than read as the character U+FEFF (a token the corpus does not hold, JSON that does not parse)
TEXT_ENCODING = "utf-8-sig"
# bytes of a file's name kept in its temporary name: with the dot, the random part and .tmp, within
# the 255 bytes a name may have on common filesystems
TEMPORARY_STEM_BYTES = 200
# an output file is recognised as an earlier one of its kind by reading it; none of ours is this large
MAX_RECOGNISED_BYTES = 64 << 20


def read_text(path: Path, errors: str = "strict") -> str:
    """A text file's content, decoded as TEXT_ENCODING (errors as for `open`)."""
    return Path(path).read_text(encoding=TEXT_ENCODING, errors=errors)


def read_user_text(path: Path, advice: str = "; save it as UTF-8") -> str:
    """A text file the user gave (a conversation or task file, a model folder's template or config), decoded
    as TEXT_ENCODING; one that is not UTF-8 is a UserError naming the file and its first bad byte, then
    `advice`."""
    try:
        return read_text(path)
    except UnicodeDecodeError as e:
        raise UserError(
            f"{path} is not UTF-8 text: byte {e.start:,} ({e.object[e.start]:#04x}) is {e.reason}{advice}"
        ) from None


# Half of a UTF-16 surrogate pair written as a JSON escape: valid JSON, but no character, so a string
# holding one can be neither encoded as UTF-8 nor tokenized. (A pair, as json.dumps writes an emoji, is fine.)
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def parse_json(text: str, where: str, advice: str = "") -> object:
    """The value of a JSON text the user gave (one line of a .jsonl file, or a whole file), or one
    UserError naming `where` and why it cannot be read (then `advice`, e.g. "; prepare the dataset
    again"): it is not JSON, it is beyond what json reads (beyond_parser), or a string of it holds
    half a surrogate pair."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        at = f"line {e.lineno}, column {e.colno}" if "\n" in text else f"column {e.colno}"
        raise UserError(f"{where} is not valid JSON ({e.msg} at {at}){advice}") from None
    except (RecursionError, ValueError) as e:
        raise UserError(f"{where} is not JSON that can be read: {beyond_parser(e)}{advice}") from None
    if SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise UserError(
                f"{where} holds the escape \\u{ord(e.object[e.start]):04x}, half of a UTF-16 surrogate pair without "
                f"its other half: no character, so not text (write the character itself, or the whole pair){advice}"
            ) from None
    return value


def beyond_parser(e: RecursionError | ValueError) -> str:
    """Why Python's json or tomllib failed on a text that is well formed, in words: they recurse once per
    level of nesting, so a text nested deeper than the interpreter's recursion limit raises RecursionError
    (not their own decoding error), and an integer longer than sys.get_int_max_str_digits() a ValueError."""
    if isinstance(e, RecursionError):
        return f"it is nested deeper than Python's parser follows (about {sys.getrecursionlimit():,} levels)"
    return f"it holds an integer of more than {sys.get_int_max_str_digits():,} digits"


def read_json(path: Path, advice: str = "") -> object:
    """The value of a JSON file the user gave, or one UserError naming it (see read_user_text, parse_json)."""
    return parse_json(read_user_text(path, advice or "; save it as UTF-8"), str(path), advice)


@contextmanager
def atomic_open(path: Path) -> Iterator[BinaryIO]:
    """Open `path` for writing in binary mode; the file appears under its name only once it is
    complete. The bytes go to a temporary file beside it, which is flushed to disk and then renamed
    over `path` (a rename within one filesystem is atomic); the folder is flushed too, so the new
    name survives a power cut. If writing fails (a full disk, a kill), `path` is untouched.

    The temporary file is created exclusively under a fresh name (`.NAME.<random>.tmp`), so it can
    never be a file that was already there: removing it after a failure removes only what this wrote."""
    path = Path(path)
    fd, tmp = _create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _sync_folder(path.parent)
    finally:
        tmp.unlink(missing_ok=True)  # ours alone (created exclusively); gone once renamed


def _create_temporary(path: Path) -> tuple[int, Path]:
    """A new, empty file beside path, created with O_EXCL under a name no file had (permissions as
    `open` gives, after the umask); its descriptor, open for writing, and its path."""
    stem = os.fsdecode(os.fsencode(path.name)[:TEMPORARY_STEM_BYTES])  # leaves room for the suffix
    while True:
        tmp = path.with_name(f".{stem}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue  # a name taken by chance (1 in 4 billion): draw another


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


def check_writable_dir(path: Path, key: str) -> None:
    """Refuse, before any work is done, a folder (existing or to be made) that cannot be written:
    one that is a file or inside one, with a name or path longer than the filesystem allows, or
    under a folder this user may not write. `key` names the setting that gave the path."""
    path = Path(path)
    shown = f"{key}={str(path)!r}"
    existing = Path(path.anchor or ".")  # the deepest folder of path that exists
    missing = False
    for part in path.parts[1:] if path.anchor else path.parts:
        name_max = os.pathconf(existing, "PC_NAME_MAX")
        if len(os.fsencode(part)) > name_max:
            raise UserError(
                f"{shown} holds a name of {len(os.fsencode(part))} bytes, longer than the {name_max} this "
                f"filesystem allows (choose a shorter name)"
            )
        if missing or not (existing / part).exists():
            missing = True  # this part and the ones after it will be made
            continue
        existing = existing / part
        if not existing.is_dir():
            where = "is a file" if existing == path else f"is inside {str(existing)!r}, which is a file"
            raise UserError(f"{shown} {where}, not a directory (choose another {key})")
    path_max = os.pathconf(existing, "PC_PATH_MAX")
    if len(os.fsencode(os.path.abspath(path))) >= path_max:
        raise UserError(f"{shown} is a path longer than the {path_max} bytes this system allows (choose a shorter one)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(
            f"{shown} cannot be written: {str(existing)!r} is read-only for this user (choose another {key}, "
            f"or make it writable)"
        )


def make_dir(path: Path) -> None:
    """Make a folder and its parents; a failure that check_writable_dir could not foresee (a folder
    that cannot hold others, a race, a full disk) is one UserError."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"the folder {str(path)!r} cannot be made ({e.strerror}): choose a place you can write"
        ) from None


# ------------------------------------------------------------------------------------------- inputs
# configs/NAME.toml, shipped with the project, trains into the run directory out/NAME (trainer/config.py)
SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def shipped_run(run_dir: Path) -> str | None:
    """For out/NAME (where the command runs), the run directory of a shipped configs/NAME.toml: what
    makes it, for a message about a run that is not there or has no checkpoint yet; else None."""
    run_dir = Path(os.path.abspath(run_dir))
    if run_dir.parent != Path(os.path.abspath("out")) or not (SHIPPED_CONFIGS / f"{run_dir.name}.toml").is_file():
        return None
    config = f"configs/{run_dir.name}.toml"
    return f"it is the run of {config} (train it first: python train.py --config {config})"


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name


def is_hub_id(value: str) -> bool:
    """owner/name that is not a path on this machine: a model or dataset on the Hugging Face hub."""
    return bool(HUB_ID.match(value)) and not Path(value).exists()


# ------------------------------------------------------------------------------------------- outputs
# The one rule for every path a command writes (docs/bad-inputs.md, "Nothing overwritten or mixed
# up"), checked before any work starts: a file is replaced only when it is an earlier output of the
# same kind, which the user asked for again by naming it; nothing else is written over, renamed
# over or removed.


def check_output_file(
    path: Path, key: str, earlier_output: Callable[[Path], bool], kind: str, inputs: Iterable[Path] = ()
) -> None:
    """Refuse, before any work, a file output that is a directory, a file the command reads
    (`inputs`), or an existing file that `earlier_output` does not recognise as one of its kind (an
    earlier output, described by `kind`, e.g. "a results file of eval.py"). `key` names the option."""
    path = Path(path)
    shown = f"{key}={str(path)!r}"
    if path.is_dir():
        raise UserError(f"{shown} is a directory, not a file (give the name of a file to write)")
    check_writable_dir(path.parent, f"{key}'s folder")
    if not os.path.lexists(path):
        return
    if any(_same_file(path, source) for source in inputs):
        raise UserError(f"{shown} is a file this command reads, which its output would replace (choose another {key})")
    if not earlier_output(path):
        raise UserError(
            f"{shown} already exists and is not {kind}: it is never replaced (choose another {key}, or remove "
            f"the file yourself)"
        )


def check_output_folder(folder: Path, key: str, names: Iterable[str]) -> None:
    """Refuse, before any work, a folder output that cannot be written or already holds anything
    under one of `names`, the files the command would write there: those are never replaced."""
    folder = Path(folder)
    check_writable_dir(folder, key)
    held = sorted({name for name in names if os.path.lexists(folder / name)})
    if held:
        them = "it" if len(held) == 1 else "them"
        raise UserError(
            f"{key}={str(folder)!r} already holds {', '.join(held)}, where this writes its files: nothing there "
            f"is replaced (choose a new or empty folder, or move {them} away yourself)"
        )


def write_output(path: Path, content: bytes) -> None:
    """Write a file output that check_output_file accepted: its folder made if missing, the bytes
    written whole or not at all."""
    make_dir(Path(path).parent)
    with atomic_open(Path(path)) as f:
        f.write(content)


def is_json_object_with(path: Path, keys: Iterable[str]) -> bool:
    """Whether path holds a JSON object with (at least) these keys: how an earlier JSON output of a
    command is told from any other file."""
    try:
        if Path(path).stat().st_size > MAX_RECOGNISED_BYTES:
            return False
        value = read_json(path)
    except (OSError, UserError):
        return False
    return isinstance(value, dict) and set(keys) <= set(value)


def _same_file(path: Path, other: Path) -> bool:
    try:
        return os.path.samefile(path, other)
    except OSError:
        return False
