"""The switches that read neighbouring tokens (smear_gate, bigram_embed, mtp_tokens): each trains,
starts as the plain model computes, never reads a later token nor the document before, decodes
through every cache (left padding and documents included) as the full forward pass does, resumes
exactly, and is refused by name where no family computes it."""

import pytest
import torch
import torch.nn.functional as F

from data.tokenizer import GPT2Tokenizer
from errors import UserError
from interop.pretrained import export_model
from model import GPT, GPTConfig, generate, left_pad
from model.gpt import MultiTokenLoss
from model.switches import BigramTable, SmearGate
from optim.optimizer import build_optimizer
from tests.conftest import tiny_config, tiny_model
from tests.test_masks import EOT
from tests.test_pattern_decoding import decode_with_cache, tokens
from tests.test_trainer import read_metrics, train_losses
from tests.test_variants import test_each_variant_learns_a_batch as learns_a_batch
from trainer.config import idle_keys, load_config
from trainer.loop import Trainer

VOCAB = 50
BLOCK = 32
SWITCHES = {
    "smear": {"smear_gate": True},
    "bigram-exact": {"bigram_embed": VOCAB**2 + 1},
    "bigram-hashed": {"bigram_embed": 97},
    "smear+bigram": {"smear_gate": True, "bigram_embed": 97},
}
TRAINED = SWITCHES | {"mtp": {"mtp_tokens": 2}}
DOCUMENTS = {"attn_documents": True, "eot_token": EOT}
# the caches: the plain one, the documents' bookkeeping, and the rolling one of a sliding window
PATTERNS = {"causal": {}, "documents": DOCUMENTS, "window": {"attn_window": 6, "attn_sinks": 1}}


def randomised(**switches):
    """A tiny model whose zero-initialised parts (the gate's scale and weights, the bigram rows) are
    made random: at zero they add nothing, which would hide a token read from the wrong place."""
    model = tiny_model(VOCAB, BLOCK, **switches)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, SmearGate):
                module.scale.fill_(0.8)
                module.gate.copy_(torch.randn(module.gate.shape, generator=generator))
            if isinstance(module, BigramTable):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.5)
    return model


def test_the_bigram_table_is_exact_where_every_pair_fits_and_hashed_below():
    exact, hashed = (tiny_model(VOCAB, BLOCK, bigram_embed=rows).embed.parts[0] for rows in (10**6, 97))
    assert exact.exact and exact.weight.shape == (VOCAB**2 + 1, 32)
    assert not hashed.exact and hashed.weight.shape == (97, 32)
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # every (previous, current)
    with torch.no_grad():  # each row holds its own number: the table's output says which row was read
        exact.weight.copy_(torch.arange(exact.weight.size(0))[:, None].float())
        hashed.weight.copy_(torch.arange(97)[:, None].float())
    x = torch.zeros(1, len(pairs), 32)
    exact_rows = exact(x, pairs[None, :, 1], pairs[None, :, 0], None)[0, :, 0].long()
    assert sorted(exact_rows.tolist()) == list(range(VOCAB**2))  # one row per pair, the last row spared
    hashed_rows = hashed(x, pairs[None, :, 1], pairs[None, :, 0], None)[0, :, 0].long()
    assert set(hashed_rows.tolist()) == set(range(96))  # every bucket used, the last row spared
    none = torch.full((1, 3), -1)
    assert exact(x[:, :3], none + 1, none, None)[0, :, 0].tolist() == [VOCAB**2] * 3
    assert hashed(x[:, :3], none + 1, none, None)[0, :, 0].tolist() == [96] * 3


