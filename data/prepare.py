"""Prepare a corpus for training: tokenize it and write train.bin, val.bin and meta.json.

    python data/prepare.py --dataset shakespeare_char        # a bundled corpus, into data/shakespeare_char
    python data/prepare.py --dataset notes.txt --tokenizer gpt2 --out data/notes
    python data/prepare.py --dataset notes.txt --tokenizer bpe --vocab-size 4096 --out data/notes
    python data/prepare.py --dataset notes.txt --tokenizer models/qwen/tokenizer.json --out data/notes
    python data/prepare.py --dataset notes.txt --tokenizer models/smollm2 --out data/notes   # a model folder's
    python data/prepare.py --dataset notes.txt --tokenizer SmolLM2-135M-Instruct.Q4_1.gguf --out data/notes
    python data/prepare.py --dataset corpus/ --tokenizer gpt2 --out data/corpus --num-proc 2
    python data/prepare.py --dataset HuggingFaceFW/fineweb-edu --config-name sample-10BT \\
        --tokenizer gpt2 --out data/fineweb_edu --val-fraction 0.0005 --streaming
    python data/prepare.py --dataset chats.jsonl --chat --tokenizer out/shakespeare_char --block-size 64

--chat reads conversations instead (docs/chat.md): JSON lines of {"messages": [{"role", "content"}]}
or ShareGPT's {"conversations": [{"from", "value"}]}, a local .jsonl/.json file or a hub dataset. Each
conversation is rendered through a chat template into one document, and OUT/train.mask.bin and
OUT/val.mask.bin say, one byte per token, which tokens are trained (bit 0: --train-on) and where each
conversation starts (bit 1). --tokenizer: a Hugging Face model folder or a GGUF file (its own template), or char,
gpt2, a tokenizer.json, a prepared dataset folder or a run directory (their tokenizer, with the
built-in template and its special tokens added after its ids). A conversation longer than
--block-size tokens is refused, naming it, or cut to it with --too-long truncate (the count is printed);
a split left without a trained token within --block-size of a conversation's start (every reply cut
off) is refused, naming it: its loss would be a mean over nothing.

--dataset is a bundled corpus, a local .txt, .jsonl, .json or .parquet file, a folder of such files
(and of no other: a file it would not read is named and refused; hidden ones are skipped),
or else the name of a Hugging Face hub dataset; all are read through `datasets.load_dataset`
(data/sources.py). A document is one row (its --text-field) or one whole .txt file.

Splits: each document goes to val with probability --val-fraction, decided by a hash of its
position and --seed, so a corpus always splits the same way, with any --num-proc and with or
without --streaming. A corpus of a single document (one .txt file, such as the bundled Shakespeare)
is cut by characters instead, as nanoGPT does: the first (1 - val_fraction) of the text is train.
With GPT-2 BPE every document is followed by <|endoftext|>; the char tokenizer has no such token,
and the two parts of a single document need none.

Tokenizers: char (the corpus's characters), gpt2 (GPT-2's BPE), bpe (a byte-level BPE of
--vocab-size tokens trained here, with the `tokenizers` package, on the train split only, so that
val stays unseen text) or the path of any tokenizer.json (a Hugging Face model folder's, or one
trained before). A BPE or a given tokenizer.json is written to OUT/tokenizer.json, and meta.json
records its sha256, so that a run refuses a dataset or checkpoint of another tokenizer. A corpus
character that a given tokenizer.json cannot encode is refused, naming its document and position.

Token ids are uint16 when the vocabulary fits, else uint32. Documents are read in batches,
tokenized by --num-proc threads (tiktoken releases the GIL) and written as they come, so memory
stays flat whatever the corpus size. train.bin and val.bin are written to temporary names and
renamed only when complete (tokenizer.json too); meta.json comes last, so a folder with meta.json is complete, and a
failed run leaves nothing behind.
"""

