"""Positions that restart at each document (attn_document_positions): with document masking, a
document packed after others in a row is computed exactly as if it opened the row, and sampling
follows the restarts, end-of-text tokens in the prompt or sampled included. The cache and
batching tests of every pattern (tests/test_pattern_decoding.py) cover it too."""

import pytest
import torch

from data.tokenizer import GPT2Tokenizer
from errors import ConfigError, UserError
from interop.pretrained import export_model
from model import generate, left_pad
from model.kv_cache import RollingKVCache
from model.masks import document_positions
from tests.conftest import tiny_model
from tests.test_masks import EOT, PATTERNS
from tests.test_pattern_decoding import decode_with_cache, tokens
from trainer.config import load_config

VOCAB = 50
BLOCK = 32
RESTARTING = PATTERNS["documents+positions"]
NEW_TOKENS = 24


def test_positions_count_from_the_start_of_each_document():
    idx = torch.tensor([[0, 0, 3, EOT, 4, 5, EOT, EOT, 6]])  # two tokens of left padding
    row_positions = torch.arange(9)[None] - 2
    positions, start = document_positions(idx, EOT, row_positions)
    assert positions.tolist() == [[-2, -1, 0, 0, 1, 2, 0, 0, 1]]  # padding keeps its negative positions
    # fed in pieces, each carrying on from the document the previous one left open
    pieces, start = [], None
    for first in range(0, 9, 2):
        piece, start = document_positions(idx[:, first : first + 2], EOT, row_positions[:, first : first + 2], start)
        pieces.append(piece)
    assert torch.equal(torch.cat(pieces, dim=1), positions)


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("window", [0, 4])
def test_a_document_packed_after_others_gives_the_logits_it_has_alone(pos_emb, window):
    document = torch.tensor([EOT, 11, 12, 13, 14, 15, 16, 17])
    before = [torch.tensor([20, 21, 22]), torch.tensor([30, EOT, 31, 32, 33, EOT, 34, 35, 36, 37, 38])]
    model = tiny_model(VOCAB, BLOCK, pos_emb=pos_emb, attn_window=window, **RESTARTING)
    alone, _ = model(document[None])
    for others in before:
        packed, _ = model(torch.cat([others, document])[None])
        torch.testing.assert_close(packed[0, len(others) :], alone[0], rtol=0, atol=1e-5)
    if pos_emb == "learned":  # counted from the row's start, the learned positions differ
        model = tiny_model(VOCAB, BLOCK, attn_window=window, **PATTERNS["documents"])
        packed, _ = model(torch.cat([before[1], document])[None])
        assert (packed[0, len(before[1]) :] - model(document[None])[0][0]).abs().max() > 1e-3


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_a_rolling_window_cache_follows_the_restarts_after_it_wraps(pos_emb):
    model = tiny_model(VOCAB, BLOCK, pos_emb=pos_emb, attn_window=4, **RESTARTING)
    idx = tokens(2, BLOCK)  # end-of-text tokens in the prompt and after it
    assert isinstance(model.new_cache(2), RollingKVCache)
    full, _ = model(idx)
    torch.testing.assert_close(decode_with_cache(model, idx, prompt_len=8), full, rtol=0, atol=1e-5)


def sample(model, prompts: list[list[int]], use_cache: bool) -> list[list[int]]:
    """Tokens sampled from ids below EOT + 1 (so the end-of-text token comes up), one generator per row."""
    batch, pad = left_pad(prompts)
    generators = [torch.Generator().manual_seed(row) for row in range(len(prompts))]
    steps = generate(model, batch, NEW_TOKENS, pad=pad, vocab_size=EOT + 1, generators=generators, use_cache=use_cache)
    return torch.stack(list(steps), dim=1).tolist()


def test_sampling_restarts_positions_after_each_end_of_text_with_and_without_the_cache():
    model = tiny_model(VOCAB, BLOCK, **RESTARTING)
    prompts = [[5, EOT, 6, 1], [1, 2, 3, 4, 5, 6], [EOT, 2]]
    together = sample(model, prompts, use_cache=True)
    assert all(EOT in row for row in together)  # each row samples documents of its own
    assert together == sample(model, prompts, use_cache=False)
    for row, ids in enumerate(prompts):
        generators = [torch.Generator().manual_seed(row)]  # the row's own, as in the batch
        alone = generate(model, torch.tensor([ids]), NEW_TOKENS, vocab_size=EOT + 1, generators=generators)
        assert torch.cat(list(alone)).tolist() == together[row]


def test_restarting_positions_without_document_masking_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"model.attn_document_positions=true restarts positions at each document, but "
        r"attn_documents=false marks no documents \(set attn_documents=true as well",
    ):
        load_config(None, ["--model.attn_document_positions"])


def test_export_to_gpt2_refuses_restarting_positions(tmp_path):
    model = tiny_model(VOCAB, BLOCK, **RESTARTING)
    with pytest.raises(UserError, match="model.attn_documents=true is computed by no Hugging Face family"):
        export_model(model, GPT2Tokenizer(), tmp_path / "exported")
    assert not (tmp_path / "exported").exists()
