"""A real `tandem serve` for the operator tests: its metrics endpoint, and load to give it samples.

Starting, health-waiting and driving the server reuse the services tests' helpers
(tests/services/svc_helpers.py), loaded by path because tests/services is not on sys.path when
only the operator or e2e tests are collected.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tandem import contract

_HELPERS = Path(__file__).resolve().parents[1] / "services" / "svc_helpers.py"


def _svc_helpers():
    if "svc_helpers" not in sys.modules:
        if not _HELPERS.is_file():
            raise RuntimeError(f"{_HELPERS} is missing: the operator tests start `tandem serve` with its helpers")
        spec = importlib.util.spec_from_file_location("svc_helpers", _HELPERS)
        module = importlib.util.module_from_spec(spec)
        sys.modules["svc_helpers"] = module
        spec.loader.exec_module(module)
    return sys.modules["svc_helpers"]


svc = _svc_helpers()


@contextmanager
def tandem_serve(tmp_dir: Path) -> Iterator["svc.ServeProcess"]:
    """A SERVING `tandem serve` subprocess on loopback (free gRPC and metrics ports) over a demo Mixtral."""
    from tandem.demo import make_demo_model

    model = make_demo_model(tmp_dir, arch="mixtral", seed=0)
    server = svc.ServeProcess("--model", str(model), "--listen", "127.0.0.1:0", "--metrics-port", "0",
                              "--device", "cpu", *svc.SMALL_ENGINE)
    try:
        assert server.metrics_port, f"tandem serve reported no metrics port:\n{server.log()}"
        asyncio.run(svc.wait_health(server.address, svc.SERVING))
        yield server
    finally:
        server.kill()


async def drive_load(address: str, requests: int = 4, max_tokens: int = 16) -> int:
    """Concurrent greedy generations; returns the number of tokens generated (each step is observed)."""
    replies = await asyncio.gather(*(
        svc.generate(address, svc.greedy([1 + i, 2, 3], max_tokens=max_tokens)) for i in range(requests)))
    return sum(len(svc.token_ids(r)) for r in replies)


def scrape(metrics_port: int) -> str:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        return response.read().decode()


def observed_bucket_range_ms(metrics_text: str) -> tuple[float, float, int]:
    """From the server's own exposition: (lower bound of the first bucket with observations, upper bound
    of the last one, in ms; the observation count) of the inter-token latency histogram.

    The operator's p95 must lie in that range; it is a check on what it read, not its arithmetic.
    """
    from prometheus_client.parser import text_string_to_metric_families

    cumulative: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != contract.INTER_TOKEN_LATENCY:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                cumulative[le] = cumulative.get(le, 0.0) + sample.value
    bounds = sorted(cumulative)
    total = cumulative.get(float("inf"), 0.0)
    lower = upper = None
    previous_le, previous_count = 0.0, 0.0
    for le in bounds:
        if cumulative[le] > previous_count:
            lower = previous_le if lower is None else lower
            upper = le
        previous_le, previous_count = le, cumulative[le]
    if lower is None:
        return 0.0, 0.0, 0
    return lower * 1000.0, upper * 1000.0, int(total)
