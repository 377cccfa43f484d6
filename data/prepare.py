"""Prepare a corpus for training: tokenize it and write train.bin, val.bin and meta.json.

    python data/prepare.py --dataset shakespeare_char        # a bundled corpus, into data/shakespeare_char
    python data/prepare.py --dataset notes.txt --tokenizer gpt2 --out data/notes
    python data/prepare.py --dataset notes.txt --tokenizer bpe --vocab-size 4096 --out data/notes
    python data/prepare.py --dataset notes.txt --tokenizer models/qwen/tokenizer.json --out data/notes
    python data/prepare.py --dataset notes.txt --tokenizer models/smollm2 --out data/notes   # a model folder's
    python data/prepare.py --dataset corpus/ --tokenizer gpt2 --out data/corpus --num-proc 2
    python data/prepare.py --dataset HuggingFaceFW/fineweb-edu --config-name sample-10BT \\
        --tokenizer gpt2 --out data/fineweb_edu --val-fraction 0.0005 --streaming
    python data/prepare.py --dataset chats.jsonl --chat --tokenizer out/shakespeare_char --block-size 64

--chat reads conversations instead (docs/chat.md): JSON lines of {"messages": [{"role", "content"}]}
or ShareGPT's {"conversations": [{"from", "value"}]}, a local .jsonl/.json file or a hub dataset. Each
conversation is rendered through a chat template into one document, and OUT/train.mask.bin and
OUT/val.mask.bin say, one byte per token, which tokens are trained (bit 0: --train-on) and where each
conversation starts (bit 1). --tokenizer: a Hugging Face model folder (its own template), or char,
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
import hashlib
import itertools
import json
import os
import re
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

if __package__ in (None, ""):  # run as `python data/prepare.py`: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.chat_tasks import FILES as CHAT_TASKS_FILES  # noqa: E402
from data.chat_tasks import OUT as CHAT_TASKS_OUT  # noqa: E402
from data.conversations import (  # noqa: E402
    BUILTIN_SPECIALS,
    BUILTIN_TEMPLATE,
    BUILTIN_VARIABLES,
    TRAIN_ON,
    ChatTemplate,
    Conversation,
    chat_tokenizer,
    folder_chat_tokenizer,
    read_conversations,
    render_conversation,
)
from data.files import FileLock, atomic_open, check_writable_dir, make_dir, shipped_run  # noqa: E402
from data.loader import CONVERSATION_START, TRAINED, has_trained_target, read_meta  # noqa: E402
from data.sources import Corpus, open_corpus, open_text_file  # noqa: E402
from data.tokenizer import (  # noqa: E402
    BPE_SPECIAL_TOKENS,
    MAX_VOCAB_SIZE,
    TOKENIZER_FILE,
    CharTokenizer,
    GPT2Tokenizer,
    JsonTokenizer,
    Tokenizer,
    UnencodableText,
    check_bpe_vocab_size,
    split_specials,
    tokenizer_from_meta,
    train_bpe,
)
from errors import ArgumentParser, UserError, run_cli  # noqa: E402

CORPUS_DIR = Path(__file__).parent
# bundled dataset name -> (corpus file beside this script, tokenizer)
BUNDLED = {
    "shakespeare_char": ("tinyshakespeare.txt", "char"),
    "shakespeare": ("tinyshakespeare.txt", "gpt2"),
}
TOKENIZERS = ("char", "gpt2", "bpe")  # or the path of a tokenizer.json
CHECKPOINT_FILE = "ckpt.pt"  # a run directory's checkpoint (trainer/checkpoint.py), whose tokenizer --chat may use
SPLITS = ("train", "val")
TRAIN, VAL = 0, 1  # indices into SPLITS
VAL_FRACTION = 0.1
SEED = 1337
BLOCK_SIZE = 1024  # the largest context of the shipped configs

BATCH_DOCUMENTS = 1024  # documents read from the source at a time
JOB_CHARS = 1 << 18  # characters handed to one tokenizing thread at a time
PIECE_CHARS = 1 << 16  # a longer document is cut into pieces of about this size (see split_long)
JOBS_PER_THREAD = 2  # jobs queued per thread: enough to keep threads busy, few enough to keep RAM flat

# A space between an ASCII letter or digit and an ASCII letter: GPT-2's split pattern always starts
# a new pre-token at such a space (" word") and ends the previous one before it, so encoding the
# text on either side separately gives exactly the tokens of encoding it whole.
SAFE_CUT = re.compile(r"(?<=[A-Za-z0-9]) (?=[A-Za-z])")


class Piece(NamedTuple):
    """A document, or part of one, with where its tokens go."""

    text: str
    split: int  # TRAIN or VAL
    ends_document: bool  # the last piece of its document: a separator follows it (if any)
    where: str  # its document, for messages: the corpus's name, and the document's index if it has several
    start: int  # its first character's index in that document


class Encoded(NamedTuple):
    ids: tuple[np.ndarray, np.ndarray]  # token ids of the train and val pieces of one job
    text_bytes: tuple[int, int]  # UTF-8 bytes of that text, per split
    documents: int  # documents that ended in the job


def prepare(
    corpus: Corpus,
    tokenizer_name: str,
    out: Path,
    *,
    vocab_size: int | None = None,
    val_fraction: float = VAL_FRACTION,
    seed: int = SEED,
    block_size: int = BLOCK_SIZE,
    num_proc: int = 1,
    max_documents: int | None = None,
) -> dict:
    """Tokenize the corpus into out/train.bin, out/val.bin and out/meta.json (and out/tokenizer.json for
    a BPE trained here or a tokenizer.json given); returns the metadata. tokenizer_name is char, gpt2, bpe
    (trained on the train split, vocab_size tokens) or the path of a tokenizer.json."""
    out = Path(out)
    refuse_prepared(out)
    tokenizer = build_tokenizer(tokenizer_name, corpus, vocab_size, val_fraction, seed, max_documents)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    pieces, single_document = corpus_pieces(corpus, val_fraction, seed, max_documents)
    separator = None if single_document or tokenizer.eot_token is None else tokenizer.eot_token

    created = not out.exists()
    make_dir(out)
    try:
        totals = write_splits(pieces, tokenizer, dtype, separator, out, num_proc, corpus, block_size)
        if isinstance(tokenizer, JsonTokenizer):
            with atomic_open(out / TOKENIZER_FILE) as f:
                f.write(tokenizer.to_json().encode("utf-8"))
    except BaseException:
        if created and not any(out.iterdir()):
            out.rmdir()  # leave no trace of a failed run
        raise
    meta = {
        "format": 1,
        "source": corpus.name,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "dtype": np.dtype(dtype).name,
        **totals,
        "split_by": "characters" if single_document else "documents",
        "val_fraction": val_fraction,
        "seed": seed,
        "separator": None if separator is None else tokenizer.decode([separator]),
    }
    if isinstance(tokenizer, CharTokenizer):
        meta["chars"] = tokenizer.chars
    if isinstance(tokenizer, JsonTokenizer):
        meta["tokenizer_sha256"] = tokenizer.sha256  # of tokenizer.json, beside meta.json
    with atomic_open(out / "meta.json") as f:
        f.write((json.dumps(meta, indent=1) + "\n").encode())
    return meta


def refuse_prepared(out: Path, key: str = "--out") -> None:
    """Never write over data: a folder with meta.json holds a dataset prepared here (meta.json is
    written last, so its presence means complete); token files or a tokenizer.json without it were
    written by something else (nanoGPT's prepare.py writes train.bin with a meta.pkl)."""
    if (out / "meta.json").exists():
        raise UserError(f"{out} already holds a prepared dataset (delete it or choose another {key})")
    foreign = [name for name in (*(f"{split}.bin" for split in SPLITS), TOKENIZER_FILE) if (out / name).exists()]
    if foreign:
        raise UserError(
            f"{out} holds {' and '.join(foreign)} but no meta.json: not a dataset prepared by data/prepare.py, "
            f"and preparing would overwrite it (move those files away or choose another {key})"
        )


def build_tokenizer(
    spec: str, corpus: Corpus, vocab_size: int | None, val_fraction: float, seed: int, max_documents: int | None
) -> Tokenizer:
    """The tokenizer that --tokenizer names. The char vocabulary is every character of the corpus (val
    included, so that every text of it can be encoded); a BPE is trained on the train split only, so
    that val measures text the tokenizer has not seen either."""
    if spec == "char":
        return CharTokenizer(corpus_characters(corpus, max_documents))  # a first pass over the corpus
    if spec == "gpt2":
        return GPT2Tokenizer()
    if spec == "bpe":
        pieces, _ = corpus_pieces(corpus, val_fraction, seed, max_documents)  # a first pass over the corpus
        print(f"training a byte-level BPE of {vocab_size:,} tokens on the train split of {corpus.name}")
        return train_bpe((piece.text for piece in pieces if piece.split == TRAIN), vocab_size)
    return JsonTokenizer.from_file(Path(spec))


def corpus_pieces(
    corpus: Corpus, val_fraction: float, seed: int, max_documents: int | None
) -> tuple[Iterator[Piece], bool]:
    """The corpus read again from its start, as pieces that know their split, and whether it is a
    single document (cut by characters, see cut_single_document)."""
    documents = read_documents(corpus, max_documents)
    first_two = list(itertools.islice(documents, 2))
    if len(first_two) == 1:
        return cut_single_document(first_two[0], corpus.name, val_fraction), True
    return split_documents(itertools.chain(first_two, documents), corpus.name, val_fraction, seed), False


def read_documents(corpus: Corpus, max_documents: int | None) -> Iterator[str]:
    texts = (text for batch in corpus.text_batches(BATCH_DOCUMENTS) for text in batch)
    return itertools.islice(texts, max_documents)


def corpus_characters(corpus: Corpus, max_documents: int | None) -> str:
    """The sorted characters of the corpus: the char tokenizer's vocabulary."""
    chars = set()
    for text in read_documents(corpus, max_documents):
        chars.update(text)
    if not chars:
        raise UserError(f"{corpus.name} is empty: there is nothing to train on")
    return "".join(sorted(chars))


def cut_single_document(text: str, name: str, val_fraction: float) -> Iterator[Piece]:
    """The first (1 - val_fraction) of the characters are train, the rest val."""
    if not text:
        raise UserError(f"{name} is empty: there is nothing to train on")
    cut = int(len(text) * (1 - val_fraction))
    for split, (start, end) in ((TRAIN, (0, cut)), (VAL, (cut, len(text)))):
        parts = split_long(text[start:end])
        for i, piece in enumerate(parts):
            yield Piece(piece, split, split == VAL and i == len(parts) - 1, name, start)
            start += len(piece)


def split_documents(documents: Iterable[str], name: str, val_fraction: float, seed: int) -> Iterator[Piece]:
    for index, text in enumerate(documents):
        split = VAL if in_val(index, seed, val_fraction) else TRAIN
        parts = split_long(text)
        start = 0
        for i, piece in enumerate(parts):
            yield Piece(piece, split, i == len(parts) - 1, f"{name} document {index:,}", start)
            start += len(piece)


def in_val(index: int, seed: int, val_fraction: float) -> bool:
    """Whether document `index` belongs to val: a seeded hash of its position, read as a number in
    [0, 1), falls below val_fraction. It depends on nothing else, so any reader agrees."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


def split_long(text: str) -> list[str]:
    """Cut a long text at safe spaces (see SAFE_CUT) into pieces of about PIECE_CHARS characters,
    so that one huge document neither builds a huge token list nor keeps the other threads idle.
    A text with no safe space stays whole."""
    pieces = []
    start = 0
    while len(text) - start > PIECE_CHARS:
        match = SAFE_CUT.search(text, start + PIECE_CHARS)
        if match is None:
            break
        pieces.append(text[start : match.start()])
        start = match.start()
    pieces.append(text[start:])
    return pieces


def batch_pieces(pieces: Iterable[Piece]) -> Iterator[list[Piece]]:
    """Group pieces into jobs of about JOB_CHARS characters."""
    job, size = [], 0
    for piece in pieces:
        job.append(piece)
        size += len(piece.text)
        if size >= JOB_CHARS:
            yield job
            job, size = [], 0
    if job:
        yield job


def encode_job(job: list[Piece], tokenizer: Tokenizer, dtype: type, separator: int | None) -> Encoded:
    """Tokenize one job (in a worker thread). Text the tokenizer cannot encode (a given tokenizer.json's
    vocabulary may not cover the corpus) is refused, naming its document and character."""
    ids = ([], [])
    text_bytes = [0, 0]
    eot = np.array([] if separator is None else [separator], dtype=dtype)
    for piece in job:
        text_bytes[piece.split] += len(piece.text.encode("utf-8"))  # valid: Arrow strings are UTF-8
        try:
            piece_ids = tokenizer.encode_array(piece.text)
        except UnencodableText as e:
            raise UserError(f"{piece.where}: {e.message(offset=piece.start)}") from None
        ids[piece.split].append(piece_ids.astype(dtype, copy=False))
        if piece.ends_document:
            ids[piece.split].append(eot)
    joined = tuple(np.concatenate(part) if part else np.empty(0, dtype) for part in ids)
    return Encoded(joined, tuple(text_bytes), sum(piece.ends_document for piece in job))


def write_splits(
    pieces: Iterable[Piece],
    tokenizer: Tokenizer,
    dtype: type,
    separator: int | None,
    out: Path,
    num_proc: int,
    corpus: Corpus,
    block_size: int,
) -> dict:
    """Tokenize the pieces with num_proc threads and append their ids, in order, to train.bin and
    val.bin; returns the token, byte and document counts. At most JOBS_PER_THREAD jobs per thread
    are queued, so memory stays flat."""
    tokens, text_bytes, documents = [0, 0], [0, 0], 0
    progress = tqdm(total=corpus.num_documents, unit="doc", dynamic_ncols=True, mininterval=0.5)
    start = time.perf_counter()
    with (
        ThreadPoolExecutor(num_proc) as pool,
        atomic_open(out / "train.bin") as train_file,
        atomic_open(out / "val.bin") as val_file,
        progress,
    ):
        files = (train_file, val_file)
        pending = deque()

        def write_oldest() -> None:
            nonlocal documents
            encoded = pending.popleft().result()
            for split in (TRAIN, VAL):
                files[split].write(encoded.ids[split].tobytes())
                tokens[split] += len(encoded.ids[split])
                text_bytes[split] += encoded.text_bytes[split]
            documents += encoded.documents
            progress.update(encoded.documents)
            rate = sum(tokens) / (time.perf_counter() - start)
            progress.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)

        for job in batch_pieces(pieces):
            pending.append(pool.submit(encode_job, job, tokenizer, dtype, separator))
            if len(pending) >= JOBS_PER_THREAD * num_proc:
                write_oldest()
        while pending:
            write_oldest()
        for split in (TRAIN, VAL):  # inside the `with`: an error here removes both files
            if tokens[split] < block_size + 1:
                raise UserError(
                    f"the {SPLITS[split]} split of {corpus.name} has {tokens[split]:,} tokens, fewer than "
                    f"--block-size + 1 = {block_size + 1:,} (pass the model's block_size with --block-size, "
                    f"use more text, or change --val-fraction)"
                )
    return {
        "train_tokens": tokens[TRAIN],
        "val_tokens": tokens[VAL],
        "train_bytes": text_bytes[TRAIN],  # for bits per byte
        "val_bytes": text_bytes[VAL],
        "documents": documents,
    }


TOO_LONG = ("refuse", "truncate")


def prepare_chat(
    conversations: Iterable[Conversation],
    tokenizer_spec: str,
    out: Path,
    *,
    source: str,
    train_on: str = "assistant",
    too_long: str = "refuse",
    val_fraction: float = VAL_FRACTION,
    seed: int = SEED,
    block_size: int = BLOCK_SIZE,
) -> dict:
    """Render conversations through a chat template into out/{train,val}.bin, their masks
    out/{train,val}.mask.bin (a byte per token: TRAINED, CONVERSATION_START) and out/meta.json, whose
    "chat" entry records the template, the special tokens added and the longest conversation. Each
    conversation goes to val by in_val and is followed by the tokenizer's end-of-text token, if any
    (unmasked, untrained: it separates conversations for model.attn_documents). Everything is
    rendered and checked before anything is written."""
    out = Path(out)
    refuse_prepared(out)
    conversations = list(conversations)
    tokenizer = build_chat_tokenizer(tokenizer_spec, conversations)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    separator = [] if tokenizer.eot_token is None else [tokenizer.eot_token]
    ids, masks, text_bytes, documents, truncated = ([], []), ([], []), [0, 0], [0, 0], [0, 0]
    longest, longest_rendered = 0, 0
    for index, conversation in enumerate(conversations):
        tokens, trained = render_conversation(conversation.messages, tokenizer, train_on, where=conversation.where)
        split = VAL if in_val(index, seed, val_fraction) else TRAIN
        longest_rendered = max(longest_rendered, len(tokens))
        if len(tokens) > block_size:
            if too_long == "refuse":
                raise UserError(
                    f"{conversation.where}: the conversation is {len(tokens):,} tokens, longer than --block-size="
                    f"{block_size:,} (shorten it, pass the model's larger block_size, or --too-long truncate)"
                )
            tokens, trained = tokens[:block_size], trained[:block_size]
            truncated[split] += 1
        longest = max(longest, len(tokens))
        flags = [TRAINED * keep for keep in trained]
        flags[0] |= CONVERSATION_START
        ids[split].append(np.array(tokens + separator, dtype=dtype))
        masks[split].append(np.array(flags + [0] * len(separator), dtype=np.uint8))
        text_bytes[split] += len(tokenizer.decode(tokens).encode("utf-8"))
        documents[split] += 1
    joined = [np.concatenate(part) if part else np.empty(0, dtype) for part in ids]
    joined_masks = [np.concatenate(part) if part else np.empty(0, np.uint8) for part in masks]
    for split in (TRAIN, VAL):
        if len(joined[split]) < block_size + 1:
            raise UserError(
                f"the {SPLITS[split]} split of {source} has {documents[split]} conversation(s), {len(joined[split]):,} "
                f"tokens, fewer than --block-size + 1 = {block_size + 1:,} (use more conversations, pass the model's "
                f"block_size with --block-size, or change --val-fraction)"
            )
        if not has_trained_target(joined_masks[split], block_size):
            # typically every reply lay past --block-size and was cut off: the split's loss would be a mean over nothing
            raise UserError(
                f"the {SPLITS[split]} split of {source} has no trained token within --block-size={block_size:,} tokens "
                f"of a conversation's start ({truncated[split]:,} of its {documents[split]:,} conversation(s) cut to "
                f"that length by --too-long truncate), so training would report a loss over nothing (pass a larger "
                f"--block-size, up to the model's: the longest conversation is {longest_rendered:,} tokens; or "
                f"shorten the conversations)"
            )
    cut = sum(truncated)
    if cut:
        print(f"truncated {cut:,} of {len(conversations):,} conversations to --block-size={block_size:,} tokens")
    created = not out.exists()
    make_dir(out)
    try:
        for split, name in enumerate(SPLITS):
            with atomic_open(out / f"{name}.bin") as f:
                f.write(joined[split].tobytes())
            with atomic_open(out / f"{name}.mask.bin") as f:
                f.write(joined_masks[split].tobytes())
        if isinstance(tokenizer, JsonTokenizer):
            with atomic_open(out / TOKENIZER_FILE) as f:
                f.write(tokenizer.to_json().encode("utf-8"))
    except BaseException:
        if created:
            for name in (*(f"{s}.bin" for s in SPLITS), *(f"{s}.mask.bin" for s in SPLITS), TOKENIZER_FILE):
                (out / name).unlink(missing_ok=True)
            if not any(out.iterdir()):
                out.rmdir()
        raise
    meta = {
        "format": 1,
        "source": source,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "dtype": np.dtype(dtype).name,
        "train_tokens": len(joined[TRAIN]),
        "val_tokens": len(joined[VAL]),
        "train_bytes": text_bytes[TRAIN],
        "val_bytes": text_bytes[VAL],
        "documents": sum(documents),
        "split_by": "documents",
        "val_fraction": val_fraction,
        "seed": seed,
        "separator": tokenizer.decode(separator) if separator else None,
        "chat": {
            "template": tokenizer.chat_template,
            "variables": tokenizer.template_variables,
            "added_specials": list(tokenizer.added_specials),
            "special_ids": {token: tokenizer.specials[token] for token in tokenizer.added_specials},
            "train_on": train_on,
            "longest": longest,  # tokens of the longest conversation: training needs model.block_size >= this
            "truncated": cut,
        },
    }
    if isinstance(tokenizer, CharTokenizer):
        meta["chars"] = tokenizer.chars
    if isinstance(tokenizer, JsonTokenizer):
        meta["tokenizer_sha256"] = tokenizer.sha256
    with atomic_open(out / "meta.json") as f:
        f.write((json.dumps(meta, indent=1) + "\n").encode())
    return meta


def build_chat_tokenizer(spec: str, conversations: list[Conversation]) -> Tokenizer:
    """The tokenizer --chat renders with: a Hugging Face model folder's own (with its template), or
    the built-in template on char (the conversations' characters), gpt2, a tokenizer.json, or the
    tokenizer of a prepared dataset folder (meta.json) or of a run (its ckpt.pt), which keeps the
    template it has."""
    path = Path(spec)
    if spec == "bpe":
        raise UserError(
            "--tokenizer=bpe with --chat: train the BPE on plain text first (prepare it without --chat), then "
            "give that dataset's folder as --tokenizer"
        )
    if spec == "char":
        template, specials = ChatTemplate(BUILTIN_TEMPLATE, BUILTIN_VARIABLES), dict.fromkeys(BUILTIN_SPECIALS, 0)
        chars = set()  # every character the template writes around the specials, and the conversations'
        for conversation in conversations:
            for piece, special in split_specials(template.render(conversation.messages), specials):
                chars.update(piece if special is None else "")
        return chat_tokenizer(CharTokenizer("".join(sorted(chars))))
    if spec == "gpt2":
        return chat_tokenizer(GPT2Tokenizer())
    if (path / "meta.json").is_file() or (path / CHECKPOINT_FILE).is_file():
        tokenizer = tokenizer_from_meta(saved_meta(path))
        return tokenizer if tokenizer.chat_template is not None else chat_tokenizer(tokenizer)
    if path.is_dir():
        return folder_chat_tokenizer(path)
    return chat_tokenizer(JsonTokenizer.from_file(path))


def saved_meta(folder: Path) -> dict:
    """The dataset metadata of a prepared dataset folder, or the copy a run's checkpoint keeps."""
    if (folder / "meta.json").is_file():
        return read_meta(folder)
    import torch

    try:
        checkpoint = torch.load(folder / CHECKPOINT_FILE, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises many kinds for a damaged file
        raise UserError(f"{folder / CHECKPOINT_FILE} cannot be read ({str(e).splitlines()[0]})") from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("dataset"), dict):
        raise UserError(f"{folder / CHECKPOINT_FILE} holds no dataset metadata: not a checkpoint written by train.py")
    return checkpoint["dataset"]


def prepare_text(
    text: str, tokenizer: str, out: Path, source: str, val_fraction: float = VAL_FRACTION, **options
) -> dict:
    """Prepare one text held in memory, as a corpus of one document."""
    import datasets

    corpus = Corpus(source, datasets.Dataset.from_dict({"text": [text]}), "text", 1)
    return prepare(corpus, tokenizer, out, val_fraction=val_fraction, **options)


def prepare_bundled(name: str, data_dir: Path) -> dict:
    corpus_file, tokenizer_name = BUNDLED[name]
    return prepare(open_text_file(CORPUS_DIR / corpus_file), tokenizer_name, Path(data_dir) / name)


def ensure_prepared(dataset: str, data_dir: str) -> None:
    """Prepare a bundled dataset the first time it is asked for; leave everything else alone. Two
    runs starting at once do not both prepare it: one does, the other waits for it and reads the result."""
    out = Path(data_dir) / dataset
    if dataset not in BUNDLED:
        return
    check_writable_dir(Path(data_dir), "data.data_dir")
    if (out / "meta.json").exists():
        return
    make_dir(Path(data_dir))
    with FileLock(Path(data_dir) / f".{dataset}.lock"):
        if (out / "meta.json").exists():
            return  # prepared by the process that held the lock
        refuse_prepared(out, key="data.data_dir")
        print(f"preparing the bundled dataset {dataset!r} into {out} (once)")
        prepare_bundled(dataset, Path(data_dir))


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
        "holding one (to fine-tune that model); bundled corpora have their own",
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
    if args.tokenizer not in (None, *TOKENIZERS):
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


if __name__ == "__main__":
    run_cli(main)
