"""The operator's RBAC: exactly what it and kopf use, written out, with no wildcards."""

from __future__ import annotations

import pytest

from conftest import NON_DEFAULT_VALUES, by_kind, one, render_objects

# (API group, resource, verb) the operator needs in each namespace it watches.
# Read from operator/tandem_operator: kube.get/create/patch and list_labelled calls, the kopf
# handlers (on.event watches children and pods; kopf's annotations patch the model), kopf.warn/info
# (Events), status_store (status subresource); `delete` on children because setting owner
# references asks for it (OwnerReferencesPermissionEnforcement).
CHILD_VERBS = ("get", "list", "watch", "create", "patch", "delete")
OPERATOR_NEEDS = {
    *{("tandem.dev", "hybridmodels", verb) for verb in ("get", "list", "watch", "patch")},
    ("tandem.dev", "hybridmodels/status", "patch"),
    *{("apps", "deployments", verb) for verb in CHILD_VERBS},
    *{("", "services", verb) for verb in CHILD_VERBS},
    *{("policy", "poddisruptionbudgets", verb) for verb in CHILD_VERBS},
    *{("", "pods", verb) for verb in ("list", "watch")},
    ("", "events", "create"),
}
CHILDREN = {"deployments", "services", "poddisruptionbudgets"}
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
            assert verb not in ("deletecollection", "escalate", "bind", "impersonate", "update"), (resource, verb)
            assert verb != "delete" or resource in CHILDREN, (resource, verb)
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


def test_operator_children_and_watches_are_covered():
    # The resources the operator's own code names must all be granted (and nothing else).
    handlers = pytest.importorskip("tandem_operator.handlers")
    kube = pytest.importorskip("tandem_operator.kube")
    watched = {(group, plural) for group, _, plural in handlers.CHILD_RESOURCES}
    touched = {(r.group, r.plural) for r in kube.BY_KIND.values()}
    granted = {(group, resource) for group, resource, _ in OPERATOR_NEEDS}
    assert watched | touched | {(kube.HYBRIDMODELS.group, "hybridmodels/status"), ("", "events")} == granted


def test_rbac_can_be_left_out(chart):
    objects = render_objects(chart, {"rbac": {"create": False}})
    assert not [obj for obj in objects if obj["apiVersion"].startswith("rbac.authorization.k8s.io/")]
