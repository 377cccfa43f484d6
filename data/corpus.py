"""A corpus into a dataset for training: tokenized, split into train and val, written as train.bin,
val.bin and meta.json (data/prepare.py is the command; its --help says what each option does).

Splits: each document goes to val with probability val_fraction, decided by a hash of its position
and the seed, so a corpus always splits the same way, with any number of threads and with or without
streaming. A corpus of a single document (one .txt file, such as the bundled Shakespeare) is cut by
characters instead, as nanoGPT does: the first (1 - val_fraction) of the text is train. With GPT-2
BPE every document is followed by <|endoftext|>; the char tokenizer has no such token, and the two
parts of a single document need none.

Token ids are uint16 when the vocabulary fits, else uint32. Documents are read in batches,
tokenized by several threads (tiktoken releases the GIL) and written as they come, so memory stays
flat whatever the corpus size. train.bin and val.bin are written to temporary names and renamed only
when complete (tokenizer.json too); meta.json comes last, so a folder with meta.json is complete, and
a failed run leaves nothing behind. train.py prepares a bundled corpus on its first use
(ensure_prepared); conversations become a dataset through data/chat_dataset.py.
"""

import hashlib
import itertools
import json
import re
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from data.files import FileLock, atomic_open, check_writable_dir, make_dir
from data.sources import Corpus, open_text_file
from data.tokenizer import (
    TOKENIZER_FILE,
    CharTokenizer,
    GPT2Tokenizer,
    JsonTokenizer,
    Tokenizer,
    UnencodableText,
    train_bpe,
)
from errors import UserError

CORPUS_DIR = Path(__file__).parent
# bundled dataset name -> (corpus file beside this script, tokenizer)
BUNDLED = {
    "shakespeare_char": ("tinyshakespeare.txt", "char"),
    "shakespeare": ("tinyshakespeare.txt", "gpt2"),
}
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
    if Path(spec).suffix == ".gguf":
        from data.gguf_tokenizer import gguf_tokenizer, open_gguf  # a GGUF file's own: the others need none of it

        return gguf_tokenizer(open_gguf(Path(spec), "--tokenizer"), spec)
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
