"""Where a fine-tuning run's weights start: a run of this trainer or a Hugging Face folder
(train.init_from), trained whole or through LoRA adapters (lora.rank); and a LoRA checkpoint's frozen
base, read again from where it came from to resume, sample or export it.

trainer/start.py hands a run to FineTune when it fine-tunes; a run from scratch never reads this file.
"""

import dataclasses
import json
from pathlib import Path

import torch

from data.loader import TokenDataset
from data.tokenizer import JsonTokenizer, Tokenizer, tokenizer_from_meta
from errors import UserError
from finetune.lora import adapter_state, add_adapters, expected_adapters, fingerprint, merge_adapters
from interop.pretrained import TOKENIZER_NAME, Pretrained, folder_tokenizer, load_pretrained
from model import GPT, GPTConfig
from trainer.checkpoint import check_weights, expected_weights, load_checkpoint, run_checkpoint
from trainer.config import INIT_FROM, Config, LoraConfig

# switches that make a model compute something else: a run that sets one differently from the folder is refused
KEPT_SWITCHES = (
    "pos_emb", "norm", "qk_norm", "mlp", "tie_embeddings", "logit_softcap", "smear_gate", "bigram_embed",
    "value_embeds", "unet_skips", "backout",
)  # fmt: skip


# what the folder decides of the model's shape, whatever the run's config says
FOLDER_SHAPE = (
    "n_layer", "n_head", "n_embd", "head_dim", "vocab_size", "n_kv_head", "mlp_width", "norm_eps", "bias", "qkv_bias",
    "rope_base", "rope_scaling", "rope_factor", "rope_original_context", "rope_low_freq_factor",
    "rope_high_freq_factor", "rope_beta_fast", "rope_beta_slow", "rope_attention_factor", "rope_truncate",
)  # fmt: skip


