"""The continuous-batching scheduler, driven by a fake model that stores tokens as its 'KV'.

The fake model writes each computed token into the slot its block table names, copies blocks
when told to swap, and checks before every chunk that the slots it would attend to hold exactly
the sequence's earlier tokens (with a sliding window, those in the window of the chunk's first
query). Its next token is a function of that context, so a run with preemptions must produce the
same outputs as a run with room to spare.
"""

from __future__ import annotations

import pytest

from tandem.engine.sampling_params import DuplicateRequest, InvalidRequest, SamplingParams
from tandem.engine.scheduler import QueueFull, Scheduler, SchedulerConfig, SchedulerOutput
from tandem.engine.sequence import Sequence, SequenceStatus
from tandem.kv.block_manager import CPU, DEVICE, KVBlockManager

BS = 4
EOS = 0


class FakeModel:
    """Token storage shaped like the KV cache: tier -> block id -> block_size slots."""

    def __init__(self, bm: KVBlockManager, window: int | None = None):
        self.bm, self.window = bm, window
        self.kv = {tier: {i: [None] * BS for i in range(bm.num_total_blocks(tier))} for tier in (DEVICE, CPU)}

    def run(self, out: SchedulerOutput) -> dict[str, int]:
        for device_id, cpu_id in out.swap_out:  # swap-outs first: swap-ins may reuse these blocks
            self.kv[CPU][cpu_id] = list(self.kv[DEVICE][device_id])
        for cpu_id, device_id in out.swap_in:
            self.kv[DEVICE][device_id] = list(self.kv[CPU][cpu_id])
        sampled = {}
        for work in out.scheduled:
            seq, table = work.seq, work.block_table
            assert len(table) * BS >= work.start_pos + len(work.token_ids)
            assert self.bm.tier_of(seq) == work.tier
            kv = self.kv[work.tier]  # offloaded sequences read and write the CPU tier
            # A query at position p attends to keys p - window + 1 .. p
            first = 0 if self.window is None else max(0, work.start_pos - self.window + 1)
            context = [kv[table[p // BS]][p % BS] for p in range(first, work.start_pos)]
            assert context == seq.all_token_ids[first:work.start_pos], "KV lost or corrupted"
            for p, token in enumerate(work.token_ids, start=work.start_pos):
                block = table[p // BS]
                assert self.bm._pools[work.tier].blocks[block].ref_count == 1, "wrote into a shared block"
                kv[block][p % BS] = token
            if work.sample:
                keys = context + work.token_ids  # the last query's, and the window's before it
                sampled[seq.request_id] = next_token(keys if self.window is None else keys[-self.window:])
        return sampled


def next_token(context: list[int]) -> int:
    """A deterministic 'model': never EOS, depends on the whole context."""
    return (sum(context) * 31 + len(context)) % 97 + 1


def make(num_device=64, num_cpu=0, caching=True, **config) -> tuple[Scheduler, FakeModel]:
    bm = KVBlockManager(num_device, num_cpu, BS, enable_prefix_caching=caching)
    config.setdefault("max_model_len", min(4096, num_device * BS))
    return Scheduler(SchedulerConfig(**config), bm, {EOS}), FakeModel(bm, config.get("sliding_window"))


def seq(rid: str, prompt: list[int] | int, **params) -> Sequence:
    if isinstance(prompt, int):
        prompt = [(sum(map(ord, rid)) + i) % 50 + 1 for i in range(prompt)]
    return Sequence(rid, prompt, SamplingParams(**params))


def swap_owners(sched: Scheduler, out: SchedulerOutput) -> set[str]:
    """The sequences whose first held block (after those a sliding window freed) is one this step's
    copies write: their KV moves. (A table's blocks move together, to fresh blocks; one freed again in
    the step, recomputed, has none.)"""
    bm = sched.block_manager
    written = {(CPU, c) for _, c in out.swap_out} | {(DEVICE, d) for _, d in out.swap_in}
    held = {s.request_id: [b.block_id for b in bm._tables.get(s.request_id, ()) if b is not None]
            for s in sched._seqs.values()}
    return {s.request_id for s in sched._seqs.values()
            if held[s.request_id] and (bm.tier_of(s), held[s.request_id][0]) in written}


def step(sched: Scheduler, model: FakeModel) -> tuple[SchedulerOutput, list[Sequence]]:
    out = sched.schedule()
    assert len(out.swapping) == len({s.request_id for s in out.swapping}) == len(swap_owners(sched, out))
    assert {s.request_id for s in out.swapping} == swap_owners(sched, out)
    assert out.num_batched_tokens == sum(len(w.token_ids) for w in out.scheduled)
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert len(out.scheduled) <= sched.config.max_num_seqs
    return out, sched.update(out, model.run(out))


def run_all(sched: Scheduler, model: FakeModel, max_steps: int = 500) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        assert len(outs) < max_steps, "no progress"
        outs.append(step(sched, model)[0])
    return outs


def assert_all_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    for tier in (DEVICE, CPU):
        assert bm.num_free_blocks(tier) == bm.num_total_blocks(tier)
        assert all(b.ref_count == 0 for b in bm._pools[tier].blocks)


def reference_outputs(prompts: dict[str, list[int]], max_tokens: int, **config) -> dict[str, list[int]]:
    sched, model = make(num_device=256, **config)
    seqs = [seq(rid, p, max_tokens=max_tokens) for rid, p in prompts.items()]
    for s in seqs:
        sched.add(s)
    run_all(sched, model)
    return {s.request_id: s.output_token_ids for s in seqs}


def test_budget_is_respected_and_prefill_is_chunked():
    sched, model = make(max_num_batched_tokens=16)
    a, b, c = seq("a", 10), seq("b", 10), seq("c", 10)
    for s in (a, b, c):
        sched.add(s)
    out, _ = step(sched, model)
    assert [(w.seq.request_id, w.start_pos, len(w.token_ids), w.sample) for w in out.scheduled] == [
        ("a", 0, 10, True), ("b", 0, 6, False)]
    assert out.num_batched_tokens == 16
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    assert b.num_computed_tokens == 6 and b.num_output_tokens == 0


def test_a_long_prompt_is_prefilled_chunk_by_chunk():
    sched, model = make(max_num_batched_tokens=8)
    s = seq("a", 21, max_tokens=2)
    sched.add(s)
    chunks = []
    for _ in range(3):
        out, changed = step(sched, model)
        (work,) = out.scheduled
        chunks.append((work.start_pos, work.token_ids, work.sample))
        assert changed == ([s] if work.sample else [])
    assert chunks == [(0, s.prompt_token_ids[0:8], False), (8, s.prompt_token_ids[8:16], False),
                      (16, s.prompt_token_ids[16:21], True)]
    assert s.num_output_tokens == 1


def test_decodes_and_a_prefill_share_a_step_decodes_first():
    sched, model = make(max_num_batched_tokens=8)
    a = seq("a", 5, max_tokens=10)
    sched.add(a)
    step(sched, model)
    b = seq("b", 20)
    sched.add(b)
    out, changed = step(sched, model)
    assert [(w.seq.request_id, len(w.token_ids)) for w in out.scheduled] == [("a", 1), ("b", 7)]
    assert out.scheduled[0].is_decode and out.scheduled[0].token_ids == [a.output_token_ids[0]]
    assert changed == [a]


def test_running_decodes_are_budgeted_before_a_running_prefill():
    sched, model = make(max_num_batched_tokens=6)
    short, long = seq("short", 3, max_tokens=20), seq("long", 30)
    sched.add(short)
    step(sched, model)
    # An older sequence (as a recomputed one can be) prefilling beside a younger decode.
    long.arrival = short.arrival - 1
    sched.add(long)
    step(sched, model)
    out, _ = step(sched, model)
    assert [(w.seq, len(w.token_ids)) for w in out.scheduled] == [(short, 1), (long, 5)]


def test_sequences_join_and_leave_every_step():
    sched, model = make(max_num_batched_tokens=32)
    seqs = [seq(f"r{i}", 3 + i % 5, max_tokens=1 + i % 4) for i in range(12)]
    active = []
    for s in seqs:
        sched.add(s)
        out, changed = step(sched, model)
        active.append({w.seq.request_id for w in out.scheduled})
        assert s in [w.seq for w in out.scheduled]  # joins the step it arrives
    run_all(sched, model)
    assert all(s.finish_reason == "length" and s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert "r0" not in active[-1]  # left long before
    assert_all_free(sched)


def test_max_num_seqs_caps_the_batch():
    sched, model = make(max_num_seqs=2)
    for i in range(4):
        sched.add(seq(f"r{i}", 3, max_tokens=3))
    out, _ = step(sched, model)
    assert len(out.scheduled) == 2 and sched.num_waiting == 2
    run_all(sched, model)
    assert_all_free(sched)


def test_preemption_by_swap_keeps_every_token():
    prompts = {f"r{i}": [(7 * i + j) % 40 + 1 for j in range(6)] for i in range(3)}
    expected = reference_outputs(prompts, max_tokens=12)
    sched, model = make(num_device=10, num_cpu=16)  # three sequences of 18 tokens need 15 blocks
    seqs = [seq(rid, p, max_tokens=12) for rid, p in prompts.items()]
    for s in seqs:
        sched.add(s)
    outs = run_all(sched, model)
    swapped_out = [s for o in outs for s in o.preempted]
    assert swapped_out and seqs[0] not in swapped_out  # the oldest is never the victim
    assert any(o.swap_out for o in outs) and any(o.swap_in for o in outs)
    assert {s.request_id: s.output_token_ids for s in seqs} == expected
    assert_all_free(sched)


def test_preemption_victim_is_swapped_and_state_is_consistent():
    sched, model = make(num_device=4, num_cpu=8)
    a, b = seq("a", 8, max_tokens=20), seq("b", 8, max_tokens=20)
    sched.add(a)
    sched.add(b)
    step(sched, model)  # both prefilled: 2 blocks each, device full
    b_table = sched.block_manager.block_table(b)
    out, _ = step(sched, model)  # both need a third block on this decode
    assert out.preempted == [b] and b.status is SequenceStatus.SWAPPED
    assert [d for d, _ in out.swap_out] == b_table
    assert [c for _, c in out.swap_out] == sched.block_manager.block_table(b)
    assert [w.seq for w in out.scheduled] == [a]
    assert sched.block_manager.tier_of(b) == CPU and sched.num_swapped == 1
    assert b.num_computed_tokens == 8 and b.num_output_tokens == 1


def test_cpu_decode_moves_the_victim_to_the_cpu_tier_where_it_keeps_running():
    sched, model = make(num_device=4, num_cpu=8, cpu_decode=True)
    a, b = seq("a", 8, max_tokens=20), seq("b", 8, max_tokens=20)
    sched.add(a)
    sched.add(b)
    step(sched, model)  # both prefilled: 2 blocks each, device full
    b_table = sched.block_manager.block_table(b)
    out, changed = step(sched, model)  # both need a third block on this decode
    assert out.preempted == [] and out.offloaded == [b] and b.status is SequenceStatus.RUNNING
    assert [d for d, _ in out.swap_out] == b_table and not out.swap_in
    assert {w.seq.request_id: w.tier for w in out.scheduled} == {"a": DEVICE, "b": CPU}
    assert changed == [a, b] and b.num_output_tokens == 2  # b decoded on the CPU tier this very step
    assert sched.num_offloaded == 1 and sched.num_swapped == 0
    assert sched.block_manager.num_used_blocks(CPU) == 3


def test_cpu_decode_keeps_every_token_and_runs_contexts_longer_than_the_device_tier():
    prompts = {f"r{i}": [(7 * i + j) % 40 + 1 for j in range(6 + 3 * i)] for i in range(4)}
    expected = reference_outputs(prompts, max_tokens=30)
    # 6 device blocks hold 24 tokens; each sequence grows to 36-45; the CPU tier holds 48 blocks.
    sched, model = make(num_device=6, num_cpu=48, cpu_decode=True, max_model_len=64, max_num_batched_tokens=8)
    seqs = [seq(rid, p, max_tokens=30) for rid, p in prompts.items()]
    for s in seqs:
        sched.add(s)
    outs = run_all(sched, model)
    assert not any(o.swap_in or o.preempted for o in outs)
    offloaded = {s.request_id for o in outs for s in o.offloaded}
    assert len(offloaded) >= 3
    assert {s.request_id: s.output_token_ids for s in seqs} == expected
    assert_all_free(sched)


def test_cpu_decode_recomputes_when_the_cpu_tier_is_full_too():
    prompts = {f"r{i}": [(5 * i + j) % 30 + 1 for j in range(6)] for i in range(4)}
    expected = reference_outputs(prompts, max_tokens=18)
    sched, model = make(num_device=6, num_cpu=6, cpu_decode=True, max_model_len=24, max_num_batched_tokens=8)
    seqs = [seq(rid, p, max_tokens=18) for rid, p in prompts.items()]
    for s in seqs:
        sched.add(s)
    outs = run_all(sched, model)
    assert any(o.offloaded for o in outs) and any(o.preempted for o in outs)
    assert {s.request_id: s.output_token_ids for s in seqs} == expected
    assert_all_free(sched)


def test_cpu_decode_never_parks_a_sequence_the_device_tier_cannot_take_back():
    """Under cpu_decode a sequence that cannot move to the CPU tier with room to grow there is
    recomputed, not swapped out: parked on the CPU tier at 8 tokens, its ninth would need 3 blocks
    of a device tier of 2, and it (and the waiting queue behind it) would wait forever."""
    prompts = {"a": [3], "b": [5]}
    expected = reference_outputs(prompts, max_tokens=15)
    sched, model = make(num_device=2, num_cpu=4, cpu_decode=True, max_model_len=16, max_num_batched_tokens=4)
    seqs = [seq(rid, p, max_tokens=15) for rid, p in prompts.items()]
    for s in seqs:
        sched.add(s)
    outs = []
    while sched.has_unfinished():
        assert len(outs) < 200, f"no progress: {[(s.request_id, s.status.value) for s in seqs]}"
        outs.append(step(sched, model)[0])
        assert sched.num_swapped == 0
    assert any(o.offloaded for o in outs) and any(o.preempted for o in outs)
    assert {s.request_id: s.output_token_ids for s in seqs} == expected
    assert_all_free(sched)


def test_swapping_names_the_sequences_whose_kv_the_copies_carry():
    """`swapping` is what a failed copy loses (LLMEngine fails those requests): the sequences
    swapped out, offloaded or swapped in. One offloaded and then recomputed in the same step (the
    CPU tier full too) holds no copied block and has nothing to lose. `step` checks every step."""
    sched, model = make(num_device=2, num_cpu=6, cpu_decode=True, max_model_len=24, max_num_batched_tokens=8)
    seqs = [seq(f"r{i}", n, max_tokens=m) for i, (n, m) in enumerate([(2, 6), (3, 2), (2, 20), (2, 22)])]
    for s in seqs:
        sched.add(s)
    outs = run_all(sched, model)
    assert any(s in o.offloaded and s in o.preempted and s not in o.swapping for o in outs for s in seqs)
    assert any(o.swapping for o in outs)
    assert_all_free(sched)


def test_preemption_by_recompute_when_the_cpu_tier_is_full():
    prompts = {f"r{i}": [(5 * i + j) % 30 + 1 for j in range(6)] for i in range(3)}
    expected = reference_outputs(prompts, max_tokens=12)
    sched, model = make(num_device=10, num_cpu=0)
    seqs = [seq(rid, p, max_tokens=12) for rid, p in prompts.items()]
    for s in seqs:
        sched.add(s)
    recomputed = []
    while sched.has_unfinished():
        out, _ = step(sched, model)
        assert not out.swap_out
        for victim in out.preempted:
            assert victim.status is SequenceStatus.WAITING and victim.num_computed_tokens == 0
            assert sched.waiting[0] is victim and sched.block_manager.block_table(victim) == []
            recomputed.append(victim)
    assert recomputed
    assert {s.request_id: s.output_token_ids for s in seqs} == expected
    assert_all_free(sched)


def test_a_recomputed_sequence_reprefills_prompt_and_outputs():
    sched, model = make(num_device=4, num_cpu=0, caching=False)
    a, b = seq("a", 8, max_tokens=20), seq("b", 8, max_tokens=20)
    sched.add(a)
    sched.add(b)
    step(sched, model)
    out, _ = step(sched, model)
    assert out.preempted == [b]
    known = b.all_token_ids
    while b.status is not SequenceStatus.RUNNING:
        out, _ = step(sched, model)
    work = next(w for w in out.scheduled if w.seq is b)
    assert work.start_pos == 0 and work.token_ids == known and work.sample
    assert b.num_output_tokens == 2


def test_a_sequence_preempted_after_it_was_scheduled_leaves_the_step():
    sched, model = make(num_device=4, num_cpu=8, max_num_batched_tokens=8)
    short, long = seq("short", 4, max_tokens=10), seq("long", 12, max_tokens=3)
    sched.add(short)
    step(sched, model)
    long.arrival = short.arrival - 1  # older, so the younger decode is the victim
    sched.add(long)
    step(sched, model)  # short decodes, long prefills 7: all four blocks used
    short_table = sched.block_manager.block_table(short)
    out, _ = step(sched, model)  # short decodes first, then long needs a block
    assert out.preempted == [short] and [d for d, _ in out.swap_out] == short_table
    assert [(w.seq, len(w.token_ids)) for w in out.scheduled] == [(long, 5)]
    assert out.num_batched_tokens == 5
    run_all(sched, model)
    assert short.num_output_tokens == 10 and long.num_output_tokens == 3
    assert_all_free(sched)


def test_a_recomputed_sequence_reuses_its_cached_prefix_without_reporting_it():
    sched, model = make(num_device=4, num_cpu=0)
    a, b = seq("a", 8, max_tokens=2), seq("b", 8, max_tokens=20)
    sched.add(a)
    sched.add(b)
    step(sched, model)
    out, _ = step(sched, model)  # b freed; a's new block evicts b's tail, b's first block stays cached
    assert out.preempted == [b]
    while b.status is not SequenceStatus.RUNNING:
        out, _ = step(sched, model)
    work = next(w for w in out.scheduled if w.seq is b)
    assert work.start_pos == BS and sched.block_manager.prefix_cache_hit_tokens == BS
    assert b.num_cached_tokens == 0  # what the user is told: no hit on first admission
    run_all(sched, model)
    assert_all_free(sched)


def test_new_work_never_preempts_running_sequences():
    sched, model = make(num_device=4, num_cpu=8)
    a = seq("a", 14, max_tokens=2)  # 4 blocks: the whole device tier
    sched.add(a)
    step(sched, model)
    sched.add(seq("b", 3))
    out, _ = step(sched, model)
    assert not out.preempted and [w.seq for w in out.scheduled] == [a]
    assert sched.num_waiting == 1


def test_abort_frees_blocks_at_once_in_every_queue():
    sched, model = make(num_device=6, num_cpu=8, max_num_seqs=8)
    running, swapped = seq("run", 10, max_tokens=50), seq("swap", 10, max_tokens=50)
    sched.add(running)
    sched.add(swapped)
    step(sched, model)
    step(sched, model)
    while swapped.status is not SequenceStatus.SWAPPED:
        step(sched, model)
    waiting = seq("wait", 3)
    sched.add(waiting)
    bm = sched.block_manager
    assert sched.abort("swap") is swapped and bm.num_used_blocks(CPU) == 0
    assert sched.abort("run") is running and bm.num_used_blocks(DEVICE) == 0
    assert sched.abort("wait") is waiting and not sched.has_unfinished()
    for s in (running, swapped, waiting):
        assert s.status is SequenceStatus.FINISHED and s.finish_reason == "cancelled"
    assert sched.abort("run") is None and sched.abort("nobody") is None


def test_abort_between_schedule_and_update_is_ignored_by_update():
    sched, model = make()
    a, b = seq("a", 5), seq("b", 5)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sampled = model.run(out)
    sched.abort("a")
    changed = sched.update(out, sampled)
    assert changed == [b] and a.num_output_tokens == 0


@pytest.mark.parametrize("params, tokens, reason, stop_reason, n", [
    (dict(max_tokens=3), [5, 6, 7, 8], "length", None, 3),
    (dict(max_tokens=9), [5, EOS, 7], "stop", None, 2),
    (dict(max_tokens=9, stop_token_ids=(EOS,)), [5, EOS, 7], "stop", EOS, 2),  # named as a stop token
    (dict(max_tokens=4, ignore_eos=True), [EOS, EOS, EOS, EOS, EOS], "length", None, 4),
    (dict(max_tokens=9, stop_token_ids=(42,)), [5, 42, 7], "stop", 42, 2),
])
def test_token_stops_set_finish_reasons(params, tokens, reason, stop_reason, n):
    sched, _ = make()
    s = seq("a", 3, **params)
    sched.add(s)
    for token in tokens:
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sched.update(out, {"a": token})
    assert (s.finish_reason, s.stop_reason, s.num_output_tokens) == (reason, stop_reason, n)
    assert s.output_token_ids == tokens[:n] and s.is_finished
    assert_all_free(sched)


def test_max_model_len_ends_a_sequence_with_length():
    sched, model = make(max_model_len=8)
    s = seq("a", 5, max_tokens=100)
    sched.add(s)
    run_all(sched, model)
    assert s.finish_reason == "length" and s.num_tokens == 8


def test_finish_is_how_the_engine_applies_stop_strings():
    sched, model = make()
    s = seq("a", 5, max_tokens=10)
    sched.add(s)
    step(sched, model)
    assert sched.finish("a", "stop", stop_reason="\n\n") is s
    assert (s.finish_reason, s.stop_reason) == ("stop", "\n\n")
    assert_all_free(sched)
    with pytest.raises(ValueError, match="finish reason"):
        sched.finish("a", "done")


def test_prefix_cache_hit_skips_prefill_tokens():
    sched, model = make(max_num_batched_tokens=64)
    prompt = [(3 * i) % 50 + 1 for i in range(18)]
    first = seq("first", prompt, max_tokens=2)
    sched.add(first)
    run_all(sched, model)
    second = seq("second", prompt[:16] + [9, 9], max_tokens=2)
    sched.add(second)
    out, _ = step(sched, model)
    (work,) = out.scheduled
    assert second.num_cached_tokens == 16 and work.start_pos == 16 and work.token_ids == [9, 9]
    assert sched.block_manager.prefix_cache_hit_tokens == 16
    same = seq("same", prompt, max_tokens=2)
    sched.add(same)
    out, _ = step(sched, model)
    work = next(w for w in out.scheduled if w.seq is same)
    assert same.num_cached_tokens == 16 and work.token_ids == prompt[16:]
    assert first.num_cached_tokens == 0


def test_bad_configuration_and_requests_raise_clear_errors():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens="2048")
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(SchedulerConfig(max_model_len=100), KVBlockManager(4, 0, BS), {EOS})
    sched, _ = make(max_model_len=8, max_waiting=2)
    with pytest.raises(InvalidRequest, match="max_model_len"):
        sched.add(seq("long", 8))
    sched.add(seq("a", 3))
    with pytest.raises(DuplicateRequest, match="already running"):
        sched.add(seq("a", 3))
    sched.add(seq("b", 3))
    with pytest.raises(QueueFull):
        sched.add(seq("c", 3))
    with pytest.raises(InvalidRequest, match="prompt"):
        Sequence("x", [])


def test_a_missing_sampled_token_is_an_error():
    sched, _ = make()
    sched.add(seq("a", 3))
    out = sched.schedule()
    with pytest.raises(KeyError, match="'a'"):
        sched.update(out, {})


# Multi-step decode (num_scheduler_steps): runs of decode steps and their slots.


def scheduler(steps: int, blocks: int = 64, max_model_len: int = 64) -> tuple[Scheduler, KVBlockManager]:
    bm = KVBlockManager(blocks, 0, 4, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(max_model_len=max_model_len, num_scheduler_steps=steps), bm, {0}), bm


def prefilled(s: Scheduler, rid: str, prompt_len: int = 6, **params) -> Sequence:
    seq = Sequence(rid, list(range(1, prompt_len + 1)), SamplingParams(temperature=0.0, **params))
    s.add(seq)
    out = s.schedule()
    s.update(out, {w.seq.request_id: 99 for w in out.scheduled if w.sample})
    return seq


def test_scheduler_gives_a_run_the_slots_of_every_step_and_cuts_it_at_max_tokens():
    s, bm = scheduler(steps=4)
    seq = prefilled(s, "a", max_tokens=6)  # 6 prompt tokens + 1 sampled: 7 tokens, 6 computed
    out = s.schedule()
    [work] = out.scheduled
    assert (work.num_steps, work.token_ids, work.start_pos) == (4, [99], 6)
    assert len(work.block_table) * bm.block_size >= 6 + 4  # every step's KV slot
    s.update(out, {"a": [5, 6, 7, 8]})
    assert seq.output_token_ids == [99, 5, 6, 7, 8] and seq.num_computed_tokens == 10
    [work] = s.schedule().scheduled
    assert work.num_steps == 1  # one token left before max_tokens


def test_scheduler_runs_single_steps_while_a_request_waits_and_rejects_extra_tokens():
    s, _ = scheduler(steps=4)
    prefilled(s, "a", max_tokens=20)
    s.add(Sequence("b", [1, 2, 3], SamplingParams(temperature=0.0)))
    out = s.schedule()
    assert [w.num_steps for w in out.scheduled] == [1, 1]
    s.update(out, {"a": 5, "b": 6})
    out = s.schedule()
    assert [w.num_steps for w in out.scheduled] == [4, 4]
    with pytest.raises(ValueError, match="5 tokens for request 'a', scheduled for 4"):
        s.update(out, {"a": [1, 2, 3, 4, 5], "b": [1]})


def test_scheduler_falls_back_to_one_step_when_the_blocks_for_a_run_are_short():
    s, bm = scheduler(steps=8, blocks=5, max_model_len=20)  # 20 slots
    a = prefilled(s, "a", prompt_len=7, max_tokens=20)
    b = prefilled(s, "b", prompt_len=3, max_tokens=20)  # a decoded a token in the same step
    assert (len(bm.block_table(a)), len(bm.block_table(b)), bm.num_free_blocks(DEVICE)) == (2, 1, 2)
    # a run of 8 needs 4 more blocks (a: 16 slots, b: 11), and 2 are free: one step, one block taken
    out = s.schedule()
    assert [w.num_steps for w in out.scheduled] == [1, 1]
    assert (len(bm.block_table(a)), len(bm.block_table(b)), bm.num_free_blocks(DEVICE)) == (3, 1, 1)
    assert not out.preempted


# Sliding window: the blocks no later query reads are freed as a sequence goes.

WINDOW = 6


def first_held(sched: Scheduler, s: Sequence) -> int:
    """How many of the sequence's leading blocks it has freed (placeholders in its table)."""
    return next(i for i, b in enumerate(sched.block_manager._tables[s.request_id]) if b is not None)


def test_a_sliding_window_frees_each_block_at_the_first_step_no_later_query_reads_it():
    # The next query is at num_computed_tokens n and reads keys n - 5 .. n: block i (tokens 4i..4i+3)
    # goes at the first n where 4i + 3 < n - 5, not a token before.
    sched, model = make(sliding_window=WINDOW)
    s = seq("a", 5, max_tokens=12)
    sched.add(s)
    freed = {}
    while not s.is_finished:
        step(sched, model)
        freed[s.num_computed_tokens] = first_held(sched, s) if not s.is_finished else None
    assert freed == {5: 0, 6: 0, 7: 0, 8: 0, 9: 1, 10: 1, 11: 1, 12: 1, 13: 2, 14: 2, 15: 2, 16: None}
    assert_all_free(sched)


def test_a_sliding_window_frees_blocks_between_prefill_chunks():
    sched, model = make(sliding_window=WINDOW, max_num_batched_tokens=8)
    s = seq("a", 30, max_tokens=10)
    sched.add(s)
    while not s.is_finished:
        step(sched, model)  # the model checks that each chunk's window is intact
        if not s.is_finished:
            n = s.num_computed_tokens
            assert first_held(sched, s) == (n - WINDOW + 1) // BS
            assert sched.block_manager.num_used_blocks(DEVICE) <= WINDOW // BS + 3  # the window, a chunk's growth
    assert_all_free(sched)


def test_without_a_window_every_block_is_held_to_the_end():
    sched, model = make()
    s = seq("a", 30, max_tokens=10)
    sched.add(s)
    step(sched, model)
    while not s.is_finished:
        assert first_held(sched, s) == 0
        assert sched.block_manager.num_used_blocks(DEVICE) == sched.block_manager.blocks_needed(s.num_tokens - 1)
        step(sched, model)


@pytest.mark.parametrize("config", [dict(num_device=8, num_cpu=16, max_model_len=32),  # swapped out and back in
                                    dict(num_device=4, num_cpu=32, cpu_decode=True, max_model_len=64,
                                         max_num_batched_tokens=16)],  # decoding on the CPU tier
                         ids=["swapped", "offloaded"])
def test_a_sliding_window_keeps_every_token_on_the_cpu_tier(config):
    prompts = {f"r{i}": [(7 * i + j) % 40 + 1 for j in range(12)] for i in range(3)}
    expected = reference_outputs(prompts, max_tokens=16, sliding_window=8)
    sched, model = make(sliding_window=8, **config)
    seqs = [seq(rid, p, max_tokens=16) for rid, p in prompts.items()]
    for s in seqs:
        sched.add(s)
    on_cpu_with_freed_blocks = 0  # steps after which a CPU-tier table had placeholders
    while sched.has_unfinished():
        step(sched, model)
        on_cpu_with_freed_blocks += any(sched.block_manager.tier_of(s) == CPU and first_held(sched, s) > 0
                                        for s in sched._seqs.values())
    assert on_cpu_with_freed_blocks
    assert {s.request_id: s.output_token_ids for s in seqs} == expected
    assert_all_free(sched)


def test_a_prefix_freed_by_the_window_serves_later_requests_until_it_is_reused():
    sched, model = make(num_device=12, sliding_window=WINDOW, max_model_len=48)
    prompt = [(3 * i) % 50 + 1 for i in range(22)]
    first = seq("first", prompt, max_tokens=4)
    sched.add(first)
    step(sched, model)
    assert first_held(sched, first) == 4  # blocks 0-3 freed, and still cached
    second = seq("second", prompt, max_tokens=4)
    sched.add(second)
    step(sched, model)
    assert second.num_cached_tokens == 20  # from block 0 on: the five full blocks
    run_all(sched, model)  # the model checks second's window was intact
    # Other prompts take every block, evicting the cached prefix; a third request computes it again.
    for i in range(3):
        sched.add(seq(f"other{i}", [(5 * i + j) % 40 + 1 for j in range(40)], max_tokens=2))
    run_all(sched, model)
    third = seq("third", prompt, max_tokens=4)
    sched.add(third)
    run_all(sched, model)
    assert third.num_cached_tokens < 20 and third.output_token_ids == first.output_token_ids
    assert_all_free(sched)


def test_a_bad_sliding_window_is_refused():
    for window in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window"):
            SchedulerConfig(sliding_window=window)
