"""Tokenize and Detokenize over a real gRPC server: text with and without special tokens, a
conversation through the chat template (transformers' apply_chat_template ids, and the prompt
Generate counts), each token's piece; decoding with and without special tokens; bad requests."""

from __future__ import annotations

import shutil

import grpc
import pytest
from tokenizers import Tokenizer

from tandem.rpc.gen import inference_pb2, inference_pb2_grpc
from test_chat import CHATML, CONVERSATIONS, hf_chat_ids, with_chat_template

TEXT = "The expert said"


@pytest.fixture(scope="module")
def chat_model(model_dir, tmp_path_factory):
    # its tokenizer adds a BOS to text: add_special_tokens makes a difference
    return with_chat_template(model_dir("mixtral"), tmp_path_factory.mktemp("tokenize") / "chatml", CHATML)


async def call(address: str, method: str, request):
    async with grpc.aio.insecure_channel(address) as channel:
        return await getattr(inference_pb2_grpc.InferenceStub(channel), method)(request)


def chat_messages(messages) -> list[inference_pb2.ChatMessage]:
    return [inference_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]


async def test_tokenize_text_and_conversations_as_generate_encodes_them(start_server, chat_model):
    server = await start_server(model=str(chat_model))
    tok = Tokenizer.from_file(str(chat_model / "tokenizer.json"))
    plain = await call(server.address, "Tokenize", inference_pb2.TokenizeRequest(text=TEXT, return_token_strs=True))
    assert list(plain.token_ids) == tok.encode(TEXT).ids and plain.token_ids[0] == tok.token_to_id("<s>")
    assert list(plain.token_strs) == [tok.id_to_token(i) for i in plain.token_ids]
    assert plain.max_model_len == 256
    bare = await call(server.address, "Tokenize", inference_pb2.TokenizeRequest(text=TEXT, add_special_tokens=False))
    assert list(bare.token_ids) == list(plain.token_ids)[1:] and not bare.token_strs
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            request = inference_pb2.GenerateRequest(
                messages=chat_messages(messages), add_generation_prompt=add_generation_prompt,
                sampling=inference_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            ids = await call(server.address, "Tokenize", inference_pb2.TokenizeRequest(
                messages=chat_messages(messages), add_generation_prompt=add_generation_prompt))
            assert list(ids.token_ids) == hf_chat_ids(chat_model, messages, add_generation_prompt=add_generation_prompt)
            async with grpc.aio.insecure_channel(server.address) as channel:
                stream = [r async for r in inference_pb2_grpc.InferenceStub(channel).Generate(request)]
            assert stream[-1].usage.prompt_tokens == len(ids.token_ids)  # the prompt Generate takes


async def test_detokenize_with_and_without_special_tokens(start_server, chat_model):
    server = await start_server(model=str(chat_model))
    tok = Tokenizer.from_file(str(chat_model / "tokenizer.json"))
    ids = tok.encode(TEXT).ids  # with its BOS
    text = await call(server.address, "Detokenize", inference_pb2.DetokenizeRequest(token_ids=ids))
    assert text.text == tok.decode(ids) == TEXT
    kept = await call(server.address, "Detokenize", inference_pb2.DetokenizeRequest(token_ids=ids,
                                                                                    skip_special_tokens=False))
    assert kept.text == tok.decode(ids, skip_special_tokens=False) and kept.text.startswith("<s>")


async def test_bad_requests_are_invalid_argument_naming_the_field(start_server, chat_model):
    server = await start_server(model=str(chat_model))
    conversation = chat_messages(CONVERSATIONS[0])
    cases = [
        ("Tokenize", inference_pb2.TokenizeRequest(text=TEXT, messages=conversation), "text:"),
        ("Tokenize", inference_pb2.TokenizeRequest(messages=conversation, add_special_tokens=True),
         "add_special_tokens:"),
        ("Tokenize", inference_pb2.TokenizeRequest(text=TEXT, add_generation_prompt=True), "add_generation_prompt:"),
        ("Tokenize", inference_pb2.TokenizeRequest(text=TEXT, continue_final_message=True), "continue_final_message:"),
        ("Detokenize", inference_pb2.DetokenizeRequest(token_ids=[5, 384]), "token_ids: token id 384"),
    ]
    for method, request, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(server.address, method, request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(message), (
            err.value.details())


async def test_a_model_without_a_tokenizer_fails_the_precondition(start_server, model_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(model_dir("mixtral"), bare, ignore=shutil.ignore_patterns("tokenizer.json"))
    server = await start_server(model=str(bare))
    for method, request in (("Tokenize", inference_pb2.TokenizeRequest(text="hi")),
                            ("Detokenize", inference_pb2.DetokenizeRequest(token_ids=[5]))):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(server.address, method, request)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, method
