"""The one exception type for mistakes a user can fix, and how the entry points report it."""

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
    for a UserError one line on stderr and status 2, for Ctrl-C status 130."""
    try:
        status = main() or 0
    except UserError as e:
        message = str(e).replace("\n", " ")
        print(f"error: {message}", file=sys.stderr)
        status = 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        status = 130
    exit(status)
