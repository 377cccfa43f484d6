"""Attention patterns: the mask each rule gives equals a definition written out here by hand, and
the model built with each pattern sees exactly what the pattern promises."""

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention

from errors import ConfigError
from model import GPTConfig
from model.attention import attention, flex_block_mask
from model.masks import dense_mask, document_ids, is_plain_causal, pattern_rule
from tests.conftest import tiny_model
from trainer.config import load_config

VOCAB = 50
EOT = 7  # the document separator in these tests

PATTERNS = {
    "causal": {},
    "window": {"attn_window": 3},
    "window+sinks": {"attn_window": 3, "attn_sinks": 2},
    "prefix-lm": {"attn_prefix_lm": True},
    "block": {"attn_block": 4},
    "documents": {"attn_documents": True, "eot_token": EOT},
    "documents+window": {"attn_documents": True, "eot_token": EOT, "attn_window": 4},
    # the mask of documents; positions restart at each document, which the cache must follow too
    "documents+positions": {"attn_documents": True, "eot_token": EOT, "attn_document_positions": True},
}


def allowed_by_hand(pattern: dict, tokens: list[int], prefix: int, q: int, k: int) -> bool:
    """Whether position q of a row (tokens, without padding) may attend to position k, from the
    patterns' definitions."""
    window, sinks, block = pattern.get("attn_window", 0), pattern.get("attn_sinks", 0), pattern.get("attn_block", 0)
    if block:
        return k < (q // block + 1) * block  # up to the end of q's own block
    if pattern.get("attn_prefix_lm") and q < prefix and k < prefix:
        return True
    if k > q:
        return False
    if sinks and k < sinks:
        return True
    if window and q - k >= window:
        return False
    if pattern.get("attn_documents") and EOT in tokens[k + 1 : q + 1]:
        return False  # a document starts after k, at or before q
    return True


def mask_by_hand(pattern: dict, idx: torch.Tensor, pad: list[int], prefix: list[int]) -> torch.Tensor:
    B, T = idx.shape
    mask = torch.zeros(B, 1, T, T, dtype=torch.bool)
    for b in range(B):
        tokens = idx[b, pad[b] :].tolist()
        for i in range(T):
            for j in range(T):
                if i < pad[b]:
                    mask[b, 0, i, j] = i == j  # a padding query sees only itself
                elif j >= pad[b]:
                    mask[b, 0, i, j] = allowed_by_hand(pattern, tokens, prefix[b], i - pad[b], j - pad[b])
    return mask


def model_mask(model, idx: torch.Tensor, pad: list[int] | None, prefix: list[int] | None) -> torch.Tensor:
    T = idx.size(1)
    slots = torch.arange(T)
    pad_tensor = None if pad is None else torch.tensor(pad)
    positions = slots[None] if pad is None else slots[None] - pad_tensor[:, None]
    prefix_tensor = None if prefix is None else torch.tensor(prefix)
    return model.attention_mask(idx, positions, slots, None, pad_tensor, prefix_tensor)


@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("T", [1, 5, 12, 17])
@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "left-padding"])
def test_mask_from_the_rule_equals_the_hand_written_definition(name, T, padded):
    pattern = PATTERNS[name]
    model = tiny_model(VOCAB, block_size=32, **pattern)
    generator = torch.Generator().manual_seed(T)
    idx = torch.randint(0, 10, (3, T), generator=generator)  # ids below 10: EOT shows up often
    pad = [0, min(2, T - 1), T - 1] if padded else [0, 0, 0]
    prefix = [max(1, (T - p) // 2) for p in pad]
    expected = mask_by_hand(pattern, idx, pad, prefix)
    mask = model_mask(model, idx, pad if padded else None, prefix)
    if mask is None:  # plain causal without padding: attention's fused path, which builds no mask
        assert is_plain_causal(model.config) and not padded
        mask = torch.ones(T, T, dtype=torch.bool).tril().expand(3, 1, T, T)
    assert torch.equal(mask, expected)


def gradients_reaching(model, idx: torch.Tensor, t: int, prefix: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) how much gradient the logits at position t send to each position's token embedding."""
    captured = {}

    def keep_embeddings(module, inputs, output):
        output.retain_grad()
        captured["embeddings"] = output

    handle = model.transformer.wte.register_forward_hook(keep_embeddings)
    logits, _ = model(idx, prefix=prefix)
    logits[:, t].sum().backward()
    handle.remove()
    return captured["embeddings"].grad.abs().sum(-1)


def last_visible(name: str, t: int, prefix: int, T: int) -> int:
    """The last position whose token may influence the logits at t."""
    if name == "prefix-lm" and t < prefix:
        return prefix - 1  # the prefix sees itself both ways
    if name == "block":
        return min(T, (t // 4 + 1) * 4) - 1  # the end of t's block
    return t


@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("t", [0, 3, 6, 13])
def test_tokens_after_what_a_position_may_see_change_nothing_there(name, t):
    T, prefix = 16, 6
    model = tiny_model(VOCAB, block_size=T, **PATTERNS[name])
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, T))
    idx[:, 9] = EOT  # a document boundary for the document patterns
    prefixes = torch.tensor([prefix, prefix])
    edge = last_visible(name, t, prefix, T)
    changed = idx.clone()
    changed[:, edge + 1 :] = (changed[:, edge + 1 :] + 1) % VOCAB
    logits, _ = model(idx, prefix=prefixes)
    changed_logits, _ = model(changed, prefix=prefixes)
    assert torch.equal(logits[:, : t + 1], changed_logits[:, : t + 1])
    grad = gradients_reaching(model, idx, t, prefixes)
    assert torch.all(grad[:, edge + 1 :] == 0)
    assert torch.all(grad[:, t] > 0)
    if edge > t:  # what a position may see ahead of it does reach it
        assert torch.all(grad[:, edge] > 0)


@pytest.mark.parametrize("name", ["documents", "documents+window", "documents+positions"])
def test_nothing_crosses_a_document_boundary(name):
    T = 16
    model = tiny_model(VOCAB, block_size=T, **PATTERNS[name])
    torch.manual_seed(1)
    idx = torch.randint(8, VOCAB, (2, T))
    idx[:, 9] = EOT  # documents: positions 0..8, then 9..15 (the separator opens the second)
    for t in (10, 15):
        grad = gradients_reaching(model, idx, t)
        assert torch.all(grad[:, :9] == 0)
        assert torch.all(grad[:, 9] > 0)
    changed = idx.clone()
    changed[:, :9] = (changed[:, :9] + 1) % VOCAB
    assert torch.equal(model(idx)[0][:, 9:], model(changed)[0][:, 9:])


def test_sinks_see_only_their_own_past():
    """A sink is visible to every later query, so a sink that saw later tokens would hand them to
    every query: its own logits and what it passes on depend on earlier tokens only."""
    T = 16
    model = tiny_model(VOCAB, block_size=T, attn_window=2, attn_sinks=3)
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, T))
    for t in range(3):
        grad = gradients_reaching(model, idx, t)
        assert torch.all(grad[:, t + 1 :] == 0)
    # and the last query, far outside the window, still hears from the first token
    assert torch.all(gradients_reaching(model, idx, T - 1)[:, 0] > 0)
    assert torch.all(gradients_reaching(tiny_model(VOCAB, block_size=T, attn_window=2), idx, T - 1)[:, 0] == 0)


