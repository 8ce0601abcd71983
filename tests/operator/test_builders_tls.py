"""Pure builder tests for `spec.tls`: the attention container's flags, the Secret and ConfigMap volumes
it reads them from, its probes on the plaintext health socket, the Service; and nothing of it without.
And `spec.apiKeySecret`'s environment variable."""

from __future__ import annotations

import copy
import posixpath

import kubernetes_validate.utils
import pytest
from test_builders import BASE, SPECS, children, containers, pod_spec

from tandem import contract
from tandem_operator.spec import parse_spec

FLAGS = contract.SERVE_FLAGS
TLS_SPECS = {
    "tls": {**BASE, "tls": {"certSecret": {"name": "mx-tls"}}},
    "mutual-tls-secret": {**BASE, "tls": {"certSecret": {"name": "mx-tls"},
                                          "clientCASecret": {"name": "clients-ca"}}},
    "mutual-tls-config-map": {**BASE, "tls": {"certSecret": {"name": "mx-tls"},
                                              "clientCAConfigMap": {"name": "trust", "key": "bundle.pem"}}},
}
# Where each flag's file comes from: (volume source, its name, the key) by spec.
SOURCES = {
    "tls": {"ssl_certfile": ("secret", "mx-tls", "tls.crt"), "ssl_keyfile": ("secret", "mx-tls", "tls.key")},
    "mutual-tls-secret": {"ssl_certfile": ("secret", "mx-tls", "tls.crt"),
                          "ssl_keyfile": ("secret", "mx-tls", "tls.key"),
                          "ssl_ca_certs": ("secret", "clients-ca", "ca.crt")},
    "mutual-tls-config-map": {"ssl_certfile": ("secret", "mx-tls", "tls.crt"),
                              "ssl_keyfile": ("secret", "mx-tls", "tls.key"),
                              "ssl_ca_certs": ("configMap", "trust", "bundle.pem")},
}
FILE_FLAGS = ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs")


def flag(container: dict, key: str) -> str | None:
    args = container["args"]
    return args[args.index(FLAGS[key]) + 1] if FLAGS[key] in args else None


def source(volume: dict) -> tuple[str, str]:
    """(kind, name) of a Secret or ConfigMap volume."""
    if "secret" in volume:
        return "secret", volume["secret"]["secretName"]
    return "configMap", volume["configMap"]["name"]


@pytest.mark.parametrize("version", ["1.28.0", kubernetes_validate.utils.latest_version()])
@pytest.mark.parametrize("name", TLS_SPECS)
def test_tls_children_are_valid_kubernetes_objects(name, version):
    for child in children(TLS_SPECS[name]).values():
        kubernetes_validate.utils.validate(child, version, strict=True)


