"""Train a GPT.

    python train.py --config configs/shakespeare_char.toml [--section.key=value ...]

Settings come from the config tree's defaults, then the TOML file, then the command line
(`--section.key=value` or `--section.key value`). Continue a stopped run with
`--config RUN_DIR/config.toml --train.init_from=resume`. Ctrl-C or SIGTERM stops the run after the
step in progress with a checkpoint (exit status 128 + the signal's number; under torchrun within
about 2 seconds more, see docs/runs.md).

Several processes, one per GPU (or CPU processes with gloo), with train.parallelism = ddp or fsdp:

    torchrun --standalone --nproc_per_node=8 train.py --config configs/gpt2_124m_owt.toml
"""

import argparse
from typing import NoReturn

from data.prepare import ensure_prepared
from errors import run_cli
from trainer.config import config_help, load_config
from trainer.distributed import World
from trainer.loop import Trainer


def main() -> NoReturn:
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog="config keys (section.key, type, default, meaning):\n" + config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--config", help="TOML config file (see configs/)")
    args, overrides = parser.parse_known_args()
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
    run_cli(main, exit=World.from_env().exit)  # under torchrun, World.exit skips the interpreter's shutdown
