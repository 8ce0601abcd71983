"""The sampler: greedy, top-k/top-p against transformers, per-request seeds, the sampled distribution, broken
logits; SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.engine.sampler import Sampler
from tandem.engine.sampling_params import NO_TOKEN, InvalidRequest, SamplingParams

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


# Against transformers' logits processors: the distribution sampled from is the softmax of the
# logits its warpers leave, in generate's order (temperature, top-k, top-p).


def transformers_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores.softmax(dim=-1)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(temperature=1.0, top_k=1000),  # more than the vocabulary: keeps it all
    SamplingParams(temperature=0.5, top_p=0.8),
    SamplingParams(temperature=2.0, top_k=40, top_p=0.5),
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=1e-4, top_k=3),
], ids=repr)
def test_the_distribution_is_transformers_warpers(params):
    logits = random_logits(8, 300, seed=5)
    ours = Sampler().probs(logits, [params] * 8)
    assert torch.allclose(ours, transformers_probs(logits, params), atol=1e-6)


@pytest.mark.parametrize("top_k", [1, 3, 10])
def test_top_k_keeps_every_token_tied_with_the_kth_as_transformers_and_vllm_do(top_k):
    logits = (random_logits(8, 60, seed=6) * 2).round() / 2  # ties at the cut-off in most rows
    params = SamplingParams(temperature=1.0, top_k=top_k)
    ours = Sampler().probs(logits, [params] * 8)
    theirs = transformers_probs(logits, params)
    assert ((ours > 0) == (theirs > 0)).all()
    assert torch.allclose(ours, theirs, atol=1e-6)


@pytest.mark.parametrize("params, scale, round_to, sorts", [
    # A vocabulary past sampler.CANDIDATES: the cut is made among the most likely tokens, without a
    # sort of the vocabulary, wherever it cannot reach past them (sorts: whether it sorted it).
    (SamplingParams(temperature=0.5, top_p=0.8), 4.0, None, False),
    (SamplingParams(temperature=1.0, top_p=0.4), 0.3, None, False),  # the candidates hold half the mass
    (SamplingParams(temperature=1.3, top_k=7), 1.0, None, False),
    (SamplingParams(temperature=2.0, top_k=40, top_p=0.5), 1.0, None, False),
    (SamplingParams(temperature=1.0, top_k=10), 1.0, 0.5, False),  # ties at the k-th
    (SamplingParams(temperature=1.0, top_p=0.9), 4.0, 0.25, False),  # ties where top_p falls
    (SamplingParams(temperature=1.0, top_p=0.9), 0.01, None, True),  # flat: 90% needs most tokens
    (SamplingParams(temperature=1.0, top_k=1023), 1.0, 1.0, True),  # the k-th tied with the 1024th
    (SamplingParams(temperature=1.0, top_k=2500), 1.0, None, False),  # as many candidates as k needs
    (SamplingParams(temperature=1.0, top_k=4999), 1.0, None, True),  # then as many as the vocabulary
], ids=repr)
def test_a_large_vocabulary_is_cut_as_transformers_warpers_cut_it(monkeypatch, params, scale, round_to, sorts):
    from tandem.engine import sampler

    logits = random_logits(4, 5000, seed=7) * scale
    if round_to is not None:
        logits = (logits / round_to).round() * round_to
    calls = []
    full_sort = sampler._cut
    monkeypatch.setattr(sampler, "_cut", lambda *a: (calls.append(1), full_sort(*a))[1])
    ours = Sampler().probs(logits, [params] * 4)
    theirs = transformers_probs(logits, params)
    assert ((ours > 0) == (theirs > 0)).all()
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert bool(calls) == sorts


def test_a_flat_row_takes_eight_times_the_candidates_before_a_sort(monkeypatch):
    from tandem.engine import sampler

    logits = random_logits(2, 20000, seed=9) * 0.3  # top_p 0.5 needs ~2.5k tokens: more than 1024, under 8192
    widths = []
    among = sampler._cut_among_candidates
    monkeypatch.setattr(sampler, "_cut_among_candidates", lambda *a: (widths.append(a[-1]), among(*a))[1])
    params = SamplingParams(temperature=1.0, top_p=0.5)
    ours = Sampler().probs(logits, [params] * 2)
    assert widths == [sampler.CANDIDATES, 8 * sampler.CANDIDATES]
    assert torch.allclose(ours, transformers_probs(logits, params), atol=1e-6)


def test_rows_that_cut_and_rows_that_do_not_share_a_batch():
    logits = random_logits(4, 5000, seed=8) * 4
    params = [SamplingParams(temperature=0.9), SamplingParams(temperature=0.5, top_p=0.7),
              SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.2)]
    ours = Sampler().probs(logits, params)
    for row, p in enumerate(params):
        assert torch.allclose(ours[row], transformers_probs(logits[row:row + 1], p)[0], atol=1e-6), p


BROKEN = {"nan": float("nan"), "+inf": float("inf")}


@pytest.mark.parametrize("bad", ["nan", "+inf", "all -inf"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_row_of_broken_logits_gets_no_token_and_spares_its_batch(bad, temperature):
    """A model gone wrong for one sequence (a NaN, +inf, or nothing finite in its logits) must not
    yield a token that looks real, nor fail the others: its row gets NO_TOKEN."""
    logits = random_logits(4, 50, seed=7)
    logits[0, :10] = float("-inf")  # some masked tokens are fine
    params = [SamplingParams(temperature=temperature, top_k=20), SamplingParams(temperature=0),
              SamplingParams(temperature=temperature), SamplingParams(temperature=1.0, top_p=0.9)]
    clean = Sampler().sample(logits, params, [gen(i) for i in range(4)])
    broken = logits.clone()
    if bad == "all -inf":
        broken[2] = float("-inf")
    else:
        broken[2, 17] = BROKEN[bad]
    out = Sampler().sample(broken, params, [gen(i) for i in range(4)])
    assert out[2].item() == NO_TOKEN
    assert out[[0, 1, 3]].tolist() == clean[[0, 1, 3]].tolist()


def test_a_tiny_temperature_samples_the_argmax_without_overflow():
    logits = random_logits(4, 50, seed=8) * 1e4
    params = [SamplingParams(temperature=2e-5)] * 4
    out = Sampler().sample(logits, params, [gen(i) for i in range(4)])
    assert out.tolist() == logits.argmax(dim=-1).tolist()


def test_unseeded_rows_are_drawn_from_the_samplers_seed():
    logits = random_logits(6, 200, seed=9) * 0.2
    params = [SamplingParams(temperature=1.0)] * 6
    runs = [Sampler(seed=3).sample(logits, params, [None] * 6).tolist() for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0] != Sampler(seed=4).sample(logits, params, [None] * 6).tolist()


def test_greedy_params_are_what_the_sampler_takes_the_argmax_for():
    for t in (0.0, 1e-7, 1e-6, 1e-5, 0.1):
        params = SamplingParams(temperature=t)
        assert params.greedy == Sampler.is_greedy(params)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 2.5), ("max_tokens", True), ("max_tokens", "8"),
    ("top_k", 2.5), ("top_k", True),
    ("temperature", "0.7"), ("temperature", None), ("temperature", True),
    ("top_p", "0.9"), ("top_p", None),
    ("stop", ("ok", 7)), ("stop", 7),
    ("stop_token_ids", (2, "3")), ("stop_token_ids", (2, -1)),
    ("ignore_eos", "no"),
])
def test_values_of_the_wrong_kind_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field


def test_one_stop_string_is_one_string_not_its_characters():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)  # as vLLM takes it
