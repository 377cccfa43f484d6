"""The catalogue of bad inputs (docs/bad-inputs.md): each one gets one line starting with `error:`,
exit status 2, no traceback, and leaves every file it found exactly as it was."""

import errno
import importlib
import io
import json
import os
import shutil
import socket
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import interop.pretrained as pretrained_module
import trainer.checkpoint as checkpoint_module
import trainer.metrics as metrics_module
from data.corpus import CORPUS_DIR, prepare_text
from data.files import FileLock
from data.loader import TRAINED
from data.tokenizer import CharTokenizer, GPT2Tokenizer
from errors import PROJECT_MODULES, run_cli
from inference.load import model_from_checkpoint
from interop.families import FAMILY_BY_TYPE, hf_config, tensors_to_hf
from interop.hf import read_safetensors, write_safetensors
from interop.pretrained import export_model
from tests.conftest import PROJECT_ROOT, run_entry_point, snapshot, tiny_config, tiny_model, tiny_toml
from trainer.checkpoint import load_checkpoint
from trainer.loop import Trainer


@dataclass
class Case:
    id: str
    script: str  # the entry point: train.py, sample.py, serve.py, eval.py, data/prepare.py, plot.py or a bench/ script
    args: list[str]  # run in a workspace holding tiny.toml, data/shakespeare_char and the trained run out/tiny
    message: str  # a fragment of the one-line error
    setup: Callable[[Path], None] = lambda workspace: None  # makes the bad input
    env: dict[str, str] = field(default_factory=dict)
    needs_no_gpu: bool = False
    needs_permissions: bool = False  # file permissions bind the user (not root, who may write anywhere)
    not_installed: str = ""  # a third-party package the entry point cannot import, as where it is not installed


class RunsCodeWhenUnpickled:
    def __reduce__(self):
        return (print, ("this ran while loading",))


def write(relative: str, text: str) -> Callable[[Path], None]:
    return lambda workspace: (workspace / relative).write_text(text)


def write_files(*relative: str) -> Callable[..., None]:
    """Make files (and their folders) holding text."""

    def setup(workspace: Path, text: str = "someone else's\n") -> None:
        for name in relative:
            (workspace / name).parent.mkdir(parents=True, exist_ok=True)
            (workspace / name).write_text(text)

    return setup


def hold_lock(relative: str) -> Callable[[Path], None]:
    """Take a run directory's lock as a running training holds it (the lock is this test's until it ends)."""
    held = []

    def setup(workspace: Path) -> None:
        lock = FileLock(workspace / relative)
        assert lock.acquire() is None
        held.append(lock)

    return setup


def reverse_characters(workspace: Path) -> None:
    """The same 65 characters, each under another id: a dataset of another text with a vocabulary of the same size."""
    path = workspace / "data" / "shakespeare_char" / "meta.json"
    edit_meta(chars=json.loads(path.read_text())["chars"][::-1])(workspace)


def edit_meta(**changes) -> Callable[[Path], None]:
    def setup(workspace: Path) -> None:
        path = workspace / "data" / "shakespeare_char" / "meta.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | changes))

    return setup


def edit_checkpoint(change: Callable[[dict], object]) -> Callable[[Path], None]:
    def setup(workspace: Path) -> None:
        path = workspace / "out" / "tiny" / "ckpt.pt"
        checkpoint = torch.load(path, weights_only=True)
        torch.save(change(checkpoint) or checkpoint, path)

    return setup


def with_unet_skips(checkpoint: dict) -> None:
    """Make a checkpoint of the tiny run one of the same model with U-net skips (one weight more)."""
    checkpoint["config"]["model"]["unet_skips"] = True
    checkpoint["model"]["skips.weight"] = torch.ones(1)


def set_value(name: str, value: float) -> Callable[[dict], None]:
    """Set one value of the tensor name, in a checkpoint or a table of tensors, to value."""

    def change(tensors: dict) -> None:
        tensors = tensors.get("model", tensors)
        tensors[name].view(-1)[0] = value

    return change


def shrink_vocabulary(workspace: Path) -> None:
    """meta.json of 10 characters beside token ids of 65."""
    chars = json.loads((workspace / "data" / "shakespeare_char" / "meta.json").read_text())["chars"]
    edit_meta(vocab_size=10, chars=chars[:10])(workspace)


def widen_token_dtype(workspace: Path) -> None:
    """meta.json reading the uint16 ids as half as many uint32 ones: the sizes agree, the ids do not."""
    meta = json.loads((workspace / "data" / "shakespeare_char" / "meta.json").read_text())
    edit_meta(dtype="uint32", train_tokens=meta["train_tokens"] // 2, val_tokens=meta["val_tokens"] // 2)(workspace)


def insert_metrics_line(text: str) -> Callable[[Path], None]:
    """out/tiny/metrics.jsonl with text as its second line."""

    def setup(workspace: Path) -> None:
        path = workspace / "out" / "tiny" / "metrics.jsonl"
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join([lines[0], text + "\n", *lines[1:]]))

    return setup


def read_only_folder(relative: str) -> Callable[[Path], None]:
    def setup(workspace: Path) -> None:
        (workspace / relative).mkdir(parents=True)
        (workspace / relative).chmod(0o555)

    return setup


def gpt2_dir(
    config: Callable[[dict], None] = lambda config: None,
    header: Callable[[dict], None] = lambda header: None,
    weights: Callable[[dict], None] = lambda tensors: None,
) -> Callable[[Path], None]:
    """A tiny Hugging Face GPT-2 directory, gpt2/, whose config.json, safetensors header and
    tensors the given functions change first."""

    def setup(workspace: Path) -> None:
        model = tiny_model(vocab_size=64)
        tensors = tensors_to_hf(model.state_dict(), model.config, FAMILY_BY_TYPE["gpt2"])
        weights(tensors)
        buffer = io.BytesIO()
        write_safetensors(tensors, buffer, metadata={"format": "pt"})
        data = buffer.getvalue()
        header_len = struct.unpack("<Q", data[:8])[0]
        table = json.loads(data[8 : 8 + header_len])
        header(table)
        header_bytes = json.dumps(table).encode("utf-8")
        (workspace / "gpt2").mkdir()
        (workspace / "gpt2" / "model.safetensors").write_bytes(
            struct.pack("<Q", len(header_bytes)) + header_bytes + data[8 + header_len :]
        )
        settings = hf_config(model.config, FAMILY_BY_TYPE["gpt2"], bos_token_id=None, eos_token_id=None)
        config(settings)
        (workspace / "gpt2" / "config.json").write_text(json.dumps(settings))

    return setup


def llama_dir(
    config: Callable[[dict], None] = lambda config: None,
    tokenizer_json: str | None = None,
    weights: Callable[[dict], None] | None = None,
) -> Callable[[Path], None]:
    """A tiny Llama-family folder, llama/, exported from a model of ours, whose config.json config
    changes, whose tensors weights changes and whose tokenizer.json is tokenizer_json, when given."""

    def setup(workspace: Path) -> None:
        model = tiny_model(vocab_size=65, pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False)
        export_model(model, CharTokenizer("".join(chr(32 + i) for i in range(65))), workspace / "llama")
        if weights is not None:
            path = workspace / "llama" / "model.safetensors"
            tensors = {name: t.clone() for name, t in read_safetensors(path).items()}  # not the mapped file's
            weights(tensors)
            with open(path, "wb") as f:
                write_safetensors(tensors, f, metadata={"format": "pt"})
        settings = json.loads((workspace / "llama" / "config.json").read_text())
        config(settings)
        (workspace / "llama" / "config.json").write_text(json.dumps(settings))
        if tokenizer_json is not None:
            (workspace / "llama" / "tokenizer.json").write_text(tokenizer_json)

    return setup


def llama_dir_naming(**names: str) -> Callable[[Path], None]:
    """llama/ (llama_dir) with a chat template, its tokenizer_config.json naming these special tokens."""

    def setup(workspace: Path) -> None:
        llama_dir()(workspace)
        path = workspace / "llama" / "tokenizer_config.json"
        template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
        path.write_text(json.dumps(json.loads(path.read_text()) | {"chat_template": template, **names}))

    return setup


def gguf_file(fields: dict | None = None, types: dict | None = None) -> Callable[[Path], None]:
    """model.gguf: a tiny Qwen2 model as sample.py --export-gguf writes it, with metadata (key -> (value,
    type, sub type)) and tensor types changed as another program might write them; types by their names in
    gguf's GGUFValueType and GGMLQuantizationType (gguf is imported when the file is made)."""

    def setup(workspace: Path) -> None:
        import gguf

        from interop.gguf import export_gguf
        from tests.test_gguf import rewrite_gguf

        named = {
            key: (value, kind and gguf.GGUFValueType[kind], sub) for key, (value, kind, sub) in (fields or {}).items()
        }
        tensor_types = {name: gguf.GGMLQuantizationType[kind] for name, kind in (types or {}).items()}

        model = tiny_model(vocab_size=65, pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=True)
        tokenizer = CharTokenizer("".join(chr(32 + i) for i in range(65)))
        export_gguf(model, tokenizer, workspace / "plain.gguf", "float32", source=workspace)
        rewrite_gguf(workspace / "plain.gguf", workspace / "model.gguf", named or None, tensor_types or None)

    return setup


def export_run(workspace: Path) -> None:
    """exported/: the trained run out/tiny as sample.py --export writes it, its 65 characters as a tokenizer.json."""
    path = workspace / "out" / "tiny" / "ckpt.pt"
    export_model(*model_from_checkpoint(load_checkpoint(path), path), workspace / "exported")


def word_level_tokenizer_json() -> str:
    """A tokenizer.json of 65 words, split at spaces (which no token stands for: a WordLevel's design)."""
    import tokenizers

    vocab = {"[UNK]": 0} | {f"word{i}": i for i in range(1, 65)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return tokenizer.to_str()


def lie_about_header_length(workspace: Path) -> None:
    gpt2_dir()(workspace)
    path = workspace / "gpt2" / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 2**40) + path.read_bytes()[8:])


def shard_outside_the_directory(workspace: Path) -> None:
    gpt2_dir()(workspace)
    (workspace / "gpt2" / "model.safetensors").unlink()
    weight_map = {"transformer.wte.weight": "../tiny.toml"}
    (workspace / "gpt2" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def truncate_checkpoint(workspace: Path) -> None:
    path = workspace / "out" / "tiny" / "ckpt.pt"
    path.write_bytes(path.read_bytes()[:1000])


def append_to_val_split(workspace: Path) -> None:
    with open(workspace / "data" / "shakespeare_char" / "val.bin", "ab") as f:
        f.write(b"\x00")


def empty_val_split(workspace: Path) -> None:
    (workspace / "data" / "shakespeare_char" / "val.bin").write_bytes(b"")
    edit_meta(val_tokens=0)(workspace)


def bpe_dataset(name: str, start: int = 0, vocab_size: int = 300) -> Callable[[Path], None]:
    """data/<name>: 30,000 characters of Shakespeare from start, with a BPE of vocab_size trained on them."""

    def setup(workspace: Path) -> None:
        text = (CORPUS_DIR / "tinyshakespeare.txt").read_text()[start : start + 30_000]
        prepare_text(text, "bpe", workspace / "data" / name, source=name, vocab_size=vocab_size, block_size=32)

    return setup


def remove_dataset_tokenizer(workspace: Path) -> None:
    bpe_dataset("notes")(workspace)
    (workspace / "data" / "notes" / "tokenizer.json").unlink()


def replace_dataset_tokenizer(workspace: Path) -> None:
    """tokenizer.json of another BPE of the same size: the ids would read as other text."""
    bpe_dataset("notes")(workspace)
    bpe_dataset("other", start=30_000)(workspace)
    shutil.copy(workspace / "data" / "other" / "tokenizer.json", workspace / "data" / "notes" / "tokenizer.json")


def bpe_run_and_another_bpe_dataset(workspace: Path) -> None:
    """out/bpe trained on data/notes; data/other has a BPE of the same size trained on other text."""
    bpe_dataset("notes")(workspace)
    bpe_dataset("other", start=30_000)(workspace)
    config = tiny_config(workspace / "out" / "bpe", workspace / "data", data__dataset="notes", train__max_iters=1)
    Trainer(config).fit()


# a port held for the session by a listening socket of this process: serve.py finds it in use
BUSY_SOCKET = socket.create_server(("127.0.0.1", 0))
BUSY_PORT = BUSY_SOCKET.getsockname()[1]

TRAIN = ["--config", "tiny.toml"]
RESUME = ["--config", "out/tiny/config.toml", "--train.init_from=resume"]
EVAL = ["--out-dir", "out/tiny", "--device", "cpu", "--no-progress", "--tasks"]
ITEM = '{"ctx": "ROMEO:", "endings": ["Peace!", "Away!"], "label": 0}\n'  # a good multiple-choice item
TORCHRUN_OF_2 = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
# rank 0 of 2, meeting the other at a port of the system's choosing, where it never comes
ALONE_OF_2 = TORCHRUN_OF_2 | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}

