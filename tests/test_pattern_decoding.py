"""Sampling with every attention pattern: cached decoding equals the full forward pass, the rolling
cache of a sliding window stays exact after it wraps, and batched rows are generated as if alone."""

import pytest
import torch

from data.tokenizer import GPT2Tokenizer
from errors import UserError
from interop.pretrained import export_model
from model import generate, left_pad
from model.kv_cache import RollingKVCache
from tests.conftest import tiny_model
from tests.test_masks import EOT
from tests.test_masks import PATTERNS as MASK_PATTERNS

VOCAB = 50
BLOCK = 32
PATTERNS = {name: pattern for name, pattern in MASK_PATTERNS.items() if pattern}  # all but plain causal


def tokens(rows: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (rows, length), generator=generator)
    idx[:, [p for p in (2, 13, 14, 22) if p < length]] = EOT  # document boundaries, two of them adjacent
    return idx


def decode_with_cache(model, idx, prompt_len, chunk=1, static=False, prefix=None):
    """Logits for every position of idx: the prompt in one pass, then `chunk` tokens per call."""
    cache = model.new_cache(idx.size(0), static=static)
    pieces = [model(idx[:, :prompt_len], cache=cache, prefix=prefix)[0]]
    for start in range(prompt_len, idx.size(1), chunk):
        pieces.append(model(idx[:, start : start + chunk], cache=cache, prefix=prefix)[0])
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("prompt_len", [4, 20])  # 20: longer than the window, the ring has wrapped
@pytest.mark.parametrize("static", [False, True], ids=["written-slots", "static"])
def test_cached_decoding_reproduces_full_forward_logits(name, prompt_len, static):
    model = tiny_model(VOCAB, BLOCK, **PATTERNS[name])
    idx = tokens(3, BLOCK)
    prefix = torch.tensor([prompt_len] * 3) if name == "prefix-lm" else None  # the prompt is the prefix
    chunk = 4 if name == "block" else 1  # a block-causal cache takes whole blocks
    full, _ = model(idx, prefix=prefix)
    cached = decode_with_cache(model, idx, prompt_len, chunk, static, prefix)
    assert (cached - full).abs().max().item() < 1e-5


def test_sliding_window_cache_is_bounded_by_the_window_and_keeps_the_sinks():
    model = tiny_model(VOCAB, BLOCK, attn_window=6, attn_sinks=2)
    cache = model.new_cache(2)
    assert isinstance(cache, RollingKVCache)
    assert cache.k[0].shape[2] == 6 + 2 + 1  # window, sinks and one scratch slot, for 32 positions
    idx = tokens(2, BLOCK)
    for t in range(BLOCK):
        model(idx[:, t : t + 1], cache=cache)
    assert sorted(cache.positions[0, :8].tolist()) == [0, 1, *range(BLOCK - 6, BLOCK)]
    assert tiny_model(VOCAB, BLOCK).new_cache(2).k[0].shape[2] == BLOCK


@pytest.mark.parametrize("name", PATTERNS)
def test_padded_prompts_give_the_logits_of_each_row_alone(name):
    model = tiny_model(VOCAB, BLOCK, **PATTERNS[name])
    prompts = [tokens(1, 9, seed=2)[0].tolist(), tokens(1, 16, seed=3)[0].tolist(), tokens(1, 4, seed=4)[0].tolist()]
    batch, pad = left_pad(prompts)
    lengths = torch.tensor([len(ids) for ids in prompts])
    prefix = lengths if name == "prefix-lm" else None
    cache = model.new_cache(3)
    logits, _ = model(batch, cache=cache, pad=torch.tensor(pad), prefix=prefix)
    for row, ids in enumerate(prompts):
        alone, _ = model(torch.tensor([ids]), prefix=None if prefix is None else prefix[row : row + 1])
        torch.testing.assert_close(logits[row, pad[row] :], alone[0], rtol=0, atol=1e-5)


def run(model, prompts, new_tokens, **kwargs) -> list[list[int]]:
    batch, pad = left_pad(prompts)
    return torch.stack(list(generate(model, batch, new_tokens, pad=pad, **kwargs)), dim=1).tolist()


@pytest.mark.parametrize("name", PATTERNS)
def test_batched_rows_are_generated_as_if_alone_with_and_without_the_cache(name):
    model = tiny_model(VOCAB, BLOCK, **PATTERNS[name])
    prompts = [[5, 6, 7, EOT, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42, 43, 44, 45]]
    new_tokens = BLOCK  # every row's context slides
    together = run(model, prompts, new_tokens, temperature=0)
    assert together == run(model, prompts, new_tokens, temperature=0, use_cache=False)
    for row, ids in enumerate(prompts):
        assert together[row] == run(model, [ids], new_tokens, temperature=0)[0]


def test_block_causal_sampling_takes_each_token_from_the_block_before():
    K = 4
    model = tiny_model(VOCAB, BLOCK, attn_block=K)
    sequence = [3, 1, 4, 1, 5, 9]
    for token in generate(model, torch.tensor([sequence]), 12, temperature=0):
        n = len(sequence)
        complete = n // K * K  # the tokens in complete blocks: the last of them predicts position n
        logits, _ = model(torch.tensor([sequence[:complete]]))
        assert token.item() == logits[0, n - K].argmax().item()
        sequence.append(token.item())


def test_block_causal_prompt_shorter_than_a_block_is_refused():
    model = tiny_model(VOCAB, BLOCK, attn_block=4)
    with pytest.raises(ValueError, match="prompt row 0 has 3 tokens: a block-causal model"):
        next(generate(model, torch.tensor([[1, 2, 3]]), 2))


def test_prefix_lm_prompt_is_read_both_ways():
    """The first prompt token's representation depends on the last one: the prompt is the prefix."""
    model = tiny_model(VOCAB, BLOCK, attn_prefix_lm=True)
    prompt = torch.tensor([[1, 2, 3, 4]])
    changed = torch.tensor([[1, 2, 3, 5]])
    first = [next(generate(model, p, 1, temperature=0)).item() for p in (prompt, changed)]
    logits = [model(p, prefix=torch.tensor([4]))[0][0, 0] for p in (prompt, changed)]
    assert not torch.allclose(logits[0], logits[1])
    assert first[0] == model(prompt, prefix=torch.tensor([4]))[0][0, -1].argmax().item()


@pytest.mark.parametrize("pattern", [{"attn_window": 4}, {"attn_sinks": 2}, {"attn_prefix_lm": True}])
def test_export_refuses_an_attention_pattern_no_family_computes(pattern, tmp_path):
    with pytest.raises(UserError, match=f"^--export cannot write this model: model.{next(iter(pattern))}="):
        export_model(tiny_model(VOCAB, BLOCK, **pattern), GPT2Tokenizer(), tmp_path / "exported")
    assert not (tmp_path / "exported").exists()


@pytest.mark.parametrize("name", PATTERNS)
def test_patterns_stay_exact_with_rotary_positions_and_shared_key_heads(name):
    """The rolling cache, the document table and the prefix hold rotated keys of fewer heads just as well."""
    model = tiny_model(VOCAB, BLOCK, pos_emb="rope", n_kv_head=1, **PATTERNS[name])
    idx = tokens(2, BLOCK)
    prefix = torch.tensor([20, 20]) if name == "prefix-lm" else None
    full, _ = model(idx, prefix=prefix)
    cached = decode_with_cache(model, idx, 20, 4 if name == "block" else 1, prefix=prefix)
    assert (cached - full).abs().max().item() < 1e-5