import argparse
import dataclasses
import itertools
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python data/prepare.py`: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.chat_dataset import CHECKPOINT_FILE, TOO_LONG, prepare_chat  # noqa: E402
from data.chat_tasks import FILES as CHAT_TASKS_FILES  # noqa: E402
from data.chat_tasks import OUT as CHAT_TASKS_OUT  # noqa: E402
from data.conversations import (  # noqa: E402
    TRAIN_ON,
    read_conversations,
)
from data.corpus import BLOCK_SIZE, BUNDLED, CORPUS_DIR, SEED, VAL_FRACTION, prepare, refuse_prepared  # noqa: E402
from data.files import check_writable_dir, shipped_run  # noqa: E402
from data.sources import open_corpus, open_text_file  # noqa: E402
from data.tokenizer import (  # noqa: E402
    BPE_SPECIAL_TOKENS,
    MAX_VOCAB_SIZE,
    TOKENIZER_FILE,
    JsonTokenizer,
    check_bpe_vocab_size,
)
from errors import ArgumentParser, UserError, run_cli  # noqa: E402


def main() -> None:
    args = parse_args()
    if args.chat:
        return main_chat(args)
    if args.dataset in BUNDLED:
        corpus_file, tokenizer_name = BUNDLED[args.dataset]
        if args.tokenizer not in (None, tokenizer_name):
            raise UserError(f"--tokenizer={args.tokenizer}: the bundled {args.dataset!r} uses {tokenizer_name}")
        spec, name = str(CORPUS_DIR / corpus_file), corpus_file
    else:
        if args.tokenizer is None:
            raise UserError(
                f"--tokenizer is required for --dataset={args.dataset!r} (char, gpt2, bpe or a tokenizer.json)"
            )
        tokenizer_name, spec, name = args.tokenizer, args.dataset, args.dataset
    out = Path(args.out or Path(args.data_dir) / default_folder(args))
    check_writable_dir(out, "--out" if args.out else "--data-dir")
    refuse_prepared(out)  # before a long download
    start = time.perf_counter()
    if args.dataset in BUNDLED:
        corpus = open_text_file(Path(spec))  # without datasets: a GPU image may lack it
    else:
        corpus = open_corpus(
            spec,
            text_field=args.text_field,
            split=args.split,
            config_name=args.config_name,
            revision=args.revision,
            streaming=args.streaming,
            num_proc=args.num_proc,
            cache_dir=args.cache_dir,
        )
    meta = prepare(
        dataclasses.replace(corpus, name=name),
        tokenizer_name,
        out,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        seed=args.seed,
        block_size=args.block_size,
        num_proc=args.num_proc,
        max_documents=args.max_documents,
    )
    print(
        f"wrote {out}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens from "
        f"{meta['documents']:,} documents, {meta['tokenizer']} tokenizer, vocabulary {meta['vocab_size']:,}, "
        f"in {time.perf_counter() - start:.1f} s"
    )


def main_chat(args: argparse.Namespace) -> None:
    if args.tokenizer is None:
        raise UserError(
            "--chat needs --tokenizer: a Hugging Face model folder, a run directory or prepared dataset to fine-tune "
            "from, char, gpt2 or a tokenizer.json"
        )
    out = Path(args.out or Path(args.data_dir) / default_folder(args))
    check_writable_dir(out, "--out" if args.out else "--data-dir")
    refuse_prepared(out)
    start = time.perf_counter()
    conversations = read_conversations(
        args.dataset, split=args.split, config_name=args.config_name, revision=args.revision, cache_dir=args.cache_dir
    )
    meta = prepare_chat(
        itertools.islice(conversations, args.max_documents),
        args.tokenizer,
        out,
        source=args.dataset,
        train_on=args.train_on,
        too_long=args.too_long,
        val_fraction=args.val_fraction,
        seed=args.seed,
        block_size=args.block_size,
    )
    print(
        f"wrote {out}: {meta['documents']:,} conversations, {meta['train_tokens']:,} train and {meta['val_tokens']:,} "
        f"val tokens, the longest {meta['chat']['longest']:,}; {meta['tokenizer']} tokenizer, vocabulary "
        f"{meta['vocab_size']:,} (special tokens added: {', '.join(meta['chat']['added_specials']) or 'none'}), "
        f"in {time.perf_counter() - start:.1f} s"
    )


def default_folder(args: argparse.Namespace) -> str:
    """data/<name>: the bundled name, the file's stem, the folder's or hub dataset's last part."""
    if args.dataset in BUNDLED:
        return args.dataset
    name = Path(args.dataset.rstrip("/")).stem
    return f"{name}-{args.config_name}" if args.config_name else name


def parse_args() -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dataset",
        required=True,
        help=f"a bundled corpus ({', '.join(BUNDLED)}), a .txt/.jsonl/.json/.parquet file, a folder of them, "
        f"or a Hugging Face hub dataset name",
    )
    parser.add_argument(
        "--tokenizer",
        help="char, gpt2, bpe (a byte-level BPE trained on the train split, written to OUT/tokenizer.json) or the "
        "path of a tokenizer.json (a Hugging Face model folder's, or one trained before) or of a model folder "
        "holding one, or a GGUF file of llama.cpp (to fine-tune that model); bundled corpora have their own",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        help=f"--tokenizer=bpe: tokens in the trained vocabulary, {256 + len(BPE_SPECIAL_TOKENS):,} (the bytes and "
        f"<|endoftext|>) to {MAX_VOCAB_SIZE:,}; e.g. 4096",
    )
    parser.add_argument("--out", help="output folder (default: DATA_DIR/<dataset name>)")
    parser.add_argument("--data-dir", default="data", help="folder for the default --out (default: data)")
    parser.add_argument("--text-field", default="text", help="the column that holds each document's text")
    parser.add_argument("--split", default="train", help="hub datasets: the split to read (default: train)")
    parser.add_argument("--config-name", help="hub datasets: the configuration, e.g. sample-10BT")
    parser.add_argument("--revision", help="hub datasets: a branch, tag or commit, e.g. refs/convert/parquet")
    parser.add_argument(
        "--streaming",
        action="store_true",
        help="read the source as it is tokenized, with no copy in the datasets cache (for corpora that do not "
        "fit on disk); progress then shows no total",
    )
    parser.add_argument("--num-proc", type=int, default=1, help="tokenizing threads (and files converted at once)")
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=VAL_FRACTION,
        help=f"share of documents (of characters, for a single document) held out for validation "
        f"(default: {VAL_FRACTION})",
    )
    parser.add_argument("--seed", type=int, default=SEED, help=f"seeds the choice of val documents (default: {SEED})")
    parser.add_argument(
        "--block-size",
        type=int,
        default=BLOCK_SIZE,
        help=f"the model's context: each split must hold at least block_size + 1 tokens (default: {BLOCK_SIZE})",
    )
    parser.add_argument("--max-documents", type=int, help="read only the first N documents (conversations)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="the dataset holds conversations (messages or ShareGPT records): render them through a chat template "
        "and write which tokens are trained beside the ids (docs/chat.md)",
    )
    parser.add_argument(
        "--train-on",
        choices=TRAIN_ON,
        default="assistant",
        help="--chat: the tokens trained: every assistant reply and its end-of-turn token (default), every token, "
        "or the last reply only",
    )
    parser.add_argument(
        "--too-long",
        choices=TOO_LONG,
        default="refuse",
        help="--chat: a conversation longer than --block-size is refused, naming it (default), or truncated to it",
    )
    parser.add_argument("--cache-dir", help="the datasets cache (default: datasets' own, under HF_HOME)")
    args = parser.parse_args()
    if not 0 < args.val_fraction < 1:
        raise UserError(f"--val-fraction={args.val_fraction} must be between 0 and 1")
    for option in ("num_proc", "block_size", "max_documents"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise UserError(f"--{option.replace('_', '-')}={value} must be a positive integer")
    if args.tokenizer == "bpe":
        check_bpe_vocab_size(args.vocab_size)
    elif args.vocab_size is not None:
        raise UserError(f"--vocab-size={args.vocab_size} applies only to --tokenizer=bpe, not {args.tokenizer}")
    if not args.chat and (args.train_on != "assistant" or args.too_long != "refuse"):
        raise UserError("--train-on and --too-long apply to conversations: add --chat")
    if args.tokenizer is not None:
        check_tokenizer_path(args.tokenizer, args.chat)
    if args.chat:
        if args.dataset in BUNDLED:
            raise UserError(f"--chat: {args.dataset!r} is a bundled text corpus, not conversations")
        check_conversations_file(args.dataset)
        return args  # --tokenizer is read with the conversations (a folder is a model's, a dataset's or a run's)
    if args.tokenizer not in (None, *TOKENIZERS) and Path(args.tokenizer).is_dir():
        args.tokenizer = str(Path(args.tokenizer) / "tokenizer.json")  # a model folder: its own tokenizer
    if args.tokenizer not in (None, *TOKENIZERS) and Path(args.tokenizer).suffix == ".gguf":
        from data.gguf_tokenizer import gguf_tokenizer, open_gguf  # a GGUF file's tokenizer: the others need none

        gguf_tokenizer(open_gguf(Path(args.tokenizer), "--tokenizer"), args.tokenizer)  # refused now, if it is none
    elif args.tokenizer not in (None, *TOKENIZERS):
        JsonTokenizer.from_file(Path(args.tokenizer))  # refused now, before a long download, if it does not load
    return args


def check_tokenizer_path(spec: str, chat: bool) -> None:
    """A --tokenizer naming a path where nothing it could be read from is: refused before any data is
    read. A file is read, or refused, by JsonTokenizer.from_file (so is a missing .json); a folder must
    hold what is read from it: with --chat a run's ckpt.pt, a prepared dataset's meta.json or a model's
    tokenizer.json, without --chat a tokenizer.json. The run directory of a shipped config (out/NAME)
    that is not trained yet is named with the command that trains it."""
    path = Path(spec)
    if spec in TOKENIZERS or path.is_file() or (path.suffix == ".json" and not path.exists()):
        return
    read = (CHECKPOINT_FILE, "meta.json", TOKENIZER_FILE) if chat else (TOKENIZER_FILE,)
    if path.is_dir() and any((path / name).is_file() for name in read):
        return
    run = shipped_run(path) if chat else None
    accepted = (
        f"a run directory with its {CHECKPOINT_FILE}, a prepared dataset folder, a model folder, a tokenizer.json, "
        f"char or gpt2"
        if chat
        else "a tokenizer.json, a model folder holding one, char, gpt2 or bpe"
    )
    if not path.exists() and run:
        raise UserError(f"--tokenizer={spec!r} does not exist yet: {run}")
    if not path.exists():
        raise UserError(f"--tokenizer={spec!r} does not exist (give {accepted})")
    if run:
        raise UserError(f"--tokenizer={spec!r} holds no {CHECKPOINT_FILE} yet: {run}")
    described = f"{CHECKPOINT_FILE}, meta.json or {TOKENIZER_FILE}" if chat else TOKENIZER_FILE
    raise UserError(f"--tokenizer={spec!r} holds no {described} (give {accepted})")


def check_conversations_file(spec: str) -> None:
    """A --chat --dataset naming a .jsonl or .json file that is not there: refused before anything
    else, with the command that writes it when it is one of the chat quickstart's files."""
    path = Path(spec)
    if path.exists() or path.suffix not in (".jsonl", ".json"):
        return  # read_conversations reads it, refuses it, or looks for it on the hub
    made = Path(os.path.abspath(path.parent)) == Path(os.path.abspath(CHAT_TASKS_OUT)) and path.name in CHAT_TASKS_FILES
    writes = f" (python data/chat_tasks.py --out {CHAT_TASKS_OUT} writes it)" if made else ""
    raise UserError(f"--dataset={spec!r} does not exist{writes}")


TOKENIZERS = ("char", "gpt2", "bpe")  # or the path of a tokenizer.json


if __name__ == "__main__":
    run_cli(main)
