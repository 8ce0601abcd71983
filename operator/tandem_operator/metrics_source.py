"""Where the autoscaler reads decode latency: each Ready pod's /metrics, or a Prometheus server.

Both give the increase of the `tandem_inter_token_latency_seconds` histogram over the window,
summed over the model's pods; the p95 is computed from that by `histogram.quantile`.
"""

from __future__ import annotations

import http
import json
import math
import re
import ssl
import string
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from tandem import contract

from . import names
from .histogram import Histogram, HistogramError, increase, merge, parse_histograms

if TYPE_CHECKING:
    from .prometheus_access import Access

SCRAPE_TIMEOUT_SECONDS = 5
# OpenSSL's names for the alerts a server sends when it wants a client certificate it did not get
# or does not accept (mutual TLS).
_CLIENT_CERTIFICATE_ALERTS = frozenset({"TLSV13_ALERT_CERTIFICATE_REQUIRED", "SSLV3_ALERT_BAD_CERTIFICATE",
                                        "TLSV1_ALERT_UNKNOWN_CA", "SSLV3_ALERT_CERTIFICATE_UNKNOWN"})

# Pod IPs and in-cluster Prometheus are never reached through an HTTP proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# The series label that names the HybridModel: the ServiceMonitor's targetLabels and the usual
# `kubernetes-pods` job's labelmap both copy the pods' names.MODEL_LABEL, with what Prometheus
# does not allow in a label name turned into "_". A pod-name pattern would also match the pods
# of any model whose name starts with this one's and a dash.
MODEL_SERIES_LABEL = re.sub(r"[^a-zA-Z0-9_]", "_", names.MODEL_LABEL)
DEFAULT_PROMETHEUS_QUERY = (
    'sum by (le) (increase(' + contract.INTER_TOKEN_LATENCY + '_bucket'
    '{namespace="$namespace", ' + MODEL_SERIES_LABEL + '="$name"}[${window}s]))'
)


class MetricsError(Exception):
    """Latency could not be read; the message says from where and why."""


@dataclass(frozen=True)
class Reading:
    """What was observed over the window: bucket increases, a p95 in seconds, or None."""

    observed: Histogram | float | None
    # Whether `observed` spans the whole window, so that no observations in it mean no traffic
    # (idle) rather than too short a look.
    covers_window: bool = False
    skipped: tuple[str, ...] = ()  # why each Ready pod that could not be read was left out


# Pods

def ready_pods(pods: list[dict]) -> list[dict]:
    """Running pods whose Ready condition is True and that have an IP, not being deleted."""
    ready = []
    for pod in pods:
        status = pod.get("status") or {}
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        if conditions.get("Ready") == "True" and status.get("podIP") \
                and not (pod.get("metadata") or {}).get("deletionTimestamp"):
            ready.append(pod)
    return ready


def metrics_url(pod: dict) -> str:
    """http://{podIP}:{port}/metrics, with the port the attention container names `metrics`."""
    port = contract.METRICS_PORT
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == names.ATTENTION:
            for p in container.get("ports") or []:
                if p.get("name") == "metrics":
                    port = p["containerPort"]
    host = pod["status"]["podIP"]
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/metrics"


def scrape_pod(pod: dict, timeout: float = SCRAPE_TIMEOUT_SECONDS) -> Histogram:
    """The pod's inter-token latency histogram (all its series summed)."""
    url = metrics_url(pod)
    text = _http_get(url, timeout)
    try:
        return merge(parse_histograms(text, contract.INTER_TOKEN_LATENCY).values())
    except HistogramError as e:
        raise MetricsError(f"{url}: {e}") from None


@dataclass
class PodWindow:
    """Per-pod scrapes over time, so the increase over a window survives pods coming and going."""

    scrapes: list[tuple[float, dict[str, Histogram]]] = field(default_factory=list)

    def record(self, now: float, by_pod: dict[str, Histogram], window: float, unread: Iterable[str] = ()) -> None:
        """Add one round of scrapes and forget those no longer needed for `window`.

        A pod in `unread` (Ready, but its scrape failed) keeps its last histogram: once read again,
        its counts are then not taken for new, as those of a pod that started in the window are.
        """
        last = self.scrapes[-1][1] if self.scrapes else {}
        self.scrapes.append((now, {**{pod: last[pod] for pod in unread if pod in last}, **by_pod}))
        # Keep the newest scrape at or before the window's start: it is the baseline.
        while len(self.scrapes) > 1 and self.scrapes[1][0] <= now - window:
            self.scrapes.pop(0)

    def increase(self) -> Histogram | None:
        """Observed over the window (None until there are two rounds of scrapes).

        A pod absent from the baseline started within the window, so all its counts are new.
        """
        if len(self.scrapes) < 2:
            return None
        _, baseline = self.scrapes[0]
        _, latest = self.scrapes[-1]
        return merge(increase(hist, baseline.get(pod)) for pod, hist in latest.items())

    def covers(self, now: float, window: float) -> bool:
        """Whether the baseline is at least `window` old: the increase spans the whole window."""
        return len(self.scrapes) > 1 and self.scrapes[0][0] <= now - window


