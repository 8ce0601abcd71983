"""How the autoscaler reaches a Prometheus behind TLS or credentials: the Secrets (and a CA
bundle's ConfigMap) that `metrics.prometheus.tls` and `.auth` name, read through the Kubernetes
API, made into an SSL context and the query's headers.

Secrets and ConfigMaps are read at every autoscaling step, not cached: the operator may only `get`
them (not list or watch them), so a cache would GET them anyway to notice a change, and this way a
rotated token, certificate or CA is used from the next step on. No message or log line carries
what a Secret holds, and a client certificate's key is handed to OpenSSL through memory (a
memfd), never written to a file.
"""

from __future__ import annotations

import base64
import os
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from . import kube
from .metrics_source import MetricsError
from .prometheus_spec import ConfigMapKeyRef, PrometheusAuth, PrometheusSpec, PrometheusTLS, SecretKeyRef, SecretRef
from .spec_fields import TLS_CERT_KEY, TLS_KEY_KEY

# Where the kubelet keeps the operator pod's projected ServiceAccount token (and rotates it).
SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
# A token as RFC 6750 allows it: no spaces or control characters, which would also break the header.
_TOKEN = re.compile(r"^[\x21-\x7e]+$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

SecretGetter = ConfigMapGetter = kube.ObjectGetter


@dataclass(frozen=True)
class Access:
    """What a query sends and checks: the TLS context (None for plain HTTP) and the headers."""

    context: ssl.SSLContext | None = None
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)  # holds the credentials
    credentials: str | None = None  # where the Authorization header comes from, in the spec's words


def access(prometheus: PrometheusSpec, namespace: str, get_secret: SecretGetter | None = None,
           get_config_map: ConfigMapGetter | None = None) -> Access:
    """Read what `prometheus` names from `namespace`; a MetricsError says what is missing or unusable."""
    get_secret = get_secret or _get_secret
    tls, auth = prometheus.tls, prometheus.auth
    context = None
    if prometheus.url.startswith("https://"):
        ca = None if tls.insecureSkipVerify else _ca_bundle(tls, namespace, get_secret,
                                                            get_config_map or _get_config_map)
        context = ssl_context(tls, ca)
        if tls.certSecret is not None:
            _load_client_certificate(context, get_secret, namespace, tls.certSecret)
    headers = dict(prometheus.headers)
    authorization = _authorization(auth, namespace, get_secret)
    if authorization is not None:
        headers["Authorization"] = authorization
    return Access(context, headers, auth.source)


def ssl_context(tls: PrometheusTLS, ca_pem: str | None = None) -> ssl.SSLContext:
    """A client context that trusts `ca_pem` (PEM certificates) if given, else the system's CAs."""
    if tls.serverName:
        context = _ServerNameContext(ssl.PROTOCOL_TLS_CLIENT)
        context.server_name = tls.serverName
    else:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if tls.insecureSkipVerify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif ca_pem is None:
        context.load_default_certs()
    else:
        try:
            context.load_verify_locations(cadata=ca_pem)
        except (ssl.SSLError, ValueError, TypeError) as e:
            where = tls.ca_source or "the CA bundle"
            raise MetricsError(f"metrics.prometheus.{where} holds no PEM CA certificate: {e}") from None
    return context


def client_certificate(context: ssl.SSLContext, cert_pem: str, key_pem: str, source: str) -> None:
    """Load a PEM certificate (chain) and its private key into `context`, from memory.

    Python's ssl reads certificates only from files: both go to a memfd (anonymous memory, no
    path on any filesystem) that OpenSSL opens by its /proc/self/fd name, and that is gone when
    closed."""
    fd = os.memfd_create("tandem-prometheus-client", os.MFD_CLOEXEC)
    try:
        with os.fdopen(fd, "wb", closefd=False) as file:
            file.write(f"{cert_pem.strip()}\n{key_pem.strip()}\n".encode())
        context.load_cert_chain(f"/proc/self/fd/{fd}")
    except ssl.SSLError as e:
        raise MetricsError(f"{source}: {TLS_CERT_KEY} and {TLS_KEY_KEY} are not a PEM certificate and its private "
                           f"key ({e.reason or e})") from None
    finally:
        os.close(fd)


def bearer(token: str, source: str) -> str:
    """The Authorization header for a bearer token (surrounding whitespace, as a file's newline, dropped)."""
    token = token.strip()
    if not _TOKEN.match(token):
        raise MetricsError(f"{source}: the token is empty or holds spaces or control characters")
    return f"Bearer {token}"


def basic(username: str, password: str, source: str) -> str:
    """The Authorization header for HTTP basic auth (RFC 7617)."""
    username, password = username.rstrip("\r\n"), password.rstrip("\r\n")
    if not username or ":" in username or _CONTROL.search(username + password):
        raise MetricsError(f"{source}: the username must be non-empty without ':', and neither it nor the password "
                           "may hold control characters")
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode("ascii")


