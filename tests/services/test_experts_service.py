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
from tandem.rpc.experts_server import MAX_FORWARD_TOKENS
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
    yield dict(ok, hidden=experts_pb2.Tensor(dtype="float32", shape=[2**62, 2**62, 0])), "hidden"
    yield dict(ok, topk_ids=to_proto(ids.repeat(1, 5)), topk_weights=to_proto(weights.repeat(1, 5) / 5)), "topk_ids"
    many = MAX_FORWARD_TOKENS + 1
    yield dict(ok, hidden=to_proto(torch.zeros(many, HIDDEN)), topk_ids=to_proto(torch.zeros(many, 2).long()),
               topk_weights=to_proto(torch.zeros(many, 2))), "hidden"


async def test_bad_requests_are_invalid_argument_naming_the_field(experts):
    address, _ = experts
    async with grpc.aio.insecure_channel(address) as channel:
        stub = experts_pb2_grpc.ExpertsStub(channel)
        for fields, name in bad_requests():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Forward(experts_pb2.ExpertForwardRequest(**fields))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"{name}:"), err.value.details()


async def test_a_client_expecting_another_model_refuses_the_experts(experts, model_dir):
    """The experts process names the fingerprint of its checkpoint; a client that expects another
    one takes neither its info nor its Forward answers (the gRPC path: the data plane connects
    only after info() has checked)."""
    from tandem.rpc.experts_client import ExpertsMismatch
    from tandem.rpc.fingerprint import model_fingerprint

    address, local = experts
    fingerprint = model_fingerprint(model_dir("mixtral"))
    hidden, ids, weights = batch()
    right = GrpcExpertExecutor(address, model_fingerprint=fingerprint)
    assert (await asyncio.to_thread(right.info)).model_fingerprint == fingerprint
    assert torch.equal(await asyncio.to_thread(right.forward, 0, hidden, ids, weights),
                       local.forward(0, hidden, ids, weights))
    assert right._data is not None
    other = model_fingerprint(model_dir("mixtral", seed=1))  # same shapes, other weights
    for data_plane in (True, False):
        wrong = GrpcExpertExecutor(address, model_fingerprint=other, data_plane=data_plane)
        with pytest.raises(ExpertsMismatch, match=f"serve '{model_dir('mixtral')}', another model") as err:
            await asyncio.to_thread(wrong.forward, 0, hidden, ids, weights)
        assert isinstance(err.value, ExpertsUnavailable) and err.value.info.model_fingerprint == fingerprint
        with pytest.raises(ExpertsMismatch):
            await asyncio.to_thread(wrong.info)
        assert wrong._data is None and wrong.last_info is None
        wrong.close()
    right.close()


async def test_the_attention_side_serves_only_from_experts_of_its_own_model(start_server, model_dir, tmp_path,
                                                                            caplog):
    """An experts process on another checkpoint of the same shapes answers every call the attention
    side makes. Found by the probe (before the first request) or by the step that reconnects (an
    experts restart), it leaves the attention side NOT_SERVING, saying why, with its pending
    request kept; its own model's experts back, it serves again."""
    from svc_helpers import NOT_SERVING, SERVING, generate, greedy, token_ids, wait_health

    path, other = model_dir("mixtral"), model_dir("mixtral", seed=1)
    listen = f"unix:{tmp_path}/experts.sock"

    async def experts_of(model):
        return await start_server(model=str(model), role="experts", listen=listen)

    async def refused_and_not_serving(address):
        assert await eventually(lambda: "another model than this process's" in caplog.text, True, 30)
        caplog.clear()
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=contract.INFERENCE_SERVICE))
        assert reply.status == NOT_SERVING

    attention = await start_server(model=str(path), role="attention", experts=listen, wait_serving=False)
    await wait_health(attention.address, SERVING, service="")  # loaded; no experts yet
    experts = await experts_of(other)
    await refused_and_not_serving(attention.address)  # the probe's
    await experts.close()
    experts = await experts_of(path)
    await wait_health(attention.address, SERVING)
    prompt = [5, 17, 42, 99, 3]
    expected = token_ids(await generate(attention.address, greedy(prompt)))

    await experts.close()
    experts = await experts_of(other)  # a restart on another model
    pending = asyncio.ensure_future(generate(attention.address, greedy(prompt)))
    await refused_and_not_serving(attention.address)  # the step's
    await asyncio.sleep(0.5)
    assert not pending.done()
    await experts.close()
    await experts_of(path)
    assert token_ids(await pending) == expected


