"""Batched generation: prompts of different lengths in one call give what each gives alone."""

import pytest
import torch

from model import generate, left_pad
from tests.conftest import tiny_model

VOCAB = 50
BLOCK = 16
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]


def run(model, prompts, new_tokens, **kwargs) -> list[list[int]]:
    batch, pad = left_pad(prompts)
    steps = list(generate(model, batch, new_tokens, pad=pad, **kwargs))
    return torch.stack(steps, dim=1).tolist()


def test_left_pad_right_aligns_rows_and_reports_the_padding():
    batch, pad = left_pad([[1, 2], [3, 4, 5, 6], [7]])
    assert batch.tolist() == [[0, 0, 1, 2], [3, 4, 5, 6], [0, 0, 0, 7]]
    assert pad == [2, 0, 3]


@pytest.mark.parametrize("cache", ["none", "written-slots", "static"])
def test_padded_rows_give_the_logits_of_the_row_alone(cache):
    model = tiny_model(VOCAB, BLOCK)
    batch, pad = left_pad(PROMPTS)
    kv_cache = None if cache == "none" else model.new_cache(len(PROMPTS), static=cache == "static")
    logits, _ = model(batch, cache=kv_cache, pad=torch.tensor(pad))
    if kv_cache is not None:  # and one more token through the cache
        next_logits, _ = model(torch.full((len(PROMPTS), 1), 3), cache=kv_cache, pad=torch.tensor(pad))
        logits = torch.cat([logits, next_logits], dim=1)
    for row, ids in enumerate(PROMPTS):
        alone, _ = model(torch.tensor([ids + [3]]))
        torch.testing.assert_close(logits[row, pad[row] :], alone[0, : logits.size(1) - pad[row]], rtol=0, atol=1e-5)


@pytest.mark.parametrize("use_cache", [True, False])
def test_each_prompt_in_a_batch_is_generated_greedily_as_if_alone(use_cache):
    model = tiny_model(VOCAB, BLOCK)
    new_tokens = 3 * BLOCK  # every row's context slides, each at its own step
    together = run(model, PROMPTS, new_tokens, temperature=0, use_cache=use_cache)
    for row, ids in enumerate(PROMPTS):
        assert together[row] == run(model, [ids], new_tokens, temperature=0)[0]


def test_each_sampled_row_matches_sampling_it_alone_with_its_generator():
    model = tiny_model(VOCAB, BLOCK)

    def generators(seeds):
        return [torch.Generator().manual_seed(seed) for seed in seeds]

    together = run(model, PROMPTS, 40, temperature=1.0, top_k=20, generators=generators([10, 11, 12]))
    for row, ids in enumerate(PROMPTS):
        alone = run(model, [ids], 40, temperature=1.0, top_k=20, generators=generators([10 + row]))[0]
        assert together[row] == alone
    assert together[0] != run(model, [PROMPTS[0]], 40, temperature=1.0, top_k=20, generators=generators([99]))[0]


def test_each_padded_row_stops_at_its_own_end_token():
    model = tiny_model(VOCAB, BLOCK)
    greedy = run(model, PROMPTS, 12, temperature=0)
    stop = greedy[1][4]  # the fifth token of the second row; other rows may meet it earlier or never
    stopped = run(model, PROMPTS, 12, temperature=0, stop_token=stop)
    for row, tokens in enumerate(stopped):
        first = greedy[row].index(stop) if stop in greedy[row] else len(greedy[row])
        assert tokens[: first + 1] == greedy[row][: first + 1]
        assert all(token == stop for token in tokens[first + 1 :])
    # generation ends at the step where the last row stops
    assert len(stopped[0]) == max((row.index(stop) + 1 if stop in row else 12) for row in greedy)


@pytest.mark.parametrize("temperature", [1e-45, 1e-300])
def test_a_temperature_too_small_for_float32_samples_the_most_likely_token(temperature):
    model = tiny_model(VOCAB, BLOCK)
    generators = [torch.Generator().manual_seed(row) for row in range(len(PROMPTS))]
    sampled = run(model, PROMPTS, 8, temperature=temperature, generators=generators)
    assert sampled == run(model, PROMPTS, 8, temperature=0)


def test_a_prompt_row_without_tokens_is_rejected():
    model = tiny_model(VOCAB, BLOCK)
    with pytest.raises(ValueError, match="prompt row 1 has 0 tokens"):
        next(generate(model, torch.zeros(2, 3, dtype=torch.long), 4, pad=[0, 3]))


@pytest.mark.slow
@torch._dynamo.config.patch(error_on_recompile=True)  # restored afterwards (monkeypatch's undo hides the key)
def test_compiled_one_token_step_gives_the_eager_tokens_without_recompiling():
    torch._dynamo.reset()
    model = tiny_model(VOCAB, BLOCK)
    eager = run(model, PROMPTS, 2 * BLOCK, temperature=0)
    compiled = run(model, PROMPTS, 2 * BLOCK, temperature=0, compile=True)
    assert compiled == eager
    # other prompt lengths and sample lengths, the same batch size: the compiled step is reused
    other_prompts = [[1, 2], [3], [4, 5, 6, 7]]
    assert run(model, other_prompts, 5, temperature=0, compile=True) == run(model, other_prompts, 5, temperature=0)
