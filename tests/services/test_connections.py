"""The Inference API's connection lifetime (tandem.rpc.server.connection_options): connections aged out
between calls, keepalive pings ending a vanished client's calls, clients' own keepalive tolerated."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from conn_helpers import FreezingProxy, HeldSteps, slowed
from svc_helpers import channel, eventually, greedy
from test_metrics import scrape

from tandem import contract
from tandem.cli import main
from tandem.engine.llm_engine import LLMEngine
from tandem.rpc.cli_serve import options_from_args
from tandem.rpc.gen import inference_pb2, inference_pb2_grpc
from tandem.rpc.server import connection_options, server_options

READY, IDLE = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.IDLE
PROMPT = [1, 2, 3, 4]
LONG_STREAM = 240  # tokens: with the prompt, within the test servers' max_model_len (256)


async def _model_info(ch: grpc.aio.Channel) -> None:
    await inference_pb2_grpc.InferenceStub(ch).GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=30)


async def _left_ready(ch: grpc.aio.Channel, timeout_s: float) -> bool:
    """Whether the channel leaves READY within timeout_s."""
    assert ch.get_state() == READY
    try:
        await asyncio.wait_for(ch.wait_for_state_change(READY), timeout_s)
    except TimeoutError:
        return False
    return True


async def _responses(call):
    """The rest of a stream whose first response was read with read() (which its iterator cannot follow)."""
    while (response := await call.read()) != grpc.aio.EOF:
        yield response


# -- connection age --------------------------------------------------------------------------


async def test_a_connection_is_aged_out_between_calls(start_server, model_dir):
    server = await start_server(model=str(model_dir()), max_connection_age_s=1.0)
    async with channel(server.address) as ch:
        await _model_info(ch)
        assert await _left_ready(ch, 30)
        assert ch.get_state() == IDLE  # GOAWAY: nothing failed, the next call connects again
        await _model_info(ch)
        assert ch.get_state() == READY


async def test_without_an_age_a_connection_stays(start_server, model_dir):
    server = await start_server(model=str(model_dir()), max_connection_age_s=0)
    async with channel(server.address) as ch:
        await _model_info(ch)
        assert not await _left_ready(ch, 2.5)  # the age above is 1 s (+-10%)


async def test_a_stream_outlives_its_connections_age(start_server, model_dir, monkeypatch):
    held = HeldSteps(LLMEngine.step)  # the prefill's step gives the first token; the next waits for release()
    monkeypatch.setattr(LLMEngine, "step", held.step)
    server = await start_server(model=str(model_dir()), max_connection_age_s=1.0)
    try:
        async with channel(server.address) as ch:
            call = inference_pb2_grpc.InferenceStub(ch).Generate(greedy(PROMPT, max_tokens=LONG_STREAM), timeout=60)
            first = await call.read()
            assert await _left_ready(ch, 30) and ch.get_state() == IDLE  # aged out with the stream running
            await _model_info(ch)  # on a new connection
            assert ch.get_state() == READY
            held.release()
            rest = [r async for r in _responses(call)]
    finally:
        held.release()
    tokens = [t for r in [first, *rest] for t in r.token_ids]
    assert len(tokens) == LONG_STREAM and rest[-1].finish_reason == "length"
    assert await call.code() == grpc.StatusCode.OK


# -- keepalive ---------------------------------------------------------------------------------


def _requests(port: int, outcome: str) -> float:
    return scrape(port)[contract.REQUESTS + "_total"].get((("outcome", outcome),), 0.0)


def _blocks_used(port: int) -> float:
    return sum(scrape(port)[contract.KV_BLOCKS_USED].values())


@pytest.mark.parametrize("keepalive_time_s", [0.5, 0])
async def test_keepalive_ends_a_vanished_clients_request(start_server, model_dir, monkeypatch, keepalive_time_s):
    # each token takes 30 ms or more: the stream runs for 7 s or more, far past what this test waits
    monkeypatch.setattr(LLMEngine, "step", slowed(LLMEngine.step, 0.03))
    server = await start_server(model=str(model_dir()), metrics_port=0, keepalive_time_s=keepalive_time_s,
                                keepalive_timeout_s=0.5)
    proxy = await FreezingProxy(server.address).start()
    try:
        async with channel(proxy.address) as ch:
            call = inference_pb2_grpc.InferenceStub(ch).Generate(greedy(PROMPT, max_tokens=LONG_STREAM), timeout=60)
            await call.read()
            assert await eventually(lambda: _blocks_used(server.metrics_port) > 0, True)  # recorded after the step
            proxy.freeze()  # the client vanishes, its TCP connection left open
            cancelled = await eventually(lambda: _requests(server.metrics_port, "cancelled"), 1.0,
                                         timeout_s=30 if keepalive_time_s else 3)
            call.cancel()
    finally:
        await proxy.close()  # without keepalive, only this ends the request
    if keepalive_time_s:
        assert cancelled == 1.0 and _blocks_used(server.metrics_port) == 0
    else:
        assert cancelled == 0.0  # still running after three times the keepalive's time and timeout above


async def test_a_client_may_ping_at_the_servers_interval(start_server, model_dir):
    server = await start_server(model=str(model_dir()), min_client_ping_interval_s=0.5)
    # grpcio's client pings at most once a second. Here it pings every second, with no call in flight
    # and no data between pings: five over the 5 s below, where gRPC's defaults (a ping per 5 minutes with
    # calls, per 2 hours without) answer the fourth (the third strike) with GOAWAY too_many_pings.
    options = [("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.http2.max_pings_without_data", 0)]
    async with grpc.aio.insecure_channel(server.address, options=options) as ch:
        await _model_info(ch)
        assert not await _left_ready(ch, 5.0)
        await _model_info(ch)


# -- flags -------------------------------------------------------------------------------------


def _parse(*argv: str):
    from tandem.cli import build_parser

    return options_from_args(build_parser().parse_args(["serve", *argv]))


def test_flags_reach_the_server_options(tmp_path):
    opts = _parse("--model", str(tmp_path))
    # the defaults, which the operator's pods get (it renders none of these flags)
    assert (opts.max_connection_age_s, opts.keepalive_time_s, opts.keepalive_timeout_s) == (300, 20, 10)
    assert dict(connection_options(opts)) == {
        "grpc.max_connection_age_ms": 300_000, "grpc.keepalive_time_ms": 20_000, "grpc.keepalive_timeout_ms": 10_000,
        "grpc.http2.ping_timeout_ms": 10_000, "grpc.keepalive_permit_without_calls": 1,
        "grpc.http2.min_ping_interval_without_data_ms": 5_000}
    opts = _parse("--model", str(tmp_path), "--max-connection-age", "0.5", "--keepalive-time", "0",
                  "--keepalive-timeout", "2.5")
    assert (opts.max_connection_age_s, opts.keepalive_time_s, opts.keepalive_timeout_s) == (0.5, 0, 2.5)
    options = dict(connection_options(opts))
    assert options["grpc.max_connection_age_ms"] == 500 and options["grpc.keepalive_timeout_ms"] == 2500
    assert options["grpc.keepalive_time_ms"] == 2**31 - 1  # never
    assert "grpc.max_connection_age_ms" not in dict(connection_options(_parse("--model", str(tmp_path),
                                                                              "--max-connection-age", "0")))
    # the experts role's server (its one peer: the pod's attention process, on a Unix socket) gets none of them
    experts = dict(server_options(_parse("--model", str(tmp_path), "--role", "experts")))
    assert not {"grpc.max_connection_age_ms", "grpc.keepalive_time_ms"} & set(experts)
    assert dict(server_options(opts)).items() >= dict(connection_options(opts)).items()


@pytest.mark.parametrize("argv, message", [
    (["--max-connection-age", "-1"], "--max-connection-age must be a number of seconds in 0..2147483, got -1.0"),
    (["--max-connection-age", "3e6"], "--max-connection-age must be a number of seconds in 0..2147483"),
    (["--keepalive-time", "nan"], "--keepalive-time must be a number of seconds in 0..2147483, got nan"),
    (["--keepalive-timeout", "-0.5"], "--keepalive-timeout must be a number of seconds in 0..2147483"),
    (["--keepalive-timeout", "0"], "--keepalive-timeout must be a number of seconds > 0, got 0"),
    (["--role", "experts", "--keepalive-time", "5"],
     "--keepalive-time is for the Inference API (--role all or attention), not --role experts"),
    (["--role", "experts", "--max-connection-age", "0"], "--max-connection-age is for the Inference API"),
])
def test_bad_connection_flags_exit_2_with_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", "--model", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
