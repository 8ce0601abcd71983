"""Structured outputs, penalties and logits processors on CUDA: their masks and penalties are applied to
logits that live on the GPU, in graphed and multi-step decode. Greedy under each, with the four requests
batched together on one engine, gives transformers' generate under the same constraint (on the CPU, its
own processors, and llguidance's masks for the structured one). Skips without a GPU, as
test_cuda_graphs.py."""

from __future__ import annotations

import llguidance
import pytest
from transformers import LogitsProcessorList

from tandem.engine.logits_processors import bad_words_token_ids
from tandem.engine.sampling_params import SamplingParams, StructuredOutputs

from test_cuda_graphs import cuda, cuda_engine
from test_parity import prompt_for
from test_sampling_features import hf_penalized_greedy
from test_sampling_params_more import KeepOnly, hf_generate
from test_structured_outputs import PERSON, hf_constrained_greedy

N = 24


@cuda
@pytest.mark.parametrize("enforce_eager, steps", [(False, 1), (False, 4), (True, 4)])
def test_constrained_and_penalized_greedy_on_cuda_is_transformers(demo_model_dir, enforce_eager, steps):
    mixtral = demo_model_dir("mixtral")
    json_prompt, penalty_prompt, allowed_prompt, banned_prompt = (prompt_for(s, n) for s, n in
                                                                  ((7, 9), (2, 9), (3, 8), (4, 8)))
    engine = cuda_engine(mixtral, enforce_eager=enforce_eager, num_scheduler_steps=steps, max_model_len=256)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(PERSON, defaults={"whitespace_flexible": False})
    allowed = sorted(set(range(20, 60)) - set(hf_generate(mixtral, allowed_prompt, N)))
    banned = bad_words_token_ids(engine.tokenizer, ("la",), engine.model_config.vocab_size)
    theirs = [
        hf_constrained_greedy(mixtral, json_prompt, grammar, 48),
        hf_penalized_greedy(mixtral, penalty_prompt, N, repetition=1.8),
        hf_generate(mixtral, allowed_prompt, N, logits_processor=LogitsProcessorList([KeepOnly(allowed)])),
        hf_generate(mixtral, banned_prompt, N, bad_words_ids=banned),
    ]
    assert theirs[3] != hf_generate(mixtral, banned_prompt, N)  # the ban changes greedy's tokens here
    greedy = dict(max_tokens=N, temperature=0, ignore_eos=True)
    structured, penalized, only, without = engine.generate(
        [json_prompt, penalty_prompt, allowed_prompt, banned_prompt],
        [SamplingParams(max_tokens=48, temperature=0, structured_outputs=StructuredOutputs(json=PERSON)),
         SamplingParams(**greedy, repetition_penalty=1.8),
         SamplingParams(**greedy, allowed_token_ids=allowed),
         SamplingParams(**greedy, bad_words=["la"])])
    assert next(engine.model.parameters()).is_cuda
    assert (engine.runner.graphs is None) == enforce_eager
    assert structured.finish_reason == "stop" and theirs[0] == structured.token_ids + [2]  # + generate's EOS
    assert penalized.token_ids == theirs[1]
    assert only.token_ids == theirs[2] and set(only.token_ids) <= set(allowed)
    assert without.token_ids == theirs[3]

