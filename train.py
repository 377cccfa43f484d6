"""Train a GPT.

    python train.py --config configs/shakespeare_char.toml [--section.key=value ...]

Settings come from the config tree's defaults, then the TOML file (required), then the command line
(`--section.key=value` or `--section.key value`). A file that sets no train.out_dir trains into
out/ + its name. Continue a stopped run with `--config RUN_DIR/config.toml --train.init_from=resume`.
Ctrl-C or SIGTERM stops the run after the micro-batch in progress, with a checkpoint of the last
finished step and the command that continues it (exit status 128 + the signal's number; under
torchrun within about 2 seconds more, see docs/runs.md); a run stopped before its first step saves
nothing.

Several processes, one per GPU (or CPU processes with gloo), with train.parallelism = ddp or fsdp:

    torchrun --standalone --nproc_per_node=8 train.py --config configs/gpt2_124m_owt.toml
"""

import argparse
from pathlib import Path
from typing import NoReturn

from data.corpus import ensure_prepared
from errors import ArgumentParser, UserError, run_cli
from trainer.config import config_help, load_config, override_keys
from trainer.distributed import World, exit_process
from trainer.loop import Trainer

CONFIGS = Path(__file__).resolve().parent / "configs"
QUICKSTART = "configs/shakespeare_char.toml"


def no_config_message() -> str:
    """Without a config the defaults alone would build GPT-2's size (85M parameters) for 600,000
    steps: not what anyone typing `python train.py` to try it wants. So a config is required, and
    the refusal names the ones shipped and the quickstart."""
    shipped = ", ".join(sorted(path.stem for path in CONFIGS.glob("*.toml")))
    return (
        f"no --config given: choose a config file (shipped in configs/: {shipped}); the quickstart, "
        f"a few minutes on a CPU: python train.py --config {QUICKSTART}"
    )


def main() -> NoReturn:
    parser = ArgumentParser(
        description=__doc__,
        epilog="config keys (section.key, type, default, meaning):\n" + config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--config", help="TOML config file (see configs/); required")
    args, overrides = parser.parse_overrides(override_keys())
    if args.config is None:
        raise UserError(no_config_message())
    cfg = load_config(args.config, overrides)
    world = World.from_env()
    if world.local_rank == 0:  # one process per machine prepares; Trainer waits for it
        ensure_prepared(cfg.data.dataset, cfg.data.data_dir)
    trainer = Trainer(cfg)
    stopped_by = trainer.fit()
    # 128 + signal is the shell's convention for "ended by this signal". Exit while `trainer` still
    # holds the model and its process group: see World.exit.
    world.exit(0 if stopped_by is None else 128 + stopped_by)


if __name__ == "__main__":
    run_cli(main, exit=exit_process)  # under torchrun, World.exit skips the interpreter's shutdown