CORPUS_TEXT = (CORPUS_DIR / "tinyshakespeare.txt").read_text()[:5000]
CHAT_PREPARE = ["--dataset", "chats.jsonl", "--chat", "--tokenizer", "char", "--out", "chat"]
CHAT_REPLY = {"role": "assistant", "content": "ho"}


def write_chats(*records: dict) -> Callable[[Path], None]:
    return write("chats.jsonl", "".join(json.dumps(record) + "\n" for record in records))


def chat_model_folder(template: str) -> Callable[[Path], None]:
    """A model folder whose tokenizer_config.json holds the chat template."""

    def setup(workspace: Path) -> None:
        folder = workspace / "chatmodel"
        folder.mkdir()
        (folder / "tokenizer.json").write_text(CharTokenizer.from_text(CORPUS_TEXT).to_json())
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        write_chats({"messages": [{"role": "user", "content": "hi"}, CHAT_REPLY]})(workspace)

    return setup


def chat_dataset_of_the_run(workspace: Path) -> None:
    """data/chat: conversations rendered with out/tiny's characters and the built-in template."""
    from data.chat_dataset import prepare_chat
    from data.conversations import read_conversations

    write_chats(*[{"messages": [{"role": "user", "content": "hi"}, CHAT_REPLY]}] * 20)(workspace)
    conversations = read_conversations(str(workspace / "chats.jsonl"))
    prepare_chat(conversations, str(workspace / "out" / "tiny"), workspace / "data" / "chat", source="chats.jsonl",
                 block_size=32, val_fraction=0.3)  # fmt: skip


def chat_dataset_without_trained_val_tokens(workspace: Path) -> None:
    """data/chat whose val split has no trained token: every reply cut off (its mask as an older prepare.py wrote it)."""
    chat_dataset_of_the_run(workspace)
    mask = workspace / "data" / "chat" / "val.mask.bin"
    mask.write_bytes(bytes(flags & ~TRAINED for flags in mask.read_bytes()))


RL = ["--data.dataset=chat", "--train.init_from=out/tiny", "--rl.task=q.jsonl", "--rl.max_new_tokens=8"]
RL_QUESTION = '{"messages": [{"role": "user", "content": "hi"}], "answer": "h o"}\n'  # a good generation item


def chat_questions(text: str) -> Callable[[Path], None]:
    """data/chat (out/tiny's characters with the chat template) and q.jsonl holding text."""
    return lambda workspace: (chat_dataset_of_the_run(workspace), write("q.jsonl", text)(workspace))


def lora_run(workspace: Path) -> None:
    """out/lora: LoRA adapters of rank 2 trained on out/tiny."""
    Trainer(tiny_config(workspace / "out" / "lora", workspace / "data", train__init_from="out/tiny", train__max_iters=2,
                        lora__rank=2)).fit()  # fmt: skip


def lora_run_on_a_changed_base(workspace: Path) -> None:
    """out/lora: LoRA adapters trained on out/tiny, whose weights then change."""
    lora_run(workspace)
    edit_checkpoint(set_value("transformer.ln_f.weight", 0.5))(workspace)


def lora_run_and_a_model_folder(workspace: Path) -> None:
    """out/lora, and models/base: the folder of a Hugging Face model (its config and weights)."""
    lora_run(workspace)
    write_files("models/base/config.json", "models/base/model.safetensors")(workspace)


