"""The real operator against KMock: children converge to the spec (removals too), the API server's
refusals end in status instead of endless retries, and only the operator's children are watched."""

from __future__ import annotations

import asyncio
import logging
import re

import kmock
import kopf
import pytest
from hm_cluster import DEPLOYMENT, NS, SERVICE, core_path, hybrid_model, model_path, wait_for, wait_for_phase
from test_operator_kmock import condition

from tandem_operator import handlers, kube, reconcile
from tandem_operator.login import configure_client

LOG = logging.getLogger("test")


async def test_settings_taken_out_of_the_spec_are_taken_off_the_deployment(cluster, operator):
    await cluster.create_model(hybrid_model("sel", imagePullSecrets=[{"name": "registry"}],
                                            placement={"nodeSelector": {"pool": "moe"}, "onePerNode": True}))
    deployment = await wait_for(lambda: cluster.get(DEPLOYMENT("sel")), what="Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "moe"} and pod["imagePullSecrets"] == [{"name": "registry"}]
    assert "podAntiAffinity" in pod["affinity"]

    await cluster.patch(model_path("sel"), {"metadata": {"generation": 2}, "spec": {
        "imagePullSecrets": None, "placement": {"nodeSelector": None, "onePerNode": False}}})

    async def converged():
        pod = (await cluster.get(DEPLOYMENT("sel")))["spec"]["template"]["spec"]
        left = {"nodeSelector", "imagePullSecrets"} & set(pod) | {"podAntiAffinity"} & set(pod["affinity"])
        return pod if not left else None

    pod = await wait_for(converged, what="nodeSelector, imagePullSecrets and podAntiAffinity gone")
    assert "nodeAffinity" in pod["affinity"]


async def test_a_rejected_child_is_reported_once_not_retried_forever(cluster, operator):
    # A rule the CRD's schema cannot express (a typo such as operator: Exist it rejects itself).
    toleration = {"key": "k", "operator": "Exists", "value": "v"}
    message = 'spec.template.spec.tolerations[0].operator: Invalid value: "v": value must be empty'
    # KMock stores a created object even when a reaction answers an error: hide it from GETs too.
    cluster.kmock["post", re.compile(r".*/deployments")] << kmock.KubernetesError(
        status=422, reason="Invalid", message=f'Deployment.apps "rej" is invalid: {message}')
    cluster.kmock["get", re.compile(r".*/deployments/rej")] << kmock.KubernetesNotFoundError()
    await cluster.create_model(hybrid_model("rej", placement={"tolerations": [toleration]}))

    async def degraded():
        model = await cluster.get(model_path("rej"))
        return condition(model, "Degraded") if condition(model, "Degraded").get("reason") == "ChildRejected" else None

    found = await wait_for(degraded, what="Degraded ChildRejected")
    assert found["status"] == "True" and message in found["message"] and "HTTP 422" in found["message"]
    assert (await cluster.get(model_path("rej")))["status"]["phase"] == "Degraded"

    # The Deployment's own watch event makes a second attempt, rejected again: still one event.
    def posts():
        return [r for r in list(cluster.kmock) if r.method == "POST" and r.url.path.endswith("/deployments")]

    await wait_for(lambda: len(posts()) >= 2, what="a second attempt")
    await wait_for(lambda: cluster.events("ChildRejected"), what="a ChildRejected event")
    assert len(await cluster.events("ChildRejected")) == 1


async def test_a_namesake_someone_else_owns_is_left_alone_and_reported(cluster, operator, monkeypatch):
    monkeypatch.setattr(reconcile, "CONFLICT_RETRY_SECONDS", 0.3)
    theirs = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "taken", "namespace": NS,
                                                                  "labels": {"app": "billing"}},
              "spec": {"selector": {"app": "billing"}, "ports": [{"name": "http", "port": 80}]}}
    await cluster.create(core_path("services"), theirs)
    await cluster.create_model(hybrid_model("taken"))

    async def conflict():
        model = await cluster.get(model_path("taken"))
        found = condition(model, "Degraded")
        return found if found.get("reason") == "ChildConflict" else None

    found = await wait_for(conflict, what="Degraded ChildConflict")
    assert found["status"] == "True" and "Service taken already exists" in found["message"]
    await wait_for(lambda: cluster.events("ChildConflict"), what="a ChildConflict event")
    service = await cluster.get(SERVICE("taken"))
    # Not patched, not adopted: deleting the HybridModel must not delete someone else's Service.
    assert service["spec"]["selector"] == {"app": "billing"} and not service["metadata"].get("ownerReferences")

    # Once the namesake is gone, the retry creates the model's own Service.
    await cluster.delete(SERVICE("taken"))

    async def ours():
        service = await cluster.get(SERVICE("taken"))
        return service if service and service["metadata"].get("ownerReferences") else None

    service = await wait_for(ours, what="the model's own Service")
    assert service["spec"]["selector"] == {"tandem.dev/hybridmodel": "taken"}


