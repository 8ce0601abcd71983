"""API keys on the Inference API (`tandem serve --api-key`, TANDEM_API_KEY; tandem.rpc.auth), over real sockets."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from svc_helpers import SERVING, eventually, greedy
from test_metrics import scrape

from tandem import contract
from tandem.rpc.auth import ENV, ApiKeyInterceptor, client_metadata, server_keys
from tandem.rpc.gen import inference_pb2, inference_pb2_grpc

OLD, NEW = "tk-old-0123456789", "tk-new-9876543210"


async def _generate(address: str, metadata=()) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return [t async for r in stub.Generate(greedy([1, 2, 3], max_tokens=4), metadata=metadata, timeout=60)
                for t in r.token_ids]


async def _refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer <key>" in info.value.details()
    return info.value


async def test_calls_need_one_of_the_keys_health_and_reflection_do_not(start_server, model_dir):
    server = await start_server(model=str(model_dir()), api_keys=(OLD, NEW))
    for metadata in ((), client_metadata("wrong"), (("authorization", OLD),), (("authorization", f"Basic {OLD}"),),
                     client_metadata(OLD) + client_metadata(NEW)):  # no key, a wrong one, no scheme, another, two
        await _refused(_generate(server.address, metadata))
    # Both keys pass (a rotation's old and new), the scheme in any case, and they give the same tokens.
    tokens = await _generate(server.address, client_metadata(OLD))
    assert len(tokens) == 4
    assert await _generate(server.address, client_metadata(NEW)) == tokens
    assert await _generate(server.address, (("authorization", f"bearer {NEW}"),)) == tokens
    async with grpc.aio.insecure_channel(server.address) as channel:
        # Every method of the service, unary ones too.
        stub = inference_pb2_grpc.InferenceStub(channel)
        await _refused(stub.Tokenize(inference_pb2.TokenizeRequest(text="hi")))
        await _refused(stub.GetModelInfo(inference_pb2.GetModelInfoRequest()))
        reply = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), metadata=client_metadata(NEW))
        assert reply.max_model_len == 256
        # Health and reflection answer without a key: the kubelet's probes and grpcurl's listing.
        check = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=contract.INFERENCE_SERVICE))
        assert check.status == SERVING
        listing = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        services = [s.name async for r in listing for s in r.list_services_response.service]
        assert contract.INFERENCE_SERVICE in services


async def test_refused_calls_admit_nothing(start_server, model_dir):
    server = await start_server(model=str(model_dir()), api_keys=(NEW,), metrics_port=0)

    def admitted() -> tuple[float, float]:
        samples = scrape(server.metrics_port)
        requests = sum(samples.get(contract.REQUESTS + "_total", {}).values())
        return requests, sum(samples.get(contract.PROMPT_TOKENS + "_total", {}).values())

    for _ in range(3):
        await _refused(_generate(server.address))
    assert admitted() == (0, 0)
    assert len(await _generate(server.address, client_metadata(NEW))) == 4
    assert await eventually(admitted, (1, 3)) == (1, 3)


def test_server_keys_from_flags_and_environment():
    assert server_keys(None, {}) == ()
    assert server_keys(["a"], {ENV: "b"}) == ("a", "b")
    assert server_keys(["a", "a"], {ENV: "a"}) == ("a",)
    for bad in ("", "  ", " padded", "tab\tkey"):
        with pytest.raises(ValueError, match="API key"):
            server_keys([bad], {})
    with pytest.raises(ValueError, match=ENV):
        server_keys(None, {ENV: ""})
    with pytest.raises(ValueError):
        ApiKeyInterceptor((), contract.INFERENCE_SERVICE)


def test_authorized_header_forms():
    interceptor = ApiKeyInterceptor(("k1", "k2"), contract.INFERENCE_SERVICE)
    assert interceptor.authorized((("authorization", "Bearer k1"),))
    assert interceptor.authorized((("authorization", "BEARER k2"), ("other", "x")))
    assert not interceptor.authorized((("authorization", "Bearer k3"),))
    assert not interceptor.authorized((("authorization", "Bearer k1x"),))
    assert not interceptor.authorized((("authorization", "Bearer"),))
    assert not interceptor.authorized((("authorization", "k1"),))
    assert not interceptor.authorized(None)


@pytest.mark.slow
def test_cli_client_sends_the_key_and_names_the_flag_when_refused(serve_process, model_dir):
    server = serve_process("--model", str(model_dir()), "--listen", "127.0.0.1:0", "--metrics-port", "0",
                           "--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "4", "--cpu-kv-gib", "0.01",
                           "--api-key", NEW)
    base = [sys.executable, "-m", "tandem.cli", "generate", "--server", server.address, "--prompt-ids", "1,2,3",
            "--max-tokens", "3", "--temperature", "0", "--json"]
    refused = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    assert "API key" in refused.stderr and "--api-key" in refused.stderr
    assert "Traceback" not in refused.stderr
    by_flag = subprocess.run([*base, "--api-key", NEW], capture_output=True, text=True, timeout=120)
    assert by_flag.returncode == 0, by_flag.stderr
    by_env = subprocess.run(base, capture_output=True, text=True, timeout=120, env={**os.environ, ENV: NEW})
    assert by_env.returncode == 0, by_env.stderr
    assert by_env.stdout == by_flag.stdout
