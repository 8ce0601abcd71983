"""A stand-in for a pod's /metrics and for Prometheus's query API, answering what a test sets;
over TLS and behind a bearer token or basic auth, as a Prometheus behind a proxy is."""

from __future__ import annotations

import http.server
import json
import ssl
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
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
    """`.metrics` is served at /metrics, `.answer` (JSON) at /api/v1/query; `.queries` logs the PromQL asked.

    With `.authorization` set, a request without that Authorization header is answered 401; with
    `.redirect` set, every request is redirected there. `.headers` logs each request's headers, and
    `.peer_certificates` the common name of each client certificate presented (mutual TLS).
    """

    def __init__(self):
        self.metrics = exposition({0.05: 0.0})
        self.answer: dict = vector()
        self.queries: list[str] = []
        self.headers: list[dict[str, str]] = []
        self.peer_certificates: list[str] = []
        self.authorization: str | None = None
        self.redirect: str | None = None
        self.port = 0


@contextmanager
def fake_server(tls: tuple[str, str] | None = None, client_ca: str | None = None) -> Iterator[FakeServer]:
    """A server on 127.0.0.1; over HTTPS with `tls`, a (certificate, key) pair in PEM; with `client_ca`
    (PEM), only for clients presenting a certificate it issued."""
    state = FakeServer()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            from urllib.parse import parse_qs, urlparse
            url = urlparse(self.path)
            state.headers.append(dict(self.headers))
            if client_ca is not None:
                subject = dict(field for rdn in self.connection.getpeercert()["subject"] for field in rdn)
                state.peer_certificates.append(subject["commonName"])
            if state.redirect:
                self.send_response(302)
                self.send_header("Location", state.redirect)
                self.end_headers()
                return
            if state.authorization is not None and self.headers.get("Authorization") != state.authorization:
                self.send_response(401)
                self.end_headers()
                return
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
    server.handle_error = lambda *_: None  # a client refusing the certificate is what some tests want
    if tls is not None:
        context = _server_context(*tls)
        if client_ca is not None:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cadata=client_ca)
        server.socket = context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    state.port = server.server_address[1]
    # A short poll interval: shutdown() waits for one.
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def _server_context(cert_pem: str, key_pem: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as directory:
        cert, key = Path(directory) / "tls.crt", Path(directory) / "tls.key"
        cert.write_text(cert_pem)
        key.write_text(key_pem)
        context.load_cert_chain(cert, key)
    return context