def read_pods(pods: list[dict], window: PodWindow, now: float, window_seconds: float) -> Reading:
    """Scrape every Ready pod, record it, and return the increase over the window.

    As the HPA does with pods missing metrics, a pod that cannot be read is left out (and named
    in `skipped`); only when no Ready pod can be read is that an error.
    """
    ready = ready_pods(pods)
    if not ready:
        raise MetricsError("no Ready pods to read metrics from")
    by_pod, failed = {}, {}
    for pod in ready:
        key = (pod.get("metadata") or {}).get("uid") or pod["metadata"]["name"]
        try:
            by_pod[key] = scrape_pod(pod)
        except MetricsError as e:
            failed[key] = str(e)
    if not by_pod:
        raise MetricsError("; ".join(failed.values()))
    window.record(now, by_pod, window_seconds, unread=failed)
    return Reading(window.increase(), window.covers(now, window_seconds), tuple(failed.values()))


# Prometheus

def prometheus_query(template: str | None, namespace: str, name: str, window_seconds: int) -> str:
    """The PromQL to run, with $namespace, $name and $window substituted."""
    return string.Template(template or DEFAULT_PROMETHEUS_QUERY).safe_substitute(
        namespace=namespace, name=name, window=str(window_seconds))


def read_prometheus(url: str, query: str, timeout: float = SCRAPE_TIMEOUT_SECONDS,
                    access: Access | None = None) -> Histogram | float | None:
    """Run an instant query: bucket increases (a vector with `le`) or a p95 in seconds (one sample).

    None when the query matches nothing (no traffic, or no scrapes yet) or answers NaN or ±Inf
    (histogram_quantile over no observations): no samples, not a latency. `access` gives the TLS
    context and the headers (credentials included) to query with.
    """
    endpoint = f"{url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    try:
        reply = json.loads(_http_get(endpoint, timeout, access))
    except ValueError:
        raise MetricsError(f"{url}: the answer is not JSON") from None
    if reply.get("status") != "success":
        raise MetricsError(f"{url}: query failed: {reply.get('error') or reply}")
    data = reply.get("data") or {}
    if data.get("resultType") == "scalar":
        return _finite(_sample_value(data.get("result"), url))
    result = data.get("result") or []
    if data.get("resultType") != "vector":
        raise MetricsError(f"{url}: expected an instant vector, got {data.get('resultType')}")
    if not result:
        return None
    if all("le" in (r.get("metric") or {}) for r in result):
        # Several series per bucket (a query without `sum by (le)`: one per pod) are summed, as the
        # pods source sums its pods; keeping one of them would scale from one pod's latency.
        buckets: Histogram = {}
        for r in result:
            le = float(r["metric"]["le"])
            buckets[le] = buckets.get(le, 0.0) + _sample_value(r.get("value"), url)
        return dict(sorted(buckets.items())) if all(map(math.isfinite, buckets.values())) else None
    if len(result) == 1:
        return _finite(_sample_value(result[0].get("value"), url))
    raise MetricsError(f"{url}: the query returned {len(result)} series; expected buckets with `le` or one value")


def _sample_value(value: object, url: str) -> float:
    try:
        return float(value[1])  # type: ignore[index]
    except (TypeError, ValueError, IndexError):
        raise MetricsError(f"{url}: malformed sample {value!r}") from None


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _http_get(url: str, timeout: float, access: Access | None = None) -> str:
    request = urllib.request.Request(url, headers=dict(access.headers) if access else {})
    try:
        with _opener(access).open(request, timeout=timeout) as response:
            return response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        raise MetricsError(f"{url}: HTTP {e.code}{_refused(e.code, access)}") from None
    except urllib.error.URLError as e:
        raise MetricsError(f"{url}: {_failure(e.reason)}") from None
    except OSError as e:  # an ssl.SSLError too (its `reason` is OpenSSL's name): after TLS 1.3's handshake, a
        # server refusing the client's certificate says so at the first read, not in urlopen's connect
        raise MetricsError(f"{url}: {_failure(e)}") from None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    # urllib would send the Authorization header on to wherever a redirect points.
    def redirect_request(self, *args, **kwargs):
        return None


def _opener(access: Access | None) -> urllib.request.OpenerDirector:
    if access is None:
        return _OPENER
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if access.context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=access.context))
    if "Authorization" in access.headers:
        handlers.append(_NoRedirect())
    return urllib.request.build_opener(*handlers)


def _refused(code: int, access: Access | None) -> str:
    """Why a Prometheus answered `code`, where the spec can say: credentials refused, a redirect not followed."""
    try:
        phrase = f" {http.HTTPStatus(code).phrase}"
    except ValueError:
        phrase = ""
    if access is None:  # a pod's /metrics, or a query made without the spec's access
        return phrase
    source = access.credentials
    if code == 401:
        return phrase + (f": the server refused the credentials of metrics.prometheus.{source}" if source
                         else ": the server asks for credentials (metrics.prometheus.auth)")
    if code == 403:
        return phrase + (f": the credentials of metrics.prometheus.{source} may not run the query" if source
                         else ": the server asks for credentials (metrics.prometheus.auth)")
    if 300 <= code < 400 and "Authorization" in access.headers:
        return phrase + ": redirects are not followed with credentials; point metrics.prometheus.url at the API"
    return phrase


def _failure(reason: object) -> str:
    if isinstance(reason, ssl.SSLCertVerificationError):
        return (f"TLS: the server's certificate failed verification: {reason.verify_message} "
                "(metrics.prometheus.tls: caSecret or caConfigMap, serverName)")
    if isinstance(reason, ssl.SSLError) and reason.reason in _CLIENT_CERTIFICATE_ALERTS:
        return f"TLS: the server refused the client's certificate or wants one (metrics.prometheus.tls.certSecret): " \
               f"{reason}"
    if isinstance(reason, ssl.SSLError):
        return f"TLS: {reason}"
    return str(reason)
