"""The training loop: `Trainer(cfg).fit()` trains a GPT until train.max_iters optimizer steps."""

import dataclasses
import math
from pathlib import Path

import torch
from tqdm import tqdm

from data.files import atomic_open
from data.loader import SPLITS, RandomWindows, TokenDataset
from errors import UserError
from model import GPT
from trainer.checkpoint import CHECKPOINT_NAME, FORMAT_VERSION, load_checkpoint, save_checkpoint
from trainer.config import INIT_FROM, Config, config_to_dict, config_to_toml
from trainer.metrics import METRICS_NAME, MetricsLog, Throughput, flops_per_token, gpu_peak_flops
from trainer.optim import build_optimizer, lr_at
from trainer.pretrained import crop_positions, load_gpt2, with_gpt2_shape
from trainer.runtime import autocast, enable_tf32, resolve_device, resolve_dtype


class Trainer:
    """Builds the model, optimizer and data of one run from its config, and trains it."""

    def __init__(self, cfg: Config):
        train = cfg.train
        self.device = resolve_device(train.device)
        self.dtype = resolve_dtype(train.dtype, self.device)
        self.run_dir = Path(train.out_dir)
        checkpoint = self._open_run_dir(train)
        self.dataset = TokenDataset(Path(cfg.data.data_dir) / cfg.data.dataset)
        pretrained = None
        if train.init_from not in INIT_FROM:  # fine-tune the GPT-2 weights in that directory
            gpt2_config, pretrained = load_gpt2(Path(train.init_from), key="train.init_from")
            cfg = with_gpt2_shape(cfg, gpt2_config, self.dataset.meta)
        self.cfg = cfg = _with_dataset_vocab(cfg, self.dataset.vocab_size)
        self.dataset.check_fits(cfg.model.block_size)
        if checkpoint is not None:
            _check_resumable(checkpoint, cfg, self.dataset.meta, self.run_dir)

        if self.device.type == "cuda":
            enable_tf32()
        torch.manual_seed(train.seed)
        self.model = GPT(cfg.model).to(self.device)
        if pretrained is not None:
            self.model.load_state_dict(crop_positions(pretrained, cfg.model.block_size))
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        # float16 gradients underflow without loss scaling; bfloat16 and float32 need none
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)
        self.batches = RandomWindows(
            self.dataset, "train", cfg.data.batch_size, cfg.model.block_size, train.seed, self.device
        )
        self.step = 0
        self.wandb_run_id = None
        if checkpoint is not None:
            self._restore(checkpoint)
        self.forward = torch.compile(self.model) if train.compile else self.model
        self.tokens_per_step = cfg.data.batch_size * cfg.model.block_size * train.gradient_accumulation_steps

    def fit(self) -> None:
        cfg, train = self.cfg, self.cfg.train
        if self.step >= train.max_iters:
            print(f"{self.run_dir} already reached train.max_iters={train.max_iters}; raise it to train longer")
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with atomic_open(self.run_dir / "config.toml") as f:
            f.write(config_to_toml(cfg).encode("utf-8"))
        resumed = self.step > 0
        log = MetricsLog(
            self.run_dir, cfg.wandb, config_to_dict(cfg), self.step if resumed else None, self.wandb_run_id
        )
        self.wandb_run_id = log.wandb_run_id
        self._print_summary(resumed)
        progress = tqdm(total=train.max_iters, initial=self.step, unit="step", dynamic_ncols=True, mininterval=0.5)
        try:
            if not resumed:
                self._evaluate(log, progress.write)  # the untrained baseline, close to ln(vocab_size)
            throughput = Throughput(
                self.tokens_per_step,
                flops_per_token(cfg.model, self.model.num_params()),
                gpu_peak_flops(self.device),
                self.step,
            )
            while self.step < train.max_iters:
                lr = lr_at(self.step, cfg.optim)
                loss = self.train_step(lr)
                self.step += 1
                progress.update()
                if self.step % train.log_interval == 0:
                    record = {"step": self.step, "loss": loss.item(), "lr": lr} | throughput.measure(self.step)
                    log.log(record)
                    progress.set_postfix(
                        loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_sec']:,.0f}", refresh=False
                    )
                if self.step % train.eval_interval == 0 or self.step == train.max_iters:
                    self._evaluate(log, progress.write)
                    save_checkpoint(self.checkpoint_state(), self.run_dir / CHECKPOINT_NAME)
                    throughput.restart(self.step)  # evaluation time is not training time
        finally:
            progress.close()
            log.close()
        print(f"done: {self.step} steps; checkpoint in {self.run_dir / CHECKPOINT_NAME}")

    def train_step(self, lr: float) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps micro-batches; returns the mean loss
        (a tensor on the device: reading it forces a sync, so only logging does)."""
        train = self.cfg.train
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        accumulation = train.gradient_accumulation_steps
        total_loss = torch.zeros((), device=self.device)
        for _ in range(accumulation):
            x, y = self.batches.next_batch()
            with autocast(self.device, self.dtype):
                _, loss = self.forward(x, y)
            total_loss += loss.detach()
            # dividing by the micro-batch count makes the summed gradients those of the mean loss
            self.scaler.scale(loss / accumulation).backward()
        if train.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), train.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return total_loss / accumulation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss over eval_iters batches of each split. The batches are the same at every
        evaluation (their own fixed seed), so successive values compare like for like."""
        train = self.cfg.train
        self.model.eval()
        losses = {}
        for split in SPLITS:
            windows = RandomWindows(
                self.dataset, split, self.cfg.data.batch_size, self.cfg.model.block_size, train.seed + 1, self.device
            )
            total = torch.zeros((), device=self.device)
            for _ in range(train.eval_iters):
                x, y = windows.next_batch()
                with autocast(self.device, self.dtype):
                    _, loss = self.forward(x, y)
                total += loss.float()
            losses[split] = (total / train.eval_iters).item()
        self.model.train()
        return losses

    def checkpoint_state(self) -> dict:
        """Everything needed to sample from the model or continue the run, as plain data."""
        return {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "config": config_to_dict(self.cfg),
            "dataset": self.dataset.meta,
            "model": self.model.state_dict(),  # the uncompiled module's names
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else [],
                "mps": torch.mps.get_rng_state() if self.device.type == "mps" else None,
                "train_batches": self.batches.state_dict(),
            },
            "wandb_run_id": self.wandb_run_id or "",
        }

    def _evaluate(self, log: MetricsLog, write) -> None:
        losses = self.evaluate()
        record = {"step": self.step}
        for split, loss in losses.items():
            record[f"{split}_loss"] = loss
            record[f"{split}_perplexity"] = math.exp(min(loss, 700.0))  # exp overflows a float past ~709
        log.log(record)
        write(
            f"step {self.step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f} "
            f"(perplexity {record['val_perplexity']:.2f})"
        )

    def _open_run_dir(self, train) -> dict | None:
        """Refuse to overwrite an existing run; when resuming, load its checkpoint."""
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise UserError(f"train.out_dir={train.out_dir!r} is a file, not a directory")
        checkpoint_path = self.run_dir / CHECKPOINT_NAME
        if train.init_from == "resume":
            if not checkpoint_path.exists():
                raise UserError(
                    f"train.init_from='resume' but there is no checkpoint at {checkpoint_path} "
                    f"(check train.out_dir, or start the run with init_from='scratch')"
                )
            return load_checkpoint(checkpoint_path)
        if checkpoint_path.exists():
            raise UserError(
                f"train.out_dir={train.out_dir!r} already holds a run ({CHECKPOINT_NAME}); continue it "
                f"with --train.init_from=resume, or choose another --train.out_dir"
            )
        if (self.run_dir / METRICS_NAME).exists():
            raise UserError(
                f"train.out_dir={train.out_dir!r} holds the {METRICS_NAME} of a run that wrote no checkpoint; "
                f"delete that directory or choose another --train.out_dir"
            )
        return None

    def _restore(self, checkpoint: dict) -> None:
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        if self.scaler.is_enabled() and checkpoint["scaler"]:
            # a run saved in another precision has no scale to restore: the new scaler starts afresh
            self.scaler.load_state_dict(checkpoint["scaler"])
        rng = checkpoint["rng"]
        torch.set_rng_state(rng["torch"])
        if self.device.type == "cuda" and len(rng["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(rng["cuda"])
        if self.device.type == "mps" and rng["mps"] is not None:
            torch.mps.set_rng_state(rng["mps"])
        self.batches.load_state_dict(rng["train_batches"])
        self.step = checkpoint["step"]
        self.wandb_run_id = checkpoint["wandb_run_id"] or None

    def _print_summary(self, resumed: bool) -> None:
        cfg = self.cfg
        start = f"resuming at step {self.step}" if resumed else "starting"
        print(
            f"{start}: {self.model.num_params() / 1e6:.2f}M parameters, {self.device.type} "
            f"{str(self.dtype).removeprefix('torch.')}, dataset {cfg.data.dataset} "
            f"({self.dataset.meta['train_tokens']:,} train tokens), {self.tokens_per_step:,} tokens per step, "
            f"run directory {self.run_dir}"
        )
        if cfg.train.compile:
            print("compiling the model: the first steps are slow")
        if self.device.type == "cuda" and gpu_peak_flops(self.device) is None:
            print(f"no peak FLOPs known for {torch.cuda.get_device_name(self.device)}: metrics.jsonl gets no mfu")


def _with_dataset_vocab(cfg: Config, dataset_vocab: int) -> Config:
    """The config with model.vocab_size filled in from the dataset (or checked against it)."""
    vocab_size = cfg.model.vocab_size
    if vocab_size == 0:
        vocab_size = dataset_vocab
    elif vocab_size < dataset_vocab:
        raise UserError(
            f"model.vocab_size={vocab_size} is smaller than the dataset's vocabulary of {dataset_vocab} "
            f"tokens (use 0 to take the dataset's, or a larger value to pad)"
        )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))


def _check_resumable(checkpoint: dict, cfg: Config, dataset_meta: dict, run_dir: Path) -> None:
    """The model and the tokenizer must be those of the run being resumed."""
    saved_model = checkpoint["config"]["model"]
    for key, value in config_to_dict(cfg)["model"].items():
        if saved_model.get(key) != value:
            raise UserError(
                f"model.{key}={value!r} but the run in {run_dir} was trained with {saved_model.get(key)!r} "
                f"(resume with the run's own config: --config {run_dir / 'config.toml'})"
            )
    saved_dataset = checkpoint["dataset"]
    for key in ("tokenizer", "vocab_size"):
        if saved_dataset.get(key) != dataset_meta.get(key):
            raise UserError(
                f"the dataset's {key} is {dataset_meta.get(key)!r} but the run in {run_dir} was trained "
                f"with {saved_dataset.get(key)!r} (resume with the run's own dataset)"
            )