def test_prefix_sees_itself_both_ways():
    T, prefix = 12, 5
    model = tiny_model(VOCAB, block_size=T, attn_prefix_lm=True)
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (1, T))
    grad = gradients_reaching(model, idx, 0, torch.tensor([prefix]))
    assert torch.all(grad[:, :prefix] > 0) and torch.all(grad[:, prefix:] == 0)
    # without a prefix the same model is causal
    assert torch.all(gradients_reaching(model, idx, 0)[:, 1:] == 0)


def test_plain_causal_patterns_need_no_mask():
    assert is_plain_causal(GPTConfig())
    assert is_plain_causal(GPTConfig(attn_sinks=4))  # sinks alone: causal queries see the first tokens anyway
    assert not is_plain_causal(GPTConfig(attn_window=4))


@pytest.mark.parametrize(
    "override,message",
    [
        (["--model.attn_window=-1"], r"model.attn_window=-1 must be 0 \(off\) or a positive number of positions"),
        (["--model.attn_block=-4"], r"model.attn_block=-4 must be 0 \(off\) or a positive number"),
        (["--model.attn_sinks=-1"], r"model.attn_sinks=-1 must be 0 \(off\)"),
        (["--model.attn_sinks=64", "--model.block_size=64"], "model.attn_sinks=64 must be smaller than block_size=64"),
        (["--model.attn_block=8", "--model.block_size=8"], "model.attn_block=8 must be smaller than block_size=8"),
        (
            ["--model.attn_prefix_lm", "--model.attn_block=4"],
            "model.attn_prefix_lm=true cannot be combined with attn_block=4: both let a query see later",
        ),
        (
            ["--model.attn_prefix_lm", "--model.attn_window=4"],
            "attn_prefix_lm=true cannot be combined with attn_window",
        ),
        (["--model.attn_prefix_lm", "--model.attn_documents"], "cannot be combined with attn_documents=true"),
        (["--model.attn_block=4", "--model.attn_window=8"], "attn_block=4 cannot be combined with attn_window=8"),
        (["--model.attn_block=4", "--model.attn_documents"], "attn_block=4 cannot be combined with attn_documents"),
        (["--model.attn_sinks=2", "--model.attn_documents"], "attn_sinks=2 cannot be combined with attn_documents"),
        (
            ["--model.attn_prefix_lm", "--model.attn_sinks=2"],
            "attn_prefix_lm=true cannot be combined with attn_sinks=2",
        ),
        (["--model.attn_block=4", "--model.attn_sinks=2"], "attn_block=4 cannot be combined with attn_sinks=2"),
    ],
)
def test_impossible_patterns_name_the_key_the_value_and_what_is_accepted(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override)


