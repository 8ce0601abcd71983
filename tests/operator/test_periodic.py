"""The periodic loops that replace kopf timers (and so need no finalizer): one per HybridModel and
job, fed the newest body, ended by deletion or the operator's exit."""

from __future__ import annotations

import asyncio
import logging

from hm_cluster import hybrid_model, wait_for

from tandem_operator.periodic import Every, Gone, Loops

LOG = logging.getLogger("test")


class Calls:
    def __init__(self, fail: bool = False):
        self.bodies: list[dict] = []
        self.memos: set[int] = set()
        self.fail = fail

    def __call__(self, body, memo, logger):
        self.bodies.append(body)
        self.memos.add(id(memo))
        if self.fail:
            raise RuntimeError("the API server is down")


async def test_a_loop_runs_per_model_with_the_newest_body_until_deleted():
    calls = Calls()
    loops = Loops([Every(calls, interval=0.01)])
    body = hybrid_model("a")
    loops.seen(body, LOG)
    await wait_for(lambda: len(calls.bodies) >= 2, what="two rounds")
    newer = {**body, "spec": {**body["spec"], "replicas": 5}}
    loops.seen(newer, LOG)  # a watch event: no second loop, the next round sees it
    await wait_for(lambda: calls.bodies[-1]["spec"]["replicas"] == 5, what="the newer body")
    assert loops.running() == {"uid-a"} and len(calls.memos) == 1

    loops.gone(body)
    await asyncio.sleep(0)  # let the cancellation land
    rounds = len(calls.bodies)
    await asyncio.sleep(0.05)  # five intervals: a live loop would have run again
    assert len(calls.bodies) == rounds and not loops.running()


async def test_a_model_being_deleted_stops_its_loops():
    loops = Loops([Every(Calls(), interval=0.01)])
    body = hybrid_model("b")
    loops.seen(body, LOG)
    loops.seen({**body, "metadata": {**body["metadata"], "deletionTimestamp": "2026-11-22T00:00:00Z"}}, LOG)
    assert not loops.running()


async def test_a_failing_job_runs_again_and_stop_ends_everything():
    failing = Calls(fail=True)
    loops = Loops([Every(failing, interval=0.01), Every(Calls(), interval=3600.0, initial_delay=3600.0)])
    loops.seen(hybrid_model("c"), LOG)
    loops.seen(hybrid_model("d"), LOG)
    await wait_for(lambda: len(failing.bodies) >= 4, what="failing rounds of both models")
    await asyncio.wait_for(loops.stop(), timeout=5)
    assert not loops.running()


async def test_a_job_that_finds_its_model_gone_ends_the_models_loops():
    # A deletion while the watch was down brings no DELETED event: the resync notices instead.
    def resync(body, memo, logger):
        raise Gone()

    loops = Loops([Every(resync, interval=0.01), Every(Calls(), interval=3600.0, initial_delay=3600.0)])
    loops.seen(hybrid_model("e"), LOG)
    await wait_for(lambda: not loops.running(), what="the loops ended")
