"""The experts data plane: `Experts.Forward` as raw frames over a Unix socket, for the hot path.

An attention process calls the experts once per MoE layer per step (58 times a token for
DeepSeek-V3), so the call's own cost is paid that often. A gRPC unary call through grpc.aio
costs about a millisecond on a small CPU; a blocking Unix-socket round trip tens of
microseconds. Both processes of a replica share a pod (and /run/tandem), so next to its gRPC
socket the experts process listens on `<socket>.data` and advertises it in
`ExpertsInfo.data_socket`. The gRPC service stays the contract (health, reflection, checks,
CpuAttention); this carries only Forward's tensors, with the same validation and errors.

Frames, little-endian:
- request: header `REQUEST` (magic, dtype code, layer, tokens, hidden, top_k), then
  hidden [T, H] in that dtype, topk_ids [T, k] int64, topk_weights [T, k] float32; a header
  claiming more than MAX_FRAME_TOKENS tokens or MAX_FRAME_BYTES bytes closes the connection;
- response: header `RESPONSE` (magic, status, payload bytes), then the output [T, H] in the
  request's dtype (status OK) or a UTF-8 message (INVALID_ARGUMENT, UNAVAILABLE, INTERNAL).

The native extension reads and writes the frames when it is loaded (`experts/csrc/data_plane.cpp`:
no GIL, no copies through Python bytes), and can wait for the peer spinning (`spin_us`) instead of
sleeping, for processes on cores of their own. The functions here are the reference it is tested
against, and serve where the extension is not built.
"""

from __future__ import annotations

import math
import select
import socket
import struct

import torch

from tandem.experts import native
from tandem.rpc.experts_server import MAX_FORWARD_TOKENS, check_forward_tensors
from tandem.rpc.tensors import BadTensor, tensor_bytes, tensor_from_bytes

REQUEST = struct.Struct("<4sIIIII")  # magic, dtype code, layer, tokens, hidden size, top_k
RESPONSE = struct.Struct("<4sII")  # magic, status, payload bytes
REQUEST_MAGIC, RESPONSE_MAGIC = b"TXF1", b"TXR1"
OK, INVALID_ARGUMENT, UNAVAILABLE, INTERNAL = 0, 1, 2, 3
STATUS_NAMES = {OK: "OK", INVALID_ARGUMENT: "INVALID_ARGUMENT", UNAVAILABLE: "UNAVAILABLE", INTERNAL: "INTERNAL"}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
MAX_FRAME_BYTES = 1 << 30  # as the gRPC message limit
MAX_FRAME_TOKENS = MAX_FORWARD_TOKENS  # a frame claiming more is refused from its header


use_native = True  # tests turn it off to check the reference functions


class WireError(RuntimeError):
    """A frame that does not parse: the connection is out of step and must be closed."""


def native_wire():
    """The extension's `wire` module, or None (not built, or `use_native` turned off)."""
    if not use_native:
        return None
    kernel = native.load_kernel()
    return None if kernel is None else kernel.wire


def timeout_ms(sock: socket.socket) -> int:
    """The socket's timeout as the native functions take it: milliseconds, -1 for none."""
    timeout = sock.gettimeout()
    return -1 if timeout is None else math.ceil(timeout * 1000)


def _call_native(fn, *args):
    try:
        return fn(*args)
    except native.load_kernel().wire.BadFrame as exc:
        raise WireError(str(exc)) from None


def data_socket_path(listen: str) -> str | None:
    """Where the experts process listening on `listen` serves the data plane; None unless it
    listens on a Unix socket path (a TCP peer may be on another host)."""
    if not listen.startswith("unix:") or listen.startswith("unix-abstract:"):
        return None
    return listen[len("unix:"):].removeprefix("//") + ".data"


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly n bytes; ConnectionError when the peer closes first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k
    return buf


