"""min_tokens, logit_bias, allowed_token_ids, bad_words, include_stop_str_in_output and
skip_special_tokens: the logits processors against a per-row reference written from vLLM's
semantics, and greedy decoding against transformers' generate on the same checkpoint with its own
processors (MinNewTokensLength, SequenceBias, NoBadWords), in one step a call and in runs of
multi-step decode; the text settings against the tokenizer's decode."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import transformers
from tokenizers import Tokenizer
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor, \
    SequenceBiasLogitsProcessor

from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.logits_processors import LogitsProcessors, bad_words_token_ids
from tandem.engine.sampler import Sampler
from tandem.engine.sampling_params import InvalidRequest, SamplingParams, StructuredOutputs
from tandem.engine.sequence import Sequence
from test_parity import prompt_for
from test_sampler import random_logits

EOS = 2  # the demo checkpoints' </s>
PROMPT, STOP = "Answer:", " was"  # greedy's text on the demo mixtral holds STOP twice


@pytest.fixture(scope="module")
def mixtral(demo_model_dir):
    return demo_model_dir("mixtral")


def engine_for(model_dir, steps: int = 1) -> LLMEngine:
    return LLMEngine.from_pretrained(model_dir, device="cpu", dtype="float32",
                                     config=EngineConfig(num_scheduler_steps=steps))


@functools.cache
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_generate(model_dir, prompt: list[int], n: int, eos=None, **kwargs) -> list[int]:
    """transformers' greedy generate: n new tokens, or up to an `eos` (none by default, as ignore_eos)."""
    model = hf_model(model_dir)
    model.generation_config.eos_token_id = eos
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             eos_token_id=eos, **kwargs)
    return out[0, len(prompt):].tolist()


def greedy(n: int, **params) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **({"ignore_eos": True} | params))


# validation


@pytest.mark.parametrize("kwargs,field", [
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 1.5}, "min_tokens"), ({"min_tokens": True}, "min_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"logit_bias": {5: 100.5}}, "logit_bias"), ({"logit_bias": {5: -101}}, "logit_bias"),
    ({"logit_bias": {5: math.nan}}, "logit_bias"), ({"logit_bias": {5: math.inf}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"logit_bias": {"a": 1.0}}, "logit_bias"),
    ({"logit_bias": {5: "1"}}, "logit_bias"), ({"logit_bias": [(5, 1.0)]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1.0]}, "allowed_token_ids"), ({"allowed_token_ids": 7}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"), ({"bad_words": ["  "]}, "bad_words"), ({"bad_words": [3]}, "bad_words"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
], ids=repr)
def test_out_of_range_or_wrong_kind_values_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


def test_values_are_taken_as_vllm_takes_them():
    p = SamplingParams(logit_bias={"7": 2, 9: -100}, allowed_token_ids=[4, 5], bad_words="word", max_tokens=3,
                       min_tokens=3)
    assert p.logit_bias == {7: 2.0, 9: -100.0} and p.allowed_token_ids == (4, 5) and p.bad_words == ("word",)
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(min_tokens=40).min_tokens == 40  # max_tokens unset: the default's cut comes first


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, min_tokens=1), SamplingParams(temperature=0, logit_bias={3: 1.0}),
    SamplingParams(temperature=0, allowed_token_ids=[3]), SamplingParams(temperature=0, bad_words=["x"]),
], ids=["min_tokens", "logit_bias", "allowed_token_ids", "bad_words"])
def test_a_logits_processor_leaves_the_native_greedy_path(params):
    assert not Sampler.argmax_only(params) and params.processes_logits
    assert Sampler.argmax_only(SamplingParams(temperature=0, include_stop_str_in_output=True,
                                              skip_special_tokens=False))


