"""The operator's RBAC: exactly what it and kopf use, written out, with no wildcards."""

from __future__ import annotations

import pytest

from conftest import NON_DEFAULT_VALUES, by_kind, one, render_objects

# (API group, resource, verb) the operator needs in each namespace it watches.
# Read from operator/tandem_operator: kube.get/create/patch and list_labelled calls (on Secrets and
# ConfigMaps only `get`: prometheus_access and pod_secrets read those a HybridModel names), the kopf handlers (on.event
# watches children and pods; kopf's annotations patch the model), kopf.warn/info (Events),
# status_store (status subresource); `delete` on children because setting owner references asks
# for it, and `update` on the owner's finalizers because their blockOwnerDeletion does (both by the
# OwnerReferencesPermissionEnforcement admission plugin).
CHILD_VERBS = ("get", "list", "watch", "create", "patch", "delete")
OPERATOR_NEEDS = {
    *{("tandem.dev", "hybridmodels", verb) for verb in ("get", "list", "watch", "patch")},
    ("tandem.dev", "hybridmodels/status", "patch"),
    ("tandem.dev", "hybridmodels/finalizers", "update"),
    *{("apps", "deployments", verb) for verb in CHILD_VERBS},
    *{("", "services", verb) for verb in CHILD_VERBS},
    *{("policy", "poddisruptionbudgets", verb) for verb in CHILD_VERBS},
    *{("", "pods", verb) for verb in ("list", "watch")},
    ("", "secrets", "get"),
    ("", "configmaps", "get"),
    ("", "events", "create"),
}
CHILDREN = {"deployments", "services", "poddisruptionbudgets"}
# kopf watches CRDs to notice resources appearing; named namespaces are watched too.
KOPF_CLUSTER_NEEDS = {("apiextensions.k8s.io", "customresourcedefinitions", verb) for verb in ("list", "watch")}
KOPF_NAMESPACE_OBSERVER = {("", "namespaces", verb) for verb in ("list", "watch")}
# Leader election (tandem_operator.leader_election), in the release namespace only: read and renew
# (a merge patch carrying the resourceVersion) the one Lease, and create it the first time.
LEADER_ELECTION_NEEDS = {("coordination.k8s.io", "leases", verb) for verb in ("get", "patch", "create")}


AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def grants(role: dict) -> set[tuple[str, str, str]]:
    return {(group, resource, verb)
            for rule in role["rules"]
            for group in rule["apiGroups"]
            for resource in rule["resources"]
            for verb in rule["verbs"]}


def aggregated(role: dict) -> set[str]:
    """The built-in roles ("view", "edit", "admin") that `role` adds its rules to."""
    labels = role["metadata"].get("labels") or {}
    return {key.removeprefix(AGGREGATE) for key, value in labels.items()
            if key.startswith(AGGREGATE) and value == "true"}


def operator_roles(objects: list[dict]) -> list[dict]:
    """The (Cluster)Roles the chart binds (to the operator's ServiceAccount)."""
    bound = {(b["roleRef"]["kind"], b["roleRef"]["name"], b["metadata"].get("namespace"))
             for b in [*by_kind(objects, "ClusterRoleBinding"), *by_kind(objects, "RoleBinding")]}
    return [role for role in [*by_kind(objects, "ClusterRole"), *by_kind(objects, "Role")]
            if (role["kind"], role["metadata"]["name"], role["metadata"].get("namespace")) in bound]


def is_leader_election(role: dict) -> bool:
    return all(rule["resources"] == ["leases"] for rule in role["rules"])


def operator_cluster_role(objects: list[dict]) -> dict:
    (role,) = [role for role in operator_roles(objects) if role["kind"] == "ClusterRole"]
    return role


@pytest.mark.parametrize("values", [{}, NON_DEFAULT_VALUES["namespaced"]], ids=["clusterwide", "namespaced"])
def test_no_wildcards_and_no_write_beyond_children(chart, values):
    roles = operator_roles(render_objects(chart, values))
    assert roles
    assert not [role for role in roles if aggregated(role)]
    for role in roles:
        for rule in role["rules"]:
            # No nonResourceURLs; resourceNames only to narrow the Lease rules (see below).
            named = {"resourceNames"} if rule["resources"] == ["leases"] else set()
            assert {"apiGroups", "resources", "verbs"} <= set(rule) <= {"apiGroups", "resources", "verbs"} | named
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field] and all("*" not in item for item in rule[field])
        for group, resource, verb in grants(role):
            assert verb not in ("deletecollection", "escalate", "bind", "impersonate"), (resource, verb)
            # `update` only where no patch will do: the finalizers subresource (see OPERATOR_NEEDS).
            assert verb != "update" or resource == "hybridmodels/finalizers", (resource, verb)
            assert verb != "delete" or resource in CHILDREN, (resource, verb)
            assert resource not in ("nodes", "pods/exec", "pods/proxy")
            # Secrets (and CA ConfigMaps) are read one by name: `list` or `watch` would hand the
            # operator every Secret's data.
            assert resource not in ("secrets", "configmaps") or verb == "get", (resource, verb)


