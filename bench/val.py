"""Finished runs' loss over a whole split, on the same windows for every run.

    python bench/val.py out/run_a out/run_b [--stride 16] [--split val]

The trainer's evaluation averages train.eval_iters random batches (20 in the quickstart: 15,360
characters), drawn with the run's own seed. That is cheap enough to repeat during training, but it
is a small sample, and a different one for each seed: two runs of one config at two seeds can
differ by several hundredths on it even when their models are equally good. This scores the same
metric (the mean loss over the targets of block_size windows, with the run's training objective)
on windows starting every --stride tokens of the whole split, the same windows for every run, so
runs compare on their models alone. A chat dataset's windows start where each conversation starts,
whatever --stride, and their targets are the trained tokens alone, as in training; a split none of
whose windows holds one is refused, as a mean over nothing. It prints, per run, the trainer's last
val loss and this one, and this one in bits per byte (the loss in bits over the split's UTF-8 bytes
per token), which compares runs on datasets of different tokenizers. Runs on the CPU.
"""

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arguments import BenchArguments  # noqa: E402
from data.loader import TRAINED, TokenDataset  # noqa: E402
from errors import UserError, run_cli  # noqa: E402
from inference.load import model_from_checkpoint  # noqa: E402
from trainer.checkpoint import CHECKPOINT_NAME, load_checkpoint  # noqa: E402
from trainer.config import config_from_dict  # noqa: E402
from trainer.metrics import METRICS_NAME, read_metrics  # noqa: E402
from trainer.objective import Objective  # noqa: E402

WINDOWS_PER_BATCH = 256
OBJECTIVE_SEED = 0  # the prefix lengths of a prefix-LM run: the same for every run
STRIDE = 16  # tokens between window starts, unless --stride says otherwise


def parse_args() -> argparse.Namespace:
    parser = BenchArguments(__doc__)
    parser.add_argument("runs", nargs="+", help="run directories (each with a checkpoint)")
    parser.add_argument("--split", choices=["val", "train"], default="val", help="which split (default: val)")
    parser.add_count(
        "--stride", default=STRIDE, help=f"tokens between window starts (default: {STRIDE}; not for chat data)"
    )
    return parser.parse_args()


@torch.no_grad()
def split_loss(
    model, objective: Objective, dataset: TokenDataset, split: str, block_size: int, stride: int
) -> tuple[float, int]:
    """Mean loss over the targets of windows of block_size tokens starting every stride tokens (a chat
    dataset's: at every conversation, its trained tokens the targets), and the number of windows."""
    tokens = torch.from_numpy(dataset.tokens(split).astype("int64"))
    chat_starts = dataset.window_starts(split, block_size)  # None for text
    if chat_starts is None:
        starts = torch.arange(0, len(tokens) - block_size, stride)
    else:
        starts = torch.from_numpy(chat_starts)
        trained = torch.from_numpy(dataset.mask(split) & TRAINED).bool()
    if len(starts) == 0:
        raise UserError(f"the split holds {len(tokens)} tokens, too few for one window of {block_size + 1}")
    offsets = torch.arange(block_size)
    total, counted = 0.0, 0
    for batch in starts.split(WINDOWS_PER_BATCH):
        index = batch[:, None] + offsets  # (B, block_size)
        x, y = tokens[index], tokens[index + 1]
        if chat_starts is not None:
            y = y.masked_fill(~trained[index + 1], -1)  # as RandomWindows: untrained tokens are no target
        x, y, prefix = objective(x, y)
        _, loss = model(x, y, prefix=prefix)
        count = int((y != -1).sum())  # the model's loss is the mean over these
        total += loss.item() * count
        counted += count
    if counted == 0:
        raise UserError(
            f"no window of the {split} split of {dataset.directory} holds a trained token: its loss would be a "
            f"mean over nothing (prepare the dataset again with a --block-size that keeps the replies)"
        )
    return total / counted, len(starts)


def score_run(run: Path, split: str, stride: int) -> dict:
    """A finished run's whole-split loss (split_loss) with its step, the trainer's last loss on the split
    (None if it logged none), the loss in bits per byte and the number of windows."""
    path = run / CHECKPOINT_NAME
    checkpoint = load_checkpoint(path)
    model, _ = model_from_checkpoint(checkpoint, path)
    cfg = config_from_dict(checkpoint["config"], source=str(path))
    dataset = TokenDataset(Path(cfg.data.data_dir) / cfg.data.dataset)
    objective = Objective(cfg.model, OBJECTIVE_SEED)
    loss, windows = split_loss(model, objective, dataset, split, cfg.model.block_size, stride)
    metrics = run / METRICS_NAME
    records = read_metrics(metrics) if metrics.is_file() else []
    evaluated = [r[f"{split}_loss"] for r in records if f"{split}_loss" in r]
    return dict(
        step=checkpoint["step"],
        trainer_loss=evaluated[-1] if evaluated else None,
        loss=loss,
        bits_per_byte=loss / math.log(2) / dataset.bytes_per_token(split),
        windows=windows,
    )


def main() -> None:
    args = parse_args()
    print(
        f"| run | step | trainer's last {args.split} loss | whole-split {args.split} loss | bits per byte | windows |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for run in args.runs:
        score = score_run(Path(run), args.split, args.stride)
        last = "-" if score["trainer_loss"] is None else f"{score['trainer_loss']:.4f}"
        print(
            f"| {run} | {score['step']:,} | {last} | {score['loss']:.4f} | {score['bits_per_byte']:.4f} "
            f"| {score['windows']:,} |",
            flush=True,
        )


if __name__ == "__main__":
    run_cli(main)
