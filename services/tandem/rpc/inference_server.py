"""The public `tandem.v1.Inference` service over an EngineLoop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass

import grpc

from tandem.engine.chat import ChatMessage
from tandem.engine.sampling_params import (InvalidRequest, RequestOutput, SamplingParams, StructuredOutputs,
                                           TokenLogprobs, check_in_vocabulary)
from tandem.metrics import ServingMetrics
from tandem.rpc.engine_loop import EngineLoop
from tandem.rpc.errors import NoTokenizer, ServerUnavailable, outcome_of, status_of
from tandem.rpc.gen import inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)


def sampling_params_from_proto(msg: inference_pb2.SamplingParams) -> SamplingParams:
    """Unset fields keep SamplingParams' defaults; bad values raise InvalidRequest naming the field."""
    kwargs = {}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "logprobs", "prompt_logprobs", "seed", "n", "min_tokens", "skip_special_tokens",
                 "truncate_prompt_tokens"):
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from_proto(msg.structured_outputs)
    return SamplingParams(
        **kwargs, stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos, logit_bias=dict(msg.logit_bias) or None,
        allowed_token_ids=tuple(msg.allowed_token_ids) or None, bad_words=tuple(msg.bad_words),
        include_stop_str_in_output=msg.include_stop_str_in_output)


def structured_outputs_from_proto(msg: inference_pb2.StructuredOutputs) -> StructuredOutputs:
    """InvalidRequest naming structured_outputs when no constraint is set (json_object false is none)."""
    kind = msg.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not msg.json_object):
        raise InvalidRequest("structured_outputs", "set one of json, regex, choice, grammar and json_object")
    value = list(msg.choice.values) if kind == "choice" else getattr(msg, kind)
    return StructuredOutputs(**{kind: value})


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation for the engine's encode_chat."""

    messages: list[ChatMessage]
    add_generation_prompt: bool
    continue_final_message: bool

    def __call__(self, engine) -> list[int]:
        """Its prompt token ids (EngineLoop.submit calls it in a worker thread: rendering takes a while)."""
        return engine.encode_chat(self.messages, self.add_generation_prompt, self.continue_final_message)


def prompt_from_proto(request: inference_pb2.GenerateRequest) -> str | list[int] | ChatPrompt:
    """The one prompt a request gives; InvalidRequest naming the field when it gives none or several."""
    given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(request, name)]
    if len(given) > 1:
        raise InvalidRequest(given[0], f"give one of prompt, prompt_token_ids and messages, not {' and '.join(given)}")
    if not given:
        raise InvalidRequest("prompt", "empty prompt: give prompt, prompt_token_ids or messages")
    chat = chat_from_proto(request)
    if request.prompt_token_ids:
        return list(request.prompt_token_ids)
    return request.prompt or chat


def chat_from_proto(request: inference_pb2.GenerateRequest | inference_pb2.TokenizeRequest) -> ChatPrompt | None:
    """The request's conversation (None without messages); InvalidRequest naming a chat field set
    without messages."""
    if not request.messages:
        if request.HasField("add_generation_prompt"):
            raise InvalidRequest("add_generation_prompt", "applies to messages only")
        if request.continue_final_message:
            raise InvalidRequest("continue_final_message", "applies to messages only")
        return None
    add_generation_prompt = (request.add_generation_prompt if request.HasField("add_generation_prompt")
                             else not request.continue_final_message)
    return ChatPrompt([ChatMessage(m.role, m.content) for m in request.messages], add_generation_prompt,
                      request.continue_final_message)


def tokenize_prompt(request: inference_pb2.TokenizeRequest):
    """What Tokenize encodes, as a callable of the engine: the conversation, or the text (with the
    tokenizer's special tokens unless add_special_tokens is false); InvalidRequest naming the field
    for text and messages together, or a field that does not apply."""
    chat = chat_from_proto(request)
    if chat is not None:
        if request.text:
            raise InvalidRequest("text", "give one of text and messages, not both")
        if request.HasField("add_special_tokens"):
            raise InvalidRequest("add_special_tokens", "applies to text only: a chat template writes its own")
        return chat
    add_special_tokens = request.add_special_tokens if request.HasField("add_special_tokens") else True
    return lambda engine: engine.encode(request.text, add_special_tokens=add_special_tokens)


def response_from_output(out: RequestOutput) -> inference_pb2.GenerateResponse:
    response = inference_pb2.GenerateResponse(
        request_id=out.request_id, token_ids=out.new_token_ids, text=out.text, index=out.index)
    response.logprobs.extend(map(_logprobs_to_proto, out.logprobs or ()))
    response.prompt_logprobs.extend(map(_logprobs_to_proto, (out.prompt_logprobs or [None])[1:]))
    if out.finished:
        response.finish_reason = out.finish_reason or ""
        if isinstance(out.stop_reason, str):
            response.stop_str = out.stop_reason
        elif out.stop_reason is not None:
            response.stop_token_id = out.stop_reason
        response.usage.prompt_tokens = out.num_prompt_tokens
        response.usage.completion_tokens = out.num_output_tokens
        response.usage.cached_tokens = out.num_cached_tokens
    return response