CATALOGUE = [
    # ---- train.py ----
    # config files and overrides
    Case("toml-syntax", "train.py", ["--config", "bad.toml"], "is not valid TOML", write("bad.toml", "[model]\nn_layer = = 2\n")),
    Case("toml-nested-too-deeply", "train.py", ["--config", "bad.toml"], "config file bad.toml cannot be read: it is nested deeper than Python's parser follows", write("bad.toml", "x = " + "[" * 100_000 + "\n")),
    Case("key-outside-section", "train.py", ["--config", "bad.toml"], "n_layer = 2 in bad.toml is outside any section", write("bad.toml", "n_layer = 2\n")),
    Case("unknown-section", "train.py", ["--config", "bad.toml"], "unknown config section [modle]", write("bad.toml", "[modle]\nn_layer = 2\n")),
    Case("unknown-key", "train.py", [*TRAIN, "--model.n_layers=2"], "unknown config key model.n_layers (did you mean model.n_layer?"),
    Case("wrong-type-in-file", "train.py", ["--config", "bad.toml"], "model.n_layer='2' in bad.toml is not an integer", write("bad.toml", '[model]\nn_layer = "2"\n')),
    Case("wrong-type-on-command-line", "train.py", [*TRAIN, "--train.max_iters=ten"], "train.max_iters='ten' on the command line is not an integer"),
    Case("not-a-finite-number", "train.py", ["--config", "bad.toml"], "optim.learning_rate=nan in bad.toml is not a finite number", write("bad.toml", "[optim]\nlearning_rate = nan\n")),
    Case("override-without-value", "train.py", [*TRAIN, "--train.max_iters"], "--train.max_iters needs a value"),
    Case("stray-argument", "train.py", [*TRAIN, "shakespeare"], "unexpected argument 'shakespeare'"),
    Case("missing-config-file", "train.py", ["--config", "nowhere.toml"], "config file nowhere.toml does not exist"),
    Case("config-is-a-directory", "train.py", ["--config", "out"], "config file out cannot be read"),
    Case("invalid-choice", "train.py", [*TRAIN, "--train.dtype=fp8"], "train.dtype='fp8' is not one of auto, float32, bfloat16, float16"),
    Case("init-from-typo", "train.py", [*TRAIN, "--train.init_from=resum"], "train.init_from='resum' is neither scratch nor resume nor a directory (use scratch for a new run, resume to continue"),
    Case("init-from-a-run-not-trained-yet", "train.py", [*TRAIN, "--train.init_from=out/shakespeare_char"], "train.init_from='out/shakespeare_char' does not exist yet: it is the run of configs/shakespeare_char.toml (train it first: python train.py --config configs/shakespeare_char.toml)"),
    # impossible sizes and settings
    Case("heads-do-not-divide-width", "train.py", [*TRAIN, "--model.n_embd=100", "--model.n_head=3"], "model.n_embd=100 is not divisible by n_head=3"),
    Case("zero-layers", "train.py", [*TRAIN, "--model.n_layer=0"], "model.n_layer=0 must be a positive integer"),
    Case("dropout-out-of-range", "train.py", [*TRAIN, "--model.dropout=1.5"], "model.dropout=1.5 must be in [0, 1)"),
    Case("contradictory-attention-patterns", "train.py", [*TRAIN, "--model.attn_prefix_lm", "--model.attn_block=4"], "model.attn_prefix_lm=true cannot be combined with attn_block=4"),
    Case("sinks-with-prefix-lm", "train.py", [*TRAIN, "--model.attn_prefix_lm", "--model.attn_sinks=2"], "model.attn_prefix_lm=true cannot be combined with attn_sinks=2: a sink sees only its own past, but the prefix is read both ways"),
    Case("sinks-with-block-causal", "train.py", [*TRAIN, "--model.attn_block=4", "--model.attn_sinks=2"], "model.attn_block=4 cannot be combined with attn_sinks=2: a sink sees only its own past, but a block is read both ways"),
    Case("documents-without-end-of-text", "train.py", [*TRAIN, "--model.attn_documents"], "model.attn_documents=true needs documents separated by an end-of-text token"),
    Case("document-positions-without-documents", "train.py", [*TRAIN, "--model.attn_document_positions"], "model.attn_document_positions=true restarts positions at each document, but attn_documents=false marks no documents (set attn_documents=true as well"),
    Case("negative-weight-decay", "train.py", [*TRAIN, "--optim.weight_decay", "-1"], "optim.weight_decay=-1.0 must be 0 or more"),
    Case("min-lr-above-peak", "train.py", [*TRAIN, "--optim.min_lr=0.1"], "optim.min_lr=0.1 must be between 0 and learning_rate"),
    Case("model-too-large-for-memory", "train.py", [*TRAIN, "--model.n_embd=1000000000", "--model.n_head=1"], "a model of 24,000,000,125,000,000,000 parameters (model.n_layer=2, n_embd=1000000000"),
    Case("micro-batch-too-large-for-memory", "train.py", [*TRAIN, f"--data.batch_size={10**12}"], f"the logits of one micro-batch of data.batch_size={10**12} x model.block_size=32 tokens need at least"),
    Case("seed-too-large-to-represent", "train.py", [*TRAIN, f"--train.seed={2**70}"], f"train.seed={2**70} is too large: a config integer is at most 2**63 - 1"),
    Case("vocabulary-smaller-than-data", "train.py", [*TRAIN, "--model.vocab_size=50"], "model.vocab_size=50 is smaller than the dataset's vocabulary of 65"),
    Case("document-separator-beyond-the-vocabulary", "train.py", [*TRAIN, "--model.attn_documents", "--model.eot_token=65"], "model.eot_token=65 is not a token of data.dataset='shakespeare_char', whose ids are 0 .. 64"),
    Case("token-key-beyond-the-vocabulary", "train.py", [*TRAIN, "--model.eot_token=1000000"], "model.eot_token=1000000 is not a token of data.dataset='shakespeare_char', whose ids are 0 .. 64"),
    Case("threads-beyond-range", "train.py", [*TRAIN, "--train.threads=2000000000"], "train.threads=2000000000 is outside the accepted range 0 .. 1,024"),
    Case("steps-beyond-range", "train.py", [*TRAIN, f"--train.max_iters={10**13}"], f"train.max_iters={10**13} is outside the accepted range 1 .. 1,000,000,000,000"),
    Case("evaluation-batches-beyond-range", "train.py", [*TRAIN, "--train.eval_iters=1000000000"], "train.eval_iters=1000000000 is outside the accepted range 1 .. 1,000,000"),
    Case("learning-rate-beyond-range", "train.py", [*TRAIN, "--optim.learning_rate=10"], "optim.learning_rate=10.0 is outside the accepted range 1e-09 .. 1.0"),
    Case("weight-decay-that-erases-weights", "train.py", [*TRAIN, "--optim.weight_decay=2000"], "optim.weight_decay=2000.0 with learning_rate=0.001 would multiply every decayed weight by 1 - learning_rate * weight_decay = -1"),
    Case("logit-cap-below-one", "train.py", [*TRAIN, "--model.logit_softcap=0.01"], "model.logit_softcap=0.01 must be 0 (off) or at least 1"),
    Case("float16-on-cpu", "train.py", [*TRAIN, "--train.dtype=float16"], "train.dtype='float16' needs a CUDA device, not cpu"),
    Case("cuda-without-gpu", "train.py", [*TRAIN, "--train.device=cuda"], "train.device='cuda' but this machine has no usable CUDA GPU", needs_no_gpu=True),
    Case("accumulation-across-ranks", "train.py", [*TRAIN, "--train.gradient_accumulation_steps=3"], "train.gradient_accumulation_steps=3 does not divide among the 2 processes", env=TORCHRUN_OF_2),
    Case("one-gpu-for-many-ranks", "train.py", [*TRAIN, "--train.device=cuda:1", "--train.gradient_accumulation_steps=2"], "train.device='cuda:1' names one GPU, but torchrun started 2 processes", env=TORCHRUN_OF_2),
    Case("torchrun-variables-incomplete", "train.py", TRAIN, "RANK=0 and WORLD_SIZE=2 are set but LOCAL_RANK is not: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE", env={"RANK": "0", "WORLD_SIZE": "2"}),
    Case("rank-beyond-the-world", "train.py", TRAIN, "RANK=2 is not below WORLD_SIZE=2: the ranks of a run are 0 .. 1", env=TORCHRUN_OF_2 | {"RANK": "2"}),
    Case("local-rank-beyond-its-machine", "train.py", TRAIN, "LOCAL_RANK=1 is not below LOCAL_WORLD_SIZE=1", env=TORCHRUN_OF_2 | {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1"}),
    Case("world-size-not-a-number", "train.py", TRAIN, "WORLD_SIZE='two' is not a whole number, 1 or more", env=TORCHRUN_OF_2 | {"WORLD_SIZE": "two"}),
    Case("meeting-address-unset", "train.py", [*TRAIN, "--train.gradient_accumulation_steps=2"], "MASTER_ADDR is not set: the processes of a run meet at MASTER_ADDR:MASTER_PORT", env=TORCHRUN_OF_2),
    Case("processes-that-never-join", "train.py", [*TRAIN, "--train.gradient_accumulation_steps=2", "--train.join_timeout=1"], "the run's 2 processes did not all join within train.join_timeout=1 s (this is rank 0", env=ALONE_OF_2),
    Case("join-timeout-beyond-range", "train.py", [*TRAIN, "--train.join_timeout=0"], "train.join_timeout=0.0 is outside the accepted range 1 .. 86,400"),
    # data
    Case("dataset-not-prepared", "train.py", [*TRAIN, "--data.dataset=nowhere"], "no prepared dataset at data/nowhere"),
    Case("dataset-smaller-than-context", "train.py", [*TRAIN, "--model.block_size=2000000"], "fewer than model.block_size + 1 = 2000001"),
    Case("empty-split", "train.py", TRAIN, "the val split of data/shakespeare_char has 0 tokens", empty_val_split),
    Case("data-file-of-wrong-length", "train.py", TRAIN, "val.bin holds 223081 bytes but meta.json promises 111540 uint16 tokens", append_to_val_split),
    Case("data-of-unknown-dtype", "train.py", TRAIN, "dtype='float32' is not one of uint16, uint32", edit_meta(dtype="float32")),
    Case("metadata-incomplete", "train.py", TRAIN, "meta.json lacks vocab_size", lambda ws: _drop_meta_key(ws, "vocab_size")),
    Case("metadata-not-json", "train.py", TRAIN, "meta.json is not valid JSON", write("data/shakespeare_char/meta.json", "{'oops'")),
    Case("metadata-nested-too-deeply", "train.py", TRAIN, "meta.json is not JSON that can be read: it is nested deeper than Python's parser follows", write("data/shakespeare_char/meta.json", "[" * 100_000)),
    Case("ids-beyond-the-vocabulary", "train.py", TRAIN, "train.bin holds the token id 18 at position 0, but meta.json declares vocab_size=10", shrink_vocabulary),
    Case("dtype-that-does-not-match-the-data", "train.py", TRAIN, "but meta.json declares vocab_size=65 and dtype uint32: the two do not belong together", widen_token_dtype),
    Case("metadata-of-the-wrong-type", "train.py", TRAIN, "meta.json: vocab_size='65' is not a positive whole number", edit_meta(vocab_size="65")),
    Case("data-file-missing", "train.py", TRAIN, "train.bin is missing", lambda ws: (ws / "data" / "shakespeare_char" / "train.bin").unlink()),
    # tokenizers: trained here, or any tokenizer.json
    Case("dataset-without-its-tokenizer", "train.py", [*TRAIN, "--data.dataset=notes"], "data/notes/tokenizer.json is missing, and the dataset's token ids mean nothing without it", remove_dataset_tokenizer),
    Case("dataset-with-another-tokenizer", "train.py", [*TRAIN, "--data.dataset=notes"], "the tokenizer.json is not the one the dataset was tokenized with (its sha256 is not tokenizer_sha256=", replace_dataset_tokenizer),
    Case("resume-on-another-tokenizer", "train.py", ["--config", "out/bpe/config.toml", "--train.init_from=resume", "--data.dataset=other"], "data.dataset='other' has the run's json vocabulary size (300) but its token ids stand for other text", bpe_run_and_another_bpe_dataset),
    # runs and checkpoints
    Case("run-would-be-overwritten", "train.py", [*TRAIN, "--train.out_dir=out/tiny"], "already holds a run (ckpt.pt) of this model; continue it with python train.py --config out/tiny/config.toml --train.init_from=resume, or start anew elsewhere (--train.out_dir=out/NAME)"),
    Case("out-dir-is-a-file", "train.py", [*TRAIN, "--train.out_dir=tiny.toml"], "train.out_dir='tiny.toml' is a file, not a directory"),
    Case("out-dir-inside-a-file", "train.py", [*TRAIN, "--train.out_dir=tiny.toml/run"], "train.out_dir='tiny.toml/run' is inside 'tiny.toml', which is a file"),
    Case("out-dir-name-too-long", "train.py", [*TRAIN, "--train.out_dir=out/" + "x" * 300], "holds a name of 300 bytes, longer than the"),
    Case("out-dir-read-only", "train.py", [*TRAIN, "--train.out_dir=locked/run"], "train.out_dir='locked/run' cannot be written: 'locked' is read-only for this user", read_only_folder("locked"), needs_permissions=True),
    Case("resume-without-checkpoint", "train.py", [*TRAIN, "--train.init_from=resume"], "init_from='resume' but there is no checkpoint at out/new/ckpt.pt"),
    Case("resume-with-another-model", "train.py", [*RESUME, "--model.n_layer=3"], "model.n_layer=3 but the run in out/tiny was trained with 2"),
    Case("resume-on-another-vocabulary", "train.py", RESUME, "data.dataset='shakespeare_char' has the run's char vocabulary size (65) but its token ids stand for other text", reverse_characters),
    Case("truncated-checkpoint", "train.py", RESUME, "out/tiny/ckpt.pt is not a readable checkpoint: truncated or corrupt", truncate_checkpoint),
    Case("checkpoint-of-another-format", "train.py", RESUME, "has checkpoint format 1; this version reads formats 2 and 3", edit_checkpoint(lambda c: c | {"format_version": 1})),
    Case("checkpoint-missing-an-entry", "train.py", RESUME, "out/tiny/ckpt.pt lacks its 'optimizer' entry", edit_checkpoint(lambda c: {k: v for k, v in c.items() if k != "optimizer"})),
    Case("damaged-metrics-line", "train.py", RESUME, "out/tiny/metrics.jsonl line 2 is not a record of this trainer", insert_metrics_line("{'step': oops")),
    Case("metrics-value-that-is-not-a-number", "train.py", RESUME, "out/tiny/metrics.jsonl line 2 is not a record of this trainer (loss=None is not a number)", insert_metrics_line('{"step": 3, "loss": null}')),
    # GPT-2 directories
    Case("hf-family-we-cannot-compute", "train.py", [*TRAIN, "--train.init_from=llama"], "llama/config.json has model_type='mixtral', a family this model cannot compute (it reads gpt2, llama, qwen2, qwen3", llama_dir(lambda c: c.update(model_type="mixtral"))),
    Case("fine-tune-from-a-non-gpt2-directory", "train.py", [*TRAIN, "--train.init_from=notes"], "train.init_from='notes' cannot be loaded: notes has no config.json", write_files("notes/README.md")),
    Case("fine-tune-from-another-vocabulary", "train.py", [*TRAIN, "--train.init_from=gpt2"], "train.init_from='gpt2' holds a model of vocab_size=64 (gpt2/config.json), fewer than the 50,257 tokens of its tokenizer (GPT-2's BPE", gpt2_dir()),
    # files of others, never overwritten
    Case("bundled-over-foreign-data", "train.py", [*TRAIN, "--data.data_dir=nano"], "nano/shakespeare_char holds train.bin and val.bin but no meta.json", write_files("nano/shakespeare_char/train.bin", "nano/shakespeare_char/val.bin")),
    Case("hand-written-run-config", "train.py", ["--config", "out/mine/config.toml"], "train.out_dir='out/mine' holds a config.toml that train.py did not write", lambda ws: write_files("out/mine/config.toml")(ws, tiny_toml("out/mine", "data"))),
    Case("run-directory-in-use", "train.py", RESUME, "train.out_dir='out/tiny' is in use by another training (pid", hold_lock("out/tiny/train.lock")),
    # weights that are not numbers, tensors of another shape
    Case("resume-nan-checkpoint", "train.py", RESUME, "out/tiny/ckpt.pt: the weight transformer.h.1.mlp.c_fc.weight holds 1 NaN", edit_checkpoint(set_value("transformer.h.1.mlp.c_fc.weight", float("nan")))),
    Case("fine-tune-from-nan-weights", "train.py", [*TRAIN, "--train.init_from=gpt2"], "train.init_from='gpt2' cannot be loaded: gpt2/model.safetensors: transformer.h.1.attn.c_proj.weight holds 1 NaN", gpt2_dir(weights=set_value("transformer.h.1.attn.c_proj.weight", float("nan")))),
    Case("checkpoint-tensor-of-the-wrong-shape", "train.py", RESUME, "out/tiny/ckpt.pt do not fit the model: transformer.h.1.mlp.c_proj.weight has shape (32, 64), the model needs (32, 128)", edit_checkpoint(lambda c: c["model"].update({"transformer.h.1.mlp.c_proj.weight": torch.zeros(32, 64)}))),
    # evaluation items: every field's type and shape checked by name, the built-in tasks' records too
    Case("resume-with-other-eval-tasks", "train.py", [*RESUME, "--eval.tasks=items.jsonl"], "eval.tasks='items.jsonl' but the run in out/tiny scored no [eval] tasks", write("items.jsonl", ITEM)),
    # a first command without a config, a changed model pointed at another model's run
    Case("no-config", "train.py", [], "no --config given: choose a config file (shipped in configs/: chat_shakespeare_char, chat_shakespeare_rl, finetune_shakespeare"),
    Case("run-of-another-model", "train.py", [*TRAIN, "--train.out_dir=out/tiny", "--model.n_layer=3"], "train.out_dir='out/tiny' already holds a run (ckpt.pt) that this config cannot resume (model.n_layer=3 but the run in out/tiny was trained with 2): train it in another directory (--train.out_dir=out/NAME)"),
    # conversations (data/prepare.py --chat) and the runs that train on them
    Case("chat-dataset-to-a-plain-run", "train.py", [*RESUME, "--data.dataset=chat"], "data.dataset='chat' holds conversations, but the run in out/tiny was trained on plain text and cannot resume on them", chat_dataset_of_the_run),
    Case("chat-split-without-a-trained-token", "train.py", [*TRAIN, "--data.dataset=chat"], "the val split of data/chat has no trained token that a window of model.block_size=32 tokens reaches, so its loss would be a mean over nothing", chat_dataset_without_trained_val_tokens),
    # options: an unknown one is named with the nearest known one, in one line (errors.ArgumentParser)
    Case("misspelt-train-option", "train.py", ["--confg", "tiny.toml"], "error: unrecognized option --confg (did you mean --config?)"),
    Case("config-key-without-its-section", "train.py", [*TRAIN, "--max_iters=5"], "error: unrecognized option --max_iters (did you mean --train.max_iters?)"),
    # LoRA (lora.* keys) and its exports
    Case("lora-without-a-base", "train.py", [*TRAIN, "--lora.rank=8"], "lora.rank=8 adapts a trained model, but train.init_from='scratch' gives none"),
    Case("lora-rank-zero", "train.py", [*TRAIN, "--train.init_from=out/tiny", "--lora.targets=q_proj"], 'rank=0 gives no adapters, but lora.targets="q_proj" asks for LoRA'),
    Case("lora-rank-above-width", "train.py", [*TRAIN, "--train.init_from=out/tiny", "--lora.rank=64"], "lora.rank=64 is above the width of q_proj (32 x 32 in block 0)"),
    Case("lora-target-not-a-projection", "train.py", [*TRAIN, "--train.init_from=out/tiny", "--lora.rank=2", "--lora.targets=qkv"], "lora.targets='qkv' names 'qkv': give one or more of q_proj, k_proj"),
    Case("lora-target-the-model-lacks", "train.py", [*TRAIN, "--train.init_from=out/tiny", "--lora.rank=2", "--lora.targets=gate_proj"], "lora.targets='gate_proj': this model (gelu MLP) has no gate_proj layer"),
    Case("lora-alpha-beyond-its-range", "train.py", [*TRAIN, "--train.init_from=out/tiny", "--lora.rank=2", "--lora.alpha=1e30"], "lora.alpha=1e+30 is outside the accepted range (0, 2000] for lora.rank=2 and optim.learning_rate=0.001"),
    Case("resume-lora-with-another-alpha", "train.py", ["--config", "out/lora/config.toml", "--train.init_from=resume", "--lora.alpha=32"], "lora.alpha=32.0 but the run in out/lora was trained with 16.0, which a resumed run cannot change", lora_run),
    # RL on checked answers (rl.* keys)
    Case("rl-from-scratch", "train.py", [*TRAIN, "--rl.task=q.jsonl"], "rl.task='q.jsonl' rewards a trained model's answers, but train.init_from='scratch' gives none", write("q.jsonl", RL_QUESTION)),
    Case("rl-one-answer-a-question", "train.py", [*TRAIN, *RL, "--rl.samples=1"], "rl.samples=1 gives each question one answer, whose reward is its group's mean: every advantage would be 0 (sample 2 or more, e.g. 8)", chat_questions(RL_QUESTION)),
    Case("rl-temperature-zero", "train.py", [*TRAIN, *RL, "--rl.temperature=0"], "rl.temperature=0.0 is outside (0, 100] (a policy gradient needs sampled answers: 0 would be greedy", chat_questions(RL_QUESTION)),
    Case("rl-reward-not-built-in", "train.py", [*TRAIN, *RL, "--rl.reward=mychecker.score"], "rl.reward='mychecker.score' is not one of task, exact, gsm8k_strict, gsm8k_flexible, numeric", chat_questions(RL_QUESTION)),
    Case("rl-clip-beyond-range", "train.py", [*TRAIN, *RL, "--rl.updates=2", "--rl.clip=1"], "rl.clip=1.0 must be in (0, 1): the ratio is kept within 1 +- clip", chat_questions(RL_QUESTION)),
    Case("rl-questions-across-ranks", "train.py", [*TRAIN, *RL, "--rl.questions=3", "--train.gradient_accumulation_steps=2"], "rl.questions=3 does not divide among the 2 processes torchrun started: each answers an equal share of a step's questions (use a multiple of 2)", env=TORCHRUN_OF_2),
    Case("rl-more-micro-batches-than-answers", "train.py", [*TRAIN, *RL, "--rl.questions=1", "--rl.samples=2", "--train.gradient_accumulation_steps=4"], "train.gradient_accumulation_steps=4 gives each process 4 micro-batches, but it samples 2 answers a step", write("q.jsonl", RL_QUESTION)),
    Case("rl-model-without-chat-template", "train.py", [*TRAIN, "--train.init_from=out/tiny", "--rl.task=q.jsonl"], "rl.task='q.jsonl': the model has no chat template, and answers are sampled through it", write("q.jsonl", RL_QUESTION)),
    Case("rl-task-file-missing", "train.py", [*TRAIN, *RL, "--rl.task=questions.jsonl"], "rl.task 'questions.jsonl' is neither a built-in task (hellaswag, arc_easy, arc_challenge, piqa, lambada, gsm8k) nor a file", chat_questions(RL_QUESTION)),
    Case("rl-task-multiple-choice", "train.py", [*TRAIN, *RL], "rl.task='q.jsonl' is a multiple-choice task; RL rewards sampled answers, so it needs a generation task", chat_questions(ITEM)),
    Case("rl-numeric-reward-of-a-word", "train.py", [*TRAIN, *RL, "--rl.reward=numeric"], "q.jsonl item 1: field 'answer'='h o' is no number, and rl.reward='numeric' compares numbers", chat_questions(RL_QUESTION)),
    Case("rl-answer-beyond-the-block", "train.py", [*TRAIN, *RL, "--rl.max_new_tokens=30"], "with rl.max_new_tokens=30 of answer it would not fit the model's block_size=32", chat_questions(RL_QUESTION)),
    # GGUF files for llama.cpp (sample.py --export-gguf)
    Case("schedule-not-stages", "train.py", [*TRAIN, "--train.block_size_schedule=16:0.3,32"], "train.block_size_schedule='16:0.3,32' is not a list of SIZE:UNTIL stages (a positive integer, then the fraction of train.max_iters it lasts until, rising inside (0, 1); after the last, model.block_size)"),
    Case("schedule-rows-longer-than-the-model", "train.py", [*TRAIN, "--train.block_size_schedule=64:0.5"], "train.block_size_schedule='64:0.5' trains rows of 64 tokens: each stage's length must lie in 1 .. model.block_size=32"),
    Case("batch-size-lr-power-beyond-range", "train.py", [*TRAIN, "--train.batch_size_lr_power=2"], "train.batch_size_lr_power=2.0 is outside the accepted range 0 .. 1"),
    Case("scheduled-micro-batch-too-large-for-memory", "train.py", [*TRAIN, f"--train.batch_size_schedule={10**12}:0.5"], f"the logits of one micro-batch of {10**12} sequences (train.batch_size_schedule='{10**12}:0.5') x model.block_size=32 tokens need at least"),
    # residual-stream switches (model.value_embeds, unet_skips, backout, zero_init_proj)
    Case("value-embeds-beyond-half-the-layers", "train.py", [*TRAIN, "--model.value_embeds=2"], "model.value_embeds=2 is outside the accepted range 0 .. n_layer // 2 = 1 (each table serves two of the n_layer=2 layers, one at each end)"),
    # the switches that read neighbouring tokens (smear gate, bigram table, multi-token prediction)
    Case("bigram-table-of-one-row", "train.py", [*TRAIN, "--model.bigram_embed=1"], "model.bigram_embed=1 must be 0 (off) or at least 2 rows (one for the tokens with no previous token, the others for the pairs)"),
    Case("mtp-tokens-beyond-the-row", "train.py", [*TRAIN, "--model.mtp_tokens=32"], "model.mtp_tokens=32 must be 0 (off) or a number of extra targets below block_size=32"),
    Case("mtp-weight-out-of-range", "train.py", [*TRAIN, "--model.mtp_tokens=2", "--model.mtp_weight=0"], "model.mtp_weight=0.0 must be in (0, 1]: its own target weighs 1, later ones less"),
    # nanoGPT beside ours (bench/speedrun.py, bench/step_profile.py): a folder that is not a checkout of it
    Case("normuon-beta2-beyond-range", "train.py", [*TRAIN, "--optim.optimizer=muon", "--optim.muon_normuon=true", "--optim.muon_beta2=1"], "optim.muon_beta2=1.0 must be in [0, 1)"),
    # ---- data/prepare.py ----
    # data
    Case("folder-with-a-file-not-read", "data/prepare.py", ["--dataset", "corpus", "--tokenizer", "char", "--out", "prepared"], "--dataset='corpus': 1 file(s) in the folder would not be read: B.TXT (only .txt, .jsonl, .json, .parquet files are read", write_files("corpus/a.txt", "corpus/B.TXT")),
    # tokenizers: trained here, or any tokenizer.json
    Case("bpe-vocabulary-below-the-bytes", "data/prepare.py", ["--dataset", "corpus.txt", "--tokenizer", "bpe", "--vocab-size", "200", "--out", "notes"], "--vocab-size=200 is outside 257..1,048,576 (a byte-level BPE holds the 256 bytes", write_files("corpus.txt")),
    Case("bpe-vocabulary-absurdly-large", "data/prepare.py", ["--dataset", "corpus.txt", "--tokenizer", "bpe", "--vocab-size", str(10**10), "--out", "notes"], f"--vocab-size={10**10} is outside 257..1,048,576", write_files("corpus.txt")),
    Case("bpe-without-a-vocabulary-size", "data/prepare.py", ["--dataset", "corpus.txt", "--tokenizer", "bpe", "--out", "notes"], "--tokenizer=bpe trains a BPE and needs its size: pass --vocab-size", write_files("corpus.txt")),
    Case("vocabulary-size-without-bpe", "data/prepare.py", ["--dataset", "corpus.txt", "--tokenizer", "gpt2", "--vocab-size", "4096", "--out", "notes"], "--vocab-size=4096 applies only to --tokenizer=bpe, not gpt2", write_files("corpus.txt")),
    Case("tokenizer-json-that-does-not-load", "data/prepare.py", ["--dataset", "corpus.txt", "--tokenizer", "bad.json", "--out", "notes"], "bad.json is not a tokenizer.json that the tokenizers package can load (", lambda ws: (write_files("corpus.txt")(ws), write("bad.json", '{"version": "1.0"}')(ws))),
    Case("tokenizer-json-missing", "data/prepare.py", ["--dataset", "corpus.txt", "--tokenizer", "nowhere.json", "--out", "notes"], "--tokenizer='nowhere.json' is not a file (give a tokenizer.json, char, gpt2 or bpe)", write_files("corpus.txt")),
    # runs and checkpoints
    Case("prepare-out-inside-a-file", "data/prepare.py", ["--dataset", "shakespeare_char", "--out", "tiny.toml/data"], "--out='tiny.toml/data' is inside 'tiny.toml', which is a file"),
    # files of others, never overwritten
    Case("prepare-over-foreign-data", "data/prepare.py", ["--dataset", "corpus.txt", "--tokenizer", "char", "--out", "nano"], "nano holds train.bin but no meta.json: not a dataset prepared by data/prepare.py", write_files("nano/train.bin", "nano/meta.pkl", "corpus.txt")),
    Case("prepare-over-a-foreign-tokenizer", "data/prepare.py", ["--dataset", "corpus.txt", "--tokenizer", "bpe", "--vocab-size", "300", "--out", "nano"], "nano holds tokenizer.json but no meta.json: not a dataset prepared by data/prepare.py", write_files("nano/tokenizer.json", "corpus.txt")),
    # conversations (data/prepare.py --chat) and the runs that train on them
    Case("chat-record-without-messages", "data/prepare.py", CHAT_PREPARE, 'chats.jsonl line 1: no "messages" field (nor ShareGPT\'s "conversations"); its fields: \'text\'', write_chats({"text": "hi"})),
    Case("chat-unknown-role", "data/prepare.py", CHAT_PREPARE, "chats.jsonl line 1: messages[1]: role='robot' is not one of system, user, assistant", write_chats({"messages": [{"role": "robot", "content": "hi"}, CHAT_REPLY]})),
    Case("chat-empty-content", "data/prepare.py", CHAT_PREPARE, "chats.jsonl line 1: messages[2]: content='' is not text", write_chats({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]})),
    Case("chat-no-assistant-turn", "data/prepare.py", CHAT_PREPARE, "chats.jsonl line 1: no assistant message, so nothing to learn", write_chats({"messages": [{"role": "user", "content": "hi"}]})),
    Case("chat-record-with-messages-and-conversations", "data/prepare.py", CHAT_PREPARE, 'chats.jsonl line 1: both "messages" and ShareGPT\'s "conversations" are given, and which one is the conversation would be a guess (keep one of them)', write_chats({"messages": [{"role": "user", "content": "hi"}, CHAT_REPLY], "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ho"}]})),
    Case("chat-record-nested-too-deeply", "data/prepare.py", CHAT_PREPARE, "chats.jsonl line 2 is not JSON that can be read: it is nested deeper than Python's parser follows", write("chats.jsonl", json.dumps({"messages": [{"role": "user", "content": "hi"}, CHAT_REPLY]}) + "\n" + "[" * 100_000 + "\n")),
    Case("chat-content-half-a-surrogate-pair", "data/prepare.py", CHAT_PREPARE, "chats.jsonl line 1 holds the escape \\ud800, half of a UTF-16 surrogate pair without its other half", write("chats.jsonl", '{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "ho"}]}\n')),
    Case("chat-template-raises", "data/prepare.py", [*CHAT_PREPARE[:4], "chatmodel"], "chats.jsonl line 1: the chat template cannot render it (roles must alternate)", chat_model_folder("{{ raise_exception('roles must alternate') }}")),
    Case("chat-template-not-jinja", "data/prepare.py", [*CHAT_PREPARE[:4], "chatmodel"], "the chat template is not valid jinja", chat_model_folder("{% for message in %}")),
    Case("chat-template-python-error", "data/prepare.py", [*CHAT_PREPARE[:4], "chatmodel"], 'chats.jsonl line 1: the chat template cannot render it (TypeError: can only concatenate str (not "int") to str)', chat_model_folder("{% for message in messages %}{{ message['content'] + 5 }}{% endfor %}")),
    Case("chat-template-range-too-large", "data/prepare.py", [*CHAT_PREPARE[:4], "chatmodel"], "chats.jsonl line 1: the chat template cannot render it (OverflowError: Range too big", chat_model_folder("{% for i in range(10**10) %}x{% endfor %}")),
    Case("chat-template-product-too-large", "data/prepare.py", [*CHAT_PREPARE[:4], "chatmodel"], "chats.jsonl line 1: the chat template cannot render it (OverflowError: 'a' * 2000000 would be 2,000,000 long, more than 1,048,576)", chat_model_folder("{{ 'a' * 2000000 }}{% for message in messages %}{{ message['content'] }}{% endfor %}")),
    Case("chat-template-renders-nothing", "data/prepare.py", [*CHAT_PREPARE[:4], "chatmodel"], "chats.jsonl line 1: the chat template renders it as no text at all", chat_model_folder("{% for message in messages %}{% endfor %}")),
    Case("chat-template-leaves-out-a-message", "data/prepare.py", [*CHAT_PREPARE[:4], "chatmodel"], "chats.jsonl line 1: the chat template leaves out the content of message 1 (the user's 'hi'), which would be lost", chat_model_folder("{% for message in messages %}{{ message['role'] }}\n{% endfor %}")),
    Case("chat-template-not-utf8", "data/prepare.py", [*CHAT_PREPARE[:4], "chatmodel"], "chatmodel/chat_template.jinja is not UTF-8 text: byte 3 (0xff) is invalid start byte", lambda ws: (chat_model_folder("")(ws), (ws / "chatmodel" / "chat_template.jinja").write_bytes(b"{{ \xff }}"))),
    Case("chat-model-folder-without-template", "data/prepare.py", [*CHAT_PREPARE[:4], "chatmodel"], "has no chat template (no chat_template.jinja, no chat_template in tokenizer_config.json)", lambda w: (chat_model_folder("")(w), (w / "chatmodel" / "tokenizer_config.json").write_text("{}"))),
    Case("chat-tokenizer-run-not-trained-yet", "data/prepare.py", [*CHAT_PREPARE[:4], "out/shakespeare_char"], "--tokenizer='out/shakespeare_char' does not exist yet: it is the run of configs/shakespeare_char.toml (train it first: python train.py --config configs/shakespeare_char.toml)"),
    Case("chat-tokenizer-folder-with-nothing-to-read", "data/prepare.py", [*CHAT_PREPARE[:4], "out"], "--tokenizer='out' holds no ckpt.pt, meta.json or tokenizer.json (give a run directory with its ckpt.pt, a prepared dataset folder, a model folder, a tokenizer.json, char or gpt2)"),
    Case("chat-conversations-not-made-yet", "data/prepare.py", ["--dataset", "data/chat_tasks/train.jsonl", "--chat", "--tokenizer", "out/tiny"], "--dataset='data/chat_tasks/train.jsonl' does not exist (python data/chat_tasks.py --out data/chat_tasks writes it)"),
    Case("chat-replies-all-cut-off", "data/prepare.py", [*CHAT_PREPARE, "--block-size", "8", "--too-long", "truncate"], "the train split of chats.jsonl has no trained token within --block-size=8 tokens of a conversation's start (19 of its 19 conversation(s) cut to that length by --too-long truncate), so training would report a loss over nothing", write_chats(*[{"messages": [{"role": "user", "content": "a question longer than the block"}, CHAT_REPLY]}] * 20)),
    # options: an unknown one is named with the nearest known one, in one line (errors.ArgumentParser)
    Case("misspelt-prepare-option", "data/prepare.py", ["--datset", "shakespeare_char"], "error: unrecognized option --datset (did you mean --dataset?)"),
    # ---- data/chat_tasks.py ----
    # generation tasks: a prompt or a conversation, and a non-empty answer; gsm8k's answer ends in its final number
    Case("chat-tasks-over-its-files", "data/chat_tasks.py", ["--out", "made", "--train", "5", "--val", "2", "--heldout", "2"], "made already holds train.jsonl (delete them or choose another --out)", write_files("made/train.jsonl")),
    Case("chat-tasks-none-held-out", "data/chat_tasks.py", ["--out", "made", "--heldout", "0"], "--heldout=0 is not allowed (use 1 or more)"),
    # ---- sample.py ----
    # runs and checkpoints
    Case("sample-run-name-too-long", "sample.py", ["--out-dir", "x" * 300, "--prompt", "a"], "the name is too long for the file system: choose a shorter path"),
    Case("export-inside-a-file", "sample.py", ["--out-dir", "out/tiny", "--export", "tiny.toml/gpt2"], "--export='tiny.toml/gpt2' is inside 'tiny.toml', which is a file"),
    Case("foreign-checkpoint", "sample.py", ["--out-dir", "out/tiny"], "is not a checkpoint written by this trainer", edit_checkpoint(lambda c: {"weights": c["model"]})),
    Case("checkpoint-that-runs-code", "sample.py", ["--out-dir", "out/tiny"], "refused to load out/tiny/ckpt.pt: it holds pickled Python objects", edit_checkpoint(lambda c: c | {"x": RunsCodeWhenUnpickled()})),
    Case("checkpoint-with-the-old-qk-norm", "sample.py", ["--out-dir", "out/tiny"], "was trained with RMSNorm QK-norm in a LayerNorm model (checkpoint format 2)", edit_checkpoint(lambda c: c["config"]["model"].update(qk_norm=True) or c | {"format_version": 2})),
    Case("weights-that-do-not-fit", "sample.py", ["--out-dir", "out/tiny"], "transformer.wte.weight has shape (65, 32), the model needs (65, 64)", edit_checkpoint(lambda c: c["config"]["model"].update(n_embd=64))),
    Case("checkpoint-entry-of-the-wrong-type", "sample.py", ["--out-dir", "out/tiny"], "out/tiny/ckpt.pt: 'step' is a str, not an integer", edit_checkpoint(lambda c: c | {"step": "ten"})),
    Case("checkpoint-config-edited-to-a-huge-model", "sample.py", ["--out-dir", "out/tiny"], "the 24,000,000,125,000,000,000 float32 parameters of the model that the config in out/tiny/ckpt.pt describes need at least", edit_checkpoint(lambda c: c["config"]["model"].update(n_embd=10**9, n_head=1))),
    Case("checkpoint-token-beyond-its-vocabulary", "sample.py", ["--out-dir", "out/tiny"], "model.eot_token=100 is not a token of the dataset out/tiny/ckpt.pt was trained on, whose ids are 0 .. 64", edit_checkpoint(lambda c: c["config"]["model"].update(attn_documents=True, eot_token=100))),
    Case("checkpoint-documents-without-separator", "sample.py", ["--out-dir", "out/tiny"], "model.attn_documents=true needs model.eot_token, the id of the token that separates documents, but it is -1", edit_checkpoint(lambda c: c["config"]["model"].update(attn_documents=True))),
    Case("checkpoint-config-no-longer-accepted", "sample.py", ["--out-dir", "out/tiny"], "the config in out/tiny/ckpt.pt is not accepted: model.attn_prefix_lm=true cannot be combined with attn_sinks=2", edit_checkpoint(lambda c: c["config"]["model"].update(attn_prefix_lm=True, attn_sinks=2))),
    # sampling
    Case("sample-without-a-run", "sample.py", ["--out-dir", "out/missing"], "no checkpoint at out/missing/ckpt.pt"),
    Case("sample-a-run-not-trained-yet", "sample.py", ["--out-dir", "out/shakespeare_char"], "no checkpoint at out/shakespeare_char/ckpt.pt: it is the run of configs/shakespeare_char.toml (train it first: python train.py --config configs/shakespeare_char.toml)"),
    Case("prompt-outside-vocabulary", "sample.py", ["--prompt", "ROMEO: ¿qué?"], "outside the model's 65-character vocabulary: '¿', 'é'"),
    Case("prompt-not-utf8", "sample.py", ["--prompt", "ROMEO\udcff"], "argument --prompt: 'ROMEO\\udcff' is not UTF-8 text: character 5 ('\\udcff') stands for a byte that is not UTF-8"),
    Case("prompt-longer-than-context", "sample.py", ["--prompt", "x" * 40], "the prompt is 40 tokens but the model's context is block_size=32"),
    Case("negative-temperature", "sample.py", ["--temperature", "-1"], "--temperature=-1.0 is not allowed"),
    Case("top-p-of-zero", "sample.py", ["--top-p", "0"], "--top-p=0.0 is not allowed"),
    Case("prompt-file-missing", "sample.py", ["--prompt-file", "nothing.txt"], "--prompt-file='nothing.txt' does not exist"),
    Case("prompt-file-is-a-directory", "sample.py", ["--prompt-file", "out"], "--prompt-file='out' cannot be read"),
    Case("batch-size-of-zero", "sample.py", ["--batch-size", "0"], "--batch-size=0 is not allowed"),
    Case("threads-below-zero", "sample.py", ["--threads", "-1"], "--threads=-1 is not allowed (use 0 up to 1024)"),
    Case("precision-with-compile-of-a-model-the-step-does-not-compute", "sample.py", ["--out-dir", "out/tiny", "--device", "cpu", "--precision", "int8", "--compile"], "--precision=int8 with --compile: the decoding step does not compute model.attn_window (leave out --precision or --compile)", edit_checkpoint(lambda c: c["config"]["model"].update(attn_window=8))),
    Case("precision-of-a-bfloat16-model", "sample.py", ["--out-dir", "out/missing", "--precision", "float16", "--dtype", "bfloat16"], "--precision=float16 does not apply here: float16 products are for a float32 model, and this one is bfloat16"),
    Case("unknown-sampling-device", "sample.py", ["--device", "foo"], "--device='foo' is not one of auto, cpu, cuda, cuda:N, mps"),
    Case("sample-on-cuda-without-gpu", "sample.py", ["--device", "cuda"], "--device='cuda' but this machine has no usable CUDA GPU", needs_no_gpu=True),
    Case("stop-text-ending-in-a-backslash", "sample.py", ["--stop", "a\\"], "ends in a lone backslash or holds an incomplete escape"),
    Case("infinite-temperature", "sample.py", ["--temperature", "inf"], "--temperature=inf is not allowed"),
    Case("more-new-tokens-than-memory", "sample.py", ["--max-new-tokens", str(10**14)], f"--max-new-tokens={10**14}: the token ids of 1 sample(s) need at least 800.0 TB"),
    Case("too-many-samples", "sample.py", ["--num-samples", str(10**14)], "asks for more than 1,000,000 samples in one run"),
    Case("seed-beyond-64-bits", "sample.py", ["--seed", str(2**64)], f"--seed={2**64} is not allowed: sample i is drawn with seed + i"),
    Case("empty-stop-text", "sample.py", ["--stop", ""], "--stop='' is empty: a sample would end before its first character"),
    Case("temperature-beyond-range", "sample.py", ["--temperature", "1000"], "--temperature=1000.0 is not allowed (use 0 (greedy) up to 100"),
    # GPT-2 directories
    Case("gpt2-directory-missing", "sample.py", ["--init-from", "nowhere"], "--init-from='nowhere' is not a directory"),
    Case("not-a-gpt2-directory", "sample.py", ["--init-from", "out"], "--init-from='out' cannot be loaded: out has no config.json"),
    Case("safetensors-offsets-past-the-end", "sample.py", ["--init-from", "gpt2"], "--init-from='gpt2' cannot be loaded: gpt2/model.safetensors is not a readable safetensors file (Error while deserializing header: invalid shape, data type, or offset for tensor)", gpt2_dir(header=lambda h: h["transformer.wte.weight"]["data_offsets"].__setitem__(1, 10**9))),
    Case("safetensors-shape-that-does-not-fit-its-bytes", "sample.py", ["--init-from", "gpt2"], "gpt2/model.safetensors is not a readable safetensors file (Error while deserializing header: invalid shape, data type, or offset for tensor)", gpt2_dir(header=lambda h: h["transformer.wte.weight"].update(shape=[64, 33]))),
    Case("safetensors-header-longer-than-the-file", "sample.py", ["--init-from", "gpt2"], "gpt2/model.safetensors is not a readable safetensors file (Error while deserializing header: header too large)", lie_about_header_length),
    Case("hf-config-of-the-wrong-shape", "sample.py", ["--init-from", "gpt2"], "gpt2/config.json holds a JSON list, not an object of settings", lambda ws: (gpt2_dir()(ws), write("gpt2/config.json", "[1, 2]")(ws))),
    Case("hf-config-nested-too-deeply", "sample.py", ["--init-from", "gpt2"], "gpt2/config.json is not valid JSON (maximum recursion depth exceeded", lambda ws: (gpt2_dir()(ws), write("gpt2/config.json", "[" * 100_000)(ws))),
    Case("hf-config-size-not-an-integer", "sample.py", ["--init-from", "gpt2"], "gpt2/config.json sets n_embd=32.5, which is not a positive integer", gpt2_dir(config=lambda c: c.update(n_embd=32.5))),
    Case("hf-config-lying-about-size", "sample.py", ["--init-from", "gpt2"], "wte.weight has shape (64, 32) but config.json implies (64, 1000000000)", gpt2_dir(config=lambda c: c.update(n_embd=10**9, n_head=1))),
    Case("hf-heads-that-do-not-divide-the-width", "sample.py", ["--init-from", "gpt2"], "gpt2/config.json sets n_embd=32 and n_head=3, which does not divide it: a gpt2 model's heads are n_embd / n_head wide", gpt2_dir(config=lambda c: c.update(n_head=3))),
    Case("hf-config-token-beyond-the-vocabulary", "sample.py", ["--init-from", "gpt2"], "--init-from='gpt2' cannot be loaded: gpt2/config.json sets eos_token_id=64, which is not a token id below its vocab_size=64", gpt2_dir(config=lambda c: c.update(eos_token_id=64))),
    Case("shard-index-outside-the-directory", "sample.py", ["--init-from", "gpt2"], "names the shard '../tiny.toml', which is not a file in gpt2", shard_outside_the_directory),
    Case("nan-weights", "sample.py", ["--init-from", "gpt2"], "gpt2/model.safetensors: transformer.h.0.mlp.c_fc.weight holds 4,096 NaN and 0 infinite values (of 4,096)", gpt2_dir(weights=lambda t: t["transformer.h.0.mlp.c_fc.weight"].fill_(float("nan")))),
    Case("export-a-model-no-family-computes", "sample.py", ["--out-dir", "out/tiny", "--export", "exported"], "--export cannot write this model: model.logit_softcap=15.0 is computed by no Hugging Face family", edit_checkpoint(lambda c: c["config"]["model"].update(logit_softcap=15.0))),
    Case("hf-key-we-cannot-compute", "sample.py", ["--init-from", "llama"], "llama/config.json sets rope_scaling.rope_type='linear'; this model computes only 'default' or 'llama3' or 'yarn'", llama_dir(lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 4.0}))),
    Case("hf-tokenizer-larger-than-the-embedding", "sample.py", ["--init-from", "llama"], "--init-from='llama' holds a model of vocab_size=65 (llama/config.json), fewer than the 70 tokens of its tokenizer (llama/tokenizer.json)", llama_dir(tokenizer_json=CharTokenizer("".join(chr(32 + i) for i in range(70))).to_json())),
    Case("hf-tokenizer-json-damaged", "sample.py", ["--init-from", "llama"], "llama/tokenizer.json is not a tokenizer.json that the tokenizers package can load", llama_dir(tokenizer_json='{"model": ')),
    Case("hub-model-offline", "sample.py", ["--init-from", "HuggingFaceTB/SmolLM2-135M"], "--init-from='HuggingFaceTB/SmolLM2-135M' is not a folder here, and the hub model HuggingFaceTB/SmolLM2-135M cannot be downloaded ("),
    Case("gguf-not-a-gguf-file", "sample.py", ["--init-from", "model.gguf"], "--init-from='model.gguf' is not a readable GGUF file (", write("model.gguf", "not a GGUF file\n")),
    Case("gguf-architecture-we-cannot-compute", "sample.py", ["--init-from", "model.gguf"], "--init-from='model.gguf' cannot be loaded: model.gguf holds general.architecture='phi3', which this model cannot compute (it reads gpt2, llama, qwen2, qwen3, stablelm)", gguf_file({"general.architecture": ("phi3", None, None)})),
    Case("gguf-sentencepiece-tokenizer", "sample.py", ["--init-from", "model.gguf"], "--init-from='model.gguf' cannot be loaded: model.gguf holds tokenizer.ggml.model='llama' (SentencePiece): only llama.cpp's byte-level BPE", gguf_file({"tokenizer.ggml.model": ("llama", "STRING", None)})),
    Case("gguf-pre-tokenizer-we-cannot-rebuild", "sample.py", ["--init-from", "model.gguf"], "--init-from='model.gguf' cannot be loaded: model.gguf holds tokenizer.ggml.pre='deepseek-llm', a split before BPE this reader does not rebuild", gguf_file({"tokenizer.ggml.pre": ("deepseek-llm", "STRING", None)})),
    Case("gguf-type-we-cannot-dequantize", "sample.py", ["--init-from", "model.gguf"], "--init-from='model.gguf' cannot be loaded: model.gguf: blk.0.ffn_up.weight is of type F64, which the gguf package cannot dequantize", gguf_file(types={"blk.0.ffn_up.weight": "F64"})),
    Case("gguf-rope-stretch-we-cannot-compute", "sample.py", ["--init-from", "model.gguf"], "--init-from='model.gguf' cannot be loaded: model.gguf sets qwen2.rope.scaling.type='longrope', a stretched RoPE this model does not compute (it computes yarn, and Llama 3's rope_freqs.weight)", gguf_file({"qwen2.rope.scaling.type": ("longrope", "STRING", None)})),
    Case("gpt2-directory-of-another-vocabulary", "sample.py", ["--init-from", "gpt2"], "--init-from='gpt2' holds a model of vocab_size=64 (gpt2/config.json), fewer than the 50,257 tokens of its tokenizer (GPT-2's BPE", gpt2_dir()),
    # files of others, never overwritten
    Case("export-over-a-model", "sample.py", ["--out-dir", "out/tiny", "--export", "models/gpt2"], "--export='models/gpt2' already holds config.json, model.safetensors, where this writes its files: nothing there is replaced", write_files("models/gpt2/config.json", "models/gpt2/model.safetensors")),
    Case("export-adapter-into-a-model-folder", "sample.py", ["--out-dir", "out/lora", "--export-adapter", "models/base"], "--export-adapter='models/base' already holds config.json, model.safetensors, where this writes its files: nothing there is replaced", lora_run_and_a_model_folder),
    # weights that are not numbers, tensors of another shape
    Case("sample-infinite-checkpoint", "sample.py", ["--out-dir", "out/tiny"], "out/tiny/ckpt.pt: the weight transformer.wte.weight holds 0 NaN and 1 infinite values (of 2,080)", edit_checkpoint(set_value("transformer.wte.weight", float("-inf")))),
    Case("export-nan-checkpoint", "sample.py", ["--out-dir", "out/tiny", "--export", "exported"], "out/tiny/ckpt.pt: the weight transformer.h.1.mlp.c_fc.weight holds 1 NaN", edit_checkpoint(set_value("transformer.h.1.mlp.c_fc.weight", float("nan")))),
    Case("hf-infinite-weight", "sample.py", ["--init-from", "llama"], "llama/model.safetensors: model.layers.0.self_attn.v_proj.weight holds 0 NaN and 1 infinite values (of 1,024)", llama_dir(weights=set_value("model.layers.0.self_attn.v_proj.weight", float("inf")))),
    Case("hf-key-tensor-of-the-wrong-shape", "sample.py", ["--init-from", "llama"], "llama/model.safetensors: model.layers.0.self_attn.k_proj.weight has shape (16, 32) but config.json implies (32, 32)", llama_dir(weights=lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 32)}))),
    Case("hf-key-tensor-of-the-wrong-width", "sample.py", ["--init-from", "llama"], "llama/model.safetensors: model.layers.0.self_attn.k_proj.weight has shape (32, 16) but config.json implies (32, 32)", llama_dir(weights=lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 16)}))),
    Case("hf-mlp-tensor-of-the-wrong-shape", "sample.py", ["--init-from", "llama"], "llama/model.safetensors: model.layers.1.mlp.up_proj.weight has shape (64, 32) but config.json implies (85, 32)", llama_dir(weights=lambda t: t.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(64, 32)}))),
    Case("hf-fused-qkv-of-the-wrong-shape", "sample.py", ["--init-from", "gpt2"], "gpt2/model.safetensors: transformer.h.0.attn.c_attn.weight has shape (96, 32) but config.json implies (32, 96)", gpt2_dir(weights=lambda t: t.update({"transformer.h.0.attn.c_attn.weight": torch.zeros(96, 32)}))),
    # tokenizers read from a file refuse what their vocabulary cannot encode, as the run's own does
    Case("exported-prompt-outside-vocabulary", "sample.py", ["--init-from", "exported", "--prompt", "ROMEO: ¿qué?"], "the text has characters that exported/tokenizer.json cannot encode: '¿' at character 7 (it has no token for it and would drop it", export_run),
    Case("exported-prompt-of-only-unencodable-characters", "sample.py", ["--init-from", "exported", "--prompt", "¿¿"], "the text has characters that exported/tokenizer.json cannot encode: '¿' at character 0", export_run),
    Case("prompt-that-encodes-to-no-tokens", "sample.py", ["--init-from", "llama", "--prompt", "   "], "the prompt '   ' encodes to no tokens: give a prompt with text the tokenizer keeps", llama_dir(tokenizer_json=word_level_tokenizer_json())),
    # outputs: a file is replaced only when it is an earlier output of its kind, checked before any work
    Case("export-over-a-tokenizer-config", "sample.py", ["--out-dir", "out/tiny", "--export", "exported"], "--export='exported' already holds tokenizer_config.json, where this writes its files", write_files("exported/tokenizer_config.json", "exported/README.md")),
    Case("export-before-loading", "sample.py", ["--out-dir", "out/missing", "--export", "exported"], "--export='exported' already holds config.json", write_files("exported/config.json")),
    # options: an unknown one is named with the nearest known one, in one line (errors.ArgumentParser)
    Case("misspelt-sample-option", "sample.py", ["--out-dir", "out/tiny", "--max-tokens", "5"], "error: unrecognized option --max-tokens (did you mean --max-new-tokens?)"),
    Case("misspelt-underscore-option", "sample.py", ["--out-dir", "out/tiny", "--max_new_token=5"], "error: unrecognized option --max_new_token (did you mean --max-new-tokens?)"),
    Case("stray-word-for-sample", "sample.py", ["--out-dir", "out/tiny", "ROMEO:"], "error: unexpected argument 'ROMEO:' (see sample.py --help for the options)"),
    # LoRA (lora.* keys) and its exports
    Case("lora-base-changed", "sample.py", ["--out-dir", "out/lora"], "has changed since the adapters in out/lora/ckpt.pt were trained on it", lora_run_on_a_changed_base),
    Case("export-adapter-of-a-full-run", "sample.py", ["--out-dir", "out/tiny", "--export-adapter", "adapter"], "out/tiny/ckpt.pt holds a full fine-tune or a model trained from scratch, not LoRA adapters"),
    Case("chat-with-a-model-without-template", "sample.py", ["--out-dir", "out/tiny", "--chat"], "has no chat template, so it cannot tell turns apart (fine-tune it on conversations first"),
    Case("chat-system-without-chat", "sample.py", ["--out-dir", "out/tiny", "--system", "Be brief."], "--system applies to --chat only"),
    Case("chat-with-export", "sample.py", ["--out-dir", "out/tiny", "--chat", "--export", "exported"], "--export does not apply to --chat, which holds one conversation (leave --export out)"),
    Case("chat-blank-prompt", "sample.py", ["--out-dir", "out/tiny", "--chat", "--prompt", "   "], "--prompt='   ' is blank: with --chat, --prompt is the one message the model answers, and a message needs text (write the message, or leave --prompt out to chat turn by turn)"),
    Case("chat-empty-system", "sample.py", ["--out-dir", "out/tiny", "--chat", "--system", ""], "--system='' is blank, and a system message needs text as every message does (write the message, or leave --system out)"),
    # GGUF files for llama.cpp (sample.py --export-gguf)
    Case("gguf-path-is-a-folder", "sample.py", ["--out-dir", "out/tiny", "--export-gguf", "model.gguf"], "--export-gguf='model.gguf' is a directory, not a file", write_files("model.gguf/notes.txt")),
    Case("gguf-path-exists", "sample.py", ["--out-dir", "out/tiny", "--export-gguf", "model.gguf"], "--export-gguf='model.gguf' already exists and is not a GGUF file of an earlier sample.py --export-gguf: it is never replaced", write_files("model.gguf")),
    Case("gguf-path-before-loading", "sample.py", ["--out-dir", "out/missing", "--export-gguf", "model.gguf"], "--export-gguf='model.gguf' already exists and is not a GGUF file", write_files("model.gguf")),
    Case("gguf-path-without-suffix", "sample.py", ["--out-dir", "out/tiny", "--export-gguf", "out/tiny/model"], "--export-gguf='out/tiny/model' does not end in .gguf"),
    Case("gguf-type-without-export", "sample.py", ["--out-dir", "out/tiny", "--gguf-type", "q8_0"], "--gguf-type=q8_0 applies to --export-gguf only (give --export-gguf FILE.gguf)"),
    Case("gguf-type-unknown", "sample.py", ["--out-dir", "out/missing", "--export-gguf", "model.gguf", "--gguf-type", "q5_k"], "--gguf-type=q5_k is not a type this export writes (use one of F32, F16, BF16, Q8_0, Q4_0; llama.cpp's llama-quantize makes the others from an F32 or F16 file)"),
    Case("gguf-type-with-dtype", "sample.py", ["--out-dir", "out/tiny", "--export-gguf", "model.gguf", "--gguf-type", "Q4_0", "--dtype", "float16"], "--gguf-type=Q4_0 and --dtype=float16 both say how the file's matrices are stored (give one of them: --gguf-type F16 is --dtype float16)"),
    Case("gguf-with-export", "sample.py", ["--out-dir", "out/tiny", "--export-gguf", "model.gguf", "--export", "exported"], "--export-gguf='model.gguf' and --export='exported' write one format each (give one of them)"),
    Case("gguf-package-not-installed", "sample.py", ["--out-dir", "out/tiny", "--export-gguf", "model.gguf"], "this needs the Python package gguf, which is not installed here: pip install gguf (or pip install -e . in the checkout)", not_installed="gguf"),
    Case("gguf-a-model-llama-cpp-cannot-run", "sample.py", ["--out-dir", "out/tiny", "--export-gguf", "model.gguf"], "--export-gguf cannot write this model: model.attn_window=8 is computed by no llama.cpp architecture (gpt2, llama, qwen2, qwen3, stablelm)", edit_checkpoint(lambda c: c["config"]["model"].update(attn_window=8))),
    Case("gguf-special-token-the-tokenizer-lacks", "sample.py", ["--init-from", "llama", "--export-gguf", "model.gguf"], "llama/tokenizer.json has no token '<s>', which tokenizer_config.json names as its bos_token (add the token to the tokenizer, or name one it has)", llama_dir_naming(bos_token="<s>")),
    # residual-stream switches (model.value_embeds, unet_skips, backout, zero_init_proj)
    Case("export-a-model-with-unet-skips", "sample.py", ["--out-dir", "out/tiny", "--export", "exported"], "--export cannot write this model: model.unet_skips=true is computed by no Hugging Face family", edit_checkpoint(with_unet_skips)),
    # ---- serve.py ----
    # where it listens: checked before the model loads
    Case("serve-port-out-of-range", "serve.py", ["--out-dir", "out/tiny", "--port", "70000"], "--port=70000 is not allowed (use 0 (a free port) to 65535)"),
    Case("serve-port-in-use", "serve.py", ["--out-dir", "out/tiny", "--port", str(BUSY_PORT)], "is in use on 127.0.0.1 (choose another port, or 0 for a free one)"),
    Case("serve-host-unknown", "serve.py", ["--out-dir", "out/tiny", "--host", "no-such-host.invalid", "--port", "0"], "--host='no-such-host.invalid' is neither an address nor a name this machine resolves"),
    Case("serve-host-of-another-machine", "serve.py", ["--out-dir", "out/tiny", "--host", "192.0.2.1", "--port", "0"], "--host='192.0.2.1' is not an address of this machine (use 127.0.0.1, or 0.0.0.0 for all of them)"),
    # the API key
    Case("serve-api-key-file-missing", "serve.py", ["--out-dir", "out/tiny", "--api-key-file", "key.txt"], "--api-key-file='key.txt' does not exist (write the key to that file, or give it with --api-key)"),
    Case("serve-api-key-file-empty", "serve.py", ["--out-dir", "out/tiny", "--api-key-file", "key.txt"], "--api-key-file='key.txt' holds no key (write the key in it as one line)", write("key.txt", "\n")),
    Case("serve-api-key-with-a-space", "serve.py", ["--out-dir", "out/tiny", "--api-key", "two words"], "--api-key holds a key with a space or a character that is not printable ASCII"),
    # limits and the model
    Case("serve-no-rows", "serve.py", ["--out-dir", "out/tiny", "--max-batch", "0"], "--max-batch=0 is not allowed (use 1 to 1,024)"),
    Case("serve-precision-of-a-bfloat16-model", "serve.py", ["--out-dir", "out/missing", "--port", "0", "--precision", "int8", "--dtype", "bfloat16"], "--precision=int8 does not apply here: int8 products are for a float32 model, and this one is bfloat16"),
    Case("serve-without-a-run", "serve.py", ["--out-dir", "out/missing", "--port", "0"], "no checkpoint at out/missing/ckpt.pt"),
    # ---- eval.py ----
    # evaluation: every item is checked before any is scored; --json is written only when every task is
    Case("eval-item-missing-a-field", "eval.py", [*EVAL, "items.jsonl"], "items.jsonl item 2: field 'label' is missing", write("items.jsonl", ITEM + '{"ctx": "ROMEO:", "endings": ["a", "b"]}\n')),
    Case("eval-label-out-of-range", "eval.py", [*EVAL, "items.jsonl"], "items.jsonl item 1: field 'label'=2 is out of range (it has 2 endings: use 0 .. 1)", write("items.jsonl", '{"ctx": "ROMEO:", "endings": ["a", "b"], "label": 2}\n')),
    Case("eval-empty-ending", "eval.py", [*EVAL, "items.jsonl"], "items.jsonl item 1: field 'endings': ending 1=\" \" is empty", write("items.jsonl", '{"ctx": "ROMEO:", "endings": ["a", " "], "label": 0}\n')),
    Case("eval-item-not-json", "eval.py", [*EVAL, "items.jsonl"], "items.jsonl line 1 is not valid JSON", write("items.jsonl", "{ctx: ROMEO}\n")),
    Case("eval-item-nested-too-deeply", "eval.py", [*EVAL, "items.jsonl"], "items.jsonl line 2 is not JSON that can be read: it is nested deeper than Python's parser follows", write("items.jsonl", ITEM + "[" * 100_000 + "\n")),
    Case("eval-hub-task-offline", "eval.py", [*EVAL, "hellaswag"], "--tasks hellaswag: Rowan/hellaswag cannot be read from the Hugging Face hub", env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}),
    Case("eval-unknown-task", "eval.py", [*EVAL, "hellaswagg"], "--tasks 'hellaswagg' is neither a built-in task (hellaswag, arc_easy"),
    Case("eval-text-outside-vocabulary", "eval.py", [*EVAL, "items.jsonl,odd.jsonl", "--json", "out.json"], "odd.jsonl item 1: the text has characters outside the model's 65-character vocabulary: '¿', 'é'", lambda ws: (write("items.jsonl", ITEM)(ws), write("odd.jsonl", '{"ctx": "ROMEO: ¿qué?", "endings": ["a", "b"], "label": 0}\n')(ws))),
    Case("eval-same-task-twice", "eval.py", [*EVAL, "items.jsonl,sub/items.jsonl"], "--tasks names 'items' twice", lambda ws: write_files("items.jsonl", "sub/items.jsonl")(ws, ITEM)),
    # weights that are not numbers, tensors of another shape
    Case("eval-nan-checkpoint", "eval.py", [*EVAL, "items.jsonl"], "out/tiny/ckpt.pt: the weight transformer.h.1.mlp.c_fc.weight holds 1 NaN and 0 infinite values (of 4,096): the run diverged", lambda ws: (write("items.jsonl", ITEM)(ws), edit_checkpoint(set_value("transformer.h.1.mlp.c_fc.weight", float("nan")))(ws))),
    # tokenizers read from a file refuse what their vocabulary cannot encode, as the run's own does
    Case("eval-ending-outside-an-exported-vocabulary", "eval.py", ["--init-from", "exported", "--device", "cpu", "--no-progress", "--tasks", "odd.jsonl"], "odd.jsonl item 1: the text has characters that exported/tokenizer.json cannot encode: '¿' at character 7", lambda ws: (export_run(ws), write("odd.jsonl", '{"ctx": "ROMEO:", "endings": ["¿¿", "Peace!"], "label": 0}\n')(ws))),
    # evaluation items: every field's type and shape checked by name, the built-in tasks' records too
    Case("eval-endings-as-text", "eval.py", [*EVAL, "items.jsonl"], 'items.jsonl item 1: field \'endings\'="go" is text, not a list (give a list of 2 or more non-empty texts)', write("items.jsonl", '{"ctx": "ROMEO:", "endings": "go", "label": 0}\n')),
    Case("eval-endings-as-object", "eval.py", [*EVAL, "items.jsonl"], 'items.jsonl item 1: field \'endings\'={"a": 1, "b": 2} is an object, not a list', write("items.jsonl", '{"ctx": "ROMEO:", "endings": {"a": 1, "b": 2}, "label": 0}\n')),
    Case("eval-one-ending", "eval.py", [*EVAL, "items.jsonl"], 'items.jsonl item 1: field \'endings\'=["Peace!"] has one ending (give a list of 2 or more', write("items.jsonl", '{"ctx": "ROMEO:", "endings": ["Peace!"], "label": 0}\n')),
    Case("eval-no-endings", "eval.py", [*EVAL, "items.jsonl"], "items.jsonl item 1: field 'endings'=[] is an empty list", write("items.jsonl", '{"ctx": "ROMEO:", "endings": [], "label": 0}\n')),
    Case("eval-context-not-text", "eval.py", [*EVAL, "items.jsonl"], "items.jsonl item 1: field 'ctx'=5 is a whole number, not text", write("items.jsonl", '{"ctx": 5, "endings": ["a", "b"], "label": 0}\n')),
    Case("eval-label-true", "eval.py", [*EVAL, "items.jsonl"], "items.jsonl item 1: field 'label'=true is true or false, not a whole number", write("items.jsonl", '{"ctx": "ROMEO:", "endings": ["a", "b"], "label": true}\n')),
    Case("eval-label-decimal", "eval.py", [*EVAL, "items.jsonl"], "items.jsonl item 1: field 'label'=1.0 is a decimal number, not a whole number", write("items.jsonl", '{"ctx": "ROMEO:", "endings": ["a", "b"], "label": 1.0}\n')),
    Case("eval-label-as-text", "eval.py", [*EVAL, "items.jsonl"], 'items.jsonl item 1: field \'label\'="1" is text, not a whole number', write("items.jsonl", '{"ctx": "ROMEO:", "endings": ["a", "b"], "label": "1"}\n')),
    Case("eval-cloze-of-one-word", "eval.py", [*EVAL, "words.jsonl"], 'words.jsonl item 1: field \'text\'="Peace!" is one word (give text of two or more words', write("words.jsonl", '{"text": "Peace!"}\n')),
    Case("eval-hellaswag-endings-as-text", "eval.py", [*EVAL, "hellaswag=hs.jsonl"], 'hs.jsonl item 1: field \'endings\'="go" is text, not a list', write("hs.jsonl", '{"activity_label": "A", "ctx_a": "B", "ctx_b": "c", "endings": "go", "label": "0"}\n')),
    Case("eval-hellaswag-ending-only-marks", "eval.py", [*EVAL, "hellaswag=hs.jsonl"], "hs.jsonl item 1: field 'endings': ending 1 is empty once prepared for scoring", write("hs.jsonl", '{"activity_label": "A", "ctx_a": "B", "ctx_b": "c", "endings": ["go", "[header]"], "label": "0"}\n')),
    Case("eval-arc-answer-not-a-choice", "eval.py", [*EVAL, "arc_easy=arc.jsonl"], "arc.jsonl item 1: field 'answerKey'=\"E\" is none of the choices' labels (A, B)", write("arc.jsonl", '{"question": "Who?", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "E"}\n')),
    Case("eval-piqa-label-as-text", "eval.py", [*EVAL, "piqa=piqa.jsonl"], 'piqa.jsonl item 1: field \'label\'="0" is text, not a whole number', write("piqa.jsonl", '{"goal": "Who?", "sol1": "a", "sol2": "b", "label": "0"}\n')),
    Case("eval-lambada-one-word", "eval.py", [*EVAL, "lambada=lambada.jsonl"], 'lambada.jsonl item 1: field \'text\'="Peace!" is one word', write("lambada.jsonl", '{"text": "Peace!"}\n')),
    Case("eval-tasks-only-commas", "eval.py", [*EVAL, ","], "--tasks names no task (give NAME, NAME=FILE or FILE"),
    Case("eval-tasks-empty", "eval.py", [*EVAL, ""], "--tasks names no task (give NAME, NAME=FILE or FILE"),
    Case("eval-precision-of-a-bfloat16-model", "eval.py", [*EVAL, "items.jsonl", "--precision", "int8", "--dtype", "bfloat16"], "--precision=int8 does not apply here: int8 products are for a float32 model, and this one is bfloat16", write("items.jsonl", ITEM)),
    # outputs: a file is replaced only when it is an earlier output of its kind, checked before any work
    Case("eval-json-over-a-task-file", "eval.py", [*EVAL, "items.jsonl", "--json", "items.jsonl"], "--json='items.jsonl' is a file this command reads, which its output would replace (choose another --json)", write("items.jsonl", ITEM)),
    Case("eval-json-over-the-checkpoint", "eval.py", [*EVAL, "items.jsonl", "--json", "out/tiny/ckpt.pt"], "--json='out/tiny/ckpt.pt' is a file this command reads", write("items.jsonl", ITEM)),
    Case("eval-json-over-another-file", "eval.py", [*EVAL, "items.jsonl", "--json", "tiny.toml"], "--json='tiny.toml' already exists and is not a results file of eval.py: it is never replaced (choose another --json, or remove the file yourself)", write("items.jsonl", ITEM)),
    Case("eval-json-over-a-deeply-nested-file", "eval.py", [*EVAL, "items.jsonl", "--json", "deep.json"], "--json='deep.json' already exists and is not a results file of eval.py: it is never replaced", lambda ws: (write("items.jsonl", ITEM)(ws), write("deep.json", "[" * 100_000)(ws))),
    Case("eval-json-is-a-directory", "eval.py", ["--out-dir", "out/missing", "--tasks", "items.jsonl", "--json", "out"], "--json='out' is a directory, not a file (give the name of a file to write)"),
    # generation tasks: a prompt or a conversation, and a non-empty answer; gsm8k's answer ends in its final number
    Case("eval-generation-answer-missing", "eval.py", [*EVAL, "gen.jsonl"], "gen.jsonl item 1: field 'answer' is missing", write("gen.jsonl", '{"prompt": "ROMEO:"}\n')),
    Case("eval-generation-empty-answer", "eval.py", [*EVAL, "gen.jsonl"], "gen.jsonl item 1: field 'answer'=\" \" is empty (give non-empty text)", write("gen.jsonl", '{"prompt": "ROMEO:", "answer": " "}\n')),
    Case("eval-generation-prompt-not-text", "eval.py", [*EVAL, "gen.jsonl"], "gen.jsonl item 1: field 'prompt'=5 is a whole number, not text", write("gen.jsonl", '{"prompt": 5, "answer": "Peace!"}\n')),
    Case("eval-generation-no-prompt", "eval.py", [*EVAL, "gen.jsonl"], "gen.jsonl item 1: field 'prompt' is missing (each item needs prompt or messages, and answer)", write("gen.jsonl", '{"answer": "Peace!"}\n')),
    Case("eval-generation-prompt-and-messages", "eval.py", [*EVAL, "gen.jsonl"], "gen.jsonl item 1: fields 'prompt' and 'messages' are both given", write("gen.jsonl", '{"prompt": "ROMEO:", "messages": [{"role": "user", "content": "ROMEO:"}], "answer": "Peace!"}\n')),
    Case("eval-generation-unknown-role", "eval.py", [*EVAL, "gen.jsonl"], "gen.jsonl item 1: field 'messages'[1]: role='bot' is not one of system, user, assistant", write("gen.jsonl", '{"messages": [{"role": "bot", "content": "ROMEO:"}], "answer": "Peace!"}\n')),
    Case("eval-generation-empty-message", "eval.py", [*EVAL, "gen.jsonl"], "gen.jsonl item 1: field 'messages'[2]: content='' is not text", write("gen.jsonl", '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ""}], "answer": "Peace!"}\n')),
    Case("eval-generation-last-message-not-the-user", "eval.py", [*EVAL, "gen.jsonl"], "gen.jsonl item 1: field 'messages': the last message is the assistant's, not the user's", write("gen.jsonl", '{"messages": [{"role": "user", "content": "ROMEO:"}, {"role": "assistant", "content": "Peace!"}], "answer": "Peace!"}\n')),
    Case("eval-generation-messages-without-a-template", "eval.py", [*EVAL, "gen.jsonl"], "gen.jsonl item 1: field 'messages' is a conversation, and this model's tokenizer has no chat template to render it with", write("gen.jsonl", '{"messages": [{"role": "user", "content": "ROMEO:"}], "answer": "Peace!"}\n')),
    Case("eval-generation-prompt-outside-vocabulary", "eval.py", [*EVAL, "gen.jsonl"], "gen.jsonl item 1: the text has characters outside the model's 65-character vocabulary: '¿'", write("gen.jsonl", '{"prompt": "¿ROMEO?", "answer": "Peace!"}\n')),
    Case("eval-gsm8k-answer-without-its-number", "eval.py", [*EVAL, "gsm8k=gsm.jsonl"], "gsm.jsonl item 1: field 'answer'=\"It is 72.\" has no '#### ' before its final answer", write("gsm.jsonl", '{"question": "How many?", "answer": "It is 72."}\n')),
    Case("eval-max-new-tokens-zero", "eval.py", [*EVAL, "gen.jsonl", "--max-new-tokens", "0"], "--max-new-tokens=0 is not allowed (use 1 or more)", write("gen.jsonl", '{"prompt": "ROMEO:", "answer": "Peace!"}\n')),
    # options: an unknown one is named with the nearest known one, in one line (errors.ArgumentParser)
    Case("misspelt-required-option", "eval.py", ["--out-dir", "out/tiny", "--taks", "items.jsonl"], "error: unrecognized option --taks (did you mean --tasks?)"),
    # ---- plot.py ----
    # pictures
    Case("plot-a-metrics-value-that-is-not-a-number", "plot.py", ["loss", "out/tiny", "--out", "loss.png"], "out/tiny/metrics.jsonl line 2 is not a record of this trainer (loss='3.2' is not a number)", insert_metrics_line('{"step": 3, "loss": "3.2"}')),
    Case("plot-a-metrics-record-without-a-step", "plot.py", ["loss", "out/tiny", "--out", "loss.png"], "out/tiny/metrics.jsonl line 2 is not a record of this trainer (it has no step)", insert_metrics_line('{"loss": 3.2}')),
    Case("plot-a-metrics-line-nested-too-deeply", "plot.py", ["loss", "out/tiny", "--out", "loss.png"], "out/tiny/metrics.jsonl line 2 is not a record of this trainer (not a JSON object)", insert_metrics_line("[" * 100_000)),
    Case("plot-every-pattern-at-a-tiny-block", "plot.py", ["mask", "--all", "--model.block_size=2", "--size", "2", "--out", "all.png"], "--all --size=2 is too few positions to tell the patterns apart: they differ from 7 on"),
    # outputs: a file is replaced only when it is an earlier output of its kind, checked before any work
    Case("plot-over-another-file", "plot.py", ["mask", "--size", "8", "--out", "notes.png"], "--out='notes.png' already exists and is not a picture drawn by plot.py", write_files("notes.png")),
    # options: an unknown one is named with the nearest known one, in one line (errors.ArgumentParser)
    Case("misspelt-plot-option", "plot.py", ["mask", "--sise", "8", "--out", "mask.png"], "error: unrecognized option --sise (did you mean --size?)"),
    Case("option-without-a-match", "plot.py", ["loss", "out/tiny", "--out", "loss.png", "--zoom"], "error: unrecognized option --zoom (see plot.py --help)"),
    # ---- bench/ ----
    # benchmarks: options checked in one place (bench/arguments.py) before anything is built or timed
    Case("bench-zero-jobs", "bench/ablation.py", ["--out-dir", "ablation", "--jobs", "0"], "--jobs=0 is not allowed (use 1 or more)"),
    Case("bench-seed-beyond-64-bits", "bench/ablation.py", ["--out-dir", "ablation", "--seeds", str(2**64)], f"--seeds={2**64} is not allowed (use -9223372036854775808 to 9223372036854775807)"),
    # outputs: a file is replaced only when it is an earlier output of its kind, checked before any work
    Case("ablation-over-foreign-results", "bench/ablation.py", ["--out-dir", "ablation", "--seeds", "1"], "--out-dir='ablation/results.jsonl' already exists and is not the results.jsonl of an earlier ablation", write_files("ablation/results.jsonl")),
    # benchmarks: options checked in one place (bench/arguments.py) before anything is built or timed
    Case("bench-negative-warm-up", "bench/attention.py", ["--warmup", "-1"], "--warmup=-1 is not allowed (use 0 or more)"),
    Case("bench-heads-do-not-divide-width", "bench/attention.py", ["--n-embd", "100", "--n-head", "3"], "--n-layer, --n-head, --n-embd and --block-size describe no model: n_embd=100 is not divisible by n_head=3"),
    Case("bench-unknown-device", "bench/attention.py", ["--device", "foo"], "--device='foo' is not one of auto, cpu, cuda, cuda:N, mps"),
    Case("bench-infinite-budget", "bench/budget.py", ["--reference", "tiny.toml", "--candidate", "tiny.toml", "--budget", "inf"], "--budget=inf is not allowed (use a finite number above 0)"),
    Case("bench-one-round", "bench/budget.py", ["--reference", "tiny.toml", "--candidate", "tiny.toml", "--rounds", "1"], "--rounds=1 is not allowed (use 2 or more)"),
    Case("bench-cuda-without-gpu", "bench/decode.py", ["--device", "cuda"], "--device='cuda' but this machine has no usable CUDA GPU", needs_no_gpu=True),
    Case("bench-batch-size-of-zero", "bench/decode.py", ["--batch-sizes", "1", "0"], "--batch-sizes=0 is not allowed (use 1 or more)"),
    Case("bench-more-positions-than-gpt2", "bench/decode.py", ["--new-tokens", "2000"], "--prompt-len=16 and --new-tokens=2000 make 2016 positions, more than the 1024"),
    # outputs: a file is replaced only when it is an earlier output of its kind, checked before any work
    Case("bench-json-over-another-file", "bench/decode.py", ["--json", "tiny.toml"], "--json='tiny.toml' already exists and is not the figures of an earlier decode.py"),
    Case("gpu-report-over-another-file", "bench/gpu.py", ["--out", "report", "--smoke"], "--out='report/report.md' already exists and is not a file of an earlier report of bench/gpu.py", write_files("report/report.md")),
    # benchmarks: options checked in one place (bench/arguments.py) before anything is built or timed
    Case("bench-size-not-a-number", "bench/prepare.py", ["--megabytes", "nan"], "--megabytes=nan is not allowed (use a finite number above 0)"),
    Case("bench-real-model-not-a-gguf-file", "bench/real_model.py", ["--gguf", "tiny.toml"], "--gguf='tiny.toml' is not a GGUF file (give a file ending in .gguf)"),
    # nanoGPT beside ours (bench/speedrun.py, bench/step_profile.py): a folder that is not a checkout of it
    Case("speedrun-not-nanogpt", "bench/speedrun.py", ["--nanogpt", "data", "--config", "tiny.toml"], "--nanogpt='data' is not a checkout of nanoGPT (no train.py, config/train_shakespeare_char.py, data/shakespeare_char/prepare.py)"),
    Case("step-profile-not-nanogpt", "bench/step_profile.py", ["--nanogpt", "out", "--config", "tiny.toml"], "--nanogpt='out' is not a checkout of nanoGPT"),
    # benchmarks: options checked in one place (bench/arguments.py) before anything is built or timed
    Case("bench-zero-steps", "bench/train.py", [*TRAIN, "--steps", "0"], "--steps=0 is not allowed (use 1 or more)"),
    Case("bench-word-for-a-number", "bench/train.py", [*TRAIN, "--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    Case("bench-zero-stride", "bench/val.py", ["out/tiny", "--stride", "0"], "--stride=0 is not allowed (use 1 or more)"),
]  # fmt: skip


def _drop_meta_key(workspace: Path, key: str) -> None:
    path = workspace / "data" / "shakespeare_char" / "meta.json"
    meta = json.loads(path.read_text())
    del meta[key]
    path.write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, data_dir) -> Path:
    run_dir = tmp_path_factory.mktemp("catalogue") / "tiny"
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=10)).fit()
    return run_dir


