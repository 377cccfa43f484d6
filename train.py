"""Train a GPT.

    python train.py --config configs/shakespeare_char.toml [--section.key=value ...]

Settings come from the config tree's defaults, then the TOML file, then the command line
(`--section.key=value` or `--section.key value`). Continue a stopped run with
`--config RUN_DIR/config.toml --train.init_from=resume`.
"""

import argparse

from data.prepare import ensure_prepared
from errors import run_cli
from trainer.config import config_help, load_config
from trainer.loop import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog="config keys (section.key, type, default, meaning):\n" + config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--config", help="TOML config file (see configs/)")
    args, overrides = parser.parse_known_args()
    cfg = load_config(args.config, overrides)
    ensure_prepared(cfg.data.dataset, cfg.data.data_dir)
    Trainer(cfg).fit()


if __name__ == "__main__":
    run_cli(main)
