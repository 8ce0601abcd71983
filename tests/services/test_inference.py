"""The Inference service over real gRPC on real sockets, with the real engine on a tiny checkpoint.

The server here is `tandem.rpc.server.serve`, the coroutine `tandem serve` runs, started in
the test's event loop; test_split.py runs it as `tandem serve` processes.
"""

from __future__ import annotations

import asyncio
import gc
import shutil
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from tandem import contract
from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.rpc.gen import inference_pb2, inference_pb2_grpc

from svc_helpers import NOT_SERVING, SERVING, generate, greedy, token_ids, wait_health

PROMPTS = [[5, 17, 42, 99], [7, 7, 300, 12, 88, 1], [250, 3]]


@pytest.fixture(scope="module")
def reference(model_dir):
    """What the engine itself generates, greedy, for PROMPTS and a text prompt."""
    engine = LLMEngine.from_pretrained(model_dir("mixtral"), device="cpu",
                                       config=EngineConfig(max_model_len=256, max_num_seqs=8, cpu_kv_gib=0.01))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ids = [c.token_ids for c in engine.generate(PROMPTS, params)]
    [text] = engine.generate([engine.encode("The expert said")], params)
    return ids, text


async def read_rest(call) -> list:
    """The remaining responses of a call already read with read() (gRPC forbids mixing in iteration)."""
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        families = text_string_to_metric_families(r.read().decode())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


