"""End to end: a real Prometheus serving its API over TLS (a certificate from a CA made here) and
behind basic auth (a bcrypt-hashed password), both through `--web.config.file`; the autoscaler, and
then the real operator (kopf against KMock, with the Secrets in KMock), read a latency from it. A
second Prometheus wants a client certificate (mutual TLS), its CA bundle read from a ConfigMap.

Prometheus' web config has no bearer tokens: tests/operator tests those against a stand-in server.
Prometheus comes from the Debian package (installed by .ci/run); on CI a missing binary is a
failure, elsewhere a skip.
"""

from __future__ import annotations

import base64
import functools
import ssl
import sys
import time
import types
import urllib.request
from pathlib import Path

import bcrypt
import pytest
import yaml

from tandem_operator import prometheus_access
from tandem_operator.metrics_source import MetricsError
from tandem_operator.scaling import measure
from tandem_operator.spec import parse_spec

# The operator tests' KMock and kopf fixtures, and their certificate and pod helpers.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from hm_cluster import NS, core_path, hybrid_model, model_path, wait_for  # noqa: E402
from kopf_fixtures import cluster, kmock_options, operator  # noqa: E402,F401 (fixtures)
from test_operator_kmock import condition, pod  # noqa: E402
from tls_certs import CA  # noqa: E402

from prometheus_process import prometheus_process  # noqa: E402

USERNAME, PASSWORD = "tandem", "correct horse battery staple"
STARTUP_TIMEOUT_S = 60
# One sample: read as the p95 in seconds, 200 ms against a 50 ms target.
QUERY = "vector(0.2)"


@pytest.fixture(scope="module")
def secure_prometheus(prometheus_binary, tmp_path_factory):
    """Prometheus with TLS (a certificate for 127.0.0.1 from its own CA) and basic auth on its API."""
    directory = tmp_path_factory.mktemp("prometheus-tls")
    ca = CA("tandem e2e CA")
    cert, key = ca.issue(dns_names=("prometheus.monitoring.svc",), ips=("127.0.0.1",)).write(directory, "server")
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()  # the cheapest cost: a test
    (directory / "web.yml").write_text(yaml.safe_dump({
        "tls_server_config": {"cert_file": str(cert), "key_file": str(key)},
        "basic_auth_users": {USERNAME: hashed},
    }))
    config = {"global": {"evaluation_interval": "1s"}}
    ready = functools.partial(_ready, ca_pem=ca.cert_pem)
    with prometheus_process(prometheus_binary, directory, config, f"--web.config.file={directory / 'web.yml'}",
                            scheme="https", ready=ready) as (url, _):
        yield types.SimpleNamespace(url=url, ca=ca.cert_pem)


@pytest.fixture(scope="module")
def mtls_prometheus(prometheus_binary, tmp_path_factory):
    """Prometheus over TLS that accepts only clients with a certificate from its client CA."""
    directory = tmp_path_factory.mktemp("prometheus-mtls")
    ca, client_ca = CA("tandem e2e CA"), CA("tandem e2e client CA")
    cert, key = ca.issue(ips=("127.0.0.1",)).write(directory, "server")
    (directory / "client-ca.crt").write_text(client_ca.cert_pem)
    (directory / "web.yml").write_text(yaml.safe_dump({"tls_server_config": {
        "cert_file": str(cert), "key_file": str(key),
        "client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": str(directory / "client-ca.crt")}}))
    client = client_ca.issue(dns_names=("tandem-operator",), client=True)
    ready = functools.partial(_ready_mtls, ca_pem=ca.cert_pem, client=client.write(directory, "client"))
    with prometheus_process(prometheus_binary, directory, {"global": {"evaluation_interval": "1s"}},
                            f"--web.config.file={directory / 'web.yml'}", scheme="https", ready=ready) as (url, _):
        yield types.SimpleNamespace(url=url, ca=ca.cert_pem, client=client)


def secret(name: str, type: str = "Opaque", **data: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": type, "metadata": {"name": name, "namespace": NS},
            "data": {key: base64.b64encode(value.encode()).decode() for key, value in data.items()}}


def client_secret(name: str, issued) -> dict:
    return secret(name, "kubernetes.io/tls", **{"tls.crt": issued.cert_pem, "tls.key": issued.key_pem})


