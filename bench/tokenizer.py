"""A byte-level BPE trained here (data/prepare.py --tokenizer bpe) against GPT-2's: training time,
bytes of text per token on held-out text, and encoding speed, in one run.

    python bench/tokenizer.py                                    # Shakespeare and 20 MB made from it
    python bench/tokenizer.py --megabytes 2 --vocab-sizes 1024   # a quick check

Two corpora, each cut as data/prepare.py cuts it: the bundled Shakespeare (one document: the first
90% of its characters train the BPE, the last 10% measure it) and --megabytes of generated documents
(Shakespeare's words drawn with their own frequencies, bench/prepare.py's generator; one document in
ten, chosen as prepare.py chooses val documents, measures). GPT-2's BPE is measured on the same
held-out text. A BPE cannot grow past the distinct pieces of its corpus (GPT-2's split pattern cuts
text into words, numbers and punctuation first), so a large vocabulary on a small corpus stops short;
the table gives the size reached.

Every BPE's ids from the tiktoken twin that encodes it (data/tokenizer.py, tiktoken_twin) are
checked against the tokenizers package's own encoder on the held-out text.

Speed, on the generated documents with the BPE of --speed-vocab-size tokens: megabytes of text per
second through each tokenizer's encode_array (what data/prepare.py calls), one document at a time on
one thread and on --threads threads, beside GPT-2's; and, for reference, the tokenizers package's
own batch encoder (all cores) beside tiktoken's encode_ordinary_batch (--threads threads). Each
speed is the best of --repeats runs, the two tokenizers' runs alternating.
"""

import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arguments import BenchArguments  # noqa: E402
from bench.prepare import generated_documents  # noqa: E402
from data.corpus import CORPUS_DIR, SEED, VAL_FRACTION, in_val  # noqa: E402
from data.tokenizer import (  # noqa: E402
    BPE_SPECIAL_TOKENS,
    MAX_VOCAB_SIZE,
    GPT2Tokenizer,
    JsonTokenizer,
    Tokenizer,
    train_bpe,
)
from errors import run_cli  # noqa: E402


def corpora(megabytes: float) -> list[tuple[str, list[str], list[str]]]:
    """(name, train texts, held-out texts) of each corpus."""
    text = (CORPUS_DIR / "tinyshakespeare.txt").read_text(encoding="utf-8")
    cut = int(len(text) * (1 - VAL_FRACTION))
    documents = generated_documents(megabytes)
    held_out = [in_val(i, SEED, VAL_FRACTION) for i in range(len(documents))]
    return [
        ("tinyshakespeare.txt (1.1 MB)", [text[:cut]], [text[cut:]]),
        (
            f"generated from it, {megabytes:g} MB, {len(documents):,} documents",
            [doc for doc, out in zip(documents, held_out, strict=True) if not out],
            [doc for doc, out in zip(documents, held_out, strict=True) if out],
        ),
    ]


def bytes_per_token(tokenizer: Tokenizer, texts: list[str]) -> float:
    tokens = sum(len(tokenizer.encode_array(text)) for text in texts)
    return sum(len(text.encode("utf-8")) for text in texts) / tokens


def same_ids_as_tokenizers(tokenizer: JsonTokenizer, texts: list[str]) -> bool:
    return all(tokenizer.encode_array(text).tolist() == tokenizer.corpus_tokenizer.encode(text).ids for text in texts)


def encode_all(encode: Callable[[str], object], texts: list[str], threads: int) -> None:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(encode, texts))


def speeds(ours: JsonTokenizer, gpt2: GPT2Tokenizer, texts: list[str], threads: int, repeats: int) -> list[tuple]:
    """(how, our MB/s, GPT-2's MB/s) rows; the two tokenizers alternate within each repeat."""
    megabytes = sum(len(text.encode("utf-8")) for text in texts) / 1e6
    cases = [
        ("encode_array, one document at a time, 1 thread", lambda t: encode_all(t.encode_array, texts, 1)),
        (
            f"encode_array, one document at a time, {threads} threads",
            lambda t: encode_all(t.encode_array, texts, threads),
        ),
        (
            f"batch: tokenizers' encode_batch (all cores) / tiktoken's encode_ordinary_batch ({threads} threads)",
            lambda t: (
                t.corpus_tokenizer.encode_batch(texts)
                if isinstance(t, JsonTokenizer)
                else t.encoding.encode_ordinary_batch(texts, num_threads=threads)
            ),
        ),
    ]
    rows = []
    for how, run in cases:
        times = {"ours": float("inf"), "gpt2": float("inf")}
        for _ in range(repeats):
            for name, tokenizer in (("ours", ours), ("gpt2", gpt2)):
                start = time.perf_counter()
                run(tokenizer)
                times[name] = min(times[name], time.perf_counter() - start)
        rows.append((how, megabytes / times["ours"], megabytes / times["gpt2"]))
    return rows


def main() -> None:
    parser = BenchArguments(__doc__)
    parser.add_amount("--megabytes", default=20, help="size of the generated corpus (default: 20)")
    sizes = dict(minimum=len(BPE_SPECIAL_TOKENS) + 256, maximum=MAX_VOCAB_SIZE)  # as data/prepare.py --vocab-size
    parser.add_count("--vocab-sizes", nargs="+", default=[1024, 4096, 16384, 50257], help="BPE sizes to train", **sizes)
    parser.add_count("--speed-vocab-size", default=4096, help="the BPE whose speed is measured", **sizes)
    parser.add_count("--threads", default=2, help="threads of the parallel rows (default: 2)")
    parser.add_count("--repeats", default=3, help="runs of each speed; the fastest counts")
    args = parser.parse_args()
    gpt2 = GPT2Tokenizer()
    measured = corpora(args.megabytes)
    print("| corpus | vocab asked | vocab reached | training, s | bytes/token, BPE | bytes/token, GPT-2 | "
          "BPE / GPT-2 | twin's ids = tokenizers' |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, train, held_out in measured:
        gpt2_bpt = bytes_per_token(gpt2, held_out)
        for vocab_size in args.vocab_sizes:
            start = time.perf_counter()
            ours = train_bpe(train, vocab_size, progress=False)
            seconds = time.perf_counter() - start
            bpt = bytes_per_token(ours, held_out)
            same = "yes" if ours.encoding is not None and same_ids_as_tokenizers(ours, held_out) else "NO"
            print(
                f"| {name} | {vocab_size:,} | {ours.vocab_size:,} | {seconds:.1f} | {bpt:.3f} | {gpt2_bpt:.3f} | "
                f"{bpt / gpt2_bpt:.2f} | {same} |",
                flush=True,
            )
    name, train, held_out = measured[-1]
    ours = train_bpe(train, args.speed_vocab_size, progress=False)
    print()
    print(f"| encoding {name}, all documents | BPE {ours.vocab_size:,}, MB/s | GPT-2, MB/s | BPE / GPT-2 |")
    print("| --- | --- | --- | --- |")
    for how, ours_mb_s, gpt2_mb_s in speeds(ours, gpt2, train + held_out, args.threads, args.repeats):
        print(f"| {how} | {ours_mb_s:.2f} | {gpt2_mb_s:.2f} | {ours_mb_s / gpt2_mb_s:.2f} |", flush=True)


if __name__ == "__main__":
    run_cli(main)
