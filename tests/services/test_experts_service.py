"""The Experts service and its client, GrpcExpertExecutor, over a real unix socket."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from svc_helpers import eventually

from tandem import contract
from tandem.experts.base import ExpertsUnavailable
from tandem.model.loader import build_expert_executor
from tandem.rpc.experts_client import GrpcExpertExecutor
from tandem.rpc.gen import experts_pb2, experts_pb2_grpc
from tandem.rpc.tensors import to_proto

HIDDEN = 64  # the demo checkpoints' hidden size


@pytest.fixture
async def experts(start_server, model_dir, tmp_path):
    """(address, the same experts computed in this process)."""
    path = model_dir("mixtral")
    server = await start_server(model=str(path), role="experts", listen=f"unix:{tmp_path}/experts.sock")
    return server.address, build_expert_executor(path)


def batch(tokens: int = 5, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=g).to(dtype)  # [T, H]
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens)])  # [T, 2]
    weights = torch.rand(tokens, 2, generator=g)  # [T, 2]
    return hidden, ids, weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_remote_forward_equals_local(experts, dtype):
    address, local = experts
    client = GrpcExpertExecutor(address)
    for layer in (0, 1):
        hidden, ids, weights = batch(dtype=dtype, seed=layer)
        remote = await asyncio.to_thread(client.forward, layer, hidden, ids, weights)
        assert remote.dtype == dtype and remote.shape == hidden.shape
        assert torch.equal(remote, local.forward(layer, hidden, ids, weights))
    client.close()


async def test_info_health_and_no_cpu_kv(experts):
    address, _ = experts
    client = GrpcExpertExecutor(address)
    info = await asyncio.to_thread(client.info)
    assert list(info.moe_layers) == [0, 1] and info.num_experts == 8 and info.hidden_size == HIDDEN
    assert info.dtype == "float32" and info.kv_shm_path == ""
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=contract.EXPERTS_SERVICE))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await experts_pb2_grpc.ExpertsStub(channel).CpuAttention(experts_pb2.CpuAttentionRequest())
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "kv_shm" in err.value.details()
    client.close()


def bad_requests():
    hidden, ids, weights = batch()
    ok = dict(layer=0, hidden=to_proto(hidden), topk_ids=to_proto(ids), topk_weights=to_proto(weights))
    yield dict(ok, layer=7), "layer"
    yield dict(ok, hidden=to_proto(hidden[:, :32])), "hidden"
    yield dict(ok, hidden=to_proto(hidden[0])), "hidden"
    yield dict(ok, topk_ids=to_proto(ids.int())), "topk_ids"
    yield dict(ok, topk_ids=to_proto(ids + 8)), "topk_ids"
    yield dict(ok, topk_weights=to_proto(weights[:, :1])), "topk_weights"
    broken = to_proto(hidden)
    broken.data = broken.data[:-4]
    yield dict(ok, hidden=broken), "hidden"


async def test_bad_requests_are_invalid_argument_naming_the_field(experts):
    address, _ = experts
    async with grpc.aio.insecure_channel(address) as channel:
        stub = experts_pb2_grpc.ExpertsStub(channel)
        for fields, name in bad_requests():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Forward(experts_pb2.ExpertForwardRequest(**fields))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"{name}:"), err.value.details()


def test_unreachable_experts_raise_experts_unavailable(tmp_path):
    client = GrpcExpertExecutor(f"unix:{tmp_path}/nobody.sock", timeout_s=5)
    with pytest.raises(ExpertsUnavailable, match="nobody.sock: UNAVAILABLE"):
        client.forward(0, *batch())
    with pytest.raises(ExpertsUnavailable):
        client.info()
    client.close()


@pytest.mark.parametrize("native_wire", [True, False], ids=["native-frames", "python-frames"])
async def test_the_data_plane_answers_forward_as_grpc_does(experts, tmp_path, native_wire, monkeypatch):
    """A same-host client learns the data socket from GetExpertsInfo and sends Forward over it:
    the same bytes back, the same field-named errors, and the gRPC path still there."""
    from tandem.rpc import expert_wire

    monkeypatch.setattr(expert_wire, "use_native", native_wire)  # both ends: the server runs in this process
    address, local = experts
    fast, plain = GrpcExpertExecutor(address), GrpcExpertExecutor(address, data_plane=False)
    info = await asyncio.to_thread(fast.info)
    assert info.data_socket == f"{tmp_path}/experts.sock.data" == fast.data_socket
    for dtype in (torch.float32, torch.bfloat16):
        hidden, ids, weights = batch(tokens=7, dtype=dtype)
        over_wire = await asyncio.to_thread(fast.forward, 1, hidden, ids, weights)
        assert fast._data is not None  # it went over the data plane
        assert torch.equal(over_wire, await asyncio.to_thread(plain.forward, 1, hidden, ids, weights))
        assert torch.equal(over_wire, local.forward(1, hidden, ids, weights))
    hidden, ids, weights = batch()
    for args, name in [((7, hidden, ids, weights), "layer"), ((0, hidden[:, :32], ids, weights), "hidden"),
                       ((0, hidden, ids + 8, weights), "topk_ids"), ((0, hidden, ids, weights[:, :1]), "topk_weights")]:
        with pytest.raises(RuntimeError, match=f"INVALID_ARGUMENT: {name}:"):
            await asyncio.to_thread(fast.forward, *args)
    # the connection survives bad requests
    assert torch.equal(await asyncio.to_thread(fast.forward, 0, hidden, ids, weights), local.forward(0, hidden, ids, weights))
    fast.close()
    plain.close()


async def test_a_garbled_frame_closes_only_its_own_connection(experts):
    import socket

    address, local = experts
    client = GrpcExpertExecutor(address)
    await asyncio.to_thread(client.info)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as rogue:
        rogue.settimeout(10)
        rogue.connect(client.data_socket)
        rogue.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(32))
        try:
            reply = rogue.recv(1)
        except ConnectionResetError:  # closed with our unread bytes still queued
            reply = b""
        assert reply == b""  # closed by the server, no reply
    hidden, ids, weights = batch()
    assert torch.equal(await asyncio.to_thread(client.forward, 0, hidden, ids, weights),
                       local.forward(0, hidden, ids, weights))
    client.close()


async def test_spinning_ends_of_the_data_plane_answer_and_shut_down(start_server, model_dir, tmp_path):
    """--spin-us on both roles: the answers are the same, and stopping the server ends the
    connection thread that is polling for the next frame."""
    path = model_dir("mixtral")
    server = await start_server(model=str(path), role="experts", listen=f"unix:{tmp_path}/experts.sock",
                                spin_us=20_000)
    local = build_expert_executor(path)
    client = GrpcExpertExecutor(server.address, spin_us=20_000)
    await asyncio.to_thread(client.info)
    for layer in (0, 1):
        hidden, ids, weights = batch(tokens=3, seed=layer)
        assert torch.equal(await asyncio.to_thread(client.forward, layer, hidden, ids, weights),
                           local.forward(layer, hidden, ids, weights))
    assert client._data is not None
    assert await server.close() == 0
    with pytest.raises(ExpertsUnavailable):
        await asyncio.to_thread(client.forward, 0, hidden, ids, weights)
    client.close()


async def test_decode_frames_are_served_natively_and_the_rest_by_python(start_server, model_dir, tmp_path,
                                                                         monkeypatch):
    """The native end answers float32 decode frames itself (counted, and timed into the expert
    latency histogram); bf16, prefill-sized and invalid frames go through the checked Python path
    with its errors. Every answer equals the executor computed in this process."""
    from tandem.rpc import experts_server

    made = []
    build = experts_server.native_expert_server
    monkeypatch.setattr(experts_server, "native_expert_server", lambda *a: made.append(build(*a)) or made[-1])
    path = model_dir("mixtral")
    server = await start_server(model=str(path), role="experts", listen=f"unix:{tmp_path}/experts.sock",
                                metrics_port=0)
    local = build_expert_executor(path)
    client = GrpcExpertExecutor(server.address)
    await asyncio.to_thread(client.info)
    [native_end] = made
    assert native_end is not None

    def latency_count() -> float:
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
        line = next(l for l in text.splitlines() if l.startswith(contract.EXPERT_CALL_LATENCY + "_count"))
        return float(line.split()[-1])

    before_served, before_count = native_end.served, latency_count()
    hidden, ids, weights = batch(tokens=3)
    assert torch.equal(await asyncio.to_thread(client.forward, 1, hidden, ids, weights),
                       local.forward(1, hidden, ids, weights))
    assert native_end.served == before_served + 1
    assert await eventually(latency_count, before_count + 1) == before_count + 1
    for tokens, dtype in ((3, torch.bfloat16), (local.prefill_tokens + 1, torch.float32)):  # Python's
        hidden, ids, weights = batch(tokens=tokens, dtype=dtype)
        assert torch.equal(await asyncio.to_thread(client.forward, 0, hidden, ids, weights),
                           local.forward(0, hidden, ids, weights))
    hidden, ids, weights = batch()
    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT: topk_ids:"):
        await asyncio.to_thread(client.forward, 0, hidden, ids + 8, weights)
    assert native_end.served == before_served + 1  # none of those
    assert await eventually(latency_count, before_count + 3) == before_count + 3
    client.close()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
async def test_a_bfloat16_split_deployment_decodes_natively_as_embedded(arch, start_server, model_dir, tmp_path,
                                                                           monkeypatch):
    """A bf16 checkpoint split in two: the attention side's greedy runs send float32 hidden states over
    the data plane, and the experts process, serving the bf16 experts, answers them in native code. The
    tokens are those of the embedded bf16 model, whose native path calls the same kernels in process.
    Qwen2-MoE's shared experts and dense layer stay on the attention side, inside its native call."""
    from tandem.engine.llm_engine import EngineConfig, LLMEngine
    from tandem.engine.sampling_params import SamplingParams
    from tandem.rpc import experts_server

    made = []
    build = experts_server.native_expert_server
    monkeypatch.setattr(experts_server, "native_expert_server", lambda *a: made.append(build(*a)) or made[-1])
    path = model_dir(arch)
    server = await start_server(model=str(path), role="experts", dtype="bfloat16",
                                listen=f"unix:{tmp_path}/experts.sock")
    [native_end] = made
    client = GrpcExpertExecutor(server.address)
    assert (await asyncio.to_thread(client.info)).dtype == "bfloat16"
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    prompts = [[3, 9, 4, 7, 11], [5, 6]]

    def run(**kwargs):
        engine = LLMEngine.from_pretrained(path, device="cpu", dtype="bfloat16",
                                           config=EngineConfig(num_scheduler_steps=4), **kwargs)
        tokens = [out.token_ids for out in engine.generate(prompts, params)]
        return engine.model.native_path, tokens

    embedded_path, embedded = await asyncio.to_thread(run)
    split_path, split = await asyncio.to_thread(run, expert_executor=client)
    assert embedded_path.local_experts and split_path.remote is client
    assert embedded_path.greedy_steps == split_path.greedy_steps == params.max_tokens - 1
    assert split == embedded
    moe_layers = sum(layer.moe_layer is not None for layer in split_path.layers)
    assert moe_layers == (1 if arch == "qwen2_moe" else 2)  # the demo Qwen2-MoE's layer 1 is dense
    assert native_end.served >= moe_layers * (params.max_tokens - 1)  # every decode step's MoE layers, natively
    client.close()


