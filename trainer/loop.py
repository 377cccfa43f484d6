"""The training loop: `Trainer(cfg)` builds a run from its config, `fit()` trains it until
train.max_iters optimizer steps. The run directory (its lock, config.toml, metrics.jsonl, what may be
resumed or overwritten) is trainer/run_dir.py's room, stop requests trainer/stop.py's, and what a
checkpoint holds and how it is written trainer/checkpoint.py's."""

import dataclasses
import itertools
import math
import signal
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from data.loader import SPLITS, RandomWindows, TokenDataset
from data.tokenizer import Tokenizer, tokenizer_from_meta
from errors import UserError
from model import GPT
from optim.lr_schedule import lr_at
from optim.optimizer import build_optimizer
from trainer.checkpoint import (
    FORMAT_VERSION,
    check_weights,
    non_finite,
    restore_rng_state,
    rng_state,
    save_checkpoint,
)
from trainer.config import (
    Config,
    TrainConfig,
    check_token_keys,
    config_to_dict,
    idle_keys,
    unfinished_schedule,
)
from trainer.distributed import ParallelModel, World
from trainer.metrics import SlowdownWatch, Throughput, flops_per_token, gpu_peak_flops, total_peak_flops
from trainer.objective import Objective
from trainer.run_dir import RunDir, check_same_kind_of_data
from trainer.runtime import (
    autocast,
    check_fits_in_memory,
    enable_tf32,
    keep_freed_memory,
    resolve_dtype,
    set_threads,
)
from trainer.schedules import batch_shape_at, describe, lr_factor_at, tokens_before
from trainer.start import check_init_from, starting_point
from trainer.stop import StopSignals


