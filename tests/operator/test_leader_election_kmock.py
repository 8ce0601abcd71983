"""The leader elector against KMock over HTTP: acquire, wait, release, take over, lose, race."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import pytest
from hm_cluster import NS, core_path, wait_for
from lease_kmock import LEASES, LeaseKMock

from tandem_operator import login
from tandem_operator.leader_election import ElectionConfig, LeaderElector, format_time, parse_time

pytestmark = pytest.mark.kmock(cls=LeaseKMock)

NAME = "tandem-operator"
LEASE = core_path("leases", NAME, group="coordination.k8s.io")
# Short enough for fast tests, long enough for two shared cores.
TIMINGS = {"lease_duration": 1.0, "renew_deadline": 0.5, "retry_period": 0.1}


@pytest.fixture
async def elect(cluster):
    """A factory of candidates for one Lease in KMock; their renewals stop after the test."""
    login.configure_client()
    made: list[LeaderElector] = []

    def candidate(identity: str, clock=None, on_lost=None, **timings) -> LeaderElector:
        config = ElectionConfig(NS, NAME, identity, **(TIMINGS | timings))
        elector = LeaderElector(config, on_lost=on_lost, **({"clock": clock} if clock else {}))
        made.append(elector)
        return elector

    yield candidate
    for elector in made:
        await elector.release()


async def lease_spec(cluster) -> dict:
    return (await cluster.get(LEASE))["spec"]


async def create_lease(cluster, **spec) -> None:
    await cluster.create(core_path("leases", group="coordination.k8s.io"), {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": NAME, "namespace": NS}, "spec": spec})


async def test_one_leads_and_the_other_waits_while_it_renews(cluster, elect):
    leader, standby = elect("a"), elect("b")
    assert await leader.acquire()
    leader.start_renewing()
    first = await lease_spec(cluster)
    assert first["holderIdentity"] == "a" and first["leaseDurationSeconds"] == 1
    assert first["leaseTransitions"] == 0 and first["acquireTime"] == first["renewTime"]
    waiting = asyncio.create_task(standby.acquire())

    # Past the moment the first claim would have expired, the leader's renewals still hold it.
    expired = parse_time(first["renewTime"]) + timedelta(seconds=1)

    async def renewed_past_first_claim():
        spec = await lease_spec(cluster)
        return parse_time(spec["renewTime"]) > expired + timedelta(seconds=0.2)

    await wait_for(renewed_past_first_claim, what="renewals past the first claim's expiry")
    assert not waiting.done() and not standby.is_leader and standby.holder == "a"
    spec = await lease_spec(cluster)
    assert (spec["holderIdentity"], spec["acquireTime"], spec["leaseTransitions"]) == ("a", first["acquireTime"], 0)
    waiting.cancel()


async def test_release_hands_the_lease_to_the_standby_at_once(cluster, elect):
    # A lease long enough that only a release, not its expiry, lets the standby in quickly.
    leader, standby = elect("a", lease_duration=30), elect("b", lease_duration=30)
    assert await leader.acquire()
    leader.start_renewing()
    waiting = asyncio.create_task(standby.acquire())
    await wait_for(lambda: standby.holder == "a", what="the standby seeing the leader")

    assert await leader.release()
    assert await asyncio.wait_for(waiting, timeout=3)
    assert not leader.is_leader and not leader.lost.is_set()
    spec = await lease_spec(cluster)
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    history = [version["spec"] for version in cluster.kmock.objects[LEASES, NS, NAME].history]
    assert {"holderIdentity": "", "leaseDurationSeconds": 1, "leaseTransitions": 0}.items() <= dict(history[-2]).items()


async def test_an_expired_lease_of_a_dead_holder_is_taken_over(cluster, elect):
    long_ago = format_time(datetime.now(UTC) - timedelta(minutes=5))
    await create_lease(cluster, holderIdentity="dead-pod_1", leaseDurationSeconds=15, acquireTime=long_ago,
                       renewTime=long_ago, leaseTransitions=4)
    candidate = elect("c")
    assert await asyncio.wait_for(candidate.acquire(), timeout=3)
    spec = await lease_spec(cluster)
    assert spec["holderIdentity"] == "c" and spec["leaseTransitions"] == 5 and spec["leaseDurationSeconds"] == 1
    assert spec["acquireTime"] == spec["renewTime"] != long_ago


async def test_a_live_lease_is_taken_only_once_renew_time_plus_duration_has_passed(cluster, elect):
    renewed = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    await create_lease(cluster, holderIdentity="other_1", leaseDurationSeconds=15, acquireTime=format_time(renewed),
                       renewTime=format_time(renewed), leaseTransitions=0)
    now = [renewed + timedelta(seconds=14.9)]
    candidate = elect("c", clock=lambda: now[0])

    assert not await candidate.try_acquire_or_renew()
    assert (await lease_spec(cluster))["holderIdentity"] == "other_1"
    now[0] = renewed + timedelta(seconds=15.1)
    assert await candidate.try_acquire_or_renew()
    spec = await lease_spec(cluster)
    assert spec["holderIdentity"] == "c" and spec["leaseTransitions"] == 1
    assert spec["renewTime"] == spec["acquireTime"] == "2026-01-01T12:00:15.100000Z"


@pytest.mark.parametrize("trouble", ["server errors", "another holder"])
async def test_a_leader_that_cannot_renew_loses_after_the_renew_deadline(cluster, elect, trouble):
    stopped = []
    leader = elect("a", on_lost=lambda: stopped.append(time.monotonic()))
    assert await leader.acquire()
    renewals = leader.start_renewing()
    first = (await lease_spec(cluster))["renewTime"]
    await wait_for(lambda: _renewed_since(cluster, first), what="a first renewal")

    began = time.monotonic()
    if trouble == "server errors":
        cluster.kmock.failing = True
    else:
        await cluster.patch(LEASE, {"spec": {"holderIdentity": "intruder_1", "leaseDurationSeconds": 30,
                                             "renewTime": format_time(datetime.now(UTC))}})
    await asyncio.wait_for(leader.lost.wait(), timeout=3)
    # Not at the first failure: it kept trying for the renew deadline since its last renewal.
    assert stopped and stopped[0] - began >= TIMINGS["renew_deadline"] - TIMINGS["retry_period"] - 0.05
    assert renewals.done() and not leader.is_leader
    cluster.kmock.failing = False
    if trouble == "another holder":
        assert not await leader.release()
        assert (await lease_spec(cluster))["holderIdentity"] == "intruder_1"


async def _renewed_since(cluster, renew_time: str) -> bool:
    return (await lease_spec(cluster))["renewTime"] != renew_time


@pytest.mark.parametrize("lease", ["missing", "expired"])
async def test_of_racing_candidates_exactly_one_wins(cluster, elect, lease):
    if lease == "expired":
        long_ago = format_time(datetime.now(UTC) - timedelta(minutes=5))
        await create_lease(cluster, holderIdentity="dead-pod_1", leaseDurationSeconds=15, renewTime=long_ago,
                           leaseTransitions=2)
    candidates = [elect(f"c{i}") for i in range(4)]
    cluster.kmock.read_barrier = asyncio.Barrier(len(candidates))  # all read before any writes

    won = await asyncio.gather(*(c.try_acquire_or_renew(timeout=5) for c in candidates))
    cluster.kmock.read_barrier = None
    assert sum(won) == 1
    (winner,) = [c for c, w in zip(candidates, won) if w]
    assert cluster.kmock.conflicts == len(candidates) - 1  # the others' writes answered 409
    spec = await lease_spec(cluster)
    assert spec["holderIdentity"] == winner.config.identity
    assert spec["leaseTransitions"] == (3 if lease == "expired" else 0)
    assert [c.is_leader for c in candidates] == won


@pytest.mark.parametrize("timings, message", [
    ({"lease_duration": 10, "renew_deadline": 10}, "greater than the renew deadline"),
    ({"renew_deadline": 2, "retry_period": 2}, "1.2 x the retry period"),
    ({"retry_period": 0}, "> 0"),
])
def test_timings_are_checked_as_client_go_does(timings, message):
    with pytest.raises(ValueError, match=message):
        ElectionConfig(NS, NAME, "a", **({"lease_duration": 15, "renew_deadline": 10, "retry_period": 2} | timings))
    assert ElectionConfig(NS, NAME, "a", lease_duration=1.5, renew_deadline=1, retry_period=0.1).lease_seconds == 2
