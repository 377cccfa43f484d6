"""Serve a model over OpenAI's HTTP API, with a chat page: any program that talks to OpenAI talks to it.

    python serve.py                                        # the newest run, at http://127.0.0.1:8000/
    python serve.py --out-dir out/chat_shakespeare_char --port 8001
    python serve.py --init-from HuggingFaceTB/SmolLM2-135M-Instruct --api-key-file key.txt

The model is picked as sample.py picks it: the newest run under out/, --out-dir RUN (a LoRA run
too), or --init-from a Hugging Face folder or hub id. It answers POST /v1/chat/completions (the
messages through the model's chat template, as sample.py --chat), POST /v1/completions (text
continued, as sample.py) and GET /v1/models; GET / is a chat page. A greedy reply is sample.py's
greedy reply for the same prompt, and with a seed, choice i of a request is drawn as sample.py draws
sample i with that --seed (docs/serving.md).

Requests decode together: each step of the model draws one token for every reply in progress, up
to --max-batch of them (the others wait their turn), and a request joins at the next step after it
arrives. The KV cache grows to --max-batch rows of block_size positions.

It listens on 127.0.0.1 only, unless --host says otherwise. With --api-key or --api-key-file, every
request but the chat page's must carry `Authorization: Bearer KEY`. Ctrl-C or SIGTERM stops taking
requests, lets the replies in progress finish for up to 5 seconds (then ends them as if max_tokens
were reached), and exits with 128 + the signal's number (130, 143), as train.py does.
"""

import argparse
import errno
import ipaddress
import socket
import sys
from pathlib import Path

import torch
import uvicorn

from errors import ArgumentParser, UserError, run_cli
from inference.chat import reply_stops
from inference.decode_step import check_precision, prepare_decoding
from inference.load import RUNS_ROOT, add_model_arguments, latest_run, load_model
from model import GPTConfig
from server.app import Served, create_app
from server.engine import Engine
from trainer.config import MAX_THREADS
from trainer.runtime import auto_threads, check_fits_in_memory, format_bytes, resolve_device, resolve_dtype

GRACE_SECONDS = 5.0  # after Ctrl-C or SIGTERM, how long the replies in progress may go on
MAX_BODY_BYTES = 2**21  # a request body beyond 2 MiB is refused: more text than any context here holds
MAX_ROWS = 1024  # --max-batch, --max-n at most
MAX_TOKENS = 1_000_000  # --max-tokens at most


def parse_args() -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument(
        "--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1, this machine only)"
    )
    parser.add_argument("--port", type=int, default=8000, help="the port to listen on; 0: a free one (default: 8000)")
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--api-key", metavar="KEY", help="every request must carry Authorization: Bearer KEY")
    key.add_argument(
        "--api-key-file", metavar="FILE", help="as --api-key, the key read from FILE (kept out of the process list)"
    )
    parser.add_argument(
        "--max-batch", type=int, default=16, help="replies decoded together; more wait their turn (default: 16)"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=500,
        help="the most tokens a reply may ask for (max_tokens), and what it gets without asking (default: 500)",
    )
    parser.add_argument("--max-n", type=int, default=8, help="the most choices a request may ask for (default: 8)")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads for torch operators; 0: one per core other work leaves free, as train.threads=0 (default: 0)",
    )
    args = parser.parse_args()
    checks = [
        ("--port", args.port, 0 <= args.port <= 65535, "0 (a free port) to 65535"),
        ("--max-batch", args.max_batch, 1 <= args.max_batch <= MAX_ROWS, f"1 to {MAX_ROWS:,}"),
        ("--max-tokens", args.max_tokens, 1 <= args.max_tokens <= MAX_TOKENS, f"1 to {MAX_TOKENS:,}"),
        ("--max-n", args.max_n, 1 <= args.max_n <= MAX_ROWS, f"1 to {MAX_ROWS:,}"),
        (
            "--threads",
            args.threads,
            0 <= args.threads <= MAX_THREADS,
            f"0 (chosen from the free cores) to {MAX_THREADS:,}",
        ),
    ]
    for flag, value, ok, accepted in checks:
        if not ok:
            raise UserError(f"{flag}={value} is not allowed (use {accepted})")
    args.api_key = read_api_key(args.api_key, args.api_key_file)
    return args


