"""The internal `tandem.v1.Experts` service: routed experts (and CPU attention) for the attention process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

import grpc
import torch

from tandem.metrics import ExpertsMetrics
from tandem.rpc.cpu_attention import KVNotShared
from tandem.rpc.gen import experts_pb2, experts_pb2_grpc
from tandem.rpc.tensors import BadTensor, from_proto, to_proto

log = logging.getLogger(__name__)

# The most tokens one Forward may carry, on either transport: far more than an engine step
# computes (--max-num-batched-tokens, 2048 by default, is held under it), and a bound on what one
# call makes the experts process allocate and compute under the lock every caller shares.
MAX_FORWARD_TOKENS = 1 << 16


def check_forward_tensors(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """The shapes a Forward's tensors must have, whichever transport carries them (gRPC, or the data
    plane, whose frame header cannot describe anything else); BadTensor names the field."""
    if hidden.dim() != 2 or not hidden.is_floating_point():
        raise BadTensor("hidden", f"must be a 2-D float tensor [T, H], got {hidden.dtype} {list(hidden.shape)}")
    if hidden.shape[0] > MAX_FORWARD_TOKENS:
        raise BadTensor("hidden", f"{hidden.shape[0]} tokens in one call, more than {MAX_FORWARD_TOKENS}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise BadTensor("topk_ids", f"must be [T={hidden.shape[0]}, k], got {list(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise BadTensor("topk_weights", f"must be {list(topk_ids.shape)} as topk_ids, got {list(topk_weights.shape)}")


def decode_forward_request(request: experts_pb2.ExpertForwardRequest):
    """(hidden [T, H], topk_ids [T, k] int64, topk_weights [T, k] float32), decoded; BadTensor for
    undecodable tensors or wrong index/weight dtypes (shapes: `check_forward`)."""
    hidden = from_proto(request.hidden, "hidden")
    topk_ids = from_proto(request.topk_ids, "topk_ids")
    topk_weights = from_proto(request.topk_weights, "topk_weights")
    if topk_ids.dtype != torch.int64:
        raise BadTensor("topk_ids", f"must be int64, got {topk_ids.dtype}")
    if topk_weights.dtype != torch.float32:
        raise BadTensor("topk_weights", f"must be float32, got {topk_weights.dtype}")
    return hidden, topk_ids, topk_weights


def check_forward(info: experts_pb2.ExpertsInfo, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> None:
    """Everything a Forward must satisfy for this model; BadTensor names the field."""
    if layer not in info.moe_layers:
        raise BadTensor("layer", f"{layer} has no routed experts here (MoE layers: {list(info.moe_layers)})")
    check_forward_tensors(hidden, topk_ids, topk_weights)
    if hidden.shape[1] != info.hidden_size:
        raise BadTensor("hidden", f"hidden size {hidden.shape[1]}, this model has {info.hidden_size}")
    if topk_ids.shape[1] > info.num_experts:  # each is computed: k is what a call costs
        raise BadTensor("topk_ids", f"{topk_ids.shape[1]} experts a token, more than the {info.num_experts} "
                                    f"this model has")
    if topk_ids.numel():
        lo, hi = torch.aminmax(topk_ids)  # one pass: this runs once per layer per step
        if not 0 <= int(lo) <= int(hi) < info.num_experts:
            raise BadTensor("topk_ids", f"expert ids must be in [0, {info.num_experts})")


class NotLoaded(RuntimeError):
    """The expert weights are still loading (UNAVAILABLE)."""


def native_expert_server(executor, hidden_size: int):
    """The data plane's native end for `executor` (`wire.ExpertServer`: decode-sized float32 frames
    served without Python), or None when the executor does not run the native kernel."""
    from tandem.experts.cpu_executor import CpuExpertExecutor

    if type(executor) is not CpuExpertExecutor or executor.native is None:
        return None
    server = executor.native.wire.ExpertServer(hidden_size, executor.prefill_tokens)
    for index, layer in executor.layers.items():
        server.add_layer(index, layer.kind, layer.group_size, *layer.native_args())
    return server


class NativeLock:
    """The native server's lock as a context manager: one lock around all expert compute."""

    def __init__(self, server):
        self.server = server

    def __enter__(self):
        self.server.lock()

    def __exit__(self, *exc) -> None:
        self.server.unlock()


class ExpertsServicer(experts_pb2_grpc.ExpertsServicer):
    """Serves one ExpertExecutor. Calls run one at a time, on a worker thread for gRPC and on the
    data plane's connection threads (`tandem.rpc.experts_data`): torch's own threads
    parallelise each call, and the attention process sends one layer at a time anyway. With the
    native executor, the data plane serves decode frames in native code (`native_server`), under
    the same lock."""

    def __init__(self, metrics: ExpertsMetrics):
        self.metrics = metrics
        self.executor = None
        self.native_server = None
        self.info = experts_pb2.ExpertsInfo()
        self.cpu_attention = None
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="experts")
        self._one_at_a_time = threading.Lock()

    def attach(self, executor, info: experts_pb2.ExpertsInfo, cpu_attention=None) -> None:
        """Starts serving `executor`; until then every call answers UNAVAILABLE (weights loading)."""
        self.native_server = native_expert_server(executor, info.hidden_size)
        if self.native_server is not None:
            self._one_at_a_time = NativeLock(self.native_server)
        self.executor, self.info, self.cpu_attention = executor, info, cpu_attention

    async def _check_loaded(self, context) -> None:
        if self.executor is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the expert weights are still loading")

    def forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """One Forward, checked (BadTensor names the field; NotLoaded while loading), timed, and
        serialised with every other call. Both the gRPC method and the data plane call this."""
        if self.executor is None:
            raise NotLoaded("the expert weights are still loading")
        check_forward(self.info, layer, hidden, topk_ids, topk_weights)
        with self._one_at_a_time:
            start = time.perf_counter()
            out = self.executor.forward(layer, hidden, topk_ids, topk_weights)
            self.metrics.forward_latency.observe(time.perf_counter() - start)
            self.metrics.forward_tokens.inc(hidden.shape[0])
        return out

    async def Forward(self, request, context):
        await self._check_loaded(context)
        try:
            hidden, topk_ids, topk_weights = decode_forward_request(request)
            out = await asyncio.get_running_loop().run_in_executor(
                self._worker, self.forward, request.layer, hidden, topk_ids, topk_weights)
        except BadTensor as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # noqa: BLE001 - as the data plane answers it, not gRPC's UNKNOWN
            log.exception("expert forward failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        return experts_pb2.ExpertForwardResponse(output=to_proto(out), model_fingerprint=self.info.model_fingerprint)

    async def CpuAttention(self, request, context):
        await self._check_loaded(context)
        if self.cpu_attention is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "kv_shm: this experts process maps no CPU KV tier (start it with --kv-shm)")
        try:
            out = await asyncio.get_running_loop().run_in_executor(self._worker, self._cpu_attention, request)
        except BadTensor as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KVNotShared as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return experts_pb2.CpuAttentionResponse(output=to_proto(out))

    def _cpu_attention(self, request) -> torch.Tensor:
        start = time.perf_counter()  # on the worker: a Forward ahead of it is not its time
        out = self.cpu_attention.handle(request)
        self.metrics.cpu_attention_latency.observe(time.perf_counter() - start)
        return out

    async def GetExpertsInfo(self, request, context):
        await self._check_loaded(context)
        return self.info

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


def add_to_server(servicer: ExpertsServicer, server: grpc.aio.Server) -> None:
    experts_pb2_grpc.add_ExpertsServicer_to_server(servicer, server)