def config_map(name: str, **data: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": NS}, "data": data}


def autoscaling(url: str, **prometheus) -> dict:
    return {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetP95InterTokenLatencyMs": 50,
            "windowSeconds": 30, "metrics": {"source": "Prometheus",
                                             "prometheus": {"url": url, "query": QUERY, **prometheus}}}


TLS = {"caSecret": {"name": "prometheus-ca", "key": "ca.crt"}}
AUTH = {"basicAuthSecret": {"name": "prometheus-basic"}}
# OpenShift's service CA, as its operator injects it into a ConfigMap; cert-manager's client certificate.
MTLS = {"caConfigMap": {"name": "openshift-service-ca.crt", "key": "service-ca.crt"},
        "certSecret": {"name": "tandem-operator-client"}}


def read(url: str, secrets: dict[str, dict], monkeypatch, config_maps: dict[str, dict] | None = None,
         **prometheus) -> float | None:
    """The p95 the autoscaler measures, with `secrets` and `config_maps` as namespace NS's."""
    monkeypatch.setattr(prometheus_access, "_get_secret", lambda namespace, name: secrets.get(name))
    monkeypatch.setattr(prometheus_access, "_get_config_map", lambda namespace, name: (config_maps or {}).get(name))
    spec = parse_spec({"model": {"volume": {"emptyDir": {}}}, "image": "x",
                       "autoscaling": autoscaling(url, **prometheus)})
    return measure(spec, NS, "mixtral", types.SimpleNamespace(), time.monotonic()).p95_s


def test_the_right_ca_and_password_read_a_latency(secure_prometheus, monkeypatch):
    secrets = {"prometheus-ca": secret("prometheus-ca", **{"ca.crt": secure_prometheus.ca}),
               "prometheus-basic": secret("prometheus-basic", username=USERNAME, password=PASSWORD)}
    assert read(secure_prometheus.url, secrets, monkeypatch, tls=TLS, auth=AUTH) == 0.2


def test_another_ca_fails_verification(secure_prometheus, monkeypatch):
    secrets = {"prometheus-ca": secret("prometheus-ca", **{"ca.crt": CA("another CA").cert_pem}),
               "prometheus-basic": secret("prometheus-basic", username=USERNAME, password=PASSWORD)}
    with pytest.raises(MetricsError, match="TLS: the server's certificate failed verification: unable to get "
                                           "local issuer certificate"):
        read(secure_prometheus.url, secrets, monkeypatch, tls=TLS, auth=AUTH)


def test_the_system_cas_do_not_know_a_private_ca(secure_prometheus, monkeypatch):
    secrets = {"prometheus-basic": secret("prometheus-basic", username=USERNAME, password=PASSWORD)}
    with pytest.raises(MetricsError, match="TLS: the server's certificate failed verification"):
        read(secure_prometheus.url, secrets, monkeypatch, auth=AUTH)


def test_a_wrong_password_is_refused(secure_prometheus, monkeypatch):
    secrets = {"prometheus-ca": secret("prometheus-ca", **{"ca.crt": secure_prometheus.ca}),
               "prometheus-basic": secret("prometheus-basic", username=USERNAME, password="Tr0ub4dor&3")}
    with pytest.raises(MetricsError, match="HTTP 401 Unauthorized: the server refused the credentials of "
                                           "metrics.prometheus.auth.basicAuthSecret prometheus-basic") as error:
        read(secure_prometheus.url, secrets, monkeypatch, tls=TLS, auth=AUTH)
    assert "Tr0ub4dor" not in str(error.value)
    with pytest.raises(MetricsError, match=r"HTTP 401 Unauthorized: the server asks for credentials"):
        read(secure_prometheus.url, secrets, monkeypatch, tls=TLS)


def test_insecure_skip_verify_reads_without_the_ca(secure_prometheus, monkeypatch):
    secrets = {"prometheus-basic": secret("prometheus-basic", username=USERNAME, password=PASSWORD)}
    assert read(secure_prometheus.url, secrets, monkeypatch, tls={"insecureSkipVerify": True}, auth=AUTH) == 0.2


async def test_operator_scales_from_a_prometheus_behind_tls_and_basic_auth(secure_prometheus, cluster, operator):
    await cluster.create(core_path("secrets"), secret("prometheus-ca", **{"ca.crt": secure_prometheus.ca}))
    await cluster.create(core_path("secrets"), secret("prometheus-basic", username=USERNAME, password=PASSWORD))
    await cluster.create_model(hybrid_model("mixtral", autoscaling=autoscaling(secure_prometheus.url, tls=TLS,
                                                                               auth=AUTH)))
    await cluster.create(core_path("pods"), pod("mixtral-1", "mixtral"))

    async def scaled():
        model = await cluster.get(model_path("mixtral"))
        return model if (model.get("status") or {}).get("desiredReplicas") == 4 else None

    model = await wait_for(scaled, timeout=STARTUP_TIMEOUT_S, what="desiredReplicas 4 from Prometheus over TLS")
    assert model["spec"]["replicas"] == 4 and model["status"]["p95InterTokenLatencyMs"] == 200
    assert condition(model, "ScalingActive")["reason"] == "ScaleUp"

    # The password changes in the Secret but not in Prometheus: refused at the next step.
    await cluster.patch(core_path("secrets", "prometheus-basic"),
                        {"data": {"password": base64.b64encode(b"Tr0ub4dor&3").decode()}})

    async def refused():
        scaling = condition(await cluster.get(model_path("mixtral")), "ScalingActive")
        return scaling if scaling.get("reason") == "FailedGetMetrics" else None

    scaling = await wait_for(refused, timeout=STARTUP_TIMEOUT_S, what="FailedGetMetrics")
    assert "HTTP 401 Unauthorized" in scaling["message"] and "Tr0ub4dor" not in scaling["message"]


def test_a_client_certificate_and_a_ca_from_a_config_map_read_a_latency(mtls_prometheus, monkeypatch):
    secrets = {"tandem-operator-client": client_secret("tandem-operator-client", mtls_prometheus.client)}
    config_maps = {"openshift-service-ca.crt": config_map("openshift-service-ca.crt",
                                                          **{"service-ca.crt": mtls_prometheus.ca})}
    assert read(mtls_prometheus.url, secrets, monkeypatch, config_maps, tls=MTLS) == 0.2


@pytest.mark.parametrize("client", ["none", "another CA's"])
def test_without_a_certificate_from_the_client_ca_the_server_refuses(mtls_prometheus, monkeypatch, client):
    config_maps = {"openshift-service-ca.crt": config_map("openshift-service-ca.crt",
                                                          **{"service-ca.crt": mtls_prometheus.ca})}
    tls, secrets = {"caConfigMap": MTLS["caConfigMap"]}, {}
    if client != "none":
        tls = MTLS
        secrets = {"tandem-operator-client": client_secret("tandem-operator-client",
                                                           CA("another CA").issue(dns_names=("x",), client=True))}
    with pytest.raises(MetricsError, match=r"TLS: the server refused the client's certificate or wants one "
                                           r"\(metrics.prometheus.tls.certSecret\)"):
        read(mtls_prometheus.url, secrets, monkeypatch, config_maps, tls=tls)


def test_a_key_that_is_not_the_certificates_is_named(mtls_prometheus, monkeypatch):
    other = CA("another CA").issue(dns_names=("x",), client=True)
    secrets = {"tandem-operator-client": secret("tandem-operator-client", "kubernetes.io/tls", **{
        "tls.crt": mtls_prometheus.client.cert_pem, "tls.key": other.key_pem})}
    config_maps = {"openshift-service-ca.crt": config_map("openshift-service-ca.crt",
                                                          **{"service-ca.crt": mtls_prometheus.ca})}
    with pytest.raises(MetricsError, match=f"metrics.prometheus.tls.certSecret: Secret {NS}/tandem-operator-client: "
                                           "tls.crt and tls.key are not a PEM certificate and its private key"
                       ) as error:
        read(mtls_prometheus.url, secrets, monkeypatch, config_maps, tls=MTLS)
    assert "PRIVATE KEY" not in str(error.value)


async def test_operator_scales_from_a_prometheus_wanting_a_client_certificate(mtls_prometheus, cluster, operator):
    await cluster.create(core_path("secrets"), client_secret("tandem-operator-client", mtls_prometheus.client))
    await cluster.create(core_path("configmaps"), config_map("openshift-service-ca.crt",
                                                             **{"service-ca.crt": mtls_prometheus.ca}))
    await cluster.create_model(hybrid_model("mixtral", autoscaling=autoscaling(mtls_prometheus.url, tls=MTLS)))
    await cluster.create(core_path("pods"), pod("mixtral-1", "mixtral"))

    async def scaled():
        model = await cluster.get(model_path("mixtral"))
        return model if (model.get("status") or {}).get("desiredReplicas") == 4 else None

    model = await wait_for(scaled, timeout=STARTUP_TIMEOUT_S, what="desiredReplicas 4 from Prometheus over mutual TLS")
    assert model["spec"]["replicas"] == 4 and condition(model, "ScalingActive")["reason"] == "ScaleUp"


def _ready_mtls(url: str, ca_pem: str, client: tuple) -> bool:
    """Whether Prometheus answers /-/ready over TLS to a client with the client CA's certificate."""
    context = ssl.create_default_context(cadata=ca_pem)
    context.load_cert_chain(*client)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(f"{url}/-/ready", timeout=2):
            return True
    except OSError:
        return False


def _ready(url: str, ca_pem: str) -> bool:
    """Whether Prometheus answers /-/ready over TLS with the basic-auth user."""
    context = ssl.create_default_context(cadata=ca_pem)
    credentials = base64.b64encode(f"{USERNAME}:{PASSWORD}".encode()).decode()
    request = urllib.request.Request(f"{url}/-/ready", headers={"Authorization": f"Basic {credentials}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(request, timeout=2):
            return True
    except OSError:
        return False