class Trainer:
    """Builds the model, optimizer and data of one run from its config, and trains it."""

    def __init__(self, cfg: Config):
        train = cfg.train
        check_init_from(train.init_from)
        self.world = World.from_env()
        _check_accumulation(train, self.world.size)
        if cfg.rl.task:  # an [rl] run's questions are shared among the processes too (its room is read only then)
            from rl.policy_gradient import check_shares

            check_shares(cfg, self.world.size)
        self.device = self.world.device(train.device)
        self.threads_chosen = None  # why train.threads = 0 chose the count it did, for the summary
        if train.threads or self.device.type == "cpu":
            self.threads_chosen = set_threads(train.threads, "train.threads", self.world.local_size)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.dtype = resolve_dtype(train.dtype, self.device)
        if self.world.launched and train.parallelism == "fsdp" and self.dtype == torch.float16:
            raise UserError(
                "train.parallelism='fsdp' with train.dtype='float16' is not supported (loss scaling of "
                "sharded gradients): use bfloat16 or float32, or parallelism='ddp'"
            )
        self.world.start(self.device, train.join_timeout)
        self.world.barrier()  # until local rank 0 has prepared a bundled dataset (train.py)
        self.run_dir = RunDir(train, self.world)  # locked until the run ends
        try:
            self._build(cfg)
        except BaseException:
            self.run_dir.abandon()
            raise

    def _build(self, cfg: Config) -> None:
        """The model, optimizer, data and state of the run (restored from its checkpoint when resuming)."""
        train = cfg.train
        checkpoint = self.run_dir.open(cfg)
        self.dataset = TokenDataset(Path(cfg.data.data_dir) / cfg.data.dataset)
        if checkpoint is not None:  # before the vocabulary sizes, which differ too: the kind of data says why
            check_same_kind_of_data(checkpoint["dataset"], self.dataset.meta, cfg.data.dataset, self.run_dir.path)
        # where the weights start: scratch, or a run or folder to fine-tune (finetune/init_from.py)
        self.start = starting_point(cfg, self.dataset, checkpoint)
        cfg = self.start.cfg
        self.cfg = cfg = _with_document_separator(_with_dataset_vocab(cfg, self.dataset.vocab_size), self.dataset.meta)
        check_token_keys(
            cfg.model,
            self.dataset.vocab_size,
            f"data.dataset={cfg.data.dataset!r}",
            "use one of them, or -1 for its tokenizer's end-of-text token",
        )
        self.dataset.check_fits(cfg.model.block_size)
        _check_rows_hold_conversations(cfg, self.dataset)
        # the [eval] tasks, read and encoded now: a bad item stops the run before it starts
        self.tokenizer = tokenizer_from_meta(self.dataset.meta)
        self.tasks = _training_tasks(
            cfg, self.tokenizer, self.world, lockstep=self.world.launched and train.parallelism == "fsdp"
        )
        if checkpoint is not None:
            self.run_dir.check_resumable(checkpoint, cfg, self.dataset.meta)

        if self.device.type == "cuda":
            enable_tf32()
        _check_fits_in_memory(cfg, self.device, self.dtype, self.world.size if train.parallelism == "fsdp" else 1)
        torch.manual_seed(train.seed)  # the same initial weights in every process
        self.model = GPT(cfg.model).to(self.device)
        checkpoint_path = self.run_dir.checkpoint_path
        if checkpoint is not None:
            check_weights(self.start.expected_weights(cfg), checkpoint["model"], f"the weights in {checkpoint_path}")
        self.start.load(self.model, cfg, checkpoint_path, resumed=checkpoint is not None)
        self.parallel = ParallelModel(self.model, train.parallelism, self.world, self.device, self.dtype)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)  # after sharding: it holds the shards
        # float16 gradients underflow without loss scaling; bfloat16 and float32 need none
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)
        # each process draws its own windows (seed + rank), so the processes train on different data
        self.batches = self._train_windows(train.seed + self.world.rank)
        # what a step trains on: windows of the dataset (prefix lengths, targets), or with [rl] sampled answers
        self.objective = self._objective(train.seed + self.world.rank, checkpoint)
        self.step = 0
        self.trained_tokens = torch.zeros((), dtype=torch.long)  # targets with a loss in the last step, all processes
        self.wandb_run_id = None
        self.stop: StopSignals | None = None  # while fit runs: its stop requests
        self.slowdown = SlowdownWatch()
        if checkpoint is not None:
            self._restore(checkpoint)
        self.forward = torch.compile(self.parallel.module) if train.compile else self.parallel.module
        # the global batch: gradient_accumulation_steps micro-batches in all, shared out among the processes
        # (its full shape: a train.batch_size_schedule or block_size_schedule draws smaller ones first)
        self.tokens_per_step = cfg.data.batch_size * cfg.model.block_size * train.gradient_accumulation_steps
        self.last_checkpoint_step: int | None = self.step if checkpoint is not None else None
        self.world.barrier()  # every process has looked at the run directory before rank 0 writes to it

    def _objective(self, seed: int, checkpoint: dict | None):
        """What the run's steps train on: windows of the dataset (an Objective), or with rl.task the
        answers rl/policy_gradient.py's PolicyGradient samples and rewards (its room is read only then)."""
        cfg = self.cfg
        if not cfg.rl.task:
            return Objective(cfg.model, seed)
        from rl.policy_gradient import PolicyGradient, reference_model

        reference = reference_model(cfg, self.dataset, checkpoint, self.device) if cfg.rl.kl else None
        lockstep = self.parallel.mode == "fsdp"  # every process runs as many forward passes as the others
        return PolicyGradient(
            cfg, self.tokenizer, self.model, self.world, self.device, self.dtype, lockstep, reference, seed
        )

    def _train_windows(self, seed: int) -> RandomWindows:
        data, block_size = self.cfg.data, self.cfg.model.block_size
        return RandomWindows(self.dataset, "train", data.batch_size, block_size, seed, self.device)

    def _restore(self, checkpoint: dict) -> None:
        self.parallel.load_state_dicts(self.optimizer, checkpoint["model"], checkpoint["optimizer"])
        if self.scaler.is_enabled() and checkpoint["scaler"]:
            # a run saved in another precision has no scale to restore: the new scaler starts afresh
            self.scaler.load_state_dict(checkpoint["scaler"])
        self.step = checkpoint["step"]
        self.wandb_run_id = checkpoint["wandb_run_id"] or None
        saved_rng = checkpoint["rng"]
        if len(saved_rng) == self.world.size:
            restore_rng_state(saved_rng[self.world.rank], self.device, self.batches, self.objective)
            return
        # another number of processes: no state to give each one, so seed afresh, apart from the
        # seeds the run has used
        seed = self.cfg.train.seed + self.step * self.world.size + self.world.rank
        torch.manual_seed(seed)
        self.batches = self._train_windows(seed)
        self.objective.reseed(seed)
        self._print(
            f"the checkpoint was written by {len(saved_rng)} process(es), this run has {self.world.size}: "
            f"batches and dropout follow new seeds, so the run will not repeat an uninterrupted one exactly"
        )

    def fit(self) -> int | None:
        """Train until train.max_iters. Returns None, or the number of the signal (SIGINT, SIGTERM)
        that stopped the run early, after a checkpoint of the last step was written."""
        cfg, train = self.cfg, self.cfg.train
        if self.step >= train.max_iters:
            self._print(
                f"{self.run_dir.path} already reached train.max_iters={train.max_iters}; raise it to train longer"
            )
            self.run_dir.release()
            self.world.stop()
            return None
        resumed = self.step > 0
        self.log = self.run_dir.open_log(cfg, self.step if resumed else None, self.wandb_run_id)
        if self.log is not None:
            self.wandb_run_id = self.log.wandb_run_id
        self._print_summary(resumed)
        progress = tqdm(
            total=train.max_iters,
            initial=self.step,
            unit="step",
            dynamic_ncols=True,
            mininterval=0.5,
            disable=not self.world.is_main,
        )
        micro_batches = train.gradient_accumulation_steps // self.world.size  # this process's share
        try:
            with StopSignals(self.world, self.device, self.step, micro_batches) as stop:
                self.stop = stop
                # the untrained baseline (close to ln(vocab_size)), or the evaluation a stop cut short
                baseline = not resumed and train.eval_at_start
                if baseline or (resumed and self.run_dir.evaluation_pending(self.step)):
                    if not self._evaluate(progress.write, stop):
                        return self._stop(stop.agreed, None, None, progress)
                throughput = Throughput(
                    lambda step: tokens_before(step, cfg),
                    flops_per_token(cfg.model, self.model.num_params()),
                    total_peak_flops(self.device, self.world.size),
                    self.step,
                )
                unlogged = None  # the last step's (loss, lr) while not yet logged: a stop logs it
                while self.step < train.max_iters:
                    lr = lr_at(self.step, cfg.optim) * lr_factor_at(self.step, cfg)
                    # multi-token prediction's weights fade over the schedule's steps, saved with the run
                    self.model.loss.set_progress(min(self.step / cfg.optim.lr_decay_iters, 1.0))
                    loss = self.train_step(lr)
                    if loss is None:  # a stop between its micro-batches dropped the step
                        return self._stop(stop.agreed, unlogged, throughput, progress)
                    self.step += 1
                    progress.update()
                    last = self.step == train.max_iters  # logged, evaluated and saved however short the run
                    logged = self.step % train.log_interval == 0 or last
                    if logged:
                        self._log_step(loss, lr, throughput, progress)
                    saved = self.step % train.eval_interval == 0 or last
                    evaluated = True
                    if saved:
                        evaluated = self._evaluate(progress.write, stop)
                        self.save()
                        throughput.restart(self.step)  # evaluation time is not training time
                    unlogged = None if logged else (loss, lr)
                    signum = stop.requested(self.step) if evaluated else stop.agreed
                    if signum is not None:
                        return self._stop(signum, unlogged, throughput, progress)
        finally:
            self.stop = None
            progress.close()
            if self.log is not None:
                self.log.close()
            if self.step == 0 and self.last_checkpoint_step is None:  # a new run that took no step: nothing to keep
                self.run_dir.abandon()
            else:
                self.run_dir.release()
            self.world.stop()
        self._print(f"done: {self.step} steps; checkpoint in {self.run_dir.checkpoint_path}")
        return None

    def train_step(self, lr: float) -> torch.Tensor | None:
        """One optimizer step over this process's share of the gradient_accumulation_steps
        micro-batches; returns its loss (a tensor on the device: reading it forces a sync, so only
        logging does; the mean over the processes is the mean over every trained target of the step,
        kept in self.trained_tokens), or None if a stop request came between two micro-batches: the step is
        then dropped whole, leaving the state of the last finished step for the checkpoint."""
        train = self.cfg.train
        self.optimizer.set_lr(lr)
        micro_batches = train.gradient_accumulation_steps // self.world.size  # this process's share
        # where the step starts, to drop it whole if a stop comes while its answers are sampled or between its
        # micro-batches (in fit); a step of one micro-batch of windows has no such moment
        stop = self.stop if micro_batches > 1 or not self.objective.windows else None
        start = rng_state(self.device, self.batches, self.objective) if stop is not None else None
        # the step's batches are drawn first: the loss is the mean over every trained target of the step, in
        # every micro-batch and process, so each micro-batch's mean is weighted by its share of their number
        shape = batch_shape_at(self.step, self.cfg)  # (sequences, tokens each): a schedule's, else the full one
        drawn = self.objective.draw(self.step, micro_batches, self.batches, shape, self._sampling_stop())
        if drawn is None:  # a stop request while the step's answers were sampled
            self._drop_step(start)
            return None
        batches, counts = drawn
        trained_tokens = self.world.sum(torch.stack(counts).sum())  # over all processes: one all-reduce
        # processes average their gradients (divide by their number): each share is scaled up by it
        shares = [count * self.world.size / trained_tokens.clamp(min=1) for count in counts]
        total_loss = torch.zeros((), device=self.device)
        for micro_batch, (batch, share) in enumerate(zip(batches, shares, strict=True)):
            if micro_batch > 0 and stop is not None and stop.requested(self.step, micro_batch) is not None:
                self._drop_step(start)
                return None
            # processes average their gradients once per step, in the last micro-batch's backward
            with self.parallel.gradient_sync(micro_batch == micro_batches - 1):
                with autocast(self.device, self.dtype):
                    loss = self.objective.loss(self.forward, batch)
                self.scaler.scale(loss * share).backward()
            total_loss += loss.detach() * share
        if train.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), train.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.trained_tokens = trained_tokens
        return total_loss  # its mean over the processes is the step's loss

    def _sampling_stop(self):
        """While fit runs, what an objective that samples asks after each batch of answers: whether the
        processes agree to stop there; else None."""
        return None if self.stop is None else _after_each_batch(self.stop.during_sampling())

    def _drop_step(self, start: dict) -> None:
        """Undo the micro-batches of an unfinished step: its gradients, and the batches and random
        numbers it drew, so that the checkpoint resumes exactly where the last finished step ended."""
        self.optimizer.zero_grad(set_to_none=True)
        restore_rng_state(start, self.device, self.batches, self.objective)

    @torch.no_grad()
    def evaluate(self, stop: "StopSignals | None" = None) -> dict[str, float | None] | None:
        """Mean loss over the targets of eval_iters batches of each split, in every process (a chat
        dataset's trained tokens only); None for a split whose batches hold no target (a chat split
        whose replies are few), where a mean is undefined. The batches
        are the same at every evaluation (their own fixed seed), so successive values compare like for like.
        With stop, a stop request ends the evaluation after the batch it is agreed on: None."""
        train = self.cfg.train
        agreement = stop.during_evaluation() if stop is not None else None
        batches = 0  # over both splits: every process counts the same
        self.model.eval()
        try:
            losses = {}
            for split in SPLITS:
                windows = RandomWindows(
                    self.dataset,
                    split,
                    self.cfg.data.batch_size,
                    self.cfg.model.block_size,
                    train.seed + self.world.size + self.world.rank,  # apart from every process's training seed
                    self.device,
                )
                objective = Objective(self.cfg.model, train.seed + self.world.size + self.world.rank)
                total = torch.zeros((), device=self.device)  # of the targets' losses
                counted = torch.zeros((), device=self.device)  # targets with a loss (chat: trained tokens)
                for _ in range(train.eval_iters):
                    x, y, prefix = objective(*windows.next_batch())
                    with autocast(self.device, self.dtype):
                        _, loss = self.forward(x, y, prefix=prefix)
                    count = (y != -1).sum()
                    total += loss.float() * count
                    counted += count
                    batches += 1
                    if agreement is not None and agreement.requested(batches) is not None:
                        return None
                counted = self.world.sum(counted)
                losses[split] = (self.world.sum(total) / counted).item() if counted > 0 else None
            return losses
        finally:
            self.model.train()

    def _evaluate(self, write, stop: "StopSignals") -> bool:
        """Evaluate and record the losses; False if a stop request ended the evaluation first."""
        losses = self.evaluate(stop)
        if losses is None:
            return False
        if not all(math.isfinite(loss) for loss in losses.values() if loss is not None):
            self._diverged(f"the evaluation loss is {losses}")
        record = {"step": self.step}
        for split, loss in losses.items():
            if loss is None:
                continue  # no target, no mean: the record leaves the split out rather than write a 0
            record[f"{split}_loss"] = loss
            record[f"{split}_perplexity"] = math.exp(min(loss, 700.0))  # exp overflows a float past ~709
            # nats per token -> bits per token -> bits per byte of text: comparable across tokenizers
            record[f"{split}_bpb"] = loss / math.log(2) / self.dataset.bytes_per_token(split)
        scores = self._score_tasks(stop)
        if scores is None:
            return False
        figures, lines = scores
        self._record(record | figures)
        if self.world.is_main:
            write(f"step {self.step}: " + ", ".join(self._loss_summary(split, record) for split in SPLITS))
            if lines:
                write(f"step {self.step}: " + "; ".join(lines))
        return True

    def _loss_summary(self, split: str, record: dict) -> str:
        """The evaluation line's part for one split: its loss (val: with perplexity and bits per byte),
        or why it has none."""
        if f"{split}_loss" not in record:
            return (
                f"{split} loss undefined (its {self.cfg.train.eval_iters} evaluation batches hold no trained token; "
                f"a larger train.eval_iters reads more)"
            )
        if split == "train":
            return f"train loss {record['train_loss']:.4f}"
        return (
            f"val loss {record['val_loss']:.4f} (perplexity {record['val_perplexity']:.2f}, "
            f"{record['val_bpb']:.4f} bits per byte)"
        )

    def _score_tasks(self, stop: "StopSignals") -> tuple[dict[str, float], list[str]] | None:
        """The [eval] tasks' figures and summary lines (and rl.heldout's pass@k) at every
        eval.every-th evaluation and at the last step, else none; None if a stop request came first
        (agreed on after each batch, counted over all the tasks). Every process scores the same items
        in the same batches (a sharded model's forward pass needs them all), so every process agrees at
        the same batch."""
        cfg = self.cfg
        due = (self.step // cfg.train.eval_interval) % cfg.eval.every == 0 or self.step == cfg.train.max_iters
        if not self.tasks or not due:
            return {}, []
        stop_requested = _after_each_batch(stop.during_evaluation())  # counted over all the tasks
        figures, lines = {}, []
        with autocast(self.device, self.dtype):
            for tasks in self.tasks:
                scores = tasks.score(self.model, stop_requested)
                if scores is None:
                    return None
                figures |= scores[0]
                lines += scores[1]
        return figures, lines

    def _log_step(self, loss: torch.Tensor, lr: float, throughput: Throughput, progress: tqdm) -> None:
        """Record the mean loss over all processes; stop the run if it is not a finite number. A chat
        step whose batches held no trained token has no mean: its record has no loss, and the
        progress bar shows none."""
        loss_value = self.world.mean(loss).item()
        if not math.isfinite(loss_value):
            self._diverged(f"the train loss is {loss_value}")
        record = {"step": self.step, "loss": loss_value, "lr": lr}
        if self.objective.windows:  # the tokens of windows trained on so far, and how fast
            record |= {"tokens": tokens_before(self.step, self.cfg)} | throughput.measure(self.step)
        figures, note = self.objective.report()  # an RL step's reward, answers and sampling speed
        record |= figures
        trained = {}
        if self.dataset.chat:  # of the step's tokens, those with a loss (the replies, by default)
            record["trained_tokens"] = int(self.trained_tokens.item())
            trained = {"trained": f"{record['trained_tokens']:,}"}
            if record["trained_tokens"] == 0:
                del record["loss"]
        self._record(record)
        if note is not None and self.world.is_main:
            progress.write(f"note: {note}")
        shown = f"{loss_value:.4f}" if "loss" in record else "-"
        if not self.objective.windows:
            speed = {
                "reward": f"{record['rl/reward']:.3f}",
                "sampled_tok_s": f"{record['rl/sampled_tokens_per_sec']:,.0f}",
            }
            progress.set_postfix(loss=shown, **speed, **trained, refresh=False)
            return
        progress.set_postfix(loss=shown, tok_s=f"{record['tokens_per_sec']:,.0f}", **trained, refresh=False)
        best = self.slowdown.update(record["tokens_per_sec"])
        if best is not None and self.device.type == "cpu" and self.world.is_main:
            progress.write(
                f"note: training runs at {record['tokens_per_sec']:,.0f} tokens/s, under a third of the {best:,.0f} "
                f"it reached earlier: other work is probably sharing the CPU, and each of this run's "
                f"{torch.get_num_threads()} threads waits for the slowest (--train.threads=1 is often several times "
                f"faster on a busy machine; or use a quieter one)"
            )

    def _record(self, record: dict) -> None:
        if self.log is not None:
            self.log.log(record)

    def save(self) -> None:
        """Write ckpt.pt: every process takes part, rank 0 writes. Weights that are not all finite
        stop the run instead, in every process, and the last checkpoint stays: a step can leave NaN
        weights behind a finite loss (an infinite gradient norm clipped to NaN), and a stop saves
        without the evaluation that would show them."""
        state = self.checkpoint_state()
        # the full weights are rank 0's alone (cpu_offload); every process learns what it found
        problem = self.world.gather(non_finite(state["model"]) if self.world.is_main else None)[0]
        if problem is not None:
            self._diverged(f"the weights are not finite ({problem})")
        if self.world.is_main:
            save_checkpoint(state, self.run_dir.checkpoint_path, self.cfg.train.keep_checkpoints)
        self.last_checkpoint_step = self.step

    def checkpoint_state(self) -> dict:
        """Everything needed to sample from the model or continue the run, as plain data. Every
        process must call it (FSDP gathers the weights, and each process adds its RNG states)."""
        model_state, optimizer_state = self.parallel.state_dicts(self.optimizer)
        return {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "config": config_to_dict(self.cfg),
            "dataset": self.dataset.meta,
            # the full, unwrapped and uncompiled module's names (a LoRA run's: its adapters, and where their base is)
            **self.start.saved(model_state),
            "optimizer": optimizer_state,  # keyed by parameter name, whatever the parallelism
            "scaler": self.scaler.state_dict(),
            # one entry per process, in rank order
            "rng": self.world.gather(rng_state(self.device, self.batches, self.objective)),
            "wandb_run_id": self.wandb_run_id or "",
        }

    def _stop(self, signum: int, unlogged: tuple | None, throughput: Throughput | None, progress: tqdm) -> int:
        """End the run on a stop request: log the last step if it was not (a checkpoint holds finite
        losses only), write its checkpoint unless the one on disk already holds it, and say how to
        go on, on a line of its own below the progress bar. A run stopped before its first step
        writes nothing (fit then removes what it had written): there is nothing to continue."""
        if unlogged is not None:
            self._log_step(*unlogged, throughput, progress)
        if self.step > 0 and self.step != self.last_checkpoint_step:
            self.save()
        progress.close()
        name = signal.Signals(signum).name
        if self.step == 0:
            self._print(
                f"stopped by {name} before the first step: nothing saved (start it again with the same command)"
            )
        else:
            self._print(
                f"stopped by {name} at step {self.step}; checkpoint in {self.run_dir.checkpoint_path}; continue with:\n"
                f"  {self.run_dir.resume_command()}"
            )
        return signum

    def _diverged(self, what: str) -> None:
        if self.last_checkpoint_step is None:
            kept = "no checkpoint was written before it"
        else:
            kept = f"{self.run_dir.checkpoint_path} from step {self.last_checkpoint_step} is kept"
        raise UserError(
            f"{what} at step {self.step}: training stopped, {kept} (lower optim.learning_rate or "
            f"raise optim.warmup_iters; in float16, try bfloat16)"
        )

    def _print_summary(self, resumed: bool) -> None:
        cfg, world = self.cfg, self.world
        start = f"resuming at step {self.step}" if resumed else "starting"
        self._print(
            f"{start}: {self.model.num_params() / 1e6:.2f}M parameters, {self.device.type} "
            f"{str(self.dtype).removeprefix('torch.')}, dataset {cfg.data.dataset} "
            f"({self.dataset.meta['train_tokens']:,} train tokens), run directory {self.run_dir.path}"
        )
        accumulation = cfg.train.gradient_accumulation_steps
        parallel = f", {world.size} processes ({self.parallel.mode}) running {accumulation // world.size} each"
        if self.objective.windows:
            self._print(
                f"global batch: {cfg.data.batch_size} sequences x {accumulation} micro-batches"
                f"{parallel if world.launched else ''} = {self.tokens_per_step:,} tokens per step"
            )
        else:
            self._print(
                f"{self.objective.describe()}; {accumulation} micro-batch{'es' if accumulation > 1 else ''}"
                f"{parallel if world.launched else ''}"
            )
        if self.threads_chosen is not None:
            self._print(self.threads_chosen)
        if (shapes := describe(cfg)) is not None:
            self._print(shapes)
        for note in (idle_keys(cfg), unfinished_schedule(cfg)):
            if note is not None:
                self._print(f"note: {note}")
        if cfg.train.parallelism == "fsdp" and not world.launched:
            self._print("train.parallelism='fsdp' applies under torchrun; this single process trains the whole model")
        if cfg.train.compile:
            self._print("compiling the model: the first steps are slow")
        if self.device.type == "cuda" and gpu_peak_flops(self.device) is None:
            self._print(f"no peak FLOPs known for {torch.cuda.get_device_name(self.device)}: metrics.jsonl gets no mfu")

    def _print(self, text: str) -> None:
        if self.world.is_main:
            print(text)


def _check_accumulation(train: TrainConfig, world_size: int) -> None:
    if train.gradient_accumulation_steps % world_size != 0:
        raise UserError(
            f"train.gradient_accumulation_steps={train.gradient_accumulation_steps} does not divide among the "
            f"{world_size} processes torchrun started: it counts the micro-batches of one optimizer step over all "
            f"processes (use a multiple of {world_size})"
        )


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


def _with_document_separator(cfg: Config, dataset_meta: dict) -> Config:
    """With model.attn_documents, the config with model.eot_token taken from the dataset's tokenizer
    (unless set), which must have one."""
    if not cfg.model.attn_documents or cfg.model.eot_token >= 0:
        return cfg
    eot_token = tokenizer_from_meta(dataset_meta).eot_token
    if eot_token is None:
        raise UserError(
            f"model.attn_documents=true needs documents separated by an end-of-text token, but data.dataset="
            f"{cfg.data.dataset!r} is tokenized with {dataset_meta['tokenizer']!r}, which has none (use a GPT-2 BPE "
            f"dataset, e.g. shakespeare, or set model.attn_documents=false)"
        )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, eot_token=eot_token))