async def test_native_decode_steps_call_the_experts_over_the_data_plane(start_server, model_dir, tmp_path,
                                                                         monkeypatch, caplog):
    """The split deployment's attention side: one native call runs each decode step's layers and
    makes every layer's Forward over the data plane itself. It gives the tokens and logits of the
    torch path calling the same server; every call is counted on both ends; an error the server
    answers is raised naming it with the connection still in step; a server gone is
    ExpertsUnavailable."""
    from types import SimpleNamespace

    from tandem.engine.llm_engine import EngineConfig, LLMEngine
    from tandem.engine.sampling_params import SamplingParams
    from tandem.rpc import experts_server

    made = []
    build = experts_server.native_expert_server
    monkeypatch.setattr(experts_server, "native_expert_server", lambda *a: made.append(build(*a)) or made[-1])
    path = model_dir("qwen3_moe")
    server = await start_server(model=str(path), role="experts", listen=f"unix:{tmp_path}/experts.sock")
    [native_end] = made
    calls = SimpleNamespace(expert_call_latency=SimpleNamespace(values=[]))
    calls.expert_call_latency.observe = calls.expert_call_latency.values.append
    client = GrpcExpertExecutor(server.address, metrics=calls)
    await asyncio.to_thread(client.info)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [3, 9, 4, 7, 11]

    def run(native_decode: bool):
        engine = LLMEngine.from_pretrained(path, device="cpu", dtype="float32", config=EngineConfig(),
                                           expert_executor=client)
        engine.model.native_decode = native_decode
        rows = []
        engine.runner.logits_hook = lambda rid, row: rows.append(row.clone())
        [out] = engine.generate([prompt], params)
        return engine, out.token_ids, torch.stack(rows)

    _, torch_tokens, torch_logits = await asyncio.to_thread(run, False)
    served, observed = native_end.served, len(calls.expert_call_latency.values)
    engine, tokens, logits = await asyncio.to_thread(run, True)
    native_path, layers = engine.model.native_path, len(engine.model.model.layers)
    assert native_path.remote is client and native_path.natives is not None
    assert native_path.steps == params.max_tokens - 1
    assert tokens == torch_tokens
    assert (logits - torch_logits).abs().max().item() <= 1e-4
    assert native_end.served == served + layers * params.max_tokens  # prefill and every decode step's layers
    assert len(calls.expert_call_latency.values) == observed + layers * params.max_tokens
    assert all(s > 0 for s in calls.expert_call_latency.values)

    def greedy_runs():  # nothing watches the logits: runs of up to 4 steps in one native call each
        engine = LLMEngine.from_pretrained(path, device="cpu", dtype="float32",
                                           config=EngineConfig(num_scheduler_steps=4), expert_executor=client)
        [out] = engine.generate([prompt], params)
        return engine.model.native_path, out.token_ids

    served, observed = native_end.served, len(calls.expert_call_latency.values)
    greedy_path, greedy_tokens = await asyncio.to_thread(greedy_runs)
    assert greedy_tokens == torch_tokens and greedy_path.greedy_steps == params.max_tokens - 1
    assert native_end.served == served + layers * params.max_tokens
    assert len(calls.expert_call_latency.values) == observed + layers * params.max_tokens

    native_path.natives[1].layer = 7  # a layer the server does not hold: it answers INVALID_ARGUMENT
    with caplog.at_level(logging.ERROR, logger="tandem.engine.llm_engine"):
        [failed] = await asyncio.to_thread(engine.generate, [prompt], params)
    assert failed.finish_reason == "error"  # the engine fails the request in that step, as any forward error
    assert "INVALID_ARGUMENT: layer: 7 has no routed experts here" in caplog.text
    native_path.natives[1].layer = 1
    assert client._data is not None  # still in step
    local = build_expert_executor(path)
    hidden, ids, weights = batch()
    assert torch.equal(await asyncio.to_thread(client.forward, 0, hidden, ids, weights),
                       local.forward(0, hidden, ids, weights))

    assert await server.close() == 0
    with pytest.raises(ExpertsUnavailable, match="experts data plane"):
        await asyncio.to_thread(engine.generate, [[5, 6, 7]], params)
    assert client._data is None  # closed, to be made again once the experts are back
    client.close()
