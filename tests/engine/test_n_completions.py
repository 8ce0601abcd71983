"""SamplingParams.n: a request of n completions, each sampled on its own, on one prompt prefilled once."""

from __future__ import annotations

import pytest

from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.sampling_params import DuplicateRequest, SamplingParams, StructuredOutputs
from tandem.kv.cache import CPU, DEVICE

PROMPT = [(7 * j) % 300 + 3 for j in range(30)]  # 7 full blocks of 4 and 2 tokens
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tandem.demo import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("mixtral"), arch="mixtral", initializer_range=0.2)


def engine(model_dir, **config):
    config.setdefault("block_size", 4)
    return LLMEngine.from_pretrained(model_dir, device="cpu", dtype="float32", config=EngineConfig(**config))


def with_n(params: SamplingParams, n: int, **changes) -> SamplingParams:
    return SamplingParams(**{**params.__dict__, "n": n, **changes})


def count_prefill(e: LLMEngine) -> list[int]:
    """The tokens of every prompt chunk the engine's steps compute (decodes left out), filled in as it steps."""
    counted, schedule = [], e.scheduler.schedule

    def counting():
        out = schedule()
        counted.extend(len(w.token_ids) for w in out.scheduled if not w.is_decode)
        return out

    e.scheduler.schedule = counting
    return counted


def test_greedy_completions_are_the_single_completion_n_times(model_dir):
    [one] = engine(model_dir).generate([PROMPT], GREEDY)
    results = engine(model_dir).generate([PROMPT, PROMPT[:9]], [with_n(GREEDY, 3), GREEDY])
    assert [(r.request_id == results[0].request_id, r.index) for r in results] == [(True, 0), (True, 1), (True, 2),
                                                                                   (False, 0)]
    assert [r.token_ids for r in results[:3]] == [one.token_ids] * 3
    assert [r.text for r in results[:3]] == [one.text] * 3
    assert all(r.finish_reason == "length" and r.num_prompt_tokens == 30 for r in results[:3])
    assert [r.num_cached_tokens for r in results[:3]] == [0, 28, 28]  # 1 and 2 took 0's prompt blocks


def test_seeded_completion_i_samples_as_a_request_seeded_seed_plus_i(model_dir):
    sampled = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=11, ignore_eos=True)
    results = engine(model_dir).generate([PROMPT], with_n(sampled, 3))
    for r in results:
        [alone] = engine(model_dir).generate([PROMPT], with_n(sampled, 1, seed=11 + r.index))
        assert r.token_ids == alone.token_ids
    assert len({tuple(r.token_ids) for r in results}) == 3
    unseeded = engine(model_dir).generate([PROMPT], with_n(sampled, 3, seed=None))
    assert len({tuple(r.token_ids) for r in unseeded}) == 3  # each draws on its own


def test_the_largest_seed_wraps_around_for_the_next_completions(model_dir):
    top = (1 << 64) - 1  # torch's largest seed
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=top, n=2, ignore_eos=True)
    results = engine(model_dir).generate([PROMPT], sampled)
    for index, seed in ((0, top), (1, 0)):
        [alone] = engine(model_dir).generate([PROMPT], with_n(sampled, 1, seed=seed))
        assert results[index].token_ids == alone.token_ids


@pytest.mark.parametrize("caching", [True, False])
def test_the_prompt_is_prefilled_once(model_dir, caching):
    e = engine(model_dir, enable_prefix_caching=caching)
    prefilled = count_prefill(e)
    results = e.generate([PROMPT], with_n(GREEDY, 4))
    assert len({tuple(r.token_ids) for r in results}) == 1
    if caching:  # the others compute the last partial block: 2 tokens each
        assert sum(prefilled) == 30 + 3 * 2 and e.stats().prefix_cache_hit_tokens == 3 * 28
    else:  # each prefills the prompt itself (see Scheduler.add)
        assert sum(prefilled) == 4 * 30
    assert e.stats().kv_blocks_used == {DEVICE: 0, CPU: 0}


def test_a_prompt_shorter_than_a_block_is_not_waited_for(model_dir):
    e = engine(model_dir, block_size=16)
    e.add_request("r", PROMPT[:10], with_n(GREEDY, 3))
    assert {o.index for o in e.step()} == {0, 1, 2}  # nothing to share: all three prefill in the first step


@pytest.mark.parametrize("steps_before", [0, 1, 3])  # all waiting; 0 prefilled and the others queued; decoding
def test_abort_cancels_every_completion_and_frees_every_block(model_dir, steps_before):
    e = engine(model_dir)
    e.add_request("other", PROMPT[:13], GREEDY)
    e.step()
    used = e.stats().kv_blocks_used[DEVICE]
    e.add_request("r", PROMPT, with_n(GREEDY, 4, max_tokens=50))
    for _ in range(steps_before):
        e.step()
    outputs = e.abort_request("r")
    assert [(o.request_id, o.index, o.finished, o.finish_reason) for o in outputs] == \
        [("r", i, True, "cancelled") for i in range(4)]
    assert "r" not in e.requests and e.stats().num_waiting == 0 and e.stats().num_running == 1
    assert e.stats().kv_blocks_used[DEVICE] <= used + 1  # "other"'s, grown by at most a block
    assert e.abort_request("r") == []
    e.abort_request("other")
    assert e.stats().kv_blocks_used[DEVICE] == 0 and not e.has_unfinished_requests()


