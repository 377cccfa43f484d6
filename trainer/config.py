"""The typed config tree: the single source of truth for a training run.

Precedence: dataclass defaults < the TOML file given with --config < command-line overrides
(`--section.key=value` or `--section.key value`). A key that follows another (optim.lr_decay_iters = 0
follows train.max_iters) is resolved when the tree is built, in Config.__post_init__, so the resolved
tree saved in the run directory (config.toml) and inside every checkpoint holds the number the run
used, and resuming with either reproduces the schedule.
"""

import dataclasses
import difflib
import inspect
import itertools
import json
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from data.files import TEXT_ENCODING, beyond_parser, read_text
from errors import ConfigError
from model import GPTConfig

DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(?::(\d+))?")  # group 1: the GPU's index
DEVICES = "auto, cpu, cuda, cuda:N, mps"
DTYPES = ("auto", "float32", "bfloat16", "float16")
INIT_FROM = ("scratch", "resume")
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")
PARALLELISMS = ("ddp", "fsdp")
WANDB_MODES = ("online", "offline")
# the projections LoRA adapts, by the names Hugging Face's Llama-layout models give them (a gelu or
# relu2 MLP has no gate_proj: its c_fc is up_proj)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_BASE_DTYPES = ("float32", "bfloat16")
MAX_LORA_RANK = 4096  # far beyond the ranks in use (4 .. 256); the layer's width bounds it too
RUN_CONFIG_NAME = "config.toml"  # the resolved config in a run directory
CHECKPOINT_NAME = "ckpt.pt"  # the latest checkpoint in a run directory
RUN_CONFIG_HEADER = "# the resolved config of the run in this directory, written by train.py\n"
# upper ends of the accepted ranges: far beyond any real run, they catch a value typed wrong
MAX_STEPS = 10**12  # optimizer steps (a run of a trillion steps at a millisecond each lasts 30 years)
MAX_BATCHES = 10**6  # micro-batches in one optimizer step or one evaluation
MAX_THREADS = 1024  # CPU threads of one process: more than the largest machines have cores
# learning rates: below MIN_LR an AdamW step (about lr per weight) no longer changes a float32 weight
# of 0.02 (its spacing there is 2e-9); at 1 or more a step moves every weight by about its own size
MIN_LR, MAX_LR = 1e-9, 1.0
LR_RANGE = "below, a step leaves float32 weights as they are; above, it throws them away"
# the schedule keys of [train]: the size a run reaches after their stages, and an example
STAGED_SIZES = {
    "block_size_schedule": ("model.block_size", "32:0.3,48:0.6"),
    "batch_size_schedule": ("data.batch_size", "4:0.5"),
}


@dataclass
class DataConfig:
    dataset: str = "shakespeare_char"  # prepared dataset: a folder under data_dir; bundled ones prepare themselves
    data_dir: str = "data"  # folder that holds prepared datasets
    batch_size: int = 12  # sequences per micro-batch

    def __post_init__(self):
        if not self.dataset:
            raise ValueError("dataset='' must name a prepared dataset (e.g. shakespeare_char)")
        _check_positive(self, "batch_size")