async def test_concurrent_streams_match_the_engine(start_server, model_dir, reference, tmp_path):
    ids, text = reference
    server = await start_server(model=str(model_dir("mixtral")), listen=f"unix:{tmp_path}/inference.sock",
                                metrics_port=0)
    streams = await asyncio.gather(*(generate(server.address, greedy(p)) for p in PROMPTS))
    assert [token_ids(s) for s in streams] == ids
    for stream, prompt in zip(streams, PROMPTS):
        assert [len(r.token_ids) for r in stream] == [1] * 8  # streamed token by token
        assert [r.finish_reason for r in stream] == [""] * 7 + ["length"]
        assert stream[-1].usage.prompt_tokens == len(prompt) and stream[-1].usage.completion_tokens == 8
        assert not stream[0].HasField("usage")
    by_text = await generate(server.address, inference_pb2.GenerateRequest(
        prompt="The expert said", request_id="mine",
        sampling=inference_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    assert token_ids(by_text) == text.token_ids
    assert "".join(r.text for r in by_text) == text.text
    assert {r.request_id for r in by_text} == {"mine"}
    metrics = scrape(server.metrics_port)
    assert metrics[(contract.TIME_TO_FIRST_TOKEN + "_count", ())] == 4
    # Each request's wait for the batch is part of its time to first token, which is part of its whole.
    assert metrics[(contract.REQUEST_QUEUE_TIME + "_count", ())] == metrics[(contract.E2E_REQUEST_LATENCY + "_count",
                                                                            ())] == 4
    queued, first, whole = (metrics[(name + "_sum", ())] for name in (
        contract.REQUEST_QUEUE_TIME, contract.TIME_TO_FIRST_TOKEN, contract.E2E_REQUEST_LATENCY))
    assert 0 < queued < first < whole
    assert metrics[(contract.PREEMPTIONS + "_total", ())] == 0
    assert metrics[(contract.INTER_TOKEN_LATENCY + "_count", ())] == 4 * 7  # every token after the first
    assert metrics[(contract.GENERATED_TOKENS + "_total", ())] == 4 * 8
    assert metrics[(contract.PROMPT_TOKENS + "_total", ())] == sum(map(len, PROMPTS)) + \
        by_text[-1].usage.prompt_tokens
    assert metrics[(contract.REQUESTS + "_total", (("outcome", "length"),))] == 4
    assert metrics[(contract.EXPERT_CALL_LATENCY + "_count", ())] > 0


async def test_multi_step_decode_streams_a_token_a_response(start_server, model_dir, reference, tmp_path,
                                                            monkeypatch):
    # --num-scheduler-steps 4: the same tokens, each in its own response as its step of the run
    # ends (the engine streams a run), not four to a response at the run's end.
    from tandem.engine import llm_engine

    ids, _ = reference
    streamed, real = [], llm_engine._StreamedRun.__call__
    monkeypatch.setattr(llm_engine._StreamedRun, "__call__",
                        lambda run, i, tokens: streamed.append(i) or real(run, i, tokens))
    server = await start_server(model=str(model_dir("mixtral")), listen=f"unix:{tmp_path}/inference.sock",
                                metrics_port=0, num_scheduler_steps=4)
    streams = await asyncio.gather(*(generate(server.address, greedy(p)) for p in PROMPTS))
    assert [token_ids(s) for s in streams] == ids
    for stream in streams:
        assert [len(r.token_ids) for r in stream] == [1] * 8
        assert stream[-1].finish_reason == "length" and stream[-1].usage.completion_tokens == 8
    assert max(streamed) >= 1  # runs of several steps took place, streamed
    metrics = scrape(server.metrics_port)
    assert metrics[(contract.INTER_TOKEN_LATENCY + "_count", ())] == 3 * 7  # still a gap per token
    assert metrics[(contract.GENERATED_TOKENS + "_total", ())] == 3 * 8


BAD_REQUESTS = [
    (inference_pb2.GenerateRequest(), "prompt"),
    (inference_pb2.GenerateRequest(prompt="hi", prompt_token_ids=[1]), "prompt"),
    (greedy([5, 10_000]), "prompt_token_ids"),
    (greedy([5], max_tokens=0), "max_tokens"),
    (greedy([5], max_tokens=300), "max_tokens"),  # beyond the 256-token context
    (inference_pb2.GenerateRequest(prompt_token_ids=[5] * 256), "prompt"),  # no room left, max_tokens unset
    (greedy([5] * 250, max_tokens=7), "max_tokens"),  # set, it must fit: unset, 6 tokens would come
    (inference_pb2.GenerateRequest(prompt_token_ids=[5], request_id="r" * 257), "request_id"),
    (greedy([5], top_p=1.5), "top_p"),
    (greedy([5], top_k=-2), "top_k"),  # -1 is off, as in vLLM
    (greedy([5], min_p=1.5), "min_p"),
    (greedy([5], repetition_penalty=0), "repetition_penalty"),  # set to 0, not unset: refused
    (greedy([5], presence_penalty=2.5), "presence_penalty"),
    (greedy([5], frequency_penalty=-3), "frequency_penalty"),
    (greedy([5], logprobs=21), "logprobs"),
    (greedy([5], logprobs=-1), "logprobs"),
    (greedy([5], prompt_logprobs=30), "prompt_logprobs"),
    (inference_pb2.GenerateRequest(prompt_token_ids=[5], sampling=inference_pb2.SamplingParams(temperature=-1)),
     "temperature"),
    (inference_pb2.GenerateRequest(prompt_token_ids=[5], sampling=inference_pb2.SamplingParams(
        temperature=float("inf"))), "temperature"),
    (inference_pb2.GenerateRequest(prompt_token_ids=[5], sampling=inference_pb2.SamplingParams(
        temperature=float("nan"))), "temperature"),
]


async def test_bad_requests_are_invalid_argument_naming_the_field(start_server, model_dir):
    server = await start_server(model=str(model_dir("mixtral")), metrics_port=0)
    for request, field_name in BAD_REQUESTS:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(server.address, request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
        assert err.value.details().startswith(f"{field_name}:"), (request, err.value.details())
    metrics = scrape(server.metrics_port)
    assert metrics[(contract.REQUESTS + "_total", (("outcome", "invalid_argument"),))] == len(BAD_REQUESTS)
    assert token_ids(await generate(server.address, greedy([5]))) != []  # still serving


async def test_full_waiting_queue_is_resource_exhausted(start_server, model_dir):
    server = await start_server(model=str(model_dir("mixtral")), max_num_seqs=1, max_waiting=1, metrics_port=0)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        running = stub.Generate(greedy([5, 6], max_tokens=250))
        await running.read()  # running now; the one-sequence batch is full
        waiting = stub.Generate(greedy([7, 8], max_tokens=4))
        # queued before the next is sent: two calls in flight at once may reach the server in either order
        await eventually(lambda: scrape(server.metrics_port), lambda m: m[(contract.WAITING_REQUESTS, ())] == 1)
        refused = stub.Generate(greedy([9, 10], max_tokens=4))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await refused.read()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "waiting" in err.value.details()
        running.cancel()
        assert token_ids(await read_rest(waiting)) != []
    metrics = scrape(server.metrics_port)
    assert metrics[(contract.REQUESTS + "_total", (("outcome", "resource_exhausted"),))] == 1


async def test_cancelled_stream_frees_its_kv_blocks(start_server, model_dir):
    server = await start_server(model=str(model_dir("mixtral")), metrics_port=0)
    used = (contract.KV_BLOCKS_USED, (("tier", "device"),))
    cancelled = (contract.REQUESTS + "_total", (("outcome", "cancelled"),))
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(greedy(list(range(3, 60)), max_tokens=150))
        await call.read()
        await call.read()  # decoding: its blocks are in use
        assert scrape(server.metrics_port)[used] >= 4
        call.cancel()
    metrics = await eventually(lambda: scrape(server.metrics_port), lambda m: m[cancelled] == 1)
    assert metrics[used] == 0
    assert metrics[(contract.RUNNING_REQUESTS, ())] == 0


async def eventually(read, done, timeout_s: float = 30):
    """Reads until `done(value)`: the server aborts a cancelled request asynchronously."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not done(value := read()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not reached in {timeout_s} s; last value {value}")
        await asyncio.sleep(0.02)
    return value


async def test_tokenize_model_info_health_and_reflection(start_server, model_dir):
    path = model_dir("mixtral")
    server = await start_server(model=str(path))
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        tokens = await stub.Tokenize(inference_pb2.TokenizeRequest(text="The expert said"))
        info = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", contract.INFERENCE_SERVICE):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == SERVING
    from tokenizers import Tokenizer

    expected = Tokenizer.from_file(str(path / "tokenizer.json")).encode("The expert said").ids
    assert list(tokens.token_ids) == expected
    assert info.architecture == "MixtralForCausalLM" and info.max_model_len == 256 and info.num_layers == 2
    assert info.has_tokenizer and info.role == "all" and info.device == "cpu" and info.dtype == "float32"
    assert info.vocab_size == Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    services = await asyncio.to_thread(list_services, server.address)
    assert {contract.INFERENCE_SERVICE, "grpc.health.v1.Health"} <= set(services)


async def test_a_failed_forward_pass_ends_its_stream_with_internal(start_server, model_dir, monkeypatch):
    from tandem.engine.model_runner import ModelRunner

    server = await start_server(model=str(model_dir("mixtral")))
    execute, calls = ModelRunner.execute, []

    def failing_fourth_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("kernel fault")
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "execute", failing_fourth_step)
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(greedy(PROMPTS[0], max_tokens=20))
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for response in call:
                got.append(response)
    assert err.value.code() == grpc.StatusCode.INTERNAL and "model failed" in err.value.details()
    assert len(token_ids(got)) == 3 and not any(r.finish_reason for r in got)  # the steps before it
    monkeypatch.setattr(ModelRunner, "execute", execute)
    assert len(token_ids(await generate(server.address, greedy(PROMPTS[0])))) == 8  # the server goes on


async def test_a_request_over_the_size_limit_is_refused_unread(start_server, model_dir):
    server = await start_server(model=str(model_dir("mixtral")))
    huge = inference_pb2.GenerateRequest(prompt="x" * (17 << 20))
    async with grpc.aio.insecure_channel(server.address, options=(("grpc.max_send_message_length", 64 << 20),)) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await read_rest(inference_pb2_grpc.InferenceStub(ch).Generate(huge))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(token_ids(await generate(server.address, greedy(PROMPTS[0])))) == 8


async def test_a_dead_serving_loop_fails_its_requests_and_the_liveness_check(start_server, model_dir, monkeypatch):
    from tandem.metrics import ServingMetrics

    server = await start_server(model=str(model_dir("mixtral")))
    prompt = greedy(PROMPTS[0], max_tokens=50)
    assert len(token_ids(await generate(server.address, prompt))) == 50  # serving

    def broken(self, stats):  # a bug in the loop thread's own code, after the engine's step
        raise RuntimeError("bookkeeping bug")

    monkeypatch.setattr(ServingMetrics, "record_engine_stats", broken)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the stream ends with an error, it does not hang
            await asyncio.wait_for(read_rest(stub.Generate(prompt)), 30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "bookkeeping bug" in err.value.details()
        await wait_health(server.address, NOT_SERVING, service="", timeout_s=10)  # what a liveness probe asks
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=contract.INFERENCE_SERVICE))
        assert reply.status == NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:  # refused at once, not queued for a loop that is gone
            await asyncio.wait_for(read_rest(stub.Generate(prompt)), 30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "serving loop stopped" in err.value.details()


async def test_an_engine_step_that_raises_fails_its_requests_and_frees_their_kv_in_the_gauges(
        start_server, model_dir, monkeypatch):
    from tandem.engine.llm_engine import LLMEngine

    server = await start_server(model=str(model_dir("mixtral")), metrics_port=0)
    step, calls = LLMEngine.step, []

    def failing_third_step(self, *args, **kwargs):  # a bug in the engine, past the forward pass's own handling
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("scheduler bug")
        return step(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "step", failing_third_step)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(server.address, greedy(PROMPTS[0], max_tokens=20))
    assert err.value.code() == grpc.StatusCode.INTERNAL and "scheduler bug" in err.value.details()
    metrics = scrape(server.metrics_port)
    assert metrics[(contract.KV_BLOCKS_USED, (("tier", "device"),))] == 0
    assert metrics[(contract.RUNNING_REQUESTS, ())] == 0


async def test_a_request_id_already_running_is_already_exists(start_server, model_dir):
    server = await start_server(model=str(model_dir("mixtral")), metrics_port=0)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        first = stub.Generate(inference_pb2.GenerateRequest(
            prompt_token_ids=[5, 6], request_id="job-1", sampling=inference_pb2.SamplingParams(
                max_tokens=200, temperature=0.0, ignore_eos=True)))
        await first.read()  # running
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await read_rest(stub.Generate(inference_pb2.GenerateRequest(prompt_token_ids=[7], request_id="job-1")))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "'job-1' is already running" in err.value.details()
        first.cancel()
    metrics = scrape(server.metrics_port)
    assert metrics[(contract.REQUESTS + "_total", (("outcome", "invalid_argument"),))] == 1


async def test_a_request_gone_before_it_was_admitted_counts_as_cancelled(start_server, model_dir, monkeypatch):
    import threading

    from tandem.engine.llm_engine import LLMEngine

    server = await start_server(model=str(model_dir("mixtral")), metrics_port=0)
    encoding, release, encode = threading.Event(), threading.Event(), LLMEngine.encode

    def slow_encode(self, text):  # a long text, still being tokenized when the client goes
        encoding.set()
        release.wait(30)
        return encode(self, text)

    monkeypatch.setattr(LLMEngine, "encode", slow_encode)
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(inference_pb2.GenerateRequest(prompt="hello"))
        await asyncio.to_thread(encoding.wait, 30)
        call.cancel()
        cancelled = (contract.REQUESTS + "_total", (("outcome", "cancelled"),))
        await eventually(lambda: scrape(server.metrics_port), lambda m: m.get(cancelled) == 1)
    release.set()


def list_services(address: str) -> list[str]:
    # The reflection client is synchronous: run it off the event loop the server runs on.
    with grpc.insecure_channel(address) as channel:
        return ProtoReflectionDescriptorDatabase(channel).get_services()


async def test_model_without_tokenizer(start_server, model_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(model_dir("mixtral"), bare, ignore=shutil.ignore_patterns("tokenizer.json"))
    server = await start_server(model=str(bare))
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Tokenize(inference_pb2.TokenizeRequest(text="hi"))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Generate(inference_pb2.GenerateRequest(prompt="hi")).read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("prompt:")
    stream = await generate(server.address, greedy([5, 6]))
    assert len(token_ids(stream)) == 8 and all(r.text == "" for r in stream)


async def test_an_unset_max_tokens_ends_at_the_context_with_length(start_server, model_dir):
    server = await start_server(model=str(model_dir("mixtral")))  # max_model_len 256
    request = inference_pb2.GenerateRequest(
        prompt_token_ids=[5] * 250, sampling=inference_pb2.SamplingParams(temperature=0.0, ignore_eos=True))
    stream = await generate(server.address, request)
    assert len(token_ids(stream)) == 6 and stream[-1].finish_reason == "length"


async def test_the_loaded_heap_is_frozen_while_serving_and_thawed_when_it_stops(start_server, model_dir):
    # a full collection would walk the whole loaded heap (~0.2 s on a real model) inside a decode
    assert gc.get_freeze_count() == 0
    server = await start_server(model=str(model_dir("mixtral")))
    frozen = gc.get_freeze_count()
    assert frozen > len(gc.get_objects())  # what a collection walks now: what came after the load
    assert len(token_ids(await generate(server.address, greedy([5, 6], max_tokens=4)))) == 4
    assert await server.close() == 0
    assert gc.get_freeze_count() == 0  # the embedding process's heap is the collector's again


async def test_a_checkpoint_that_fails_to_load_exits_1_with_one_line(start_server, model_dir, tmp_path, caplog):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir("mixtral"), broken, ignore=shutil.ignore_patterns("*.safetensors"))
    server = await start_server(model=str(broken), wait_serving=False)
    assert await asyncio.wait_for(server.task, 60) == 1
    [record] = [r for r in caplog.records if r.name == "tandem.serve" and r.levelname == "ERROR"]
    assert record.getMessage().startswith("cannot load the model: ") and record.exc_info is None


async def test_shutdown_cancels_streams_left_after_the_grace(start_server, model_dir):
    server = await start_server(model=str(model_dir("mixtral")), shutdown_grace_s=0)
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(greedy([5, 6], max_tokens=250))
        first = await call.read()
        server.stop.set()
        rest = await read_rest(call)
    assert rest[-1].finish_reason == "cancelled"
    assert len(token_ids([first, *rest])) < 250
    assert await asyncio.wait_for(server.task, 60) == 0


async def test_prefix_cache_hits_are_reported_and_counted(start_server, model_dir):
    server = await start_server(model=str(model_dir("mixtral")), metrics_port=0)
    prompt = list(range(10, 50))  # 40 tokens: two full 16-token blocks to reuse
    first = await generate(server.address, greedy(prompt, max_tokens=2))
    again = await generate(server.address, greedy(prompt, max_tokens=2))
    assert first[-1].usage.cached_tokens == 0
    assert again[-1].usage.cached_tokens == 32 and token_ids(again) == token_ids(first)
    assert scrape(server.metrics_port)[(contract.PREFIX_CACHED_TOKENS + "_total", ())] == 32


async def test_a_cache_salt_shares_the_prefix_cache_only_with_its_own(start_server, model_dir):
    server = await start_server(model=str(model_dir("mixtral")))
    prompt = list(range(10, 50))  # two full blocks

    async def cached(salt: str | None) -> int:
        request = greedy(prompt, max_tokens=2)
        if salt is not None:
            request.cache_salt = salt
        return (await generate(server.address, request))[-1].usage.cached_tokens

    assert await cached("tenant-a") == 0
    assert await cached("tenant-b") == 0  # the same prompt under another salt
    assert await cached(None) == 0  # nor unsalted
    assert await cached("tenant-a") == 32
    assert await cached(None) == 32
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cached("")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in info.value.details()


async def test_no_enable_prefix_caching_computes_every_prompt_in_full(start_server, model_dir):
    server = await start_server(model=str(model_dir("mixtral")), metrics_port=0, enable_prefix_caching=False)
    prompt = list(range(10, 50))
    first = await generate(server.address, greedy(prompt, max_tokens=2))
    again = await generate(server.address, greedy(prompt, max_tokens=2))
    assert first[-1].usage.cached_tokens == again[-1].usage.cached_tokens == 0
    assert token_ids(again) == token_ids(first)
    assert scrape(server.metrics_port)[(contract.PREFIX_CACHED_TOKENS + "_total", ())] == 0


async def test_ports_that_cannot_be_bound_are_refused_naming_the_flag(start_server, model_dir):
    model = str(model_dir("mixtral"))
    first = await start_server(model=model, metrics_port=0, wait_serving=False)
    grpc_port = int(first.address.rpartition(":")[2])
    cases = (  # (--listen, --metrics-port, what the one log line says)
        (f"127.0.0.1:{grpc_port}", "0", f"--listen 127.0.0.1:{grpc_port}: cannot bind"),  # not half its clients
        ("127.0.0.1:0", str(first.metrics_port), f"--metrics-port: cannot serve /metrics on port {first.metrics_port}"),
    )
    for listen, metrics_port, message in cases:  # as a user runs it: `tandem serve`, its exit code and log
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tandem.cli", "serve", "--model", model, "--listen", listen, "--metrics-port",
            metrics_port, "--device", "cpu", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(child.communicate(), 120)
        errors = [line for line in out.decode().splitlines() if " ERROR " in line]
        assert child.returncode == 2, out.decode()[-2000:]  # as a bad flag: no traceback
        assert len(errors) == 1 and message in errors[0], errors
    # the refused servers left nothing bound: a server stopped frees its ports for the next
    assert await first.close() == 0
    again = await start_server(model=model, listen=f"127.0.0.1:{grpc_port}", metrics_port=first.metrics_port)
    assert scrape(again.metrics_port)[(contract.REQUESTS + "_total", (("outcome", "stop"),))] == 0


async def test_logprobs_and_penalties_stream_one_entry_per_token(start_server, model_dir, monkeypatch):
    # A multi-step decode streams a token a response: each response carries its token's logprobs,
    # the same as the engine's in-process (tests/engine/test_sampling_features.py checks those
    # against transformers), and the penalty reaches the engine.
    prompt = PROMPTS[1]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3, repetition_penalty=1.5)
    engine = LLMEngine.from_pretrained(model_dir("mixtral"), device="cpu",
                                       config=EngineConfig(max_model_len=256, max_num_seqs=8, cpu_kv_gib=0.01))
    [expected] = engine.generate([prompt], params)
    server = await start_server(model=str(model_dir("mixtral")), num_scheduler_steps=4)
    stream = await generate(server.address, greedy(prompt, logprobs=3, repetition_penalty=1.5))
    assert token_ids(stream) == expected.token_ids
    assert [len(r.logprobs) for r in stream] == [len(r.token_ids) for r in stream] == [1] * 8
    got = [e for r in stream for e in r.logprobs]
    for entry, want in zip(got, expected.logprobs):
        assert entry.rank == want.rank and entry.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [(t.token_id, pytest.approx(t.logprob, abs=1e-5)) for t in entry.top] == list(want.top)
    plain = await generate(server.address, greedy(prompt))
    assert token_ids(plain) != expected.token_ids  # the penalty made a difference
    assert all(not r.logprobs for r in plain)
    assert all(not r.prompt_logprobs for r in plain + stream)


async def test_prompt_logprobs_arrive_in_the_first_message(start_server, model_dir):
    prompt = PROMPTS[1]
    engine = LLMEngine.from_pretrained(model_dir("mixtral"), device="cpu",
                                       config=EngineConfig(max_model_len=256, max_num_seqs=8, cpu_kv_gib=0.01))
    [expected] = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2))
    server = await start_server(model=str(model_dir("mixtral")))
    stream = await generate(server.address, greedy(prompt, max_tokens=3, prompt_logprobs=2))
    assert [len(r.prompt_logprobs) for r in stream] == [len(prompt) - 1] + [0] * (len(stream) - 1)
    for entry, want in zip(stream[0].prompt_logprobs, expected.prompt_logprobs[1:]):
        assert entry.rank == want.rank and entry.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t.token_id for t in entry.top] == [t for t, _ in want.top]
