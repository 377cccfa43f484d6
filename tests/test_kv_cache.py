import pytest
import torch

from model import GPTConfig, KVCache, generate
from model.generate import slide_context
from tests.conftest import tiny_model

VOCAB = 50
BLOCK = 32


def decode_with_cache(model, idx: torch.Tensor, prompt_len: int, static: bool = False) -> torch.Tensor:
    """Logits for every position of idx: the prompt in one forward pass, then one token at a time."""
    cache = model.new_cache(idx.size(0), static=static)
    pieces = [model(idx[:, :prompt_len], cache=cache)[0]]
    for t in range(prompt_len, idx.size(1)):
        pieces.append(model(idx[:, t : t + 1], cache=cache)[0])
    return torch.cat(pieces, dim=1)


# heads of their own width (2 heads over n_embd = 32, so 16 unless head_dim is set), with the
# rotation and key/value heads that such models (Qwen3-0.6B) have
HEAD_WIDTHS = {
    "gpt2": {},
    "wide-heads": {"head_dim": 24, "pos_emb": "rope", "n_kv_head": 1},
    "narrow-heads": {"head_dim": 6},
    # the stretched rotations of Llama 3.1/3.2 and YaRN (model/rope.py), over a pretrained context of 8 positions
    "llama3-rope": {"pos_emb": "rope", "rope_scaling": "llama3", "rope_factor": 8.0, "rope_original_context": 8},
    "yarn-rope": {
        "pos_emb": "rope",
        "n_kv_head": 1,
        "rope_scaling": "yarn",
        "rope_factor": 4.0,
        "rope_original_context": 8,
    },
}


@pytest.mark.parametrize("heads", HEAD_WIDTHS.values(), ids=HEAD_WIDTHS.keys())
@pytest.mark.parametrize("static", [False, True], ids=["written-slots", "static"])
@pytest.mark.parametrize("prompt_len", [1, 2, 7, 31, 32])
def test_cached_decoding_reproduces_full_forward_logits(prompt_len, static, heads):
    model = tiny_model(VOCAB, BLOCK, **heads)
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (3, BLOCK))
    full, _ = model(idx)
    cached = decode_with_cache(model, idx, prompt_len, static)
    assert (cached - full).abs().max().item() < 1e-5


def test_cache_advances_once_per_forward_call():
    model = tiny_model(VOCAB, BLOCK)
    cache = model.new_cache(1)
    model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
    assert cache.pos == 5
    model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    assert cache.pos == 6


def test_writing_past_the_end_of_the_cache_states_the_limit():
    cache = KVCache(n_layer=1, batch_size=1, n_head=2, head_dim=4, max_len=8)
    cache.claim(6)
    with pytest.raises(ValueError, match="holds 8 positions.*needs 9"):
        cache.claim(3)
    model = tiny_model(VOCAB, BLOCK)
    cache = model.new_cache(1, max_len=4)
    model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="holds 4 positions; writing 2 tokens at position 3 needs 5"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache)


