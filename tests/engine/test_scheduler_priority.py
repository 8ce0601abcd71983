"""The priority scheduling policy (vLLM's `--scheduling-policy priority`): lower priority values
first, ties by arrival; the lowest-priority running sequence is the one preempted; a waiting
request never preempts. Driven by test_scheduler's fake model, which checks every token's KV."""

from __future__ import annotations

import pytest

from tandem.engine.sampling_params import InvalidRequest, SamplingParams
from tandem.engine.sequence import Sequence, SequenceStatus

from test_scheduler import assert_all_free, make, reference_outputs, run_all, step


def seq(rid: str, prompt: int, priority: int = 0, **params) -> Sequence:
    tokens = [(sum(map(ord, rid)) + i) % 50 + 1 for i in range(prompt)]
    return Sequence(rid, tokens, SamplingParams(**params), priority=priority)


def admitted(outs) -> list[str]:
    """Request ids in the order they were first scheduled."""
    order = []
    for out in outs:
        for work in out.scheduled:
            if work.seq.request_id not in order:
                order.append(work.seq.request_id)
    return order


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched, model = make(policy="priority", max_num_seqs=1)
    for rid, priority in [("batch-1", 10), ("batch-2", 10), ("urgent", -5), ("normal", 0), ("urgent-2", -5)]:
        sched.add(seq(rid, 5, priority, max_tokens=2))
    assert admitted(run_all(sched, model)) == ["urgent", "urgent-2", "normal", "batch-1", "batch-2"]
    assert_all_free(sched)


def test_first_come_first_served_keeps_arrival_order_and_refuses_priorities():
    sched, model = make(max_num_seqs=1)
    for rid in ("a", "b", "c"):
        sched.add(seq(rid, 5, max_tokens=2))
    assert admitted(run_all(sched, model)) == ["a", "b", "c"]
    with pytest.raises(InvalidRequest, match="priority: -1 needs the priority scheduling policy"):
        sched.add(seq("d", 5, -1))
    assert not sched.has_unfinished()


def test_the_lowest_priority_running_sequence_is_preempted_not_the_latest():
    sched, model = make(num_device=4, num_cpu=8, policy="priority")
    batch = seq("batch", 8, 1, max_tokens=20)  # arrives first, but ranks lower
    urgent = seq("urgent", 8, 0, max_tokens=20)
    assert batch.arrival < urgent.arrival
    sched.add(batch)
    sched.add(urgent)
    step(sched, model)  # both prefilled: 2 blocks each, the device tier full
    out, _ = step(sched, model)  # both need a third block
    assert out.preempted == [batch] and batch.status is SequenceStatus.SWAPPED
    assert [w.seq for w in out.scheduled] == [urgent]


def test_first_come_first_served_preempts_the_latest_arrival():
    sched, model = make(num_device=4, num_cpu=8)
    first, second = seq("first", 8, max_tokens=20), seq("second", 8, max_tokens=20)
    sched.add(first)
    sched.add(second)
    step(sched, model)
    out, _ = step(sched, model)
    assert out.preempted == [second]


def test_a_waiting_urgent_request_never_preempts_but_is_next():
    sched, model = make(num_device=4, num_cpu=8, policy="priority")
    batch = seq("batch", 14, 5, max_tokens=2)  # 4 blocks: the whole device tier
    sched.add(batch)
    step(sched, model)
    sched.add(seq("later", 3, 0))
    sched.add(seq("urgent", 3, -1))
    out, _ = step(sched, model)
    assert not out.preempted and [w.seq for w in out.scheduled] == [batch]
    assert [s.request_id for s in sched.waiting] == ["urgent", "later"]


@pytest.mark.parametrize("num_cpu", [0, 16], ids=["recompute", "swap"])
def test_preemption_under_priorities_keeps_every_token(num_cpu):
    # Mixed priorities on a device tier too small for all of them: swapped out (or recomputed) and
    # resumed by rank, every sequence's tokens equal a run with room to spare.
    prompts = {f"r{i}": 6 for i in range(4)}
    sched, model = make(num_device=10, num_cpu=num_cpu, policy="priority")
    seqs = [seq(rid, n, priority=(i * 7) % 3, max_tokens=12) for i, (rid, n) in enumerate(prompts.items())]
    for s in seqs:
        sched.add(s)
    outs = run_all(sched, model)
    victims = {s.request_id for o in outs for s in o.preempted}
    assert victims and "r0" not in victims  # priority 0, first to arrive: never the victim
    assert sched.num_preemptions == sum(len(o.preempted) for o in outs) == sum(s.num_preemptions for s in seqs)
    expected = reference_outputs({s.request_id: s.prompt_token_ids for s in seqs}, max_tokens=12)
    assert {s.request_id: s.output_token_ids for s in seqs} == expected
    assert_all_free(sched)


def test_a_priority_must_be_an_integer():
    with pytest.raises(InvalidRequest, match="priority: must be an integer"):
        Sequence("a", [1, 2], priority=1.5)
    with pytest.raises(ValueError, match="policy must be one of"):
        make(policy="lifo")
