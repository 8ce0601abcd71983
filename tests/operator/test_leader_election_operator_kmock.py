"""Two real `tandem-operator --leader-elect` processes against KMock: one leads, one waits.

Each process has its own token, so KMock's request log tells which of them made each request.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import pytest
import yaml
from hm_cluster import DEPLOYMENT, NS, core_path, hybrid_model, wait_for
from lease_kmock import LEASES, LeaseKMock

from tandem_operator.leader_election import format_time, parse_time

pytestmark = pytest.mark.kmock(cls=LeaseKMock)

HERE = Path(__file__).resolve().parent
LEASE_NAME = "tandem-operator"
LEASE = core_path("leases", LEASE_NAME, group="coordination.k8s.io")
LEASE_SECONDS = 3
ELECTION = [f"--leader-election-lease-duration={LEASE_SECONDS}", "--leader-election-renew-deadline=2",
            "--leader-election-retry-period=0.2"]
START_TIMEOUT = 30.0  # a Python process importing kopf on two busy cores


class Operator:
    """One `python -m tandem_operator --leader-elect` process as pod `name`, with its own token."""

    def __init__(self, name: str, cluster, tmp_path: Path):
        self.name, self.token = name, f"token-{name}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/healthz"
        kubeconfig = tmp_path / f"kubeconfig-{name}"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": cluster.url}}],
            "users": [{"name": "kmock", "user": {"token": self.token}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
        }))
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "POD_NAME": name, "POD_NAMESPACE": NS,
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               "TANDEM_OPERATOR_RESYNC_INTERVAL": "3600"}
        self.log = tmp_path / f"{name}.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tandem_operator", "--leader-elect", *ELECTION, "--all-namespaces",
                 f"--liveness={self.url}", "--verbose", "--module=fast_kopf"],
                env=env, stdout=out, stderr=subprocess.STDOUT)

    def holds(self, spec: dict) -> bool:
        return (spec.get("holderIdentity") or "").startswith(f"{self.name}_")

    async def health(self) -> dict | None:
        """The liveness endpoint's JSON if it answers 200 (kopf's is `{}`), else None."""
        try:
            async with aiohttp.ClientSession() as session, session.get(self.url) as response:
                return await response.json() if response.status == 200 else None
        except aiohttp.ClientError:
            return None

    async def healthy(self) -> bool:
        return await self.health() is not None

    def requests(self, cluster) -> list:
        return [r for r in list(cluster.kmock) if r.headers.get("Authorization") == f"Bearer {self.token}"]

    async def exited(self, timeout: float) -> int:
        await wait_for(lambda: self.process.poll() is not None, timeout=timeout, what=f"{self.name} to exit")
        return self.process.returncode

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_lease(request) -> bool:
    return "/leases" in request.url.path


def creates_deployment(request) -> bool:
    return str(request.method).upper().endswith("POST") and request.url.path.endswith("/deployments")


@pytest.fixture
async def operators(cluster, tmp_path):
    started: list[Operator] = []

    def start(name: str) -> Operator:
        started.append(Operator(name, cluster, tmp_path))
        return started[-1]

    yield start
    for operator in started:
        operator.stop()
        print(f"--- {operator.name} ---\n{operator.log.read_text()[-4000:]}")


async def test_only_the_leader_reconciles_and_a_standby_takes_over(cluster, operators):
    async def lease() -> dict:
        return ((await cluster.get(LEASE)) or {}).get("spec") or {}

    first = operators("operator-a")
    await wait_for(lambda: _holds(first, lease), timeout=START_TIMEOUT, what="operator-a leading")
    second = operators("operator-b")
    # A standby answers the liveness endpoint itself, so the probes keep it alive and Ready.
    await wait_for(lambda: _standby_of(second, first), timeout=START_TIMEOUT, what="operator-b's standby health")
    await wait_for(first.healthy, timeout=START_TIMEOUT, what="operator-a's kopf health endpoint")

    await cluster.create_model(hybrid_model("first"))
    await wait_for(lambda: cluster.get(DEPLOYMENT("first")), timeout=START_TIMEOUT, what="Deployment first")
    assert [r for r in second.requests(cluster) if not is_lease(r)] == []  # the standby ran no kopf
    assert any(is_lease(r) for r in second.requests(cluster))
    assert any(creates_deployment(r) for r in first.requests(cluster))

    # SIGTERM: kopf stops, the Lease is released, and the standby takes over long before it expires.
    first.process.send_signal(signal.SIGTERM)
    assert await first.exited(timeout=START_TIMEOUT) == 0
    spec = await wait_for(lambda: _holds(second, lease), timeout=LEASE_SECONDS * 3, what="operator-b leading")
    assert spec["leaseTransitions"] == 1
    history = [dict(version["spec"]) for version in cluster.kmock.objects[LEASES, NS, LEASE_NAME].history]
    takeover = next(i for i, version in enumerate(history) if second.holds(version))
    last_renewal, release = history[takeover - 2:takeover]
    assert first.holds(last_renewal) and release["holderIdentity"] == "" and release["leaseDurationSeconds"] == 1
    waited = parse_time(history[takeover]["acquireTime"]) - parse_time(last_renewal["renewTime"])
    assert waited < timedelta(seconds=LEASE_SECONDS)

    await cluster.create_model(hybrid_model("second"))
    await wait_for(lambda: cluster.get(DEPLOYMENT("second")), timeout=START_TIMEOUT, what="Deployment second")
    assert any(creates_deployment(r) for r in second.requests(cluster))

    # Someone else takes the Lease: the leader cannot renew, stops kopf and exits non-zero.
    await cluster.patch(LEASE, {"spec": {"holderIdentity": "intruder_1", "leaseDurationSeconds": 60,
                                         "renewTime": format_time(datetime.now(UTC))}})
    assert await second.exited(timeout=START_TIMEOUT) == 1
    assert "Lost Lease" in second.log.read_text()
    assert (await lease())["holderIdentity"] == "intruder_1"

    # A standby stops at once on SIGTERM, having written nothing.
    third = operators("operator-c")
    await wait_for(lambda: _standby_of(third, "intruder_1"), timeout=START_TIMEOUT, what="operator-c waiting")
    third.process.send_signal(signal.SIGTERM)
    assert await third.exited(timeout=START_TIMEOUT) == 0
    assert {str(r.method).upper().rsplit(".", 1)[-1] for r in third.requests(cluster)} == {"GET"}


async def _holds(operator: Operator, lease) -> dict | None:
    spec = await lease()
    return spec if operator.holds(spec) else None


async def _standby_of(operator: Operator, leader: Operator | str) -> bool:
    """Whether `operator` answers its liveness endpoint as a standby that has seen `leader` hold the Lease."""
    election = ((await operator.health()) or {}).get("leaderElection") or {}
    holder = election.get("holder") or ""
    holds = leader.holds({"holderIdentity": holder}) if isinstance(leader, Operator) else holder == leader
    return election.get("role") == "standby" and holds