class _ServerNameContext(ssl.SSLContext):
    """Sends (as SNI) and checks `server_name` instead of the URL's host, as Prometheus' server_name does."""

    server_name = ""

    def wrap_socket(self, sock, *args, **kwargs):  # type: ignore[override]
        kwargs["server_hostname"] = self.server_name
        return super().wrap_socket(sock, *args, **kwargs)


def _authorization(auth: PrometheusAuth, namespace: str, get_secret: SecretGetter) -> str | None:
    if auth.bearerTokenSecret is not None:
        token = _secret_value(get_secret, namespace, auth.bearerTokenSecret, "auth.bearerTokenSecret")
        return bearer(token, f"metrics.prometheus.{auth.source}")
    if auth.basicAuthSecret is not None:
        name, where = auth.basicAuthSecret.name, "auth.basicAuthSecret"
        data = _secret_data(get_secret, namespace, name, where)
        username, password = (_decoded(data, namespace, SecretKeyRef(name, key), where)
                              for key in ("username", "password"))
        return basic(username, password, f"metrics.prometheus.{auth.source}")
    if auth.serviceAccountToken:
        try:
            token = SERVICE_ACCOUNT_TOKEN.read_text()
        except OSError as e:
            raise MetricsError(f"auth.serviceAccountToken: the operator's token {SERVICE_ACCOUNT_TOKEN} cannot be "
                               f"read ({e.strerror}): is the operator running in a pod that mounts its "
                               "ServiceAccount token?") from None
        return bearer(token, f"metrics.prometheus.{auth.source}")
    return None


def _ca_bundle(tls: PrometheusTLS, namespace: str, get_secret: SecretGetter,
               get_config_map: ConfigMapGetter) -> str | None:
    """The PEM CA bundle the spec names; None for the system's CAs."""
    if tls.caSecret is not None:
        return _secret_value(get_secret, namespace, tls.caSecret, "tls.caSecret")
    if tls.caConfigMap is not None:
        return _config_map_value(get_config_map, namespace, tls.caConfigMap)
    return None


def _load_client_certificate(context: ssl.SSLContext, get_secret: SecretGetter, namespace: str,
                             ref: SecretRef) -> None:
    where = "tls.certSecret"
    data = _secret_data(get_secret, namespace, ref.name, where)
    cert, key = (_decoded(data, namespace, SecretKeyRef(ref.name, k), where) for k in (TLS_CERT_KEY, TLS_KEY_KEY))
    client_certificate(context, cert, key, f"metrics.prometheus.{where}: Secret {namespace}/{ref.name}")


# Module attributes, read at each call: tests replace them.
_get_secret = kube.get_secret
_get_config_map = kube.get_config_map


def _read(get: SecretGetter, noun: str, namespace: str, name: str, where: str) -> dict:
    try:
        found = get(namespace, name)
    except kube.KubeError as e:
        raise MetricsError(f"metrics.prometheus.{where}: cannot read {noun} {namespace}/{name}: HTTP {e.status}: "
                           f"{e.message}") from None
    if found is None:
        raise MetricsError(f"metrics.prometheus.{where}: {noun} {namespace}/{name} not found")
    return found


def _secret_data(get_secret: SecretGetter, namespace: str, name: str, where: str) -> dict:
    return _read(get_secret, "Secret", namespace, name, where).get("data") or {}


def _config_map_value(get_config_map: ConfigMapGetter, namespace: str, ref: ConfigMapKeyRef) -> str:
    """A ConfigMap's key as text: from `data`, or `binaryData` (base64) where the bundle was put there."""
    where = "tls.caConfigMap"
    config_map = _read(get_config_map, "ConfigMap", namespace, ref.name, where)
    data, binary = config_map.get("data") or {}, config_map.get("binaryData") or {}
    if ref.key in data:
        return data[ref.key]
    if ref.key in binary:
        return _decoded(binary, namespace, ref, where, noun="ConfigMap")
    raise MetricsError(f"metrics.prometheus.{where}: ConfigMap {namespace}/{ref.name} has no key {ref.key!r} "
                       f"(its keys: {', '.join(sorted({*data, *binary})) or 'none'})")


def _secret_value(get_secret: SecretGetter, namespace: str, ref: SecretKeyRef, where: str) -> str:
    return _decoded(_secret_data(get_secret, namespace, ref.name, where), namespace, ref, where)


def _decoded(data: dict, namespace: str, ref: SecretKeyRef | ConfigMapKeyRef, where: str, noun: str = "Secret") -> str:
    """One key of a Secret's `data` (base64, as the API serves it) as text; its value is never in a message."""
    secret = f"metrics.prometheus.{where}: {noun} {namespace}/{ref.name}"
    if ref.key not in data:
        raise MetricsError(f"{secret} has no key {ref.key!r} (its keys: {', '.join(sorted(data)) or 'none'})")
    try:
        return base64.b64decode(data[ref.key], validate=True).decode("utf-8")
    except (ValueError, TypeError):
        raise MetricsError(f"{secret} key {ref.key!r} is not UTF-8 text") from None
