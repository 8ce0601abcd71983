"""A stand-in for a pod's /metrics and for Prometheus's query API, answering what a test sets."""

from __future__ import annotations

import http.server
import json
import threading
from contextlib import contextmanager
from typing import Iterator

from tandem import contract

NAME = contract.INTER_TOKEN_LATENCY


def exposition(buckets: dict[float, float]) -> str:
    """The inter-token latency histogram in Prometheus's text format, from cumulative bucket counts."""
    lines = [f"# TYPE {NAME} histogram"]
    lines += [f'{NAME}_bucket{{le="{le}"}} {count}' for le, count in sorted(buckets.items())]
    total = max(buckets.values(), default=0.0)
    lines += [f'{NAME}_bucket{{le="+Inf"}} {total}', f"{NAME}_count {total}", f"{NAME}_sum 0.0", ""]
    return "\n".join(lines)


def vector(*samples: tuple[dict, str]) -> dict:
    """A Prometheus instant-query answer: (labels, value) samples."""
    return {"status": "success", "data": {"resultType": "vector",
                                          "result": [{"metric": m, "value": [0, v]} for m, v in samples]}}


class FakeServer:
    """`.metrics` is served at /metrics, `.answer` (JSON) at /api/v1/query; `.queries` logs the PromQL asked."""

    def __init__(self):
        self.metrics = exposition({0.05: 0.0})
        self.answer: dict = vector()
        self.queries: list[str] = []
        self.port = 0


@contextmanager
def fake_server() -> Iterator[FakeServer]:
    state = FakeServer()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            from urllib.parse import parse_qs, urlparse
            url = urlparse(self.path)
            if url.path == "/metrics":
                body = state.metrics.encode()
            else:
                state.queries.extend(parse_qs(url.query).get("query", []))
                body = json.dumps(state.answer).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.port = server.server_address[1]
    # A short poll interval: shutdown() waits for one.
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
