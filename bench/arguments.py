"""The one place where bench/ scripts check their options, before anything is built or timed.

Each option says what it accepts when it is declared: a count of 1 or more (steps, sizes, repeats;
0 or more where none is a choice, as for warm-up steps), a finite amount above 0 (megabytes, a
budget), a device this machine has (checked as train.device is). A mistake ends the script with
one line, `error: --steps=0 is not allowed (use 1 or more)`, and exit status 2 through run_cli, as
for train.py and sample.py; so do argparse's own complaints (a missing option, a word where a
number belongs, an unknown option with the nearest known one), through errors.ArgumentParser. A
JSON file a script writes its figures to is checked here too, by data/files.py's rule for every
output: new, or an earlier output of the same script, never another file.
"""

import argparse
import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path

from data.files import check_output_file, is_json_object_with, write_output
from errors import ArgumentParser, UserError
from trainer.runtime import resolve_device


class BenchArguments(ArgumentParser):
    """argparse with checked counts, amounts and a device (see the module's docstring)."""

    def __init__(self, description: str):
        super().__init__(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
        self._checks: list[tuple[argparse.Action, Callable[[float], bool], str]] = []
        self._outputs: list[tuple[argparse.Action, tuple[str, ...]]] = []

    def add_count(self, flag: str, *, minimum: int = 1, maximum: int | None = None, **kwargs) -> None:
        """An integer option (a list of them with nargs) from minimum up to maximum (None: no limit)."""
        action = self.add_argument(flag, type=int, **kwargs)
        if maximum is None:
            self._checks.append((action, lambda value: value >= minimum, f"{minimum} or more"))
        else:
            self._checks.append((action, lambda value: minimum <= value <= maximum, f"{minimum} to {maximum}"))

    def add_amount(self, flag: str, **kwargs) -> None:
        """A number option above 0 and finite (NaN fails both comparisons)."""
        action = self.add_argument(flag, type=float, **kwargs)
        self._checks.append((action, lambda value: 0 < value < math.inf, "a finite number above 0"))

    def add_device(self, default: str = "cpu") -> None:
        """--device, as a torch.device: auto, cpu, cuda, cuda:N or mps, one this machine has."""
        self.add_argument(
            "--device",
            default=default,
            type=lambda name: resolve_device(name, key="--device"),
            help=f"auto, cpu, cuda, cuda:N or mps (default: {default})",
        )

    def add_json_output(self, flag: str, keys: Iterable[str], **kwargs) -> None:
        """A JSON file of figures (a Path): new, or an earlier output of this script, which is told by
        its `keys`; checked before anything is timed. Write it with write_json."""
        action = self.add_argument(flag, type=Path, metavar="PATH", **kwargs)
        self._outputs.append((action, tuple(keys)))

    def parse_known_args(self, args=None, namespace=None):  # parse_args calls it too
        parsed, extras = super().parse_known_args(args, namespace)
        for action, accepts, accepted in self._checks:
            value = getattr(parsed, action.dest)
            for item in value if isinstance(value, list) else [value]:
                if item is not None and not accepts(item):
                    raise UserError(f"{action.option_strings[0]}={item} is not allowed (use {accepted})")
        for action, keys in self._outputs:
            path = getattr(parsed, action.dest)
            if path is not None:
                earlier = lambda p, keys=keys: is_json_object_with(p, keys)  # noqa: E731
                check_output_file(path, action.option_strings[0], earlier, f"the figures of an earlier {self.prog}")
        return parsed, extras


def write_json(path: Path, value: dict | list) -> None:
    """A script's figures as JSON, written whole or not at all."""
    write_output(path, json.dumps(value, indent=1).encode("utf-8"))