def test_the_engine_refuses_ids_outside_the_vocabulary_and_bad_words_without_a_tokenizer(mixtral):
    engine = engine_for(mixtral)
    vocab = engine.model_config.vocab_size
    for params, field in [(SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
                          (SamplingParams(allowed_token_ids=[5, vocab]), "allowed_token_ids")]:
        with pytest.raises(InvalidRequest, match=f"{vocab} is outside the vocabulary") as err:
            engine.add_request("r", [5, 6], params)
        assert err.value.field == field
    engine.tokenizer, engine._grammars = None, None  # as loaded from a directory with no tokenizer.json
    with pytest.raises(InvalidRequest, match="need a tokenizer") as err:
        engine.add_request("r", [5, 6], SamplingParams(bad_words=["x"]))
    assert err.value.field == "bad_words"
    assert not engine.has_unfinished_requests()


# the processors, batched, against a row-by-row reference


def reference(logits: torch.Tensor, params: list[SamplingParams], outputs, words, eos) -> torch.Tensor:
    """vLLM's processors one row at a time: allowed ids, bad words (vllm/v1/sample/ops/bad_words.py:
    matched against the output only), min_tokens (EOS and stop tokens), logit bias."""
    out = logits.clone()
    for i, (p, output, ws) in enumerate(zip(params, outputs, words)):
        if p.allowed_token_ids is not None:
            keep = out[i, list(p.allowed_token_ids)].clone()
            out[i] = float("-inf")
            out[i, list(p.allowed_token_ids)] = keep
        for w in ws:
            if len(w) <= len(output) + 1 and output[len(output) - len(w) + 1:] == w[:-1]:
                out[i, w[-1]] = float("-inf")
        if len(output) < p.min_tokens:
            out[i, list({*eos, *p.stop_token_ids})] = float("-inf")
        for t, b in (p.logit_bias or {}).items():
            out[i, t] += b
    return out


def test_processors_are_the_reference_step_after_step_of_a_multi_step_decode():
    vocab = 300
    params = [SamplingParams(), SamplingParams(min_tokens=3, stop_token_ids=[9]),
              SamplingParams(logit_bias={4: 2.5, 8: -1.0, 9: 100}, allowed_token_ids=[4, 8, 9, 10, 11]),
              SamplingParams(bad_words=["x"], min_tokens=1, logit_bias={7: -3.0}), SamplingParams(bad_words=["y"])]
    words = [[], [], [], [[7, 8, 9], [5], [8, 9], [6, 9]], [[12, 13]]]
    outputs = [[1], [], [3, 4], [6, 7], [5]]
    seqs = [Sequence(f"s{i}", [1, 2], p, output_token_ids=list(o), bad_words_token_ids=w or None)
            for i, (p, o, w) in enumerate(zip(params, outputs, words))]
    processors = LogitsProcessors.of(seqs, [EOS], vocab, torch.device("cpu"))
    assert processors.index.tolist() == [1, 2, 3, 4]
    # each step's tokens walk the rows into and out of their bad words' prefixes and past min_tokens
    steps = [[0, 20, 4, 7, 12], [0, 21, 8, 8, 13], [0, 22, 9, 6, 12], [0, 23, 10, 9, 1]]
    for i, step in enumerate(steps):
        logits = random_logits(len(seqs), vocab, seed=i)
        expected = reference(logits, params, outputs, words, [EOS])
        assert torch.equal(processors.apply(logits), expected), i
        processors.add(torch.tensor(step))
        outputs = [o + [t] for o, t in zip(outputs, step)]
    assert LogitsProcessors.of(seqs[:1], [EOS], vocab, torch.device("cpu")) is None


def test_bad_words_are_tokenized_alone_and_after_a_space_by_vllms_rule(mixtral):
    tok = Tokenizer.from_file(str(mixtral / "tokenizer.json"))

    def encode(text):
        return tok.encode(text, add_special_tokens=False).ids

    # "la" and " la" are one token each: both banned; " FP" is 3 tokens to "FP"'s 2: only "FP"
    assert bad_words_token_ids(tok, ("la",), 384) == [encode("la"), encode(" la")] and encode("la") != encode(" la")
    assert bad_words_token_ids(tok, (" FP",), 384) == [encode("FP")] and len(encode(" FP")) == 3
    with pytest.raises(InvalidRequest, match="outside the vocabulary") as err:
        bad_words_token_ids(tok, ("la",), 100)
    assert err.value.field == "bad_words"


# the engine, greedy, against transformers' generate


def eos_at(model_dir, prompt, n) -> tuple[int, list[int]]:
    """A token greedy generates third (and not before), to make the checkpoint's EOS: it would end
    the output at once."""
    tokens = hf_generate(model_dir, prompt, n)
    assert tokens[2] not in tokens[:2] and tokens[2] in tokens[3:]  # and greedy comes back to it later
    return tokens[2], tokens


@pytest.mark.parametrize("steps", [1, 4])
def test_min_tokens_holds_eos_back_as_transformers_min_new_tokens(demo_model_dir, mixtral, steps):
    prompt, n = prompt_for(2, 8), 20
    eos, free = eos_at(mixtral, prompt, n)
    checkpoint = demo_model_dir("mixtral", eos_token_id=eos)  # the same weights, an EOS greedy picks early
    engine = engine_for(checkpoint, steps)
    [early] = engine.generate([prompt], greedy(n, ignore_eos=False))
    assert early.token_ids == free[:3] and early.finish_reason == "stop"
    # 2: EOS may come as the third token, mid-way through a multi-step run; 5: held back, greedy goes on
    for min_tokens in (2, 5):
        theirs = hf_generate(checkpoint, prompt, n, eos=eos, min_new_tokens=min_tokens)
        assert (theirs == free[:3]) == (min_tokens == 2)
        [ours] = engine.generate([prompt], greedy(n, ignore_eos=False, min_tokens=min_tokens))
        assert ours.token_ids == theirs and ours.finish_reason == ("stop" if theirs[-1] == eos else "length")


@pytest.mark.parametrize("steps", [1, 4])
def test_stop_token_ids_end_the_output_only_after_min_tokens(mixtral, steps):
    prompt, n = prompt_for(2, 8), 20
    stop, free = eos_at(mixtral, prompt, n)
    engine = engine_for(mixtral, steps)
    for min_tokens in (0, 2, 3, 5):
        theirs = hf_generate(mixtral, prompt, n, eos=[EOS, stop], min_new_tokens=min_tokens)
        assert (theirs == free[:3]) == (min_tokens <= 2)
        [ours] = engine.generate([prompt], greedy(n, ignore_eos=False, stop_token_ids=[stop], min_tokens=min_tokens))
        assert ours.token_ids == theirs and stop not in ours.token_ids[:min_tokens]
        assert ours.finish_reason == ("stop" if theirs[-1] in (stop, EOS) else "length")


@pytest.mark.parametrize("steps", [1, 4])
def test_greedy_with_a_logit_bias_is_transformers_sequence_bias(mixtral, steps):
    prompt, n = prompt_for(4, 8), 24
    free = hf_generate(mixtral, prompt, n)
    bias = {free[0]: -30.0, free[5]: 0.1, 300: 0.05}  # the logits spread ~0.16 here: 0.1 tips some steps
    theirs = hf_generate(mixtral, prompt, n, sequence_bias=[[[t], b] for t, b in bias.items()])
    assert theirs != free and len(set(theirs)) > 3 and free[0] not in theirs
    [ours] = engine_for(mixtral, steps).generate([prompt], greedy(n, logit_bias=bias))
    assert ours.token_ids == theirs


def test_logit_bias_comes_before_the_repetition_penalty_as_in_vllm(mixtral):
    prompt, n = prompt_for(4, 8), 24
    free = hf_generate(mixtral, prompt, n)
    bias = {free[3]: 0.3, free[7]: 0.2}

    def processors(*order):
        return LogitsProcessorList(order)

    biased = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    penalty = RepetitionPenaltyLogitsProcessor(1.8)
    theirs = hf_generate(mixtral, prompt, n, logits_processor=processors(biased, penalty))
    assert theirs != hf_generate(mixtral, prompt, n, logits_processor=processors(penalty, biased))
    [ours] = engine_for(mixtral).generate([prompt], greedy(n, logit_bias=bias, repetition_penalty=1.8))
    assert ours.token_ids == theirs


class KeepOnly(LogitsProcessor):
    def __init__(self, ids):
        self.ids = list(ids)

    def __call__(self, input_ids, scores):
        out = torch.full_like(scores, float("-inf"))
        out[:, self.ids] = scores[:, self.ids]
        return out


@pytest.mark.parametrize("steps", [1, 4])
def test_allowed_token_ids_are_the_only_tokens_and_greedy_among_them_is_transformers(mixtral, steps):
    prompt, n = prompt_for(3, 8), 24
    free = hf_generate(mixtral, prompt, n)
    allowed = sorted(set(range(20, 60)) - set(free))
    theirs = hf_generate(mixtral, prompt, n, logits_processor=LogitsProcessorList([KeepOnly(allowed)]))
    [ours] = engine_for(mixtral, steps).generate([prompt], greedy(n, allowed_token_ids=allowed))
    assert ours.token_ids == theirs and set(ours.token_ids) <= set(allowed) and len(set(ours.token_ids)) > 2


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("seed,word", [(4, "la"), (11, "td"), (7, "FP")])  # one token; two; two, spaced three
def test_bad_words_are_absent_and_greedy_is_transformers_no_bad_words(mixtral, steps, seed, word):
    prompt, n = prompt_for(seed, 8), 24
    engine = engine_for(mixtral, steps)
    banned = bad_words_token_ids(engine.tokenizer, (word,), engine.model_config.vocab_size)
    free = hf_generate(mixtral, prompt, n)
    assert contains(free, banned[0])
    assert all(prompt[-len(w) + 1:] != w[:-1] for w in banned if len(w) > 1)  # transformers matches the prompt too
    theirs = hf_generate(mixtral, prompt, n, bad_words_ids=banned)
    [ours] = engine.generate([prompt], greedy(n, bad_words=[word]))
    assert ours.token_ids == theirs and not any(contains(ours.token_ids, w) for w in banned)


def test_logprobs_stay_the_raw_distributions_under_a_logit_bias(mixtral):
    prompt, n = prompt_for(4, 8), 8
    engine = engine_for(mixtral)
    raw = []
    engine.runner.logits_hook = lambda rid, row: raw.append(row.float().log_softmax(-1))
    free = hf_generate(mixtral, prompt, n)
    [ours] = engine.generate([prompt], greedy(n, logit_bias={free[0]: -50.0}, logprobs=0))
    assert ours.token_ids[0] != free[0] and ours.logprobs[0].rank > 1
    for token, entry, logp in zip(ours.token_ids, ours.logprobs, raw):
        assert entry.logprob == pytest.approx(logp[token].item(), abs=1e-5)


# every token blocked: the request fails, it does not hang


@pytest.mark.parametrize("params", [
    greedy(8, structured_outputs=StructuredOutputs(choice=["red", "green"]), allowed_token_ids=[90]),
    greedy(8, ignore_eos=False, allowed_token_ids=[EOS], min_tokens=2),
], ids=["allowed ids the structured output forbids", "only EOS, before min_tokens"])
@pytest.mark.timeout(60)
def test_a_request_with_no_token_left_to_sample_finishes_with_error(mixtral, params):
    engine = engine_for(mixtral)
    [out] = engine.generate([prompt_for(5, 6)], params)
    assert out.finish_reason == "error" and out.token_ids == []
    [after] = engine.generate([prompt_for(5, 6)], greedy(4))  # and the engine goes on
    assert after.finish_reason == "length"


# text


def test_include_stop_str_in_output_ends_the_text_with_it(mixtral):
    engine = engine_for(mixtral, 4)
    prompt = engine.encode(PROMPT)
    [free] = engine.generate([prompt], greedy(24))
    at = free.text.find(STOP)
    assert at > 0
    for include, text in ((False, free.text[:at]), (True, free.text[:at + len(STOP)])):
        [out] = engine.generate([prompt], greedy(24, stop=[STOP], include_stop_str_in_output=include))
        assert out.text == text and out.finish_reason == "stop"


@pytest.mark.parametrize("steps", [1, 4])
def test_a_stop_string_counts_only_when_it_ends_after_min_tokens_tokens(mixtral, steps):
    engine = engine_for(mixtral, steps)
    prompt = engine.encode(PROMPT)
    [free] = engine.generate([prompt], greedy(24))
    first = next(i for i in range(1, 25) if STOP in engine.tokenizer.decode(free.token_ids[:i]))
    at = free.text.find(STOP)
    again = free.text.find(STOP, at + 1)
    assert again != -1
    [early] = engine.generate([prompt], greedy(24, stop=[STOP], min_tokens=first - 1))
    assert early.text == free.text[:at] and len(early.token_ids) == first
    [held] = engine.generate([prompt], greedy(24, stop=[STOP], min_tokens=first))
    assert held.text == free.text[:again] and held.finish_reason == "stop" and len(held.token_ids) > first


def test_skip_special_tokens_false_keeps_them_in_the_text(mixtral):
    engine = engine_for(mixtral)
    prompt = engine.encode(PROMPT)
    [skipped] = engine.generate([prompt], greedy(16, logit_bias={1: 3.0, EOS: 2.0}))  # <s> and </s> among them
    [kept] = engine.generate([prompt], greedy(16, logit_bias={1: 3.0, EOS: 2.0}, skip_special_tokens=False))
    assert kept.token_ids == skipped.token_ids and {1, EOS} & set(kept.token_ids)
    assert skipped.text == engine.tokenizer.decode(skipped.token_ids)
    assert kept.text == engine.tokenizer.decode(kept.token_ids, skip_special_tokens=False) != skipped.text
    assert "<s>" in kept.text or "</s>" in kept.text