def test_model_refuses_positions_past_block_size():
    model = tiny_model(VOCAB, block_size=8)
    with pytest.raises(ValueError, match="block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    cache = model.new_cache(1)
    model(torch.zeros(1, 8, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="holds 8 positions; writing 1 tokens at position 8 needs 9"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="cache of 9 positions exceeds the model's block_size=8"):
        model.new_cache(1, max_len=9)


@pytest.mark.parametrize("new_tokens", [10, 3 * BLOCK])  # the second slides the context twice
def test_greedy_generation_is_identical_with_and_without_the_cache(new_tokens):
    model = tiny_model(VOCAB, BLOCK)
    torch.manual_seed(1)
    prompt = torch.randint(0, VOCAB, (2, 5))
    with_cache = torch.stack(list(generate(model, prompt, new_tokens, temperature=0)), dim=1)
    without = torch.stack(list(generate(model, prompt, new_tokens, temperature=0, use_cache=False)), dim=1)
    assert with_cache.shape == (2, new_tokens)
    assert torch.equal(with_cache, without)


def test_greedy_generation_follows_the_full_forward_argmax():
    model = tiny_model(VOCAB, BLOCK)
    torch.manual_seed(1)
    sequence = torch.randint(0, VOCAB, (1, 4))
    for token in generate(model, sequence.clone(), 12, temperature=0):
        expected = model(sequence)[0][:, -1].argmax(-1)
        assert torch.equal(token, expected)
        sequence = torch.cat([sequence, token[:, None]], dim=1)


def test_context_slides_to_the_last_half_block_when_full():
    # within the block nothing moves
    assert slide_context(0, BLOCK, BLOCK) == 0
    # one token past it, the context restarts with the last BLOCK // 2 tokens
    assert slide_context(0, BLOCK + 1, BLOCK) == BLOCK + 1 - BLOCK // 2
    start = BLOCK + 1 - BLOCK // 2
    # and it holds until the window is full again
    assert slide_context(start, start + BLOCK, BLOCK) == start
    assert slide_context(start, start + BLOCK + 1, BLOCK) == start + BLOCK + 1 - BLOCK // 2


def test_generation_past_block_size_sees_the_documented_context():
    model = tiny_model(VOCAB, block_size=8)
    torch.manual_seed(1)
    prompt = torch.randint(0, VOCAB, (1, 3))
    tokens = prompt[0].tolist()
    start = 0
    for token in generate(model, prompt, 30, temperature=0):
        start = slide_context(start, len(tokens), 8)
        window = torch.tensor([tokens[start:]])
        assert window.size(1) <= 8 and (start == 0 or window.size(1) >= 4)
        assert token.item() == model(window)[0][0, -1].argmax().item()
        tokens.append(token.item())


class ScriptedModel:
    """Stands in for a GPT: row b predicts script[b][n] as its n-th new token, whatever it is shown."""

    def __init__(self, script: list[list[int]], prompt_len: int, block_size: int = BLOCK):
        self.script = torch.tensor(script)
        self.prompt_len = prompt_len
        self.config = GPTConfig(block_size=block_size)

    def __call__(self, context: torch.Tensor, cache=None, pad=None, prefix=None, logits_to_keep=0):
        step = context.size(1) - self.prompt_len  # without a cache, the context is the whole sequence
        logits = torch.zeros(context.size(0), 1, VOCAB)
        logits[torch.arange(context.size(0)), 0, self.script[:, step]] = 1.0
        return logits, None


def test_stop_token_finishes_each_row_on_its_own():
    STOP = 7
    script = [
        [1, 2, STOP, 3, 4, 5, 6, 8],  # row 0 stops at its third token
        [1, 2, 3, 4, STOP, 5, 6, 8],  # row 1 at its fifth
    ]
    model = ScriptedModel(script, prompt_len=2)
    prompt = torch.zeros(2, 2, dtype=torch.long)
    tokens = torch.stack(list(generate(model, prompt, 8, temperature=0, stop_token=STOP, use_cache=False)), dim=1)
    assert tokens.tolist() == [
        [1, 2, STOP, STOP, STOP],  # a finished row repeats the stop token
        [1, 2, 3, 4, STOP],  # generation ends once every row has stopped
    ]
    without_stop = torch.stack(list(generate(model, prompt, 8, temperature=0, use_cache=False)), dim=1)
    assert without_stop.tolist() == script


def test_chunks_after_a_cached_prefix_match_the_full_forward_pass():
    """Several new tokens at once after a prefix take the explicit-mask path of attention."""
    model = tiny_model(VOCAB, BLOCK)
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, BLOCK))
    full, _ = model(idx)
    cache = model.new_cache(2)
    pieces = [model(idx[:, start : start + 5], cache=cache)[0] for start in range(0, BLOCK, 5)]
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < 1e-5


def test_generation_never_samples_padded_vocabulary_ids():
    model = tiny_model(VOCAB, BLOCK)
    with torch.no_grad():
        model.lm_head.weight[40:] = 5.0  # make the padding ids the most likely by far
    prompt = torch.zeros(1, 2, dtype=torch.long)
    generators = [torch.Generator().manual_seed(0)]
    tokens = torch.cat(list(generate(model, prompt, 30, temperature=1.0, vocab_size=40, generators=generators)))
    assert tokens.max().item() < 40