@pytest.mark.parametrize("switches", TRAINED.values(), ids=TRAINED.keys())
def test_each_switch_starts_as_the_plain_model_and_learns_a_batch(switches):
    """Zero-initialised, the gate is closed and the table empty: the logits are the plain model's.
    The gate's scale and the table learn from the first step, the gate's weights once the scale has moved."""
    idx = torch.randint(0, VOCAB, (4, BLOCK), generator=torch.Generator().manual_seed(1))
    model = tiny_model(VOCAB, BLOCK, **switches).train()
    assert torch.equal(model(idx)[0], tiny_model(VOCAB, BLOCK).train()(idx)[0])
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    still = [name for name, p in model.embed.named_parameters() if not p.grad.abs().sum() > 0]
    assert still == (["parts.0.gate"] if "smear_gate" in switches else [])
    learns_a_batch(switches)


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
@pytest.mark.parametrize("t", [0, 11])
def test_later_tokens_do_not_change_earlier_logits(switches, t):
    model = randomised(**switches)
    idx = torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, t + 1 :] = (idx[:, t + 1 :] + 1) % VOCAB
    logits, changed_logits = model(idx)[0], model(changed)[0]
    assert torch.equal(logits[:, : t + 1], changed_logits[:, : t + 1])
    assert not torch.allclose(logits[:, t + 1 :], changed_logits[:, t + 1 :])


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
def test_a_document_never_reads_the_one_before(switches):
    """With attn_documents, the second document's logits depend on no token of the first, and
    no gradient of them reaches an embedding looked up for the first document's tokens."""
    model = randomised(**switches, **DOCUMENTS)
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    idx[idx == EOT] = 0
    changed = (idx + 1) % VOCAB
    changed[changed == EOT] = 0
    changed[:, 9:] = idx[:, 9:]
    idx[:, 9] = changed[:, 9] = EOT  # the second document opens at position 9 with its end-of-text token
    assert torch.equal(model(idx)[0][:, 9:], model(changed)[0][:, 9:])
    lookups = []  # each call of the token table: its output (B, T, C) for tokens shifted by the call's order
    model.transformer.wte.register_forward_hook(lambda module, inputs, output: lookups.append(output) or output)
    model.train()  # the gradient the training step follows
    logits, _ = model(idx)
    for output in lookups:
        output.retain_grad()
    logits[:, 9:].sum().backward()
    # the first lookup is each position's own token; the smear gate's second is the token before it
    for shift, output in enumerate(lookups):
        assert torch.all(output.grad[:, : 9 + shift] == 0)
        assert torch.all(output.grad[:, 10:].abs().sum(-1) > 0)


@pytest.mark.parametrize("pattern", PATTERNS.values(), ids=PATTERNS.keys())
@pytest.mark.parametrize("static", [False, True], ids=["written-slots", "static"])
@pytest.mark.parametrize("prompt_len", [1, 13])  # 13: a document opens with the first decoded token
@torch.no_grad()
def test_cached_decoding_reproduces_full_forward_logits(pattern, static, prompt_len):
    """Both switches at once: either one reading a wrong previous token changes the logits."""
    model = randomised(**SWITCHES["smear+bigram"], **pattern)
    idx = tokens(3, 24)  # end-of-text tokens at 2, 13, 14 and 22
    full, _ = model(idx)
    cached = decode_with_cache(model, idx, prompt_len, static=static)
    assert (cached - full).abs().max().item() < 1e-5


@pytest.mark.parametrize("pattern", PATTERNS.values(), ids=PATTERNS.keys())
@torch.no_grad()
def test_padded_prompts_give_the_logits_of_each_row_alone(pattern):
    """The first real token after left padding reads no previous token, in the prompt's pass and
    in the decoding calls after it."""
    model = randomised(**SWITCHES["smear+bigram"], **pattern)
    rows = [tokens(1, n, seed=seed)[0].tolist() for n, seed in ((15, 2), (20, 3), (10, 4))]
    prompts = [ids[:-4] for ids in rows]
    batch, pad = left_pad(prompts)
    cache = model.new_cache(3)
    pieces = [model(batch, cache=cache, pad=torch.tensor(pad))[0]]
    continuations = torch.tensor([ids[-4:] for ids in rows])
    for t in range(4):
        pieces.append(model(continuations[:, t : t + 1], cache=cache, pad=torch.tensor(pad))[0])
    logits = torch.cat(pieces, dim=1)
    for row, ids in enumerate(rows):
        alone, _ = model(torch.tensor([ids]))
        torch.testing.assert_close(logits[row, pad[row] :], alone[0], rtol=0, atol=1e-5)