@pytest.mark.parametrize("name", TLS_SPECS)
def test_each_file_flag_names_a_read_only_mount_of_only_its_key(name):
    spec = pod_spec(TLS_SPECS[name])
    attention = containers(TLS_SPECS[name])["attention"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounted = {}
    for key in FILE_FLAGS:
        path = flag(attention, key)
        if path is None:
            continue
        (mount,) = [m for m in attention["volumeMounts"] if posixpath.dirname(path) == m["mountPath"]]
        # A whole-directory mount, not subPath: the kubelet swaps in a renewed certificate only there.
        assert mount["readOnly"] is True and "subPath" not in mount
        volume = volumes[mount["name"]]
        kind, secret = source(volume)
        (item,) = [i for i in volume[kind]["items"] if i["path"] == posixpath.basename(path)]
        mounted[key] = (kind, secret, item["key"])
    assert mounted == SOURCES[name]
    # The volumes map the keys the flags read and nothing else of the Secret or ConfigMap.
    tls_volumes = {n for n, v in volumes.items() if "secret" in v or "configMap" in v}
    items = {(*source(volumes[n]), i["key"]) for n in tls_volumes for i in volumes[n][source(volumes[n])[0]]["items"]}
    assert items == set(SOURCES[name].values())


@pytest.mark.parametrize("name", TLS_SPECS)
def test_only_the_servers_group_may_read_the_key(name):
    # The kubelet writes a Secret volume's files owned by root, in the pod's fsGroup: the non-root
    # server reads them through its group bits, and nobody else may read the private key.
    spec = pod_spec(TLS_SPECS[name])
    security = spec["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0 and security["fsGroup"]
    for volume in spec["volumes"]:
        kind = "secret" if "secret" in volume else "configMap" if "configMap" in volume else None
        if kind is None:
            continue
        mode = volume[kind]["defaultMode"]
        assert mode & 0o040, f"{volume['name']}: the server's group cannot read it"
        assert not mode & 0o007 and not mode & 0o222, f"{volume['name']}: mode {mode:o}"
        assert all("mode" not in item for item in volume[kind]["items"])


@pytest.mark.parametrize("name", TLS_SPECS)
def test_over_tls_the_probes_ask_the_plaintext_health_socket(name):
    attention = containers(TLS_SPECS[name])["attention"]
    plain = containers(BASE)["attention"]
    assert flag(attention, "health_listen") == contract.HEALTH_SOCKET
    sockets = next(m for m in attention["volumeMounts"] if m["name"] == "sockets")
    assert posixpath.dirname(contract.HEALTH_SOCKET.removeprefix("unix:")) == sockets["mountPath"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = attention[probe]["exec"]["command"]
        script, socket, service = command[command.index("-c") + 1:command.index("-c") + 4]
        compile(script, "probe", "exec")
        # The same question of the same health service as the kubelet's gRPC probe asks without TLS.
        assert (socket, service) == (contract.HEALTH_SOCKET, plain[probe]["grpc"]["service"])
        assert "grpc" not in attention[probe]
        timing = {k: v for k, v in attention[probe].items() if k != "exec"}
        assert timing == {k: v for k, v in plain[probe].items() if k != "grpc"}


@pytest.mark.parametrize("name", TLS_SPECS)
def test_tls_changes_the_attention_container_its_volumes_and_the_service_only(name):
    tls, plain = children(TLS_SPECS[name]), children(BASE)
    tls_pod, plain_pod = (c["Deployment"]["spec"]["template"]["spec"] for c in (tls, plain))
    tls_attention, plain_attention = tls_pod["containers"][0], plain_pod["containers"][0]
    # The flags come after every other, so the rest of the command line stays as it was.
    added = tls_attention["args"][len(plain_attention["args"]):]
    assert tls_attention["args"][:len(plain_attention["args"])] == plain_attention["args"]
    expected = [FLAGS["ssl_certfile"], "/etc/tandem/tls/tls.crt", FLAGS["ssl_keyfile"], "/etc/tandem/tls/tls.key"]
    if parse_spec(TLS_SPECS[name]).tls.client_ca is not None:
        expected += [FLAGS["ssl_ca_certs"], "/etc/tandem/client-ca/ca.crt"]
    assert added == expected + [FLAGS["health_listen"], contract.HEALTH_SOCKET]
    assert tls_attention["volumeMounts"][:len(plain_attention["volumeMounts"])] == plain_attention["volumeMounts"]
    assert tls_pod["volumes"][:len(plain_pod["volumes"])] == plain_pod["volumes"]
    # The experts container talks over the Unix socket inside the pod: untouched.
    assert tls_pod["containers"][1] == plain_pod["containers"][1]
    changed = ("args", "volumeMounts", "startupProbe", "readinessProbe", "livenessProbe")
    assert {k: v for k, v in tls_attention.items() if k not in changed} == \
        {k: v for k, v in plain_attention.items() if k not in changed}
    assert {k: v for k, v in tls_pod.items() if k not in ("containers", "volumes")} == \
        {k: v for k, v in plain_pod.items() if k not in ("containers", "volumes")}
    assert tls["PodDisruptionBudget"] == plain["PodDisruptionBudget"]


@pytest.mark.parametrize("name", SPECS)
def test_without_tls_nothing_of_it_is_rendered(name):
    kids = children(SPECS[name])
    pod = kids["Deployment"]["spec"]["template"]["spec"]
    args = [arg for container in pod["containers"] for arg in container["args"]]
    assert not {FLAGS[key] for key in (*FILE_FLAGS, "health_listen")} & set(args)
    assert not [v for v in pod["volumes"] if "secret" in v or "configMap" in v]
    attention = pod["containers"][0]
    assert all(attention[probe]["grpc"]["port"] == contract.GRPC_PORT
               for probe in ("startupProbe", "readinessProbe", "livenessProbe"))
    grpc = next(p for p in kids["Service"]["spec"]["ports"] if p["name"] == "grpc")
    assert grpc["appProtocol"] == "kubernetes.io/h2c"


@pytest.mark.parametrize("name", TLS_SPECS)
def test_the_service_no_longer_claims_cleartext_http2(name):
    # kubernetes.io/h2c tells a gateway to speak HTTP/2 in cleartext: wrong once the port wants TLS.
    # None, not left out: the operator owns the key, so turning TLS on takes it off the Service.
    ports = {p["name"]: p for p in children(TLS_SPECS[name])["Service"]["spec"]["ports"]}
    assert "appProtocol" in ports["grpc"] and ports["grpc"]["appProtocol"] is None
    assert ports["grpc"]["port"] == contract.GRPC_PORT and ports["grpc"]["targetPort"] == "grpc"


@pytest.mark.parametrize("name", TLS_SPECS)
def test_tls_command_line_is_what_tandem_serve_accepts(name):
    from tandem.cli import build_parser

    attention = containers(TLS_SPECS[name])["attention"]
    args = build_parser().parse_args(attention["command"][1:] + attention["args"])
    assert args.ssl_certfile == "/etc/tandem/tls/tls.crt" and args.ssl_keyfile == "/etc/tandem/tls/tls.key"
    ca = "/etc/tandem/client-ca/ca.crt" if parse_spec(TLS_SPECS[name]).tls.client_ca is not None else None
    assert args.ssl_ca_certs == ca and args.health_listen == contract.HEALTH_SOCKET


def test_a_client_ca_key_of_any_name_is_the_same_file():
    # One file name whatever the key: a key the schema allows but no Secret holds (`..`) still makes a
    # valid pod, whose missing key the status then names (tandem_operator.pod_secrets).
    raw = copy.deepcopy(TLS_SPECS["mutual-tls-secret"])
    raw["tls"]["clientCASecret"]["key"] = "root-ca.pem"
    attention = containers(raw)["attention"]
    assert flag(attention, "ssl_ca_certs") == "/etc/tandem/client-ca/ca.crt"
    (volume,) = [v for v in pod_spec(raw)["volumes"] if v["name"] == "client-ca"]
    assert volume["secret"]["items"] == [{"key": "root-ca.pem", "path": "ca.crt"}]


@pytest.mark.parametrize("version", ["1.28.0", kubernetes_validate.utils.latest_version()])
def test_the_api_key_reaches_the_attention_container_by_environment_only(version):
    spec = {**BASE, "apiKeySecret": {"name": "mx-keys", "key": "token"}}
    for child in children(spec).values():
        kubernetes_validate.utils.validate(child, version, strict=True)
    by_name = containers(spec)
    wanted = {"name": contract.API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": "mx-keys", "key": "token"}}}
    assert wanted in by_name["attention"]["env"]
    # The experts process serves no public API; nothing else of the pod changes.
    assert all(e["name"] != contract.API_KEY_ENV for e in by_name["experts"]["env"])
    plain = containers(BASE)
    assert by_name["experts"] == plain["experts"]
    assert {**by_name["attention"], "env": plain["attention"]["env"]} == plain["attention"]
    assert all(e["name"] != contract.API_KEY_ENV for e in plain["attention"]["env"])
