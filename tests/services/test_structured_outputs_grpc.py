"""Structured outputs over a real gRPC server: the proto's constraint reaches the engine (the same
tokens as in-process, which tests/engine/test_structured_outputs.py checks against transformers),
and a constraint that is missing or does not compile is INVALID_ARGUMENT naming it."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.sampling_params import SamplingParams, StructuredOutputs
from tandem.rpc.gen import inference_pb2

from svc_helpers import generate, token_ids

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["id", "ok"], "additionalProperties": False}
PROMPT = [5, 17, 42, 9, 77]


def request(max_tokens: int = 40, **constraint) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(prompt_token_ids=PROMPT, sampling=inference_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, structured_outputs=inference_pb2.StructuredOutputs(**constraint)))


@pytest.mark.parametrize("steps", [1, 4])
async def test_constrained_streams_are_the_engines_and_finish_when_complete(start_server, model_dir, steps):
    model = model_dir("mixtral")
    engine = LLMEngine.from_pretrained(model, device="cpu", config=EngineConfig(max_model_len=256, cpu_kv_gib=0.01))
    server = await start_server(model=str(model), num_scheduler_steps=steps)
    cases = [
        ({"json": json.dumps(SCHEMA)}, StructuredOutputs(json=SCHEMA)),
        ({"choice": inference_pb2.Choices(values=["red", "green"])}, StructuredOutputs(choice=["red", "green"])),
        ({"regex": "[0-9]{4}"}, StructuredOutputs(regex="[0-9]{4}")),
        ({"json_object": True}, StructuredOutputs(json_object=True)),
    ]
    for fields, constraint in cases:
        [expected] = engine.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0.0,
                                                              structured_outputs=constraint))
        stream = await generate(server.address, request(**fields))
        assert token_ids(stream) == expected.token_ids and stream[-1].finish_reason == "stop", fields
        assert stream[-1].usage.completion_tokens == len(expected.token_ids)
    text = "".join(r.text for r in await generate(server.address, request(json=json.dumps(SCHEMA))))
    assert set(json.loads(text)) == {"id", "ok"}


async def test_a_bad_or_missing_constraint_is_invalid_argument_naming_it(start_server, model_dir):
    server = await start_server(model=str(model_dir("mixtral")))
    cases = [
        (request(regex="(unclosed"), "structured_outputs.regex: does not compile"),
        (request(json="{"), "structured_outputs.json: is not JSON"),
        (request(grammar="start: nowhere"), "structured_outputs.grammar: does not compile"),
        (request(json_object=False), "structured_outputs: set one of"),
        (request(choice=inference_pb2.Choices(values=["a", ""])), "structured_outputs.choice:"),
    ]
    for bad, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(server.address, bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(message), (
            err.value.details())
    # and the server serves on
    assert (await generate(server.address, request(regex="[ab]{3}")))[-1].finish_reason == "stop"


async def test_the_cli_sends_a_constraint_locally_and_to_a_server(start_server, model_dir, tmp_path, capsys):
    from tandem.cli import main

    model = model_dir("mixtral")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    server = await start_server(model=str(model))
    common = ["--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "40", "--json"]
    results = {}
    for where in (["--model", str(model), "--device", "cpu"], ["--server", server.address]):
        for flags in (["--json-schema", f"@{schema}"], ["--choice", "red", "--choice", "green"]):
            assert await asyncio.to_thread(main, ["generate", *where, *common, *flags]) == 0
            results[where[0], flags[0]] = json.loads(capsys.readouterr().out)
    for where in ("--model", "--server"):
        assert set(json.loads(results[where, "--json-schema"]["text"])) == {"id", "ok"}
        assert results[where, "--choice"]["text"] in ("red", "green")
        assert results[where, "--choice"]["finish_reason"] == "stop"
    assert results["--model", "--choice"] == results["--server", "--choice"]
    assert await asyncio.to_thread(main, ["generate", "--server", server.address, *common, "--regex", "(x"]) == 2
    assert "structured_outputs.regex: does not compile" in capsys.readouterr().err
