"""The one exception type for mistakes a user can fix, and how the entry points report it: in one
`error:` line, for a command line argparse cannot read too."""

import argparse
import difflib
import errno
import importlib.util
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn


class UserError(Exception):
    """A mistake the user can fix: a config value, a missing file, a checkpoint that does not fit,
    a prompt the tokenizer cannot encode. The message names the thing, the value received and what
    would be accepted."""


class ConfigError(UserError):
    """A config file or command-line override that cannot be used."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse for every entry point (train.py, sample.py, eval.py, plot.py, data/prepare.py and
    bench/): its complaints are a UserError, so one `error:` line and exit status 2 with no usage
    text; an option it does not know is named with the nearest it does (`unrecognized option
    --max-tokens (did you mean --max-new-tokens?)`); and an option spelled with underscores where
    its name has dashes (`--max_new_tokens`, as config keys are spelled) is that option."""

    def parse_known_args(self, args=None, namespace=None):  # parse_args calls it too
        self._given = self._dashed(sys.argv[1:] if args is None else list(args))
        return super().parse_known_args(self._given, namespace)

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.refuse(extras, parsed)
        return parsed

    def parse_overrides(self, keys: Iterable[str], args=None) -> tuple[argparse.Namespace, list[str]]:
        """The options, and the `--section.key=value` overrides left for the config loader; any other
        option is refused, named with the nearest of this parser's options and keys (the overrides'
        spellings, `--section.key`)."""
        parsed, extras = self.parse_known_args(args)
        unknown = [arg for arg in extras if arg.startswith("--") and "." not in arg.partition("=")[0]]
        if unknown:
            self.refuse(unknown, parsed, keys)
        return parsed, extras

    def refuse(self, extras: list[str], parsed: argparse.Namespace, keys: Iterable[str] = ()) -> NoReturn:
        """End with one line naming the arguments not understood: each option with the nearest one
        this parser (and the subcommand chosen) or keys take; a bare word only if no option is among
        them (after an unknown option it is that option's value)."""
        known = [*self._known_options(parsed), *keys]
        options = [arg.partition("=")[0] for arg in extras if arg.startswith("-")]
        if not options:
            raise UserError(f"unexpected argument {extras[0]!r} (see {self.prog} --help for the options)")
        named, suggested = [], False
        for option in options:
            close = difflib.get_close_matches(option.replace("_", "-"), known, n=1) or difflib.get_close_matches(
                option, known, n=1
            )
            named.append(option + (f" (did you mean {close[0]}?)" if close else ""))
            suggested = suggested or bool(close)
        plural = "s" if len(named) > 1 else ""
        see = "" if suggested else f" (see {self.prog} --help)"
        raise UserError(f"unrecognized option{plural} {', '.join(named)}{see}")

    def error(self, message: str) -> NoReturn:
        # a required option "missing" because it was misspelt (--datset): name the misspelling instead
        if message.startswith("the following arguments are required") and self._subparsers is None:
            unknown = [arg for arg in self._given if self._is_unknown_option(arg)]
            if unknown:
                self.refuse(unknown, argparse.Namespace())
        raise UserError(message)

    def _is_unknown_option(self, arg: str) -> bool:
        """An --option this parser takes neither whole nor abbreviated, nor a --section.key override."""
        name = arg.partition("=")[0]
        if not name.startswith("--") or "." in name or name in self._option_string_actions:
            return False
        return not (self.allow_abbrev and any(option.startswith(name) for option in self._option_string_actions))

    def _dashed(self, args: list[str]) -> list[str]:
        """args with each --name_with_underscores that is not an option but whose dashed spelling
        is, in that spelling; nothing after `--`, which ends the options."""
        result = list(args)
        for i, arg in enumerate(args):
            if arg == "--":
                break
            name, equals, value = arg.partition("=")
            dashed = "--" + name[2:].replace("_", "-")
            known = self._option_string_actions
            if arg.startswith("--") and name not in known and dashed in known:
                result[i] = dashed + equals + value
        return result

    def _known_options(self, parsed: argparse.Namespace) -> list[str]:
        options = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(parsed, action.dest, None))
                if isinstance(chosen, ArgumentParser):
                    options += chosen._known_options(parsed)
        return options


def text_argument(value: str) -> str:
    """argparse's type for an option whose value is text (a prompt, a message): Python keeps the bytes of
    an argument that are not UTF-8 as lone surrogates, which no tokenizer encodes, so such a value is
    refused, naming the first one."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise argparse.ArgumentTypeError(
            f"{value!r:.60} is not UTF-8 text: character {e.start} ({value[e.start]!r}) stands for a byte that is not "
            f"UTF-8 (give the text in UTF-8)"
        ) from None
    return value


def run_cli(main: Callable[[], int | None], exit: Callable[[int], NoReturn] = sys.exit) -> NoReturn:
    """Run an entry point and end the process with exit(status): main's own status (None is 0), or
    for a UserError, a file system error or a third-party package that is not installed one line on
    stderr and status 2, for Ctrl-C status 130."""
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
    except ModuleNotFoundError as e:
        missing = (e.name or "").partition(".")[0]
        # a module of this project's own, or a part of an installed package: not an installation to mend
        if not missing or missing in PROJECT_MODULES or importlib.util.find_spec(missing) is not None:
            raise
        print(f"error: {_missing_package_message(missing)}", file=sys.stderr)
        status = 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        status = 130
    exit(status)


# the top-level modules of this checkout: its commands and the folders of Python files beside them
PROJECT_MODULES = tuple(
    sorted(
        path.stem
        for path in Path(__file__).resolve().parent.iterdir()
        if path.suffix == ".py" or (path.is_dir() and any(path.glob("*.py")))
    )
)
# third-party modules whose package has another name, and those that come with one of pyproject.toml's
# optional extras rather than with the dependencies
PIP_NAMES = {"lm_eval": "lm-eval", "llama_cpp": "llama-cpp-python"}
EXTRAS = {"lm_eval": "eval", "accelerate": "eval", "llama_cpp": "llama", "transformers": "test", "peft": "test"}


def _missing_package_message(module: str) -> str:
    """What to install when an import that only some commands make fails (gguf for --export-gguf,
    datasets for preparing a hub dataset, wandb for logging to it): the package, and the one command
    that installs it with the rest."""
    package = PIP_NAMES.get(module, module)
    extra = EXTRAS.get(module)
    project = f'pip install -e ".[{extra}]"' if extra else "pip install -e ."
    return (
        f"this needs the Python package {package}, which is not installed here: "
        f"pip install {package} (or {project} in the checkout)"
    )


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
