"""The engine end to end on a tiny checkpoint: tiers, preemption, prefix cache, cancel, stops, seeds,
multi-step decode."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.sampling_params import InvalidRequest, SamplingParams
from tandem.engine.scheduler import QueueFull
from tandem.experts.base import ExpertsUnavailable
from tandem.kv.cache import CPU, DEVICE
from tier_probe import count_tier_traffic

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tandem.demo import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("mixtral"), arch="mixtral", initializer_range=0.2)


def engine(model_dir, **config):
    return LLMEngine.from_pretrained(model_dir, device="cpu", dtype="float32", config=EngineConfig(**config))


def prompts(n, length=13):
    return [[(7 * i + 3 * j) % 300 + 3 for j in range(length + i)] for i in range(n)]


def test_preemption_by_swap_to_cpu_tier_loses_nothing(model_dir):
    reference = [c.token_ids for c in engine(model_dir).generate(prompts(4), GREEDY)]
    # 4 sequences of ~40 tokens need ~40 blocks of 4; 16 device blocks force swaps to the CPU tier.
    small = engine(model_dir, block_size=4, num_device_blocks=16, num_cpu_blocks=64, max_model_len=64,
                   cpu_decode=False)
    swaps, cpu_tokens = count_tier_traffic(small)
    results = small.generate(prompts(4), GREEDY)
    assert [c.token_ids for c in results] == reference
    assert swaps["out"] and swaps["in"] and not cpu_tokens[0], (swaps, cpu_tokens)
    stats = small.stats()
    assert stats.kv_blocks_used[CPU] == 0 and stats.num_swapped == 0


def test_sequences_outgrowing_the_device_tier_decode_on_the_cpu_tier(model_dir):
    reference = [c.token_ids for c in engine(model_dir).generate(prompts(4), GREEDY)]
    # The device tier holds 32 tokens: less than one sequence at full length (16 + 24), so
    # sequences move to the CPU tier mid-decode and finish there.
    small = engine(model_dir, block_size=4, num_device_blocks=8, num_cpu_blocks=64, max_model_len=64,
                   max_num_batched_tokens=16)
    swaps, cpu_tokens = count_tier_traffic(small)
    seen_offloaded = []
    real_step = small.step
    small.step = lambda: (seen_offloaded.append(small.stats().num_offloaded), real_step())[1]
    results = small.generate(prompts(4), GREEDY)
    assert [c.token_ids for c in results] == reference
    assert swaps["out"] and not swaps["in"] and cpu_tokens[0] >= 24, (swaps, cpu_tokens)
    assert max(seen_offloaded) >= 2
    stats = small.stats()
    assert stats.kv_blocks_used == {DEVICE: 0, CPU: 0} and stats.num_offloaded == 0


def test_bytes_left_in_free_slots_never_reach_the_tokens(model_dir):
    """Slots a sequence has not written hold what was there before (another request's KV, a NaN it
    computed, an earlier run's bytes in a reused shared-memory tier): none of it may change a token."""
    reference = [c.token_ids for c in engine(model_dir).generate(prompts(4), GREEDY)]
    small = engine(model_dir, block_size=4, num_device_blocks=8, num_cpu_blocks=64, max_model_len=64,
                   max_num_batched_tokens=16)  # chunks, partial blocks and both tiers
    for tensors in small.cache.tiers.values():
        for tensor in tensors.values():
            tensor.fill_(float("nan"))
    swaps, cpu_tokens = count_tier_traffic(small)
    assert [c.token_ids for c in small.generate(prompts(4), GREEDY)] == reference
    assert swaps["out"] and cpu_tokens[0]


def test_without_cpu_decode_the_device_tier_must_hold_a_whole_sequence(model_dir):
    with pytest.raises(ValueError, match="device KV tier holds 32 tokens, fewer than max_model_len=64"):
        engine(model_dir, block_size=4, num_device_blocks=8, num_cpu_blocks=64, max_model_len=64, cpu_decode=False)
    with pytest.raises(ValueError, match="device KV tier holds 32 tokens and the CPU tier 16"):
        engine(model_dir, block_size=4, num_device_blocks=8, num_cpu_blocks=4, max_model_len=64)


def test_tiers_too_small_are_refused_naming_their_settings_and_leave_no_files(model_dir, tmp_path):
    shm = tmp_path / "shm" / "kv"
    with pytest.raises(ValueError, match=r"fewer than max_model_len=64; .* \(device tier: 8 blocks of 4 tokens from "
                                         r"num_device_blocks .*; CPU tier: 4 blocks from num_cpu_blocks"):
        engine(model_dir, block_size=4, num_device_blocks=8, num_cpu_blocks=4, max_model_len=64, kv_shm_path=str(shm))
    assert list(shm.parent.glob("*")) == []  # refused before its CPU tier's files were made
    with pytest.raises(ValueError, match=r"CPU tier: 0 blocks from cpu_kv_gib=0.0 \(--cpu-kv-gib\)"):
        engine(model_dir, block_size=4, num_device_blocks=8, cpu_kv_gib=0.0, max_model_len=64)
    with pytest.raises(ValueError, match=r"no room for a single KV block .* 0 blocks of 16 tokens from "
                                         r"device_kv_gib=1e-09"):
        engine(model_dir, device_kv_gib=1e-9)
    for field, value in (("num_device_blocks", 0), ("num_cpu_blocks", -1)):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: value})
    e = engine(model_dir, block_size=4, num_device_blocks=16, num_cpu_blocks=4, max_model_len=64, kv_shm_path=str(shm))
    assert sorted(p.name for p in shm.parent.glob("*")) == ["kv.k", "kv.v"]
    e.close()
    assert list(shm.parent.glob("*")) == []