def read_api_key(key: str | None, path: str | None) -> str | None:
    """The key given, or the first line of the file given. A key is one word of printable ASCII, as an
    HTTP header carries it; an error never shows it."""
    flag = "--api-key"
    if path is not None:
        flag = f"--api-key-file={path!r}"
        try:
            key = Path(path).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            raise UserError(f"{flag} does not exist (write the key to that file, or give it with --api-key)") from None
        except IsADirectoryError:
            raise UserError(f"{flag} is a directory, not a file holding the key") from None
        except OSError as e:
            raise UserError(f"{flag} cannot be read ({e.strerror})") from None
        except UnicodeDecodeError:
            raise UserError(f"{flag} is not text (write the key in it as one line)") from None
    if key is None:
        return None
    if not key:
        raise UserError(f"{flag} holds no key (write the key in it as one line)" if path else "--api-key='' is empty")
    if any(not 33 <= ord(c) <= 126 for c in key):
        raise UserError(
            f"{flag} holds a key with a space or a character that is not printable ASCII (a key is one word of "
            f"printable ASCII, as an HTTP header carries it)"
        )
    return key


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, bound before the model loads, so that a port in use or an
    address not of this machine is said at once."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise UserError(f"--host={host!r} is neither an address nor a name this machine resolves ({reason})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"--port={port} is in use on {host} (choose another port, or 0 for a free one)") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise UserError(
                f"--host={host!r} is not an address of this machine (use 127.0.0.1, or 0.0.0.0 for all of them)"
            ) from None
        if e.errno == errno.EACCES:
            raise UserError(f"--port={port}: this user may not listen on it (ports below 1024 need root)") from None
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror})") from None
    sock.listen(128)
    return sock


def model_name(args: argparse.Namespace) -> str:
    """What requests call the model: a run's directory name, a folder's name, or a hub id."""
    if args.init_from is not None:
        path = Path(args.init_from)
        return path.resolve().name if path.exists() else args.init_from
    return (Path(args.out_dir) if args.out_dir is not None else latest_run(RUNS_ROOT)).resolve().name


def loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main() -> None:
    args = parse_args()
    device = resolve_device(args.device, key="--device")
    dtype = resolve_dtype(args.dtype, device, key="--dtype")
    check_precision(args.precision, device, dtype)  # before a model, perhaps a large download, is loaded
    with listen(args.host, args.port) as sock:  # closed however this ends
        model, tokenizer, source = load_model(args.out_dir, init_from=args.init_from)
        cache_bytes = kv_cache_bytes(model.config, dtype, args.max_batch)
        check_fits_in_memory(
            cache_bytes,
            device,
            f"--max-batch={args.max_batch}: a KV cache of {args.max_batch} rows of {model.config.block_size} positions",
            "serve fewer replies together: a smaller --max-batch",
        )
        model.to(device=device, dtype=dtype)
        decoding = prepare_decoding(model, device, args.precision)
        threads = set_threads(args.threads, device)
        served = Served(
            name=model_name(args),
            tokenizer=tokenizer,
            config=model.config,
            chat_stops=None if tokenizer.chat_template is None else frozenset(reply_stops(tokenizer)),
            max_tokens=args.max_tokens,
            max_n=args.max_n,
            max_body_bytes=MAX_BODY_BYTES,
            api_key=args.api_key,
        )
        engine = Engine(model, tokenizer, args.max_batch, decoding.step)
        host, port = sock.getsockname()[:2]
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/"
        print(
            f"serving {source} as {served.name!r} at {url} on {device.type}, {decoding.description}{threads}; up to "
            f"{args.max_batch} replies together (KV cache up to {format_bytes(cache_bytes)}); Ctrl-C stops",
            file=sys.stderr,
        )
        if not loopback(args.host):
            anyone = "anyone who can reach it may use it" if args.api_key is None else "requests need the API key"
            print(f"note: --host={args.host} lets other machines reach the server: {anyone}", file=sys.stderr)
        config = uvicorn.Config(
            create_app(engine, served),
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=int(GRACE_SECONDS) + 5,
        )
        DrainingServer(config, engine).run(sockets=[sock])


def set_threads(threads: int, device: torch.device) -> str:
    """Set torch's CPU threads; returns how many, and why, for the start-up line (nothing off the CPU)."""
    if device.type != "cpu":
        return ""
    why = "--threads"
    if threads == 0:
        # a torch operator waits for its slowest thread: on a core other work takes, that is a long wait
        threads, free = auto_threads()
        why = f"chosen from {free}"
    torch.set_num_threads(threads)
    return f", {threads} thread(s) ({why})"


def kv_cache_bytes(config: GPTConfig, dtype: torch.dtype, rows: int) -> int:
    """The most memory the KV cache takes: keys and values of every layer for `rows` replies of block_size
    positions, and one more row for a prompt's own encoding."""
    return (rows + 1) * 2 * config.n_layer * config.kv_heads * config.head_size * config.block_size * dtype.itemsize


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which on Ctrl-C or SIGTERM first gives the replies in progress GRACE_SECONDS."""

    def __init__(self, config: uvicorn.Config, engine: Engine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            print(f"stopping: the replies in progress get {GRACE_SECONDS:g} s to finish", file=sys.stderr)
        self.engine.drain(GRACE_SECONDS)
        super().handle_exit(sig, frame)


if __name__ == "__main__":
    run_cli(main)