@pytest.fixture
def workspace(tmp_path, data_dir, trained_run, monkeypatch) -> Path:
    shutil.copytree(data_dir / "shakespeare_char", tmp_path / "data" / "shakespeare_char")
    shutil.copytree(trained_run, tmp_path / "out" / "tiny")
    (tmp_path / "tiny.toml").write_text(tiny_toml(out_dir="out/new", data_dir="data"))
    config = (tmp_path / "out" / "tiny" / "config.toml").read_text()
    config = config.replace(f'"{trained_run}"', '"out/tiny"').replace(f'"{data_dir}"', '"data"')
    (tmp_path / "out" / "tiny" / "config.toml").write_text(config)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("case", CATALOGUE, ids=[case.id for case in CATALOGUE])
def test_bad_input_gets_one_line_and_loses_nothing(case, workspace, monkeypatch, capsys):
    if case.needs_no_gpu and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    if case.needs_permissions and os.geteuid() == 0:
        pytest.skip("root may write anywhere")
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    if case.not_installed:
        block_import(case.not_installed, monkeypatch)
    case.setup(workspace)
    capsys.readouterr()  # what the setup printed (preparing, training) is not the entry point's
    before = snapshot(workspace)
    code = run_entry_point(case.script, case.args, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert case.message in lines[0]
    assert "this ran while loading" not in capsys.readouterr().out
    assert snapshot(workspace) == before


def block_import(package: str, monkeypatch) -> None:
    """Make `import package` fail for the rest of the test, as where it is not installed: also in this
    project's modules that imported it already (they are imported afresh, and fail)."""
    imported = sys.modules.get(package)
    for name, module in list(sys.modules.items()):
        if (
            imported is not None
            and name.partition(".")[0] in PROJECT_MODULES
            and getattr(module, package, None) is imported
        ):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)


