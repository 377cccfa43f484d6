"""The residual-stream switches (value_embeds, unet_skips, backout, zero_init_proj): each trains, no
position sees a later token (nor, with documents, another document), cached and padded decoding
equals the full forward pass, the optimizer routes its parameters as documented, a run resumes
bit for bit, and export refuses the ones no family computes, by name."""

import weakref

import pytest
import torch

from data.tokenizer import GPT2Tokenizer
from errors import UserError
from finetune.init_from import grow_vocabulary, with_pretrained_shape
from inference.load import model_from_checkpoint
from interop.families import FAMILY_BY_TYPE, family_for, gguf_family_for
from interop.pretrained import Pretrained, export_model
from model import GPT, GPTConfig, left_pad
from optim.optimizer import build_optimizer
from tests.conftest import tiny_config, tiny_model
from tests.test_kv_cache import decode_with_cache
from tests.test_masks import EOT
from tests.test_optim import CPU, one_step, owners
from tests.test_trainer import train_losses
from tests.test_variants import learns_a_batch
from trainer.checkpoint import load_checkpoint
from trainer.config import OptimConfig, build_config, idle_keys, load_config
from trainer.loop import Trainer

VOCAB = 50
BLOCK = 32
SWITCHES = {
    "value_embeds=1": {"value_embeds": 1},
    "value_embeds=2": {"value_embeds": 2},  # every one of the 4 layers
    "unet_skips": {"unet_skips": True},
    "backout": {"backout": True},
    "zero_init_proj": {"zero_init_proj": True},
    "all, rope, gqa": {
        "value_embeds": 1,
        "unet_skips": True,
        "backout": True,
        "zero_init_proj": True,
        "pos_emb": "rope",
        "n_kv_head": 1,
    },
}
REFUSED = {  # the switches no family computes, with the value export names
    "value_embeds": ({"value_embeds": 1}, "model.value_embeds=1"),
    "unet_skips": ({"unet_skips": True}, "model.unet_skips=true"),
    "backout": ({"backout": True}, "model.backout=true"),
}