@dataclass
class OptimConfig:
    optimizer: str = "adamw"  # "adamw", or "muon": Muon for the blocks' weight matrices, AdamW for the rest
    learning_rate: float = 6e-4  # AdamW's peak LR, reached at the end of warmup (1e-9 .. 1)
    min_lr: float = 6e-5  # AdamW's LR at the end of the decay, and after it
    schedule: str = "cosine"  # after warmup: "cosine" decay to min_lr, or "wsd" (stable, then linear decay)
    warmup_iters: int = 2000  # steps of linear warmup up to learning_rate; at most lr_decay_iters
    lr_decay_iters: int = 0  # step at which the decay reaches min_lr; 0 = train.max_iters, the run's last step
    # (a run shorter than its warmup keeps the recipe: the decay ends past the run, and a note says so)
    cooldown_frac: float = 0.2  # wsd: the last fraction of lr_decay_iters, spent decaying linearly to min_lr
    weight_decay: float = 0.1  # AdamW weight decay, applied to 2-D+ parameters only
    beta1: float = 0.9  # AdamW decay rate of the gradient's running mean
    beta2: float = 0.95  # AdamW decay rate of the squared gradient's running mean
    muon_lr: float = 0.02  # muon: Muon's peak LR (1e-9 .. 1); its schedule is AdamW's times muon_lr / learning_rate
    muon_momentum: float = 0.95  # muon: decay rate of Muon's (Nesterov) momentum
    muon_weight_decay: float = 0.0  # muon: decoupled weight decay on the matrices Muon updates
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations that orthogonalise each update
    muon_ns_smallest: float = 0.0  # muon: 0 = torch's quintic, else one fitted per iteration from this singular value
    muon_normuon: bool = False  # muon: NorMuon: even out the update's RMS across neurons (rows, or columns if wider)
    muon_beta2: float = 0.95  # muon_normuon: decay rate of each neuron's running mean square, in [0, 1)
    cautious_weight_decay: bool = False  # decay (AdamW's and Muon's) only where the update has the weight's sign

    def __post_init__(self):
        _check_choice(self, "optimizer", OPTIMIZERS)
        _check_choice(self, "schedule", SCHEDULES)
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate={self.learning_rate} must be positive")
        _check_range(self, "learning_rate", MIN_LR, MAX_LR, LR_RANGE)
        if not 0 <= self.min_lr <= self.learning_rate:
            raise ValueError(f"min_lr={self.min_lr} must be between 0 and learning_rate={self.learning_rate}")
        if self.warmup_iters < 0:
            raise ValueError(f"warmup_iters={self.warmup_iters} must be 0 or more")
        # 0 follows train.max_iters: Config resolves it, then these checks run on the number
        if self.lr_decay_iters and self.lr_decay_iters < self.warmup_iters:
            raise ValueError(f"lr_decay_iters={self.lr_decay_iters} must be at least warmup_iters={self.warmup_iters}")
        _check_range(self, "lr_decay_iters", 0, MAX_STEPS, "steps")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be 0 or more")
        for name in ("beta1", "beta2", "muon_momentum", "muon_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1)")
        if self.muon_lr <= 0:
            raise ValueError(f"muon_lr={self.muon_lr} must be positive")
        _check_range(self, "muon_lr", MIN_LR, MAX_LR, LR_RANGE)
        if self.muon_weight_decay < 0:
            raise ValueError(f"muon_weight_decay={self.muon_weight_decay} must be 0 or more")
        # decoupled weight decay multiplies each decayed weight by 1 - lr * decay at every step
        for decay, lr in (("weight_decay", "learning_rate"), ("muon_weight_decay", "muon_lr")):
            if getattr(self, decay) * getattr(self, lr) >= 1:
                raise ValueError(
                    f"{decay}={getattr(self, decay)} with {lr}={getattr(self, lr)} would multiply every decayed "
                    f"weight by 1 - {lr} * {decay} = {1 - getattr(self, decay) * getattr(self, lr):.3g} at each "
                    f"step, erasing or flipping it (keep {decay} below 1 / {lr} = {1 / getattr(self, lr):.3g})"
                )
        if not 0 < self.muon_ns_steps < 100:  # torch's Muon refuses 100 or more
            raise ValueError(f"muon_ns_steps={self.muon_ns_steps} must be between 1 and 99")
        if not 0 <= self.muon_ns_smallest < 1:
            raise ValueError(
                f"muon_ns_smallest={self.muon_ns_smallest} must be 0 (torch's coefficients) or between 0 and 1"
            )
        if not 0 < self.cooldown_frac <= 1:
            raise ValueError(f"cooldown_frac={self.cooldown_frac} must be in (0, 1]")
        if self.schedule == "wsd" and self.lr_decay_iters and self.wsd_decay_start < self.warmup_iters:
            raise ValueError(
                f"cooldown_frac={self.cooldown_frac} starts the decay at step {self.wsd_decay_start} of "
                f"lr_decay_iters={self.lr_decay_iters}, before warmup_iters={self.warmup_iters} ends "
                f"(lower cooldown_frac or warmup_iters)"
            )

    def decaying_until(self, max_iters: int) -> "OptimConfig":
        """This section with an lr_decay_iters of 0 resolved to max_iters, so the decay ends at the
        run's last step. A run shorter than its recipe's warmup (or than a wsd schedule whose decay
        starts after the warmup) keeps the recipe: its decay is placed at the shortest length the
        recipe allows, past the run's end, and unfinished_schedule names what the run leaves out,
        so shortening a run for a quick try takes one override, not two."""
        if self.lr_decay_iters:
            return self
        length = max(max_iters, self.warmup_iters)
        if self.schedule == "wsd" and self.cooldown_frac < 1:
            length = max(length, math.ceil(self.warmup_iters / (1 - self.cooldown_frac)))
            while length - round(self.cooldown_frac * length) < self.warmup_iters:  # round() may take a step
                length += 1
        return dataclasses.replace(self, lr_decay_iters=length)

    @property
    def wsd_decay_start(self) -> int:
        """The step at which the wsd schedule leaves learning_rate and starts its linear decay."""
        return self.lr_decay_iters - round(self.cooldown_frac * self.lr_decay_iters)