def test_patterns_that_make_sense_together_compose():
    assert load_config(None, ["--model.attn_window=8", "--model.attn_sinks=2"]).model.attn_sinks == 2
    assert load_config(None, ["--model.attn_window=8", "--model.attn_documents"]).model.attn_documents


def test_document_masking_needs_an_end_of_text_token():
    with pytest.raises(ValueError, match="attn_documents=true needs eot_token"):
        tiny_model(VOCAB, attn_documents=True)


def pattern_inputs(name: str, B: int, T: int, device: str = "cpu") -> tuple:
    """A pattern's rule on random rows, and the positions (B, T) of a whole sequence."""
    config = tiny_model(VOCAB, block_size=T, **PATTERNS[name]).config
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 10, (B, T), generator=generator).to(device)
    positions = torch.arange(T, device=device).expand(B, T)
    doc_ids, _ = document_ids(idx, EOT, positions)
    prefix = torch.randint(1, T + 1, (B,), generator=generator).to(device)
    return pattern_rule(config, prefix, doc_ids), positions


@pytest.mark.parametrize("name", PATTERNS)
def test_rule_read_as_a_flex_attention_mask_mod_gives_the_dense_mask(name):
    """FlexAttention evaluates the rule element by element under vmap: the same mask must come out."""
    rule, positions = pattern_inputs(name, B=2, T=40)
    flex_mask = create_mask(lambda b, h, q, k: rule(b, q, k), 2, None, 40, 40, device="cpu")
    assert torch.equal(flex_mask, dense_mask(rule, positions, positions))