async def test_an_attention_server_does_not_start_on_experts_of_another_model(start_server, model_dir, tmp_path,
                                                                               caplog):
    """Found at startup, before the weights load, it is a configuration error: the server exits 1."""
    listen = f"unix:{tmp_path}/experts.sock"
    await start_server(model=str(model_dir("mixtral", seed=1)), role="experts", listen=listen)
    attention = await start_server(model=str(model_dir("mixtral")), role="attention", experts=listen,
                                   wait_serving=False)
    assert await asyncio.wait_for(attention.task, 60) == 1
    [error] = [r for r in caplog.records if r.name == "tandem.serve" and r.levelname == "ERROR"]
    assert error.getMessage().startswith("cannot load the model: experts at ") and error.exc_info is None
    assert "another model than this process's" in error.getMessage()


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
                       ((0, hidden, ids + 8, weights), "topk_ids"), ((0, hidden, ids, weights[:, :1]), "topk_weights"),
                       ((0, hidden, ids.repeat(1, 5), weights.repeat(1, 5)), "topk_ids")]:  # k = 10 of 8 experts
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


def closed_by_the_server(sock) -> bool:
    """Whether the server closed `sock` (within its 10 s timeout), as the garbled-frame test reads it."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:  # closed with our unread bytes still queued
        return True


@pytest.mark.parametrize("native_wire", [True, False], ids=["native-frames", "python-frames"])
async def test_a_peer_stalled_mid_frame_is_dropped_and_connections_are_capped(start_server, model_dir, tmp_path,
                                                                             native_wire, monkeypatch):
    """A data connection may idle between frames as long as it likes; one that stops mid-frame is
    closed after the frame timeout; one over the cap is closed at once. Clients that behave are
    served throughout."""
    import functools
    import socket
    import time

    from tandem.rpc import expert_wire, server as server_module
    from tandem.rpc.experts_data import DataPlaneServer

    monkeypatch.setattr(expert_wire, "use_native", native_wire)
    monkeypatch.setattr(server_module, "DataPlaneServer",
                        functools.partial(DataPlaneServer, frame_timeout_s=0.5, max_connections=3))
    path = model_dir("mixtral")
    server = await start_server(model=str(path), role="experts", listen=f"unix:{tmp_path}/experts.sock")
    client = GrpcExpertExecutor(server.address)
    await asyncio.to_thread(client.info)
    hidden, ids, weights = batch()
    want = build_expert_executor(path).forward(0, hidden, ids, weights)
    assert torch.equal(await asyncio.to_thread(client.forward, 0, hidden, ids, weights), want)  # connection 1

    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(client.data_socket)
        return sock

    idle, stalled = connect(), connect()
    stalled.sendall(expert_wire.REQUEST_MAGIC)  # a third of a header, then nothing
    start = time.monotonic()
    with connect() as extra:
        assert await asyncio.to_thread(closed_by_the_server, extra)  # a fourth: over the cap
    assert await asyncio.to_thread(closed_by_the_server, stalled)
    assert 0.4 < time.monotonic() - start < 5
    for sock in (idle, connect()):  # idle past the frame timeout, and one in the room the stalled one left
        expert_wire.send_request(sock, 0, hidden, ids, weights)
        assert torch.equal(expert_wire.recv_response(sock, torch.float32, tuple(hidden.shape))[1], want)
        sock.close()
    assert torch.equal(await asyncio.to_thread(client.forward, 0, hidden, ids, weights), want)
    stalled.close()
    client.close()


async def test_the_experts_role_stops_with_its_shutdown_grace(start_server, model_dir, tmp_path, monkeypatch):
    """Stopping lets in-flight calls run for --shutdown-grace, as on the inference roles: with 0,
    a call that needs seconds more is cut off at once."""
    import time

    from tandem.rpc import experts_server

    forward = experts_server.ExpertsServicer.forward
    monkeypatch.setattr(experts_server.ExpertsServicer, "forward", lambda self, *a: time.sleep(3) or forward(self, *a))
    server = await start_server(model=str(model_dir("mixtral")), role="experts", shutdown_grace_s=0,
                                listen=f"unix:{tmp_path}/experts.sock")
    client = GrpcExpertExecutor(server.address, data_plane=False)
    call = asyncio.ensure_future(asyncio.to_thread(client.forward, 0, *batch()))
    await asyncio.sleep(0.5)  # in flight
    start = time.monotonic()
    assert await server.close() == 0
    with pytest.raises((ExpertsUnavailable, RuntimeError)):
        await call
    assert time.monotonic() - start < 2
    client.close()


async def test_stopping_serves_a_connected_attention_process_until_it_leaves(start_server, model_dir, tmp_path):
    """A pod's two containers get SIGTERM together, and the attention side drains its requests
    with the experts' help: the experts process answers until that connection closes."""
    import time

    path = model_dir("mixtral")
    server = await start_server(model=str(path), role="experts", listen=f"unix:{tmp_path}/experts.sock",
                                shutdown_grace_s=60)
    client = GrpcExpertExecutor(server.address)
    await asyncio.to_thread(client.info)  # the data plane is opened after the model is checked
    hidden, ids, weights = batch(tokens=2)
    expected = await asyncio.to_thread(client.forward, 0, hidden, ids, weights)
    assert client._data is not None  # on the data plane
    server.stop.set()  # SIGTERM
    for _ in range(3):  # still answered: the attention side is draining
        assert torch.equal(await asyncio.to_thread(client.forward, 0, hidden, ids, weights), expected)
    start = time.monotonic()
    client.close()  # the attention process exits
    assert await asyncio.wait_for(server.task, 30) == 0
    assert time.monotonic() - start < 30  # when it left, not at the end of the 60 s grace


