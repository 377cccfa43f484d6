"""train.py and sample.py driven as a user drives them: in a fresh interpreter, from the shell.
(The catalogue of bad inputs runs in-process, in tests/test_bad_inputs.py.)"""

import json
import math
import shutil
import sys
import tomllib

import pytest
import torch

import sample
from data.corpus import CORPUS_DIR
from errors import UserError
from inference.load import load_model
from inference.packed_linear import packing_unavailable, precision_unavailable
from tests.conftest import run_script, tiny_config, tiny_toml
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.config import TrainConfig, config_to_toml
from trainer.loop import Trainer

pytestmark = pytest.mark.slow


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A user's working directory holding a config and, after the first test, a trained run."""
    root = tmp_path_factory.mktemp("user")
    (root / "tiny.toml").write_text(tiny_toml(out_dir="out/tiny", data_dir="data"))
    return root


@pytest.fixture(scope="module")
def trained(workdir):
    result = run_script("train.py", "--config", "tiny.toml", cwd=workdir)
    assert result.returncode == 0, result.stderr
    return workdir, result


def test_train_prepares_the_bundled_data_and_writes_a_run(trained):
    workdir, result = trained
    assert "preparing the bundled dataset 'shakespeare_char'" in result.stdout
    assert (workdir / "data" / "shakespeare_char" / "meta.json").exists()
    assert {"ckpt.pt", "config.toml", "metrics.jsonl"} <= {p.name for p in (workdir / "out" / "tiny").iterdir()}
    assert "step 20: train loss" in result.stdout + result.stderr


