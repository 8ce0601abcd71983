"""Server addresses as `tandem serve` takes them: `host:port`, `[v6]:port` or `unix:/path`."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path


def check_address(address: str, flag: str = "--listen") -> str:
    """Returns `address` unchanged if it is well formed; raises ValueError naming `flag` if not."""
    if address.startswith("unix:"):
        path = address[len("unix:"):]
        if not path:
            raise ValueError(f"{flag}: unix: needs a socket path, e.g. unix:/run/tandem/experts.sock")
        return address
    if address.startswith("unix-abstract:"):
        return address
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{flag}: expected host:port or unix:/path, got {address!r}")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{flag}: port must be a number in 0..65535, got {port!r} in {address!r}")
    return address


def with_bound_port(address: str, port: int) -> str:
    """`address` with port 0 replaced by the port the server actually bound."""
    if address.startswith("unix"):
        return address
    host, _, _ = address.rpartition(":")
    return f"{host}:{port}"


def prepare_unix_socket(address: str) -> None:
    """Creates the socket's directory and removes a stale socket file a crashed server left.

    A socket someone still accepts on is left alone: binding then fails with a clear error.
    """
    if not address.startswith("unix:"):
        return
    path = Path(address[len("unix:"):].removeprefix("//"))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"{address}: {path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink(missing_ok=True)
            return
    raise ValueError(f"{address}: another server is listening on {path}")
