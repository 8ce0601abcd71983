"""The operator's RBAC: exactly what it and kopf use, written out, with no wildcards."""

from __future__ import annotations

import pytest

from conftest import NON_DEFAULT_VALUES, by_kind, one, render_objects

# (API group, resource, verb) the operator needs in each namespace it watches.
OPERATOR_NEEDS = {
    *{("tandem.dev", "hybridmodels", verb) for verb in ("get", "list", "watch", "patch")},
    *{("tandem.dev", "hybridmodels/status", verb) for verb in ("get", "patch")},
    *{("apps", "deployments", verb) for verb in ("get", "list", "watch", "create", "patch")},
    *{("", "services", verb) for verb in ("get", "list", "watch", "create", "patch")},
    *{("policy", "poddisruptionbudgets", verb) for verb in ("get", "list", "watch", "create", "patch")},
    *{("", "pods", verb) for verb in ("get", "list", "watch")},
    ("", "events", "create"),
}
# kopf watches CRDs to notice resources appearing; named namespaces are watched too.
KOPF_CLUSTER_NEEDS = {("apiextensions.k8s.io", "customresourcedefinitions", verb) for verb in ("list", "watch")}
KOPF_NAMESPACE_OBSERVER = {("", "namespaces", verb) for verb in ("list", "watch")}


def grants(role: dict) -> set[tuple[str, str, str]]:
    return {(group, resource, verb)
            for rule in role["rules"]
            for group in rule["apiGroups"]
            for resource in rule["resources"]
            for verb in rule["verbs"]}


@pytest.mark.parametrize("values", [{}, NON_DEFAULT_VALUES["namespaced"]], ids=["clusterwide", "namespaced"])
def test_no_wildcards_and_no_write_beyond_children(chart, values):
    roles = [*by_kind(render_objects(chart, values), "ClusterRole"), *by_kind(render_objects(chart, values), "Role")]
    assert roles
    for role in roles:
        for rule in role["rules"]:
            assert set(rule) == {"apiGroups", "resources", "verbs"}, "no resourceNames/nonResourceURLs"
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field] and all("*" not in item for item in rule[field])
        for group, resource, verb in grants(role):
            assert verb not in ("delete", "deletecollection", "escalate", "bind", "impersonate"), (resource, verb)
            assert resource not in ("secrets", "configmaps", "nodes", "pods/exec", "pods/proxy")


def test_clusterwide_role_grants_exactly_what_is_needed(chart):
    objects = render_objects(chart)
    role = one(objects, "ClusterRole")
    assert grants(role) == OPERATOR_NEEDS | KOPF_CLUSTER_NEEDS
    binding = one(objects, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    account = one(objects, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
    assert not by_kind(objects, "Role") and not by_kind(objects, "RoleBinding")


def test_namespaced_mode_grants_children_only_in_watched_namespaces(chart):
    objects = render_objects(chart, NON_DEFAULT_VALUES["namespaced"])
    assert grants(one(objects, "ClusterRole")) == KOPF_CLUSTER_NEEDS | KOPF_NAMESPACE_OBSERVER
    roles = {role["metadata"]["namespace"]: role for role in by_kind(objects, "Role")}
    assert set(roles) == {"models", "research"}
    for namespace, role in roles.items():
        assert grants(role) == OPERATOR_NEEDS
        (binding,) = [b for b in by_kind(objects, "RoleBinding") if b["metadata"]["namespace"] == namespace]
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"][0]["namespace"] == "tandem-system"


def test_rbac_can_be_left_out(chart):
    objects = render_objects(chart, {"rbac": {"create": False}})
    assert not [obj for obj in objects if obj["apiVersion"].startswith("rbac.authorization.k8s.io/")]
