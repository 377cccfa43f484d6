"""Serving under load: requests/s and tokens/s of serve.py at several numbers of concurrent clients,
with requests decoded together against the same server decoding them one at a time.

    python bench/serve.py                                 # the quickstart's shape, 1, 4 and 16 clients
    python bench/serve.py --shape gpt2 --requests 32 --max-tokens 32

A model of the chosen shape with random weights (speed does not depend on their values) is written as a
Hugging Face folder into a temporary directory, and two serve.py processes serve it on this machine:
one with --max-batch 16 (requests decode together), one with --max-batch 1 (one at a time: each
request waits for the one before it), both with the same --threads (chosen once from the free cores,
as train.threads=0 chooses, unless given). They are measured in turn at each number of clients, so
that both meet the same load from other work. For each number of clients, that many threads send
--requests POST /v1/completions in all, each thread its next request as soon as its last is answered:
a different prompt of the corpus each, --max-tokens tokens drawn greedily (no end of text: the
vocabularies have none, or its id is never the most likely). requests/s and tokens/s are over the
wall time of the whole load; latency is the median time a request took to be answered. One untimed
request first warms each server up. The clients run on this machine too, and their share of its cores
is part of the figure.
"""

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arguments import BenchArguments, write_json  # noqa: E402
from data.corpus import CORPUS_DIR  # noqa: E402
from data.tokenizer import CharTokenizer, GPT2Tokenizer  # noqa: E402
from errors import UserError, run_cli  # noqa: E402
from interop.pretrained import export_model  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from trainer.runtime import auto_threads  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # the quickstart's model (configs/shakespeare_char.toml), and GPT-2 124M's
    "quickstart": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, bias=False, pos_emb="rope", qk_norm=True,
                       mlp="swiglu", n_kv_head=2),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
}  # fmt: skip
STARTUP_SECONDS = 300


def parse_args() -> argparse.Namespace:
    parser = BenchArguments(__doc__)
    parser.add_argument("--shape", choices=SHAPES, default="quickstart", help="the model's shape (default: quickstart)")
    parser.add_count("--clients", nargs="+", default=[1, 4, 16], help="concurrent clients (default: 1 4 16)")
    parser.add_count("--requests", default=64, help="requests at each number of clients (default: 64)")
    parser.add_count("--max-tokens", default=64, help="tokens each request draws (default: 64)")
    parser.add_count("--max-batch", default=16, help="the batched server's --max-batch (default: 16)")
    parser.add_count("--threads", minimum=0, default=0, help="both servers' --threads; 0: chosen once (default: 0)")
    parser.add_json_output("--json", ("shape", "rows"), help="also write the rows to this JSON file")
    return parser.parse_args()


def write_model(shape: str, folder: Path) -> None:
    """A model of the shape with random weights, and its tokenizer, as a Hugging Face folder."""
    tokenizer = CharTokenizer.from_text(CORPUS_DIR.joinpath("tinyshakespeare.txt").read_text())
    if shape == "gpt2":
        tokenizer = GPT2Tokenizer()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, **SHAPES[shape])).eval()
    export_model(model, tokenizer, folder)


class Server:
    """serve.py serving the folder in a process of its own, on a free port."""

    def __init__(self, folder: Path, max_batch: int, max_tokens: int, threads: int):
        command = [sys.executable, str(ROOT / "serve.py"), "--init-from", str(folder), "--port", "0", "--device",
                   "cpu", "--max-batch", str(max_batch), "--max-tokens", str(max_tokens),
                   "--threads", str(threads)]  # fmt: skip
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        deadline = time.monotonic() + STARTUP_SECONDS
        for line in self.process.stderr:
            found = re.search(r"at (http://\S+/) on ", line)
            if found:
                self.url = found.group(1)
                break
            if time.monotonic() > deadline:
                break
        else:
            raise UserError(f"serve.py did not start: {self.process.stderr.read()[-2000:]}")
        threading.Thread(target=self.process.stderr.read, daemon=True).start()  # keep the pipe from filling

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def prompts(count: int) -> list[str]:
    """Different prompts of the corpus, each some 16 characters from the start of a line."""
    lines = [line for line in CORPUS_DIR.joinpath("tinyshakespeare.txt").read_text().splitlines() if len(line) >= 16]
    return [lines[i * 37 % len(lines)][:16] for i in range(count)]


def load(url: str, clients: int, texts: list[str], max_tokens: int) -> dict:
    """Send every prompt, `clients` at a time; the figures of the whole load."""
    with httpx.Client(timeout=600, limits=httpx.Limits(max_connections=clients)) as http:

        def ask(prompt: str) -> tuple[int, float]:
            start = time.perf_counter()
            body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            response = http.post(url + "v1/completions", json=body)
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"], time.perf_counter() - start

        ask(texts[0])  # untimed: the first request warms the server up
        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            answers = list(pool.map(ask, texts))
        seconds = time.perf_counter() - start
    tokens = sum(count for count, _ in answers)
    latency = statistics.median(took for _, took in answers)
    return dict(requests_per_s=len(texts) / seconds, tokens_per_s=tokens / seconds, latency_s=latency, tokens=tokens)


def main() -> None:
    args = parse_args()
    texts = prompts(args.requests)
    threads, why = (args.threads, "--threads") if args.threads else auto_threads()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{threads} thread(s) ({why}); model: the {args.shape} shape; {args.requests} requests of {args.max_tokens} "
        f"tokens at each load",
        file=sys.stderr,
    )
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        write_model(args.shape, folder)
        servers = {}
        try:
            for name, max_batch in (("together", args.max_batch), ("one at a time", 1)):
                servers[name] = Server(folder, max_batch, args.max_tokens, threads)
            for clients in args.clients:
                for (name, server), max_batch in zip(servers.items(), (args.max_batch, 1), strict=True):
                    figures = load(server.url, clients, texts, args.max_tokens)
                    rows.append(dict(serving=name, max_batch=max_batch, clients=clients) | figures)
                    print(f"  {name} (--max-batch {max_batch}), {clients} clients: {figures}", file=sys.stderr)
                    if args.json:
                        write_json(args.json, dict(shape=args.shape, threads=threads, rows=rows, complete=False))
        finally:
            for server in servers.values():
                server.stop()
    print("| serving | clients | requests/s | tokens/s | median latency (s) |")
    print("|---|---:|---:|---:|---:|")
    for row in sorted(rows, key=lambda row: row["max_batch"] == 1):
        print(
            f"| {row['serving']} (`--max-batch {row['max_batch']}`) | {row['clients']} | {row['requests_per_s']:.2f} "
            f"| {row['tokens_per_s']:.0f} | {row['latency_s']:.2f} |"
        )
    if args.json:
        write_json(args.json, dict(shape=args.shape, threads=threads, rows=rows, complete=True))


if __name__ == "__main__":
    run_cli(main)
