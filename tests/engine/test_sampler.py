"""The sampler: greedy, top-k/top-p support, per-request seeds, and the sampled distribution."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.engine.sampler import Sampler
from tandem.engine.sampling_params import SamplingParams

PROBS = [0.5, 0.3, 0.1, 0.06, 0.04]
LOGITS = torch.tensor(PROBS).log()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(b: int, v: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, v, generator=gen(seed)) * 3


def draw(params: SamplingParams, n: int, logits: torch.Tensor = LOGITS) -> list[int]:
    """n tokens for the same logits, one seeded request per row."""
    batch = logits.expand(n, -1)
    out = Sampler(seed=0).sample(batch, [params] * n, [gen(i) for i in range(n)])
    return out.tolist()


def chi_square(samples: list[int], expected: list[float]) -> float:
    n = len(samples)
    counts = [samples.count(t) for t in range(len(expected))]
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, expected) if p > 0)


def test_greedy_is_argmax():
    logits = random_logits(6, 50)
    params = [SamplingParams(temperature=0)] * 3 + [SamplingParams(temperature=1e-7)] * 3
    out = Sampler().sample(logits, params, [None] * 6)
    assert out.dtype == torch.long and out.shape == (6,)
    assert out.tolist() == logits.argmax(dim=-1).tolist()


def test_top_k_one_is_greedy_at_any_temperature():
    logits = random_logits(8, 100, seed=1)
    params = [SamplingParams(temperature=2.0, top_k=1)] * 8
    out = Sampler().sample(logits, params, [gen(i) for i in range(8)])
    assert out.tolist() == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_keeps_only_the_most_likely_token():
    logits = random_logits(8, 100, seed=2)
    params = [SamplingParams(temperature=1.5, top_p=1e-6)] * 8
    out = Sampler().sample(logits, params, [None] * 8)
    assert out.tolist() == logits.argmax(dim=-1).tolist()


def test_a_seeded_row_ignores_its_batch_neighbours():
    logits = random_logits(5, 300, seed=3) * 0.2  # flat: a different draw almost surely differs
    mine = SamplingParams(temperature=1.0, top_p=0.95)
    neighbours = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5),
                  mine, SamplingParams(temperature=1.3), SamplingParams(top_p=0.5)]
    alone = [Sampler().sample(logits[2:3], [mine], [gen(seed)]).item() for seed in range(10)]
    assert len(set(alone)) > 5  # the seed decides the draw
    for first_gen in (gen(1), None):
        in_batch = [Sampler().sample(logits, neighbours, [first_gen, gen(99), gen(seed), None, gen(5)])[2].item()
                    for seed in range(10)]
        assert in_batch == alone


def test_a_seed_replays_a_whole_generation():
    logits = random_logits(10, 200, seed=4)
    params = SamplingParams(temperature=1.0)
    runs = []
    for _ in range(2):
        g = gen(1234)  # the engine makes one generator per request and keeps it across steps
        runs.append([Sampler().sample(logits[i:i + 1], [params], [g]).item() for i in range(10)])
    assert runs[0] == runs[1]


def test_temperature_one_samples_the_softmax():
    samples = draw(SamplingParams(temperature=1.0), 4000)
    assert set(samples) == set(range(5))
    assert chi_square(samples, PROBS) < 30  # 4 degrees of freedom: p ~ 5e-6 at 30


def test_temperature_flattens_the_distribution():
    samples = draw(SamplingParams(temperature=2.0), 4000)
    flat = [math.sqrt(p) for p in PROBS]
    expected = [p / sum(flat) for p in flat]
    assert chi_square(samples, expected) < 30
    assert chi_square(samples, PROBS) > 100  # clearly not the untempered softmax


def test_top_k_restricts_support_and_renormalises():
    samples = draw(SamplingParams(temperature=1.0, top_k=2), 3000)
    assert set(samples) == {0, 1}
    assert chi_square(samples, [0.5 / 0.8, 0.3 / 0.8, 0, 0, 0]) < 30


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # mass before each token: 0, .5, .8, .9, .96; top_p .85 keeps tokens 0..2
    samples = draw(SamplingParams(temperature=1.0, top_p=0.85), 3000)
    assert set(samples) == {0, 1, 2}
    assert chi_square(samples, [0.5 / 0.9, 0.3 / 0.9, 0.1 / 0.9, 0, 0]) < 30


def test_top_k_applies_before_top_p():
    probs = Sampler().probs(LOGITS[None], [SamplingParams(top_k=2, top_p=0.6)])[0]
    # top-2 renormalised: .625, .375, so the mass before token 1 is already .625 >= .6;
    # top-p on the full distribution first would have kept token 1 (mass before it .5)
    expected = torch.tensor([1.0, 0, 0, 0, 0])
    assert torch.allclose(probs, expected)


def test_top_p_one_keeps_even_tiny_probabilities():
    logits = torch.tensor([[20.0, 0.0, -5.0, -30.0]])
    for params in (SamplingParams(top_p=1.0), SamplingParams(top_k=4, top_p=1.0)):
        probs = Sampler().probs(logits, [params])[0]
        assert bool((probs > 0).all())  # float32 cumsum reaches 1.0 before the last tokens


def test_mismatched_inputs_raise_clear_errors():
    logits = random_logits(2, 10)
    with pytest.raises(ValueError, match="must match"):
        Sampler().sample(logits, [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match=r"\[batch, vocab\]"):
        Sampler().sample(logits[0], [SamplingParams()], [None])