def test_sample_streams_a_continuation_from_the_most_recent_run(trained):
    workdir, _ = trained
    result = run_script("sample.py", "--prompt", "ROMEO:", "--max-new-tokens", "100", "--device", "cpu", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ROMEO:")
    assert len(result.stdout) == len("ROMEO:") + 100 + 1  # 100 characters past a 32-token context, then a newline
    val_loss = [r["val_loss"] for r in map(json.loads, (workdir / "out/tiny/metrics.jsonl").open()) if "val_loss" in r]
    described = f"out/tiny/ckpt.pt (the newest run under out/; step 20 of 20, val loss {val_loss[-1]:.4f} at step 20)"
    assert f"sampling from {described} on cpu" in result.stderr
    if packing_unavailable(torch.device("cpu"), torch.float32) is None:
        assert "on cpu, linear layers packed for oneDNN, one-token steps by inference/decode_step.py" in result.stderr


@pytest.mark.skipif(
    precision_unavailable(torch.device("cpu"), torch.float32, "float16") is not None, reason="no float16 products here"
)
def test_sample_with_precision_float16_decodes_with_float16_weights_and_says_so(trained):
    workdir, _ = trained
    args = ["--prompt", "ROMEO:", "--max-new-tokens", "20", "--device", "cpu", "--precision", "float16"]
    result = run_script("sample.py", *args, "--temperature", "0", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout) == len("ROMEO:") + 20 + 1
    products = "float16 linear weights, fbgemm products (float32 activations)"
    assert f"on cpu, {products}, one-token steps by inference/decode_step.py" in result.stderr


def test_the_newest_run_is_described_with_its_step_of_max_iters_and_its_last_val_loss(trained, monkeypatch):
    """sample.py and eval.py say which run they picked; one stopped at step 10 of 20 is interrupted,
    and its val loss is the one recorded at its step, not the run's later ones."""
    workdir, _ = trained
    root = workdir / "described"
    shutil.copytree(workdir / "out" / "tiny", root / "out" / "half")
    state = load_checkpoint(root / "out" / "half" / "ckpt.pt")
    save_checkpoint(state | {"step": 10}, root / "out" / "half" / "ckpt.pt")
    records = [json.loads(line) for line in (root / "out" / "half" / "metrics.jsonl").open()]
    at_10 = next(r["val_loss"] for r in records if r.get("val_loss") is not None and r["step"] == 10)
    monkeypatch.chdir(root)
    _, _, described = load_model()
    assert described == (
        f"out/half/ckpt.pt (the newest run under out/; step 10 of 20, interrupted, val loss {at_10:.4f} at step 10)"
    )
    (root / "out" / "half" / "metrics.jsonl").unlink()
    assert load_model(out_dir="out/half")[2] == (
        "out/half/ckpt.pt (step 10 of 20, interrupted, no metrics.jsonl beside it, so no val loss)"
    )


def test_an_option_spelled_with_underscores_is_that_option(monkeypatch):
    """As config keys are spelled (train.max_iters): --max_new_tokens is --max-new-tokens."""
    monkeypatch.setattr(sys, "argv", ["sample.py", "--max_new_tokens=7", "--num_samples", "2", "--top-k", "5"])
    args = sample.parse_args()
    assert (args.max_new_tokens, args.num_samples, args.top_k) == (7, 2, 5)


def test_greedy_sampling_is_the_same_with_and_without_the_cache(trained):
    workdir, _ = trained
    args = (
        "--out-dir",
        "out/tiny",
        "--prompt",
        "KING:",
        "--temperature",
        "0",
        "--max-new-tokens",
        "60",
        "--device",
        "cpu",
    )
    cached = run_script("sample.py", *args, cwd=workdir)
    uncached = run_script("sample.py", *args, "--no-cache", cwd=workdir)
    assert cached.returncode == uncached.returncode == 0
    assert cached.stdout == uncached.stdout


def test_several_samples_are_separated(trained):
    workdir, _ = trained
    result = run_script(
        "sample.py", "--out-dir", "out/tiny", "--num-samples", "3", "--max-new-tokens", "10", cwd=workdir
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("-" * 40) == 2


def test_the_seed_makes_samples_reproducible(trained):
    workdir, _ = trained
    args = ("--out-dir", "out/tiny", "--temperature", "1", "--max-new-tokens", "40", "--device", "cpu")
    first, again, other = (run_script("sample.py", *args, "--seed", seed, cwd=workdir) for seed in ("1", "1", "2"))
    assert first.returncode == again.returncode == other.returncode == 0
    assert first.stdout == again.stdout
    assert first.stdout != other.stdout


def test_each_line_of_a_prompt_file_is_sampled_as_if_alone(trained):
    workdir, _ = trained
    prompts = ["JULIET:", "O Romeo, Romeo! wherefore", "A"]
    (workdir / "prompts.txt").write_text(prompts[0] + "\n\n" + "\n".join(prompts[1:]) + "\n")
    args = ("--out-dir", "out/tiny", "--max-new-tokens", "40", "--temperature", "1", "--device", "cpu")
    batch = run_script("sample.py", *args, "--prompt-file", "prompts.txt", "--seed", "7", cwd=workdir)
    assert batch.returncode == 0, batch.stderr
    samples = batch.stdout.split("\n" + "-" * 40 + "\n")
    assert len(samples) == 3
    for i, prompt in enumerate(prompts):
        alone = run_script("sample.py", *args, "--prompt", prompt, "--seed", str(7 + i), cwd=workdir)
        assert alone.returncode == 0, alone.stderr
        assert samples[i] == alone.stdout
        assert alone.stdout.startswith(prompt) and len(alone.stdout) == len(prompt) + 40 + 1


def test_sampling_ends_before_a_stop_string(trained):
    workdir, _ = trained
    args = ("--out-dir", "out/tiny", "--prompt", "ROMEO:", "--temperature", "0", "--max-new-tokens", "60")
    full = run_script("sample.py", *args, cwd=workdir)
    assert full.returncode == 0, full.stderr
    continuation = full.stdout[len("ROMEO:") : -1]
    stop = continuation[10:13]  # three characters from the middle of the greedy continuation
    stopped = run_script("sample.py", *args, "--stop", stop, "--stop", "never seen", cwd=workdir)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout == "ROMEO:" + continuation[: continuation.index(stop)] + "\n"


def test_stop_strings_keep_non_ascii_characters_and_read_escapes():
    from sample import unescape

    assert unescape("é—¿") == "é—¿"
    assert unescape("\\n\\nROMEO") == "\n\nROMEO"
    assert unescape("tab\\there") == "tab\there"


def test_bpe_sample_stops_at_end_of_text(bpe_data_dir, tmp_path):
    run_dir = tmp_path / "run"
    Trainer(
        tiny_config(run_dir, bpe_data_dir, data__dataset="shakespeare", train__max_iters=1, train__eval_iters=1)
    ).fit()
    checkpoint = load_checkpoint(run_dir / "ckpt.pt")
    weights = checkpoint["model"]
    # make <|endoftext|> (50256) by far the likeliest next token after any input
    direction = torch.zeros_like(weights["transformer.wte.weight"][50256])
    direction[0] = 10.0
    weights["transformer.wte.weight"][50256] = direction
    weights["transformer.ln_f.weight"].zero_()
    weights["transformer.ln_f.bias"].copy_(direction)
    save_checkpoint(checkpoint, run_dir / "ckpt.pt")
    result = run_script(
        "sample.py", "--out-dir", str(run_dir), "--prompt", "Hello", "--num-samples", "2", "--device", "cpu",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == "Hello\n\n" + "-" * 40 + "\nHello\n"


def test_bpe_model_trains_and_samples(bpe_data_dir, tmp_path):
    (tmp_path / "bpe.toml").write_text(tiny_toml(out_dir="run", data_dir=str(bpe_data_dir)))
    train = run_script(
        "train.py", "--config", "bpe.toml", "--data.dataset=shakespeare", "--train.max_iters=4",
        "--train.eval_interval=4", cwd=tmp_path,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr
    sample = run_script(
        "sample.py", "--out-dir", "run", "--prompt", "Hello", "--max-new-tokens", "8", "--device", "cpu", cwd=tmp_path,
    )  # fmt: skip
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("Hello") and len(sample.stdout) > len("Hello\n")


def test_a_bpe_trained_on_the_corpus_prepares_trains_and_samples_without_its_dataset(tmp_path):
    (tmp_path / "notes.txt").write_text((CORPUS_DIR / "tinyshakespeare.txt").read_text()[:40_000])
    prepare = run_script(
        "data/prepare.py", "--dataset", "notes.txt", "--tokenizer", "bpe", "--vocab-size", "320", "--out", "data/notes",
        "--block-size", "32", cwd=tmp_path,
    )  # fmt: skip
    assert prepare.returncode == 0, prepare.stderr
    assert "training a byte-level BPE of 320 tokens" in prepare.stdout and "vocabulary 320" in prepare.stdout
    assert {"tokenizer.json", "meta.json"} <= {p.name for p in (tmp_path / "data" / "notes").iterdir()}
    (tmp_path / "bpe.toml").write_text(tiny_toml(out_dir="run", data_dir="data"))
    train = run_script("train.py", "--config", "bpe.toml", "--data.dataset=notes", "--train.max_iters=4",
                       "--train.eval_interval=4", cwd=tmp_path)  # fmt: skip
    assert train.returncode == 0, train.stderr
    shutil.rmtree(tmp_path / "data")  # the checkpoint carries its tokenizer
    sample = run_script(
        "sample.py", "--out-dir", "run", "--prompt", "ROMEO: ¿qué? 🙂", "--max-new-tokens", "8", "--device", "cpu",
        cwd=tmp_path,
    )  # fmt: skip
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("ROMEO: ¿qué? 🙂") and len(sample.stdout) > len("ROMEO: ¿qué? 🙂\n")


def test_train_help_lists_the_config_keys():
    result = run_script("train.py", "--help")
    assert result.returncode == 0
    assert "model.n_layer" not in result.stdout  # keys are listed under their section
    assert "[optim]" in result.stdout and "  learning_rate " in result.stdout


def test_sample_help_states_the_context_policy():
    result = run_script("sample.py", "--help")
    assert result.returncode == 0
    assert "block_size // 2" in result.stdout


def test_train_refuses_to_overwrite_a_run_and_leaves_it_intact(trained):
    workdir, _ = trained
    checkpoint = workdir / "out" / "tiny" / "ckpt.pt"
    before = checkpoint.read_bytes()
    result = run_script("train.py", "--config", "tiny.toml", cwd=workdir)
    assert_one_line_error(result, "already holds a run", "--train.init_from=resume")
    assert checkpoint.read_bytes() == before


def test_train_without_a_config_refuses_at_once_naming_the_configs_and_the_quickstart(tmp_path):
    """Not GPT-2's size from the defaults, sitting at step 0 of 600,000: one line, and nothing written."""
    result = run_script("train.py", cwd=tmp_path)
    quickstart = "python train.py --config configs/shakespeare_char.toml"
    assert_one_line_error(result, "no --config given", "shakespeare_char_gpt2", quickstart)
    assert not any(tmp_path.iterdir())


def test_sample_rejects_a_corrupt_checkpoint(trained):
    workdir, _ = trained
    broken = workdir / "broken"  # outside out/, so no other test takes it for the latest run
    broken.mkdir()
    (broken / "ckpt.pt").write_bytes((workdir / "out" / "tiny" / "ckpt.pt").read_bytes()[:1000])
    result = run_script("sample.py", "--out-dir", "broken", cwd=workdir)
    assert_one_line_error(result, "broken/ckpt.pt is not a readable checkpoint")


def test_val_bench_scores_runs_on_the_same_windows_of_the_whole_split(trained):
    """bench/val.py: a row per run with the trainer's last val loss beside the loss over windows
    every --stride tokens of the whole split, and that in bits per byte; a run scored twice gets the same figure."""
    workdir, _ = trained
    result = run_script("bench/val.py", "out/tiny", "out/tiny", "--stride", "64", cwd=workdir)
    assert result.returncode == 0, result.stderr
    rows = [line.strip(" |").split(" | ") for line in result.stdout.splitlines() if line.startswith("| out/tiny")]
    assert len(rows) == 2 and rows[0] == rows[1]
    _, _, trainer_loss, split_loss, bits_per_byte, windows = rows[0]
    assert abs(float(split_loss) - float(trainer_loss)) < 0.2  # the same metric, on more text
    meta = json.loads((workdir / "data" / "shakespeare_char" / "meta.json").read_text())
    bytes_per_token = meta["val_bytes"] / meta["val_tokens"]  # 1 but for a few multi-byte characters
    assert float(bits_per_byte) == pytest.approx(float(split_loss) / math.log(2) / bytes_per_token, abs=1e-3)
    block_size = tomllib.loads((workdir / "tiny.toml").read_text())["model"]["block_size"]
    assert int(windows.replace(",", "")) == math.ceil((meta["val_tokens"] - block_size) / 64)


def test_budget_bench_projects_both_whole_runs_and_says_whether_the_candidate_fits(tmp_path, data_dir):
    """bench/budget.py, the tool behind the quickstart's wall-time budget: the same model projected
    over 1000x the steps is over a 10% budget, and the most steps it may take are few."""
    (tmp_path / "reference.toml").write_text(config_to_toml(tiny_config(tmp_path / "a", data_dir)))
    longer = tiny_config(tmp_path / "b", data_dir, train__max_iters=20000, optim__lr_decay_iters=20000)
    (tmp_path / "longer.toml").write_text(config_to_toml(longer))
    args = ["--reference", "reference.toml", "--candidate", "longer.toml", "--rounds", "2", "--block", "2"]
    result = run_script("bench/budget.py", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith(("| reference", "| candidate"))]
    assert [row.split(" | ")[3] for row in rows] == ["20", "20,000"]  # the steps each whole run takes
    assert "within budget: no" in result.stdout
    most = int(result.stdout.split("most candidate steps within budget: ")[1].replace(",", ""))
    assert 0 < most < 20000


# what nanoGPT's train.py prints on a CPU, cut down: evaluations, checkpoint notes and steps between them
NANOGPT_LOG = """\
tokens per iteration will be: 768
found vocab_size = 65 (inside data/shakespeare_char/meta.pkl)
step 0: train loss 4.1664, val loss 4.1617
iter 0: loss 4.1650, time 1036.86ms, mfu -100.00%
step 250: train loss 2.3912, val loss 2.4123
saving checkpoint to out-shakespeare-char
iter 250: loss 2.4233, time 1104.01ms, mfu 0.04%
step 2000: train loss 1.7601, val loss 1.8857
iter 2000: loss 1.7752, time 1100.30ms, mfu 0.05%
"""


def test_speedrun_bench_reads_the_val_loss_of_nanogpts_last_evaluation():
    from bench.speedrun import nanogpt_val_loss

    assert nanogpt_val_loss(NANOGPT_LOG) == 1.8857
    with pytest.raises(UserError, match="printed no 'step N: train loss X, val loss Y' line; its last: iter 0"):
        nanogpt_val_loss("iter 0: loss 4.1650, time 1036.86ms, mfu -100.00%\n")


def test_speedrun_bench_times_both_whole_processes_beside_a_nanogpt_left_untouched(tmp_path, data_dir):
    """bench/speedrun.py on a stand-in for nanoGPT that checks its recipe and its copied input and
    prints nanoGPT's lines: both programs' val losses, the ratio, the JSON; the given folder unchanged."""
    fake = tmp_path / "nanoGPT"
    (fake / "config").mkdir(parents=True)
    (fake / "config" / "train_shakespeare_char.py").write_text("")
    (fake / "data" / "shakespeare_char").mkdir(parents=True)
    (fake / "data" / "shakespeare_char" / "prepare.py").write_text(
        "import os; assert os.path.getsize('input.txt') == 1115394; open('train.bin', 'w').close()\n"
    )
    (fake / "train.py").write_text(
        "import os, sys\n"
        "assert '--device=cpu' in sys.argv and '--max_iters=2000' in sys.argv\n"
        "assert os.environ['OMP_NUM_THREADS'] == '1'\n"
        "assert os.path.exists('data/shakespeare_char/train.bin')\n"
        "os.makedirs('out-shakespeare-char', exist_ok=True)\n"
        f"print({NANOGPT_LOG!r})\n"
    )
    before = sorted(p.relative_to(fake) for p in fake.rglob("*"))
    (tmp_path / "tiny.toml").write_text(tiny_toml(tmp_path / "unused", data_dir))
    args = ["--nanogpt", str(fake), "--config", "tiny.toml", "--repeats", "1", "--threads", "1", "--json", "s.json"]
    result = run_script("bench/speedrun.py", *args, "--train.max_iters=2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(p.relative_to(fake) for p in fake.rglob("*")) == before
    figures = json.loads((tmp_path / "s.json").read_text())
    assert figures["reference"]["median_val_loss"] == 1.8857
    assert figures["ours"]["median_val_loss"] > 3  # two steps of a tiny model: near ln(65)
    assert figures["wall_ratio"] == figures["reference"]["median_wall_s"] / figures["ours"]["median_wall_s"]
    assert "| nanoGPT's CPU recipe |" in result.stdout and "nanoGPT / ours, whole process: " in result.stdout
    assert "ours reaches nanoGPT's val loss: no" in result.stdout


def test_speedrun_bench_against_a_config_scores_both_on_the_whole_val_split_seed_by_seed(tmp_path, data_dir):
    """--against: a config of ours as the reference, run in turns with ours, each round at the next of
    --seeds; both runs scored on the whole val split, as bench/val.py scores the same run."""
    from bench.val import score_run

    (tmp_path / "tiny.toml").write_text(tiny_toml(tmp_path / "unused", data_dir))  # 20 steps
    args = ["--against", "tiny.toml", "--config", "tiny.toml", "--repeats", "3", "--seeds", "1", "2"]
    result = run_script(
        "bench/speedrun.py", *args, "--threads", "1", "--json", "s.json", "--train.max_iters=2", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads((tmp_path / "s.json").read_text())
    assert figures["reference"]["program"] == "tiny.toml" and figures["val_loss"] == "whole val split (bench/val.py)"
    for name in ("reference", "ours"):
        assert [run["seed"] for run in figures[name]["runs"]] == [1, 2, 1]
    assert figures["ours"]["runs"][0]["val_loss"] == figures["ours"]["runs"][2]["val_loss"]  # seed 1 twice
    assert figures["ours"]["runs"][0]["val_loss"] != figures["ours"]["runs"][1]["val_loss"]
    train = ["--config", "tiny.toml", "--train.max_iters=2", "--train.seed=1", "--train.out_dir=seed1"]
    assert run_script("train.py", *train, cwd=tmp_path).returncode == 0
    assert figures["ours"]["runs"][0]["val_loss"] == score_run(tmp_path / "seed1", "val", 16)["loss"]
    assert figures["reference"]["median_val_loss"] < figures["ours"]["median_val_loss"]  # 20 steps against 2
    assert (
        "tiny.toml / ours, whole process: " in result.stdout
        and "ours reaches tiny.toml's val loss: no" in result.stdout
    )


# a stand-in for nanoGPT's model.py: its GPTConfig, GPT(config)(idx, targets) -> (logits, loss) and
# configure_optimizers, on a model small enough to step in milliseconds
NANOGPT_MODEL = """\
from dataclasses import dataclass
import torch
from torch import nn
from torch.nn import functional as F

@dataclass
class GPTConfig:
    block_size: int; vocab_size: int; n_layer: int; n_head: int; n_embd: int; dropout: float; bias: bool

class MLP(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.fc = nn.Linear(n, n)
    def forward(self, x):
        return F.gelu(self.fc(x))

class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.mlp = MLP(config.n_embd)
        print("number of parameters: (a note this stand-in prints, as nanoGPT does)")
    def forward(self, idx, targets):
        logits = self.mlp(self.wte(idx)) @ self.wte.weight.T
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        return torch.optim.AdamW(self.parameters(), lr=learning_rate, betas=betas, weight_decay=weight_decay)
"""


def test_step_profile_bench_splits_both_steps_into_their_parts(tmp_path, data_dir):
    """bench/step_profile.py beside a stand-in model.py: the ratio line, a row per part with both
    programs' CPU time, the MLP's forward timed in both, and nothing of nanoGPT's notes printed."""
    fake = tmp_path / "nanoGPT"
    for name in ("train.py", "config/train_shakespeare_char.py", "data/shakespeare_char/prepare.py"):
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text("")
    (fake / "model.py").write_text(NANOGPT_MODEL)
    (tmp_path / "tiny.toml").write_text(tiny_toml(tmp_path / "unused", data_dir))
    args = ["--nanogpt", str(fake), "--config", "tiny.toml", "--rounds", "2"]
    result = run_script("bench/step_profile.py", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "ours / nanoGPT " in result.stdout and "number of parameters" not in result.stdout
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:3] for line in result.stdout.splitlines() if " | " in line}
    for part in ("data", "forward", "forward: MLP", "backward", "clipping", "optimizer", "whole step"):
        assert all(float(ms) > 0 for ms in rows[part]), (part, result.stdout)
    assert "forward: CausalSelfAttention" in rows  # ours has attention; the stand-in has none (0.00)


@pytest.mark.parametrize("at_start, evaluations", [(True, 3), (False, 2)])
def test_train_bench_projects_the_evaluation_at_start_only_where_the_run_does_one(at_start, evaluations):
    from bench.train import run_parts

    train = TrainConfig(max_iters=130, eval_interval=100, eval_at_start=at_start)
    parts = {name.split(" (")[0]: count for name, count, _ in run_parts(train, 2.0, 0.05, 0.3, 0.01)}
    assert (parts["evaluations"], parts["checkpoints"], parts["optimizer steps"]) == (evaluations, 2, 130)


def test_ablation_compares_each_variant_with_the_recipe_it_was_added_to():
    from bench.ablation import base_of, table

    assert base_of("rope") == "gpt2" and base_of("quickstart (all)") == "quickstart (all)"
    assert base_of("normuon") == base_of("block_size_schedule=32:0.3") == "quickstart before NorMuon"
    runs = [("gpt2", 1.8), ("rope", 1.7), ("quickstart before NorMuon", 1.6), ("normuon", 1.58)]
    rows = table([{"variant": v, "seed": 1, "val_loss": loss, "wall_s": 100.0} for v, loss in runs])
    assert "| rope | 1 | 1.7000 | 0.0000 | gpt2 | -0.1000 |" in rows[3]
    assert "| normuon | 1 | 1.5800 | 0.0000 | quickstart before NorMuon | -0.0200 |" in rows[5]
