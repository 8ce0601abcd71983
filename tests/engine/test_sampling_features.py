"""min-p, the repetition / presence / frequency penalties and logprobs: against transformers' logits
processors and its generate on the same checkpoint; presence and frequency (which transformers
lacks) against OpenAI's formula, written out here token by token."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers import (LogitsProcessor, LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.sampler import Penalties, Sampler
from tandem.engine.sampling_params import MAX_LOGPROBS, InvalidRequest, SamplingParams
from tandem.engine.sequence import Sequence
from test_parity import hf_greedy, prompt_for
from test_sampler import random_logits

# min-p


def vllm_order_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' warpers in vLLM's order: temperature, min-p, top-k, top-p."""
    scores = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
    if params.min_p:
        scores = MinPLogitsWarper(params.min_p)(None, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores.softmax(dim=-1)


@pytest.mark.parametrize("vocab", [300, 20000])  # all sorted, and cut among the likeliest candidates
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.6, min_p=0.2),
    SamplingParams(temperature=1.5, min_p=0.01, top_k=20),
    SamplingParams(temperature=1.0, min_p=0.02, top_p=0.7),
    SamplingParams(temperature=1.0, min_p=1.0),  # only the likeliest (and tokens tied with it)
], ids=repr)
def test_min_p_cuts_as_transformers_min_p_warper_in_vllms_order(params, vocab):
    logits = random_logits(4, vocab, seed=3) * 3
    ours = Sampler().probs(logits, [params] * 4)
    assert torch.allclose(ours, vllm_order_probs(logits, params), atol=1e-6)
    assert ((ours > 0).sum(dim=-1) < vocab).all()  # it cut something


def test_min_p_zero_rows_are_untouched_beside_min_p_rows():
    logits = random_logits(2, 300, seed=4)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, min_p=0.3)]
    ours = Sampler().probs(logits, params)
    assert torch.allclose(ours[0], logits[0].softmax(-1), atol=1e-7)
    assert torch.allclose(ours[1], vllm_order_probs(logits[1:], params[1])[0], atol=1e-6)


# penalties


def seq(prompt: list[int], output: list[int], **params) -> Sequence:
    s = Sequence("r", prompt, SamplingParams(**params))
    s.output_token_ids = list(output)
    return s


