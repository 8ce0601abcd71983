"""SamplingParams.n over real gRPC: one call streams n completions told apart by index, and
`tandem generate --n` prints them, locally and against a server."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from tandem import contract
from tandem.cli import main
from tandem.engine.sampling_params import NO_TOKEN
from tandem.rpc.gen import inference_pb2, inference_pb2_grpc

from svc_helpers import generate, greedy, token_ids
from test_inference import eventually, scrape

PROMPT = [(7 * j) % 300 + 3 for j in range(40)]  # two full blocks of 16 to share
USED = (contract.KV_BLOCKS_USED, (("tier", "device"),))


def sampled(prompt, max_tokens: int, **sampling) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=inference_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=1.0, ignore_eos=True, **sampling))


def by_index(responses) -> dict[int, list]:
    out: dict[int, list] = {}
    for r in responses:
        out.setdefault(r.index, []).append(r)
    return out


async def test_n_completions_stream_with_their_indexes_and_end_after_the_last(start_server, model_dir):
    server = await start_server(model=str(model_dir("mixtral")), metrics_port=0)
    [alone] = by_index(await generate(server.address, greedy(PROMPT, max_tokens=6))).values()
    responses = await generate(server.address, greedy(PROMPT, max_tokens=6, n=3, prompt_logprobs=0))
    completions = by_index(responses)
    assert sorted(completions) == [0, 1, 2]
    for index, stream in completions.items():
        assert token_ids(stream) == token_ids(alone)
        *before, last = stream
        assert not any(r.finish_reason for r in before) and last.finish_reason == "length"
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (40, 6)
        assert last.usage.cached_tokens == (0 if index == 0 else 32)  # 1 and 2 took 0's prompt blocks
        assert all(r.request_id == responses[0].request_id for r in stream)
    assert [r.index for r in responses if r.prompt_logprobs] == [0]  # the prompt scored once
    seeded = by_index(await generate(server.address, sampled(PROMPT, 5, n=2, seed=7)))
    for index in (0, 1):
        [alone] = by_index(await generate(server.address, sampled(PROMPT, 5, seed=7 + index))).values()
        assert token_ids(seeded[index]) == token_ids(alone)
    metrics = scrape(server.metrics_port)
    requests = contract.REQUESTS + "_total"
    assert metrics[(requests, (("outcome", "length"),))] == 5  # a request is one outcome, whatever its n
    assert metrics[(contract.TIME_TO_FIRST_TOKEN + "_count", ())] == 5
    assert metrics[(contract.GENERATED_TOKENS + "_total", ())] == 6 + 3 * 6 + 2 * 5 + 2 * 5
    # each completion's tokens after its own first: 5 of 6, 4 of 5
    assert metrics[(contract.INTER_TOKEN_LATENCY + "_count", ())] == 5 + 3 * 5 + 2 * 4 + 2 * 4
    assert metrics[(contract.PROMPT_TOKENS + "_total", ())] == 5 * 40  # a prompt counts once
    assert metrics[USED] == 0


@pytest.mark.parametrize("n", [0, 17])
async def test_n_out_of_range_is_invalid_argument_naming_n(start_server, model_dir, n):
    server = await start_server(model=str(model_dir("mixtral")))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(server.address, greedy(PROMPT, n=n))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("n: must be in [1, 16]")


async def test_cancelling_the_call_frees_every_completions_blocks(start_server, model_dir):
    server = await start_server(model=str(model_dir("mixtral")), metrics_port=0)
    cancelled = (contract.REQUESTS + "_total", (("outcome", "cancelled"),))
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(greedy(PROMPT, max_tokens=150, n=3))
        seen = set()
        while len(seen) < 3:  # every completion decoding
            seen.add((await call.read()).index)
        # The shared prompt blocks and a block each. The first tokens come from the prefill, before
        # a decode step has copied each completion's last block, and the gauge is set after a step's
        # tokens go out: read at once, it raced that step (3 blocks seen), so it is polled.
        await eventually(lambda: scrape(server.metrics_port), lambda m: m[USED] >= 3 + 2)
        call.cancel()
    metrics = await eventually(lambda: scrape(server.metrics_port), lambda m: m[cancelled] == 1)
    assert metrics[USED] == 0 and metrics[(contract.RUNNING_REQUESTS, ())] == 0


async def test_a_completion_the_model_fails_on_fails_the_request(start_server, model_dir, monkeypatch):
    from tandem.engine.model_runner import ModelRunner

    server = await start_server(model=str(model_dir("mixtral")), metrics_port=0)
    real = ModelRunner._sample

    def nan_for_completion_1(self, hidden, seqs, generators, penalties=None):
        tokens, penalties = real(self, hidden, seqs, generators, penalties)
        for row, seq in enumerate(seqs):
            if seq.request_id.endswith("#1") and seq.num_output_tokens == 3:
                tokens[row] = NO_TOKEN  # as the sampler answers logits that hold a NaN
        return tokens, penalties

    monkeypatch.setattr(ModelRunner, "_sample", nan_for_completion_1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(server.address, sampled(PROMPT, 200, n=3))
    assert err.value.code() == grpc.StatusCode.INTERNAL and "model failed" in err.value.details()
    error = (contract.REQUESTS + "_total", (("outcome", "error"),))
    metrics = await eventually(lambda: scrape(server.metrics_port), lambda m: m[error] == 1)
    assert metrics[USED] == 0 and metrics[(contract.RUNNING_REQUESTS, ())] == 0
    assert metrics[(contract.GENERATED_TOKENS + "_total", ())] < 3 * 6  # the others were aborted with it
    monkeypatch.setattr(ModelRunner, "_sample", real)
    assert len(by_index(await generate(server.address, sampled(PROMPT, 4, n=2)))) == 2  # the server goes on


async def test_generate_n_prints_each_completion_locally_and_against_a_server(start_server, model_dir, capsys):
    model = model_dir("mixtral")
    flags = ["--prompt-ids", "5,6,7", "--max-tokens", "5", "--temperature", "1", "--seed", "3", "--n", "2"]
    local = ["generate", "--model", str(model), "--device", "cpu", *flags]
    assert await asyncio.to_thread(main, [*local, "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [c["index"] for c in lines] == [0, 1] and all(len(c["token_ids"]) == 5 for c in lines)
    assert await asyncio.to_thread(main, local[:-2] + ["--seed", "4", "--json"]) == 0  # --n 1, seed + 1
    assert json.loads(capsys.readouterr().out)["token_ids"] == lines[1]["token_ids"]
    assert await asyncio.to_thread(main, local) == 0
    assert [line[:4] for line in capsys.readouterr().out.splitlines()] == ["[0] ", "[1] "]

    server = await start_server(model=str(model))
    remote = ["generate", "--server", server.address, *flags]
    assert await asyncio.to_thread(main, [*remote, "--json"]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == lines
    assert await asyncio.to_thread(main, remote) == 0
    assert [line[:4] for line in capsys.readouterr().out.splitlines()] == ["[0] ", "[1] "]