async def test_spinning_ends_of_the_data_plane_answer_and_shut_down(start_server, model_dir, tmp_path):
    """--spin-us on both roles: the answers are the same, and stopping the server ends the
    connection thread that is polling for the next frame."""
    path = model_dir("mixtral")
    server = await start_server(model=str(path), role="experts", listen=f"unix:{tmp_path}/experts.sock",
                                spin_us=20_000, shutdown_grace_s=0)  # 0: no waiting for the client to leave
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

    def sample(name: str) -> float:
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
        return float(next(l for l in text.splitlines() if l.startswith(name + " ")).split()[-1])

    def latency_count() -> float:
        return sample(contract.EXPERTS_FORWARD_LATENCY + "_count")

    tokens_total = contract.EXPERTS_FORWARD_TOKENS + "_total"
    before_served, before_count, before_tokens = native_end.served, latency_count(), sample(tokens_total)
    hidden, ids, weights = batch(tokens=3)
    assert torch.equal(await asyncio.to_thread(client.forward, 1, hidden, ids, weights),
                       local.forward(1, hidden, ids, weights))
    assert native_end.served == before_served + 1
    assert await eventually(latency_count, before_count + 1) == before_count + 1
    assert sample(tokens_total) == before_tokens + 3  # the native end's frame: its tokens come back with its seconds
    for tokens, dtype in ((3, torch.bfloat16), (local.prefill_tokens + 1, torch.float32)):  # Python's
        hidden, ids, weights = batch(tokens=tokens, dtype=dtype)
        assert torch.equal(await asyncio.to_thread(client.forward, 0, hidden, ids, weights),
                           local.forward(0, hidden, ids, weights))
    hidden, ids, weights = batch()
    for bad_ids, bad_weights in ((ids + 8, weights), (ids.repeat(1, 5), weights.repeat(1, 5))):  # k = 10 of 8
        with pytest.raises(RuntimeError, match="INVALID_ARGUMENT: topk_ids:"):
            await asyncio.to_thread(client.forward, 0, hidden, bad_ids, bad_weights)
    assert native_end.served == before_served + 1  # none of those
    assert await eventually(latency_count, before_count + 3) == before_count + 3
    assert sample(tokens_total) == before_tokens + 3 + 3 + local.prefill_tokens + 1  # the refused ones: none
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