def _check_fits_in_memory(cfg: Config, device: torch.device, dtype: torch.dtype, shards: int) -> None:
    """Refuse, before building anything, a model or a micro-batch that cannot fit: what is counted
    here is needed whatever else the run holds."""
    model = cfg.model
    params = model.num_params()
    check_fits_in_memory(
        16 * params // shards,  # float32 weights, gradients and AdamW's two moments: 4 bytes each
        device,
        f"a model of {params:,} parameters (model.n_layer={model.n_layer}, n_embd={model.n_embd}, "
        f"vocab_size={model.vocab_size}, block_size={model.block_size}) and its gradients and optimizer state",
        "choose smaller model.n_layer, n_embd or vocab_size",
    )
    batch_size = max([cfg.data.batch_size] + [size for size, _ in cfg.train.batch_size_stages])
    rows = f"data.batch_size={batch_size}"
    if batch_size > cfg.data.batch_size:
        rows = f"{batch_size} sequences (train.batch_size_schedule={cfg.train.batch_size_schedule!r})"
    check_fits_in_memory(
        batch_size * model.block_size * model.vocab_size * dtype.itemsize,
        device,
        f"the logits of one micro-batch of {rows} x model.block_size={model.block_size} tokens",
        "lower data.batch_size and raise train.gradient_accumulation_steps to keep the tokens per step",
    )


