"""The run directory (train.out_dir): one writer at a time, what may be resumed or overwritten, and
the files a run keeps there. Rank 0 holds train.lock from the moment the trainer is built until
the run ends; it writes config.toml (the resolved config) and metrics.jsonl; the checkpoint, ckpt.pt,
is written by trainer/checkpoint.py. Nothing here overwrites a run or a file the trainer did not write.
"""

import shlex
import tomllib
from pathlib import Path

from data.files import FileLock, atomic_open, check_writable_dir
from data.tokenizer import vocabulary_fingerprint
from errors import UserError
from trainer.checkpoint import CHECKPOINT_NAME, load_checkpoint
from trainer.config import (
    RUN_CONFIG_HEADER,
    RUN_CONFIG_NAME,
    Config,
    TrainConfig,
    config_to_dict,
    is_run_config,
    run_config_toml,
    task_specs,
)
from trainer.distributed import World
from trainer.metrics import METRICS_NAME, MetricsLog, read_metrics, read_records

LOCK_NAME = "train.lock"  # in the run directory while a run writes to it: the pid and host of its process


class RunDir:
    """train.out_dir of one run, locked on construction (rank 0 holds the lock, every process
    learns whether it got it) until `release` or `abandon`."""

    def __init__(self, train: TrainConfig, world: World):
        self.train, self.world = train, world
        self.path = Path(train.out_dir)
        self.written: list[Path] = []  # the files this run created (config.toml and metrics.jsonl of a new run)
        self.lock = self._lock()

    @property
    def checkpoint_path(self) -> Path:
        return self.path / CHECKPOINT_NAME

    def _lock(self) -> FileLock:
        """One writer per run directory: rank 0 holds out_dir/train.lock until the run ends, and a
        second training or resume of the same directory is refused, naming the process that holds it."""
        check_writable_dir(self.path, "train.out_dir")
        lock = FileLock(self.path / LOCK_NAME)
        holder = None
        self.created = False
        if self.world.is_main:
            self.created = not self.path.exists()
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                holder = lock.acquire()
            except OSError as e:
                raise UserError(
                    f"train.out_dir={self.train.out_dir!r} cannot be written ({e.strerror}): choose a directory you "
                    f"can write"
                ) from None
        holder = self.world.gather(holder)[0]  # every process learns rank 0's answer
        if holder is not None:
            raise UserError(
                f"train.out_dir={self.train.out_dir!r} is in use by another training ({holder}): wait for it to end "
                f"or stop it, or choose another --train.out_dir"
            )
        return lock

    def release(self) -> None:
        self.lock.release()

    def abandon(self) -> None:
        """Release the run directory of a run that did not start, or took no step, leaving no trace
        of it: a new attempt in the same directory then starts as the first would have."""
        self.release()
        for path in self.written:
            path.unlink(missing_ok=True)
        if self.created and not any(self.path.iterdir()):
            self.path.rmdir()

    def resume_command(self) -> str:
        return resume_command(self.path, self.world)

    def open(self, cfg: Config) -> dict | None:
        """Refuse to overwrite an existing run; when resuming, load its checkpoint."""
        train = self.train
        config_path = self.path / RUN_CONFIG_NAME
        if config_path.exists() and not is_run_config(config_path):
            raise UserError(
                f"train.out_dir={train.out_dir!r} holds a {RUN_CONFIG_NAME} that train.py did not write (its first "
                f"line is not {RUN_CONFIG_HEADER.strip()!r}), where the run's resolved config goes: move yours "
                f"elsewhere (e.g. configs/) or choose another --train.out_dir"
            )
        if train.init_from == "resume":
            if not self.checkpoint_path.exists():
                raise UserError(
                    f"train.init_from='resume' but there is no checkpoint at {self.checkpoint_path} "
                    f"(check train.out_dir, or start the run with init_from='scratch')"
                )
            checkpoint = load_checkpoint(self.checkpoint_path)
            if (self.path / METRICS_NAME).is_file():
                read_records(self.path / METRICS_NAME)  # a damaged log is refused before anything is written
            return checkpoint
        if self.checkpoint_path.exists():
            raise UserError(
                f"train.out_dir={train.out_dir!r} already holds a run ({CHECKPOINT_NAME}){self._what_works(cfg)}"
            )
        if (self.path / METRICS_NAME).exists():
            raise UserError(
                f"train.out_dir={train.out_dir!r} holds the {METRICS_NAME} of a run that wrote no checkpoint; "
                f"delete that directory or choose another --train.out_dir"
            )
        return None

    def _what_works(self, cfg: Config) -> str:
        """For a new run pointed at this directory's run: whether resuming it could work (the same
        model and optimizer, by the run's config.toml) or not, and what to do instead."""
        elsewhere = "--train.out_dir=out/NAME"
        try:
            saved = tomllib.loads((self.path / RUN_CONFIG_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):  # not UTF-8, not TOML, or nested too deep to parse
            return f"; continue it with {self.resume_command()}, or choose another directory ({elsewhere})"
        changes = unresumable_changes(config_to_dict(cfg), saved, self.path)
        if changes:
            return f" that this config cannot resume ({changes[0]}): train it in another directory ({elsewhere})"
        return f" of this model; continue it with {self.resume_command()}, or start anew elsewhere ({elsewhere})"

    def check_resumable(self, checkpoint: dict, cfg: Config, dataset_meta: dict) -> None:
        """The model and its adapters (every key that defines what the weights compute), the optimizer,
        the tokenizer and the [eval] tasks must be those of the run being resumed."""
        run_dir = self.path
        changes = unresumable_changes(config_to_dict(cfg), checkpoint["config"], run_dir)
        if changes:
            raise UserError(
                f"{changes[0]}, which a resumed run cannot change (resume with the run's own config: "
                f"{self.resume_command()}; or train this config in another directory: --train.out_dir=out/NAME)"
            )
        # the centred mean of other tasks is another figure: one line of it in metrics.jsonl and plot.py
        # must mean one set of tasks (older checkpoints without [eval] scored none)
        saved_tasks = task_specs([checkpoint["config"].get("eval", {}).get("tasks", "")])
        if sorted(saved_tasks) != sorted(cfg.eval.task_list):
            scored = f"scored {','.join(saved_tasks)!r}" if saved_tasks else "scored no [eval] tasks"
            raise UserError(
                f"eval.tasks={','.join(cfg.eval.task_list)!r} but the run in {run_dir} {scored}, and its eval/ "
                f"figures and centred_mean must mean the same tasks throughout (resume with the run's own tasks: "
                f"--config {run_dir / 'config.toml'}; or train with the new tasks under another --train.out_dir)"
            )
        saved_dataset = checkpoint["dataset"]
        for key in ("tokenizer", "vocab_size"):
            if saved_dataset.get(key) != dataset_meta.get(key):
                raise UserError(
                    f"the dataset's {key} is {dataset_meta.get(key)!r} but the run in {run_dir} was trained "
                    f"with {saved_dataset.get(key)!r} (resume with the run's own dataset)"
                )
        if vocabulary_fingerprint(dataset_meta) != vocabulary_fingerprint(saved_dataset):
            raise UserError(
                f"data.dataset={cfg.data.dataset!r} has the run's {dataset_meta['tokenizer']} vocabulary size "
                f"({dataset_meta['vocab_size']}) but its token ids stand for other text than those the run in "
                f"{run_dir} was trained on (vocabulary {vocabulary_fingerprint(dataset_meta)}, the run's "
                f"{vocabulary_fingerprint(saved_dataset)}): resume with the run's own dataset"
            )

    def open_log(self, cfg: Config, resume_step: int | None, wandb_run_id: str | None) -> MetricsLog | None:
        """Rank 0 writes config.toml and metrics.jsonl and talks to wandb; other processes log nothing.
        resume_step: the checkpoint's step, whose later records the resumed run logs again."""
        if not self.world.is_main:
            return None
        self.path.mkdir(parents=True, exist_ok=True)
        with atomic_open(self.path / RUN_CONFIG_NAME) as f:
            f.write(run_config_toml(cfg).encode("utf-8"))
        if resume_step is None:  # a new run's own files, which abandon removes
            self.written = [self.path / RUN_CONFIG_NAME, self.path / METRICS_NAME]
        return MetricsLog(self.path, cfg.wandb, config_to_dict(cfg), resume_step, wandb_run_id)

    def evaluation_pending(self, step: int) -> bool:
        """Whether the checkpoint's step is an evaluation step whose evaluation a stop cut short (its
        metrics.jsonl holds none), for the resumed run to do first. Rank 0 reads the log; every
        process learns its answer."""
        pending = None
        if self.world.is_main:
            evaluated = [r for r in read_metrics(self.path / METRICS_NAME) if "val_loss" in r]
            at_interval = step % self.train.eval_interval == 0
            pending = at_interval and not any(r["step"] == step for r in evaluated)
        return self.world.gather(pending)[0]


def resume_command(run_dir: Path, world: World) -> str:
    """The whole command that continues the run in run_dir, which `world` trained: its config.toml holds
    every setting it ran with. A run on several machines continues on as many, each starting the
    command with HOST:PORT, the rendezvous endpoint of the launch, filled in."""
    if not world.launched:
        launcher = "python"
    elif world.nodes == 1:
        launcher = f"torchrun --standalone --nproc_per_node={world.size}"
    else:
        launcher = (
            f"torchrun --nnodes={world.nodes} --nproc_per_node={world.local_size} --rdzv_backend=c10d "
            f"--rdzv_endpoint=HOST:PORT"
        )
    return f"{launcher} train.py --config {shlex.quote(str(run_dir / RUN_CONFIG_NAME))} --train.init_from=resume"


def check_same_kind_of_data(saved: dict, meta: dict, dataset: str, run_dir: Path) -> None:
    """A run trained on plain text resumes on plain text, one trained on conversations on conversations
    (a chat dataset: meta.json's "chat", its template and special tokens): the other kind is refused."""
    if ("chat" in saved) == ("chat" in meta):
        return
    if "chat" in meta:
        raise UserError(
            f"data.dataset={dataset!r} holds conversations, but the run in {run_dir} was trained on plain text and "
            f"cannot resume on them: fine-tune it in a new run with --train.init_from={run_dir} (docs/chat.md)"
        )
    raise UserError(
        f"data.dataset={dataset!r} is plain text, but the run in {run_dir} was trained on conversations with a chat "
        f"template: resume it on its own chat dataset, or fine-tune it in a new run with --train.init_from={run_dir}"
    )


# what a checkpoint's weights compute is defined by every key of these sections (the model's shape, architecture
# and attention pattern; the adapters' rank, scale and targets): a resume with another value would continue
# another computation, its loss jumping, or not load at all
DEFINE_THE_WEIGHTS = ("model", "lora")
# the keys of those sections that act only while training, and which a resume may change: dropout is off when
# the model is evaluated or sampled, and the frozen weights' dtype is a matter of memory, as train.dtype is
TRAINING_ONLY = ("model.dropout", "lora.dropout", "lora.base_dtype")
# model keys a run fills in from its dataset when left at these values: the request does not differ
FOLLOWS_DATA = {"model.vocab_size": 0, "model.eot_token": -1}


def unresumable_changes(requested: dict, saved: dict, run_dir: Path) -> list[str]:
    """What in the requested config (as a dict) the run in run_dir, saved with `saved`, cannot resume
    with: the keys that define what its weights compute (but those in TRAINING_ONLY) and its optimizer,
    each as 'model.n_layer=6 but the run in out/x was trained with 4'. A key the saved config lacks
    (written before the key existed) counts as its default."""
    defaults = config_to_dict(Config())
    changes = []
    for section in DEFINE_THE_WEIGHTS:
        for key, value in requested[section].items():
            name = f"{section}.{key}"
            was = saved.get(section, {}).get(key, defaults[section][key])
            if name not in TRAINING_ONLY and was != value and FOLLOWS_DATA.get(name, object()) != value:
                changes.append(f"{name}={value!r} but the run in {run_dir} was trained with {was!r}")
    optimizer = requested["optim"]["optimizer"]
    was = saved.get("optim", {}).get("optimizer", "adamw")  # runs from before Muon used AdamW
    if was != optimizer:
        changes.append(f"optim.optimizer={optimizer!r} but the run in {run_dir} was trained with {was!r}")
    return changes
