"""min_tokens, logit_bias, allowed_token_ids, bad_words, include_stop_str_in_output and
skip_special_tokens over a real gRPC server: the proto's fields reach the engine (the same tokens
and text as in-process, which tests/engine/test_sampling_params_more.py checks against
transformers), out-of-range values are INVALID_ARGUMENT naming the field, and `tandem generate`
sends them locally and to a server alike."""

from __future__ import annotations

import asyncio
import json
import shutil

import grpc
import pytest

from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.rpc.gen import inference_pb2

from svc_helpers import generate, token_ids

PROMPT_IDS = [5, 17, 42, 9, 77, 130, 201, 33]
TEXT, STOP = "Answer:", " was"  # greedy's text on the demo mixtral holds STOP

# (the proto's fields, SamplingParams' keywords): each on top of greedy, ignore_eos, 16 tokens. Biases
# that float32 (the proto's) holds exactly.
CASES = [
    ({"min_tokens": 4, "stop_token_ids": [274]}, {"min_tokens": 4, "stop_token_ids": (274,)}),  # greedy's 3rd
    ({"logit_bias": {265: -30.0, 26: 0.125}}, {"logit_bias": {265: -30.0, 26: 0.125}}),
    ({"allowed_token_ids": [20, 30, 40, 50, 60]}, {"allowed_token_ids": (20, 30, 40, 50, 60)}),
    ({"bad_words": ["xper", "mo"]}, {"bad_words": ("xper", "mo")}),
]
TEXT_CASES = [
    ({"stop": [STOP], "include_stop_str_in_output": True}, {"stop": (STOP,), "include_stop_str_in_output": True}),
    ({"stop": [STOP], "min_tokens": 6}, {"stop": (STOP,), "min_tokens": 6}),
    ({"logit_bias": {1: 0.25, 2: 0.125}, "skip_special_tokens": False},
     {"logit_bias": {1: 0.25, 2: 0.125}, "skip_special_tokens": False}),
]


def request(max_tokens: int = 16, prompt=PROMPT_IDS, **sampling) -> inference_pb2.GenerateRequest:
    where = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    return inference_pb2.GenerateRequest(**where, sampling=inference_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling))


def local(engine: LLMEngine, prompt, **params):
    ids = engine.encode(prompt) if isinstance(prompt, str) else prompt
    greedy = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    [out] = engine.generate([ids], SamplingParams(**(greedy | params)))
    return out


@pytest.mark.parametrize("steps", [1, 4])
async def test_the_fields_reach_the_engine(start_server, model_dir, steps):
    model = model_dir("mixtral")
    engine = LLMEngine.from_pretrained(model, device="cpu", config=EngineConfig(max_model_len=256, cpu_kv_gib=0.01))
    server = await start_server(model=str(model), num_scheduler_steps=steps)
    free = local(engine, PROMPT_IDS)
    for fields, params in CASES:
        expected = local(engine, PROMPT_IDS, **params)
        assert expected.token_ids != free.token_ids, fields  # each changes what greedy generates here
        stream = await generate(server.address, request(**fields))
        assert token_ids(stream) == expected.token_ids, fields
    free = local(engine, TEXT)
    for fields, params in TEXT_CASES:
        expected = local(engine, TEXT, **params)
        assert expected.text != free.text, fields
        stream = await generate(server.address, request(prompt=TEXT, **fields))
        assert "".join(r.text for r in stream) == expected.text, fields
        assert token_ids(stream) == expected.token_ids and stream[-1].finish_reason == expected.finish_reason


async def test_out_of_range_values_are_invalid_argument_naming_the_field(start_server, model_dir, tmp_path):
    model = model_dir("mixtral")
    server = await start_server(model=str(model))
    bad = [
        (request(max_tokens=4, min_tokens=5), "min_tokens"),
        (request(min_tokens=-1), "min_tokens"),
        (request(logit_bias={5: 100.5}), "logit_bias"),
        (request(logit_bias={5: float("nan")}), "logit_bias"),
        (request(logit_bias={384: 1.0}), "logit_bias"),  # the demo vocabulary is 384 tokens
        (request(allowed_token_ids=[5, 384]), "allowed_token_ids"),
        (request(bad_words=[" "]), "bad_words"),
    ]
    for message, field_name in bad:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(server.address, message)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
        assert err.value.details().startswith(f"{field_name}:"), err.value.details()
    bare = tmp_path / "bare"  # no tokenizer: no bad words
    shutil.copytree(model, bare, ignore=shutil.ignore_patterns("tokenizer.json"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate((await start_server(model=str(bare))).address, request(bad_words=["la"]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("bad_words: bad words need a tokenizer"), err.value.details()
    assert len(token_ids(await generate(server.address, request(bad_words=["la"])))) == 16  # serving on


async def test_no_token_left_to_sample_is_internal_and_the_server_serves_on(start_server, model_dir):
    server = await start_server(model=str(model_dir("mixtral")))
    blocked = request(allowed_token_ids=[90], structured_outputs=inference_pb2.StructuredOutputs(
        choice=inference_pb2.Choices(values=["red", "green"])))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(server.address, blocked)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert len(token_ids(await generate(server.address, request()))) == 16


async def test_the_cli_sends_them_locally_and_to_a_server(start_server, model_dir, capsys):
    from tandem.cli import main

    model = model_dir("mixtral")
    server = await start_server(model=str(model))
    flags = ["--prompt", TEXT, "--max-tokens", "16", "--json", "--stop", STOP, "--include-stop-str-in-output",
             "--min-tokens", "2", "--logit-bias", "1=0.25", "--logit-bias", "17=-30", "--bad-word", "la",
             "--no-skip-special-tokens", "--allowed-token-ids", ",".join(map(str, range(0, 200)))]
    results = {}
    for where in (["--model", str(model), "--device", "cpu"], ["--server", server.address]):
        assert await asyncio.to_thread(main, ["generate", *where, *flags]) == 0
        results[where[0]] = json.loads(capsys.readouterr().out)
    engine = LLMEngine.from_pretrained(model, device="cpu", config=EngineConfig(max_model_len=256, cpu_kv_gib=0.01))
    expected = local(engine, TEXT, stop=(STOP,), include_stop_str_in_output=True, min_tokens=2,
                     logit_bias={1: 0.25, 17: -30.0}, bad_words=("la",), skip_special_tokens=False,
                     allowed_token_ids=tuple(range(200)), ignore_eos=False)
    for result in results.values():
        assert result["token_ids"] == expected.token_ids and result["text"] == expected.text
    for bad, message in ((["--logit-bias", "17"], "--logit-bias takes TOKEN=BIAS"),
                         (["--allowed-token-ids", "1,x"], "--allowed-token-ids must be"),
                         (["--min-tokens", "20"], "min_tokens: must be at most max_tokens")):
        assert await asyncio.to_thread(main, ["generate", "--server", server.address, "--prompt", TEXT,
                                              "--max-tokens", "16", *bad]) == 2
        assert message in capsys.readouterr().err
