"""Leader election on a coordination.k8s.io/v1 Lease, with client-go's semantics and defaults.

A candidate acquires the Lease by creating it, or by taking it over once the holder's
`renewTime + leaseDurationSeconds` has passed (or the holder released it). Every write carries
the resourceVersion it was based on, so of two candidates racing for one Lease the API server
lets exactly one win and answers the other 409 Conflict. The leader renews every retry period;
when it has not renewed for the renew deadline it has lost, and sets `lost`. A leader that
stops on purpose releases the Lease (holderIdentity "", leaseDurationSeconds 1, as client-go's
ReleaseOnCancel) so that a standby takes over at once instead of after the lease duration.

Writes are JSON merge patches that carry `metadata.resourceVersion`: the API server treats it
as a precondition, exactly as for an update (controller-runtime's MergeFromWithOptimisticLock).
Calls go through the operator's own client (tandem_operator.kube) in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from . import kube

LEASES = kube.Resource("coordination.k8s.io", "v1", "leases", "Lease")
# client-go's wait.JitterUntil factor: a standby waits retryPeriod * (1 + 1.2 * random()) between
# attempts, so that standbys started together do not hit the API server in step.
JITTER_FACTOR = 1.2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ElectionConfig:
    """Which Lease, who we are, and client-go's timings (seconds)."""

    namespace: str
    name: str
    identity: str
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        for field in ("namespace", "name", "identity"):
            if not getattr(self, field):
                raise ValueError(f"leader election needs a {field}")
        if min(self.lease_duration, self.renew_deadline, self.retry_period) <= 0:
            raise ValueError("leader election durations must be > 0")
        # The leader must give up before a standby may take over (client-go checks the same).
        if self.lease_duration <= self.renew_deadline:
            raise ValueError(f"lease duration ({self.lease_duration}s) must be greater than the renew "
                             f"deadline ({self.renew_deadline}s)")
        if self.renew_deadline <= JITTER_FACTOR * self.retry_period:
            raise ValueError(f"renew deadline ({self.renew_deadline}s) must be greater than "
                             f"{JITTER_FACTOR} x the retry period ({self.retry_period}s)")

    @property
    def lease_seconds(self) -> int:
        """leaseDurationSeconds as written on the Lease: whole seconds, rounded up."""
        return max(1, math.ceil(self.lease_duration))

    @property
    def lease(self) -> str:
        return f"{self.namespace}/{self.name}"


def utc_now() -> datetime:
    return datetime.now(UTC)


def format_time(moment: datetime) -> str:
    """A MicroTime as the API server writes it: RFC 3339, microseconds, UTC."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def expiry(spec: dict) -> datetime | None:
    """When the holder's claim ends: renewTime + leaseDurationSeconds (None if either is missing)."""
    renewed, seconds = parse_time(spec.get("renewTime")), spec.get("leaseDurationSeconds")
    if renewed is None or not isinstance(seconds, (int, float)):
        return None
    return renewed + timedelta(seconds=seconds)


def claim(old: dict, identity: str, lease_seconds: int, now: datetime) -> dict:
    """The spec that makes `identity` the holder: a renewal if it already was, else a takeover."""
    transitions = int(old.get("leaseTransitions") or 0)
    renewal = old.get("holderIdentity") == identity
    return {
        "holderIdentity": identity,
        "leaseDurationSeconds": lease_seconds,
        "acquireTime": old.get("acquireTime") if renewal and old.get("acquireTime") else format_time(now),
        "renewTime": format_time(now),
        "leaseTransitions": transitions if renewal else transitions + 1,
    }


def released(old: dict, now: datetime) -> dict:
    """client-go's release: no holder, a one-second lease, the transitions kept."""
    return {"holderIdentity": "", "leaseDurationSeconds": 1, "acquireTime": format_time(now),
            "renewTime": format_time(now), "leaseTransitions": int(old.get("leaseTransitions") or 0)}