def test_clusterwide_role_grants_exactly_what_is_needed(chart):
    objects = render_objects(chart)
    role = operator_cluster_role(objects)
    assert grants(role) == OPERATOR_NEEDS | KOPF_CLUSTER_NEEDS
    binding = one(objects, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    account = one(objects, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
    # The only Role is leader election's, in the release namespace.
    assert [role["metadata"]["namespace"] for role in by_kind(objects, "Role") if is_leader_election(role)] == [
        "tandem-system"]
    assert len(by_kind(objects, "Role")) == len(by_kind(objects, "RoleBinding")) == 1


def test_namespaced_mode_grants_children_only_in_watched_namespaces(chart):
    objects = render_objects(chart, NON_DEFAULT_VALUES["namespaced"])
    assert grants(operator_cluster_role(objects)) == KOPF_CLUSTER_NEEDS | KOPF_NAMESPACE_OBSERVER
    roles = {role["metadata"]["namespace"]: role for role in by_kind(objects, "Role") if not is_leader_election(role)}
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
    subresources = {(kube.HYBRIDMODELS.group, f"hybridmodels/{sub}") for sub in ("status", "finalizers")}
    assert watched | touched | subresources | {("", "events")} == granted


def test_children_may_block_their_owners_deletion():
    # The operator's owner references set blockOwnerDeletion; under the OwnerReferencesPermission-
    # Enforcement admission plugin (on by default in OpenShift) creating such a child needs
    # `update` on the owner's finalizers subresource, or every create is Forbidden.
    names = pytest.importorskip("tandem_operator.names")
    reference = names.owner_reference({"metadata": {"name": "m", "uid": "1"}})
    assert reference["blockOwnerDeletion"] is True
    assert (names.GROUP, f"{names.PLURAL}/finalizers", "update") in OPERATOR_NEEDS


def test_rbac_can_be_left_out(chart):
    objects = render_objects(chart, {"rbac": {"create": False}})
    assert not [obj for obj in objects if obj["apiVersion"].startswith("rbac.authorization.k8s.io/")]


@pytest.mark.parametrize("values", [{}, NON_DEFAULT_VALUES["namespaced"]], ids=["clusterwide", "namespaced"])
def test_namespace_users_get_hybridmodels_through_the_builtin_roles(chart, values):
    # Without aggregation only cluster admins could create a HybridModel: namespace users hold
    # the built-in view/edit/admin ClusterRoles, which pick up the rules of labelled ClusterRoles.
    objects = render_objects(chart, values)
    users = [role for role in by_kind(objects, "ClusterRole") if aggregated(role)]
    by_builtin = {builtin: set().union(*(grants(r) for r in users if builtin in aggregated(r)))
                  for builtin in ("view", "edit", "admin")}
    read = {("tandem.dev", resource, verb)
            for resource in ("hybridmodels", "hybridmodels/status", "hybridmodels/scale")
            for verb in ("get", "list", "watch")}
    write = {("tandem.dev", "hybridmodels", verb)
             for verb in ("create", "update", "patch", "delete", "deletecollection")}
    scale = {("tandem.dev", "hybridmodels/scale", verb) for verb in ("update", "patch")}
    assert by_builtin["view"] == read
    assert by_builtin["edit"] == by_builtin["admin"] == read | write | scale
    # No one is bound to them directly: they only extend the built-in roles.
    bindings = [*by_kind(objects, "ClusterRoleBinding"), *by_kind(objects, "RoleBinding")]
    assert not {b["roleRef"]["name"] for b in bindings} & {r["metadata"]["name"] for r in users}


def test_aggregation_can_be_left_out(chart):
    for values in ({"rbac": {"aggregateClusterRoles": False}}, {"rbac": {"create": False}}):
        assert not [role for role in by_kind(render_objects(chart, values), "ClusterRole") if aggregated(role)]


@pytest.mark.parametrize("values", [{}, NON_DEFAULT_VALUES["namespaced"]], ids=["clusterwide", "namespaced"])
def test_leader_election_reaches_only_its_lease_in_the_release_namespace(chart, values):
    objects = render_objects(chart, values)
    (role,) = [role for role in operator_roles(objects) if is_leader_election(role)]
    assert role["kind"] == "Role" and role["metadata"]["namespace"] == "tandem-system"
    assert grants(role) == LEADER_ELECTION_NEEDS
    args = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    (lease,) = [arg.split("=", 1)[1] for arg in args if arg.startswith("--leader-election-id=")]
    # Reading and renewing name the Lease; `create` cannot be narrowed by name.
    by_verbs = {tuple(rule["verbs"]): rule.get("resourceNames") for rule in role["rules"]}
    assert by_verbs == {("get", "patch"): [lease], ("create",): None}
    (binding,) = [b for b in by_kind(objects, "RoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"]]
    assert binding["metadata"]["namespace"] == "tandem-system"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "namespace": "tandem-system",
                                    "name": one(objects, "ServiceAccount")["metadata"]["name"]}]
    # No other role grants Leases.
    assert not [r for r in operator_roles(objects) if r is not role and any(
        resource == "leases" for _, resource, _ in grants(r))]


def test_leader_election_rules_cover_the_operators_lease_calls():
    election = pytest.importorskip("tandem_operator.leader_election")
    assert {(election.LEASES.group, election.LEASES.plural)} == {(g, r) for g, r, _ in LEADER_ELECTION_NEEDS}


def test_no_lease_access_without_leader_election(chart):
    objects = render_objects(chart, {"operator": {"leaderElection": {"enabled": False}}})
    assert not by_kind(objects, "Role") and not by_kind(objects, "RoleBinding")
