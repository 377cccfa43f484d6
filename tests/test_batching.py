"""Continuous batching (inference/batching.py): sequences that join and leave a batch at any step each
draw the tokens `generate` draws for them alone, whatever the model's switches and pattern."""

import pytest
import torch

from inference.batching import BatchDecoder, Sequence
from inference.decode_step import DecodeStep
from inference.packed_linear import pack_linears, packing_unavailable
from model import generate
from tests.conftest import tiny_model

CPU = torch.device("cpu")
VOCAB = 50
BLOCK = 16
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42, 17], [9] * 15, [3, 1, 4, 0, 5, 9, 2, 6]]
SWITCHES = {
    "plain": {},
    "rope-gqa-swiglu": {"pos_emb": "rope", "n_kv_head": 1, "mlp": "swiglu", "qk_norm": True},
    "rolling-window": {"attn_window": 4, "attn_sinks": 1},
    "window": {"attn_window": 12},
    "prefix-lm": {"attn_prefix_lm": True},
    "documents": {"attn_documents": True, "attn_document_positions": True, "eot_token": 0},
    "speedrun": {"smear_gate": True, "bigram_embed": 97, "value_embeds": 1, "unet_skips": True, "backout": True},
    "block-causal": {"attn_block": 2},
}


def switched_model(switches: dict) -> torch.nn.Module:
    """A tiny model whose every weight is drawn at random, so that the switches that start as nothing
    (a closed smear gate, a zero bigram table) do something."""
    model = tiny_model(VOCAB, BLOCK, **switches)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def alone(model, prompt, max_tokens, seed=None, **sampling) -> list[int]:
    generators = None if seed is None else [torch.Generator().manual_seed(seed)]
    steps = generate(model, torch.tensor([prompt]), max_tokens, generators=generators, **sampling)
    return [int(tokens[0]) for tokens in steps]


def sequence(prompt, max_tokens, seed=None, stop=None, **sampling) -> tuple[Sequence, list[int]]:
    """A sequence that ends at max_tokens or at its stop token, and the list its tokens go to."""
    drawn = []

    def accept(token: int) -> bool:
        drawn.append(token)
        return len(drawn) == max_tokens or token == stop

    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return Sequence(prompt, accept, max_tokens, generator=generator, **sampling), drawn


def run(decoder: BatchDecoder, arrivals: dict[int, list[Sequence]]) -> int:
    """Step the decoder until it is idle, adding each step's arrivals before it; returns the steps."""
    steps = 0
    while decoder.busy or any(step >= steps for step in arrivals):
        for arrival in arrivals.get(steps, []):
            decoder.add(arrival)
        decoder.step()
        steps += 1
    return steps


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
def test_rows_joining_and_leaving_draw_what_each_draws_alone(switches):
    model = switched_model(switches)
    lengths = [40, 7, 25, 3, 33]  # past block_size: contexts slide, each at its own step
    pairs = [sequence(prompt, n, temperature=0) for prompt, n in zip(PROMPTS, lengths, strict=True)]
    arrivals = {0: [pairs[0][0]], 2: [pairs[1][0], pairs[2][0]], 5: [pairs[3][0]], 9: [pairs[4][0]]}
    run(BatchDecoder(model, VOCAB, max_rows=4), arrivals)
    for (prompt, n), (_, drawn) in zip(zip(PROMPTS, lengths, strict=True), pairs, strict=True):
        assert drawn == alone(model, prompt, n, temperature=0)


def test_sampled_rows_draw_from_their_own_generators_as_alone():
    model = switched_model({"pos_emb": "rope"})
    sampling = {"temperature": 0.9, "top_k": 20, "top_p": 0.9}
    pairs = [sequence(prompt, 30, seed=100 + i, **sampling) for i, prompt in enumerate(PROMPTS)]
    run(BatchDecoder(model, VOCAB, max_rows=3), {i: [s] for i, (s, _) in enumerate(pairs)})
    for i, (prompt, (_, drawn)) in enumerate(zip(PROMPTS, pairs, strict=True)):
        assert drawn == alone(model, prompt, 30, seed=100 + i, **sampling)
    assert pairs[0][1] != alone(model, PROMPTS[0], 30, seed=99, **sampling)


def test_a_row_ends_at_its_own_stop_and_the_others_go_on():
    model = switched_model({})
    greedy = alone(model, PROMPTS[1], 20, temperature=0)
    stop = greedy[5]
    first, first_drawn = sequence(PROMPTS[1], 20, stop=stop, temperature=0)
    second, second_drawn = sequence(PROMPTS[0], 20, temperature=0)
    run(BatchDecoder(model, VOCAB, max_rows=2), {0: [first, second]})
    assert first_drawn == greedy[: greedy.index(stop) + 1]
    assert second_drawn == alone(model, PROMPTS[0], 20, temperature=0)


def test_a_cancelled_row_leaves_at_the_next_step_and_frees_its_place():
    model = switched_model({})
    decoder = BatchDecoder(model, VOCAB, max_rows=1)
    first, first_drawn = sequence(PROMPTS[0], 1000, temperature=0)
    waiting, waiting_drawn = sequence(PROMPTS[1], 5, temperature=0)
    decoder.add(first)
    decoder.add(waiting)
    for _ in range(3):
        decoder.step()
    assert len(first_drawn) == 4 and waiting_drawn == []  # one row at a time: the second waits
    first.cancelled = True
    run(decoder, {})
    assert len(first_drawn) == 4 and waiting_drawn == alone(model, PROMPTS[1], 5, temperature=0)
    assert not decoder.rows and decoder.cache.pos == 0


def test_a_lone_row_computes_exactly_what_generate_computes():
    """No padding, no other row: the same products in the same order, so the same logits to the bit."""
    model = switched_model({"pos_emb": "rope"})
    logits_seen = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: logits_seen.append(output[:, -1].clone()))
    alone(model, PROMPTS[1], 20, temperature=0)
    expected, logits_seen[:] = list(logits_seen), []
    run(BatchDecoder(model, VOCAB, max_rows=4), {0: [sequence(PROMPTS[1], 20, temperature=0)[0]]})
    assert len(logits_seen) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(logits_seen, expected, strict=True))


@pytest.mark.skipif(packing_unavailable(CPU, torch.float32) is not None, reason="no packed products here")
@pytest.mark.parametrize("switches", ["plain", "rope-gqa-swiglu", "prefix-lm"])
def test_rows_stepped_by_the_cpus_decoding_step_draw_what_each_draws_alone(switches):
    """serve.py's batches on a CPU: the one-token steps by inference/decode_step.py, over rows that join
    and leave with padding of their own, draw each row's greedy tokens of sample.py's lone decoding."""
    model = pack_linears(switched_model(SWITCHES[switches]))
    step = DecodeStep(model)
    expected = [alone(model, prompt, 12, temperature=0) for prompt in PROMPTS]
    made = [sequence(prompt, 12, temperature=0) for prompt in PROMPTS]
    calls = []
    counted = lambda *args, **kwargs: calls.append(1) or step(*args, **kwargs)  # noqa: E731
    run(
        BatchDecoder(model, VOCAB, max_rows=3, one_token_step=counted),
        {0: [s for s, _ in made[:3]], 4: [s for s, _ in made[3:]]},
    )
    assert [drawn for _, drawn in made] == expected
    assert calls  # the batch's steps went through the decoding step