def flex_case(name: str, device: str) -> tuple[BlockMask, torch.Tensor, list[torch.Tensor]]:
    """A pattern's FlexAttention BlockMask and SDPA mask over three 128-position blocks (the last one
    partial), as the model builds them, and random queries, keys and values (B, H, T, D)."""
    B, H, T, D = 2, 2, 300, 16
    rule, positions = pattern_inputs(name, B, T, device)
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, T, D, generator=generator).to(device) for _ in range(3))
    return flex_block_mask(rule, B, T, torch.device(device)), dense_mask(rule, positions, positions), [q, k, v]


@pytest.mark.gpu
@pytest.mark.parametrize("name", PATTERNS)
def test_flex_attention_matches_sdpa_with_the_dense_mask(name):
    block_mask, mask, qkv = flex_case(name, "cuda")
    results = []
    for each in (block_mask, mask):
        inputs = [tensor.clone().requires_grad_() for tensor in qkv]
        output = attention(*inputs, mask=each)
        output.square().sum().backward()
        results.append([output, *(tensor.grad for tensor in inputs)])
    for flex, sdpa in zip(*results, strict=True):
        torch.testing.assert_close(flex, sdpa, rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # meant: the reference path
@pytest.mark.parametrize("name", PATTERNS)
def test_flex_attention_forward_on_a_cpu_matches_sdpa_with_the_dense_mask(name):
    """The forward pass only (FlexAttention has no backward on a CPU), uncompiled: fast, but it
    evaluates the mask_mod on every score and never reads the BlockMask's block tables, which the
    next tests check."""
    block_mask, mask, qkv = flex_case(name, "cpu")
    torch.testing.assert_close(flex_attention(*qkv, block_mask=block_mask), attention(*qkv, mask=mask))


def blocks_as_scores(block_mask: BlockMask, num_blocks: torch.Tensor | None, indices: torch.Tensor | None):
    """(B, 1, Tq, Tk) boolean: the scores inside the blocks that num_blocks and indices list per
    row of query blocks (BlockMask's layout); none when num_blocks is None."""
    Tq, Tk = block_mask.seq_lengths
    if num_blocks is None:
        return torch.zeros(block_mask.kv_num_blocks.size(0), 1, Tq, Tk, dtype=torch.bool)
    rows, cols = block_mask.BLOCK_SIZE
    listed = BlockMask.from_kv_blocks(num_blocks, indices, BLOCK_SIZE=block_mask.BLOCK_SIZE).to_dense().bool()
    return listed.repeat_interleave(rows, dim=2).repeat_interleave(cols, dim=3)[:, :, :Tq, :Tk]


@pytest.mark.parametrize("name", PATTERNS)
def test_flex_block_mask_skips_only_blocks_the_rule_blocks_entirely(name):
    """What the block-sparse kernels compute from a BlockMask: every score of a full block (the
    mask_mod is not evaluated there), the mask_mod's scores of a partial block, nothing elsewhere.
    That must be the dense mask: a block wrongly full would leak blocked keys, a block left out
    would drop allowed ones."""
    block_mask, mask, _ = flex_case(name, "cpu")
    partial = blocks_as_scores(block_mask, block_mask.kv_num_blocks, block_mask.kv_indices)
    full = blocks_as_scores(block_mask, block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    B, _, Tq, Tk = mask.shape
    assert not (partial & full).any()
    assert torch.equal(full | (partial & create_mask(block_mask.mask_mod, B, 1, Tq, Tk, device="cpu")), mask)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["causal", "documents+window"])  # full blocks; blocks that differ by row
def test_compiled_flex_attention_on_a_cpu_matches_sdpa_with_the_dense_mask(name):
    """The model's compiled FlexAttention, which skips blocks by the block tables (CPU kernels: the
    closest a machine without a GPU comes to the CUDA path); compiling takes seconds per pattern."""
    block_mask, mask, qkv = flex_case(name, "cpu")
    torch.testing.assert_close(attention(*qkv, mask=block_mask), attention(*qkv, mask=mask))
