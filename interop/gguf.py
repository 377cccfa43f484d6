"""sample.py --export-gguf: a model and its tokenizer as one GGUF file, which llama.cpp (and Ollama,
LM Studio) runs. The architecture and tensors are interop/gguf_tensors.py's; this file adds the tokenizer and
writes the file (docs/shipping.md).

llama.cpp's byte-level BPE ("gpt2" tokenizer model) reads GPT-2's BPE, a BPE trained by
data/prepare.py and a folder's byte-level tokenizer.json split by GPT-2's pattern: its token
strings in GPT-2's byte alphabet, its merges, the pre-tokenizer "gpt-2". A character vocabulary is
the same tokenizer with no merges, which encodes each byte of text as the token spelling it: it
works where every character is one byte (ASCII). Anything else is refused by name.
"""

import json
import sys
from collections.abc import Callable
from pathlib import Path

import gguf

from data.files import check_output_file, make_dir
from data.gguf_tokenizer import SPLIT_PATTERNS
from data.tokenizer import Tokenizer, byte_level_bytes, byte_level_spelling
from errors import UserError
from interop.families import gguf_family_for
from interop.gguf_tensors import DTYPE_TYPES, FILE_TYPES, add_model, add_tensors, gguf_tensors, is_export
from interop.pretrained import SpecialTokens, exported_config, note_plain_causal, special_tokens
from model import GPT
from trainer.checkpoint import non_finite

GGUF_KIND = "a GGUF file of an earlier sample.py --export-gguf"
# llama.cpp refuses a "gpt2" tokenizer without merges, and gguf writes no empty list: a character
# vocabulary gets this one, of two 0xFF bytes (spelled ÿ), which UTF-8 text never holds, so it never applies
NO_MERGE = f"{byte_level_spelling(bytes([0xFF]))} {byte_level_spelling(bytes([0xFF]))}"
# the id llama.cpp takes for the end of text (and the start) of a byte-level BPE whose file names none (its
# llama-vocab.cpp's default): a character vocabulary without <|endoftext|> cannot tell it otherwise
LLAMA_CPP_DEFAULT_EOS = 11
# gguf's token types (llama.cpp's llama_token_type)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


def write_gguf(
    path: Path,
    dtype: str,
    gguf_type: str | None,
    load: Callable[[], tuple[GPT, Tokenizer, Path]],
    also: str | None,
) -> None:
    """sample.py --export-gguf: check path and the type, load the model (load() gives it, its tokenizer
    and where it came from), write the file and say so. dtype is --dtype's value (auto is float32), and
    gguf_type --gguf-type's (None: --dtype's type). `also`: an --export given with it, refused (one
    format a command)."""
    if also is not None:
        raise UserError(f"--export-gguf={str(path)!r} and --export={also!r} write one format each (give one of them)")
    file_type = gguf_file_type(dtype, gguf_type)
    check_gguf_file(path)  # before a model, perhaps a large download, is loaded
    model, tokenizer, source = load()
    arch = export_gguf(model, tokenizer, path, file_type, source)
    print(f"wrote {source} as a llama.cpp {arch} model in {file_type} to {path}", file=sys.stderr)
    if special_tokens(tokenizer).eos is None and tokenizer.vocab_size > LLAMA_CPP_DEFAULT_EOS:
        shown = tokenizer.decode([LLAMA_CPP_DEFAULT_EOS])
        print(
            f"note: this vocabulary has no end-of-text token, and llama.cpp takes token {LLAMA_CPP_DEFAULT_EOS} "
            f"({shown!r}) for one: run it with --ignore-eos to generate past it",
            file=sys.stderr,
        )


def gguf_file_type(dtype: str, gguf_type: str | None) -> str:
    """The type of the file's matrices (FILE_TYPES) that --dtype and --gguf-type ask for; both given,
    or an unknown type, is refused by name."""
    if gguf_type is None:
        return DTYPE_TYPES.get(dtype, "F32")  # auto: float32
    if dtype != "auto":
        raise UserError(
            f"--gguf-type={gguf_type} and --dtype={dtype} both say how the file's matrices are stored (give one of "
            f"them: --gguf-type {DTYPE_TYPES[dtype]} is --dtype {dtype})"
        )
    if gguf_type.upper() not in FILE_TYPES:
        raise UserError(
            f"--gguf-type={gguf_type} is not a type this export writes (use one of {', '.join(FILE_TYPES)}; "
            f"llama.cpp's llama-quantize makes the others from an F32 or F16 file)"
        )
    return gguf_type.upper()