def _logprobs_to_proto(entry: TokenLogprobs) -> inference_pb2.TokenLogprobs:
    return inference_pb2.TokenLogprobs(
        logprob=entry.logprob, rank=entry.rank,
        top=[inference_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.top])


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Generate, Tokenize and GetModelInfo. Answers UNAVAILABLE until `attach` gives it an engine."""

    def __init__(self, metrics: ServingMetrics, info: dict | None = None):
        self.metrics = metrics
        self.loop: EngineLoop | None = None
        self.info = info or {}

    def attach(self, loop: EngineLoop, info: dict) -> None:
        """Starts answering with `loop`'s engine; `info` fills ModelInfo (role, device, dtype, model)."""
        self.loop, self.info = loop, info

    def _engine_loop(self) -> EngineLoop:
        if self.loop is None:
            raise ServerUnavailable("the model is still loading")
        return self.loop

    async def Generate(self, request, context):
        try:
            loop = self._engine_loop()
            prompt = prompt_from_proto(request)
            params = sampling_params_from_proto(request.sampling)
            request_id = request.request_id or uuid.uuid4().hex
            cache_salt = request.cache_salt if request.HasField("cache_salt") else None
            queue = await loop.submit(request_id, prompt, params, request.priority, cache_salt)
        except asyncio.CancelledError:  # gone before it was admitted (deadline, disconnect)
            self.metrics.record_outcome("cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status code
            code, message = status_of(exc)
            self.metrics.record_outcome(outcome_of(code))
            await context.abort(code, message)
        unfinished = params.n  # completions: the call ends after the last one's final message
        try:
            while unfinished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    unfinished = 0  # the loop already forgot the request
                    code, message = status_of(item)
                    await context.abort(code, message)
                if item.finished:
                    unfinished -= 1
                if item.finish_reason == "error":  # the model failed on it (the server logged why)
                    unfinished = 0  # and the loop aborted the request's other completions
                    if item.new_token_ids:
                        item.finished = False
                        yield response_from_output(item)
                    await context.abort(grpc.StatusCode.INTERNAL, "the model failed while generating this request; "
                                        "the tokens streamed before this error stand")
                yield response_from_output(item)
        finally:
            if unfinished:  # cancelled or disconnected: free its KV blocks now
                log.info("request %s cancelled by the client", request_id)
                with contextlib.suppress(ServerUnavailable):  # stopping: the loop cancels it anyway
                    loop.abort(request_id, queue)

    async def Tokenize(self, request, context):
        try:
            engine = self._tokenizing_engine()
            ids = await asyncio.to_thread(tokenize_prompt(request), engine)  # the tokenizer lets go of the GIL
        except Exception as exc:  # noqa: BLE001
            await context.abort(*status_of(exc))
        strs = [engine.tokenizer.id_to_token(i) or "" for i in ids] if request.return_token_strs else []
        return inference_pb2.TokenizeResponse(token_ids=ids, token_strs=strs, max_model_len=engine.max_model_len)

    async def Detokenize(self, request, context):
        try:
            engine = self._tokenizing_engine()
            ids = list(request.token_ids)
            check_in_vocabulary("token_ids", ids, engine.model_config.vocab_size)
            skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
            text = await asyncio.to_thread(engine.tokenizer.decode, ids, skip_special_tokens=skip)
        except Exception as exc:  # noqa: BLE001
            await context.abort(*status_of(exc))
        return inference_pb2.DetokenizeResponse(text=text)

    def _tokenizing_engine(self):
        engine = self._engine_loop().engine
        if engine.tokenizer is None:
            raise NoTokenizer("this model has no tokenizer; send and read token ids instead")
        return engine

    async def GetModelInfo(self, request, context):
        try:
            loop = self._engine_loop()
        except ServerUnavailable as exc:
            await context.abort(*status_of(exc))
        engine, cfg = loop.engine, loop.engine.model_config
        return inference_pb2.ModelInfo(
            model=str(self.info.get("model", "")),
            architecture=str(getattr(cfg, "architecture", "")),
            vocab_size=cfg.vocab_size,
            max_model_len=engine.max_model_len,
            num_layers=getattr(cfg, "num_layers", 0),
            eos_token_ids=list(getattr(cfg, "eos_token_ids", ()) or ()),
            has_tokenizer=engine.tokenizer is not None,
            has_chat_template=await asyncio.to_thread(has_chat_template, engine),  # loads it on first use
            role=str(self.info.get("role", "")),
            device=str(self.info.get("device", "")),
            dtype=str(self.info.get("dtype", "")),
        )


def has_chat_template(engine) -> bool:
    return engine.tokenizer is not None and engine.chat_template is not None and engine.chat_template.available


def add_to_server(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)