@dataclass
class TrainConfig:
    out_dir: str = "out/run"  # run directory: config.toml, metrics.jsonl, ckpt.pt; a file without one: out/ + its name
    device: str = "auto"  # "auto" (cuda, else mps, else cpu), "cpu", "cuda", "cuda:N" or "mps"
    dtype: str = "auto"  # float32, bfloat16, float16, or auto: bfloat16 on Ampere+ GPUs, float16 before, else float32
    compile: bool = False  # torch.compile the model (slow start, faster steps)
    threads: int = 0  # CPU threads of each process for torch operators, at most 1024; 0 = one per free core
    seed: int = 1337  # seeds weight init, dropout and batch sampling
    max_iters: int = 600000  # optimizer steps in the whole run
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step, over all processes (each runs 1/N)
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 = no clipping
    eval_interval: int = 2000  # steps between evaluations, and the last step; each writes a checkpoint (not step 0's)
    eval_iters: int = 200  # batches per split in each evaluation
    eval_at_start: bool = True  # evaluate the untrained model before the first step (its loss: about ln(vocab_size))
    log_interval: int = 10  # steps between lines of metrics.jsonl; the last step is always logged
    init_from: str = "scratch"  # scratch, resume (out_dir's ckpt), a run or ckpt.pt, an HF folder or hub id, a GGUF
    keep_checkpoints: int = 1  # checkpoints kept: ckpt.pt is the latest; k > 1 keeps ckpt_STEP.pt of the last k
    parallelism: str = "ddp"  # under torchrun: "ddp" (replicate the model) or "fsdp" (FSDP2: shard it)
    join_timeout: float = 300.0  # under torchrun: seconds the processes wait for each other at the start (1 .. 86,400)
    block_size_schedule: str = ""  # "32:0.3": rows of 32 tokens for 30% of max_iters, then model.block_size; "" = off
    batch_size_schedule: str = ""  # "8:0.5": micro-batches of 8 for half of max_iters, then data.batch_size; "" = off
    batch_size_lr_power: float = 0.6  # batch_size_schedule: LR times (batch / data.batch_size) ** this (0 .. 1)

    def __post_init__(self):
        if not self.out_dir:
            raise ValueError("out_dir='' must name a run directory")
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"device={self.device!r} is not one of {DEVICES}")
        _check_choice(self, "dtype", DTYPES)
        if not self.init_from:
            raise ValueError(
                f"init_from='' is not one of {', '.join(INIT_FROM)} or a Hugging Face model folder or hub id"
            )
        _check_choice(self, "parallelism", PARALLELISMS)
        for name in (
            "max_iters",
            "gradient_accumulation_steps",
            "eval_interval",
            "eval_iters",
            "log_interval",
            "keep_checkpoints",
        ):
            _check_positive(self, name)
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip={self.grad_clip} must be 0 (off) or positive")
        if self.threads < 0:
            raise ValueError(f"threads={self.threads} must be 0 (chosen from the free cores) or positive")
        _check_range(
            self, "threads", 0, MAX_THREADS, "0 = chosen from the free cores; more threads than cores only slow a run"
        )
        for name in ("max_iters", "eval_interval", "log_interval"):
            _check_range(self, name, 1, MAX_STEPS, "steps")
        for name in ("gradient_accumulation_steps", "eval_iters"):
            _check_range(self, name, 1, MAX_BATCHES, "batches")
        for name in STAGED_SIZES:
            parse_stages(name, getattr(self, name))
        _check_range(self, "batch_size_lr_power", 0, 1, "0 = the same LR at every batch size, 1 = LR in proportion")
        _check_range(self, "join_timeout", 1, 86_400, "seconds, at most a day")

    @property
    def block_size_stages(self) -> list[tuple[int, float]]:
        return parse_stages("block_size_schedule", self.block_size_schedule)

    @property
    def batch_size_stages(self) -> list[tuple[int, float]]:
        return parse_stages("batch_size_schedule", self.batch_size_schedule)


@dataclass
class WandbConfig:
    enabled: bool = False  # log metrics to Weights & Biases
    project: str = "gpt"  # wandb project name
    run_name: str = ""  # wandb run name; "" = the run directory's name
    mode: str = "online"  # "online", or "offline" (no network needed; upload later with `wandb sync`)

    def __post_init__(self):
        _check_choice(self, "mode", WANDB_MODES)


def task_specs(entries: list[str]) -> list[str]:
    """The --tasks entries (eval.py's arguments, or [eval] tasks), each split at its commas; blanks
    between commas name nothing."""
    return [spec.strip() for entry in entries for spec in entry.split(",") if spec.strip()]


@dataclass
class EvalConfig:
    tasks: str = ""  # eval.py --tasks entries to score while training, comma-separated; "" = none
    items: int = 200  # items of each task scored each time (text: windows of block_size); 0 = all
    every: int = 1  # score the tasks at every Nth loss evaluation (train.eval_interval steps apart) and at the end
    batch_size: int = 32  # endings scored in one forward pass

    def __post_init__(self):
        for name in ("every", "batch_size"):
            _check_positive(self, name)
        if self.items < 0:
            raise ValueError(f"items={self.items} must be 0 (all) or positive")

    @property
    def task_list(self) -> list[str]:
        return task_specs([self.tasks])