@pytest.mark.parametrize("status, error", [(400, kopf.PermanentError), (403, kopf.PermanentError),
                                           (422, kopf.PermanentError), (429, kopf.TemporaryError),
                                           (500, kopf.TemporaryError), (503, kopf.TemporaryError)])
async def test_api_errors_become_kopf_retries_or_give_up(cluster, monkeypatch, status, error):
    body = hybrid_model("err")
    await cluster.create_model(body)
    await asyncio.to_thread(configure_client)

    def refuse(resource, namespace, child):
        raise kube.KubeError(status, "POST", resource.path(namespace), "the server says no")

    warnings = []
    monkeypatch.setattr(kube, "create", refuse)
    monkeypatch.setattr(kopf, "warn", lambda obj, reason, message: warnings.append(reason))
    with pytest.raises(error) as raised:
        await asyncio.to_thread(reconcile.reconcile, body, LOG, "spec")

    degraded = condition(await cluster.get(model_path("err")), "Degraded")
    if error is kopf.TemporaryError:
        assert raised.value.delay == reconcile.RETRY_DELAY_SECONDS
        assert not degraded and not warnings
    else:
        assert degraded["reason"] == "ChildRejected" and "the server says no" in degraded["message"]
        assert warnings == ["ChildRejected"]


@pytest.mark.parametrize("observed, repaired", [(1, False), (2, True)])
async def test_a_spec_change_reaching_children_first_is_no_drift(cluster, monkeypatch, observed, repaired):
    # A pod's event can reconcile generation 2 before the update handler does: that rollout is the
    # spec's, not a repair of a hand edit, and must not raise a DriftRepaired warning.
    body = hybrid_model("fresh", replicas=2)
    body["metadata"]["generation"] = 2
    body["status"] = {"observedGeneration": observed}
    await cluster.create_model(body, validate=False)
    await asyncio.to_thread(configure_client)
    warnings = []
    monkeypatch.setattr(kopf, "warn", lambda obj, reason, message: warnings.append(reason))

    outcomes = await asyncio.to_thread(reconcile.reconcile, body, LOG, "drift")
    assert set(outcomes.values()) == {reconcile.Outcome.CREATED}
    assert warnings == (["DriftRepaired"] * 3 if repaired else [])


async def test_a_name_that_cannot_name_a_service_is_an_invalid_spec(cluster, operator):
    # A valid object name (DNS subdomain), but not a DNS-1035 label: the Service would be refused.
    await cluster.create_model(hybrid_model("9lives"))

    model = await wait_for_phase(cluster, "9lives", "Failed")
    assert condition(model, "Degraded")["reason"] == "InvalidSpec"
    assert "metadata.name '9lives' must be a DNS-1035 label" in condition(model, "Degraded")["message"]
    assert await cluster.get(DEPLOYMENT("9lives")) is None


async def test_an_invalid_spec_is_announced_once_per_generation(cluster, monkeypatch):
    body = hybrid_model("bad", replicas=-1)
    await cluster.create_model(body, validate=False)
    await asyncio.to_thread(configure_client)
    warnings = []
    monkeypatch.setattr(kopf, "warn", lambda obj, reason, message: warnings.append(reason))

    for _ in range(3):  # e.g. a pod event, the resync, a retry
        with pytest.raises(kopf.PermanentError):
            await asyncio.to_thread(reconcile.checked_spec, body)
    assert warnings == ["InvalidSpec"]

    body["metadata"]["generation"] = 2  # edited, and still invalid: worth saying again
    await cluster.patch(model_path("bad"), {"metadata": {"generation": 2}})
    with pytest.raises(kopf.PermanentError):
        await asyncio.to_thread(reconcile.checked_spec, body)
    assert warnings == ["InvalidSpec", "InvalidSpec"]


def test_children_are_selected_on_the_server():
    settings = kopf.OperatorSettings()
    handlers.configure(settings)
    selectors = settings.watching.label_selectors
    for group, version, plural in handlers.CHILD_RESOURCES:
        assert selectors[group, version, plural] == "app.kubernetes.io/managed-by=tandem-operator"
    assert (handlers.MODEL not in selectors), "HybridModels carry no such label"


async def test_child_watches_carry_the_label_selector(cluster, operator):
    def watches(plural: str) -> list:
        return [r for r in list(cluster.kmock)
                if r.url.path.endswith(f"/{plural}") and r.params.get("watch") == "true"]

    for _, _, plural in handlers.CHILD_RESOURCES:
        requests = await wait_for(lambda: watches(plural), what=f"a watch on {plural}")
        assert {r.params.get("labelSelector") for r in requests} == {"app.kubernetes.io/managed-by=tandem-operator"}
    models = await wait_for(lambda: watches("hybridmodels"), what="a watch on hybridmodels")
    assert not any(r.params.get("labelSelector") for r in models)