@pytest.mark.parametrize("module", ["model.no_such_module", "torch.no_such_module"])
def test_a_module_missing_from_the_project_or_an_installed_package_keeps_its_traceback(module):
    """Only a package that is not installed at all is the user's to mend (gguf-package-not-installed):
    a module missing from this checkout or from an installed package is a bug, shown whole."""
    with pytest.raises(ModuleNotFoundError):
        run_cli(lambda: importlib.import_module(module))


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class FullDiskFile:
    """A file on a full disk: opening works, writing does not."""

    def __init__(self, *args, **kwargs):
        pass

    write = staticmethod(disk_full)

    def close(self) -> None:
        pass


def fill_disk_at_checkpoint(monkeypatch) -> None:
    monkeypatch.setattr(checkpoint_module.torch, "save", disk_full)


def fill_disk_at_metrics(monkeypatch) -> None:
    monkeypatch.setattr(metrics_module, "open", FullDiskFile, raising=False)


@pytest.mark.parametrize(
    "fill_disk,message",
    [
        (
            fill_disk_at_checkpoint,
            "the checkpoint of step 11 could not be written to out/tiny (No space left on device)",
        ),
        (fill_disk_at_metrics, "could not add step 11 to out/tiny/metrics.jsonl (No space left on device)"),
    ],
    ids=["checkpoint", "metrics"],
)
def test_a_full_disk_ends_the_run_in_one_line_and_keeps_the_previous_checkpoint(
    fill_disk, message, workspace, monkeypatch, capsys
):
    checkpoint = workspace / "out" / "tiny" / "ckpt.pt"
    before = checkpoint.read_bytes()
    fill_disk(monkeypatch)
    code = run_entry_point("train.py", [*RESUME, "--train.max_iters=11"], monkeypatch)  # one step, then a save
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [err.strip().splitlines()[-1]], err
    assert message in errors[0]
    assert checkpoint.read_bytes() == before and not list(checkpoint.parent.glob("*.tmp"))
    monkeypatch.undo()
    assert load_checkpoint(checkpoint)["step"] == 10