def send_request(sock: socket.socket, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> None:
    """Raises BadTensor, sending nothing, for tensors whose shapes the header cannot describe."""
    check_forward_tensors(hidden, topk_ids, topk_weights)
    if hidden.dtype not in DTYPE_CODES:
        raise BadTensor("hidden", f"must be float32, bfloat16 or float16, got {hidden.dtype}")
    ids, weights = topk_ids.to(torch.int64).contiguous(), topk_weights.to(torch.float32).contiguous()
    if (w := native_wire()) is not None:
        w.send_request(sock.fileno(), layer, hidden.contiguous(), ids, weights, timeout_ms(sock))
        return
    tokens, size = hidden.shape
    header = REQUEST.pack(REQUEST_MAGIC, DTYPE_CODES[hidden.dtype], layer, tokens, size, topk_ids.shape[1])
    sock.sendall(header + tensor_bytes(hidden) + tensor_bytes(ids) + tensor_bytes(weights))


def recv_request(sock: socket.socket, spin_us: int = 0) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(layer, hidden [T, H], topk_ids [T, k] int64, topk_weights [T, k] float32). It waits for
    the frame to start for as long as it takes (a server's connection idles between steps; the
    native reader polls for up to `spin_us` before sleeping); the rest must come within the
    socket's timeout of each read, or TimeoutError (a peer stalled mid-frame)."""
    if (w := native_wire()) is not None:
        return _call_native(w.recv_request, sock.fileno(), spin_us, timeout_ms(sock))
    wait_readable(sock)
    magic, code, layer, tokens, size, top_k = REQUEST.unpack(recv_exact(sock, REQUEST.size))
    if magic != REQUEST_MAGIC or code not in DTYPES:
        raise WireError(f"not an expert-forward frame (magic {magic!r}, dtype code {code})")
    if tokens > MAX_FRAME_TOKENS:
        raise WireError(f"a frame of {tokens} tokens, more than {MAX_FRAME_TOKENS}")
    dtype = DTYPES[code]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if tokens * (size * itemsize + top_k * 12) > MAX_FRAME_BYTES:
        raise WireError(f"a frame of {tokens} tokens x {size} is larger than {MAX_FRAME_BYTES} bytes")
    hidden = tensor_from_bytes(recv_exact(sock, tokens * size * itemsize), dtype, (tokens, size))
    ids = tensor_from_bytes(recv_exact(sock, tokens * top_k * 8), torch.int64, (tokens, top_k))
    weights = tensor_from_bytes(recv_exact(sock, tokens * top_k * 4), torch.float32, (tokens, top_k))
    return layer, hidden, ids, weights


def wait_readable(sock: socket.socket) -> None:
    """Returns once `sock` has data or its end of stream to read, however long that takes."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poller.poll()  # no timeout: until POLLIN, POLLHUP or POLLERR


SERVED, SERVED_FAILING, FOR_PYTHON = 1, 2, 0  # what `serve_native` did with a frame


FLUSH_S = 0.05  # the longest `serve_native` answers frames before returning the seconds it has


def serve_native(server, sock: socket.socket, spin_us: int = 0) -> tuple:
    """Answers frames in the native `ExpertServer` while they are decode frames it holds the
    layers of and come back to back (within `spin_us` of each answer, for up to FLUSH_S). Returns
    (SERVED, frames), (SERVED_FAILING, frames, message) when the kernel failed and INTERNAL was
    answered, or (FOR_PYTHON, frames, layer, hidden, ids, weights) for a frame it leaves to the
    checked Python path; `frames` lists (compute seconds, tokens) of each frame it answered."""
    return _call_native(server.serve, sock.fileno(), spin_us, timeout_ms(sock), FLUSH_S)


def send_response(sock: socket.socket, status: int, payload: torch.Tensor | str) -> None:
    if (w := native_wire()) is not None:
        if isinstance(payload, str):
            w.send_response(sock.fileno(), status, torch.empty(0), payload, timeout_ms(sock))
        else:
            w.send_response(sock.fileno(), status, payload.contiguous(), "", timeout_ms(sock))
        return
    data = payload.encode() if isinstance(payload, str) else tensor_bytes(payload)
    sock.sendall(RESPONSE.pack(RESPONSE_MAGIC, status, len(data)) + data)


def recv_response(sock: socket.socket, dtype: torch.dtype, shape: tuple[int, int],
                  spin_us: int = 0) -> tuple[int, torch.Tensor | str]:
    """(OK, output tensor) or (error status, message). The native reader polls for up to
    `spin_us` before sleeping until the response comes."""
    if (w := native_wire()) is not None:
        return tuple(_call_native(w.recv_response, sock.fileno(), DTYPE_CODES[dtype], shape[0], shape[1], spin_us,
                                  timeout_ms(sock)))
    magic, status, length = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
    if magic != RESPONSE_MAGIC or length > MAX_FRAME_BYTES:
        raise WireError(f"not an expert-forward response (magic {magic!r})")
    data = recv_exact(sock, length)
    if status != OK:
        return status, data.decode(errors="replace")
    expected = shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
    if length != expected:
        raise WireError(f"response of {length} bytes, expected {expected} for {list(shape)} {dtype}")
    return OK, tensor_from_bytes(data, dtype, shape)