def test_a_finished_completion_frees_its_blocks_while_the_others_run(model_dir):
    sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=4, n=2, ignore_eos=True)
    free = engine(model_dir).generate([PROMPT], sampled)
    stop = next(t for t in free[1].token_ids[2:12] if t not in free[0].token_ids)  # ends 1 before 0
    e = engine(model_dir)
    e.add_request("r", PROMPT, with_n(sampled, 2, stop_token_ids=(stop,)))
    table_of = e.block_manager.block_table
    first = e.requests["r"].completions[0].seq
    got = {0: [], 1: []}
    while e.has_unfinished_requests():
        for out in e.step():
            got[out.index] += out.new_token_ids
            if out.index == 1 and out.finished:
                assert out.finish_reason == "stop" and got[1][-1] == stop
                assert e.has_unfinished_requests() and "r" in e.requests
                assert e.stats().kv_blocks_used[DEVICE] == len(table_of(first))  # 0's blocks, no more
    assert got[0] == free[0].token_ids and got[1] == free[1].token_ids[:free[1].token_ids.index(stop) + 1]
    assert e.stats().kv_blocks_used[DEVICE] == 0


def test_stop_strings_and_logprobs_apply_to_each_completion(model_dir):
    [free] = engine(model_dir).generate([PROMPT], GREEDY)
    stop = free.text[4:7]
    params = with_n(GREEDY, 1, stop=(stop,), logprobs=2)
    [alone] = engine(model_dir).generate([PROMPT], params)
    assert alone.finish_reason == "stop" and stop not in alone.text
    results = engine(model_dir).generate([PROMPT], with_n(params, 3))
    for r in results:
        assert (r.text, r.token_ids, r.finish_reason) == (alone.text, alone.token_ids, "stop")
        assert [[t for t, _ in e.top] for e in r.logprobs] == [[t for t, _ in e.top] for e in alone.logprobs]
        assert [e.logprob for e in r.logprobs] == pytest.approx([e.logprob for e in alone.logprobs], abs=1e-5)


def test_prompt_logprobs_are_computed_and_returned_once(model_dir):
    params = with_n(GREEDY, 1, prompt_logprobs=1)
    [alone] = engine(model_dir).generate([PROMPT], params)
    e = engine(model_dir)
    prefilled = count_prefill(e)
    e.add_request("r", PROMPT, with_n(params, 3))
    scored, tokens = [], {0: [], 1: [], 2: []}
    while e.has_unfinished_requests():
        for out in e.step():
            tokens[out.index] += out.new_token_ids
            if out.prompt_logprobs is not None:
                scored.append((out.index, out.prompt_logprobs))
    [(index, prompt_logprobs)] = scored
    assert index == 0 and [p and p.rank for p in prompt_logprobs] == [p and p.rank for p in alone.prompt_logprobs]
    assert sum(prefilled) == 30 + 2 * 2  # the others took the blocks 0 computed to score the prompt
    assert list(tokens.values()) == [alone.token_ids] * 3
    results = engine(model_dir).generate([PROMPT], with_n(params, 2))
    assert results[0].prompt_logprobs is not None and results[1].prompt_logprobs is None


def test_each_completion_has_a_structured_output_matcher_of_its_own(model_dir):
    e = engine(model_dir)
    choice = ("yes", "no", "maybe")
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1, n=4,
                            structured_outputs=StructuredOutputs(choice=choice))
    e.add_request("r", e.encode("Is it sunny? Answer:"), params)
    assert len({id(c.seq.constraint) for c in e.requests["r"].completions}) == 4
    texts = {0: "", 1: "", 2: "", 3: ""}
    while e.has_unfinished_requests():
        for out in e.step():
            texts[out.index] += out.text
            assert not out.finished or out.finish_reason == "stop"
    assert all(t in choice for t in texts.values()) and len(set(texts.values())) > 1, texts


@pytest.mark.parametrize("stream", [False, True])
def test_multi_step_decode_runs_the_completions_together(model_dir, stream):
    sampled = SamplingParams(max_tokens=13, temperature=0.9, seed=21, n=3, ignore_eos=True)
    want = {r.index: r.token_ids for r in engine(model_dir).generate([PROMPT], sampled)}
    e = engine(model_dir, num_scheduler_steps=4)
    runs, schedule = [], e.scheduler.schedule
    e.scheduler.schedule = lambda: (out := schedule(), runs.append([w.num_steps for w in out.scheduled]))[0]
    e.add_request("r", PROMPT, sampled)
    got = {0: [], 1: [], 2: []}

    def take(outputs):
        for out in outputs:
            got[out.index] += out.new_token_ids

    while e.has_unfinished_requests():
        take(e.step(emit=take) if stream else e.step())
    assert got == want
    assert [4, 4, 4] in runs  # the three decoded 4 tokens a step


def test_request_ids_stay_unique_while_any_completion_runs(model_dir):
    e = engine(model_dir)
    e.add_request("r", PROMPT, with_n(GREEDY, 2, max_tokens=3))
    e.add_request("r#1", PROMPT[:9], GREEDY)  # not completion 1 of "r": a request of its own
    e.add_request("r#0#1", PROMPT[:9], with_n(GREEDY, 2))
    finished = set()
    while "r" in e.requests:
        with pytest.raises(DuplicateRequest):
            e.add_request("r", PROMPT, GREEDY)
        finished |= {(o.request_id, o.index) for o in e.step() if o.finished}
    assert ("r", 0) in finished and ("r", 1) in finished
    e.add_request("r", PROMPT, GREEDY)  # free again once all of its completions are
    while e.has_unfinished_requests():
        finished |= {(o.request_id, o.index) for o in e.step() if o.finished}
    assert finished == {("r", 0), ("r", 1), ("r#1", 0), ("r#0#1", 0), ("r#0#1", 1)}
