"""The real operator against KMock with `spec.tls`: the pods' TLS reaches the Deployment and the Service
both ways, and a missing Secret, ConfigMap or key is named in Degraded until it is fixed."""

from __future__ import annotations

import asyncio
import base64
import logging

import kopf
from hm_cluster import DEPLOYMENT, NS, SERVICE, core_path, hybrid_model, model_path, wait_for
from test_operator_kmock import condition, containers

from tandem import contract
from tandem_operator import handlers
from tandem_operator.login import configure_client

LOG = logging.getLogger("test")

CERT = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
KEY = "-----BEGIN PRIVATE KEY-----\nsecret key material\n-----END PRIVATE KEY-----\n"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def tls_secret(name: str, data: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": name, "namespace": NS}, "data": {key: b64(value) for key, value in data.items()}}


async def degraded(cluster, name: str, reason: str) -> dict | None:
    found = condition(await cluster.get(model_path(name)), "Degraded")
    return found if found.get("reason") == reason else None


async def test_a_missing_secret_is_named_and_the_deployment_applied_all_the_same(cluster, operator):
    await cluster.create_model(hybrid_model("secure", tls={"certSecret": {"name": "secure-tls"}}))

    # The pods start once cert-manager has written the Secret: nothing to hold back meanwhile.
    deployment = await wait_for(lambda: cluster.get(DEPLOYMENT("secure")), what="Deployment")
    assert contract.SERVE_FLAGS["ssl_certfile"] in containers(deployment)["attention"]["args"]
    missing = await wait_for(lambda: degraded(cluster, "secure", "TLSSecretInvalid"), what="TLSSecretInvalid")
    assert missing["status"] == "True" and missing["observedGeneration"] == 1
    assert missing["message"] == (f"spec.tls.certSecret: Secret {NS}/secure-tls not found: new pods wait for it in "
                                  "ContainerCreating")
    assert (await cluster.get(model_path("secure")))["status"]["phase"] == "Degraded"


async def resyncing(cluster, monkeypatch, body: dict):
    """Creates the model; returns a coroutine function running one periodic resync, then giving Degraded."""
    await cluster.create_model(body)
    await asyncio.to_thread(configure_client)
    monkeypatch.setattr(kopf, "warn", lambda obj, reason, message: None)

    async def resync() -> dict:
        await asyncio.to_thread(handlers.resync, body, None, LOG)
        return condition(await cluster.get(model_path(body["metadata"]["name"])), "Degraded")

    return resync


async def test_the_resync_names_what_is_missing_until_it_is_fixed(cluster, monkeypatch):
    # The operator may not watch Secrets: the periodic resync (the job tandem_operator.periodic runs)
    # is what reads them again. Called here round by round, without kopf.
    resync = await resyncing(cluster, monkeypatch, hybrid_model("fixed", tls={"certSecret": {"name": "fixed-tls"}}))

    assert (await resync())["message"].startswith(f"spec.tls.certSecret: Secret {NS}/fixed-tls not found")
    await cluster.create(core_path("secrets"), tls_secret("fixed-tls", {"tls.crt": CERT}))
    missing_key = await resync()
    assert (missing_key["status"], missing_key["reason"]) == ("True", "TLSSecretInvalid")
    assert missing_key["message"] == (f"spec.tls.certSecret: Secret {NS}/fixed-tls has no key 'tls.key' "
                                      "(its keys: tls.crt)")

    await cluster.patch(core_path("secrets", "fixed-tls"), {"data": {"tls.key": b64(KEY)}})
    cleared = await resync()
    assert (cleared["status"], cleared["reason"]) == ("False", "AsExpected")
    model = await cluster.get(model_path("fixed"))
    assert model["status"]["phase"] == "Pending" and "secret key material" not in str(model)
    # Read one by name (all the operator's role allows), never listed or watched.
    reads = {(str(r.method).upper().rsplit(".", 1)[-1], r.url.path) for r in list(cluster.kmock)
             if "/secrets" in r.url.path and str(r.method).upper().rsplit(".", 1)[-1] not in ("POST", "PATCH")}
    assert reads == {("GET", core_path("secrets", "fixed-tls"))}


async def test_a_missing_client_ca_config_map_is_named(cluster, operator):
    await cluster.create(core_path("secrets"), tls_secret("mutual-tls", {"tls.crt": CERT, "tls.key": KEY}))
    await cluster.create_model(hybrid_model("mutual", tls={"certSecret": {"name": "mutual-tls"},
                                                           "clientCAConfigMap": {"name": "clients"}}))

    missing = await wait_for(lambda: degraded(cluster, "mutual", "TLSSecretInvalid"), what="TLSSecretInvalid")
    assert missing["message"].startswith(f"spec.tls.clientCAConfigMap: ConfigMap {NS}/clients not found")
    volumes = (await cluster.get(DEPLOYMENT("mutual")))["spec"]["template"]["spec"]["volumes"]
    assert {"name": "client-ca", "configMap": {"name": "clients", "items": [{"key": "ca.crt", "path": "ca.crt"}],
                                               "defaultMode": 0o440}} in volumes


async def test_turning_tls_on_and_off_rolls_the_pods_and_updates_the_service(cluster, operator):
    await cluster.create(core_path("secrets"), tls_secret("flip-tls", {"tls.crt": CERT, "tls.key": KEY}))
    await cluster.create_model(hybrid_model("flip"))
    plain = await wait_for(lambda: cluster.get(DEPLOYMENT("flip")), what="Deployment")
    plain_service = await wait_for(lambda: cluster.get(SERVICE("flip")), what="Service")
    assert plain_service["spec"]["ports"][0]["appProtocol"] == "kubernetes.io/h2c"

    async def rolled(tls: bool) -> tuple[dict, dict] | None:
        deployment, service = await cluster.get(DEPLOYMENT("flip")), await cluster.get(SERVICE("flip"))
        attention = containers(deployment)["attention"]
        over_tls = (contract.SERVE_FLAGS["ssl_certfile"] in attention["args"], "exec" in attention["readinessProbe"],
                    any(v["name"] == "tls" for v in deployment["spec"]["template"]["spec"]["volumes"]),
                    not service["spec"]["ports"][0].get("appProtocol"))
        return (deployment, service) if over_tls == (tls,) * 4 else None

    # Each state is waited for as a whole: a child's event can reconcile from the newest spec before
    # the update handler does, and the two write in turn.
    await cluster.patch(model_path("flip"), {"metadata": {"generation": 2},
                                             "spec": {"tls": {"certSecret": {"name": "flip-tls"}}}})
    await wait_for(lambda: rolled(tls=True), what="the pod template and the Service over TLS")

    await cluster.patch(model_path("flip"), {"metadata": {"generation": 3}, "spec": {"tls": None}})
    deployment, service = await wait_for(lambda: rolled(tls=False), what="the pod template and the Service without TLS")
    assert deployment["spec"]["template"] == plain["spec"]["template"]
    assert service["spec"]["ports"] == plain_service["spec"]["ports"]


async def test_the_api_key_secret_is_named_until_it_is_there(cluster, monkeypatch):
    # spec.apiKeySecret: the same check as spec.tls's, its own reason; the key reaches the pods by env only.
    resync = await resyncing(cluster, monkeypatch,
                             hybrid_model("keyed", apiKeySecret={"name": "keyed-keys", "key": "token"}))

    missing = await resync()
    assert (missing["status"], missing["reason"]) == ("True", "APIKeySecretInvalid")
    assert missing["message"].startswith(f"spec.apiKeySecret: Secret {NS}/keyed-keys not found")
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keyed-keys", "namespace": NS},
              "data": {"token": b64("tk-live-0123")}}
    await cluster.create(core_path("secrets"), secret)
    cleared = await resync()
    assert (cleared["status"], cleared["reason"]) == ("False", "AsExpected")
    attention = containers(await cluster.get(DEPLOYMENT("keyed")))["attention"]
    assert {"name": contract.API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": "keyed-keys", "key": "token"}}} in \
        attention["env"]
    assert "tk-live-0123" not in str(await cluster.get(model_path("keyed")))
