"""Chat requests: a conversation rendered by the checkpoint's chat template, tokenized as transformers'
apply_chat_template tokenizes it, through the engine, real gRPC and both forms of `tandem generate`.

The demo tokenizer here gets a post-processor that adds a BOS, as Llama's and Mistral's do, and
the templates write `bos_token` themselves: encoding the rendered text with special tokens would
start the prompt with two BOS tokens, and the comparisons with transformers would fail.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import grpc
import pytest

from tandem.cli import main
from tandem.engine.chat import ChatMessage
from tandem.engine.llm_engine import EngineConfig, LLMEngine
from tandem.engine.sampling_params import InvalidRequest
from tandem.rpc.gen import inference_pb2, inference_pb2_grpc

from svc_helpers import generate, greedy, token_ids

# ChatML with a BOS; roles after an optional system message must alternate user/assistant.
CHATML = (
    "{%- set offset = 1 if messages[0]['role'] == 'system' else 0 -%}"
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- if loop.index0 >= offset and (m['role'] == 'user') != ((loop.index0 - offset) % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Llama-2 style, saved as transformers 5 saves templates: chat_template.jinja beside the tokenizer.
INST = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{- '[INST] ' + m['content'] + ' [/INST]' -}}"
    "{%- else -%}{{- ' ' + m['content'] + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "The expert said"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which expert?"},
     {"role": "assistant", "content": "The second one."}, {"role": "user", "content": "Why?"}],
]
BAD_ORDER = [{"role": "user", "content": "hi"}, {"role": "user", "content": "hi again"}]
SAMPLING = inference_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def with_chat_template(src, dst, template: str, as_jinja_file: bool = False):
    """A copy of the demo checkpoint `src` whose tokenizer adds a BOS and has `template`."""
    from tokenizers import Tokenizer, processors

    shutil.copytree(src, dst)
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    tok.save(str(dst / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    if as_jinja_file:
        (dst / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def chat_model(model_dir, tmp_path_factory):
    return with_chat_template(model_dir("mixtral"), tmp_path_factory.mktemp("chat") / "chatml", CHATML)


@pytest.fixture(scope="module")
def jinja_model(model_dir, tmp_path_factory):
    return with_chat_template(model_dir("mixtral"), tmp_path_factory.mktemp("chat") / "inst", INST, as_jinja_file=True)


def hf_chat_ids(path, messages, **kwargs) -> list[int]:
    from transformers import AutoTokenizer

    kwargs.setdefault("add_generation_prompt", True)
    return AutoTokenizer.from_pretrained(path).apply_chat_template(messages, tokenize=True, **kwargs)["input_ids"]


def engine_for(path) -> LLMEngine:
    return LLMEngine.from_pretrained(path, device="cpu",
                                     config=EngineConfig(max_model_len=256, max_num_seqs=4, cpu_kv_gib=0.01))


def chat(messages) -> list[ChatMessage]:
    return [ChatMessage(m["role"], m["content"]) for m in messages]


def test_encode_chat_equals_transformers_with_one_bos(chat_model, jinja_model):
    engine = engine_for(chat_model)
    bos = engine.tokenizer.token_to_id("<s>")
    assert engine.encode("hi")[0] == bos  # the tokenizer adds a BOS to text: the trap this guards against
    for messages in CONVERSATIONS:
        ids = engine.encode_chat(chat(messages))
        assert ids == hf_chat_ids(chat_model, messages)
        assert ids[0] == bos and ids.count(bos) == 1
    [messages, _] = CONVERSATIONS
    assert engine.encode_chat(chat(messages), add_generation_prompt=False) == \
        hf_chat_ids(chat_model, messages, add_generation_prompt=False)
    partial = [*messages, {"role": "assistant", "content": "The"}]
    assert engine.encode_chat(chat(partial), add_generation_prompt=False, continue_final_message=True) == \
        hf_chat_ids(chat_model, partial, add_generation_prompt=False, continue_final_message=True)

    engine = engine_for(jinja_model)  # chat_template.jinja, as transformers 5 saves it
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Which expert?"}]
    ids = engine.encode_chat(chat(messages))
    assert ids == hf_chat_ids(jinja_model, messages) and ids.count(bos) == 1
    assert ids.count(engine.tokenizer.token_to_id("</s>")) == 1


def test_encode_chat_errors_name_messages(chat_model, model_dir):
    engine = engine_for(chat_model)
    with pytest.raises(InvalidRequest, match=r"^messages: .*Conversation roles must alternate user/assistant"):
        engine.encode_chat(chat(BAD_ORDER))
    with pytest.raises(InvalidRequest, match=r"^add_generation_prompt: "):
        engine.encode_chat(chat(BAD_ORDER[:1]), add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(InvalidRequest, match=r"^messages: this model has no chat template"):
        engine_for(model_dir("mixtral")).encode_chat(chat(BAD_ORDER[:1]))


async def test_a_messages_request_generates_what_its_token_ids_do(start_server, chat_model):
    server = await start_server(model=str(chat_model))
    for messages in CONVERSATIONS:
        ids = hf_chat_ids(chat_model, messages)
        request = inference_pb2.GenerateRequest(
            messages=[inference_pb2.ChatMessage(**m) for m in messages], sampling=SAMPLING)
        by_messages, by_ids = await asyncio.gather(generate(server.address, request),
                                                   generate(server.address, greedy(ids)))
        assert token_ids(by_messages) == token_ids(by_ids) and len(token_ids(by_ids)) == 8
        assert by_messages[-1].usage.prompt_tokens == len(ids)
    partial = [*CONVERSATIONS[0], {"role": "assistant", "content": "The"}]
    request = inference_pb2.GenerateRequest(  # add_generation_prompt unset: off with continue_final_message
        messages=[inference_pb2.ChatMessage(**m) for m in partial], continue_final_message=True, sampling=SAMPLING)
    ids = hf_chat_ids(chat_model, partial, add_generation_prompt=False, continue_final_message=True)
    assert token_ids(await generate(server.address, request)) == token_ids(await generate(server.address, greedy(ids)))
    async with grpc.aio.insecure_channel(server.address) as channel:
        info = await inference_pb2_grpc.InferenceStub(channel).GetModelInfo(inference_pb2.GetModelInfoRequest())
    assert info.has_tokenizer and info.has_chat_template


def chat_request(messages=BAD_ORDER[:1], **fields) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(messages=[inference_pb2.ChatMessage(**m) for m in messages],
                                         sampling=SAMPLING, **fields)


BAD_CHAT_REQUESTS = [
    (chat_request(prompt="hi"), "prompt: give one of prompt, prompt_token_ids and messages, not prompt and messages"),
    (chat_request(prompt_token_ids=[5]), "prompt_token_ids: give one of"),
    (inference_pb2.GenerateRequest(prompt_token_ids=[5], add_generation_prompt=True),
     "add_generation_prompt: applies to messages only"),
    (inference_pb2.GenerateRequest(prompt_token_ids=[5], continue_final_message=True),
     "continue_final_message: applies to messages only"),
    (chat_request(add_generation_prompt=True, continue_final_message=True), "add_generation_prompt: not with"),
    (chat_request(BAD_ORDER), "messages: the chat template refused the conversation: Conversation roles must "
                              "alternate user/assistant/user/assistant/..."),
]


async def test_bad_chat_requests_are_invalid_argument(start_server, chat_model, model_dir, tmp_path):
    server = await start_server(model=str(chat_model))
    for request, message in BAD_CHAT_REQUESTS:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(server.address, request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
        assert err.value.details().startswith(message), err.value.details()
    assert token_ids(await generate(server.address, chat_request())) != []  # still serving

    plain = await start_server(model=str(model_dir("mixtral")))  # a tokenizer, no chat template
    bare = tmp_path / "bare"  # no tokenizer at all
    shutil.copytree(chat_model, bare, ignore=shutil.ignore_patterns("tokenizer.json"))
    for model, why in ((plain, "this model has no chat template"), (await start_server(model=str(bare)),
                                                                    "this model has no tokenizer.json")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(model.address, chat_request())
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"messages: {why}"), err.value.details()
        async with grpc.aio.insecure_channel(model.address) as channel:
            info = await inference_pb2_grpc.InferenceStub(channel).GetModelInfo(inference_pb2.GetModelInfoRequest())
        assert not info.has_chat_template


async def test_generate_chat_locally_and_against_a_server(start_server, chat_model, capsys):
    [messages, _] = CONVERSATIONS
    ids = ",".join(map(str, hf_chat_ids(chat_model, messages)))
    common = ["--max-tokens", "6", "--json"]
    local = ["generate", "--model", str(chat_model), "--device", "cpu", "--max-model-len", "256", *common]
    assert await asyncio.to_thread(main, [*local, "--chat", json.dumps(messages)]) == 0
    by_chat = json.loads(capsys.readouterr().out)
    assert await asyncio.to_thread(main, [*local, "--prompt-ids", ids]) == 0
    by_ids = json.loads(capsys.readouterr().out)
    assert by_chat["token_ids"] == by_ids["token_ids"] and len(by_ids["token_ids"]) == 6
    assert by_chat["usage"]["prompt_tokens"] == len(ids.split(","))

    server = await start_server(model=str(chat_model))  # the CLI blocks: run it off this loop, which serves
    remote = ["generate", "--server", server.address, *common]
    assert await asyncio.to_thread(main, [*remote, "--chat", json.dumps(messages)]) == 0
    assert json.loads(capsys.readouterr().out) == by_chat
    assert await asyncio.to_thread(main, [*remote, "--chat", json.dumps(BAD_ORDER)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("tandem: error: messages: the chat template refused") and "alternate" in line


@pytest.mark.parametrize("chat_json,message", [
    ("[{\"role\": \"user\"", "--chat is not valid JSON"),
    ("[]", "--chat must be a non-empty JSON list"),
    ("{\"role\": \"user\", \"content\": \"hi\"}", "--chat must be a non-empty JSON list"),
    ("[{\"role\": \"user\", \"content\": 3}]", "--chat: message 1 is not"),
    ("[{\"role\": \"user\", \"content\": \"hi\", \"name\": \"x\"}]", "--chat: message 1 is not"),
])
@pytest.mark.parametrize("where", [["--model", "/nonexistent/dir"], ["--server", "127.0.0.1:1"]])
def test_bad_chat_json_exits_2_with_one_line(chat_json, message, where, capsys):
    assert main(["generate", *where, "--chat", chat_json]) == 2  # refused before loading or connecting
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"tandem: error: {message}"), line
