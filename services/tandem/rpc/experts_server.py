"""The internal `tandem.v1.Experts` service: routed experts (and CPU attention) for the attention process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import grpc
import torch

from tandem.metrics import ServingMetrics
from tandem.rpc.cpu_attention import KVNotShared
from tandem.rpc.gen import experts_pb2, experts_pb2_grpc
from tandem.rpc.tensors import BadTensor, from_proto, to_proto


def decode_forward_request(request: experts_pb2.ExpertForwardRequest):
    """(hidden [T, H], topk_ids [T, k] int64, topk_weights [T, k] float32), checked; BadTensor otherwise."""
    hidden = from_proto(request.hidden, "hidden")
    topk_ids = from_proto(request.topk_ids, "topk_ids")
    topk_weights = from_proto(request.topk_weights, "topk_weights")
    if hidden.dim() != 2 or not hidden.is_floating_point():
        raise BadTensor("hidden", f"must be a 2-D float tensor [T, H], got {hidden.dtype} {list(hidden.shape)}")
    if topk_ids.dtype != torch.int64 or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise BadTensor("topk_ids", f"must be int64 [T={hidden.shape[0]}, k], got {topk_ids.dtype} "
                        f"{list(topk_ids.shape)}")
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_ids.shape:
        raise BadTensor("topk_weights", f"must be float32 {list(topk_ids.shape)}, got "
                        f"{topk_weights.dtype} {list(topk_weights.shape)}")
    return hidden, topk_ids, topk_weights


class ExpertsServicer(experts_pb2_grpc.ExpertsServicer):
    """Serves one ExpertExecutor. Calls run one at a time on a worker thread: torch's own
    threads parallelise each call, and the attention process sends one layer at a time anyway."""

    def __init__(self, metrics: ServingMetrics):
        self.metrics = metrics
        self.executor = None
        self.info = experts_pb2.ExpertsInfo()
        self.cpu_attention = None
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="experts")

    def attach(self, executor, info: experts_pb2.ExpertsInfo, cpu_attention=None) -> None:
        """Starts serving `executor`; until then every call answers UNAVAILABLE (weights loading)."""
        self.executor, self.info, self.cpu_attention = executor, info, cpu_attention

    async def _check_loaded(self, context) -> None:
        if self.executor is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the expert weights are still loading")

    async def Forward(self, request, context):
        await self._check_loaded(context)
        if request.layer not in self.info.moe_layers:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"layer: {request.layer} has no routed experts here "
                                f"(MoE layers: {list(self.info.moe_layers)})")
        try:
            hidden, topk_ids, topk_weights = decode_forward_request(request)
        except BadTensor as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if hidden.shape[1] != self.info.hidden_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"hidden: hidden size {hidden.shape[1]}, this model has {self.info.hidden_size}")
        if topk_ids.numel() and not 0 <= int(topk_ids.min()) <= int(topk_ids.max()) < self.info.num_experts:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"topk_ids: expert ids must be in [0, {self.info.num_experts})")
        start = time.perf_counter()
        out = await asyncio.get_running_loop().run_in_executor(
            self._worker, self.executor.forward, request.layer, hidden, topk_ids, topk_weights)
        self.metrics.expert_call_latency.observe(time.perf_counter() - start)
        return experts_pb2.ExpertForwardResponse(output=to_proto(out))

    async def CpuAttention(self, request, context):
        await self._check_loaded(context)
        if self.cpu_attention is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "kv_shm: this experts process maps no CPU KV tier (start it with --kv-shm)")
        start = time.perf_counter()
        try:
            out = await asyncio.get_running_loop().run_in_executor(
                self._worker, self.cpu_attention.handle, request)
        except BadTensor as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KVNotShared as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        self.metrics.cpu_attention_latency.observe(time.perf_counter() - start)
        return experts_pb2.CpuAttentionResponse(output=to_proto(out))

    async def GetExpertsInfo(self, request, context):
        await self._check_loaded(context)
        return self.info

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


def add_to_server(servicer: ExpertsServicer, server: grpc.aio.Server) -> None:
    experts_pb2_grpc.add_ExpertsServicer_to_server(servicer, server)
