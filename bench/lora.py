r"""LoRA against a full fine-tune: peak memory, step time, and the val loss each reaches in the same
wall time.

    python bench/lora.py                        # a Qwen3-0.6B-shaped model (random weights), then the small task
    python bench/lora.py --shape tiny --steps 2 --seconds 5   # a quick look

Memory and speed: a model of Qwen3-0.6B's shape (28 blocks of width 1024, 16 query and 8 key/value
heads of 128, SwiGLU of 3072, a tied vocabulary of 151,936; random weights: the cost of a step does
not depend on their values) takes --steps AdamW steps on one sequence of --seq-len tokens, once with
every weight trained and once with rank --rank adapters on every projection of every block (the
base frozen). Each side runs in a process of its own, so its peak is its own: on a GPU the most
memory torch allocated, on a CPU the process's peak resident memory (its whole footprint: Python,
torch and the model). The step time is the median of the steps after the first.

Quality: a small character model is trained from scratch on Shakespeare for --base-steps steps (the
base), then fine-tuned on the same data for --seconds of wall time each way, full and LoRA, at the
learning rates each is usually run with (--full-lr, --lora-lr); the table gives the steps each took
and the val loss each reached.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.arguments import BenchArguments, write_json  # noqa: E402
from data.corpus import ensure_prepared  # noqa: E402
from errors import run_cli  # noqa: E402
from finetune.lora import add_adapters  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from optim.lr_schedule import lr_at  # noqa: E402
from trainer.config import LORA_TARGETS, LoraConfig, load_config  # noqa: E402
from trainer.loop import Trainer  # noqa: E402

SHAPES = {
    "qwen3-0.6b": GPTConfig(
        n_layer=28, n_head=16, n_kv_head=8, head_dim=128, n_embd=1024, mlp_width=3072, vocab_size=151936,
        block_size=4096, bias=False, pos_emb="rope", rope_base=1e6, norm="rmsnorm", norm_eps=1e-6, qk_norm=True,
        mlp="swiglu", tie_embeddings=True,
    ),
    "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=512, block_size=256, bias=False, pos_emb="rope",
                      norm="rmsnorm", mlp="swiglu"),
}  # fmt: skip
TASK_CONFIG = "configs/shakespeare_char.toml"


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def one_side(args: argparse.Namespace) -> dict:
    """Train one side (args.side: full or lora) for args.steps steps; its peak memory and step times."""
    device = args.device
    torch.manual_seed(0)
    model = GPT(SHAPES[args.shape]).to(device)
    if args.side == "lora":
        add_adapters(model, LoraConfig(rank=args.rank, targets=",".join(LORA_TARGETS)))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type in ("cuda", "cpu"))
    x = torch.randint(0, model.config.vocab_size, (1, args.seq_len + 1), device=device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return {
        "side": args.side,
        "trained_params": sum(p.numel() for p in params),
        "params": sum(p.numel() for p in model.parameters()),
        "peak_bytes": peak_bytes(device),
        "step_seconds": statistics.median(times[1:] or times),
    }


def finetune(base: Path, side: str, args: argparse.Namespace, scratch: Path) -> dict:
    """Fine-tune the base run for args.seconds of wall time, full or LoRA; the steps and val loss."""
    lora = [f"--lora.rank={args.rank}", f"--lora.targets={','.join(LORA_TARGETS)}"] if side == "lora" else []
    lr = args.lora_lr if side == "lora" else args.full_lr
    cfg = load_config(TASK_CONFIG, [
        f"--train.out_dir={scratch / side}", f"--train.init_from={base}", "--train.device=cpu", "--train.threads=1",
        "--train.max_iters=100000", f"--train.eval_iters={args.eval_iters}", f"--optim.learning_rate={lr}",
        f"--optim.min_lr={lr}",
        "--optim.warmup_iters=0", *lora,
    ])  # fmt: skip
    trainer = Trainer(cfg)
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < args.seconds:
        trainer.train_step(lr_at(steps, cfg.optim))
        steps += 1
    losses = trainer.evaluate()
    trainer.run_dir.release()
    return {"side": side, "steps": steps, "val_loss": losses["val"]}


def quality(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        cfg = load_config(TASK_CONFIG, [f"--train.out_dir={scratch / 'base'}", "--train.device=cpu",
                                        "--train.threads=1", f"--train.max_iters={args.base_steps}",
                                        f"--train.eval_interval={args.base_steps}",
                                        f"--train.eval_iters={args.eval_iters}"])  # fmt: skip
        ensure_prepared(cfg.data.dataset, cfg.data.data_dir)
        base = Trainer(cfg)
        base.fit()
        base_loss = base.evaluate()["val"]
        return {
            "base_val_loss": base_loss,
            "sides": [finetune(scratch / "base", s, args, scratch) for s in ("full", "lora")],
        }


def main() -> None:
    parser = BenchArguments(__doc__)
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b", help="model of the memory part")
    parser.add_count("--rank", default=8, help="LoRA rank (default: 8)")
    parser.add_count("--seq-len", default=128, help="tokens in the one sequence of a step (default: 128)")
    parser.add_count(
        "--steps", minimum=2, default=4, help="steps timed on each side, the first not counted (default: 4)"
    )
    parser.add_count("--base-steps", default=300, help="steps of the small base model (default: 300)")
    parser.add_count("--eval-iters", default=20, help="batches of each split in an evaluation (default: 20)")
    parser.add_amount("--seconds", default=60.0, help="wall time of each small fine-tune (default: 60)")
    parser.add_amount("--full-lr", default=1e-3, help="learning rate of the full fine-tune (default: 1e-3)")
    parser.add_amount("--lora-lr", default=1e-2, help="learning rate of the LoRA fine-tune (default: 1e-2)")
    parser.add_argument("--side", choices=("full", "lora"), help=argparse.SUPPRESS)  # one side, in a child process
    parser.add_argument("--skip-quality", action="store_true", help="measure memory and speed only")
    parser.add_device()
    parser.add_json_output("--json", keys=("memory",), help="also write the figures here")
    args = parser.parse_args()
    if args.side is not None:
        print(json.dumps(one_side(args)))
        return
    child = [sys.executable, __file__, "--shape", args.shape, "--rank", str(args.rank), "--seq-len",
             str(args.seq_len), "--steps", str(args.steps), "--device", str(args.device)]  # fmt: skip
    sides = []
    for side in ("full", "lora"):
        done = subprocess.run([*child, "--side", side], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"the {side} side failed:\n{done.stderr}")
        sides.append(json.loads(done.stdout.strip().splitlines()[-1]))
    full, lora = sides
    print(f"{args.shape} on {args.device}, one sequence of {args.seq_len} tokens, AdamW, LoRA rank {args.rank} on "
          f"every projection")  # fmt: skip
    print(f"{'':6} {'trained params':>15} {'peak memory':>12} {'step':>9}")
    for s in sides:
        print(
            f"{s['side']:6} {s['trained_params']:>15,} {s['peak_bytes'] / 2**30:>9.2f} GiB {s['step_seconds']:>7.2f} s"
        )
    print(f"LoRA's peak is {lora['peak_bytes'] / full['peak_bytes']:.0%} of the full fine-tune's; "
          f"its step takes {lora['step_seconds'] / full['step_seconds']:.2f}x the time")  # fmt: skip
    figures = {"memory": sides}
    if not args.skip_quality:
        figures["quality"] = quality(args)
        print(f"small task: base val loss {figures['quality']['base_val_loss']:.4f}; after {args.seconds:g} s each:")
        for s in figures["quality"]["sides"]:
            print(f"  {s['side']:6} {s['steps']:>6} steps, val loss {s['val_loss']:.4f}")
    if args.json is not None:
        write_json(args.json, figures)


if __name__ == "__main__":
    run_cli(main)