def test_preemption_by_recompute_when_cpu_tier_is_full_loses_nothing(model_dir):
    reference = [c.token_ids for c in engine(model_dir).generate(prompts(4), GREEDY)]
    small = engine(model_dir, block_size=4, num_device_blocks=16, num_cpu_blocks=0, max_model_len=64,
                   enable_prefix_caching=False)
    assert [c.token_ids for c in small.generate(prompts(4), GREEDY)] == reference
    assert small.stats().kv_blocks_used[DEVICE] == 0


def test_prefix_cache_reuses_blocks_and_skips_prefill(model_dir):
    e = engine(model_dir, block_size=4)
    shared = prompts(1, 30)[0]
    [first] = e.generate([shared + [5, 6]], GREEDY)
    assert first.num_cached_tokens == 0
    [second] = e.generate([shared + [9, 10, 11]], GREEDY)
    assert second.num_cached_tokens == 28  # the 7 full blocks of the shared 30-token prefix
    assert e.stats().prefix_cache_hit_tokens == 28
    # Cached blocks change nothing: a fresh engine with no cache gives the same tokens.
    [fresh] = engine(model_dir, enable_prefix_caching=False).generate([shared + [9, 10, 11]], GREEDY)
    assert second.token_ids == fresh.token_ids


def test_cancel_frees_blocks_at_once(model_dir):
    e = engine(model_dir, block_size=4)
    e.add_request("a", prompts(1, 20)[0], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    e.add_request("b", prompts(2, 9)[1], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        e.step()
    assert e.stats().kv_blocks_used[DEVICE] > 0
    [out] = e.abort_request("a")
    assert out.finished and out.finish_reason == "cancelled"
    e.abort_request("b")
    assert e.stats().kv_blocks_used[DEVICE] == 0
    assert not e.has_unfinished_requests()
    assert e.abort_request("a") == []


def test_finish_reasons_stop_token_and_length(model_dir):
    e = engine(model_dir)
    [free] = e.generate(prompts(1), GREEDY)
    assert free.finish_reason == "length" and len(free.token_ids) == 24
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    [stopped] = e.generate(prompts(1), SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_id,)))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]


def test_an_unset_max_tokens_is_16_or_what_the_context_has_left(model_dir):
    e = engine(model_dir, max_model_len=64)
    unset = SamplingParams(temperature=0.0, ignore_eos=True)
    [short, near_the_end] = e.generate([[5] * 10, [5] * 59], unset)
    assert (len(short.token_ids), short.finish_reason) == (16, "length")
    assert (len(near_the_end.token_ids), near_the_end.finish_reason) == (5, "length")  # the context's end
    with pytest.raises(InvalidRequest, match="max_tokens"):  # one that is set must fit
        e.add_request("r", [5] * 59, SamplingParams(max_tokens=6))


