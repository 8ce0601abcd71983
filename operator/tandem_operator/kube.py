"""A small dict-in, dict-out client for the few Kubernetes resources the operator touches.

It rides on the `kubernetes` package's configured ApiClient (host, TLS, token) but skips its
typed models: the builders produce plain dicts and the drift check compares plain dicts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import quote

import kubernetes.client

from . import names

REQUEST_TIMEOUT_SECONDS = 30


@dataclass(frozen=True)
class Resource:
    """A namespaced resource: its API group ("" for the core group), version and plural."""

    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        path = f"{base}/namespaces/{quote(namespace, safe='')}/{self.plural}"
        if name is not None:
            path += f"/{quote(name, safe='')}"
        if subresource is not None:
            path += f"/{subresource}"
        return path


DEPLOYMENTS = Resource("apps", "v1", "deployments", "Deployment")
SERVICES = Resource("", "v1", "services", "Service")
PDBS = Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
PODS = Resource("", "v1", "pods", "Pod")
HYBRIDMODELS = Resource(names.GROUP, names.VERSION, names.PLURAL, names.KIND)
# Only read, one by name: the credentials of a Prometheus the autoscaler queries, and spec.tls's
# certificate and client CA, checked before the pods mount them.
SECRETS = Resource("", "v1", "secrets", "Secret")
CONFIGMAPS = Resource("", "v1", "configmaps", "ConfigMap")  # the same, for CA bundles
BY_KIND = {r.kind: r for r in (DEPLOYMENTS, SERVICES, PDBS, PODS, HYBRIDMODELS, SECRETS, CONFIGMAPS)}


# Error statuses that may pass on their own: not found or conflicting during a concurrent change,
# throttled, timed out, or the server's own trouble (5xx). Any other 4xx rejects the request itself.
_TRANSIENT = (404, 408, 409, 429)


class KubeError(Exception):
    """The API server answered with an error status; `message` is the server's own."""

    def __init__(self, status: int, method: str, path: str, message: str):
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status
        self.message = message

    @property
    def rejected(self) -> bool:
        """Whether the server refused the request as such (invalid, forbidden): retrying will not help."""
        return 400 <= self.status < 500 and self.status not in _TRANSIENT


def get(resource: Resource, namespace: str, name: str) -> dict | None:
    """The object, or None when it does not exist."""
    try:
        return _request("GET", resource.path(namespace, name))
    except KubeError as e:
        if e.status == 404:
            return None
        raise


# (namespace, name) -> the Secret or ConfigMap, or None when there is none: how the checks of what a
# HybridModel names read them (tests hand in their own).
ObjectGetter = Callable[[str, str], "dict | None"]


def get_secret(namespace: str, name: str) -> dict | None:
    return get(SECRETS, namespace, name)


def get_config_map(namespace: str, name: str) -> dict | None:
    return get(CONFIGMAPS, namespace, name)


def create(resource: Resource, namespace: str, body: dict) -> dict:
    """Create `body`; a KubeError with status 409 when it already exists."""
    return _request("POST", resource.path(namespace), body)


def patch(resource: Resource, namespace: str, name: str, body: dict, subresource: str | None = None) -> dict:
    """JSON merge patch (RFC 7386): dicts merge, lists and scalars replace, None deletes."""
    path = resource.path(namespace, name, subresource)
    return _request("PATCH", path, body, content_type="application/merge-patch+json")


def delete(resource: Resource, namespace: str, name: str) -> bool:
    """Delete the object with foreground propagation; False when it was already gone."""
    try:
        _request("DELETE", resource.path(namespace, name), {"propagationPolicy": "Foreground"})
        return True
    except KubeError as e:
        if e.status == 404:
            return False
        raise


def list_labelled(resource: Resource, namespace: str, labels: dict[str, str]) -> list[dict]:
    """Objects in `namespace` carrying all of `labels`.

    The labels also go to the server as a selector; the result is filtered again here because
    not every server (test servers included) honours the selector.
    """
    selector = ",".join(f"{key}={value}" for key, value in labels.items())
    reply = _request("GET", f"{resource.path(namespace)}?labelSelector={quote(selector, safe='')}")
    items = reply.get("items") or []
    return [item for item in items
            if all(((item.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in labels.items())]


def _request(method: str, path: str, body: Any = None, content_type: str = "application/json") -> dict:
    headers = {"Accept": "application/json", "Content-Type": content_type}
    with kubernetes.client.ApiClient() as api:
        method, url, headers, body, _ = api.param_serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"])
        response = api.call_api(method, url, header_params=headers, body=body,
                                _request_timeout=REQUEST_TIMEOUT_SECONDS)
        data = response.read()
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else (data or "")
    if response.status >= 400:
        raise KubeError(response.status, method, path, _message(text))
    return json.loads(text) if text else {}


def _message(text: str) -> str:
    try:
        return json.loads(text).get("message") or text
    except (ValueError, AttributeError):
        return text