@torch.no_grad()
def test_sampling_is_the_same_with_and_without_the_cache_and_for_continuations_of_one_prompt():
    model = randomised(smear_gate=True, bigram_embed=97)
    prompts = [tokens(1, 9, seed=2)[0].tolist(), tokens(1, 4, seed=3)[0].tolist()]
    batch, pad = left_pad(prompts)
    kwargs = dict(temperature=0, pad=pad)
    cached = torch.stack(list(generate(model, batch, 12, **kwargs)), dim=1)
    uncached = torch.stack(list(generate(model, batch, 12, use_cache=False, **kwargs)), dim=1)
    assert torch.equal(cached, uncached)
    source = model.new_cache(2)
    model(batch, cache=source, pad=torch.tensor(pad))
    copy = model.new_cache(2)
    copy.copy_rows(source, torch.tensor([1, 1]))  # row 1's prompt twice: its last token goes with it
    assert copy.last_token.tolist() == [[prompts[1][-1]]] * 2


def test_multi_token_loss_is_the_weighted_cross_entropy_of_later_targets_in_training_only():
    model = tiny_model(VOCAB, BLOCK, mtp_tokens=2, mtp_weight=0.5).train()
    idx = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    targets[0, 3:6] = -1  # masked tokens (a chat prompt) stay out of every target
    logits, loss = model(idx, targets)
    expected = 0.0
    for k, weight in enumerate((1.0, 0.5, 0.25)):
        later = F.pad(targets[:, k:], (0, k), value=-1)  # target t + k at position t
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), later.reshape(-1), ignore_index=-1, reduction="sum")
        expected = expected + weight * ce
    torch.testing.assert_close(loss, expected / (targets != -1).sum())
    plain = tiny_model(VOCAB, BLOCK)  # the same weights: evaluation is the next-token loss alone
    model.eval()
    assert torch.equal(model(idx, targets)[1], plain(idx, targets)[1])


def test_multi_token_weights_fade_the_furthest_target_first():
    loss = MultiTokenLoss(tokens=2, weight=0.5)
    expected = {0.0: [1, 0.5, 0.25], 1 / 6: [1, 0.5, 0.125], 1 / 3: [1, 0.5, 0], 0.5: [1, 0.25, 0], 2 / 3: [1, 0, 0]}
    for progress, weights in (expected | {0.9: [1, 0, 0]}).items():
        torch.testing.assert_close(loss.weights_at(progress), torch.tensor(weights, dtype=torch.float32))
    loss.set_progress(0.5)
    assert loss.weights.tolist() == [1, 0.25, 0]


def test_a_run_with_every_switch_resumes_exactly_and_evaluates_the_next_token_loss(tmp_path, data_dir):
    """The multi-token weights follow the step through the learning-rate schedule's length, which the
    run's config holds, so a resumed run (here: one that is lengthened) takes the same ones; the train log
    holds the training objective, the evaluation the next-token loss."""
    common = dict(
        model__smear_gate=True, model__bigram_embed=300, model__mtp_tokens=2, train__max_iters=6, train__eval_interval=3
    )
    whole = Trainer(tiny_config(tmp_path / "whole", data_dir, **common))
    whole.fit()
    last_step = 5 / whole.cfg.optim.lr_decay_iters  # the schedule's length, not the run's, decides
    assert whole.model.loss.weights.tolist() == whole.model.loss.weights_at(last_step).tolist()
    Trainer(tiny_config(tmp_path / "split", data_dir, **common | {"train__max_iters": 3})).fit()
    Trainer(tiny_config(tmp_path / "split", data_dir, **common | {"train__init_from": "resume"})).fit()
    assert train_losses(tmp_path / "split") == train_losses(tmp_path / "whole")
    val = [
        {r["step"]: r["val_loss"] for r in read_metrics(tmp_path / name) if "val_loss" in r}
        for name in ("whole", "split")
    ]
    assert val[0] == val[1] and list(val[0]) == [0, 3, 6]
    state = [torch.load(tmp_path / name / "ckpt.pt", weights_only=True)["model"] for name in ("whole", "split")]
    assert all(torch.equal(state[0][name], state[1][name]) for name in state[0])
    model = whole.model.eval()
    x, y, _ = whole.objective(*whole.batches.next_batch())
    plain = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten())
    torch.testing.assert_close(model(x, y)[1], plain)