def test_stop_string_truncates_text(model_dir):
    e = engine(model_dir)
    [free] = e.generate(prompts(1), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    text = free.text
    assert len(text) > 6
    stop = text[3:6]
    [stopped] = e.generate(prompts(1), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                      stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]
    assert stop not in stopped.text


def finish(e: LLMEngine, max_steps: int = 400) -> dict[str, list[int]]:
    """Steps until nothing is left, at most `max_steps` (a scheduler that never admits fails)."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not e.has_unfinished_requests():
            return tokens
        for out in e.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError(f"not finished after {max_steps} steps: {e.stats()}")


def test_a_cached_prefix_longer_than_the_device_tier_leaves_room_for_a_chunk(model_dir):
    # A 40-token prompt on a device tier of 32 tokens: prefilled in chunks, then decoded on the
    # CPU tier. Its 8 full blocks stay cached on the device: run again, all 8 hit, and with the
    # next chunk they would need 9 of the tier's 8 blocks; only 7 can be used.
    e = engine(model_dir, block_size=4, num_device_blocks=8, num_cpu_blocks=64, max_model_len=64,
               max_num_batched_tokens=16)
    prompt = prompts(1, 40)[0]
    e.add_request("first", prompt, GREEDY)
    first = finish(e)["first"]
    e.add_request("again", prompt, GREEDY)
    e.add_request("behind", prompts(2)[1], GREEDY)  # waits behind it: first come, first served
    again = finish(e)
    assert again["again"] == first
    assert again["behind"] == engine(model_dir).generate([prompts(2)[1]], GREEDY)[0].token_ids
    assert e.block_manager.prefix_cache_hit_tokens > 0  # the prefix cache was used, not bypassed
    assert sum(e.stats().kv_blocks_used.values()) == 0


def test_an_abort_during_a_streamed_run_leaves_the_others_their_own_tokens(model_dir):
    requests = {rid: (p, GREEDY) for rid, p in zip("abc", prompts(3))}
    reference, _ = run(engine(model_dir, num_scheduler_steps=6), requests, stream=True)
    e = engine(model_dir, num_scheduler_steps=6)
    for rid, (prompt, params) in requests.items():
        e.add_request(rid, prompt, params)
    got: dict[str, list[int]] = {rid: [] for rid in requests}

    def emit(outputs):
        for out in outputs:
            got[out.request_id].extend(out.new_token_ids)
        if len(got["a"]) == 3 and "a" in e.requests:
            e.abort_request("a")  # a caller cancelling from emit, inside the run

    while e.has_unfinished_requests():
        for out in e.step(emit=emit):
            got[out.request_id].extend(out.new_token_ids)
    assert got["a"] == reference["a"][0][:3]
    assert got["b"] == reference["b"][0] and got["c"] == reference["c"][0]


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 1.5, "7", True])
def test_a_seed_torch_cannot_take_is_refused(seed):
    with pytest.raises(InvalidRequest, match="seed"):
        SamplingParams(max_tokens=4, seed=seed)


def test_a_request_that_fails_to_be_added_leaves_nothing_queued(model_dir):
    e = engine(model_dir)
    params = SamplingParams(max_tokens=4, seed=1)
    object.__setattr__(params, "seed", 2**64)  # past the checks: whatever raises in add_request
    with pytest.raises((RuntimeError, ValueError)):
        e.add_request("bad", prompts(1)[0], params)
    assert not e.has_unfinished_requests() and e.stats().num_waiting == 0
    [out] = e.generate(prompts(1), GREEDY)  # and the engine goes on
    assert out.finish_reason == "length"


def test_a_stop_string_completed_by_the_last_allowed_token_still_stops(model_dir):
    e = engine(model_dir)
    n = 12
    [full] = e.generate(prompts(1), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    [before] = e.generate(prompts(1), SamplingParams(max_tokens=n - 1, temperature=0.0, ignore_eos=True))
    assert full.text.startswith(before.text) and len(full.text) > len(before.text)
    # the shortest tail of the text that occurs nowhere earlier: it ends with the last token's text
    stop = next(full.text[-m:] for m in range(1, len(full.text) + 1) if full.text.find(full.text[-m:]) == len(
        full.text) - m)
    [stopped] = e.generate(prompts(1), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: -len(stop)]


def test_stop_strings_that_never_occur_change_no_text(model_dir):
    # A stop string's length of text is held back while it may begin there; a request that ends
    # for another reason (a stop token, its length) still gets all of it.
    e = engine(model_dir)
    [free] = e.generate(prompts(1), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    never = "\x00never\x00"
    stop_id = free.token_ids[9]
    for params in (dict(max_tokens=16, ignore_eos=True), dict(max_tokens=16, stop_token_ids=(stop_id,))):
        [plain] = e.generate(prompts(1), SamplingParams(temperature=0.0, **params))
        [held] = e.generate(prompts(1), SamplingParams(temperature=0.0, stop=(never,), **params))
        assert held.finish_reason == plain.finish_reason
        assert held.text == plain.text and len(plain.text) > len(never)


def test_seeded_sampling_is_reproducible_and_independent_of_batch(model_dir):
    e = engine(model_dir)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    [alone] = e.generate(prompts(1), params)
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    together = e.generate(prompts(3), [params, others, others])
    assert together[0].token_ids == alone.token_ids
    [other_seed] = e.generate(prompts(1), SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True))
    assert other_seed.token_ids != alone.token_ids


@pytest.mark.parametrize("prompt,params,field", [
    ([], GREEDY, "prompt"),
    ([1, 100000], GREEDY, "prompt_token_ids"),
    ([1, 2], SamplingParams(max_tokens=9000), "max_tokens"),
])
def test_bad_requests_name_the_field_and_leave_nothing_behind(model_dir, prompt, params, field):
    e = engine(model_dir)
    with pytest.raises(InvalidRequest) as err:
        e.add_request("x", prompt, params)
    assert err.value.field == field
    assert not e.has_unfinished_requests()
    e.add_request("x", [1, 2, 3], GREEDY)  # the id is free again
    with pytest.raises(InvalidRequest):
        e.add_request("x", [1, 2, 3], GREEDY)


def test_waiting_queue_limit(model_dir):
    e = engine(model_dir, max_waiting=2)
    e.add_request("a", [1, 2], GREEDY)
    e.add_request("b", [1, 2], GREEDY)
    with pytest.raises(QueueFull):
        e.add_request("c", [1, 2], GREEDY)
    assert e.stats().num_waiting == 2


def test_experts_unavailable_keeps_the_step_pending_and_loses_nothing(model_dir):
    reference = [c.token_ids for c in engine(model_dir).generate(prompts(2), GREEDY)]
    e = engine(model_dir)
    executor = e.model.model.layers[0].mlp.executor
    real, failures = executor.forward, iter([True, False, False, True, True] + [False] * 10_000)

    def flaky(*args):
        if next(failures):
            raise ExpertsUnavailable("experts process is down")
        return real(*args)

    executor.forward = flaky
    for rid, prompt in zip("ab", prompts(2)):
        e.add_request(rid, prompt, GREEDY)
    tokens, raised = {"a": [], "b": []}, 0
    while e.has_unfinished_requests():
        try:
            outputs = e.step()
        except ExpertsUnavailable:
            raised += 1
            continue
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    assert raised == 3
    assert [tokens["a"], tokens["b"]] == reference


def test_a_failed_forward_pass_finishes_its_requests_with_error_and_frees_blocks(model_dir):
    e = engine(model_dir)
    e.add_request("a", prompts(1)[0], GREEDY)
    e.runner.model.compute_logits = lambda hidden: (_ for _ in ()).throw(RuntimeError("boom"))
    [out] = e.step()
    assert out.finished and out.finish_reason == "error"
    assert not e.has_unfinished_requests() and e.stats().kv_blocks_used[DEVICE] == 0


def fail_one_copy(e: LLMEngine, direction: str) -> dict:
    """Makes the engine's first KV copy in `direction` ("out": device -> CPU, "in": CPU -> device)
    copy one block and raise, as a CUDA error mid-copy would. Returns what it saw, filled in as the
    engine steps: "lost" (the requests whose tables name a block that copy wrote) and "step" (the
    engine step it failed in, counted from 0)."""
    real, schedule, seen = e.cache.swap, e.scheduler.schedule, {"steps": 0}
    bm = e.block_manager

    def counted():
        seen["steps"] += 1
        return schedule()

    def swap(pairs, src, dst):
        if pairs and (src == DEVICE) == (direction == "out") and "lost" not in seen:
            written = {d for _, d in pairs}
            seen["lost"] = {rid for rid, req in e.requests.items() for c in req.completions
                            if bm.tier_of(c.seq) == dst and written & set(bm.block_table(c.seq))}
            seen["step"] = seen["steps"] - 1
            real(pairs[:1], src, dst)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        real(pairs, src, dst)

    e.cache.swap, e.scheduler.schedule = swap, counted
    return seen


@pytest.mark.parametrize("direction,config", [
    ("out", dict(num_device_blocks=16, cpu_decode=False)),  # preempted by swapping out
    ("in", dict(num_device_blocks=16, cpu_decode=False)),  # swapped back in
    ("out", dict(num_device_blocks=8, max_num_batched_tokens=16)),  # offloaded, running on the CPU tier
], ids=["swap-out", "swap-in", "offload"])
def test_a_failed_kv_copy_fails_only_the_requests_whose_blocks_it_moved(model_dir, caplog, direction, config):
    requests = {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts(4))}
    reference, _ = run(engine(model_dir), requests)
    e = engine(model_dir, block_size=4, num_cpu_blocks=64, max_model_len=64, **config)
    seen = fail_one_copy(e, direction)
    with caplog.at_level("ERROR", logger="tandem.engine.llm_engine"):
        got, steps = run(e, requests)
    lost = seen["lost"]
    assert lost and lost != set(requests), seen
    for rid, (tokens, _, reason) in got.items():
        if rid in lost:  # ended by the failure, with the tokens it had
            assert reason == "error" and tokens == reference[rid][0][:len(tokens)], rid
        else:
            assert got[rid] == reference[rid], rid
    # The step the copy failed in reported the lost as finished, and ran the rest of its batch: on a
    # swap-out, the sequence that needed the blocks decoded there.
    [failed_step] = steps[seen["step"]]
    assert all(failed_step[rid] == 0 for rid in lost)
    assert direction == "in" or any(n for rid, n in failed_step.items() if rid not in lost), failed_step
    [record] = [r for r in caplog.records if r.name == "tandem.engine.llm_engine"]
    assert "copying KV blocks" in record.getMessage() and record.exc_info[0] is RuntimeError
    stats = e.stats()
    assert stats.kv_blocks_used == {DEVICE: 0, CPU: 0} and stats.num_swapped == stats.num_running == 0
    # The engine serves on, swapping again.
    swaps, _ = count_tier_traffic(e)
    again, _ = run(e, {f"again-{rid}": r for rid, r in requests.items()})
    assert {rid[len("again-"):]: r for rid, r in again.items()} == reference and swaps[direction]
    assert sum(e.stats().kv_blocks_used.values()) == 0


def test_requests_lost_to_a_failed_copy_are_reported_once_after_an_experts_outage(model_dir):
    # The copy fails, then the same step's forward pass finds the experts down: the step raises and
    # stays pending; the lost requests' "error" comes with the step once it runs.
    requests = {f"r{i}": p for i, p in enumerate(prompts(4))}
    e = engine(model_dir, block_size=4, num_device_blocks=16, num_cpu_blocks=64, max_model_len=64, cpu_decode=False)
    seen = fail_one_copy(e, "out")
    executor = e.model.model.layers[0].mlp.executor
    real, downs = executor.forward, [0]

    def flaky(*args):
        if "lost" in seen and downs[0] < 2:
            downs[0] += 1
            raise ExpertsUnavailable("experts process is down")
        return real(*args)

    executor.forward = flaky
    for rid, prompt in requests.items():
        e.add_request(rid, prompt, GREEDY)
    reasons, raised = {}, 0
    while e.has_unfinished_requests():
        try:
            outputs = e.step()
        except ExpertsUnavailable:
            raised += 1
            continue
        for out in outputs:
            if out.finished:
                assert out.request_id not in reasons  # reported once
                reasons[out.request_id] = out.finish_reason
    assert raised == 2 and seen["lost"]
    assert reasons == {rid: "error" if rid in seen["lost"] else "length" for rid in requests}
    assert sum(e.stats().kv_blocks_used.values()) == 0


# Multi-step decode (`num_scheduler_steps`): several decode tokens per engine step, each sampled
# token fed to the next forward pass. The tokens must be the single-step engine's, token for
# token, whatever stops a sequence inside a run; KV blocks come back; an outage loses nothing.


def run(e: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], stream: bool = False):
    """Step to the end; (tokens, text, finish reason) per request, and the tokens each step returned.
    stream: the steps stream (LLMEngine.step's emit), and a step's outputs are those emitted during it
    and then returned, one dict of token counts per output batch."""
    for rid, (prompt, params) in requests.items():
        e.add_request(rid, prompt, params)
    got = {rid: ([], [], None) for rid in requests}
    per_step = []
    while e.has_unfinished_requests():
        batches = []
        batches.append(e.step(emit=batches.append) if stream else e.step())
        batches = [b for b in batches if b] if stream else batches
        per_step.append([{o.request_id: len(o.new_token_ids) for o in b} for b in batches])
        for o in (o for b in batches for o in b):
            tokens, texts, _ = got[o.request_id]
            tokens.extend(o.new_token_ids)
            texts.append(o.text)
            got[o.request_id] = (tokens, texts, o.finish_reason)
    return {rid: (t, "".join(x), r) for rid, (t, x, r) in got.items()}, per_step


MIXED = [
    GREEDY,
    SamplingParams(max_tokens=19, temperature=0.8, top_p=0.9, seed=3),  # cut short by max_tokens mid-run
    SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=1.0, top_k=5, seed=9, ignore_eos=True),
]


@pytest.mark.parametrize("stream", [False, True], ids=["returned", "streamed"])
def test_multi_step_decode_gives_the_single_step_tokens(model_dir, stream):
    requests = {f"r{i}": (p, params) for i, (p, params) in enumerate(zip(prompts(4), MIXED))}
    want, single_steps = run(engine(model_dir), requests)
    e = engine(model_dir, num_scheduler_steps=4)
    got, steps = run(e, requests, stream)
    assert got == want
    # The decodes came four tokens a step (fewer where max_tokens cut the run), in fewer steps:
    # returned at the end of the step in one output per request, or streamed a token at a time,
    # one batch of outputs as each of the run's steps ended.
    sizes = [n for step in steps for batch in step for n in batch.values()]
    assert max(sizes) == (1 if stream else 4)
    assert max(len(step) for step in steps) == (4 if stream else 1)
    assert len(steps) < len(single_steps) / 2
    stats = e.stats()
    assert stats.kv_blocks_used[DEVICE] == 0 and stats.num_running == 0


@pytest.mark.parametrize("stream", [False, True], ids=["returned", "streamed"])
def test_a_stop_token_inside_a_run_drops_the_tokens_after_it(model_dir, stream):
    e = engine(model_dir)
    free, _ = run(e, {"a": (prompts(1)[0], GREEDY)})
    tokens = free["a"][0]
    stop_id = tokens[5]  # the 6th token: inside the second run of four
    cut = tokens.index(stop_id) + 1
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_id,))
    e = engine(model_dir, num_scheduler_steps=4)
    got, _ = run(e, {"a": (prompts(1)[0], params)}, stream)
    assert got["a"][0] == tokens[:cut] and got["a"][2] == "stop"
    assert e.stats().kv_blocks_used[DEVICE] == 0
    # Returned, the run goes to its end; streamed, it ends with the step that stops its last sequence.
    run_steps = e.model.native_path.greedy_steps  # the prefill sampled the first token
    assert run_steps == (cut - 1 if stream else -(-(cut - 1) // 4) * 4), run_steps


@pytest.mark.parametrize("stream", [False, True], ids=["returned", "streamed"])
def test_a_stop_string_inside_a_run_drops_the_tokens_after_it(model_dir, stream):
    requests = {"a": (prompts(1)[0], GREEDY)}
    free, _ = run(engine(model_dir), requests)
    text = free["a"][1]
    stop = text[5:8]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
    want, _ = run(engine(model_dir), {"a": (prompts(1)[0], params)})
    got, _ = run(engine(model_dir, num_scheduler_steps=4), {"a": (prompts(1)[0], params)}, stream)
    assert got == want
    assert got["a"][2] == "stop" and got["a"][1] == text[: text.index(stop)]
    assert len(got["a"][0]) < len(free["a"][0])


def test_a_streamed_run_ends_when_the_caller_has_work(model_dir):
    # interrupted() true ends the run after the step that asked: a request can then be admitted
    # at once, and the tokens are those of a run never interrupted.
    reference, _ = run(engine(model_dir), {"a": (prompts(1)[0], GREEDY), "b": (prompts(2)[1], GREEDY)})
    e = engine(model_dir, num_scheduler_steps=8)
    e.add_request("a", prompts(1)[0], GREEDY)
    tokens, emitted, asked = {"a": [], "b": []}, [], []
    for o in e.step():  # the prefill
        tokens["a"] += o.new_token_ids
    assert e.step(emit=emitted.append, interrupted=lambda: asked.append(1) or len(asked) == 3) == []
    assert [[len(o.new_token_ids) for o in b] for b in emitted] == [[1], [1], [1]]
    e.add_request("b", prompts(2)[1], GREEDY)
    for o in (o for b in emitted for o in b):
        tokens["a"] += o.new_token_ids
    outputs = e.step(emit=emitted.append)  # b's prefill beside a's decode: one step, returned
    assert {o.request_id: len(o.new_token_ids) for o in outputs} == {"a": 1, "b": 1}
    for o in outputs:
        tokens[o.request_id] += o.new_token_ids
    while e.has_unfinished_requests():
        emitted = []
        returned = e.step(emit=emitted.append)
        for o in [*(o for b in emitted for o in b), *returned]:
            tokens[o.request_id] += o.new_token_ids
    assert tokens == {rid: reference[rid][0] for rid in "ab"}
    assert e.stats().kv_blocks_used[DEVICE] == 0


def test_a_streamed_run_that_fails_fails_only_the_unfinished(model_dir):
    # b stops at the run's first step; the second step's emit raises (as a bug in the caller
    # would): the error comes out of the native call, a ends with "error", b keeps its "stop".
    free, _ = run(engine(model_dir), {"b": (prompts(2)[1], GREEDY)})
    stop_b = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(free["b"][0][1],))
    e = engine(model_dir, num_scheduler_steps=4)
    e.add_request("a", prompts(1)[0], GREEDY)
    e.add_request("b", prompts(2)[1], stop_b)
    e.step()  # both prefills
    emitted = []

    def emit(outputs):
        emitted.append(outputs)
        if len(emitted) == 2:
            raise RuntimeError("the caller's bug")

    failed = e.step(emit=emit)
    assert [(o.request_id, o.finished, o.finish_reason) for o in emitted[0]] == [
        ("a", False, None), ("b", True, "stop")]
    assert [(o.request_id, o.finish_reason) for o in failed] == [("a", "error")]
    assert not e.has_unfinished_requests() and e.stats().kv_blocks_used[DEVICE] == 0


def test_new_requests_are_prefilled_without_waiting_for_a_run(model_dir):
    # Multi-step runs only while nothing waits: a request added mid-decode is prefilled next step.
    reference, _ = run(engine(model_dir), {"a": (prompts(1)[0], GREEDY), "b": (prompts(2)[1], GREEDY)})
    e = engine(model_dir, num_scheduler_steps=8)
    e.add_request("a", prompts(1)[0], GREEDY)
    tokens = {"a": [], "b": []}
    for expect in ({"a": 1}, {"a": 8}):  # the prefill's token, then a run of 8
        outputs = e.step()
        assert {o.request_id: len(o.new_token_ids) for o in outputs} == expect
        tokens["a"] += outputs[0].new_token_ids
    e.add_request("b", prompts(2)[1], GREEDY)
    outputs = e.step()
    assert {o.request_id: len(o.new_token_ids) for o in outputs} == {"a": 1, "b": 1}  # a's decode, b's prefill
    for o in outputs:
        tokens[o.request_id] += o.new_token_ids
    while e.has_unfinished_requests():
        for o in e.step():
            tokens[o.request_id] += o.new_token_ids
    assert tokens == {rid: reference[rid][0] for rid in "ab"}
    assert e.stats().kv_blocks_used[DEVICE] == 0


def step_through_outages(e: LLMEngine, requests: dict[str, list[int]], stream: bool = False):
    """Greedy requests stepped to the end, retrying the steps that raise ExpertsUnavailable: the
    tokens per request, the token counts of each step that returned, and when steps raised (how
    many had returned before)."""
    for rid, prompt in requests.items():
        e.add_request(rid, prompt, GREEDY)
    tokens, sizes, raised = {rid: [] for rid in requests}, [], []
    while e.has_unfinished_requests():
        emitted = []
        try:
            outputs = e.step(emit=emitted.extend if stream else None)
        except ExpertsUnavailable:
            assert not emitted  # a step that raises emitted nothing
            raised.append(len(sizes))
            continue
        outputs = emitted + outputs
        sizes.append([len(o.new_token_ids) for o in outputs])
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens, sizes, raised


@pytest.mark.parametrize("stream", [False, True], ids=["returned", "streamed"])
def test_experts_unavailable_inside_a_greedy_run_keeps_the_steps_it_finished(model_dir, stream):
    # A native greedy run writes a column of tokens as each of its steps ends. The experts process
    # lost at a run's second step keeps the first step's token; lost at the first step, the engine
    # step raises and stays pending; the tokens end up those of a run without outages.
    reference, _ = run(engine(model_dir), {"a": (prompts(1)[0], GREEDY)})
    e = engine(model_dir, num_scheduler_steps=4)
    real, runs = e.model.greedy_steps, []

    def outages(ids, steps, cache, tokens, on_step=None):
        runs.append(steps.positions.shape[0])
        if len(runs) == 1:  # the first run: down after its first step
            first = steps._replace(positions=steps.positions[:1], slots=steps.slots[:1])
            assert real(ids, first, cache, tokens[:, :1], on_step)
        if len(runs) <= 2:  # the second: down from the start
            raise ExpertsUnavailable("experts process is down")
        return real(ids, steps, cache, tokens, on_step)

    e.model.greedy_steps = outages
    tokens, sizes, raised = step_through_outages(e, {"a": prompts(1)[0]}, stream)
    assert sizes[:3] == [[1], [1], [1] * 4 if stream else [4]] and raised == [2] and runs[:3] == [4, 4, 4]
    assert tokens == {"a": reference["a"][0]}
    assert e.model.native_path.greedy_steps == GREEDY.max_tokens - 1
    assert e.stats().kv_blocks_used[DEVICE] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["returned", "streamed"])
def test_experts_unavailable_inside_a_run_keeps_the_tokens_so_far(model_dir, stream):
    reference, _ = run(engine(model_dir), {"a": (prompts(1)[0], GREEDY), "b": (prompts(2)[1], GREEDY)})
    e = engine(model_dir, num_scheduler_steps=4)
    executor = e.model.model.layers[0].mlp.executor
    real, calls = executor.forward, [0]
    # One executor serves both layers: two calls a forward pass. Calls 1-2: both prefills; 3-4: a
    # run's first step; 5: its second (down: the run keeps one token); 6: the next run's first
    # step (down: the step raises and stays pending); 7 on: its retry.
    down = {5, 6}

    def flaky(*args):
        calls[0] += 1
        if calls[0] in down:
            raise ExpertsUnavailable("experts process is down")
        return real(*args)

    executor.forward = flaky
    tokens, sizes, raised = step_through_outages(e, {"a": prompts(1)[0], "b": prompts(2)[1]}, stream)
    assert sizes[:3] == [[1, 1], [1, 1], [1] * 8 if stream else [4, 4]] and raised == [2]
    assert tokens == {rid: reference[rid][0] for rid in "ab"}
    assert e.stats().kv_blocks_used[DEVICE] == 0


@pytest.mark.parametrize("steps,stream", [(1, False), (4, False), (4, True)], ids=["single", "returned", "streamed"])
def test_broken_logits_end_only_their_request_with_error(model_dir, steps, stream):
    # The model gone wrong for one sequence (NaN logits from its 4th token on) ends that request
    # with "error" and the 3 tokens before; its neighbours, seeded or greedy, get their own tokens.
    requests = {rid: (p, params) for rid, p, params in zip("abc", prompts(3), MIXED)}
    want, _ = run(engine(model_dir), requests)
    e = engine(model_dir, num_scheduler_steps=steps)
    seen = {"b": 0}

    def break_b(rid, logits):
        if rid == "b":
            seen["b"] += 1
            if seen["b"] > 3:
                with torch.inference_mode():  # the logits are inference tensors
                    logits.fill_(float("nan"))

    e.runner.logits_hook = break_b
    got, _ = run(e, requests, stream)
    assert got["b"][0] == want["b"][0][:3] and got["b"][2] == "error"
    assert got["a"] == want["a"] and got["c"] == want["c"]
    assert e.stats().kv_blocks_used[DEVICE] == 0


@pytest.mark.parametrize("path", ["python", "native"])  # native: decode_greedy's argmax
def test_greedy_decode_with_nan_logits_ends_with_error(model_dir, path):
    # The head gone NaN after the prefill: every decode step's logits are NaN, the hidden states fine.
    e = engine(model_dir, num_scheduler_steps=4)
    if path == "python":
        e.runner.logits_hook = lambda rid, logits: None  # a watcher keeps the steps in Python
    e.add_request("a", prompts(1)[0], GREEDY)
    [first] = e.step()
    with torch.no_grad():
        e.model.lm_head.weight.fill_(float("nan"))
    outputs = [o for _ in range(3) for o in e.step()]
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([], "error")]
    assert len(first.new_token_ids) == 1 and not e.has_unfinished_requests()


NAN_EMBEDDING = """
import sys, torch
from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.sampling_params import SamplingParams
model_dir, native, prompt, t0 = sys.argv[1], sys.argv[2] == "native", eval(sys.argv[3]), int(sys.argv[4])
e = LLMEngine.from_pretrained(model_dir, device="cpu", dtype="float32", config=EngineConfig())
e.model.native_decode = native
with torch.no_grad():
    e.model.model.embed_tokens.weight[t0] = float("nan")
[out] = e.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
print(out.token_ids, out.finish_reason)
"""


@pytest.mark.parametrize("path", ["torch", "native"])  # native: the decode layer's route()
def test_nan_hidden_states_end_their_request_not_the_server(model_dir, path):
    # The embedding of the first generated token made NaN: the decode steps' hidden states are NaN
    # from the first layer on. In a child process: a native crash must not take pytest with it.
    import subprocess
    import sys

    prompt = prompts(1)[0]
    [first] = engine(model_dir).generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    t0 = first.token_ids[0]
    assert t0 not in prompt
    child = subprocess.run([sys.executable, "-c", NAN_EMBEDDING, str(model_dir), path, repr(prompt), str(t0)],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split("\n")[-2] == f"[{t0}] error"