def test_a_full_disk_while_exporting_ends_in_one_line_and_leaves_no_partial_file(tmp_path, monkeypatch, capsys):
    model = tiny_model(vocab_size=GPT2Tokenizer().vocab_size)
    monkeypatch.setattr(pretrained_module, "write_safetensors", disk_full)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: export_model(model, GPT2Tokenizer(), tmp_path / "exported"))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.strip().splitlines() == [
        "error: the disk is full: free some space (or choose a folder on another disk) and run again"
    ]
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


@pytest.mark.parametrize(
    "script", sorted(p.name for p in (PROJECT_ROOT / "bench").glob("*.py") if p.name != "arguments.py")
)
def test_every_bench_script_answers_a_bad_option_in_one_line(script, workspace, monkeypatch, capsys):
    """Each bench/ script parses its options through bench/arguments.py: argparse's own complaints
    too are one `error:` line, with no usage text, before anything is timed."""
    code = run_entry_point(f"bench/{script}", ["--no-such-option=1"], monkeypatch)
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err


def test_catalogue_is_documented_case_by_case():
    table = (PROJECT_ROOT / "docs" / "bad-inputs.md").read_text()
    documented = [line.split("|")[1].strip().strip("`") for line in table.splitlines() if line.startswith("| `")]
    assert documented == [case.id for case in CATALOGUE]
    assert len(CATALOGUE) >= 25
