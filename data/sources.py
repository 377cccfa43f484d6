"""Where data/prepare.py reads documents from: local files and folders (.txt, .jsonl, .json,
.parquet) or a Hugging Face hub dataset, all opened through `datasets.load_dataset`.

A document is one row of a jsonl, json or parquet file (its text field), or one whole .txt file.
Text files must be UTF-8: a file that is not is refused with its name and the offset of the first
bad byte, before anything is written. Text files are read with Python's universal newlines, so
"\\r\\n" and "\\r" line ends become "\\n".

`datasets` is imported inside the functions that need it: it takes a second to load, and
train.py imports this package for bundled datasets that are already prepared. The bundled corpora
(one .txt file each) are read without it (`open_text_file`), so train.py prepares them on a machine
that lacks it, such as a GPU image.
"""

import codecs
import glob
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.files import TEXT_ENCODING
from errors import UserError

# file suffix -> the `datasets` builder that reads it
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
UTF8_CHECK_CHUNK = 16 << 20  # bytes read at a time when checking that a text file is UTF-8
HUB_TIMEOUT_S = 5  # how long to wait for the hub before calling the machine offline
LOCAL_ADVICE = (
    "To prepare local data instead, pass a file or folder: --dataset corpus.txt, corpus.jsonl, "
    "corpus.parquet or a folder of them"
)


@dataclass
class Corpus:
    """An opened source of documents."""

    name: str  # the file, folder or hub name, for messages and meta.json
    dataset: Any  # a datasets.Dataset, or an IterableDataset when streaming
    text_field: str
    num_documents: int | None  # None when streaming: the count is known only at the end

    def text_batches(self, batch_size: int) -> Iterator[list[str]]:
        """The documents' texts in order, batch_size at a time."""
        batches = self.dataset.iter(batch_size=batch_size)
        index = 0
        while True:
            with read_errors(self.name):
                batch = next(batches, None)
            if batch is None:
                return
            if self.text_field not in batch:
                raise missing_field_error(self.name, self.text_field, list(batch))
            texts = batch[self.text_field]
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    raise UserError(
                        f"document {index + i} of {self.name} has {self.text_field}={text!r:.60}, not text "
                        f"(every document needs a string in the {self.text_field!r} field)"
                    )
            index += len(texts)
            yield texts


@dataclass
class TextFile(Corpus):
    """One local .txt file, one document, read by Python itself: the text `open_corpus` gives for
    the same file (UTF-8, universal newlines), without `datasets`."""

    path: Path = Path()

    def text_batches(self, batch_size: int) -> Iterator[list[str]]:
        yield [self.path.read_text(encoding="utf-8")]


def open_text_file(path: Path) -> Corpus:
    """A .txt file as a corpus of one document, checked as `open_corpus` checks it (not empty, UTF-8)."""
    (path,) = local_files(path)
    return TextFile(path.name, None, "text", 1, path)


def open_corpus(
    spec: str,
    *,
    text_field: str = "text",
    split: str = "train",
    config_name: str | None = None,
    revision: str | None = None,
    streaming: bool = False,
    num_proc: int = 1,
    cache_dir: str | None = None,
) -> Corpus:
    """Open a local file or folder, or else a hub dataset by name. Without streaming, `datasets`
    first converts the source into Arrow files in its cache (cache_dir, by default under HF_HOME)."""
    path = Path(spec)
    common = {"streaming": streaming, "cache_dir": cache_dir}
    if path.exists():
        files = local_files(path)
        builder = BUILDERS[files[0].suffix]
        # a .txt file is one document, decoded as every text file here is (a byte-order mark skipped);
        # the json builder skips the mark itself, and parquet is binary
        options = {"sample_by": "document", "encoding": TEXT_ENCODING} if builder == "text" else {}
        # datasets reads data_files as glob patterns: escaped, book[1].txt is that file, not book1.txt
        data_files = [glob.escape(str(file)) for file in files]
        with read_errors(spec):
            dataset = _load(
                builder, data_files=data_files, split="train", num_proc=min(num_proc, len(files)), **options, **common
            )
    elif path.suffix in BUILDERS or spec.startswith((".", "/", "~")):
        raise UserError(f"--dataset={spec!r}: there is no such file or folder")
    else:
        check_hub_reachable(spec)
        with read_errors(spec), hub_offline_errors(spec):
            dataset = _load(spec, config_name, split=split, revision=revision, num_proc=num_proc, **common)
    if dataset.column_names is not None:  # some streamed datasets learn their columns only when read
        if text_field not in dataset.column_names:
            raise missing_field_error(spec, text_field, dataset.column_names)
        dataset = dataset.select_columns([text_field])
    return Corpus(spec, dataset, text_field, None if streaming else len(dataset))


def _load(*args, streaming: bool, num_proc: int, **kwargs):
    import datasets

    if not streaming and num_proc > 1:
        kwargs["num_proc"] = num_proc  # converts several files at once; streaming reads them in order
    return datasets.load_dataset(*args, streaming=streaming, **kwargs)


