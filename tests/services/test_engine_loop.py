"""The serving loop's own bookkeeping, on the real engine, with the loop thread held at chosen
points: callers that give up while their command waits, aborts that arrive late, and a loop
thread that dies."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest

from tandem import contract
from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.metrics import ServingMetrics
from tandem.rpc.engine_loop import EngineLoop
from tandem.rpc.errors import ServerUnavailable

PROMPT = [5, 17, 42, 99]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture
def loop(model_dir):
    engine = LLMEngine.from_pretrained(model_dir("mixtral"), device="cpu",
                                       config=EngineConfig(max_model_len=256, max_num_seqs=8, cpu_kv_gib=0.01))
    fatal: list[BaseException] = []
    serving = EngineLoop(engine, ServingMetrics(), on_fatal=fatal.append)
    serving.fatal = fatal
    serving.start()
    yield serving
    serving.stop(timeout=10)


async def hold(loop: EngineLoop) -> tuple[threading.Event, asyncio.Task]:
    """Holds the loop thread inside a command until the returned event is set."""
    entered, release = threading.Event(), threading.Event()

    def wait(engine):
        entered.set()
        release.wait(10)

    task = asyncio.create_task(loop.run_on_engine(wait))
    assert await asyncio.to_thread(entered.wait, 10)
    return release, task


async def drain(queue: asyncio.Queue) -> list:
    outputs = []
    while not (outputs and outputs[-1].finished):
        item = await asyncio.wait_for(queue.get(), 30)
        if isinstance(item, BaseException):
            raise item
        outputs.append(item)
    return outputs


async def finished_with(loop: EngineLoop, request_id: str, max_tokens: int):
    outputs = await drain(await loop.submit(request_id, PROMPT, params(max_tokens)))
    return outputs[-1].finish_reason, sum(len(o.new_token_ids) for o in outputs)


async def test_callers_that_give_up_while_their_command_waits_leave_nothing_behind(loop):
    release, held = await hold(loop)
    submit = asyncio.create_task(loop.submit("gone", PROMPT, params(200)))
    tokenize = asyncio.create_task(loop.run_on_engine(lambda engine: engine.stats()))
    await asyncio.sleep(0)  # both queued behind the held command
    submit.cancel()  # a deadline or a disconnect while the loop thread is busy
    tokenize.cancel()
    release.set()
    await held
    for task in (submit, tokenize):
        with pytest.raises(asyncio.CancelledError):
            await task
    # The loop lives on, and the cancelled request was never left running.
    assert await finished_with(loop, "next", 5) == ("length", 5)
    assert not loop.fatal
    stats = await loop.run_on_engine(lambda engine: engine.stats())
    assert stats.num_running == stats.num_waiting == 0 and sum(stats.kv_blocks_used.values()) == 0


async def test_a_caller_that_gives_up_during_its_admission_has_its_request_taken_out(loop, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    add_request = loop.engine.add_request

    def slow_add(*args):  # holds the loop thread inside the admission
        entered.set()
        release.wait(10)
        return add_request(*args)

    monkeypatch.setattr(loop.engine, "add_request", slow_add)
    submit = asyncio.create_task(loop.submit("late", PROMPT, params(200)))
    assert await asyncio.to_thread(entered.wait, 10)
    submit.cancel()  # too late to skip the admission: the request gets in, then must come out
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await submit
    stats = await loop.run_on_engine(lambda engine: engine.stats())
    assert stats.num_running == stats.num_waiting == 0 and sum(stats.kv_blocks_used.values()) == 0
    assert not loop.fatal


async def test_text_is_encoded_off_the_loop_thread(loop, monkeypatch):
    threads = []
    encode_batch = loop.engine.tokenizer.encode_batch

    def recording(*args, **kwargs):
        threads.append(threading.current_thread())
        return encode_batch(*args, **kwargs)

    monkeypatch.setattr(loop.engine.tokenizer, "encode_batch", recording)
    outputs = await drain(await loop.submit("text", "The expert said", params(3)))
    assert outputs[-1].finish_reason == "length"
    assert threads and loop._thread not in threads  # a long text must not hold up every stream's steps


async def test_a_late_abort_leaves_a_new_request_with_the_same_id_alone(loop):
    first = await loop.submit("x", PROMPT, params(2))
    await drain(first)  # finished; its handler's abort (client gone before the last read) comes late:
    release, held = await hold(loop)
    second = asyncio.create_task(loop.submit("x", PROMPT, params(12)))
    await asyncio.sleep(0)
    loop.abort("x", first)  # queued after the second request's admission
    release.set()
    await held
    outputs = await drain(await second)
    assert outputs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outputs) == 12


async def test_a_dead_loop_fails_its_requests_and_queued_callers_and_refuses_new_ones(loop):
    running = await loop.submit("running", PROMPT, params(200))
    release, held = await hold(loop)

    def bug():
        raise RuntimeError("loop bug")

    loop._call(bug)  # runs after the held command: a bug in the loop's own code
    queued = asyncio.create_task(loop.submit("queued", PROMPT, params(5)))
    await asyncio.sleep(0)
    release.set()
    await held
    with pytest.raises(ServerUnavailable, match="loop bug"):  # its stream ends, it does not hang
        await drain(running)
    with pytest.raises(ServerUnavailable, match="loop bug"):  # admitted by no one: failed, not left waiting
        await asyncio.wait_for(queued, 10)
    assert [type(e) for e in loop.fatal] == [RuntimeError]
    with pytest.raises(ServerUnavailable, match="serving loop stopped"):
        await loop.submit("after", PROMPT, params(5))


async def test_a_request_cancelled_during_its_admission_counts_once(loop, monkeypatch):
    from tandem.rpc.gen import inference_pb2
    from tandem.rpc.inference_server import InferenceServicer

    entered, release = threading.Event(), threading.Event()
    add_request = loop.engine.add_request

    def slow_add(*args):  # the caller gives up while the loop thread admits its request
        entered.set()
        release.wait(10)
        return add_request(*args)

    monkeypatch.setattr(loop.engine, "add_request", slow_add)
    servicer = InferenceServicer(loop.metrics)
    servicer.attach(loop, {})
    request = inference_pb2.GenerateRequest(
        prompt_token_ids=PROMPT, sampling=inference_pb2.SamplingParams(max_tokens=200, temperature=0.0))

    async def read():
        async for _ in servicer.Generate(request, context=None):
            pass

    handler = asyncio.create_task(read())
    assert await asyncio.to_thread(entered.wait, 10)
    handler.cancel()  # the client disconnects
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await handler
    await loop.run_on_engine(lambda engine: None)  # after the abort the cancellation queued
    value = loop.metrics.registry.get_sample_value
    assert value(contract.REQUESTS + "_total", {"outcome": "cancelled"}) == 1


async def test_a_failed_kv_copy_ends_only_its_requests_and_the_loop_serves_on(model_dir):
    # A small device tier makes the engine swap sequences out and in; the first copy fails. Its
    # requests end with "error" (a finished output, not a failed stream); the others, and the loop, go on.
    engine = LLMEngine.from_pretrained(model_dir("mixtral"), device="cpu", config=EngineConfig(
        block_size=4, num_device_blocks=16, num_cpu_blocks=64, max_model_len=64, cpu_decode=False))
    real, failed = engine.cache.swap, []

    def swap(pairs, src, dst):
        if pairs and not failed:
            failed.append(pairs)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        real(pairs, src, dst)

    engine.cache.swap = swap
    fatal: list[BaseException] = []
    loop = EngineLoop(engine, ServingMetrics(), on_fatal=fatal.append)
    loop.start()
    try:
        prompts = [[(7 * i + 3 * j) % 90 + 3 for j in range(13 + i)] for i in range(4)]
        streams = [await loop.submit(f"r{i}", p, params(24)) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*(drain(s) for s in streams))
        reasons = [r[-1].finish_reason for r in results]
        assert failed and 0 < reasons.count("error") < len(reasons), reasons
        assert all(sum(len(o.new_token_ids) for o in r) == 24 for r, why in zip(results, reasons) if why != "error")
        value = loop.metrics.registry.get_sample_value
        assert value(contract.REQUESTS + "_total", {"outcome": "error"}) == reasons.count("error")
        assert await finished_with(loop, "after", 5) == ("length", 5)
        stats = await loop.run_on_engine(lambda engine: engine.stats())
        assert sum(stats.kv_blocks_used.values()) == 0 and not fatal
    finally:
        loop.stop(timeout=10)


async def test_cancel_all_ends_each_of_a_requests_completions_once(loop):
    stream = await loop.submit("n", list(range(3, 40)), SamplingParams(max_tokens=200, temperature=0.0, n=3,
                                                                       ignore_eos=True))
    first = [await asyncio.wait_for(stream.get(), 30) for _ in range(4)]  # 0's first token, then 1's and 2's
    loop.cancel_all()
    finals = []
    while len(finals) < 3:
        out = await asyncio.wait_for(stream.get(), 30)
        finals += [out] if out.finished else []
    assert sorted((o.index, o.finish_reason) for o in finals) == [(i, "cancelled") for i in range(3)]
    assert {o.index for o in first} == {0, 1, 2} and loop.in_flight() == 0
    value = loop.metrics.registry.get_sample_value
    assert value(contract.REQUESTS + "_total", {"outcome": "cancelled"}) == 1
    stats = await loop.run_on_engine(lambda engine: engine.stats())
    assert sum(stats.kv_blocks_used.values()) == 0 and stream.empty()


@pytest.mark.parametrize("n", [1, 3])
async def test_a_structured_request_compiles_once_and_makes_a_matcher_per_completion(loop, monkeypatch, n):
    from tandem.engine.sampling_params import StructuredOutputs
    from tandem.engine.structured import Constraint

    compiled_on, made = [], []
    compile_, init = loop.engine._grammars.compile, Constraint.__init__

    def compile_counted(constraint):
        compiled_on.append(threading.current_thread())
        return compile_(constraint)

    def init_counted(self, *args, **kwargs):  # a Constraint is a matcher of its own (compiled or copied)
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(loop.engine._grammars, "compile", compile_counted)
    monkeypatch.setattr(Constraint, "__init__", init_counted)
    regex = "[ab]{4}"
    stream = await loop.submit("s", "Answer:", SamplingParams(max_tokens=16, temperature=1.0, seed=3, n=n,
                                                              structured_outputs=StructuredOutputs(regex=regex)))
    texts, finished = dict.fromkeys(range(n), ""), 0
    while finished < n:
        out = await asyncio.wait_for(stream.get(), 30)
        texts[out.index] += out.text
        finished += out.finished
    assert len(compiled_on) == 1 and loop._thread not in compiled_on  # once, in a worker thread
    assert len({id(c.matcher) for c in made}) == len(made) == n  # n matchers, not n + 1
    assert all(re.fullmatch(regex, t) for t in texts.values()), texts
