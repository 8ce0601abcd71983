"""The chart rendered by Helm's own engine (helm-python-sdk bundles Helm v4) and linted."""

from __future__ import annotations

import re
import urllib.parse

import helm_python
import pytest

from conftest import CHART_DIR, NAMESPACE, NON_DEFAULT_VALUES, RELEASE, by_kind, one, render_objects

ERROR = 3  # helm lint severity


def test_default_render_has_the_operator_and_nothing_optional(chart):
    objects = render_objects(chart)
    kinds = sorted(obj["kind"] for obj in objects)
    # The operator's ClusterRole and the two that extend the built-in view and edit roles; the
    # Role and RoleBinding of leader election's Lease.
    assert kinds == ["ClusterRole", "ClusterRole", "ClusterRole", "ClusterRoleBinding",
                     "CustomResourceDefinition", "Deployment", "Role", "RoleBinding", "ServiceAccount"]
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == f"tandem-{chart.version}"


def test_operator_deployment_runs_kopf_standalone_clusterwide(chart):
    deployment = one(render_objects(chart), "Deployment")
    assert deployment["metadata"]["namespace"] == NAMESPACE
    assert deployment["spec"]["replicas"] == 1
    # Two standalone kopf processes would both handle every HybridModel: only the leader runs kopf,
    # and a new pod waits for the Lease (see test_leader_election.py).
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"ghcr.io/tandem-llm/tandem-operator:{chart.metadata['appVersion']}"
    assert container["command"] == ["tandem-operator"]
    args = container["args"]
    assert {"--standalone", "--all-namespaces"} <= set(args)
    assert not [arg for arg in args if arg.startswith("--namespace")]
    assert pod["serviceAccountName"] == one(render_objects(chart), "ServiceAccount")["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        # kopf's --liveness endpoint, which serves once the operator has started.
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    assert any(arg == f"--liveness=http://0.0.0.0:{ports['health']}/healthz" for arg in container["args"])
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("values", [{}, *NON_DEFAULT_VALUES.values()],
                         ids=["default", *NON_DEFAULT_VALUES])
def test_operator_arguments_parse_as_tandem_operator_options(chart, values):
    # tandem-operator is its own flags plus `kopf run --module=tandem_operator ARGS`: split them with
    # its parser and parse ARGS with kopf's own command-line parser, without running either.
    kopf_cli = pytest.importorskip("kopf.cli")
    leadership = pytest.importorskip("tandem_operator.leadership")
    container = one(render_objects(chart, values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["tandem-operator"]
    election, kopf_args = leadership.parse_args(container["args"])
    assert election.enabled == values.get("operator", {}).get("leaderElection", {}).get("enabled", True)
    context = kopf_cli.run.make_context("run", ["--module=tandem_operator", *kopf_args])
    assert context.params["standalone"] is True
    assert context.params["liveness_endpoint"].endswith(":8080/healthz")
    assert context.params["clusterwide"] == (not values.get("operator", {}).get("watchNamespaces"))


def test_operator_intervals_reach_the_operator(chart):
    handlers = pytest.importorskip("tandem_operator.handlers")
    values = {"operator": {"autoscaleIntervalSeconds": 30, "resyncIntervalSeconds": 600}}
    container = one(render_objects(chart, values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env[handlers.AUTOSCALE_INTERVAL_ENV] == "30"
    assert env[handlers.RESYNC_INTERVAL_ENV] == "600"


def test_watch_namespaces_become_kopf_flags(chart):
    objects = render_objects(chart, NON_DEFAULT_VALUES["namespaced"])
    args = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=models" in args and "--namespace=research" in args
    assert "--all-namespaces" not in args
    assert "--debug" in args and "--log-format=plain" in args


def test_everything_on(chart):
    values = NON_DEFAULT_VALUES["everything"]
    objects = render_objects(chart, values)
    deployment = one(objects, "Deployment")
    assert deployment["metadata"]["name"] == "tandem-ops-operator"
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "registry.example.com/tandem/operator@sha256:" + "a" * 64
    assert container["imagePullPolicy"] == "Always"
    assert "--quiet" in container["args"]
    assert [env["name"] for env in container["env"]][-2:] == ["TANDEM_PROMETHEUS_URL", "NODE"]
    assert pod["serviceAccountName"] == "tandem-sa"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["tolerations"] == values["operator"]["tolerations"]
    assert pod["affinity"] == values["operator"]["affinity"]
    assert deployment["spec"]["template"]["metadata"]["labels"]["team"] == "ml-platform"
    model = one(objects, "HybridModel")
    assert model["metadata"] == {**model["metadata"], "name": "mixtral", "namespace": NAMESPACE}
    assert model["spec"] == values["hybridModel"]["spec"]
    assert one(objects, "ServiceMonitor")["spec"]["namespaceSelector"] == {"matchNames": ["models"]}


def test_bring_your_own_crd_rbac_and_service_account(chart):
    objects = render_objects(chart, NON_DEFAULT_VALUES["bring-your-own"])
    assert sorted(obj["kind"] for obj in objects) == ["Deployment"]
    pod = objects[0]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "existing-operator"


def test_an_existing_service_account_must_be_named(chart):
    with pytest.raises(helm_python.HelmError, match="serviceAccount.name is required"):
        chart.render({"serviceAccount": {"create": False}}, name=RELEASE, namespace=NAMESPACE)


def test_release_name_containing_chart_name_is_not_doubled(chart):
    objects = render_objects(chart, release="tandem-prod")
    assert one(objects, "Deployment")["metadata"]["name"] == "tandem-prod-operator"
    objects = render_objects(chart, release="ml")
    assert one(objects, "Deployment")["metadata"]["name"] == "ml-tandem-operator"


def test_hybrid_model_defaults_to_the_release_name(chart):
    spec = NON_DEFAULT_VALUES["everything"]["hybridModel"]["spec"]
    objects = render_objects(chart, {"hybridModel": {"enabled": True, "spec": spec}}, release="mixtral")
    assert one(objects, "HybridModel")["metadata"]["name"] == "mixtral"
    assert not by_kind(render_objects(chart, {"hybridModel": {"spec": spec}}), "HybridModel")


@pytest.mark.parametrize("values", [{}, *NON_DEFAULT_VALUES.values()],
                         ids=["default", *NON_DEFAULT_VALUES])
@pytest.mark.parametrize("kube_version", ["v1.28.0", None], ids=["k8s-1.28", "k8s-default"])
def test_helm_lint_strict_has_no_errors(values, kube_version):
    report = helm_python.lint(CHART_DIR, values, strict=True, namespace=NAMESPACE,
                              kube_version=kube_version)
    problems = [msg for msg in report["messages"] if msg["severity"] >= 2]
    assert problems == [] and report["errors"] == []


def test_helm_lint_reports_bad_values():
    report = helm_python.lint(CHART_DIR, {"operator": {"replicas": 0}}, strict=True)
    assert any(msg["severity"] == ERROR and "replicas" in msg["error"] for msg in report["messages"])


@pytest.mark.parametrize("values, release", [
    ({"fullnameOverride": "f" * 63, "serviceMonitor": {"enabled": True}}, RELEASE),
    ({"nameOverride": "n" * 63, "serviceMonitor": {"enabled": True}}, RELEASE),
    ({"operator": {"watchNamespaces": ["models"]}, "serviceMonitor": {"enabled": True}}, "r" * 53),
], ids=["fullnameOverride", "nameOverride", "longest-release"])
def test_every_name_is_a_dns_label_and_names_stay_distinct(chart, values, release):
    # Helm allows 53-character release names and the schema 63-character overrides; the suffixes
    # ("-operator", "-view", ...) must not push a name past 63 or make two names equal.
    objects = render_objects(chart, values, release=release)
    seen = set()
    for obj in objects:
        meta = obj["metadata"]
        assert len(meta["name"]) <= 63, (obj["kind"], meta["name"])
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", meta["name"]), meta["name"]
        key = (obj["kind"], meta.get("namespace"), meta["name"])
        assert key not in seen, key
        seen.add(key)
        for label in meta["labels"].values():
            assert len(label) <= 63
    deployment = one(objects, "Deployment")
    assert deployment["metadata"]["name"].endswith("-operator")


@pytest.mark.parametrize("label", ["app.kubernetes.io/name", "app.kubernetes.io/instance",
                                   "app.kubernetes.io/component"])
def test_pod_labels_cannot_take_over_the_selector(chart, label):
    # A podLabels entry with a selector key would replace the chart's value in the pod template
    # only, and the API server would refuse the Deployment: "selector does not match template labels".
    with pytest.raises(helm_python.HelmError, match=f"operator.podLabels must not set {label}"):
        chart.render({"operator": {"podLabels": {label: "mine"}}}, name=RELEASE, namespace=NAMESPACE)


def test_hybrid_model_must_be_in_a_watched_namespace(chart):
    spec = NON_DEFAULT_VALUES["everything"]["hybridModel"]["spec"]
    values = {"operator": {"watchNamespaces": ["models"]}, "hybridModel": {"enabled": True, "spec": spec}}
    with pytest.raises(helm_python.HelmError, match="operator.watchNamespaces leaves out"):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    objects = render_objects(chart, values, namespace="models")
    assert one(objects, "HybridModel")["metadata"]["namespace"] == "models"


def test_hybrid_model_name_is_a_dns_1035_label(chart):
    # The CRD rejects names that do not start with a letter; catch that at render time, also for
    # the release name it defaults to.
    spec = NON_DEFAULT_VALUES["everything"]["hybridModel"]["spec"]
    with pytest.raises(helm_python.HelmValuesError, match="name"):
        chart.validate_schema({"hybridModel": {"enabled": True, "name": "8x7b", "spec": spec}})
    with pytest.raises(helm_python.HelmError, match="must be a DNS-1035 label"):
        chart.render({"hybridModel": {"enabled": True, "spec": spec}}, name="8x7b", namespace=NAMESPACE)
    objects = render_objects(chart, {"hybridModel": {"enabled": True, "name": "m8x7b", "spec": spec}}, release="8x7b")
    assert one(objects, "HybridModel")["metadata"]["name"] == "m8x7b"


@pytest.mark.parametrize("address, host", [("0.0.0.0", "0.0.0.0"), ("::", "::")])
def test_health_endpoint_can_listen_on_ipv6(chart, address, host):
    # kopf binds exactly the --liveness host (asyncio makes "::" IPv6-only), and the kubelet
    # probes the pod's first IP: an IPv6 cluster needs "::", written as a URL wants it, "[::]".
    kopf_cli = pytest.importorskip("kopf.cli")
    leadership = pytest.importorskip("tandem_operator.leadership")
    values = {"operator": {"healthBindAddress": address, "healthPort": 9090}}
    container = one(render_objects(chart, values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    _, kopf_args = leadership.parse_args(container["args"])
    context = kopf_cli.run.make_context("run", ["--module=tandem_operator", *kopf_args])
    url = urllib.parse.urlsplit(context.params["liveness_endpoint"])
    assert (url.hostname, url.port, url.path) == (host, 9090, "/healthz")
    assert {"name": "health", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
