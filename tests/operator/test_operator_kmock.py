"""The real operator against KMock over HTTP: create, update, drift repair, delete, status."""

from __future__ import annotations

from hm_cluster import DEPLOYMENT, PDB, SERVICE, hybrid_model, model_path, wait_for

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

    async def pending_status():
        model = await cluster.get(model_path("mixtral"))
        return model if (model.get("status") or {}).get("phase") == "Pending" else None

    model = await wait_for(pending_status, what="status.phase Pending")
    status = model["status"]
    assert status["desiredReplicas"] == 1 and status["readyReplicas"] == 0
    assert status["selector"] == f"{names.MODEL_LABEL}=mixtral"
    assert status["observedGeneration"] == 1
    assert condition(model, "Ready")["status"] == "False"
    assert condition(model, "Progressing")["status"] == "True"
    assert condition(model, "Degraded")["status"] == "False"