def model_of(switches: dict, n_layer: int = 4, block_size: int = BLOCK, seed: int = 0, **more) -> GPT:
    """A tiny model with the switches; zero-initialised projections are made random, so that every
    block computes something (a zero projection would hide causality and cache mistakes)."""
    torch.manual_seed(seed)
    config = GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, block_size=block_size, vocab_size=VOCAB)
    model = GPT(GPTConfig(**{**config.__dict__, **switches, **more})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("c_proj.weight") and not param.any():
                param.normal_(std=0.02)
    return model


def tokens(rows: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
def test_each_switch_learns_a_batch(switches):
    torch.manual_seed(0)
    learns_a_batch(GPT(GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=VOCAB, **switches)))


def gradient_per_position(model: GPT, idx: torch.Tensor, t: int) -> torch.Tensor:
    """(B, T) how much gradient the logits at position t send to each position's rows of every
    embedding table (the token embedding and the value embeddings)."""
    outputs = []
    tables = [module for module in model.modules() if isinstance(module, torch.nn.Embedding)]
    tables = [table for table in tables if table is not getattr(model.transformer, "wpe", None)]

    def keep(module, inputs, output):
        output.retain_grad()
        outputs.append(output)

    handles = [table.register_forward_hook(keep) for table in tables]
    logits, _ = model(idx)
    logits[:, t].sum().backward()
    for handle in handles:
        handle.remove()
    return sum(output.grad.abs().sum(-1) for output in outputs)


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
def test_no_position_sees_a_later_token(switches):
    model = model_of(switches, block_size=16)
    idx = tokens(2, 16)
    for t in (0, 7, 14):
        model.zero_grad()
        grad = gradient_per_position(model, idx, t)
        assert torch.all(grad[:, t + 1 :] == 0)
        assert torch.all(grad[:, : t + 1] > 0)


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
def test_no_gradient_crosses_a_document_boundary(switches):
    model = model_of(switches, block_size=16, attn_documents=True, eot_token=EOT)
    idx = torch.randint(8, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    idx[:, 9] = EOT  # documents: positions 0..8, then 9..15
    for t in (10, 15):
        model.zero_grad()
        grad = gradient_per_position(model, idx, t)
        assert torch.all(grad[:, :9] == 0)
        assert torch.all(grad[:, 9 : t + 1] > 0)


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
@pytest.mark.parametrize("static", [False, True], ids=["written-slots", "static"])
def test_cached_decoding_reproduces_the_full_forward_pass(switches, static):
    model = model_of(switches, block_size=16)
    idx = tokens(3, 16)
    full, _ = model(idx)
    cached = decode_with_cache(model, idx, prompt_len=5, static=static)
    assert (cached - full).abs().max().item() < 1e-5


def test_a_rolling_window_cache_with_every_switch_reproduces_the_full_forward_pass():
    model = model_of(SWITCHES["all, rope, gqa"], block_size=16, attn_window=4)
    idx = tokens(2, 16)
    full, _ = model(idx)
    cached = decode_with_cache(model, idx, prompt_len=6, static=False)  # the ring has wrapped
    assert (cached - full).abs().max().item() < 1e-5


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
def test_padded_prompts_give_the_logits_of_each_row_alone(switches):
    model = model_of(switches)
    prompts = [tokens(1, 9, seed=2)[0].tolist(), tokens(1, 16, seed=3)[0].tolist(), tokens(1, 4, seed=4)[0].tolist()]
    batch, pad = left_pad(prompts)
    logits, _ = model(batch, cache=model.new_cache(3), pad=torch.tensor(pad))
    for row, ids in enumerate(prompts):
        alone, _ = model(torch.tensor([ids]))
        torch.testing.assert_close(logits[row, pad[row] :], alone[0], rtol=0, atol=1e-5)


def test_value_embeddings_serve_the_first_and_the_last_layers_table_by_table():
    model = model_of({"value_embeds": 2}, n_layer=6)
    assert model.value_embeds.layer_tables == [0, 1, None, None, 0, 1]
    mixing = [hasattr(block.attn.value_mix, "weight") for block in model.transformer.h]
    assert mixing == [True, True, False, False, True, True]
    grouped = model_of({"value_embeds": 1, "n_kv_head": 1}, n_layer=2)
    assert grouped.value_embeds.tables[0].weight.shape == (VOCAB, 16)  # one key/value head of 16
    with pytest.raises(ValueError, match=r"^value_embeds=3 is outside the accepted range 0 \.\. n_layer // 2 = 2"):
        GPTConfig(n_layer=5, value_embeds=3)


@torch.no_grad()
def test_the_cache_holds_the_values_mixed_with_the_value_embedding():
    """Layer 0's cached values are a * v + b * e: its own values v, its tokens' rows e of the table."""
    model = model_of({"value_embeds": 1, "n_kv_head": 1})
    B, T, D = 2, 8, 16
    idx = tokens(B, T)
    cache = model.new_cache(B)
    model(idx, cache=cache)
    x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(T))
    layer = model.transformer.h[0]
    v = layer.attn.c_attn(layer.ln_1(x))[..., -D:]  # (B, T, D): the values of the one key/value head
    a, b = layer.attn.value_mix.weight
    mixed = a * v + b * model.value_embeds.tables[0](idx)
    torch.testing.assert_close(cache.v[0][:, 0, :T], mixed)


def test_unet_skips_join_each_late_block_to_its_early_mirror():
    """With every block's branches zero, the stream doubles at each skip: block 3 adds block 0's
    output, block 2 block 1's (both the embedding itself), so the final stream is weight-sums of it."""
    model = model_of({"unet_skips": True, "zero_init_proj": True})
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("c_proj.weight"):
                param.zero_()
        model.skips.weight.copy_(torch.tensor([3.0, 5.0]))
    streams = []
    model.transformer.ln_f.register_forward_hook(lambda module, inputs, output: streams.append(inputs[0]))
    idx = tokens(1, 8)
    model(idx)
    embedding = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(8))
    # block 2 reads x + 5 x (block 1's output); block 3 reads that + 3 x (block 0's output)
    torch.testing.assert_close(streams[0], embedding * (1 + 5 + 3))
    odd = model_of({"unet_skips": True}, n_layer=5)
    assert odd.skips.weight.shape == (2,)  # blocks 3 and 4 add blocks 1 and 0; the middle block 2 none