def local_files(path: Path) -> list[Path]:
    """The files to read from a file or a folder (searched recursively; hidden files and folders,
    whose names start with a dot, are skipped as `ls` skips them), checked: every file one of
    BUILDERS' kinds, one kind only, none empty, text files UTF-8."""
    if path.is_file():
        if path.suffix not in BUILDERS:
            raise UserError(
                f"--dataset={str(path)!r}: {path.suffix or 'no suffix'} is not one of {', '.join(BUILDERS)}"
            )
        files = [path]
    else:
        visible = sorted(file for file in path.rglob("*") if _visible_file(file, path))
        files = [file for file in visible if file.suffix in BUILDERS]
        _refuse_unread(path, [file for file in visible if file.suffix not in BUILDERS])
        if not files:
            raise UserError(f"--dataset={str(path)!r}: the folder holds no {', '.join(BUILDERS)} files")
        kinds = sorted({file.suffix for file in files})
        if len({BUILDERS[kind] for kind in kinds}) > 1:
            raise UserError(f"{path} mixes {', '.join(kinds)} files: put one kind in the folder, or prepare them apart")
    for file in files:
        if file.stat().st_size == 0:
            raise UserError(f"{file} is empty: there is nothing to train on")
        if BUILDERS[file.suffix] != "parquet":  # parquet strings are UTF-8 by the format's own rules
            check_utf8(file)
    return files


def _refuse_unread(folder: Path, unread: list[Path]) -> None:
    """A folder's file that would not be read is refused, as it is when given alone: an upper-case
    .TXT, a .text or a README skipped without a word would leave text out of the corpus unseen."""
    if not unread:
        return
    names = [str(file.relative_to(folder)) for file in unread]
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    raise UserError(
        f"--dataset={str(folder)!r}: {len(names)} file(s) in the folder would not be read: {shown} "
        f"(only {', '.join(BUILDERS)} files are read: rename them to one of these, or move them out of the folder)"
    )


def _visible_file(file: Path, folder: Path) -> bool:
    return file.is_file() and not any(part.startswith(".") for part in file.relative_to(folder).parts)


def check_utf8(file: Path) -> None:
    """Refuse a file that is not UTF-8, naming the offset of the first invalid byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes of the file handed to the decoder so far
    with open(file, "rb") as f:
        while True:
            chunk = f.read(UTF8_CHECK_CHUNK)
            held = len(decoder.getstate()[0])  # bytes of an unfinished character from the last chunk
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                position = offset - held + e.start
                raise UserError(
                    f"{file} is not UTF-8: byte {position:,} ({e.object[e.start]:#04x}) is {e.reason} "
                    f"(convert the file first, e.g. iconv -f latin1 -t utf-8)"
                ) from None
            if not chunk:
                return
            offset += len(chunk)


def missing_field_error(name: str, text_field: str, fields: list[str]) -> UserError:
    return UserError(
        f"{name} has no {text_field!r} field (its fields: {', '.join(fields) or 'none'}); "
        f"choose the one that holds the text with --text-field"
    )


@contextmanager
def read_errors(name: str) -> Iterator[None]:
    """Reading errors of `datasets` and Arrow (malformed JSON, an unknown split or config) as one
    line that names the source."""
    import datasets
    import pyarrow

    try:
        yield
    except (datasets.exceptions.DatasetsError, pyarrow.ArrowInvalid, ValueError) as e:
        cause = e.__cause__ or e  # DatasetGenerationError hides the reader's own message in its cause
        message = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise UserError(f"cannot read {name}: {message}") from None


def check_hub_reachable(name: str) -> None:
    """Fail within seconds when the hub cannot be reached (datasets itself retries for half a
    minute). In datasets' offline mode there is nothing to check: it answers from its cache."""
    import datasets
    from huggingface_hub import constants

    if datasets.config.HF_HUB_OFFLINE:
        return
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=HUB_TIMEOUT_S)
    except urllib.error.HTTPError:
        return  # the hub answered, even if not with 200
    except OSError as e:  # URLError, a timeout, a refused connection
        reason = getattr(e, "reason", e)
        raise UserError(
            f"--dataset={name!r} is not a local file or folder, and the Hugging Face hub at {constants.ENDPOINT} "
            f"cannot be reached ({reason}): this machine is offline. {LOCAL_ADVICE}"
        ) from None


@contextmanager
def hub_offline_errors(name: str) -> Iterator[None]:
    """In datasets' offline mode, a dataset missing from the cache is a ConnectionError."""
    try:
        yield
    except ConnectionError:
        raise UserError(
            f"--dataset={name!r} is not a local file or folder, and this machine is offline (HF_DATASETS_OFFLINE "
            f"or HF_HUB_OFFLINE is set) with no copy of it in the datasets cache. {LOCAL_ADVICE}"
        ) from None