def test_gates_and_tables_go_to_adamw_not_muon(tmp_path, data_dir):
    cfg = tiny_config(tmp_path, data_dir, model__smear_gate=True, model__bigram_embed=97, optim__optimizer="muon")
    model = tiny_model(VOCAB, BLOCK, smear_gate=True, bigram_embed=97)
    muon, adamw = build_optimizer(model, cfg.optim, torch.device("cpu")).optimizers
    in_muon = {id(p) for group in muon.param_groups for p in group["params"]}
    decayed, undecayed = ({id(p) for p in group["params"]} for group in adamw.param_groups)
    smear, bigram = model.embed.parts
    assert not in_muon & {id(p) for p in model.embed.parameters()}
    assert id(bigram.weight) in decayed and {id(smear.gate), id(smear.scale)} <= undecayed


@pytest.mark.parametrize("switches", [{"smear_gate": True}, {"bigram_embed": 97}], ids=["smear", "bigram"])
def test_export_refuses_a_model_that_reads_the_previous_token_by_its_key(switches, tmp_path):
    model = tiny_model(GPT2Tokenizer().vocab_size, BLOCK, **switches)
    key = next(iter(switches))
    with pytest.raises(UserError, match=rf"^--export cannot write this model: model\.{key}="):
        export_model(model, GPT2Tokenizer(), tmp_path / "export")
    pytest.importorskip("gguf")
    from interop.gguf import export_gguf

    with pytest.raises(UserError, match=rf"^--export-gguf cannot write this model: model\.{key}="):
        export_gguf(model, GPT2Tokenizer(), tmp_path / "model.gguf", "float32", source=tmp_path)
    assert not any(tmp_path.iterdir())


def test_multi_token_prediction_exports_as_the_plain_model_it_is(tmp_path):
    """It changes only the training loss: the model computes what a plain one does."""
    model = tiny_model(GPT2Tokenizer().vocab_size, BLOCK, mtp_tokens=2)
    assert export_model(model, GPT2Tokenizer(), tmp_path / "export").model_type == "gpt2"


@pytest.mark.parametrize(
    "switches",
    [{"smear_gate": True}, {"bigram_embed": 97}, {"bigram_embed": 10**6}, {"mtp_tokens": 3}],
    ids=["smear", "bigram-hashed", "bigram-exact", "mtp"],
)
def test_config_counts_the_parameters_of_each_switch(switches):
    config = GPTConfig(n_layer=3, n_head=2, n_embd=12, block_size=5, vocab_size=11, **switches)
    assert config.num_params() == GPT(config).num_params(non_embedding=False)


def test_mtp_weight_without_mtp_tokens_is_named_as_idle():
    cfg = load_config(None, ["--model.mtp_weight=0.3"])
    assert "model.mtp_weight=0.3 (only with model.mtp_tokens above 0)" in idle_keys(cfg)


def test_the_bigram_table_is_no_compute_parameter_as_a_lookup_table():
    plain, with_table = tiny_model(VOCAB, BLOCK), tiny_model(VOCAB, BLOCK, bigram_embed=101)
    assert with_table.num_params() == plain.num_params()
    assert with_table.num_params(non_embedding=False) == plain.num_params(non_embedding=False) + 101 * 32
