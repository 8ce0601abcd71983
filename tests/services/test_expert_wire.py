"""The data plane's frames: the native reader/writer (experts/csrc/data_plane.cpp) against the
pure-Python reference in tandem.rpc.expert_wire, over real socket pairs."""

from __future__ import annotations

import socket
import struct
import threading

import pytest
import torch

from tandem.experts import native
from tandem.rpc import expert_wire as wire


@pytest.fixture(autouse=True)
def kernel():
    module = native.load_kernel()
    assert module is not None, native.unavailable_reason()
    return module


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(10)
    b.settimeout(10)
    yield a, b
    a.close()
    b.close()


@pytest.fixture(params=[True, False], ids=["native", "reference"])
def sender(request):
    """Which implementation writes; the other one reads."""
    return request.param


def using(native_on: bool, fn, *args):
    saved = wire.use_native
    wire.use_native = native_on
    try:
        return fn(*args)
    finally:
        wire.use_native = saved


def request_tensors(tokens=3, hidden=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.randint(0, 8, (tokens, 2), generator=g)
    weights = torch.rand(tokens, 2, generator=g)
    return x, ids, weights


def read_all(sock: socket.socket, n: int) -> bytes:
    return bytes(wire.recv_exact(sock, n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_both_implementations_write_the_same_request_bytes(pair, dtype):
    a, b = pair
    x, ids, weights = request_tensors(dtype=dtype)
    size = wire.REQUEST.size + x.numel() * x.element_size() + ids.numel() * 8 + weights.numel() * 4
    frames = []
    for native_on in (True, False):
        using(native_on, wire.send_request, a, 5, x, ids.int(), weights.double())  # converted on the way
        frames.append(read_all(b, size))
    assert frames[0] == frames[1]
    assert frames[0][:4] == wire.REQUEST_MAGIC and struct.unpack_from("<IIIII", frames[0], 4) == (
        wire.DTYPE_CODES[dtype], 5, 3, 16, 2)


def test_requests_and_responses_cross_between_implementations(pair, sender):
    a, b = pair
    x, ids, weights = request_tensors(tokens=4, dtype=torch.bfloat16)
    using(sender, wire.send_request, a, 2, x, ids, weights)
    layer, got_x, got_ids, got_w = using(not sender, wire.recv_request, b)
    assert layer == 2 and torch.equal(got_x, x) and torch.equal(got_ids, ids) and torch.equal(got_w, weights)
    assert (got_x.dtype, got_ids.dtype, got_w.dtype) == (torch.bfloat16, torch.int64, torch.float32)

    out = torch.randn(4, 16).to(torch.bfloat16)
    using(sender, wire.send_response, b, wire.OK, out)
    status, payload = using(not sender, wire.recv_response, a, torch.bfloat16, (4, 16))
    assert status == wire.OK and torch.equal(payload, out)

    using(sender, wire.send_response, b, wire.INVALID_ARGUMENT, "topk_ids: must be in [0, 8) – ü")
    assert using(not sender, wire.recv_response, a, torch.float32, (4, 16)) == (
        wire.INVALID_ARGUMENT, "topk_ids: must be in [0, 8) – ü")


def test_an_empty_batch_round_trips(pair, sender):
    a, b = pair
    x, ids, weights = request_tensors(tokens=0)
    using(sender, wire.send_request, a, 0, x, ids, weights)
    layer, got_x, got_ids, _ = using(not sender, wire.recv_request, b)
    assert layer == 0 and got_x.shape == (0, 16) and got_ids.shape == (0, 2)


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "reference"])
def test_frames_that_do_not_parse_raise_wire_error(pair, native_on):
    a, b = pair
    a.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(6))  # one header's worth
    with pytest.raises(wire.WireError, match="not an expert-forward frame"):
        using(native_on, wire.recv_request, b)
    a.sendall(wire.REQUEST.pack(wire.REQUEST_MAGIC, 0, 0, 1 << 16, 1 << 16, 2))  # 16 GiB of hidden states
    with pytest.raises(wire.WireError, match="larger than"):
        using(native_on, wire.recv_request, b)
    a.sendall(wire.REQUEST.pack(wire.REQUEST_MAGIC, 0, 0, wire.MAX_FRAME_TOKENS + 1, 1, 1))  # 1 MiB, but too many
    with pytest.raises(wire.WireError, match=f"{wire.MAX_FRAME_TOKENS + 1} tokens, more than"):
        using(native_on, wire.recv_request, b)
    a.sendall(wire.RESPONSE.pack(wire.RESPONSE_MAGIC, wire.OK, 12) + bytes(12))  # 3 floats, not [2, 16]
    with pytest.raises(wire.WireError, match="expected 128"):
        using(native_on, wire.recv_response, b, torch.float32, (2, 16))
    a.sendall(b"HTTP/1.1 200")
    with pytest.raises(wire.WireError, match="not an expert-forward response"):
        using(native_on, wire.recv_response, b, torch.float32, (2, 16))


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "reference"])
def test_a_closed_peer_and_a_timeout_are_os_errors(pair, native_on):
    a, b = pair
    b.settimeout(0.05)
    with pytest.raises(TimeoutError):
        using(native_on, wire.recv_response, b, torch.float32, (1, 16))
    a.sendall(wire.REQUEST.pack(wire.REQUEST_MAGIC, 0, 0, 1, 16, 2))  # a header, then the peer goes away
    a.close()
    with pytest.raises(ConnectionError):
        using(native_on, wire.recv_request, b)


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "reference"])
def test_a_reader_waits_for_a_frame_to_start_but_not_for_a_stalled_one(pair, native_on):
    """The socket's timeout bounds the reads of a started frame, not the wait for the next one:
    a server's connection idles between steps."""
    a, b = pair
    b.settimeout(0.2)
    x, ids, weights = request_tensors()
    timer = threading.Timer(0.5, wire.send_request, (a, 1, x, ids, weights))
    timer.start()
    layer, got_x, _, _ = using(native_on, wire.recv_request, b)
    assert layer == 1 and torch.equal(got_x, x)
    a.sendall(wire.REQUEST.pack(wire.REQUEST_MAGIC, 0, 0, 1, 16, 2) + bytes(8))  # then nothing
    with pytest.raises(TimeoutError):
        using(native_on, wire.recv_request, b)


def test_a_spinning_reader_gets_frames_sent_during_and_after_its_spin(pair):
    a, b = pair
    x, ids, weights = request_tensors()
    sent = threading.Event()

    def send_later(delay_s: float):
        sent.wait(delay_s)
        wire.send_request(a, 1, x, ids, weights)

    for delay_s, spin_us in ((0.0, 200_000), (0.05, 1_000)):  # inside the spin; after it, from poll(2)
        thread = threading.Thread(target=send_later, args=(delay_s,))
        thread.start()
        layer, got_x, _, _ = wire.recv_request(b, spin_us)
        thread.join()
        assert layer == 1 and torch.equal(got_x, x)
    a.close()  # end of stream seen while spinning
    with pytest.raises(ConnectionError):
        wire.recv_request(b, 200_000)


def test_writing_to_a_closed_peer_is_a_connection_error(pair):
    a, b = pair
    b.close()
    x, ids, weights = request_tensors()
    with pytest.raises(ConnectionError):
        wire.send_request(a, 0, x, ids, weights)
