"""The experts process's data plane server: Forward frames (`tandem.rpc.expert_wire`) over a
Unix socket, one blocking thread per connection, answered by the same checked, serialised
`ExpertsServicer.forward` the gRPC method uses. Each connection waits for its next frame spinning
for up to `spin_us` before sleeping (see `tandem.rpc.expert_wire`). With the native executor,
decode frames are answered in native code (`ExpertsServicer.native_server`) and the rest here.

A connection may idle between frames for as long as its client likes (an attention process with
no requests), but a peer that stalls for `frame_timeout_s` in the middle of a frame, or stops
reading its answers, is dropped; and at most `max_connections` are served at once (a replica's
attention process holds one), so a misbehaving local peer cannot pin threads and frame buffers
without bound."""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

from tandem.rpc import expert_wire as wire
from tandem.rpc.addresses import prepare_unix_socket
from tandem.rpc.experts_server import NotLoaded
from tandem.rpc.tensors import BadTensor

log = logging.getLogger(__name__)

FRAME_TIMEOUT_S = 30.0  # the longest a started frame's next bytes, or an answer's send, may wait
MAX_CONNECTIONS = 16


class DataPlaneServer:
    """Listens on `path` until `close()`; `forward(layer, hidden, ids, weights)` answers frames."""

    def __init__(self, path: str, servicer, spin_us: int = 0, frame_timeout_s: float = FRAME_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS):
        self.path = path
        self.servicer = servicer
        self.spin_us = spin_us
        self.frame_timeout_s = frame_timeout_s
        self.max_connections = max_connections
        prepare_unix_socket(f"unix:{path}")  # a stale socket from a crashed process goes
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)  # in the pod's socket emptyDir, next to the gRPC socket
        self._listener.listen(16)
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="experts-data-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            if self._admit(conn):
                conn.settimeout(self.frame_timeout_s)  # the reads of a started frame, and the sends
                threading.Thread(target=self._serve, args=(conn,), name="experts-data", daemon=True).start()
            elif self._closed:
                return

    def _admit(self, conn: socket.socket) -> bool:
        """Whether `conn` is served: not once closed, nor beyond `max_connections` (closed at once)."""
        with self._lock:
            admitted = not self._closed and len(self._connections) < self.max_connections
            if admitted:
                self._connections.add(conn)
        if not admitted:
            if not self._closed:
                log.warning("refusing an experts data connection: %d are open already", self.max_connections)
            conn.close()
        return admitted

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                request = self._next_request(conn)
                if request is not None:
                    self._answer(conn, *request)
        except wire.WireError as exc:
            log.warning("closing an experts data connection: %s", exc)
        except TimeoutError:
            log.warning("closing an experts data connection stalled for %gs mid-frame or mid-answer",
                        self.frame_timeout_s)
        except OSError:
            pass  # the client went away
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _next_request(self, conn: socket.socket) -> tuple | None:
        """The next frame for the Python path, or None when the native end answered frames itself."""
        native = self.servicer.native_server if wire.use_native else None
        if native is None:
            return wire.recv_request(conn, self.spin_us)
        status, frames, *rest = wire.serve_native(native, conn, self.spin_us)
        for seconds, tokens in frames:
            self.servicer.metrics.forward_latency.observe(seconds)
            self.servicer.metrics.forward_tokens.inc(tokens)
        if status == wire.SERVED_FAILING:
            log.error("native expert forward failed: %s", rest[0])
        return tuple(rest) if status == wire.FOR_PYTHON else None

    def _answer(self, conn: socket.socket, layer, hidden, ids, weights) -> None:
        """The checked forward's output, or its error; the connection stays in step either way."""
        try:
            out = self.servicer.forward(layer, hidden, ids, weights)
        except BadTensor as exc:
            wire.send_response(conn, wire.INVALID_ARGUMENT, str(exc))
        except NotLoaded as exc:
            wire.send_response(conn, wire.UNAVAILABLE, str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, the connection stays usable
            log.exception("expert forward failed")
            wire.send_response(conn, wire.INTERNAL, f"{type(exc).__name__}: {exc}")
        else:
            wire.send_response(conn, wire.OK, out)

    def num_connections(self) -> int:
        """Peers connected now (an attention process holds one while it runs)."""
        with self._lock:
            return len(self._connections)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        self._listener.close()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        Path(self.path).unlink(missing_ok=True)
