"""`GrpcExpertExecutor`: the ExpertExecutor of the split deployment, calling `--role experts`."""

from __future__ import annotations

import logging
import socket
import time
from contextlib import contextmanager

import grpc
import torch

from tandem.experts.base import ExpertsUnavailable
from tandem.rpc import expert_wire as wire
from tandem.rpc.gen import experts_pb2, experts_pb2_grpc
from tandem.rpc.tensors import BadTensor, from_proto, to_proto

# Reconnect quickly once the experts process is back: gRPC's default backoff grows to 120 s.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_send_message_length", 1 << 30),
    ("grpc.max_receive_message_length", 1 << 30),
)
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

log = logging.getLogger(__name__)


class ExpertsMismatch(ExpertsUnavailable):
    """The experts process answering serves another model than the one expected: unusable until
    one serving that model answers, as an unreachable one. `info` is what it answered."""

    def __init__(self, message: str, info: experts_pb2.ExpertsInfo):
        super().__init__(message)
        self.info = info


class GrpcExpertExecutor:
    """Implements ExpertExecutor by calling the Experts service at `address` (`unix:/path` or
    `host:port`). Raises ExpertsUnavailable when it cannot be reached within `timeout_s`.

    Once `info()` has seen the experts process advertise a data plane socket (same host), and
    unless `data_plane=False`, Forward goes over it (`tandem.rpc.expert_wire`) instead of gRPC,
    waiting for each answer spinning for up to `spin_us` before sleeping.

    With `model_fingerprint` (tandem.rpc.fingerprint), it uses only an experts process serving
    that model: `info()` checks it, a new data plane connection (the first, or one after the
    experts process went away) is made only after `info()` has, and every gRPC Forward answer
    names it. Another model's process raises ExpertsMismatch, an ExpertsUnavailable: the serving
    loop stays down and retries, as while the experts are unreachable."""

    def __init__(self, address: str, *, timeout_s: float = 30.0, metrics=None, data_plane: bool = True,
                 spin_us: int = 0, model_fingerprint: str | None = None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.use_data_plane = data_plane
        self.spin_us = spin_us
        self.model_fingerprint = model_fingerprint
        self._mismatch_logged: str | None = None  # the other model's fingerprint, once logged
        self.data_socket: str | None = None  # advertised by the experts process
        self.last_info: experts_pb2.ExpertsInfo | None = None  # as `info()` last answered
        self._data: socket.socket | None = None
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = experts_pb2_grpc.ExpertsStub(self._channel)

    def forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        if self.use_data_plane and self.data_socket:
            out = self._forward_data(layer, hidden, topk_ids, topk_weights)
        else:
            request = experts_pb2.ExpertForwardRequest(
                layer=layer, hidden=to_proto(hidden), topk_ids=to_proto(topk_ids.to(torch.int64)),
                topk_weights=to_proto(topk_weights.to(torch.float32)))
            out = from_proto(self._checked(self._call(self._stub.Forward, request)).output, "output")
        if self.metrics is not None:
            self.metrics.expert_call_latency.observe(time.perf_counter() - start)
        return out.to(hidden.device)

    def _checked(self, response: experts_pb2.ExpertForwardResponse) -> experts_pb2.ExpertForwardResponse:
        """The answer, if the expected model's experts computed it; else ExpertsMismatch (or, when
        that process is gone again already, ExpertsUnavailable)."""
        if self.model_fingerprint is None or response.model_fingerprint == self.model_fingerprint:
            return response
        self.info()  # raises ExpertsMismatch, saying what the process serves
        raise ExpertsUnavailable(f"experts at {self.address}: a Forward answered by another model's process")

    def _forward_data(self, layer, hidden, topk_ids, topk_weights) -> torch.Tensor:
        with self._data_errors():
            sock = self._data_connection()
            wire.send_request(sock, layer, hidden, topk_ids, topk_weights)
            status, payload = wire.recv_response(sock, hidden.dtype, tuple(hidden.shape), self.spin_us)
        if status == wire.OK:
            return payload
        raise self._refused(status, payload)

    @contextmanager
    def data_plane_calls(self):
        """For a native caller that makes Forward calls itself (`tandem.model.native_decode`):
        yields (fd, spin_us, timeout_ms) of the data plane connection, connected now, or None
        when Forward goes over gRPC. What the native wire raises inside becomes what `forward`
        raises: ExpertsUnavailable when the experts process cannot be reached (the connection is
        closed and made again on the next call), RuntimeError for an error it answered."""
        if not (self.use_data_plane and self.data_socket) or (w := wire.native_wire()) is None:
            yield None
            return
        with self._data_errors():
            sock = self._data_connection()
            try:
                yield sock.fileno(), self.spin_us, wire.timeout_ms(sock)
            except w.Refused as exc:
                raise self._refused(*exc.args) from None
            except w.BadFrame as exc:  # out of step: closed below, as the Python reader's WireError
                raise wire.WireError(str(exc)) from None

    def record_call(self, seconds: float) -> None:
        """A Forward call a native caller made over `data_plane_calls`, for the metrics."""
        if self.metrics is not None:
            self.metrics.expert_call_latency.observe(seconds)

    def _data_connection(self) -> socket.socket:
        if self._data is None:
            if self.model_fingerprint is not None:
                self.info()  # the process listening now serves the expected model (ExpertsMismatch)
                if not self.data_socket:
                    raise ExpertsUnavailable(f"experts at {self.address} no longer advertise a data plane")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.data_socket)
            except OSError:
                sock.close()
                raise
            self._data = sock
        return self._data

    @property
    def _where(self) -> str:
        return f"experts data plane at {self.data_socket}"

    @contextmanager
    def _data_errors(self):
        where = self._where
        try:
            yield
        except BadTensor as exc:  # refused before sending: the connection is still in step
            raise RuntimeError(f"{where}: INVALID_ARGUMENT: {exc}") from exc
        except (OSError, wire.WireError) as exc:  # refused, reset, timed out: down, as gRPC's UNAVAILABLE
            self._close_data()
            raise ExpertsUnavailable(f"{where}: {exc}") from exc

    def _refused(self, status: int, message: str) -> Exception:
        """The exception for an error status the experts process answered (the connection stays in step)."""
        text = f"{self._where}: {wire.STATUS_NAMES.get(status, status)}: {message}"
        return ExpertsUnavailable(text) if status == wire.UNAVAILABLE else RuntimeError(text)

    def _close_data(self) -> None:
        if self._data is not None:
            self._data.close()
            self._data = None

    def info(self, timeout_s: float | None = None) -> experts_pb2.ExpertsInfo:
        """What the experts process holds; ExpertsUnavailable when it is unreachable, ExpertsMismatch
        when it serves another model than `model_fingerprint`."""
        info = self._call(self._stub.GetExpertsInfo, experts_pb2.GetExpertsInfoRequest(), timeout_s)
        self._check_model(info)
        if info.data_socket != self.data_socket:
            self._close_data()
            self.data_socket = info.data_socket or None
        self.last_info = info
        return info

    def _check_model(self, info: experts_pb2.ExpertsInfo) -> None:
        if self.model_fingerprint is None or info.model_fingerprint == self.model_fingerprint:
            self._mismatch_logged = None
            return
        self._close_data()  # nothing more goes to that process
        message = (f"experts at {self.address} serve {info.model!r}, another model than this process's (model "
                   f"fingerprint {info.model_fingerprint or 'none'}, expected {self.model_fingerprint}): not "
                   f"serving from it until the experts process serves the same checkpoint")
        if self._mismatch_logged != info.model_fingerprint:  # once, not at every retry
            log.error("%s", message)
            self._mismatch_logged = info.model_fingerprint
        raise ExpertsMismatch(message, info)

    def cpu_attention(self, layer: int, query: torch.Tensor, block_tables: list[list[int]], seq_lens: list[int],
                      scale: float = 0.0, *, query_lens: list[int] | None = None, value_dim: int = 0,
                      sliding_window: int | None = None) -> torch.Tensor:
        """Attention over CPU-tier KV blocks, by the experts process (see CpuAttentionRequest).

        query [T, heads, head_dim]: query_lens[i] rows per sequence (default one each: decode);
        block_tables[i] and seq_lens[i] give sequence i's CPU-tier blocks and KV length. Returns
        [T, heads, head_dim] (value_dim for a latent cache) in query's dtype.
        """
        request = experts_pb2.CpuAttentionRequest(
            layer=layer, query=to_proto(query), seq_lens=seq_lens, scale=scale, query_lens=query_lens or [],
            value_dim=value_dim, sliding_window=sliding_window or 0,
            block_tables=[experts_pb2.BlockTable(block_ids=t) for t in block_tables])
        start = time.perf_counter()
        out = from_proto(self._call(self._stub.CpuAttention, request).output, "output")
        if self.metrics is not None:
            self.metrics.cpu_attention_latency.observe(time.perf_counter() - start)
        return out.to(query.device)

    def _call(self, method, request, timeout_s: float | None = None):
        try:
            return method(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as exc:
            if exc.code() in _UNREACHABLE:
                raise ExpertsUnavailable(f"experts at {self.address}: {exc.code().name}: {exc.details()}") from exc
            raise RuntimeError(f"experts at {self.address}: {exc.code().name}: {exc.details()}") from exc

    def close(self) -> None:
        self._close_data()
        self._channel.close()


class RemoteCpuAttention:
    """The runner's CpuAttentionBackend in the split deployment: the experts process attends over
    the CPU tier it maps from the same shared-memory files (`tandem.kv.tiered`)."""

    def __init__(self, client: GrpcExpertExecutor):
        self.client = client

    def __call__(self, layer: int, query: torch.Tensor, batch, scale: float, value_dim: int = 0) -> torch.Tensor:
        return self.client.cpu_attention(layer, query, batch.block_tables, batch.seq_lens, scale,
                                         query_lens=batch.query_lens, value_dim=value_dim,
                                         sliding_window=batch.sliding_window)