class LeaseClient:
    """Get, create and conditionally update one Lease; each call runs in a worker thread.

    The calls make futures, not tasks: when kopf stops, it waits for and then cancels every task
    started after it, and the leader's renewals must go on until kopf has stopped.
    """

    def __init__(self, namespace: str, name: str):
        self.namespace, self.name = namespace, name

    async def get(self) -> dict | None:
        return await _in_thread(kube.get, LEASES, self.namespace, self.name)

    async def create(self, spec: dict) -> dict:
        body = {"apiVersion": LEASES.api_version, "kind": LEASES.kind,
                "metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec}
        return await _in_thread(kube.create, LEASES, self.namespace, body)

    async def update(self, lease: dict, spec: dict) -> dict:
        """Write `spec` over `lease` only if nobody changed it since it was read (else 409)."""
        version = (lease.get("metadata") or {}).get("resourceVersion")
        body = {"metadata": {"resourceVersion": version}, "spec": spec} if version else {"spec": spec}
        return await _in_thread(kube.patch, LEASES, self.namespace, self.name, body)


async def _in_thread(function: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, function, *args)


class LeaderElector:
    """One candidate for one Lease: `acquire()`, then `start_renewing()`, then `release()`.

    `lost` is set when the leader could not renew within the renew deadline. `clock` gives the
    wall-clock time written to and compared with the Lease; `monotonic` measures the deadlines.
    """

    def __init__(self, config: ElectionConfig, *, client: LeaseClient | None = None,
                 clock: Callable[[], datetime] = utc_now, monotonic: Callable[[], float] = time.monotonic,
                 on_lost: Callable[[], None] | None = None):
        self.config = config
        self.client = client or LeaseClient(config.namespace, config.name)
        self.clock, self.monotonic, self.on_lost = clock, monotonic, on_lost
        self.lost = asyncio.Event()
        self.is_leader = False
        self.holder: str | None = None  # the holder last seen on the Lease
        self._written: dict | None = None  # the Lease as this candidate last wrote it
        self._observed: tuple[float, dict] | None = None  # when its spec last changed, and the spec
        self._renewed_at = 0.0
        self._renewals: asyncio.Task | None = None
        self._stopping = False
        self._wakeup: asyncio.Future | None = None

    async def acquire(self, stop: asyncio.Event | None = None) -> bool:
        """Try every retry period (jittered) until leader (True) or until `stop` is set (False)."""
        logger.info("Candidate %s for leader election on Lease %s.", self.config.identity, self.config.lease)
        while not (stop and stop.is_set()):
            if await self.try_acquire_or_renew(timeout=self.config.renew_deadline):
                logger.info("Became leader: %s holds Lease %s.", self.config.identity, self.config.lease)
                return True
            delay = self.config.retry_period * (1 + JITTER_FACTOR * random.random())
            if stop is None:
                await asyncio.sleep(delay)
            else:
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except TimeoutError:
                    pass
        return False

    def start_renewing(self) -> asyncio.Task:
        """Renew in a task of its own until lost or released; start it before kopf (see LeaseClient)."""
        self._renewals = asyncio.get_running_loop().create_task(self._renew(), name="leader election renewals")
        return self._renewals

    async def release(self) -> bool:
        """Stop renewing and hand the Lease back at once; True if it was released."""
        self._stopping = True
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)
        if self._renewals is not None:
            await self._renewals  # lets an in-flight renewal finish, so its resourceVersion is known
        if not self.is_leader or self._written is None:
            return False
        self.is_leader = False
        try:  # based on our own last write: if anyone wrote since, the Lease is not ours to release
            async with asyncio.timeout(self.config.renew_deadline):
                await self.client.update(self._written, released(self._written.get("spec") or {}, self.clock()))
        except Exception as e:  # unreleased, it expires after the lease duration instead
            logger.warning("Could not release Lease %s: %s", self.config.lease, e)
            return False
        logger.info("Released Lease %s: a standby may take over now.", self.config.lease)
        return True

    async def try_acquire_or_renew(self, timeout: float | None = None) -> bool:
        """One attempt, as client-go's tryAcquireOrRenew; False on any failure, which is logged."""
        try:
            async with asyncio.timeout(timeout):
                return await self._attempt()
        except TimeoutError:
            logger.warning("Leader election on Lease %s: the API server did not answer within %.1fs.",
                           self.config.lease, timeout)
        except kube.KubeError as e:
            log = logger.debug if e.status == 409 else logger.warning  # 409: someone else won the race
            log("Leader election on Lease %s: %s", self.config.lease, e)
        except Exception as e:
            logger.warning("Leader election on Lease %s failed: %s", self.config.lease, e)
        return False

    async def _attempt(self) -> bool:
        now, sent = self.clock(), self.monotonic()  # a renewal counts from when it was sent
        # The leader's fast path, while no one else was seen holding it: one write based on the
        # version it wrote last.
        if self.is_leader and self._written is not None and self.holder == self.config.identity:
            try:
                return self._won(sent, await self.client.update(
                    self._written, claim(self._written.get("spec") or {}, self.config.identity,
                                         self.config.lease_seconds, now)))
            except kube.KubeError as e:
                logger.debug("Renewal of Lease %s by its last version failed (%s); reading it.",
                             self.config.lease, e)
        lease = await self.client.get()
        if lease is None:  # the first holder of a new Lease: no transition yet
            first = claim({}, self.config.identity, self.config.lease_seconds, now) | {"leaseTransitions": 0}
            return self._won(sent, await self.client.create(first))
        spec = lease.get("spec") or {}
        self._observe(spec)
        if self._held_by_another(spec, now):
            return False
        return self._won(sent, await self.client.update(lease, claim(spec, self.config.identity,
                                                                     self.config.lease_seconds, now)))

    def _observe(self, spec: dict) -> None:
        if self._observed is None or self._observed[1] != spec:
            self._observed = (self.monotonic(), spec)
        holder = spec.get("holderIdentity") or None
        if holder != self.holder and holder and holder != self.config.identity:
            if self.is_leader:
                logger.warning("Lease %s was taken over by %s.", self.config.lease, holder)
            else:
                logger.info("Lease %s is held by %s; %s waits as a standby.", self.config.lease, holder,
                            self.config.identity)
        self.holder = holder

    def _held_by_another(self, spec: dict, now: datetime) -> bool:
        holder = spec.get("holderIdentity")
        if not holder or holder == self.config.identity:
            return False
        ends = expiry(spec)
        if ends is not None:
            return now < ends
        # No usable renewTime: as client-go does, count from when this candidate saw it change.
        seen_at = self._observed[0] if self._observed else self.monotonic()
        return self.monotonic() < seen_at + float(spec.get("leaseDurationSeconds") or self.config.lease_duration)

    def _won(self, sent: float, lease: dict) -> bool:
        self._written = lease
        self._observe(lease.get("spec") or {})
        self._renewed_at = sent
        self.is_leader = True
        return True

    async def _renew(self) -> None:
        # The renew deadline counts from the last successful renewal: the leader never acts on a
        # Lease whose renewTime is more than renewDeadline old, which leaves it leaseDuration -
        # renewDeadline to stop before any standby may take over.
        while await self._pause(self.config.retry_period):
            while True:
                remaining = self._renewed_at + self.config.renew_deadline - self.monotonic()
                if remaining <= 0:
                    self._lose()
                    return
                if await self.try_acquire_or_renew(timeout=remaining):
                    break
                if self._stopping:
                    return
                await self._pause(min(self.config.retry_period, remaining))

    async def _pause(self, delay: float) -> bool:
        """Sleep `delay`, cut short by release(); False once stopping. Makes no task (see LeaseClient)."""
        if self._stopping:
            return False
        loop = asyncio.get_running_loop()
        self._wakeup = loop.create_future()
        timer = loop.call_later(delay, lambda f: f.done() or f.set_result(None), self._wakeup)
        try:
            await self._wakeup
        finally:
            timer.cancel()
        return not self._stopping

    def _lose(self) -> None:
        self.is_leader = False
        logger.error("Lost Lease %s: %s could not renew it within %.1fs; stopping.", self.config.lease,
                     self.config.identity, self.config.renew_deadline)
        self.lost.set()
        if self.on_lost is not None:
            self.on_lost()