@dataclass
class LoraConfig:
    rank: int = 0  # LoRA: train rank-r adapters beside the frozen weights of train.init_from; 0 = off (0 .. 4096)
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha); at most rank / LR
    dropout: float = 0.0  # dropout on the adapters' input, in [0, 1)
    targets: str = (
        "q_proj,k_proj,v_proj,o_proj"  # comma-separated: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
    )
    base_dtype: str = "float32"  # the frozen weights' dtype: float32, or bfloat16 (with train.dtype bfloat16)

    def __post_init__(self):
        _check_range(self, "rank", 0, MAX_LORA_RANK, "0 = off; the adapted layer's width bounds it too")
        # a LoRA key set with rank 0 asks for adapters of rank zero: no adapter at all, and a run that
        # silently trains every weight instead (an error, where other keys set in vain get a note)
        chosen = [f.name for f in dataclasses.fields(self) if f.name != "rank" and getattr(self, f.name) != f.default]
        if self.rank == 0 and chosen:
            raise ValueError(
                f"rank=0 gives no adapters, but lora.{chosen[0]}={_toml_value(getattr(self, chosen[0]))} asks for "
                f"LoRA (set lora.rank to 1 or more, e.g. 8; or leave the [lora] keys out to train every weight)"
            )
        if self.alpha <= 0:
            raise ValueError(f"alpha={self.alpha} must be positive")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        unknown = [name for name in self.target_list if name not in LORA_TARGETS]
        if unknown or not self.target_list:
            raise ValueError(
                f"targets={self.targets!r} names {'no projection' if not unknown else repr(unknown[0])}: "
                f"give one or more of {', '.join(LORA_TARGETS)}, comma-separated"
            )
        _check_choice(self, "base_dtype", LORA_BASE_DTYPES)

    @property
    def target_list(self) -> list[str]:
        return [name.strip() for name in self.targets.split(",") if name.strip()]


# the built-in checkers an [rl] run may reward answers with (rl/rewards.py says what each compares)
RL_REWARDS = ("task", "exact", "gsm8k_strict", "gsm8k_flexible", "numeric")
MAX_RL_SAMPLES = 4096  # answers per question: far beyond the 4 .. 64 in use
MAX_RL_TOKENS = 10**6  # tokens of one answer: the model's block_size bounds it too


