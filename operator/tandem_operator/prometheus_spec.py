"""`spec.autoscaling.metrics.prometheus`: where the Prometheus HTTP API is, the PromQL to run, and
how to reach it (TLS, credentials, headers), as the CRD declares them.

The credentials themselves never appear in the spec: it names Secrets (and, for a CA bundle, a
ConfigMap) in the HybridModel's namespace, which tandem_operator.prometheus_access reads when it
queries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from .spec_fields import (ConfigMapKeyRef, SecretKeyRef, SecretRef, SpecError, _bool, _key_ref, _known, _object,
                          _secret, _string)

WHERE = "spec.autoscaling.metrics.prometheus"
_URL = re.compile(r"^https?://\S+$")
# An HTTP field name (RFC 9110's token), and a value without control characters (no header
# injection through a newline).
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_HEADER_VALUE = re.compile(r"^[^\x00-\x1f\x7f]*$")
HEADERS_MAX = 16
HEADER_VALUE_MAX_LENGTH = 1024


@dataclass(frozen=True)
class PrometheusTLS:
    # A PEM CA bundle trusted instead of the system's CAs, from at most one of a Secret and a
    # ConfigMap (where OpenShift's service CA and cert-manager's trust-manager put theirs).
    caSecret: SecretKeyRef | None = None
    caConfigMap: ConfigMapKeyRef | None = None
    # The client's certificate for mutual TLS: a kubernetes.io/tls Secret (keys tls.crt and tls.key).
    certSecret: SecretRef | None = None
    insecureSkipVerify: bool = False
    serverName: str | None = None  # the name the certificate must carry, when the URL's host is not it

    @property
    def ca_source(self) -> str | None:
        """Where the CA bundle comes from, in the spec's words (for messages); None for the system's CAs."""
        if self.caSecret is not None:
            return f"tls.caSecret: Secret {self.caSecret.name} key {self.caSecret.key!r}"
        if self.caConfigMap is not None:
            return f"tls.caConfigMap: ConfigMap {self.caConfigMap.name} key {self.caConfigMap.key!r}"
        return None


@dataclass(frozen=True)
class PrometheusAuth:
    """At most one source of credentials."""

    bearerTokenSecret: SecretKeyRef | None = None
    basicAuthSecret: SecretRef | None = None  # holds the keys `username` and `password`
    serviceAccountToken: bool = False  # the operator's own projected token, as a bearer token

    @property
    def source(self) -> str | None:
        """Where the credentials come from, in the spec's words (for messages); None without any."""
        if self.bearerTokenSecret is not None:
            return f"auth.bearerTokenSecret {self.bearerTokenSecret.name}"
        if self.basicAuthSecret is not None:
            return f"auth.basicAuthSecret {self.basicAuthSecret.name}"
        return "auth.serviceAccountToken" if self.serviceAccountToken else None


@dataclass(frozen=True)
class PrometheusSpec:
    url: str
    query: str | None = None
    tls: PrometheusTLS = field(default_factory=PrometheusTLS)
    auth: PrometheusAuth = field(default_factory=PrometheusAuth)
    headers: dict = field(default_factory=dict)  # sent with every query, e.g. Mimir's X-Scope-OrgID


def parse_prometheus(raw: Any) -> PrometheusSpec:
    """Validate `metrics.prometheus`; raise SpecError on the first bad field."""
    prom = _object(raw, WHERE)
    _known(prom, WHERE, PrometheusSpec)
    url = _string(prom, "url", WHERE, None)
    if not _URL.match(url):
        raise SpecError(f"{WHERE}.url must be an http(s) URL, got {url!r}")
    if prom.get("tls") is not None and not url.startswith("https://"):
        raise SpecError(f"{WHERE}.tls needs an https:// url, got {url!r}")
    return PrometheusSpec(
        url=url.rstrip("/"),
        query=None if prom.get("query") is None else _string(prom, "query", WHERE, None, 1),
        tls=_tls(_object(prom.get("tls", {}), f"{WHERE}.tls")),
        auth=_auth(_object(prom.get("auth", {}), f"{WHERE}.auth")),
        headers=_headers(_object(prom.get("headers", {}), f"{WHERE}.headers")),
    )


def _tls(raw: Mapping) -> PrometheusTLS:
    where = f"{WHERE}.tls"
    _known(raw, where, PrometheusTLS)
    secret, config_map, cert = raw.get("caSecret"), raw.get("caConfigMap"), raw.get("certSecret")
    if secret is not None and config_map is not None:
        raise SpecError(f"{where} takes at most one of caSecret and caConfigMap")
    return PrometheusTLS(
        caSecret=None if secret is None else _key_ref(secret, f"{where}.caSecret", SecretKeyRef),
        caConfigMap=None if config_map is None else _key_ref(config_map, f"{where}.caConfigMap", ConfigMapKeyRef),
        certSecret=None if cert is None else _secret(cert, f"{where}.certSecret"),
        insecureSkipVerify=_bool(raw, "insecureSkipVerify", where, False),
        serverName=None if raw.get("serverName") is None else _string(raw, "serverName", where, None, 1),
    )


def _auth(raw: Mapping) -> PrometheusAuth:
    where = f"{WHERE}.auth"
    _known(raw, where, PrometheusAuth)
    bearer, basic = raw.get("bearerTokenSecret"), raw.get("basicAuthSecret")
    auth = PrometheusAuth(
        bearerTokenSecret=None if bearer is None else _key_ref(bearer, f"{where}.bearerTokenSecret", SecretKeyRef),
        basicAuthSecret=None if basic is None else _secret(basic, f"{where}.basicAuthSecret"),
        serviceAccountToken=_bool(raw, "serviceAccountToken", where, False),
    )
    if (bearer is not None) + (basic is not None) + auth.serviceAccountToken > 1:
        raise SpecError(f"{where} takes at most one of bearerTokenSecret, basicAuthSecret and serviceAccountToken")
    return auth


def _headers(raw: Mapping) -> dict:
    where = f"{WHERE}.headers"
    if len(raw) > HEADERS_MAX:
        raise SpecError(f"{where} holds at most {HEADERS_MAX} headers, got {len(raw)}")
    for name, value in raw.items():
        if not _HEADER_NAME.match(name):
            raise SpecError(f"{where}: {name!r} is not an HTTP header name")
        if name.lower() == "authorization":
            # Whoever may read the HybridModel could read it there.
            raise SpecError(f"{where} may not set Authorization: put the credentials in a Secret named by "
                            "metrics.prometheus.auth")
        if not isinstance(value, str) or len(value) > HEADER_VALUE_MAX_LENGTH or not _HEADER_VALUE.match(value):
            raise SpecError(f"{where}.{name} must be a string of at most {HEADER_VALUE_MAX_LENGTH} characters, "
                            "without control characters")
    return dict(raw)
