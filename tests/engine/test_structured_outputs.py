"""Structured outputs (SamplingParams.structured_outputs): greedy decoding under the constraint is
transformers' generate with the same constraint applied as a logits processor (llguidance's own
masks, not ours); sampled outputs are instances of their schema, matches of their regex, one of
their choices; bad constraints are refused with nothing left behind."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest
import torch
import transformers
from transformers import LogitsProcessor, LogitsProcessorList

from tandem.engine import structured
from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.sampler import Sampler
from tandem.engine.sampling_params import InvalidRequest, SamplingParams, StructuredOutputs
from tandem.kv.cache import CPU, DEVICE
from test_parity import prompt_for

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False,
}
CALL = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'


@pytest.fixture(scope="module")
def mixtral(demo_model_dir):
    return demo_model_dir("mixtral")


@pytest.fixture(scope="module")
def engine(mixtral):
    return LLMEngine.from_pretrained(mixtral, device="cpu", dtype="float32", config=EngineConfig(max_model_len=256))


class LLGuidanceProcessor(LogitsProcessor):
    """The constraint as transformers applies a logits processor: llguidance's matcher, fed each token
    generate appended, allows the tokens of its logit bias (0 for a token it cannot take)."""

    def __init__(self, model_dir, grammar: str, prompt_len: int):
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
        config = json.loads((model_dir / "config.json").read_text())
        ll = llguidance.LLTokenizer(tokenizer.backend_tokenizer.to_str(), n_vocab=config["vocab_size"],
                                    eos_token=config["eos_token_id"])
        self.matcher, self.prompt_len = llguidance.LLMatcher(ll, grammar), prompt_len

    def __call__(self, input_ids, scores):
        generated = input_ids.shape[1] - self.prompt_len
        if generated:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        allowed = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)
        return scores.masked_fill(allowed[: scores.shape[1]] == 0, float("-inf"))


def hf_constrained_greedy(model_dir, prompt, grammar: str, n: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    processors = LogitsProcessorList([LLGuidanceProcessor(model_dir, grammar, len(prompt))])
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             logits_processor=processors)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("steps", [1, 4])  # a step a call, and multi-step decode
@pytest.mark.parametrize("constraint, grammar", [
    (StructuredOutputs(json=PERSON),
     llguidance.LLMatcher.grammar_from_json_schema(PERSON, defaults={"whitespace_flexible": False})),
    (StructuredOutputs(grammar=CALL), llguidance.LLMatcher.grammar_from_lark(CALL)),
    (StructuredOutputs(regex=r"[a-z]{2,5}( [a-z]{2,5}){2}"), llguidance.LLMatcher.grammar_from_regex(
        r"[a-z]{2,5}( [a-z]{2,5}){2}")),
], ids=["json", "grammar", "regex"])
def test_greedy_is_transformers_generate_under_llguidances_mask(mixtral, constraint, grammar, steps):
    prompt = prompt_for(7, 9)
    theirs = hf_constrained_greedy(mixtral, prompt, grammar, 48)
    engine = LLMEngine.from_pretrained(mixtral, device="cpu", dtype="float32",
                                       config=EngineConfig(max_model_len=256, num_scheduler_steps=steps))
    [ours] = engine.generate([prompt], SamplingParams(max_tokens=48, temperature=0, structured_outputs=constraint))
    # transformers goes on to the end-of-sequence token, the only one left once the output is complete;
    # the engine stops at the token that completes it
    assert ours.finish_reason == "stop"
    assert theirs == ours.token_ids + [2]
    unconstrained = engine.generate([prompt], SamplingParams(max_tokens=len(ours.token_ids), temperature=0))[0]
    assert unconstrained.token_ids != ours.token_ids  # the constraint made a difference


@pytest.mark.parametrize("seed", range(4))
def test_sampled_outputs_are_what_they_were_constrained_to(engine, seed):
    prompt = prompt_for(seed, 5)
    cases = [
        (StructuredOutputs(json=json.dumps(PERSON)), lambda text: jsonschema.validate(json.loads(text), PERSON)),
        (StructuredOutputs(regex=r"[a-c]{3}-[0-9]{2}"), lambda text: re.fullmatch(r"[a-c]{3}-[0-9]{2}", text)
         or pytest.fail(text)),
        (StructuredOutputs(choice=["yes", "no", "maybe so"]), lambda text: text in ("yes", "no", "maybe so")
         or pytest.fail(text)),
        (StructuredOutputs(grammar=CALL), lambda text: re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", text)
         or pytest.fail(text)),
    ]
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=seed, structured_outputs=c) for c, _ in cases]
    outputs = engine.generate([prompt] * len(cases), params)  # batched together, each row its own matcher
    for (constraint, check), out in zip(cases, outputs):
        assert out.finish_reason == "stop", (constraint.kind, out.text)
        check(out.text)
        assert 2 not in out.token_ids  # finished by the constraint, not by an end-of-sequence token


def test_json_object_is_any_json_object(engine):
    # (sampled, a random model writes strings without end: greedy here)
    [out] = engine.generate([prompt_for(5, 5)], SamplingParams(
        max_tokens=40, temperature=0, structured_outputs=StructuredOutputs(json_object=True)))
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)


def test_unconstrained_rows_are_untouched_and_the_constraint_can_run_out_of_tokens(engine):
    prompt, other = prompt_for(1, 6), prompt_for(2, 6)
    alone = engine.generate([other], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    cut, together = engine.generate([prompt, other], [
        SamplingParams(max_tokens=5, temperature=0, structured_outputs=StructuredOutputs(json=PERSON)),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)])
    assert together.token_ids == alone.token_ids
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5
    assert engine.tokenizer.decode(cut.token_ids).startswith('{"')  # (the text may hold the prompt's last bytes)


@pytest.mark.parametrize("constraint, field, message", [
    (StructuredOutputs(json="{not json"), "structured_outputs.json", "is not JSON"),
    (StructuredOutputs(json="[1, 2]"), "structured_outputs.json", "JSON schema object"),
    (StructuredOutputs(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
     "structured_outputs.json", "does not compile"),
    (StructuredOutputs(regex="a(b"), "structured_outputs.regex", "does not compile"),
    (StructuredOutputs(grammar="start: undefined_rule"), "structured_outputs.grammar", "does not compile"),
])
def test_a_constraint_that_does_not_compile_is_refused_leaving_nothing(engine, constraint, field, message):
    used = {t: engine.block_manager.num_used_blocks(t) for t in (DEVICE, CPU)}
    with pytest.raises(InvalidRequest, match=message) as info:
        engine.add_request("bad", prompt_for(3, 4), SamplingParams(structured_outputs=constraint))
    assert info.value.field == field
    assert not engine.has_unfinished_requests() and engine.scheduler.num_waiting == 0
    assert {t: engine.block_manager.num_used_blocks(t) for t in (DEVICE, CPU)} == used


def test_a_model_without_a_tokenizer_refuses_structured_outputs(mixtral):
    engine = LLMEngine.from_pretrained(mixtral, device="cpu", config=EngineConfig(max_model_len=64))
    engine.tokenizer, engine._grammars = None, None  # as loaded from a directory with no tokenizer.json
    with pytest.raises(InvalidRequest, match="tokenizer") as info:
        engine.add_request("r", [5, 6], SamplingParams(structured_outputs=StructuredOutputs(regex="a+")))
    assert info.value.field == "structured_outputs"


def test_a_constraint_compiles_once_and_each_request_gets_its_own_matcher(engine, monkeypatch):
    made = []
    real = llguidance.LLMatcher

    class Counting:
        def __new__(cls, *args, **kwargs):
            made.append(args[1])
            return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", type("LLMatcher", (Counting,), {
        name: getattr(real, name) for name in ("validate_grammar_with_warnings", "grammar_from_regex")}))
    constraint = StructuredOutputs(regex="(ab|cd){3}")
    first, second = (engine.compile_constraint(SamplingParams(structured_outputs=constraint)) for _ in range(2))
    assert len(made) == 1 and first.matcher is not second.matcher
    b, a = engine.encode("b", add_special_tokens=False), engine.encode("a", add_special_tokens=False)
    assert len(a) == len(b) == 1
    assert first.matcher.consume_token(a[0]) and not second.matcher.consume_token(b[0])  # states apart


def test_a_structured_request_leaves_the_fused_greedy_path():
    constrained = SamplingParams(temperature=0, structured_outputs=StructuredOutputs(regex="x"))
    assert Sampler.argmax_only(SamplingParams(temperature=0)) and not Sampler.argmax_only(constrained)


def test_masks_allow_exactly_the_matchers_tokens_and_leave_other_rows(engine):
    constraint = engine.compile_constraint(SamplingParams(structured_outputs=StructuredOutputs(choice=["ab", "cd"])))
    vocab = engine.model_config.vocab_size
    logits = torch.randn(3, vocab)
    masked = structured.mask_logits(logits, [None, constraint, None])
    allowed = torch.frombuffer(bytearray(constraint.matcher.compute_logit_bias()), dtype=torch.uint8)[:vocab] > 0
    assert 0 < int(allowed.sum()) < vocab
    assert torch.equal(masked[1].isfinite(), allowed) and torch.equal(masked[1][allowed], logits[1][allowed])
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert structured.mask_logits(logits, [None, None, None]) is logits


def test_a_tokenizer_larger_than_the_logits_masks_the_logits_width(engine):
    # (a tokenizer may hold tokens past the model's vocabulary; the masks are the tokenizer's width)
    grammars = structured.Grammars(engine.tokenizer, 300, [2])
    constraint = grammars.compile(StructuredOutputs(regex="[a-z]+"))
    assert constraint.vocab_size == engine.tokenizer.get_vocab_size() > 300
    logits = torch.randn(1, 300)
    masked = structured.mask_logits(logits, [constraint])
    allowed = torch.frombuffer(bytearray(constraint.matcher.compute_logit_bias()), dtype=torch.uint8)[:300] > 0
    assert masked.shape == (1, 300) and torch.equal(masked[0].isfinite(), allowed)
