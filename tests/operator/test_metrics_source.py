"""Where latency comes from: unreadable pods are left out, NaN is no sample, a whole quiet window
is idle, and the default PromQL selects this model's series only."""

from __future__ import annotations

import base64
import math
import types
from dataclasses import astuple

import pytest

from fake_metrics import exposition, fake_server, vector
from tls_certs import CA
from tandem_operator import kube, names, prometheus_access
from tandem_operator.metrics_source import (DEFAULT_PROMETHEUS_QUERY, MetricsError, PodWindow, prometheus_query,
                                            read_pods, read_prometheus)
from tandem_operator.scaling import measure
from tandem_operator.spec import SpecError, parse_spec


@pytest.fixture
def server():
    with fake_server() as state:
        yield state


def pod(name: str, port: int) -> dict:
    return {"metadata": {"name": name, "uid": f"uid-{name}", "labels": names.common_labels("mx")},
            "spec": {"containers": [{"name": "attention", "ports": [{"name": "metrics", "containerPort": port}]}]},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


def spec(source: str = "Pods", url: str = "http://127.0.0.1:1", window: int = 60, query: str | None = None):
    metrics = {"source": source}
    if source == "Prometheus":
        metrics["prometheus"] = {"url": url, **({"query": query} if query else {})}
    return parse_spec({"model": {"volume": {"emptyDir": {}}}, "image": "x", "autoscaling": {
        "enabled": True, "maxReplicas": 4, "targetP95InterTokenLatencyMs": 50, "windowSeconds": window,
        "metrics": metrics}})


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
def test_non_finite_prometheus_samples_are_no_samples(server, value):
    url = f"http://127.0.0.1:{server.port}"
    server.answer = vector(({}, value))  # histogram_quantile over no observations answers NaN
    assert read_prometheus(url, "histogram_quantile(0.95, ...)") is None
    server.answer = vector(({"le": "0.05"}, value), ({"le": "+Inf"}, "3"))
    assert read_prometheus(url, "q") is None
    server.answer = {"status": "success", "data": {"resultType": "scalar", "result": [0, value]}}
    measured = measure(spec("Prometheus", url, query="q"), "models", "mx", types.SimpleNamespace(), 0.0)
    assert measured.p95_s is None and not measured.idle


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-1"])
def test_a_pod_exporting_a_non_finite_count_is_left_out(server, value):
    window, broken = PodWindow(), pod("broken", server.port)
    with fake_server() as healthy:
        good = pod("good", healthy.port)
        healthy.metrics = exposition({0.05: 10.0})
        server.metrics = exposition({0.05: 1.0}).replace(" 1.0\n", f" {value}\n", 1)
        first = read_pods([broken, good], window, 0.0, 60)
        healthy.metrics = exposition({0.05: 30.0})
        second = read_pods([broken, good], window, 10.0, 60)
    assert len(first.skipped) == len(second.skipped) == 1 and "not a count" in second.skipped[0]
    assert second.observed == {0.05: 20.0, math.inf: 20.0}  # the good pod's, not NaN or inf
    with pytest.raises(MetricsError, match="not a count"):  # alone: no reading at all, so no decision
        read_pods([broken], PodWindow(), 0.0, 60)


def test_prometheus_series_of_the_same_bucket_are_summed(server):
    # A custom query without `sum by (le)`: one series per pod and bucket.
    url = f"http://127.0.0.1:{server.port}"
    server.answer = vector(({"le": "0.05", "pod": "a"}, "90"), ({"le": "+Inf", "pod": "a"}, "90"),
                           ({"le": "0.05", "pod": "b"}, "0"), ({"le": "+Inf", "pod": "b"}, "10"))
    assert read_prometheus(url, "increase(x_bucket[1m])") == {0.05: 90.0, math.inf: 100.0}


def test_an_unreadable_pod_is_left_out(server):
    window, good, dead = PodWindow(), pod("good", server.port), pod("dead", 1)
    server.metrics = exposition({0.05: 10.0})
    first = read_pods([good, dead], window, 0.0, 60)
    assert len(first.skipped) == 1 and "127.0.0.1:1/metrics" in first.skipped[0]
    server.metrics = exposition({0.05: 30.0})
    second = read_pods([good, dead], window, 10.0, 60)
    assert second.observed[math.inf] == 20.0
    with pytest.raises(MetricsError, match="127.0.0.1:1/metrics"):
        read_pods([dead], PodWindow(), 0.0, 60)


def test_a_pod_read_again_after_a_failed_scrape_is_not_new():
    window = PodWindow()
    window.record(0.0, {"a": {math.inf: 100.0}}, 60)
    window.record(10.0, {}, 60, unread=["a"])  # a's scrape failed: it keeps its last histogram
    window.record(70.0, {"a": {math.inf: 103.0}}, 60)
    assert window.scrapes[0][0] == 10.0
    assert window.increase() == {math.inf: 3.0}  # not all 103 of its observations


def test_no_decode_steps_in_a_whole_window_is_idle(server):
    memo, quiet = types.SimpleNamespace(), [pod("a", server.port)]
    server.metrics = exposition({0.05: 5.0})  # no new observations from here on
    assert measure(spec(window=60), "models", "mx", memo, 0.0, quiet).p95_s is None
    part = measure(spec(window=60), "models", "mx", memo, 30.0, quiet)
    assert (part.p95_s, part.idle) == (None, False)  # half a window: too short a look
    whole = measure(spec(window=60), "models", "mx", memo, 60.0, quiet)
    assert (whole.p95_s, whole.idle) == (None, True)
    # From Prometheus: the model's series exist and did not increase.
    url = f"http://127.0.0.1:{server.port}"
    server.answer = vector(({"le": "0.05"}, "0"), ({"le": "+Inf"}, "0"))
    assert measure(spec("Prometheus", url), "models", "mx", memo, 0.0).idle
    server.answer = vector()  # nothing matched: unknown, not idle
    assert not measure(spec("Prometheus", url), "models", "mx", memo, 0.0).idle


def test_default_query_selects_this_models_series_only():
    query = prometheus_query(None, "models", "mixtral", 60)
    assert 'namespace="models"' in query and 'tandem_dev_hybridmodel="mixtral"' in query
    assert "pod=~" not in query and "[60s]" in query
    # What the default selects on is the pods' model label, as Prometheus spells label names.
    assert DEFAULT_PROMETHEUS_QUERY.count("tandem_dev_hybridmodel") == 1
    assert names.MODEL_LABEL.replace(".", "_").replace("/", "_") == "tandem_dev_hybridmodel"


# Prometheus over TLS and with credentials (metrics.prometheus.tls, .auth, .headers)

TOKEN = "s3cret-token.with_chars~"


def secret(**data: str) -> dict:
    """A Secret as the API serves it: `data` in base64."""
    return {"apiVersion": "v1", "kind": "Secret", "data": {k: base64.b64encode(v.encode()).decode()
                                                            for k, v in data.items()}}


@pytest.fixture(scope="module")
def ca():
    return CA()


@pytest.fixture
def https(ca):
    """A fake Prometheus over HTTPS, its certificate for 127.0.0.1 issued by `ca`, wanting TOKEN."""
    with fake_server(tls=astuple(ca.issue(ips=("127.0.0.1",)))) as state:
        state.authorization = f"Bearer {TOKEN}"
        state.answer = vector(({}, "0.042"))
        state.url = f"https://127.0.0.1:{state.port}"
        yield state


def prometheus_spec(url: str, **fields):
    """A parsed metrics.prometheus with query `q`."""
    return parse_spec({"model": {"volume": {"emptyDir": {}}}, "image": "x", "autoscaling": {"metrics": {
        "source": "Prometheus", "prometheus": {"url": url, "query": "q", **fields}}}}).autoscaling.metrics.prometheus


def query(prometheus, secrets: dict) -> float | None:
    """What the autoscaler reads from `prometheus`, with `secrets` ({name: Secret}) in namespace models."""
    access = prometheus_access.access(prometheus, "models", lambda ns, name: secrets.get(name) if ns == "models"
                                      else None)
    return read_prometheus(prometheus.url, prometheus.query, access=access)


BEARER = {"tls": {"caSecret": {"name": "prom-ca", "key": "ca.crt"}},
          "auth": {"bearerTokenSecret": {"name": "prom-token", "key": "token"}}}


def test_a_bearer_token_and_a_private_ca_from_secrets(https, ca):
    prometheus = prometheus_spec(https.url, headers={"X-Scope-OrgID": "team-a"}, **BEARER)
    secrets = {"prom-ca": secret(**{"ca.crt": ca.cert_pem}), "prom-token": secret(token=TOKEN + "\n")}
    assert query(prometheus, secrets) == 0.042
    (headers,) = https.headers
    # The token file's newline is dropped; the tenant header goes along (header names are case-insensitive).
    assert headers["Authorization"] == f"Bearer {TOKEN}"
    assert {k.lower(): v for k, v in headers.items()}["x-scope-orgid"] == "team-a"


def test_basic_auth_from_a_secret(https, ca):
    https.authorization = "Basic " + base64.b64encode(b"tandem:pa:ss word").decode()
    prometheus = prometheus_spec(https.url, tls=BEARER["tls"], auth={"basicAuthSecret": {"name": "prom-basic"}})
    secrets = {"prom-ca": secret(**{"ca.crt": ca.cert_pem}), "prom-basic": secret(username="tandem",
                                                                                 password="pa:ss word")}
    assert query(prometheus, secrets) == 0.042
    assert prometheus_access.basic("Aladdin", "open sesame", "x") == "Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ=="  # RFC 7617


def test_the_operators_own_service_account_token(https, ca, tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    monkeypatch.setattr(prometheus_access, "SERVICE_ACCOUNT_TOKEN", token)
    prometheus = prometheus_spec(https.url, tls=BEARER["tls"], auth={"serviceAccountToken": True})
    assert query(prometheus, {"prom-ca": secret(**{"ca.crt": ca.cert_pem})}) == 0.042
    token.unlink()  # not in a pod
    with pytest.raises(MetricsError, match="auth.serviceAccountToken: the operator's token .* cannot be read"):
        query(prometheus, {"prom-ca": secret(**{"ca.crt": ca.cert_pem})})


def test_insecure_skip_verify_accepts_any_certificate(https):
    prometheus = prometheus_spec(https.url, tls={"insecureSkipVerify": True, "caSecret": {"name": "gone", "key": "k"}},
                                 auth=BEARER["auth"])
    assert query(prometheus, {"prom-token": secret(token=TOKEN)}) == 0.042


def test_server_name_is_checked_instead_of_the_urls_host(ca):
    with fake_server(tls=astuple(ca.issue(dns_names=("prometheus.monitoring.svc",)))) as server:
        server.answer = vector(({}, "0.042"))
        url = f"https://127.0.0.1:{server.port}"
        secrets = {"prom-ca": secret(**{"ca.crt": ca.cert_pem})}
        mismatch = "certificate failed verification: IP address mismatch, certificate is not valid for '127.0.0.1'"
        with pytest.raises(MetricsError, match=mismatch):
            query(prometheus_spec(url, tls=BEARER["tls"]), secrets)
        tls = dict(BEARER["tls"], serverName="prometheus.monitoring.svc")
        assert query(prometheus_spec(url, tls=tls), secrets) == 0.042


@pytest.mark.parametrize("secrets, message", [
    ({"prom-token": secret(token=TOKEN)}, "metrics.prometheus.tls.caSecret: Secret models/prom-ca not found"),
    ({"prom-ca": secret(other="x"), "prom-token": secret(token=TOKEN)},
     r"tls.caSecret: Secret models/prom-ca has no key 'ca.crt' \(its keys: other\)"),
    ({"prom-ca": secret(**{"ca.crt": "not a certificate " + TOKEN}), "prom-token": secret(token=TOKEN)},
     "tls.caSecret: Secret prom-ca key 'ca.crt' holds no PEM CA certificate"),
    ({"prom-ca": "CA"}, "auth.bearerTokenSecret: Secret models/prom-token not found"),
    ({"prom-ca": "CA", "prom-token": secret(tok=TOKEN)}, "Secret models/prom-token has no key 'token'"),
    ({"prom-ca": "CA", "prom-token": secret(token=f"{TOKEN}\nX-Evil: 1")},
     "auth.bearerTokenSecret prom-token: the token is empty or holds spaces or control characters"),
    ({"prom-ca": "OTHER CA", "prom-token": secret(token=TOKEN)},
     "TLS: the server's certificate failed verification: unable to get local issuer certificate"),
    ({"prom-ca": "CA", "prom-token": secret(token="wrong-" + TOKEN)},
     "HTTP 401 Unauthorized: the server refused the credentials of metrics.prometheus.auth.bearerTokenSecret "
     "prom-token"),
])
def test_what_is_missing_or_refused_is_named_and_no_secret_is_told(https, ca, secrets, message):
    pem = {"CA": ca.cert_pem, "OTHER CA": CA("another CA").cert_pem}
    secrets = {name: secret(**{"ca.crt": pem[value]}) if isinstance(value, str) else value
               for name, value in secrets.items()}
    with pytest.raises(MetricsError, match=message) as error:
        query(prometheus_spec(https.url, **BEARER), secrets)
    assert TOKEN not in str(error.value) and "BEGIN CERTIFICATE" not in str(error.value)


def test_a_server_wanting_credentials_says_so(https, ca):
    with pytest.raises(MetricsError, match=r"HTTP 401 Unauthorized: the server asks for credentials \(metrics.pro"):
        query(prometheus_spec(https.url, tls=BEARER["tls"]), {"prom-ca": secret(**{"ca.crt": ca.cert_pem})})


def test_a_forbidden_secret_read_is_named():
    def forbidden(namespace, name):
        raise kube.KubeError(403, "GET", f"/api/v1/namespaces/{namespace}/secrets/{name}",
                             f'secrets "{name}" is forbidden: User "system:serviceaccount:tandem:op" cannot get')

    prometheus = prometheus_spec("https://prom:9090", auth=BEARER["auth"])
    with pytest.raises(MetricsError, match="auth.bearerTokenSecret: cannot read Secret models/prom-token: HTTP 403: "
                                           'secrets "prom-token" is forbidden'):
        prometheus_access.access(prometheus, "models", forbidden)


CA_CONFIG_MAP = {"caConfigMap": {"name": "prom-ca", "key": "service-ca.crt"}}


def config_maps(maps: dict[str, dict]):
    return lambda namespace, name: maps.get(name) if namespace == "models" else None


@pytest.mark.parametrize("where", ["data", "binaryData"])
def test_a_ca_bundle_from_a_config_map(https, ca, where):
    bundle = ca.cert_pem if where == "data" else base64.b64encode(ca.cert_pem.encode()).decode()
    prometheus = prometheus_spec(https.url, tls=CA_CONFIG_MAP, auth=BEARER["auth"])
    access = prometheus_access.access(prometheus, "models", lambda ns, n: secret(token=TOKEN),
                                      config_maps({"prom-ca": {where: {"service-ca.crt": bundle}}}))
    assert read_prometheus(prometheus.url, prometheus.query, access=access) == 0.042


@pytest.mark.parametrize("maps, message", [
    ({}, "metrics.prometheus.tls.caConfigMap: ConfigMap models/prom-ca not found"),
    ({"prom-ca": {"data": {"ca.crt": "x"}, "binaryData": {"other": "eA=="}}},
     r"tls.caConfigMap: ConfigMap models/prom-ca has no key 'service-ca.crt' \(its keys: ca.crt, other\)"),
    ({"prom-ca": {"data": {"service-ca.crt": "not a certificate"}}},
     "metrics.prometheus.tls.caConfigMap: ConfigMap prom-ca key 'service-ca.crt' holds no PEM CA certificate"),
    ({"prom-ca": {"binaryData": {"service-ca.crt": "not base64!"}}},
     "ConfigMap models/prom-ca key 'service-ca.crt' is not UTF-8 text"),
])
def test_what_is_wrong_with_a_ca_config_map_is_named(maps, message):
    prometheus = prometheus_spec("https://prom:9090", tls=CA_CONFIG_MAP)
    with pytest.raises(MetricsError, match=message):
        prometheus_access.access(prometheus, "models", lambda ns, n: None, config_maps(maps))


def test_a_ca_from_a_secret_and_a_config_map_at_once_is_refused():
    with pytest.raises(SpecError, match="tls takes at most one of caSecret and caConfigMap"):
        prometheus_spec("https://prom:9090", tls={**BEARER["tls"], **CA_CONFIG_MAP})


@pytest.mark.parametrize("data, message", [
    (None, "metrics.prometheus.tls.certSecret: Secret models/client not found"),
    ({"tls.crt": "x"}, r"tls.certSecret: Secret models/client has no key 'tls.key' \(its keys: tls.crt\)"),
    ({"tls.crt": "not a certificate", "tls.key": "not a key"},
     "tls.certSecret: Secret models/client: tls.crt and tls.key are not a PEM certificate and its private key"),
])
def test_what_is_wrong_with_a_client_certificate_is_named(data, message):
    prometheus = prometheus_spec("https://prom:9090", tls={"certSecret": {"name": "client"}})
    with pytest.raises(MetricsError, match=message) as error:
        prometheus_access.access(prometheus, "models", lambda ns, n: None if data is None else secret(**data))
    assert "not a key" not in str(error.value)


def test_a_client_certificate_is_presented(ca):
    # A server that wants one: the certificate from the Secret is what it sees.
    client = CA("client CA")
    issued = client.issue(dns_names=("tandem-operator",), client=True)
    prometheus = prometheus_spec("https://127.0.0.1:1", tls={"certSecret": {"name": "client"}})
    access = prometheus_access.access(prometheus, "models", lambda ns, n: secret(
        **{"tls.crt": issued.cert_pem, "tls.key": issued.key_pem}))
    with fake_server(tls=astuple(ca.issue(ips=("127.0.0.1",))), client_ca=client.cert_pem) as server:
        server.answer = vector(({}, "0.042"))
        access.context.load_verify_locations(cadata=ca.cert_pem)
        assert read_prometheus(f"https://127.0.0.1:{server.port}", "q", access=access) == 0.042
        assert server.peer_certificates == ["tandem-operator"]


def test_credentials_do_not_follow_a_redirect(https, ca):
    # urllib would send the Authorization header on to wherever the redirect points.
    with fake_server() as elsewhere:
        https.redirect = f"http://127.0.0.1:{elsewhere.port}/api/v1/query?query=q"
        secrets = {"prom-ca": secret(**{"ca.crt": ca.cert_pem}), "prom-token": secret(token=TOKEN)}
        with pytest.raises(MetricsError, match="HTTP 302 Found: redirects are not followed with credentials"):
            query(prometheus_spec(https.url, **BEARER), secrets)
        assert not elsewhere.headers


def test_access_keeps_the_credentials_out_of_its_repr(https, ca):
    secrets = {"prom-ca": secret(**{"ca.crt": ca.cert_pem}), "prom-token": secret(token=TOKEN)}
    access = prometheus_access.access(prometheus_spec(https.url, **BEARER), "models", lambda ns, n: secrets.get(n))
    assert access.headers["Authorization"] == f"Bearer {TOKEN}" and TOKEN not in repr(access)
    assert access.credentials == "auth.bearerTokenSecret prom-token"
    # Plain HTTP: no TLS context; no credentials: no Authorization header.
    plain = prometheus_access.access(prometheus_spec("http://prom:9090"), "models", lambda ns, n: None)
    assert (plain.context, dict(plain.headers), plain.credentials) == (None, {}, None)