@dataclass
class RLConfig:
    task: str = ""  # RL: a generation task (an eval.py --tasks entry) whose sampled answers are rewarded; "" = off
    heldout: str = ""  # a generation task scored at each [eval] scoring: pass@k of eval_samples answers a question
    reward: str = "task"  # task (the task's own exact match), exact, gsm8k_strict, gsm8k_flexible or numeric
    tolerance: float = 0.0  # numeric: the largest distance between answer and reference still rewarded
    questions: int = 16  # questions per step, over all processes (each process answers an equal share)
    samples: int = 8  # answers sampled per question (the group whose mean reward is the baseline)
    temperature: float = 1.0  # sampling temperature, above 0 (the loss uses the distribution sampled)
    top_k: int = 0  # sample among the top_k most likely tokens (the loss renormalises over them); 0 = all
    max_new_tokens: int = 64  # an answer is cut after this many tokens (a prompt and answer fit in block_size)
    sample_batch_size: int = 64  # answers sampled together, left padded into one KV cache
    std_advantage: bool = False  # divide each advantage by its group's reward standard deviation (+ 1e-4)
    drop_equal_groups: bool = False  # leave a question whose answers' rewards are all equal out of the update
    kl: float = 0.0  # weight of a KL penalty towards the starting model (kept frozen beside it); 0 = none
    updates: int = 1  # optimizer steps on each batch of answers (train.max_iters counts them); > 1: clipped ratio
    clip: float = 0.2  # updates > 1: the probability ratio to the sampling policy is clipped to 1 +- clip
    eval_samples: int = 8  # n: answers sampled per held-out question at each scoring (pass@1, 2, 4, ... up to n)
    eval_items: int = 200  # held-out questions scored each time; 0 = all

    def __post_init__(self):
        _check_choice(self, "reward", RL_REWARDS)
        if self.tolerance < 0:
            raise ValueError(f"tolerance={self.tolerance} must be 0 (equal numbers only) or more")
        for name in ("questions", "sample_batch_size", "updates"):
            _check_positive(self, name)
        _check_range(self, "questions", 1, MAX_BATCHES, "questions per step")
        _check_range(self, "sample_batch_size", 1, MAX_BATCHES, "answers sampled together")
        _check_range(self, "updates", 1, MAX_BATCHES, "optimizer steps on one batch of answers")
        for name in ("samples", "eval_samples"):
            _check_range(self, name, 1, MAX_RL_SAMPLES, "answers per question")
        if self.samples < 2:
            raise ValueError(
                f"samples={self.samples} gives each question one answer, whose reward is its group's mean: every "
                f"advantage would be 0 (sample 2 or more, e.g. 8)"
            )
        if not 0 < self.temperature <= 100:
            raise ValueError(
                f"temperature={self.temperature} is outside (0, 100] (a policy gradient needs sampled answers: "
                f"0 would be greedy; 1 samples the model's own distribution)"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be 0 (every token) or positive")
        _check_range(self, "max_new_tokens", 1, MAX_RL_TOKENS, "tokens of one answer")
        if self.kl < 0:
            raise ValueError(f"kl={self.kl} must be 0 (no reference model) or positive")
        if not 0 < self.clip < 1:
            raise ValueError(f"clip={self.clip} must be in (0, 1): the ratio is kept within 1 +- clip")
        if self.eval_items < 0:
            raise ValueError(f"eval_items={self.eval_items} must be 0 (all) or positive")


@dataclass
class Config:
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    def __post_init__(self):
        if self.rl.task:
            self._check_rl()
        if self.lora.rank and self.train.init_from == "scratch":
            raise ValueError(
                f"lora.rank={self.lora.rank} adapts a trained model, but train.init_from='scratch' gives none "
                f"(set train.init_from to a run directory, a ckpt.pt, or a Hugging Face folder or hub id; "
                f"or lora.rank=0)"
            )
        if self.lora.rank:
            self._check_adapter_scale()
        if self.lora.rank and self.lora.base_dtype == "bfloat16" and self.train.dtype != "bfloat16":
            raise ValueError(
                f"lora.base_dtype='bfloat16' holds the frozen weights in bfloat16, which needs train.dtype='bfloat16' "
                f"(got {self.train.dtype!r}) for the products to mix them with float32 adapters"
            )
        model = self.model
        # a block-causal row needs more than one block: its last attn_block - 1 positions learn nothing
        bad = [n for n, _ in self.train.block_size_stages if not model.attn_block < n <= model.block_size]
        if bad:
            lowest = f"model.attn_block={model.attn_block} + 1" if model.attn_block else "1"
            raise ValueError(
                f"train.block_size_schedule={self.train.block_size_schedule!r} trains rows of {bad[0]} tokens: each "
                f"stage's length must lie in {lowest} .. model.block_size={model.block_size}"
            )
        # the one place where a key follows another section's: resolved as the tree is built, so the
        # run, its config.toml and its checkpoints all hold the number it used
        self.optim = self.optim.decaying_until(self.train.max_iters)

    def _check_rl(self) -> None:
        """An [rl] run improves a trained chat model's answers, sampled as sample.py samples them."""
        if self.train.init_from == "scratch":
            raise ValueError(
                f"rl.task={self.rl.task!r} rewards a trained model's answers, but train.init_from='scratch' gives "
                f"none (set train.init_from to a chat run directory, a ckpt.pt or a Hugging Face folder)"
            )
        for key in ("attn_prefix_lm", "attn_block"):
            if getattr(self.model, key):
                raise ValueError(
                    f"rl.task is set, but model.{key}={_toml_value(getattr(self.model, key))}: RL samples and "
                    f"scores answers token by token under causal attention (set model.{key} off)"
                )

    def _check_adapter_scale(self) -> None:
        """lora.alpha / lora.rank multiplies everything the adapters add, so their steps move the model
        alpha / rank times as far as unscaled adapters would at the same rate: that product of the scale and
        the rate of the optimizer that trains them is their effective rate, held to the bound of every rate."""
        lora = self.lora
        name = "muon_lr" if self.optim.optimizer == "muon" else "learning_rate"  # Muon trains the 2-D adapters
        lr = getattr(self.optim, name)
        most = MAX_LR * lora.rank / lr
        if lora.alpha > most:
            raise ValueError(
                f"lora.alpha={lora.alpha} is outside the accepted range (0, {most:.6g}] for lora.rank={lora.rank} "
                f"and optim.{name}={lr}: the adapters' output is scaled by alpha / rank, so their steps move the "
                f"model as steps at a rate of alpha / rank * {name} = {lora.alpha / lora.rank * lr:.3g} would, "
                f"where a rate above {MAX_LR:g} throws the weights away (docs/finetuning.md)"
            )


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config)}


def _uses_muon(cfg: Config) -> bool:
    return cfg.optim.optimizer == "muon"


