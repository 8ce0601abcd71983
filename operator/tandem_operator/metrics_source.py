"""Where the autoscaler reads decode latency: each Ready pod's /metrics, or a Prometheus server.

Both give the increase of the `tandem_inter_token_latency_seconds` histogram over the window,
summed over the model's pods; the p95 is computed from that by `histogram.quantile`.
"""

from __future__ import annotations

import json
import string
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from tandem import contract

from . import names
from .histogram import Histogram, HistogramError, increase, merge, parse_histograms

SCRAPE_TIMEOUT_SECONDS = 5

# Pod IPs and in-cluster Prometheus are never reached through an HTTP proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

DEFAULT_PROMETHEUS_QUERY = (
    'sum by (le) (increase(' + contract.INTER_TOKEN_LATENCY + '_bucket'
    '{namespace="$namespace", pod=~"$name-.*"}[${window}s]))'
)


class MetricsError(Exception):
    """Latency could not be read; the message says from where and why."""


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

    def record(self, now: float, by_pod: dict[str, Histogram], window: float) -> None:
        """Add one round of scrapes and forget those no longer needed for `window`."""
        self.scrapes.append((now, by_pod))
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


def read_pods(pods: list[dict], window: PodWindow, now: float, window_seconds: float) -> Histogram | None:
    """Scrape every Ready pod, record it, and return the increase over the window."""
    ready = ready_pods(pods)
    if not ready:
        raise MetricsError("no Ready pods to read metrics from")
    by_pod = {(p.get("metadata") or {}).get("uid") or p["metadata"]["name"]: scrape_pod(p) for p in ready}
    window.record(now, by_pod, window_seconds)
    return window.increase()


# Prometheus

def prometheus_query(template: str | None, namespace: str, name: str, window_seconds: int) -> str:
    """The PromQL to run, with $namespace, $name and $window substituted."""
    return string.Template(template or DEFAULT_PROMETHEUS_QUERY).safe_substitute(
        namespace=namespace, name=name, window=str(window_seconds))


def read_prometheus(url: str, query: str, timeout: float = SCRAPE_TIMEOUT_SECONDS) -> Histogram | float | None:
    """Run an instant query: bucket increases (a vector with `le`) or a p95 in seconds (one sample).

    None when the query matches nothing (no traffic, or no scrapes yet).
    """
    endpoint = f"{url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    try:
        reply = json.loads(_http_get(endpoint, timeout))
    except ValueError:
        raise MetricsError(f"{url}: the answer is not JSON") from None
    if reply.get("status") != "success":
        raise MetricsError(f"{url}: query failed: {reply.get('error') or reply}")
    data = reply.get("data") or {}
    if data.get("resultType") == "scalar":
        return _sample_value(data.get("result"), url)
    result = data.get("result") or []
    if data.get("resultType") != "vector":
        raise MetricsError(f"{url}: expected an instant vector, got {data.get('resultType')}")
    if not result:
        return None
    if all("le" in (r.get("metric") or {}) for r in result):
        buckets = {float(r["metric"]["le"]): _sample_value(r.get("value"), url) for r in result}
        return dict(sorted(buckets.items()))
    if len(result) == 1:
        return _sample_value(result[0].get("value"), url)
    raise MetricsError(f"{url}: the query returned {len(result)} series; expected buckets with `le` or one value")


def _sample_value(value: object, url: str) -> float:
    try:
        return float(value[1])  # type: ignore[index]
    except (TypeError, ValueError, IndexError):
        raise MetricsError(f"{url}: malformed sample {value!r}") from None


def _http_get(url: str, timeout: float) -> str:
    try:
        with _OPENER.open(url, timeout=timeout) as response:
            return response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        raise MetricsError(f"{url}: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        raise MetricsError(f"{url}: {getattr(e, 'reason', e)}") from None
