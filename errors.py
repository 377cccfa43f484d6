"""The one exception type for mistakes a user can fix, and how the entry points report it."""

import errno
import sys
from collections.abc import Callable
from typing import NoReturn


class UserError(Exception):
    """A mistake the user can fix: a config value, a missing file, a checkpoint that does not fit,
    a prompt the tokenizer cannot encode. The message names the thing, the value received and what
    would be accepted."""


class ConfigError(UserError):
    """A config file or command-line override that cannot be used."""


def run_cli(main: Callable[[], int | None], exit: Callable[[int], NoReturn] = sys.exit) -> NoReturn:
    """Run an entry point and end the process with exit(status): main's own status (None is 0), or
    for a UserError or a file system error one line on stderr and status 2, for Ctrl-C status 130."""
    try:
        status = main() or 0
    except UserError as e:
        message = str(e).replace("\n", " ")
        print(f"error: {message}", file=sys.stderr)
        status = 2
    except OSError as e:
        # The file system said no where no check could have said it earlier (a disk that fills while a
        # file is written, a path the system will not take): every write goes through a temporary file
        # renamed into place, so nothing is left half-written, and the user gets the one line.
        print(f"error: {_file_system_message(e)}", file=sys.stderr)
        status = 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        status = 130
    exit(status)


def _file_system_message(e: OSError) -> str:
    where = f"{e.filename}: " if e.filename else ""
    if e.errno == errno.ENOSPC:
        return f"{where}the disk is full: free some space (or choose a folder on another disk) and run again"
    if e.errno == errno.ENAMETOOLONG:
        return f"{where}the name is too long for the file system: choose a shorter path"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{where}permission denied: choose a path you can read and write"
    reason = e.strerror or str(e)
    return f"{where}{reason}: check the path and the disk, then run again"