def check_gguf_file(path: Path, inputs: tuple[Path, ...] = ()) -> None:
    """Refuse, before the model is loaded, an --export-gguf path that is a folder, a file the command
    reads, or a file other than an earlier export (which is replaced)."""
    if Path(path).suffix != ".gguf":
        raise UserError(f"--export-gguf={str(path)!r} does not end in .gguf (llama.cpp and Ollama look for FILE.gguf)")
    check_output_file(Path(path), "--export-gguf", is_export, GGUF_KIND, inputs)


def export_gguf(model: GPT, tokenizer: Tokenizer, path: Path, file_type: str, source: Path) -> str:
    """Write model and tokenizer to path as a GGUF file of the llama.cpp architecture that computes
    the model, matrices in file_type (FILE_TYPES: F32, F16, BF16, Q8_0, Q4_0, with gguf_tensors.tensor_type's
    exceptions; or --dtype's float32, float16, bfloat16). Returns the architecture. A chat model
    trained with model.attn_documents is written as the plain causal model, as --export writes it, with a
    note saying so (exported_config). Everything is checked before the file is written, and the file
    appears whole or not at all."""
    config = exported_config(model.config, tokenizer)
    try:
        family = gguf_family_for(config)
    except ValueError as e:
        raise UserError(f"--export-gguf cannot write this model: {e}") from None
    state = model.state_dict()
    problem = non_finite(state)
    if problem is not None:
        raise UserError(
            f"--export-gguf cannot write this model: its weight {problem} (export one from before it diverged)"
        )
    vocabulary = gguf_vocabulary(tokenizer, config.vocab_size)
    special = special_tokens(tokenizer)
    tensors = gguf_tensors(state, config, family)
    make_dir(Path(path).parent)
    temporary = Path(path).with_name(f".{Path(path).name}.tmp")
    writer = gguf.GGUFWriter(temporary, family.gguf.arch)
    try:
        add_model(writer, config, family, name=Path(path).stem, source=str(source))
        add_tokenizer(writer, tokenizer, vocabulary, special)
        fell_back = add_tensors(writer, tensors, DTYPE_TYPES.get(file_type, file_type))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        temporary.replace(path)  # the file appears whole, replacing an earlier export only now
    finally:
        temporary.unlink(missing_ok=True)
    note_plain_causal(model.config, tokenizer)
    if fell_back:
        print(
            f"note: {len(fell_back)} matrices ({', '.join(fell_back[:3])}{', ...' if len(fell_back) > 3 else ''}) "
            f"hold rows of a length that is not a multiple of {file_type}'s blocks of 32, so they are F16, as "
            f"llama-quantize writes them",
            file=sys.stderr,
        )
    return family.gguf.arch


def gguf_vocabulary(tokenizer: Tokenizer, vocab_size: int) -> dict:
    """The tokens (GPT-2 byte alphabet), their types and the merges of llama.cpp's byte-level BPE for
    tokenizer, padded to the model's vocab_size; a tokenizer it cannot read is refused by name."""
    state = json.loads(tokenizer.to_json())
    model = state["model"]
    if _is_characters(state):
        wide = [ch for ch in model["vocab"] if len(ch.encode("utf-8")) > 1]
        if wide:
            raise UserError(
                f"--export-gguf cannot write this character vocabulary: {wide[0]!r} is {len(wide[0].encode())} "
                f"bytes in UTF-8, and llama.cpp's byte-level tokenizer would split it into bytes this vocabulary "
                f"has no tokens for (only vocabularies of one-byte characters, ASCII, export)"
            )
        vocab = {byte_level_spelling(ch.encode("utf-8")): i for ch, i in model["vocab"].items()}
        pre = "gpt-2"  # with no merges, any split gives one token a character
    else:
        pre = pre_tokenizer_name(state, getattr(tokenizer, "source", tokenizer.name))
        vocab = model["vocab"]
    added = {token["id"]: token for token in state.get("added_tokens", [])}
    tokens, types = [], []
    by_id = {token_id: token for token, token_id in vocab.items()}
    for token_id in range(vocab_size):
        if token_id in added:
            tokens.append(added[token_id]["content"])
            types.append(CONTROL if added[token_id]["special"] else USER_DEFINED)
        elif token_id in by_id:
            tokens.append(by_id[token_id])
            types.append(NORMAL)
        else:  # an id no token has (the model's vocabulary padded past the tokenizer's)
            tokens.append(f"[PAD{token_id}]")
            types.append(UNUSED)
    merges = [pair if isinstance(pair, str) else " ".join(pair) for pair in model.get("merges", [])]
    return {"tokens": tokens, "types": types, "merges": merges, "pre": pre}


