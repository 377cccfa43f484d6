import contextlib
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.corpus import prepare_bundled
from errors import run_cli
from model import GPT, GPTConfig
from trainer.config import Config, build_config, config_to_toml
from trainer.runtime import usable_cores

PROJECT_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def offline_hugging_face(tmp_path_factory):
    """No test reaches the network or the user's Hugging Face cache. `datasets` reads these
    variables when it is imported, so nothing may import it before this fixture runs (the project
    imports it only inside the functions that use it); subprocesses inherit them."""
    assert "datasets" not in sys.modules, "datasets was imported before the test environment was set"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
        yield


@pytest.fixture(scope="session", autouse=True)
def cores_shared_among_workers(request):
    """Under pytest-xdist (-n) the worker processes share the cores: each worker's torch operators, and
    the processes its tests start, get the usable cores divided among the workers (at least one
    thread), where each would take one per core (n workers on c cores, n * c threads) and every
    operator wait for threads that the other workers had descheduled. On 2 cores with 2 workers a
    subset of 248 in-process tests took 27.6 s against 38.7 s, but the whole suite about as long as
    with a thread per core (9 min 24 s against 9 min 8 s); the share matters where cores are many.
    Tests that ask for a count of their own still set it. The processes a test starts inherit
    OMP_NUM_THREADS: in them torch's default, and with it train.threads = 0's choice and the
    benches' default --threads, is that share, not one per core."""
    workers = getattr(request.config, "workerinput", {}).get("workercount", 1)
    if workers <= 1:
        yield
        return
    threads = max(1, usable_cores() // workers)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("OMP_NUM_THREADS", str(threads))
            yield
    finally:
        torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@contextlib.contextmanager
def tf32_off():
    """Within it, float32 matrix products on CUDA are exact (TF32 off: a trainer on CUDA turns it on);
    after it, TF32 is as it was. Set and restored by hand: pytest's monkeypatch (9.x) restores an
    instance's attribute from its __dict__, where torch.backends.cuda.matmul keeps no flag, so its
    undo fails on these flags."""
    flags = (torch.backends.cuda.matmul, torch.backends.cudnn)
    before = [flag.allow_tf32 for flag in flags]
    try:
        for flag in flags:
            flag.allow_tf32 = False
        yield
    finally:
        for flag, value in zip(flags, before, strict=True):
            flag.allow_tf32 = value


@pytest.fixture
def exact_float32_products():
    with tf32_off():
        yield


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """A data folder with the bundled char-level Shakespeare prepared in it."""
    root = tmp_path_factory.mktemp("data")
    prepare_bundled("shakespeare_char", root)
    return root


@pytest.fixture(scope="session")
def bpe_data_dir(tmp_path_factory) -> Path:
    """A data folder with the bundled Shakespeare prepared with GPT-2 BPE."""
    root = tmp_path_factory.mktemp("bpe_data")
    prepare_bundled("shakespeare", root)
    return root


CHAT_WORDS = ["dog", "cat", "lamb", "crow", "deer", "goat", "swan", "bee", "horse", "mouse"]


@pytest.fixture(scope="session")
def chat_run(tmp_path_factory, data_dir) -> Path:
    """A tiny character run fine-tuned for a few steps on spelling conversations (with document masking,
    as the chat recipe trains)."""
    from data.chat_dataset import prepare_chat
    from data.conversations import read_conversations
    from trainer.loop import Trainer

    root = tmp_path_factory.mktemp("chat_run")
    Trainer(tiny_config(root / "plain", data_dir, model__block_size=64, train__max_iters=4)).fit()
    chats = root / "chats.jsonl"
    records = [
        {"messages": [{"role": "user", "content": f"spell: {w}"}, {"role": "assistant", "content": " ".join(w)}]}
        for w in CHAT_WORDS * 3
    ]
    chats.write_text("".join(json.dumps(record) + "\n" for record in records))
    prepare_chat(read_conversations(str(chats)), str(root / "plain"), root / "chat", source="chats.jsonl",
                 block_size=64, val_fraction=0.2)  # fmt: skip
    cfg = tiny_config(root / "run", root, data__dataset="chat", model__block_size=64, model__attn_documents=True,
                      train__init_from=str(root / "plain"), train__max_iters=6)  # fmt: skip
    Trainer(cfg).fit()
    return root / "run"


def tiny_values(out_dir: Path, data_dir: Path) -> dict:
    """Config values for a model and run small enough to train in seconds on a CPU."""
    return {
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "dropout": 0.0},
        "data": {"dataset": "shakespeare_char", "data_dir": str(data_dir), "batch_size": 4},
        "optim": {"learning_rate": 1e-3, "min_lr": 1e-4, "warmup_iters": 2, "lr_decay_iters": 20},
        "train": {
            "out_dir": str(out_dir),
            "device": "cpu",
            "dtype": "float32",
            "max_iters": 20,
            "eval_interval": 10,
            "eval_iters": 2,
            "log_interval": 1,
            "threads": 1,  # not train.threads=0, which chooses from the machine's load: the same numbers every time
        },
    }


def tiny_config(out_dir: Path, data_dir: Path, **overrides) -> Config:
    """tiny_values with overrides given as section__key=value."""
    values = tiny_values(out_dir, data_dir)
    for name, value in overrides.items():
        section, key = name.split("__")
        values.setdefault(section, {})[key] = value
    return build_config(values)


def tiny_toml(out_dir: Path, data_dir: Path) -> str:
    return config_to_toml(tiny_config(out_dir, data_dir))


def tiny_model(vocab_size: int = 50, block_size: int = 32, seed: int = 0, **kwargs) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=block_size, vocab_size=vocab_size, **kwargs)
    return GPT(config).eval()


def fixed_tokens(rows: int, block_size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed (x, y) token rows, the same in every process that asks."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab_size, (rows, block_size), generator=generator)
    y = torch.randint(0, vocab_size, (rows, block_size), generator=generator)
    return x, y


class FixedBatches:
    """Stands in for a trainer's RandomWindows: hands out consecutive rows of fixed tensors."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int):
        self.x, self.y, self.batch_size, self.at = x, y, batch_size, 0

    def next_batch(self, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:  # its own shape, whatever is asked
        rows = slice(self.at, self.at + self.batch_size)
        self.at += self.batch_size
        return self.x[rows], self.y[rows]


def capture_gradients(trainer) -> dict[str, torch.Tensor]:
    """Make the trainer's optimizer record the full gradient of each parameter (gathered when FSDP
    shards it) before it steps. Returns the dict it fills."""
    gradients = {}
    step = trainer.optimizer.step

    def record_then_step(*args, **kwargs):
        for name, param in trainer.model.named_parameters():
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            gradients[name] = grad.detach().clone()
        return step(*args, **kwargs)

    trainer.optimizer.step = record_then_step
    return gradients


def run_script(script: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run one of the project's entry points as a user would, in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, str(PROJECT_ROOT / script), *args],
        cwd=cwd or PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_entry_point(script: str, args: list[str], monkeypatch) -> int:
    """Call an entry point's main() through run_cli, as the script does, in this process (faster than
    a subprocess); returns its exit status."""
    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(SystemExit) as exit_info:
        run_cli(module.main)
    return exit_info.value.code


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
