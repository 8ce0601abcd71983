"""Operator replicas and leader election in the chart: flags, rollout strategy, budget, checks."""

from __future__ import annotations

import helm_python
import pytest
from kubernetes_validate import utils as kv

from conftest import NAMESPACE, RELEASE, by_kind, one, render_objects

leadership = pytest.importorskip("tandem_operator.leadership")
leader_election = pytest.importorskip("tandem_operator.leader_election")


def operator_container(objects: list[dict]) -> dict:
    return one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def test_by_default_one_replica_elects_itself_and_upgrades_roll(chart, monkeypatch):
    objects = render_objects(chart)
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    # The new pod starts as a standby and is Ready; only then is the old leader stopped, which
    # releases the Lease: never two operators at once, and no gap longer than a retry period.
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    container = operator_container(objects)
    env = {item["name"]: item.get("valueFrom") for item in container["env"]}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}

    # What tandem-operator makes of the flags: the Lease named after the release, in the pod's
    # namespace (which the downward API gives it), with client-go's default timings.
    election, kopf_args = leadership.parse_args(container["args"])
    assert "--standalone" in kopf_args
    monkeypatch.setenv("POD_NAMESPACE", NAMESPACE)
    monkeypatch.setenv("POD_NAME", "tandem-operator-7d9f-abcde")
    config = election.config()
    assert (config.namespace, config.name) == (NAMESPACE, deployment["metadata"]["name"])
    assert (config.lease_duration, config.renew_deadline, config.retry_period) == (15, 10, 2)
    assert config.identity.startswith("tandem-operator-7d9f-abcde_")
    assert not by_kind(objects, "PodDisruptionBudget")


def test_without_leader_election_one_operator_is_replaced_not_rolled(chart):
    objects = render_objects(chart, {"operator": {"leaderElection": {"enabled": False}}})
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    election, _ = leadership.parse_args(operator_container(objects)["args"])
    assert not election.enabled
    assert not [arg for arg in operator_container(objects)["args"] if arg.startswith("--leader-elect")]


def test_several_replicas_need_leader_election(chart):
    values = {"operator": {"replicas": 2, "leaderElection": {"enabled": False}}}
    with pytest.raises(helm_python.HelmError, match="operator.replicas > 1 needs operator.leaderElection.enabled"):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_several_replicas_keep_all_but_one_through_a_drain(chart):
    objects = render_objects(chart, {"operator": {"replicas": 3}})
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    budget = one(objects, "PodDisruptionBudget")
    assert budget["metadata"]["namespace"] == NAMESPACE
    assert budget["spec"] == {"maxUnavailable": 1, "selector": deployment["spec"]["selector"]}
    kv.validate(budget, "1.28.0", strict=True)


@pytest.mark.parametrize("lease, renew, retry", [(15, 10, 2), (10, 10, 2), (15, 16, 2), (15, 2.4, 2), (15, 2.5, 2),
                                                 (3, 2, 0.2)])
def test_the_chart_refuses_exactly_the_timings_the_operator_refuses(chart, lease, renew, retry):
    values = {"operator": {"leaderElection": {"enabled": True, "leaseDurationSeconds": lease,
                                              "renewDeadlineSeconds": renew, "retryPeriodSeconds": retry}}}
    try:
        leader_election.ElectionConfig(NAMESPACE, "lease", "me", lease_duration=lease, renew_deadline=renew,
                                       retry_period=retry)
    except ValueError:
        with pytest.raises(helm_python.HelmError, match="operator.leaderElection.renewDeadlineSeconds must be"):
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
        return
    election, _ = leadership.parse_args(operator_container(render_objects(chart, values))["args"])
    assert (election.lease_duration, election.renew_deadline, election.retry_period) == (lease, renew, retry)


@pytest.mark.parametrize("values, message", [
    ({"replicas": 0}, "replicas"),
    ({"leaderElection": {"leaseDurationSeconds": 1.5}}, "leaseDurationSeconds"),
    ({"leaderElection": {"retryPeriodSeconds": 0}}, "retryPeriodSeconds"),
    ({"leaderElection": {"enable": True}}, "additional propert"),
])
def test_bad_replica_and_election_values_are_rejected(chart, values, message):
    with pytest.raises(helm_python.HelmValuesError, match=message):
        chart.validate_schema({"operator": values})
