"""Conversations into a dataset for chat fine-tuning (data/prepare.py --chat, docs/chat.md): each
conversation rendered through a chat template (data/conversations.py) into one document, written as
train.bin and val.bin with train.mask.bin and val.mask.bin beside them, one byte per token saying
which tokens are trained (bit 0) and where each conversation starts (bit 1). A conversation longer
than the block size is refused, naming it, or cut to it; a split left without a trained token within
the block size of a conversation's start (every reply cut off) is refused, naming it: its loss would
be a mean over nothing."""

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from data.conversations import (
    BUILTIN_SPECIALS,
    BUILTIN_TEMPLATE,
    BUILTIN_VARIABLES,
    ChatTemplate,
    Conversation,
    chat_tokenizer,
    folder_chat_tokenizer,
    render_conversation,
)
from data.corpus import BLOCK_SIZE, SEED, SPLITS, TRAIN, VAL, VAL_FRACTION, in_val, refuse_prepared
from data.files import atomic_open, make_dir
from data.loader import CONVERSATION_START, TRAINED, has_trained_target, read_meta
from data.tokenizer import (
    TOKENIZER_FILE,
    CharTokenizer,
    GPT2Tokenizer,
    JsonTokenizer,
    Tokenizer,
    split_specials,
    tokenizer_from_meta,
)
from errors import UserError

TOO_LONG = ("refuse", "truncate")


CHECKPOINT_FILE = "ckpt.pt"  # a run directory's checkpoint (trainer/checkpoint.py), whose tokenizer --chat may use


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
    if path.suffix == ".gguf":  # a GGUF file's tokenizer, with its own template where it has one
        from data.gguf_tokenizer import gguf_tokenizer, open_gguf  # llama.cpp's files: the others need none of it

        tokenizer = gguf_tokenizer(open_gguf(path, "--tokenizer"), spec)
        return tokenizer if tokenizer.chat_template is not None else chat_tokenizer(tokenizer)
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