def openai_penalized(logits: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's formula: mu[j] - c[j] * frequency - (c[j] > 0) * presence, c[j] j's count in the output."""
    out = logits.clone()
    for j in set(output):
        count = output.count(j)
        out[j] -= count * frequency + presence
    return out


def test_repetition_penalty_is_transformers_processor_over_prompt_and_output():
    prompt, output = [5, 9, 9, 40], [7, 5, 120, 7]
    logits = random_logits(1, 300, seed=6)[0]
    logits[[5, 9]] = torch.tensor([-2.0, 3.0])  # one negative and one positive penalized logit, for sure
    s = seq(prompt, output, repetition_penalty=1.7)
    ours = Penalties.of([s], torch.device("cpu")).apply(logits[None])[0]
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits[None].clone())[0]
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, logits)


@pytest.mark.parametrize("presence,frequency", [(0.5, 0.0), (0.0, 0.3), (-1.0, 2.0), (2.0, -2.0)])
def test_presence_and_frequency_penalties_follow_openais_formula_over_the_output_only(presence, frequency):
    prompt, output = [3, 3, 8], [8, 11, 11, 11, 200]
    logits = random_logits(1, 300, seed=7)[0]
    s = seq(prompt, output, presence_penalty=presence, frequency_penalty=frequency)
    ours = Penalties.of([s], torch.device("cpu")).apply(logits[None])[0]
    assert torch.allclose(ours, openai_penalized(logits, output, presence, frequency), atol=1e-6)
    assert ours[3] == logits[3]  # in the prompt only: not penalized


def test_all_penalties_together_repetition_first_as_vllm():
    prompt, output = [4, 6], [6, 6, 90]
    logits = random_logits(1, 300, seed=8)[0]
    s = seq(prompt, output, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.25)
    ours = Penalties.of([s], torch.device("cpu")).apply(logits[None])[0]
    repeated = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[None].clone())[0]
    assert torch.allclose(ours, openai_penalized(repeated, output, 0.4, 0.25), atol=1e-6)


def test_penalties_touch_only_their_rows_and_steps_add_to_the_counts():
    logits = random_logits(4, 300, seed=9)
    logits[3, 7] = -1.5  # a negative logit the repetition penalty multiplies
    seqs = [seq([1, 2], [3]), seq([1, 2], [3, 3], frequency_penalty=1.0, presence_penalty=0.5),
            seq([5], [], repetition_penalty=2.0), seq([7], [9], repetition_penalty=1.5, frequency_penalty=-0.5)]
    penalties = Penalties.of(seqs, torch.device("cpu"))
    out = penalties.apply(logits)
    assert torch.equal(out[0], logits[0])
    assert out[1, 3] == logits[1, 3] - 2.5 and out[1, 1] == logits[1, 1]
    for _ in range(2):  # the second time, tokens the rows have seen already
        penalties.add(torch.tensor([50, 3, 5, 9]))
    later = penalties.apply(logits)
    rebuilt = Penalties.of([seqs[0], seq([1, 2], [3, 3, 3, 3], frequency_penalty=1.0, presence_penalty=0.5),
                            seq([5], [5, 5], repetition_penalty=2.0),
                            seq([7], [9, 9, 9], repetition_penalty=1.5, frequency_penalty=-0.5)],
                           torch.device("cpu")).apply(logits)
    assert torch.allclose(later, rebuilt, atol=1e-6)
    assert later[3, 7] == logits[3, 7] * 1.5
    assert Penalties.of([seqs[0]], torch.device("cpu")) is None


def test_a_penalty_changes_greedy_sampling_and_needs_the_seen_tokens():
    logits = torch.tensor([[1.0, 3.0, 2.9, 0.0]])
    s = seq([0], [1], temperature=0, presence_penalty=0.5)
    assert Sampler().sample(logits, [s.params], [None], Penalties.of([s], torch.device("cpu"))).item() == 2
    with pytest.raises(ValueError, match="penalty"):
        Sampler().sample(logits, [s.params], [None])
    assert not Sampler.argmax_only(s.params) and Sampler.argmax_only(SamplingParams(temperature=0))
    assert not Sampler.argmax_only(SamplingParams(temperature=0, logprobs=0))


# logprobs


def test_logprobs_give_the_tokens_rank_and_the_likeliest_in_order():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [1.0, 1.0, 5.0, 0.5]])
    tokens = torch.tensor([2, 0])
    out = Sampler.logprobs(logits, tokens, [3, None])
    logp = logits[0].log_softmax(-1)
    assert out[1] is None
    assert out[0].rank == 2 and math.isclose(out[0].logprob, logp[2].item(), rel_tol=1e-6)
    assert [t for t, _ in out[0].top] == [1, 2, 0]
    assert [v for _, v in out[0].top] == pytest.approx(logp[[1, 2, 0]].tolist())
    assert Sampler.logprobs(logits, tokens, [0, 10])[0].top == ()
    assert len(Sampler.logprobs(logits, tokens, [0, 10])[1].top) == 4  # no more than the vocabulary


# validation


def test_vllms_minus_one_turns_top_k_off():
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize("field,value", [
    ("top_k", -2), ("min_p", -0.1), ("min_p", 1.5), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf), ("presence_penalty", 2.5), ("frequency_penalty", -2.01),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 2.0), ("logprobs", True), ("min_p", "0.1"),
    ("presence_penalty", math.nan), ("repetition_penalty", math.nan), ("prompt_logprobs", 21),
    ("prompt_logprobs", "1"),
])
def test_out_of_range_or_wrong_kind_values_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field


# the engine, against transformers' generate on the same checkpoint


class OpenAIPenalties(LogitsProcessor):
    """Presence and frequency penalties for transformers' generate, over the tokens after the prompt."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = scores.clone()
        for row, ids in enumerate(input_ids[:, self.prompt_len:].tolist()):
            out[row] = openai_penalized(scores[row], ids, self.presence, self.frequency)
        return out


def hf_penalized_greedy(model_dir, prompt, n, **penalties) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    processors = LogitsProcessorList()
    if "presence" in penalties:
        processors.append(OpenAIPenalties(len(prompt), penalties["presence"], penalties["frequency"]))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             repetition_penalty=penalties.get("repetition"), logits_processor=processors)
    return out[0, len(prompt):].tolist()


def engine_for(model_dir, steps: int) -> LLMEngine:
    return LLMEngine.from_pretrained(model_dir, device="cpu", dtype="float32",
                                     config=EngineConfig(num_scheduler_steps=steps))


@pytest.fixture(scope="module")
def mixtral(demo_model_dir):
    return demo_model_dir("mixtral")


@pytest.mark.parametrize("steps", [1, 4])  # one step a call, and runs of multi-step decode
def test_greedy_with_a_repetition_penalty_is_transformers_generate(mixtral, steps):
    prompt, n = prompt_for(2, 9), 24
    theirs = hf_penalized_greedy(mixtral, prompt, n, repetition=1.8)
    assert theirs != hf_greedy(mixtral, prompt, n)[0]  # the penalty changes what greedy picks here
    [ours] = engine_for(mixtral, steps).generate(
        [prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, repetition_penalty=1.8))
    assert ours.token_ids == theirs