def same_ids(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers stand for the same ids: as many, each the same bytes (so a tokenizer.json
    written from GPT-2's ranks is GPT-2's BPE). Two BPEs of one vocabulary and different merges would
    pass; no tokenizer in practice is built so."""
    return a.vocab_size == b.vocab_size and all(a.token_bytes(i) == b.token_bytes(i) for i in range(a.vocab_size))


def with_pretrained_shape(cfg: Config, pretrained: Pretrained, dataset_meta: dict) -> Config:
    """The run's config for fine-tuning the weights in train.init_from.

    The architecture and shape are the folder's; model.block_size may shorten its context (a learned
    position table is cropped); model.dropout and the attention pattern are the run's own.
    """
    source, folder = cfg.train.init_from, pretrained.config
    tokenizer = folder_tokenizer(pretrained, "train.init_from")
    if not same_ids(tokenizer, tokenizer_from_meta(dataset_meta)):
        made_with = TOKENIZER_NAME if isinstance(tokenizer, JsonTokenizer) else "GPT-2 BPE"
        prepare = pretrained.directory / TOKENIZER_NAME if made_with == TOKENIZER_NAME else "gpt2"
        if pretrained.tokenizer is not None:  # a GGUF file's
            made_with, prepare = "tokenizer", pretrained.directory
        raise UserError(
            f"train.init_from={source!r} holds a model that reads the ids of its {made_with}, but "
            f"data.dataset={cfg.data.dataset!r} was prepared with another tokenizer ({dataset_meta['tokenizer']!r}) "
            f"(prepare the text with python data/prepare.py --tokenizer {prepare})"
        )
    if cfg.model.block_size > folder.block_size:
        raise UserError(
            f"model.block_size={cfg.model.block_size} is longer than the {folder.block_size} positions of the "
            f"model in train.init_from={source!r} (use at most {folder.block_size})"
        )
    default = GPTConfig()
    for key in KEPT_SWITCHES:
        run, theirs = getattr(cfg.model, key), getattr(folder, key)
        if run != getattr(default, key) and run != theirs:
            raise UserError(
                f"train.init_from={source!r} holds a {pretrained.family.model_type} model with model.{key}="
                f"{json.dumps(theirs)}, but the run sets model.{key}={json.dumps(run)} (fine-tuning keeps the "
                f"folder's architecture: set model.{key}={json.dumps(theirs)} or leave it out)"
            )
    shape = {name: getattr(folder, name) for name in (*FOLDER_SHAPE, *KEPT_SWITCHES)}
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **shape))


def crop_positions(state: dict[str, torch.Tensor], block_size: int) -> dict[str, torch.Tensor]:
    """The weights with a learned position table cut to the first block_size positions."""
    if "transformer.wpe.weight" not in state:
        return state
    return state | {"transformer.wpe.weight": state["transformer.wpe.weight"][:block_size]}


def from_run_checkpoint(cfg: Config, checkpoint: dict, dataset_meta: dict) -> tuple[Config, dict[str, torch.Tensor]]:
    """The run's config and starting weights for fine-tuning a checkpoint of this trainer (train.init_from
    a run directory or ckpt.pt) on data.dataset. The architecture and shape are the checkpoint's; the
    run's model.block_size (at most the checkpoint's), dropout and attention pattern apply.

    The dataset's vocabulary must be the checkpoint's, or the checkpoint's followed by special tokens
    added for chat (docs/chat.md): then the token embedding (and an untied output layer) grows by their
    rows, each started at the mean of the existing tokens' rows, a token the model reads as an average
    one rather than as noise."""
    source = cfg.train.init_from
    saved = dataclasses.replace(GPTConfig(), **checkpoint["config"]["model"])
    if cfg.model.block_size > saved.block_size:
        raise UserError(
            f"model.block_size={cfg.model.block_size} is longer than the {saved.block_size} positions of the "
            f"model in train.init_from={source!r} (use at most {saved.block_size})"
        )
    theirs, ours = tokenizer_from_meta(checkpoint["dataset"]), tokenizer_from_meta(dataset_meta)
    shared = min(theirs.vocab_size, ours.vocab_size)
    if ours.vocab_size < theirs.vocab_size or not all(
        theirs.token_bytes(i) == ours.token_bytes(i) for i in range(shared)
    ):
        chat = "conversations" if "chat" in dataset_meta else "plain text"
        vocabulary = f"{dataset_meta['tokenizer']} vocabulary of {ours.vocab_size:,}"
        raise UserError(
            f"data.dataset={cfg.data.dataset!r} ({chat}, {vocabulary}) "
            f"does not extend the vocabulary the model in train.init_from={source!r} was trained with "
            f"({theirs.vocab_size:,} tokens{', with a chat template' if 'chat' in checkpoint['dataset'] else ''}): "
            f"prepare the data with --tokenizer {source} (docs/chat.md)"
        )
    pattern = {key: getattr(cfg.model, key) for key in ("block_size", "dropout", "attn_documents", "eot_token")}
    vocab_size = max(saved.vocab_size, ours.vocab_size)
    model = dataclasses.replace(saved, **pattern, vocab_size=vocab_size)
    state = grow_vocabulary(checkpoint["model"], theirs.vocab_size, vocab_size)
    return dataclasses.replace(cfg, model=model), state


def grow_vocabulary(state: dict[str, torch.Tensor], known: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """The weights with the token embedding (and an untied output layer, and value embeddings) grown to
    vocab_size rows, the new rows each the mean of the first `known` rows (the tokens the model was
    trained on)."""
    grown = dict(state)
    tables = [name for name in state if name.startswith("value_embeds.tables.")]
    for name in ("transformer.wte.weight", "lm_head.weight", *tables):
        if name in state and state[name].size(0) < vocab_size:
            rows = state[name]
            mean = rows[:known].mean(dim=0, keepdim=True)  # (1, C)
            grown[name] = torch.cat([rows, mean.expand(vocab_size - rows.size(0), -1)])
    return grown


def base_record(source: str, state: dict[str, torch.Tensor]) -> dict:
    """What a LoRA checkpoint says of its base: where it came from (a local path made absolute, so a
    run resumed or sampled from elsewhere finds it), its fingerprint, and its name as train.init_from
    gave it (a hub id, or a path as typed), which an exported adapter names: an absolute path would
    hold only on the machine it was made on."""
    where = str(Path(source).resolve()) if Path(source).exists() else source
    return {"source": where, "fingerprint": fingerprint(state), "name": source}


def base_weights(record: dict, config: GPTConfig, adapters: str) -> dict[str, torch.Tensor]:
    """The frozen weights a LoRA checkpoint was trained on, read again from record["source"] and
    shaped as at the start of its run (a vocabulary grown for chat, positions cropped); refused if
    their fingerprint is not the recorded one. adapters: the file that holds the adapters."""

    source = record["source"]
    checkpoint_path = run_checkpoint(source)
    if checkpoint_path is not None:
        checkpoint = load_checkpoint(checkpoint_path)
        raw, known = checkpoint["model"], tokenizer_from_meta(checkpoint["dataset"]).vocab_size
    else:
        raw = load_pretrained(source, key=f"the base model of {adapters}").state
        known = config.vocab_size
    found = fingerprint(raw)
    if found != record["fingerprint"]:
        raise UserError(
            f"the base model {source} has changed since the adapters in {adapters} were trained on it "
            f"(fingerprint {found[:12]}, trained on {record['fingerprint'][:12]}): put the original back, "
            f"or train new adapters on this one"
        )
    return crop_positions(grow_vocabulary(raw, known, config.vocab_size), config.block_size)


def check_base(source: str, checkpoint: dict, vocab_size: int) -> None:
    """A LoRA run cannot adapt another LoRA run's checkpoint, which holds adapters only; nor a run
    whose vocabulary lacks tokens of the dataset (vocab_size ids): the rows grown for them (a chat
    template's tokens) would stay frozen, all equal to the mean row, so the model could never tell
    them apart, nor end a reply."""
    if "lora" in checkpoint:
        raise UserError(
            f"train.init_from={source!r} is a LoRA run, whose checkpoint holds adapters only: export it merged "
            f"(python sample.py --out-dir {source} --export DIR) and fine-tune that folder"
        )
    known = tokenizer_from_meta(checkpoint["dataset"]).vocab_size
    if vocab_size > known:
        raise UserError(
            f"lora.rank is set, but the dataset has {vocab_size - known} token(s) that train.init_from={source!r} "
            f"has no embedding for (a chat template's): frozen, their rows would all be alike. Fine-tune the run on "
            f"this dataset without LoRA first (lora.rank=0), or adapt a model whose vocabulary holds them"
        )


def lora_model(checkpoint: dict, path: Path, config: GPTConfig, lora: LoraConfig) -> GPT:
    """The model of a LoRA checkpoint: its base read again, its adapters merged in."""
    check_weights(expected_adapters(config, lora), checkpoint["model"], f"the weights in {path}")  # before loading
    model = GPT(config)
    model.load_state_dict(base_weights(checkpoint["lora"], config, str(path)))
    add_adapters(model, lora)
    model.load_state_dict(checkpoint["model"], strict=False)  # the adapters; their names were checked
    return merge_adapters(model)


class FineTune:
    """A fine-tuning run's start: the weights of train.init_from (a run of this trainer, with its
    vocabulary grown for a chat template's tokens, or a Hugging Face folder, whose architecture and
    shape the run takes), and with lora.rank above 0 the adapters beside them, frozen, which then are
    all a checkpoint holds of the model, with where their base came from (base_record)."""

    def __init__(self, cfg: Config, dataset: TokenDataset, checkpoint: dict | None):
        init_from = cfg.train.init_from
        self.weights: dict[str, torch.Tensor] | None = None  # the starting weights, from train.init_from
        self.lora_base = checkpoint.get("lora") if checkpoint is not None else None  # a LoRA run's base
        if init_from not in INIT_FROM and run_checkpoint(init_from) is not None:  # a run of ours
            source = load_checkpoint(run_checkpoint(init_from))
            if cfg.lora.rank:
                check_base(init_from, source, dataset.vocab_size)
                self.lora_base = base_record(init_from, source["model"])
            cfg, self.weights = from_run_checkpoint(cfg, source, dataset.meta)
        elif init_from not in INIT_FROM:  # the weights in that folder (or hub model)
            folder = load_pretrained(init_from, key="train.init_from")
            cfg = with_pretrained_shape(cfg, folder, dataset.meta)
            self.weights = folder.state
            if cfg.lora.rank:
                self.lora_base = base_record(init_from, folder.state)
        self.cfg = cfg

    def expected_weights(self, cfg: Config) -> dict[str, torch.Tensor]:
        """What a checkpoint of this run holds (names and shapes, on the meta device): the adapters
        only, with LoRA."""
        return expected_adapters(cfg.model, cfg.lora) if cfg.lora.rank else expected_weights(cfg.model)

    def load(self, model: GPT, cfg: Config, checkpoint_path: Path, resumed: bool) -> None:
        """Put the starting weights into model (built from cfg.model) and, with LoRA, freeze them (in
        lora.base_dtype) and wrap the targeted layers with adapters: the optimizer then holds only those.
        A resumed LoRA run's checkpoint lacks the frozen weights: they are read again from their source."""
        weights = self.weights
        if resumed and cfg.lora.rank:
            weights = base_weights(self.lora_base, cfg.model, str(checkpoint_path))
        if weights is not None:
            model.load_state_dict(crop_positions(weights, cfg.model.block_size))
        if cfg.lora.rank:
            model.to(dtype=getattr(torch, cfg.lora.base_dtype))
            add_adapters(model, cfg.lora)

    def saved(self, model_state: dict[str, torch.Tensor]) -> dict:
        """The entries a checkpoint holds of the model: its weights, or with LoRA the adapters only and
        where their base is."""
        if not self.cfg.lora.rank:
            return {"model": model_state}
        return {"model": adapter_state(model_state), "lora": self.lora_base}
