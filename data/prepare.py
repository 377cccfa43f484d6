"""Prepare a text corpus for training: tokenize it and write train.bin, val.bin and meta.json.

    python data/prepare.py --dataset shakespeare_char          # a bundled dataset, into data/
    python data/prepare.py --dataset notes.txt --tokenizer gpt2 --out data/notes

The first 90% of the text (by characters) becomes the train split and the rest the val split, as
nanoGPT does, so figures compare: the char-level Shakespeare gives 1,003,854 / 111,540 tokens.
Token ids are stored as uint16 when the vocabulary fits, else uint32. Each file is written to a
temporary name and renamed; meta.json comes last, so a folder with meta.json is complete.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as `python data/prepare.py`: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.files import atomic_open  # noqa: E402
from data.tokenizer import CharTokenizer, GPT2Tokenizer  # noqa: E402
from errors import UserError, run_cli  # noqa: E402

CORPUS_DIR = Path(__file__).parent
# bundled dataset name -> (corpus file beside this script, tokenizer)
BUNDLED = {
    "shakespeare_char": ("tinyshakespeare.txt", "char"),
    "shakespeare": ("tinyshakespeare.txt", "gpt2"),
}
TOKENIZERS = ("char", "gpt2")
VAL_FRACTION = 0.1


def prepare_text(text: str, tokenizer_name: str, out: Path, source: str, val_fraction: float = VAL_FRACTION) -> dict:
    """Tokenize text, split it and write the dataset folder `out`; returns the metadata."""
    if not text:
        raise UserError(f"{source} is empty: there is nothing to train on")
    split_at = int(len(text) * (1 - val_fraction))
    splits = {"train": text[:split_at], "val": text[split_at:]}
    if tokenizer_name == "char":
        tokenizer = CharTokenizer.from_text(text)
        encode = tokenizer.encode
    else:
        tokenizer = GPT2Tokenizer()
        encode = tokenizer.encode_ordinary
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    meta = {
        "format": 1,
        "source": source,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "dtype": np.dtype(dtype).name,
    }
    if tokenizer_name == "char":
        meta["chars"] = tokenizer.chars
    out.mkdir(parents=True, exist_ok=True)
    for split, split_text in splits.items():
        ids = np.array(encode(split_text), dtype=dtype)
        with atomic_open(out / f"{split}.bin") as f:
            f.write(ids.tobytes())
        meta[f"{split}_tokens"] = len(ids)
        meta[f"{split}_bytes"] = len(split_text.encode("utf-8"))  # for bits per byte
    with atomic_open(out / "meta.json") as f:
        f.write((json.dumps(meta, indent=1) + "\n").encode())
    return meta


def prepare_bundled(name: str, data_dir: Path) -> dict:
    corpus, tokenizer_name = BUNDLED[name]
    text = (CORPUS_DIR / corpus).read_text(encoding="utf-8")
    return prepare_text(text, tokenizer_name, Path(data_dir) / name, source=corpus)


def ensure_prepared(dataset: str, data_dir: str) -> None:
    """Prepare a bundled dataset the first time it is asked for; leave everything else alone."""
    out = Path(data_dir) / dataset
    if dataset in BUNDLED and not (out / "meta.json").exists():
        print(f"preparing the bundled dataset {dataset!r} into {out} (once)")
        prepare_bundled(dataset, Path(data_dir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dataset", required=True, help=f"a bundled dataset ({', '.join(BUNDLED)}) or a UTF-8 .txt file"
    )
    parser.add_argument("--tokenizer", choices=TOKENIZERS, help="char or gpt2 (bundled datasets have their own)")
    parser.add_argument("--out", help="output folder (default: data/<dataset name>)")
    parser.add_argument("--data-dir", default="data", help="where bundled datasets are written (default: data)")
    parser.add_argument(
        "--val-fraction", type=float, default=VAL_FRACTION, help="share of the text held out for validation"
    )
    args = parser.parse_args()
    if not 0 < args.val_fraction < 1:
        raise UserError(f"--val-fraction={args.val_fraction} must be between 0 and 1")

    if args.dataset in BUNDLED:
        corpus, tokenizer_name = BUNDLED[args.dataset]
        if args.tokenizer not in (None, tokenizer_name):
            raise UserError(f"--tokenizer={args.tokenizer}: the bundled {args.dataset!r} uses {tokenizer_name}")
        source = CORPUS_DIR / corpus
        out = Path(args.out or Path(args.data_dir) / args.dataset)
    else:
        source = Path(args.dataset)
        if not source.is_file():
            raise UserError(
                f"--dataset={args.dataset!r} is neither a bundled dataset ({', '.join(BUNDLED)}) nor a file"
            )
        if args.tokenizer is None:
            raise UserError("--tokenizer is required for a text file (char or gpt2)")
        tokenizer_name = args.tokenizer
        out = Path(args.out or Path(args.data_dir) / source.stem)
    if (out / "meta.json").exists():
        raise UserError(f"{out} already holds a prepared dataset (delete it or choose another --out)")
    try:
        text = source.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{source} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    meta = prepare_text(text, tokenizer_name, out, source=source.name, val_fraction=args.val_fraction)
    print(
        f"wrote {out}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens, "
        f"{meta['tokenizer']} tokenizer, vocabulary {meta['vocab_size']:,}"
    )


if __name__ == "__main__":
    run_cli(main)