@pytest.mark.parametrize("steps", [1, 4])
def test_greedy_with_presence_and_frequency_penalties_is_generate_with_openais_formula(mixtral, steps):
    prompt, n = prompt_for(3, 7), 24
    theirs = hf_penalized_greedy(mixtral, prompt, n, presence=0.6, frequency=0.9)
    assert theirs != hf_greedy(mixtral, prompt, n)[0]
    [ours] = engine_for(mixtral, steps).generate([prompt], SamplingParams(
        max_tokens=n, temperature=0, ignore_eos=True, presence_penalty=0.6, frequency_penalty=0.9))
    assert ours.token_ids == theirs


@pytest.mark.parametrize("steps", [1, 4])
def test_logprobs_are_the_log_softmax_of_transformers_logits(mixtral, steps):
    prompt, n = prompt_for(4, 10), 12
    tokens, logits = hf_greedy(mixtral, prompt, n)
    logp = logits.log_softmax(dim=-1)  # [n, V]
    [ours] = engine_for(mixtral, steps).generate(
        [prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5))
    assert ours.token_ids == tokens and len(ours.logprobs) == n
    for i, entry in enumerate(ours.logprobs):
        assert entry.rank == 1  # greedy
        assert entry.logprob == pytest.approx(logp[i, tokens[i]].item(), abs=1e-4)
        values, ids = logp[i].topk(5)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_sampled_tokens_logprobs_and_ranks_are_theirs_under_the_raw_distribution(mixtral):
    # sampled at a high temperature: tokens other than the likeliest, each with its rank
    prompt, n = prompt_for(5, 6), 16
    engine = engine_for(mixtral, 1)
    raw = {}
    engine.runner.logits_hook = lambda rid, row: raw.setdefault(rid, []).append(row.float().log_softmax(-1))
    [ours] = engine.generate([prompt], SamplingParams(max_tokens=n, temperature=3.0, seed=1, ignore_eos=True,
                                                      logprobs=0))
    [rows] = raw.values()
    assert any(e.rank > 1 for e in ours.logprobs)
    for token, entry, logp in zip(ours.token_ids, ours.logprobs, rows):
        assert entry.logprob == pytest.approx(logp[token].item(), abs=1e-5)
        assert entry.rank == int((logp > logp[token]).sum()) + 1 and entry.top == ()


def test_logprobs_stay_one_per_token_when_a_stop_token_cuts_a_multi_step_run(mixtral):
    prompt = prompt_for(6, 8)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    [full] = engine_for(mixtral, 4).generate([prompt], params)
    stop = full.token_ids[5]
    first = full.token_ids.index(stop)
    [cut] = engine_for(mixtral, 4).generate([prompt], SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, logprobs=1, stop_token_ids=(stop,)))
    assert cut.token_ids == full.token_ids[:first + 1] and cut.finish_reason == "stop"
    assert cut.logprobs == full.logprobs[:first + 1]


def test_requests_without_logprobs_get_none(mixtral):
    [out] = engine_for(mixtral, 1).generate([prompt_for(7, 5)], SamplingParams(max_tokens=3, temperature=0))
    assert out.logprobs is None


# prompt logprobs: scoring a text


def transformers_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every prompt position: row p scores token p + 1."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)  # [P, V]


def assert_scores(entries, logp: torch.Tensor, prompt: list[int], n: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for p, entry in enumerate(entries[1:]):
        row, token = logp[p], prompt[p + 1]
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry.rank == int((row > row[token]).sum()) + 1
        values, ids = row.topk(n)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("chunk", [None, 8])  # the prompt in one step, and in chunks of 8 tokens
def test_prompt_logprobs_are_the_log_softmax_of_transformers_logits(mixtral, chunk):
    prompt = prompt_for(8, 21)
    config = EngineConfig(max_num_batched_tokens=chunk) if chunk else EngineConfig()
    engine = LLMEngine.from_pretrained(mixtral, device="cpu", dtype="float32", config=config)
    [out] = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))
    assert_scores(out.prompt_logprobs, transformers_prompt_logprobs(mixtral, prompt), prompt, 3)
    assert out.logprobs is None


def test_a_scoring_request_takes_no_prefix_cache_hits_and_others_still_do(mixtral):
    prompt = prompt_for(9, 40)  # more than two 16-token blocks
    engine = engine_for(mixtral, 1)
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))  # fills the prefix cache
    [scored] = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    assert scored.num_cached_tokens == 0
    assert_scores(scored.prompt_logprobs, transformers_prompt_logprobs(mixtral, prompt), prompt, 0)
    [plain] = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None


def test_prompt_logprobs_come_once_in_the_first_output(mixtral):
    engine = engine_for(mixtral, 1)
    prompt = prompt_for(10, 6)
    engine.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.prompt_logprobs is not None for o in outputs] == [True] + [False] * (len(outputs) - 1)
    assert len(outputs[0].prompt_logprobs) == len(prompt)