def test_backout_subtracts_its_weight_times_the_stream_after_two_thirds_of_the_blocks():
    model = model_of({"backout": True}, n_layer=6)
    assert model.backout.layer == 4
    plain = model_of({}, n_layer=6)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k != "backout.weight"})
    streams = []
    for block in plain.transformer.h:
        block.register_forward_hook(lambda module, inputs, output: streams.append(output))
    ends = []
    plain.transformer.ln_f.register_forward_hook(lambda module, inputs, output: ends.append(inputs[0]))
    backed = []
    model.transformer.ln_f.register_forward_hook(lambda module, inputs, output: backed.append(inputs[0]))
    idx = tokens(2, 8)
    plain(idx)
    model(idx)
    torch.testing.assert_close(backed[0], ends[0] - 0.5 * streams[3])  # the stream after blocks 0 .. 3


@pytest.mark.parametrize("switches,kept", [({}, False), ({"unet_skips": True}, True), ({"backout": True}, True)])
def test_a_blocks_output_is_kept_after_the_next_block_only_where_a_switch_reads_it(switches, kept):
    """Without autograd (evaluation, sampling), a block's output is freed once the next block has
    read it, unless the U-net skips or backout read it later: n_layer outputs held to the end of the
    pass would add n_layer x B x T x n_embd to its peak memory."""
    model = GPT(GPTConfig(n_layer=6, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=VOCAB, **switches)).eval()
    first_output, alive = [], []
    model.transformer.h[0].register_forward_hook(lambda module, args, output: first_output.append(weakref.ref(output)))
    model.transformer.h[2].register_forward_pre_hook(lambda module, args: alive.append(first_output[0]() is not None))
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (2, BLOCK)))
    assert alive == [kept]


def test_zero_init_projections_start_at_zero_and_muon_moves_them_on_the_first_step():
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=VOCAB, zero_init_proj=True)
    model = GPT(config)
    projections = {n: p for n, p in model.named_parameters() if n.endswith("c_proj.weight")}
    assert len(projections) == 4 and all(not p.any() for p in projections.values())
    before = one_step(model, build_optimizer(model, OptimConfig(optimizer="muon"), CPU))
    for name, param in projections.items():
        assert torch.isfinite(param).all() and param.any(), name
    # the rest of a block gets no gradient through a zero projection: it moves from the second step
    assert torch.equal(model.transformer.h[0].attn.c_attn.weight, before["transformer.h.0.attn.c_attn.weight"])


def test_off_switches_add_no_parameters_and_no_modules_with_weights():
    plain = model_of({})
    names = set(plain.state_dict())
    assert not any(name.startswith(("value_embeds.", "skips.", "backout.")) or "value_mix" in name for name in names)


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
def test_config_counts_the_parameters_of_each_switch(switches):
    for n_layer in (4, 5):
        config = GPTConfig(n_layer=n_layer, n_head=2, n_embd=12, block_size=5, vocab_size=11, **switches)
        assert config.num_params() == GPT(config).num_params(non_embedding=False)


def test_non_embedding_count_leaves_out_the_value_tables():
    with_tables = model_of({"value_embeds": 2})
    assert with_tables.num_params() == model_of({}).num_params() + 2 * 4  # a and b in 4 layers


def test_muon_takes_the_block_matrices_and_adamw_the_tables_and_weights_of_the_switches():
    model = model_of(SWITCHES["all, rope, gqa"])
    optimizer = build_optimizer(model, OptimConfig(optimizer="muon"), CPU)
    owner = owners(optimizer)
    adamw = optimizer.optimizers[1]
    decayed = {id(p) for g in adamw.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, param in model.named_parameters():
        meant = "muon" if name.startswith("transformer.h.") and param.dim() == 2 else "adamw"
        assert owner[id(param)] == meant, name
    names = dict(model.named_parameters())
    assert owner[id(names["value_embeds.tables.0.weight"])] == "adamw"
    assert id(names["value_embeds.tables.0.weight"]) in decayed  # a table, like wte
    for name in ("skips.weight", "backout.weight", "transformer.h.0.attn.value_mix.weight"):
        assert owner[id(names[name])] == "adamw" and id(names[name]) not in decayed, name


def test_a_run_with_every_switch_resumes_bit_for_bit(tmp_path, data_dir):
    run = dict(
        model__n_layer=4,
        model__value_embeds=1,
        model__unet_skips=True,
        model__backout=True,
        model__zero_init_proj=True,
        optim__optimizer="muon",
        train__max_iters=12,
        train__eval_interval=6,
    )
    Trainer(tiny_config(tmp_path / "whole", data_dir, **run)).fit()
    Trainer(tiny_config(tmp_path / "split", data_dir, **run | {"train__max_iters": 6})).fit()
    Trainer(tiny_config(tmp_path / "split", data_dir, **run | {"train__init_from": "resume"})).fit()
    assert train_losses(tmp_path / "split") == train_losses(tmp_path / "whole")


def test_a_checkpoint_written_before_the_switches_loads_with_them_off(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=2, train__eval_interval=2)).fit()
    checkpoint = torch.load(run_dir / "ckpt.pt", weights_only=True)
    for key in ("value_embeds", "unet_skips", "backout", "zero_init_proj"):
        del checkpoint["config"]["model"][key]
    torch.save(checkpoint, run_dir / "ckpt.pt")
    model, _ = model_from_checkpoint(load_checkpoint(run_dir / "ckpt.pt"), run_dir / "ckpt.pt")
    assert (model.config.value_embeds, model.config.unet_skips, model.config.backout) == (0, False, False)