def _is_characters(state: dict) -> bool:
    """Whether a tokenizer.json is a character vocabulary (CharTokenizer.to_json's, or one read back
    from a folder it was exported to): a BPE of single characters with no merges, joined by Fuse."""
    model, decoder = state.get("model") or {}, state.get("decoder") or {}
    characters = all(len(token) == 1 for token in model.get("vocab", {}))
    return model.get("type") == "BPE" and not model.get("merges") and decoder.get("type") == "Fuse" and characters


def pre_tokenizer_name(state: dict, source: str) -> str:
    """The llama.cpp pre-tokenizer that splits text as a byte-level BPE's tokenizer.json does: GPT-2's
    ByteLevel split ("gpt-2"), SmolLM2's digits one at a time before it ("smollm"), or a Split by one of
    SPLIT_PATTERNS before a plain ByteLevel. Another
    model, split or normalizer is refused by name. (Qwen2's NFC normalizer is let through, as
    llama.cpp's converter lets it: NFC leaves text alone unless it holds combining characters.)"""
    model = state.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = model.get("type") if model.get("type") != "BPE" else "BPE with byte fallback (SentencePiece-style)"
        raise UserError(
            f"--export-gguf cannot write the tokenizer of {source}: it is a {kind}, and this export writes llama.cpp's "
            f"byte-level BPE only (GPT-2's, a BPE trained by data/prepare.py, Qwen2's or Llama 3's kind)"
        )
    pre, normalizer = state.get("pre_tokenizer") or {}, state.get("normalizer")
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    name = None
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex"):
        name = "gpt-2"
    elif len(steps) == 2 and [step.get("type") for step in steps] == ["Digits", "ByteLevel"]:  # SmolLM2's
        name = "smollm" if steps[0].get("individual_digits") and steps[1].get("use_regex") else None
    elif len(steps) == 2 and [step.get("type") for step in steps] == ["Split", "ByteLevel"]:
        split, byte_level = steps
        plain = split.get("behavior") == "Isolated" and not split.get("invert") and not byte_level.get("use_regex")
        name = SPLIT_PATTERNS.get((split.get("pattern") or {}).get("Regex")) if plain else None
    if any(step.get("add_prefix_space") for step in steps) or normalizer not in (None, {"type": "NFC"}):
        name = None
    if name is None:
        raise UserError(
            f"--export-gguf cannot write the tokenizer of {source}: its pre-tokenizer or normalizer is none that "
            f"llama.cpp reproduces here (GPT-2's ByteLevel split, SmolLM2's, Qwen2's or Llama 3's split pattern)"
        )
    if not all(char in byte_level_bytes() for token in model["vocab"] for char in token):
        raise UserError(f"--export-gguf cannot write the tokenizer of {source}: its tokens are not spelled in bytes")
    return name


def add_tokenizer(writer: "gguf.GGUFWriter", tokenizer: Tokenizer, vocabulary: dict, special: SpecialTokens) -> None:
    """The tokenizer's metadata: llama.cpp's byte-level BPE, its special tokens (bos, eos, the end of a
    reply, padding) and whether llama.cpp adds bos and eos to a text as the tokenizer does, and the chat
    template, which llama.cpp renders with the bos and eos written here."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocabulary["pre"])
    writer.add_token_list(vocabulary["tokens"])
    writer.add_token_types(vocabulary["types"])
    writer.add_token_merges(vocabulary["merges"] or [NO_MERGE])
    writer.add_add_bos_token(special.add_bos)
    writer.add_add_eos_token(special.add_eos)
    for token_id, add in (
        (special.bos, writer.add_bos_token_id),
        (special.eos, writer.add_eos_token_id),
        (special.eot, writer.add_eot_token_id),
        (special.pad, writer.add_pad_token_id),
    ):
        if token_id is not None:
            add(token_id)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)
