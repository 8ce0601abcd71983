"""The real operator against KMock: fixtures shared by tests/operator and tests/e2e.

A plain module (not a conftest) so the e2e tests can import these fixtures too.
"""

from __future__ import annotations

import asyncio

import aiohttp
import kmock
import kopf
import pytest
import yaml
from kopf.testing import KopfRunner

from tandem_operator import handlers

from hm_cluster import NS, Cluster, load_crd
from versioned_kmock import VersionedKMock

# Fast loops for tests; the periodic resync is kept out of the way so drift repair is shown to
# come from watch events, not from periodic polling.
AUTOSCALE_INTERVAL = 0.2
RESYNC_INTERVAL = 3600.0


@pytest.fixture
def kmock_options(kmock_options):
    """KMock's own options, with VersionedKMock for its default class (a marker's class is kept)."""
    if kmock_options.get("cls") is kmock.KubernetesEmulator:
        kmock_options["cls"] = VersionedKMock
    return kmock_options


@pytest.fixture
async def cluster(kmock, tmp_path, monkeypatch) -> Cluster:
    """KMock with the built-in resources and the HybridModel CRD, and a kubeconfig pointing at it."""
    kmock.resources.load_bundled()
    crd = load_crd()["spec"]
    version = crd["versions"][0]
    kmock.resources[f"{crd['group']}/{version['name']}/{crd['names']['plural']}"] = kmock.ResourceInfo(
        kind=crd["names"]["kind"], namespaced=crd["scope"] == "Namespaced",
        singular=crd["names"]["singular"], shortnames=set(crd["names"]["shortNames"]),
        verbs={"get", "list", "watch", "create", "patch", "delete"},
        subresources=set(version["subresources"]))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
        "users": [{"name": "kmock", "user": {"token": "test-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": NS}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    async with aiohttp.ClientSession() as session:
        yield Cluster(str(kmock.url), session, kmock)


@pytest.fixture
async def operator(cluster):
    """The real operator (all its handlers, fast timers) running against KMock over HTTP."""
    registry = handlers.register(kopf.OperatorRegistry(), autoscale_interval=AUTOSCALE_INTERVAL,
                                 resync_interval=RESYNC_INTERVAL)

    @kopf.on.startup(registry=registry)
    def kmock_settings(settings: kopf.OperatorSettings, **_):
        # Per-object workers idle 5 s before exiting, and shutdown waits for them: keep it short.
        settings.queueing.idle_timeout = 0.2
        settings.queueing.exit_timeout = 0.5

    runner = KopfRunner(["run", "--standalone", "--all-namespaces", "--verbose"], registry=registry, timeout=30)
    await asyncio.to_thread(runner.__enter__)
    try:
        yield runner
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)