@pytest.mark.parametrize("key", REFUSED)
def test_export_refuses_a_switch_no_family_computes_by_name(key, tmp_path):
    """--export, --export-adapter (family_for) and --export-gguf (gguf_family_for) read the same table."""
    switches, named = REFUSED[key]
    model = model_of(switches, n_layer=2)
    with pytest.raises(UserError, match=rf"^--export cannot write this model: {named} is computed by no"):
        export_model(model, GPT2Tokenizer(), tmp_path / "export")
    assert not (tmp_path / "export").exists()
    for check in (family_for, gguf_family_for):
        with pytest.raises(ValueError, match=rf"^{named} is computed by no "):
            check(model.config)


def test_zero_initialised_projections_export_as_gpt2():
    """zero_init_proj only starts the weights: the trained model is GPT-2's computation."""
    assert family_for(GPTConfig(zero_init_proj=True)).model_type == "gpt2"


def test_growing_the_vocabulary_grows_the_value_tables():
    state = model_of({"value_embeds": 1}).state_dict()
    grown = grow_vocabulary(state, VOCAB, VOCAB + 2)
    table = grown["value_embeds.tables.0.weight"]
    assert table.shape == (VOCAB + 2, 16 * 2)
    torch.testing.assert_close(table[-1], state["value_embeds.tables.0.weight"].mean(dim=0))


def test_switches_that_do_nothing_in_a_run_are_named_in_the_note():
    note = idle_keys(load_config(None, ["--model.n_layer=1", "--model.unet_skips=true"]))
    assert note == "these settings do nothing in this run: model.unet_skips=true (only with model.n_layer of 2 or " \
        "more: a skip joins two blocks)"  # fmt: skip
    note = idle_keys(load_config(None, ["--model.zero_init_proj=true", "--train.init_from=gpt2"]))
    assert "model.zero_init_proj=true (only with train.init_from='scratch'" in note
    assert idle_keys(load_config(None, ["--model.zero_init_proj=true", "--train.init_from=resume"])) is None


@pytest.mark.parametrize("switch", [{"value_embeds": 1}, {"unet_skips": True}, {"backout": True}], ids=str)
def test_fine_tuning_a_folder_refuses_a_residual_switch_it_does_not_compute(switch, tmp_path):
    key, value = next(iter(switch.items()))
    cfg = build_config({"model": switch, "train": {"init_from": str(tmp_path)}})
    gpt2 = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=1024, vocab_size=50257)
    folder = Pretrained(FAMILY_BY_TYPE["gpt2"], gpt2, {}, tmp_path)
    with pytest.raises(UserError, match=rf"holds a gpt2 model with model\.{key}=.* but the run sets model\.{key}="):
        with_pretrained_shape(cfg, folder, {"tokenizer": "gpt2"})


def test_attention_maps_of_a_model_with_value_embeddings_are_its_attention_weights():
    model = tiny_model(VOCAB, BLOCK, value_embeds=1)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    block = model.transformer.h[0]
    weights = block.attn.weights(block.ln_1(model.transformer.wte(ids)))  # (B, H, T, T)
    assert weights.shape == (1, 2, 12, 12)
    assert torch.allclose(weights.sum(-1), torch.ones(1, 2, 12)) and (weights.triu(1) == 0).all()