def _check_rows_hold_conversations(cfg: Config, dataset: TokenDataset) -> None:
    """A chat dataset's rows start where a conversation starts and hold it whole (check_fits): a
    train.block_size_schedule's shorter rows must too, or they would cut its longest replies."""
    shortest = min([cfg.model.block_size] + [size for size, _ in cfg.train.block_size_stages])
    if dataset.chat and shortest < dataset.meta["chat"]["longest"]:
        raise UserError(
            f"train.block_size_schedule={cfg.train.block_size_schedule!r} trains rows of {shortest} tokens, but "
            f"{dataset.directory} holds a conversation of {dataset.meta['chat']['longest']:,} tokens, which they "
            f"would cut (use lengths of at least that, or no schedule)"
        )


def _training_tasks(cfg: Config, tokenizer: Tokenizer, world: World, lockstep: bool) -> list:
    """What the run scores at its evaluations beside the losses: the [eval] tasks (an
    evals.evaluate.TrainingTasks) and rl.heldout's questions (an rl.policy_gradient.HeldOut), each read and
    checked now, or none: a run without them never reads evaluation or RL code. lockstep: every
    process must sample as many steps as the others (FSDP)."""
    scored = []
    if cfg.eval.task_list:
        from evals.evaluate import TrainingTasks

        scored.append(TrainingTasks(cfg.eval, tokenizer, cfg.model.block_size))
    if cfg.rl.task and cfg.rl.heldout:
        from rl.policy_gradient import HeldOut

        scored.append(HeldOut(cfg, tokenizer, lockstep, world))
    return scored


def _after_each_batch(agreement) -> Callable[[], bool]:
    """What an evaluation or sampling asks after each of its batches: whether the processes agree (a
    StopSignals agreement counting the batches) to stop there."""
    batches = itertools.count(1)
    return lambda: agreement.requested(next(batches)) is not None
