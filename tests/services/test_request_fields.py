"""GenerateResponse's stop_reason (vLLM's: the stop token id or stop string that ended a completion,
neither for an end-of-sequence token or max_tokens), GenerateRequest.priority under
`--scheduling-policy priority`, and SamplingParams.truncate_prompt_tokens, over a real gRPC server
and `tandem generate`."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.rpc.gen import inference_pb2, inference_pb2_grpc

from svc_helpers import generate, greedy, token_ids

PROMPT_IDS = [5, 17, 42, 9, 77, 130, 201, 33]
TEXT, STOP = "Answer:", " was"  # greedy's text on the demo mixtral holds STOP


def request(prompt=PROMPT_IDS, max_tokens: int = 16, priority: int = 0, **sampling):
    where = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    return inference_pb2.GenerateRequest(**where, priority=priority, sampling=inference_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, **sampling))


def stop_reason(last: inference_pb2.GenerateResponse):
    kind = last.WhichOneof("stop_reason")
    return kind, None if kind is None else getattr(last, kind)


async def test_stop_reason_names_the_stop_token_or_string_and_nothing_else(start_server, model_dir):
    model = model_dir("mixtral")
    server = await start_server(model=str(model))
    free = token_ids(await generate(server.address, request(ignore_eos=True)))
    third = free[2]
    stopped = await generate(server.address, request(stop_token_ids=[third], ignore_eos=True))
    assert token_ids(stopped) == free[:3] and stopped[-1].finish_reason == "stop"
    assert stop_reason(stopped[-1]) == ("stop_token_id", third)
    assert all(r.WhichOneof("stop_reason") is None for r in stopped[:-1])  # the last message only

    by_string = await generate(server.address, request(prompt=TEXT, stop=["no such text", STOP], ignore_eos=True))
    assert by_string[-1].finish_reason == "stop" and STOP not in "".join(r.text for r in by_string)
    assert stop_reason(by_string[-1]) == ("stop_str", STOP)

    engine = LLMEngine.from_pretrained(model, device="cpu", config=EngineConfig(max_model_len=256, cpu_kv_gib=0.01))
    eos = min(engine.model_config.eos_token_ids)
    ended = await generate(server.address, request(logit_bias={eos: 100.0}))  # the end-of-sequence token first
    assert token_ids(ended) == [eos] and ended[-1].finish_reason == "stop"
    assert stop_reason(ended[-1]) == (None, None)
    # The same token named in stop_token_ids is a stop token, as vLLM reports it.
    named = await generate(server.address, request(logit_bias={eos: 100.0}, stop_token_ids=[eos]))
    assert stop_reason(named[-1]) == ("stop_token_id", eos)
    long = await generate(server.address, request(max_tokens=4, ignore_eos=True))
    assert long[-1].finish_reason == "length" and stop_reason(long[-1]) == (None, None)
    # In process, the engine's Completion says the same.
    [done] = engine.generate([PROMPT_IDS], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                          stop_token_ids=(third,)))
    assert (done.finish_reason, done.stop_reason) == ("stop", third)


async def test_the_cli_prints_the_stop_reason_locally_and_from_a_server(start_server, model_dir, capsys):
    from tandem.cli import main

    model = model_dir("mixtral")
    server = await start_server(model=str(model))
    for where in (["--model", str(model), "--device", "cpu"], ["--server", server.address]):
        assert await asyncio.to_thread(main, ["generate", *where, "--prompt", TEXT, "--max-tokens", "16", "--json",
                                              "--stop", STOP]) == 0
        result = json.loads(capsys.readouterr().out)
        assert (result["finish_reason"], result["stop_reason"]) == ("stop", STOP), where


async def test_a_priority_needs_the_priority_policy(start_server, model_dir, capsys):
    from tandem.cli import main

    server = await start_server(model=str(model_dir("mixtral")))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(server.address, request(priority=-1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("priority: -1 needs the priority scheduling policy"), err.value.details()
    assert len(token_ids(await generate(server.address, request(max_tokens=4)))) == 4  # serving on
    assert await asyncio.to_thread(main, ["generate", "--server", server.address, "--prompt", TEXT,
                                          "--priority", "3"]) == 2
    assert "priority: 3 needs the priority scheduling policy" in capsys.readouterr().err
    assert await asyncio.to_thread(main, ["generate", "--model", str(model_dir("mixtral")), "--prompt", TEXT,
                                          "--priority", "3"]) == 2
    assert "--priority: for --server" in capsys.readouterr().err


async def test_generate_sends_the_cache_salt_and_refuses_it_locally(start_server, model_dir, capsys):
    from tandem.cli import main

    server = await start_server(model=str(model_dir("mixtral")))
    argv = ["generate", "--server", server.address, "--prompt-ids", ",".join(map(str, range(10, 50))),
            "--max-tokens", "1", "--json"]

    async def cached(*salt: str) -> int:
        assert await asyncio.to_thread(main, [*argv, *salt]) == 0
        return json.loads(capsys.readouterr().out)["usage"]["cached_tokens"]

    assert await cached("--cache-salt", "a") == 0
    assert await cached() == 0  # the salted blocks are not the unsalted prompt's
    assert await cached("--cache-salt", "a") == 32
    assert await asyncio.to_thread(main, ["generate", "--model", str(model_dir("mixtral")), "--prompt", TEXT,
                                          "--cache-salt", "a"]) == 2
    assert "--cache-salt: for --server" in capsys.readouterr().err


async def test_waiting_requests_run_by_priority(start_server, model_dir):
    # One seat: while a long request decodes, three more queue; they run by priority, lowest first,
    # not in the order they arrived.
    server = await start_server(model=str(model_dir("mixtral")), scheduling_policy="priority", max_num_seqs=1)
    finished: list[str] = []
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def run(name: str, message) -> list:
            responses = [r async for r in stub.Generate(message, timeout=120)]
            finished.append(name)
            return responses

        long = stub.Generate(greedy(PROMPT_IDS, max_tokens=200), timeout=120)
        first = await long.read()  # decoding: the seat is taken
        queued = [asyncio.create_task(run(name, request(PROMPT_IDS[:4], max_tokens=4, priority=priority,
                                                        ignore_eos=True)))
                  for name, priority in (("batch", 5), ("normal", 0), ("urgent", -2))]
        rest = []
        while (response := await long.read()) is not grpc.aio.EOF:
            rest.append(response)
        await asyncio.gather(*queued)
    assert rest[-1].finish_reason == "length" and len(first.token_ids) + len(token_ids(rest)) == 200
    assert finished == ["urgent", "normal", "batch"]


async def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(start_server, model_dir, capsys):
    from tandem.cli import main

    model = model_dir("mixtral")
    server = await start_server(model=str(model))  # max_model_len 256
    long_prompt = [(7 * i) % 300 + 3 for i in range(400)]  # longer than the context
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(server.address, request(long_prompt, max_tokens=4))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("prompt:")
    kept = await generate(server.address, request(long_prompt, max_tokens=4, truncate_prompt_tokens=5,
                                                  ignore_eos=True))
    tail = await generate(server.address, request(long_prompt[-5:], max_tokens=4, ignore_eos=True))
    assert token_ids(kept) == token_ids(tail) and kept[-1].usage.prompt_tokens == 5
    fitted = await generate(server.address, request(long_prompt, max_tokens=1, truncate_prompt_tokens=-1))
    assert fitted[-1].usage.prompt_tokens == 255 and len(token_ids(fitted)) == 1
    for bad, message in ((0, "truncate_prompt_tokens: must be an integer >= 1, or -1"),
                         (256, "truncate_prompt_tokens: 256 leaves no room to generate")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(server.address, request(long_prompt, truncate_prompt_tokens=bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(message), err.value.details()
    for where in (["--model", str(model), "--device", "cpu"], ["--server", server.address]):
        assert await asyncio.to_thread(main, ["generate", *where, "--prompt", TEXT * 20, "--max-tokens", "2",
                                              "--json", "--truncate-prompt-tokens", "3"]) == 0
        assert json.loads(capsys.readouterr().out)["usage"]["prompt_tokens"] == 3, where
