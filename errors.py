"""The one exception type for mistakes a user can fix, and how the entry points report it."""

import sys
from collections.abc import Callable


class UserError(Exception):
    """A mistake the user can fix: a config value, a missing file, a checkpoint that does not fit,
    a prompt the tokenizer cannot encode. The message names the thing, the value received and what
    would be accepted."""


class ConfigError(UserError):
    """A config file or command-line override that cannot be used."""


def run_cli(main: Callable[[], None]) -> None:
    """Run an entry point: a UserError becomes one line on stderr and exit status 2, Ctrl-C exit 130."""
    try:
        main()
    except UserError as e:
        message = str(e).replace("\n", " ")
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