# keys that act only under another setting, with a test for it and its name: set away from its
# default where that setting does not hold, such a key does nothing, and idle_keys names it
ACTS_ONLY_WITH = {
    "model.rope_base": (lambda cfg: cfg.model.pos_emb == "rope", "model.pos_emb='rope'"),
    "model.rope_scaling": (lambda cfg: cfg.model.pos_emb == "rope", "model.pos_emb='rope'"),
    **{
        f"model.rope_{name}": (lambda cfg: cfg.model.rope_scaling != "none", "model.rope_scaling='llama3' or 'yarn'")
        for name in ("factor", "original_context")
    },
    **{
        f"model.rope_{name}": (lambda cfg: cfg.model.rope_scaling == "llama3", "model.rope_scaling='llama3'")
        for name in ("low_freq_factor", "high_freq_factor")
    },
    **{
        f"model.rope_{name}": (lambda cfg: cfg.model.rope_scaling == "yarn", "model.rope_scaling='yarn'")
        for name in ("beta_fast", "beta_slow", "attention_factor", "truncate")
    },
    "model.qkv_bias": (lambda cfg: not cfg.model.bias, "model.bias=false: bias=true already has them"),
    "model.attn_window": (
        lambda cfg: cfg.model.attn_window < cfg.model.block_size,
        "a value below model.block_size: a query never sees more than block_size positions",
    ),
    "model.attn_sinks": (
        lambda cfg: 0 < cfg.model.attn_window < cfg.model.block_size,
        "a model.attn_window below block_size: a causal query already sees the first positions",
    ),
    "model.eot_token": (lambda cfg: cfg.model.attn_documents, "model.attn_documents=true"),
    "model.unet_skips": (lambda cfg: cfg.model.n_layer >= 2, "model.n_layer of 2 or more: a skip joins two blocks"),
    "model.zero_init_proj": (
        lambda cfg: cfg.train.init_from in INIT_FROM,
        "train.init_from='scratch': a fine-tuned model starts from its base's weights",
    ),
    "model.mtp_weight": (lambda cfg: cfg.model.mtp_tokens > 0, "model.mtp_tokens above 0"),
    "optim.cooldown_frac": (lambda cfg: cfg.optim.schedule == "wsd", "optim.schedule='wsd'"),
    **{
        f"optim.{name}": (_uses_muon, "optim.optimizer='muon'")
        for name in (
            "muon_lr",
            "muon_momentum",
            "muon_weight_decay",
            "muon_ns_steps",
            "muon_ns_smallest",
            "muon_normuon",
        )
    },
    "train.batch_size_lr_power": (lambda cfg: bool(cfg.train.batch_size_schedule), "train.batch_size_schedule"),
    "optim.muon_beta2": (
        lambda cfg: _uses_muon(cfg) and cfg.optim.muon_normuon,
        "optim.optimizer='muon' and optim.muon_normuon=true",
    ),
    "optim.cautious_weight_decay": (
        lambda cfg: cfg.optim.weight_decay > 0 or (_uses_muon(cfg) and cfg.optim.muon_weight_decay > 0),
        "a weight decay: optim.weight_decay, or optim.muon_weight_decay with optim.optimizer='muon'",
    ),
    **{
        f"wandb.{name}": (lambda cfg: cfg.wandb.enabled, "wandb.enabled=true")
        for name in ("project", "run_name", "mode")
    },
    **{
        f"rl.{f.name}": (lambda cfg: bool(cfg.rl.task), "rl.task")
        for f in dataclasses.fields(RLConfig)
        if f.name not in ("task", "tolerance", "clip", "eval_samples", "eval_items")
    },
    "rl.tolerance": (lambda cfg: bool(cfg.rl.task) and cfg.rl.reward == "numeric", "rl.task and rl.reward='numeric'"),
    "rl.clip": (lambda cfg: bool(cfg.rl.task) and cfg.rl.updates > 1, "rl.task and rl.updates above 1"),
    **{
        f"rl.{name}": (lambda cfg: bool(cfg.rl.task and cfg.rl.heldout), "rl.task and rl.heldout")
        for name in ("eval_samples", "eval_items")
    },
}


def idle_keys(cfg: Config) -> str | None:
    """One line naming the keys set away from their defaults that do nothing in cfg (a config
    copied from another and switched, say, back to AdamW keeps its muon_* keys), or None."""
    values, defaults = config_to_dict(cfg), config_to_dict(Config())
    idle: dict[str, list[str]] = {}  # the setting a key needs -> the keys that need it
    for key, (acts, needs) in ACTS_ONLY_WITH.items():
        section, name = key.split(".")
        value = values[section][name]
        if value != defaults[section][name] and not acts(cfg):
            idle.setdefault(needs, []).append(f"{key}={_toml_value(value)}")
    if not idle:
        return None
    return "these settings do nothing in this run: " + "; ".join(
        f"{', '.join(keys)} (only with {needs})" for needs, keys in idle.items()
    )


def unfinished_schedule(cfg: Config) -> str | None:
    """One line saying where the learning-rate schedule stands at the run's last step when the run
    ends before the decay reaches min_lr (a run shortened below its warmup, or an lr_decay_iters
    set past max_iters), or None."""
    optim, steps = cfg.optim, cfg.train.max_iters
    if optim.lr_decay_iters <= steps:
        return None
    if steps < optim.warmup_iters:
        where = f"inside its warmup of optim.warmup_iters={optim.warmup_iters} steps"
    else:
        where = f"before its decay to min_lr ends at optim.lr_decay_iters={optim.lr_decay_iters}"
    return (
        f"the run ends at train.max_iters={steps}, {where}; a shorter optim.warmup_iters (0 for none) "
        f"fits the whole schedule in the run"
    )


def _check_positive(section, name: str) -> None:
    value = getattr(section, name)
    if value <= 0:
        raise ValueError(f"{name}={value} must be a positive integer")


def check_token_keys(model: GPTConfig, vocab_size: int, vocabulary: str, fix: str) -> None:
    """The keys that name a token (model.eot_token) lie inside the vocabulary of vocab_size ids that
    `vocabulary` describes, once resolved: -1 (none) only where nothing needs a token. fix: what to do."""
    eot = model.eot_token
    if model.attn_documents and eot < 0:
        raise ConfigError(
            f"model.attn_documents=true needs model.eot_token, the id of the token that separates documents, "
            f"but it is {eot} ({fix})"
        )
    if not -1 <= eot < vocab_size:
        raise ConfigError(
            f"model.eot_token={eot} is not a token of {vocabulary}, whose ids are 0 .. {vocab_size - 1} ({fix})"
        )


