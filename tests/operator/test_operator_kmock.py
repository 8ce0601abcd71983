"""The real operator against KMock over HTTP: create, update, drift repair, delete, status."""

from __future__ import annotations

from hm_cluster import DEPLOYMENT, NS, PDB, SERVICE, core_path, hybrid_model, model_path, wait_for, wait_for_phase

from tandem_operator import names


def containers(deployment: dict) -> dict[str, dict]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def condition(model: dict, type_: str) -> dict:
    return next((c for c in (model.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


async def test_create_builds_owned_children_and_status(cluster, operator):
    await cluster.create_model(hybrid_model("mixtral"))

    deployment = await wait_for(lambda: cluster.get(DEPLOYMENT("mixtral")), what="Deployment")
    service = await wait_for(lambda: cluster.get(SERVICE("mixtral")), what="Service")
    pdb = await wait_for(lambda: cluster.get(PDB("mixtral")), what="PodDisruptionBudget")
    for child in (deployment, service, pdb):
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "tandem.dev/v1alpha1", "kind": "HybridModel", "name": "mixtral",
                       "uid": "uid-mixtral", "controller": True, "blockOwnerDeletion": True}
    assert set(containers(deployment)) == {"attention", "experts"}
    assert deployment["spec"]["replicas"] == 1

    model = await wait_for_phase(cluster, "mixtral", "Pending")
    status = model["status"]
    assert status["desiredReplicas"] == 1 and status["readyReplicas"] == 0
    assert status["selector"] == f"{names.MODEL_LABEL}=mixtral"
    assert status["observedGeneration"] == 1
    assert condition(model, "Ready")["status"] == "False"
    assert condition(model, "Progressing")["status"] == "True"
    assert condition(model, "Degraded")["status"] == "False"


async def test_spec_change_rolls_out_and_drift_is_repaired(cluster, operator):
    await cluster.create_model(hybrid_model("qwen"))
    await wait_for(lambda: cluster.get(DEPLOYMENT("qwen")), what="Deployment")

    # A spec change rolls out to the pod template and the replica count.
    await cluster.patch(model_path("qwen"), {"metadata": {"generation": 2},
                                             "spec": {"image": "ghcr.io/example/tandem:0.2.0", "replicas": 3}})

    async def rolled_out():
        dep = await cluster.get(DEPLOYMENT("qwen"))
        images = {c["image"] for c in containers(dep).values()}
        return dep if images == {"ghcr.io/example/tandem:0.2.0"} and dep["spec"]["replicas"] == 3 else None

    await wait_for(rolled_out, what="the new image and replicas in the Deployment")

    # Until the status says generation 2 was reconciled, an edit of a child is part of that
    # rollout (reconcile.py): repaired, but no DriftRepaired event. The children are written first.
    async def observed():
        model = await cluster.get(model_path("qwen"))
        return ((model or {}).get("status") or {}).get("observedGeneration") == 2

    await wait_for(observed, what="the status's observedGeneration at 2")

    # A hand edit of a field the operator sets is put back.
    dep = await cluster.get(DEPLOYMENT("qwen"))
    edited = [dict(c, image="evil:latest") for c in dep["spec"]["template"]["spec"]["containers"]]
    await cluster.patch(DEPLOYMENT("qwen"), {"spec": {"replicas": 7, "template": {"spec": {"containers": edited}}}})
    await wait_for(rolled_out, what="the hand-edited Deployment restored")

    # A deleted child is recreated.
    await cluster.delete(SERVICE("qwen"))
    service = await wait_for(lambda: cluster.get(SERVICE("qwen")), what="the Service recreated")
    assert service["spec"]["selector"] == {names.MODEL_LABEL: "qwen"}
    await wait_for(lambda: cluster.events("DriftRepaired"), what="a DriftRepaired event")


async def test_deletion_is_never_blocked_by_a_finalizer(cluster, operator):
    # The children go with their HybridModel through the garbage collector (controller owner
    # references); no finalizer means deletion works with no operator running, e.g. after
    # `helm uninstall`.
    await cluster.create_model(hybrid_model("gone", autoscaling={
        "enabled": True, "maxReplicas": 2, "targetP95InterTokenLatencyMs": 50}))
    await wait_for(lambda: cluster.get(PDB("gone")), what="children")

    async def reported():
        model = await cluster.get(model_path("gone"))
        return model if (model.get("status") or {}).get("conditions") else None

    model = await wait_for(reported, what="status written")
    assert not model["metadata"].get("finalizers")
    for child in (DEPLOYMENT("gone"), SERVICE("gone"), PDB("gone")):
        (ref,) = (await cluster.get(child))["metadata"]["ownerReferences"]
        assert ref["uid"] == "uid-gone" and ref["controller"] and ref["blockOwnerDeletion"]

    await cluster.delete(model_path("gone"))
    assert await cluster.get(model_path("gone")) is None


async def test_status_follows_deployment_and_pods(cluster, operator):
    await cluster.create_model(hybrid_model("st", replicas=2))
    await wait_for(lambda: cluster.get(DEPLOYMENT("st")), what="Deployment")

    # The Deployment controller's report: both replicas up to date and ready.
    await cluster.patch(DEPLOYMENT("st") + "/status", {"status": {
        "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "availableReplicas": 2}})

    model = await wait_for_phase(cluster, "st", "Running")
    assert model["status"]["readyReplicas"] == 2
    assert condition(model, "Ready")["status"] == "True"
    assert condition(model, "Progressing")["reason"] == "Complete"

    # A pod that no node fits turns the model Degraded, with the scheduler's reason.
    await cluster.create(core_path("pods"), pod("st-abc", "st", scheduled=False))
    model = await wait_for_phase(cluster, "st", "Degraded")
    degraded = condition(model, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "Unschedulable"
    assert "0/3 nodes are available" in degraded["message"]


async def test_invalid_spec_is_reported_not_applied(cluster, operator):
    # As if the API server's schema were older or absent: the operator checks again.
    body = hybrid_model("bad", replicas=-1)
    await cluster.create_model(body, validate=False)

    model = await wait_for_phase(cluster, "bad", "Failed")
    assert condition(model, "Degraded")["reason"] == "InvalidSpec"
    assert "spec.replicas" in condition(model, "Degraded")["message"]
    await wait_for(lambda: cluster.events("InvalidSpec"), what="an InvalidSpec event")
    assert await cluster.get(DEPLOYMENT("bad")) is None


def pod(name: str, model: str, scheduled: bool = True, ip: str = "127.0.0.1", metrics_port: int = 9400) -> dict:
    """A pod of `model` as the ReplicaSet controller and kubelet would leave it."""
    if scheduled:
        conditions = [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]
        status = {"phase": "Running", "podIP": ip, "conditions": conditions}
    else:
        status = {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."}]}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "labels": names.common_labels(model)},
        "spec": {"containers": [
            {"name": "attention", "image": "x", "ports": [{"name": "metrics", "containerPort": metrics_port}]},
            {"name": "experts", "image": "x"}]},
        "status": status,
    }
