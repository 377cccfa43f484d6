"""Data-preparation speed next to tiktoken's own: tokens per second of data/prepare.py (read through
`datasets`, tokenize, write train.bin / val.bin) and of `encode_ordinary_batch` on the same text
with as many threads, in the same run.

    python bench/prepare.py                   # the bundled corpus and 100 MB of generated text
    python bench/prepare.py --megabytes 5     # a quick check

The generated text is a deterministic sequence of documents made of Shakespeare's words drawn
with their own frequencies, so GPT-2's BPE meets realistic English words. The rate of both
columns is the same token count (the text's, separators left out) over each one's wall time;
prepare's time runs from opening the source to the last file written, so it includes reading the
file through `datasets` (and, without --streaming, its conversion into the datasets cache).
"""

import collections
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arguments import BenchArguments  # noqa: E402
from data.corpus import CORPUS_DIR, prepare  # noqa: E402
from data.files import read_text  # noqa: E402
from data.sources import open_corpus  # noqa: E402
from data.tokenizer import GPT2Tokenizer  # noqa: E402
from errors import run_cli  # noqa: E402

WORDS_PER_DOCUMENT = (100, 3000)  # uniform range of document lengths, in words


def generated_documents(megabytes: float, seed: int = 0) -> list[str]:
    """About `megabytes` MB of text in documents of sentences of Shakespeare's words."""
    corpus = read_text(CORPUS_DIR / "tinyshakespeare.txt")
    counts = collections.Counter(re.findall(r"[A-Za-z']+", corpus))
    words = np.array(list(counts))
    frequencies = np.array(list(counts.values()), dtype=np.float64)
    rng = np.random.default_rng(seed)
    documents, size = [], 0
    while size < megabytes * 1e6:
        n_words = rng.integers(*WORDS_PER_DOCUMENT)
        drawn = words[rng.choice(len(words), n_words, p=frequencies / frequencies.sum())]
        # sentences of 4 to 24 words: a capital first, then a full stop, comma or question mark
        ends = np.cumsum(rng.integers(4, 25, n_words))
        sentences = np.split(drawn, ends[ends < n_words])
        marks = rng.choice([".", ".", ".", "?", "!"], len(sentences))
        text = " ".join(" ".join(s).capitalize() + mark for s, mark in zip(sentences, marks, strict=True))
        documents.append(text)
        size += len(text)
    return documents


def time_raw(texts: list[str], threads: int, repeats: int) -> tuple[int, float]:
    encoding = GPT2Tokenizer().encoding
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        ids = encoding.encode_ordinary_batch(texts, num_threads=threads)
        best = min(best, time.perf_counter() - start)
    return sum(len(x) for x in ids), best


def time_prepare(source: Path, work: Path, threads: int, streaming: bool, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        run = Path(tempfile.mkdtemp(dir=work))  # a fresh output folder and a cold datasets cache every time
        start = time.perf_counter()
        corpus = open_corpus(str(source), streaming=streaming, num_proc=threads, cache_dir=str(run / "cache"))
        prepare(corpus, "gpt2", run / "out", val_fraction=0.1, block_size=1, num_proc=threads)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = BenchArguments(__doc__)
    parser.add_amount("--megabytes", default=100, help="size of the generated text (default: 100)")
    parser.add_count("--num-proc", nargs="+", default=[1, 2], help="thread counts (default: 1 2)")
    parser.add_count("--repeats", default=1, help="runs of each measurement; the fastest counts")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        bundled = CORPUS_DIR / "tinyshakespeare.txt"
        documents = generated_documents(args.megabytes)
        generated = work / "generated.jsonl"
        generated.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents), encoding="utf-8")
        for streaming in (False, True):  # warm-up: imports and first-use costs are not measured
            time_prepare(bundled, work, 1, streaming, 1)
        cases = [
            ("tinyshakespeare.txt", bundled, [read_text(bundled)], True),
            (f"generated, {args.megabytes:g} MB, {len(documents):,} documents", generated, documents, False),
            (f"generated, {args.megabytes:g} MB, --streaming", generated, documents, True),
        ]
        print("| text | num_proc | tiktoken encode_ordinary_batch, tokens/s | prepare.py, tokens/s | ratio |")
        print("| --- | --- | --- | --- | --- |")
        for name, source, texts, streaming in cases:
            for threads in args.num_proc:
                tokens, raw_s = time_raw(texts, threads, args.repeats)
                prepare_s = time_prepare(source, work, threads, streaming, args.repeats)
                print(
                    f"| {name} | {threads} | {tokens / raw_s:,.0f} | {tokens / prepare_s:,.0f} | "
                    f"{raw_s / prepare_s:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    run_cli(main)