def _check_range(section, name: str, low: float, high: float, meaning: str) -> None:
    """The accepted range of a number that has no other bound: its ends, inclusive, are named."""
    value = getattr(section, name)
    if not low <= value <= high:
        raise ValueError(f"{name}={value} is outside the accepted range {low:,} .. {high:,} ({meaning})")


def _check_choice(section, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(section, name)
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")


def parse_stages(name: str, text: str) -> list[tuple[int, float]]:
    """A schedule key's stages as (size, until) pairs: "32:0.3,48:0.6" is size 32 until 30% of
    train.max_iters, then 48 until 60%, then the configured size for the rest; "" is none. Sizes
    are positive integers, fractions rise strictly inside (0, 1)."""
    stages = []
    for entry in text.split(",") if text.strip() else []:
        size, _, until = entry.partition(":")
        try:
            stages.append((int(size), float(until)))
        except ValueError:
            stages = None
            break
    valid = stages is not None and all(size > 0 for size, _ in stages)
    if not valid or not all(a < b for a, b in itertools.pairwise([0.0, *(until for _, until in stages), 1.0])):
        final, example = STAGED_SIZES[name]
        raise ValueError(
            f"{name}={text!r} is not a list of SIZE:UNTIL stages (a positive integer, then the fraction of "
            f"train.max_iters it lasts until, rising inside (0, 1); after the last, {final}), e.g. {example!r}"
        )
    return stages


def load_config(path: str | None, overrides: list[str]) -> Config:
    """Defaults, then the TOML file at path (if any), then `--section.key=value` overrides. A file
    that sets no train.out_dir trains into out/ + the file's name (configs/deep.toml: out/deep), so
    a config copied under a new name, and changed, never meets the run of the one it came from."""
    values: dict[str, dict[str, object]] = {name: {} for name in SECTIONS}
    if path is not None:
        values["train"]["out_dir"] = f"out/{Path(path).stem}"
        for section, key, value in _read_toml(Path(path)):
            values[section][key] = _check_type(section, key, value, source=path)
        if _is_in_its_run_directory(Path(path)):
            # the run directory is where this file is, wherever it was first written (a copied run resumes in the copy)
            values["train"]["out_dir"] = str(Path(path).parent)
    for section, key, text in _parse_overrides(overrides):
        values[section][key] = _from_string(section, key, text)
    return build_config(values)


def build_config(values: dict[str, dict[str, object]]) -> Config:
    """Build the tree from {section: {key: value}}, values already of the right types."""
    sections = {}
    for name, cls in SECTIONS.items():
        _check_int_range(name, values.get(name, {}))
        try:
            sections[name] = cls(**values.get(name, {}))
        except ValueError as e:
            raise ConfigError(f"{name}.{e}") from None
    try:
        return Config(**sections)
    except ValueError as e:  # across sections: the message names each key in full
        raise ConfigError(str(e)) from None


def _check_int_range(section: str, values: dict[str, object]) -> None:
    """Integers fit in 64 bits: torch's seeds and counters, and the checkpoint, hold no larger ones."""
    for key, value in values.items():
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            raise ConfigError(
                f"{section}.{key}={value} is too large: a config integer is at most 2**63 - 1 = {2**63 - 1:,}"
            )


def config_from_dict(raw: dict, source: str) -> Config:
    """A tree from a plain nested dict (a checkpoint's copy), checking keys and types."""
    values: dict[str, dict[str, object]] = {name: {} for name in SECTIONS}
    for section, table in raw.items():
        _check_section(section, source)
        for key, value in table.items():
            values[section][key] = _check_type(section, key, value, source)
    try:
        return build_config(values)
    except ConfigError as e:  # name the file: the user never wrote this config
        raise ConfigError(f"the config in {source} is not accepted: {e}") from None


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def default_values() -> dict:
    """Each key's default as its section declares it, before Config resolves the keys that follow
    another (optim.lr_decay_iters = 0): what --help and the README show."""
    return {name: dataclasses.asdict(cls()) for name, cls in SECTIONS.items()}


def config_to_toml(cfg: Config) -> str:
    """The resolved config as TOML that load_config reads back to an equal Config."""
    lines = []
    for section, table in config_to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def run_config_toml(cfg: Config) -> str:
    """The config.toml of a run directory: the resolved config under a first line that marks it as
    written by the trainer, which may then rewrite it (a hand-written file is never overwritten)."""
    return RUN_CONFIG_HEADER + config_to_toml(cfg)


def is_run_config(path: Path) -> bool:
    """Whether path is a config.toml the trainer wrote: a file starting with RUN_CONFIG_HEADER, or one
    beside a checkpoint (runs written before the header existed stay resumable)."""
    if not path.is_file():
        return False
    if (path.parent / CHECKPOINT_NAME).is_file():
        return True
    with open(path, encoding=TEXT_ENCODING, errors="replace") as f:
        return f.readline() == RUN_CONFIG_HEADER


def _is_in_its_run_directory(path: Path) -> bool:
    """Whether path is the config.toml the trainer wrote into a run directory, beside its checkpoint."""
    return path.name == RUN_CONFIG_NAME and (path.parent / CHECKPOINT_NAME).is_file() and is_run_config(path)


def _toml_value(value: object) -> str:
    """JSON's booleans, finite numbers and strings are TOML values too, provided strings keep
    characters beyond U+FFFF whole (JSON would escape them as surrogate pairs, which TOML rejects)
    and escape DEL (which TOML does not allow raw)."""
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def _read_toml(path: Path) -> list[tuple[str, str, object]]:
    try:
        raw = tomllib.loads(read_text(path))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist (see configs/ for examples)") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except (RecursionError, ValueError) as e:
        raise ConfigError(f"config file {path} cannot be read: {beyond_parser(e)}") from None
    entries = []
    for section, table in raw.items():
        if not isinstance(table, dict):
            raise ConfigError(
                f"{section} = {table!r} in {path} is outside any section "
                f"(put it under one of [{'], ['.join(SECTIONS)}])"
            )
        _check_section(section, str(path))
        entries.extend((section, key, value) for key, value in table.items())
    return entries


def _parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """`--section.key=value` and `--section.key value` pairs; a bare `--section.flag` means true."""
    entries = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument {arg!r} (overrides look like --section.key=value)")
        name, has_value, text = arg[2:].partition("=")
        section, _, key = name.partition(".")
        _check_section(section, "the command line")
        _field_type(section, key)  # rejects unknown keys before the value is looked at
        if not has_value:
            next_is_value = i + 1 < len(args) and not args[i + 1].startswith("--")
            if next_is_value:
                i += 1
                text = args[i]
            elif _field_type(section, key) is bool:
                text = "true"
            else:
                raise ConfigError(f"--{name} needs a value (--{name}=VALUE)")
        entries.append((section, key, text))
        i += 1
    return entries


def _check_section(section: str, source: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section [{section}] in {source} (valid sections: {', '.join(SECTIONS)})")


def _field_type(section: str, key: str) -> type:
    hints = typing.get_type_hints(SECTIONS[section])
    names = [f.name for f in dataclasses.fields(SECTIONS[section])]
    if key not in names:
        close = difflib.get_close_matches(key, names, n=1)
        hint = f"did you mean {section}.{close[0]}? " if close else ""
        raise ConfigError(f"unknown config key {section}.{key} ({hint}valid keys in [{section}]: {', '.join(names)})")
    return hints[key]


def _type_name(kind: type) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[kind]


def _check_type(section: str, key: str, value: object, source: str) -> object:
    kind = _field_type(section, key)
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # an int is fine where a float is expected
    if not ok:
        raise ConfigError(f"{section}.{key}={value!r} in {source} is not {_type_name(kind)}")
    if kind is float and not math.isfinite(value):
        raise ConfigError(f"{section}.{key}={value!r} in {source} is not a finite number")
    return value


def _from_string(section: str, key: str, text: str) -> object:
    kind = _field_type(section, key)
    try:
        if kind is bool:
            lowered = text.lower()
            if lowered in ("true", "1", "yes"):
                return True
            if lowered in ("false", "0", "no"):
                return False
            raise ValueError
        value = kind(text)
    except ValueError:
        raise ConfigError(f"{section}.{key}={text!r} on the command line is not {_type_name(kind)}") from None
    if kind is float and not math.isfinite(value):
        raise ConfigError(f"{section}.{key}={text!r} on the command line is not a finite number")
    return value


def field_comments(cls: type) -> dict[str, str]:
    """The trailing comment of each field in a config dataclass's source: its help text. A default
    too long for one line stands in parentheses (as the formatter writes it), its comment on the
    line of the value."""
    comments, wrapped = {}, None
    for line in inspect.getsource(cls).splitlines():
        match = re.match(r"\s+(\w+): [^=]+=.*?#\s*(.*)$", line)
        if match:
            comments[match.group(1)] = match.group(2)
        elif wrapped and (comment := re.search(r"#\s*(.*)$", line)):
            comments[wrapped] = comment.group(1)
        opening = re.match(r"\s+(\w+): [^=]+= \($", line)
        wrapped = opening.group(1) if opening else None
    return comments


def override_keys() -> list[str]:
    """Every key as a command-line override spells it, `--section.key`, for "did you mean"."""
    return [f"--{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def config_help() -> str:
    """Every config key with its type, default and meaning, for --help."""
    lines = []
    defaults = default_values()
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        comments = field_comments(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = json.dumps(defaults[section][f.name])
            lines.append(f"  {f.name:<28} {hints[f.name].__name__:<5} {default:<20} {comments.get(f.name, '')}")
    return "\n".join(lines)
