"""The experts process's data plane server: Forward frames (`tandem.rpc.expert_wire`) over a
Unix socket, one blocking thread per connection, answered by the same checked, serialised
`ExpertsServicer.forward` the gRPC method uses. Each connection waits for its next frame spinning
for up to `spin_us` before sleeping (see `tandem.rpc.expert_wire`). With the native executor,
decode frames are answered in native code (`ExpertsServicer.native_server`) and the rest here."""

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


class DataPlaneServer:
    """Listens on `path` until `close()`; `forward(layer, hidden, ids, weights)` answers frames."""

    def __init__(self, path: str, servicer, spin_us: int = 0):
        self.path = path
        self.servicer = servicer
        self.spin_us = spin_us
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
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="experts-data", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                native = self.servicer.native_server if wire.use_native else None
                try:
                    if native is None:
                        layer, hidden, ids, weights = wire.recv_request(conn, self.spin_us)
                    else:
                        status, seconds, *rest = wire.serve_native(native, conn, self.spin_us)
                        for s in seconds:
                            self.servicer.metrics.expert_call_latency.observe(s)
                        if status == wire.SERVED:
                            continue
                        if status == wire.SERVED_FAILING:
                            log.error("native expert forward failed: %s", rest[0])
                            continue
                        layer, hidden, ids, weights = rest
                except (ConnectionError, OSError):
                    return  # the client went away
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
        except wire.WireError as exc:
            log.warning("closing an experts data connection: %s", exc)
        except OSError:
            pass  # the client went away mid-response
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

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
