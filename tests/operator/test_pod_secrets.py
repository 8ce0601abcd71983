"""The check of what `spec.tls` and `spec.apiKeySecret` name, with the Secrets and ConfigMaps handed in (no API
server)."""

from __future__ import annotations

import base64

import pytest

from tandem_operator import kube
from tandem_operator.spec import TLSSpec, parse_spec
from tandem_operator.status import compute_status
from tandem_operator.pod_secrets import API_KEY_REASON, REASON, api_key_problem, tls_problem

BASE = {"model": {"volume": {"emptyDir": {}}}, "image": "x"}
PRIVATE = "-----BEGIN PRIVATE KEY-----\nnot for messages\n-----END PRIVATE KEY-----\n"
CERT = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def tls(**fields) -> TLSSpec:
    return parse_spec({**BASE, "tls": {"certSecret": {"name": "mx-tls"}, **fields}}).tls


def getter(objects: dict[str, dict], calls: list | None = None):
    def get(namespace: str, name: str) -> dict | None:
        if calls is not None:
            calls.append((namespace, name))
        return objects.get(name)
    return get


SERVING = {"mx-tls": {"type": "kubernetes.io/tls", "data": {"tls.crt": b64(CERT), "tls.key": b64(PRIVATE)}}}


def test_without_tls_nothing_is_read():
    calls = []
    assert tls_problem(None, "models", getter({}, calls), getter({}, calls)) is None
    assert calls == []


@pytest.mark.parametrize("fields, config_maps", [
    ({}, {}),
    ({"clientCASecret": {"name": "mx-tls"}}, {}),  # cert-manager's CA issuer writes ca.crt beside the certificate
    ({"clientCAConfigMap": {"name": "trust", "key": "bundle.pem"}}, {"trust": {"data": {"bundle.pem": CERT}}}),
    ({"clientCAConfigMap": {"name": "trust"}}, {"trust": {"binaryData": {"ca.crt": b64(CERT)}}}),
])
def test_everything_the_pods_mount_is_there(fields, config_maps):
    secrets = {"mx-tls": {"data": {**SERVING["mx-tls"]["data"], "ca.crt": b64(CERT)}}}
    assert tls_problem(tls(**fields), "models", getter(secrets), getter(config_maps)) is None


@pytest.mark.parametrize("fields, secrets, config_maps, message", [
    ({}, {}, {}, "spec.tls.certSecret: Secret models/mx-tls not found: new pods wait for it in ContainerCreating"),
    ({}, {"mx-tls": {"data": {"tls.crt": b64(CERT)}}}, {},
     "spec.tls.certSecret: Secret models/mx-tls has no key 'tls.key' (its keys: tls.crt)"),
    ({}, {"mx-tls": {}}, {}, "spec.tls.certSecret: Secret models/mx-tls has no key 'tls.crt' (its keys: none)"),
    ({}, {"mx-tls": {"data": {"tls.crt": "", "tls.key": b64(PRIVATE)}}}, {},
     "spec.tls.certSecret: Secret models/mx-tls key 'tls.crt' is empty"),
    ({"clientCASecret": {"name": "clients"}}, SERVING, {},
     "spec.tls.clientCASecret: Secret models/clients not found: new pods wait for it in ContainerCreating"),
    ({"clientCASecret": {"name": "mx-tls"}}, SERVING, {},
     "spec.tls.clientCASecret: Secret models/mx-tls has no key 'ca.crt' (its keys: tls.crt, tls.key)"),
    ({"clientCAConfigMap": {"name": "trust"}}, SERVING, {},
     "spec.tls.clientCAConfigMap: ConfigMap models/trust not found: new pods wait for it in ContainerCreating"),
    ({"clientCAConfigMap": {"name": "trust", "key": "bundle.pem"}}, SERVING, {"trust": {"data": {"ca.crt": CERT}}},
     "spec.tls.clientCAConfigMap: ConfigMap models/trust has no key 'bundle.pem' (its keys: ca.crt)"),
], ids=["no-secret", "no-key", "no-data", "empty-certificate", "no-ca-secret", "no-ca-key", "no-config-map",
        "no-config-map-key"])
def test_what_is_missing_is_named_never_what_is_there(fields, secrets, config_maps, message):
    assert tls_problem(tls(**fields), "models", getter(secrets), getter(config_maps)) == (REASON, message)
    assert "not for messages" not in message and b64(PRIVATE) not in message


@pytest.mark.parametrize("ref, secrets, message", [
    ({"name": "keys"}, {"keys": {"data": {"api-key": b64("k")}}}, None),
    ({"name": "keys", "key": "token"}, {"keys": {"data": {"token": b64("k")}}}, None),
    ({"name": "keys"}, {},
     "spec.apiKeySecret: Secret models/keys not found: new pods wait for it in ContainerCreating"),
    ({"name": "keys", "key": "token"}, {"keys": {"data": {"api-key": b64("k")}}},
     "spec.apiKeySecret: Secret models/keys has no key 'token' (its keys: api-key)"),
    ({"name": "keys"}, {"keys": {"data": {"api-key": ""}}},
     "spec.apiKeySecret: Secret models/keys key 'api-key' is empty"),
], ids=["default-key", "named-key", "no-secret", "no-key", "empty"])
def test_the_api_key_secret_is_checked(ref, secrets, message):
    spec = parse_spec({**BASE, "apiKeySecret": ref})
    expected = None if message is None else (API_KEY_REASON, message)
    assert api_key_problem(spec.apiKeySecret, "models", getter(secrets)) == expected
    assert api_key_problem(None, "models", lambda *_: pytest.fail("read without apiKeySecret")) is None


def test_a_refused_read_says_what_the_operator_needs_and_a_failed_one_is_retried():
    def refuse(status: int):
        def get(namespace: str, name: str):
            raise kube.KubeError(status, "GET", f"/api/v1/namespaces/{namespace}/secrets/{name}", "no")
        return get

    reason, message = tls_problem(tls(), "models", refuse(403), getter({}))
    assert (reason, message) == (REASON, "spec.tls.certSecret: Secret models/mx-tls cannot be read to check it "
                                         "(HTTP 403: no): the operator needs `get` on it")
    with pytest.raises(kube.KubeError):  # the server's trouble, not the spec's: the reconcile is retried
        tls_problem(tls(), "models", refuse(503), getter({}))


def test_a_mount_problem_degrades_the_model_whose_running_pods_stay_ready():
    # Pods already running keep the files they mounted: Ready still counts them, Degraded says why
    # no new pod can start.
    deployment = {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}}
    problem = (REASON, "spec.tls.certSecret: Secret models/mx-tls not found")
    fields, conditions = compute_status("mx", 2, deployment, [], problem)
    by_type = {c["type"]: c for c in conditions}
    assert (by_type["Degraded"]["status"], by_type["Degraded"]["reason"]) == ("True", REASON)
    assert by_type["Degraded"]["message"] == problem[1]
    assert by_type["Ready"]["status"] == "True" and fields["phase"] == "Degraded"
    fields, conditions = compute_status("mx", 2, deployment, [])
    assert fields["phase"] == "Running" and conditions[-1]["reason"] == "AsExpected"
