"""The drift check and the patch: a child converges to its spec, removals included, and what the
API server leaves out of its answers (zero values) is not drift."""

from __future__ import annotations

import copy

import pytest

from tandem_operator.apply import NotOwned, _patch_body, adopt, check_owned, contains, without_nulls
from tandem_operator.children import build_children
from tandem_operator.spec import parse_spec

BASE = {"model": {"path": "m", "volume": {"persistentVolumeClaim": {"claimName": "models"}}},
        "image": "ghcr.io/example/tandem:0.1.0", "experts": {"cpus": 4, "memory": "16Gi"}}
EVERYTHING_SET = {**BASE, "imagePullSecrets": [{"name": "registry"}],
                  "placement": {"nodeSelector": {"pool": "moe"}, "onePerNode": True}}


def deployment(raw: dict) -> dict:
    return build_children(parse_spec(raw), "mx", "ns")[0]


def served(obj: dict) -> dict:
    """`obj` as the API server stores it: created without nulls."""
    return without_nulls(copy.deepcopy(obj))


def merge_patch(target, patch):
    """RFC 7386, as the API server applies a merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


@pytest.mark.parametrize("removed", ["imagePullSecrets", "nodeSelector", "onePerNode"])
def test_a_setting_taken_out_of_the_spec_is_taken_off_the_deployment(removed):
    raw = copy.deepcopy(EVERYTHING_SET)
    if removed == "imagePullSecrets":
        del raw["imagePullSecrets"]
    elif removed == "nodeSelector":
        del raw["placement"]["nodeSelector"]
    else:
        raw["placement"]["onePerNode"] = False
    server, desired = served(deployment(EVERYTHING_SET)), deployment(raw)

    assert not contains(server, desired), "the server still has the removed setting: that is drift"
    patched = merge_patch(server, _patch_body(desired))
    assert contains(patched, desired), "one patch converges"
    spec = pod_spec(patched)
    assert ("imagePullSecrets" in spec) == (removed != "imagePullSecrets")
    assert ("nodeSelector" in spec) == (removed != "nodeSelector")
    assert ("podAntiAffinity" in spec["affinity"]) == (removed != "onePerNode")


def test_nothing_set_and_nothing_on_the_server_is_no_drift():
    desired = deployment(BASE)
    assert pod_spec(desired)["nodeSelector"] is None
    assert contains(served(desired), desired)


def test_create_sends_no_nulls():
    def nulls(value) -> int:
        if isinstance(value, dict):
            return sum(v is None or nulls(v) for v in value.values())
        if isinstance(value, list):
            return sum(nulls(v) for v in value)
        return 0

    assert nulls(deployment(BASE)) > 0
    assert nulls(without_nulls(deployment(BASE))) == 0


def test_zero_values_the_server_omits_are_not_drift():
    raw = {**BASE, "model": {"volume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": False}}},
           "placement": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "value": "",
                                          "effect": "NoSchedule"}]}}
    desired = deployment(raw)
    server = served(desired)
    # omitempty: the API server answers without false, "" and other zero values.
    del pod_spec(server)["volumes"][0]["persistentVolumeClaim"]["readOnly"]
    del pod_spec(server)["tolerations"][0]["value"]
    assert contains(server, desired)


@pytest.mark.parametrize("actual, desired, same", [
    ({}, {"a": False}, True), ({}, {"a": 0}, True), ({}, {"a": ""}, True), ({}, {"a": []}, True),
    ({}, {"a": {}}, True), ({}, {"a": None}, True), ({"a": None}, {"a": None}, True),
    ({}, {"a": True}, False), ({}, {"a": "x"}, False), ({}, {"a": [1]}, False), ({}, {"a": 1}, False),
    ({"a": {"b": 1}}, {"a": None}, False), ({"a": "x"}, {"a": None}, False), ({"a": True}, {"a": False}, False),
    ({"a": "1Gi"}, {"a": "1024Mi"}, True),
])
def test_missing_means_zero_and_none_means_absent(actual, desired, same):
    assert contains(actual, desired) is same


OWNER = {"apiVersion": "tandem.dev/v1alpha1", "kind": "HybridModel", "name": "mx", "uid": "uid-mx",
         "controller": True, "blockOwnerDeletion": True}


def existing(owner: dict | None, labels: dict | None = None) -> dict:
    return {"kind": "Deployment", "metadata": {"name": "mx", "labels": labels or {},
                                               "ownerReferences": [owner] if owner else []}}


@pytest.mark.parametrize("current, ours", [
    (existing(OWNER), True),
    (existing(None, {"tandem.dev/hybridmodel": "mx"}), True),  # our own child, orphaned: adopted
    (existing(None), False),  # someone else's Deployment of the same name
    (existing(None, {"tandem.dev/hybridmodel": "other"}), False),
    (existing({**OWNER, "uid": "uid-older-mx"}, {"tandem.dev/hybridmodel": "mx"}), False),  # a deleted namesake's
    (existing({"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "x", "uid": "u", "controller": True}), False),
])
def test_an_object_another_owner_controls_is_never_taken_over(current, ours):
    desired = adopt(deployment(BASE), OWNER)
    if ours:
        check_owned(current, desired)
    else:
        with pytest.raises(NotOwned, match="Deployment mx already exists"):
            check_owned(current, desired)
