"""`tandem generate --server ADDR`: the local command's flags and JSON output, over gRPC."""

from __future__ import annotations

import os
import sys

import grpc

from tandem import contract
from tandem.rpc import auth, tls
from tandem.rpc.addresses import check_address
from tandem.rpc.gen import inference_pb2, inference_pb2_grpc


def build_request(args) -> inference_pb2.GenerateRequest:
    """A GenerateRequest from `tandem generate`'s flags."""
    from tandem.cli import parse_chat, parse_prompt_ids, processors_from_args, structured_from_args

    sampling = inference_pb2.SamplingParams(  # the processors' keywords are the proto's field names
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, stop=list(args.stop), n=args.n, **processors_from_args(args))
    if args.seed is not None:
        sampling.seed = args.seed
    if args.truncate_prompt_tokens is not None:
        sampling.truncate_prompt_tokens = args.truncate_prompt_tokens
    if args.logprobs is not None:
        sampling.logprobs = args.logprobs
    if args.prompt_logprobs is not None:
        sampling.prompt_logprobs = args.prompt_logprobs
    structured = structured_from_args(args)
    if structured is not None:
        [(kind, value)] = structured.items()
        if kind == "choice":
            sampling.structured_outputs.choice.values.extend(value)
        else:
            setattr(sampling.structured_outputs, kind, value)
    request = inference_pb2.GenerateRequest(sampling=sampling, priority=args.priority)
    if args.cache_salt is not None:
        request.cache_salt = args.cache_salt
    if args.chat is not None:
        request.messages.extend(inference_pb2.ChatMessage(role=r, content=c) for r, c in parse_chat(args.chat))
    elif args.prompt_ids:
        request.prompt_token_ids.extend(parse_prompt_ids(args.prompt_ids))
    else:
        request.prompt = args.prompt
    return request


def collect(stub, request, timeout_s: float | None = None, metadata=()) -> list[dict]:
    """Runs one Generate stream to its end: for each of its completions, by index, token_ids, text,
    finish_reason, usage and, when asked for, logprobs (a TokenLogprobs per token) and
    prompt_logprobs (one per prompt token, None for the first; completion 0's only)."""
    from tandem.engine.sampling_params import TokenLogprobs

    def plain(e):
        return TokenLogprobs(e.logprob, e.rank, tuple((t.token_id, t.logprob) for t in e.top))

    n = request.sampling.n if request.sampling.HasField("n") else 1
    parts = [{"token_ids": [], "texts": [], "logprobs": [], "prompt_logprobs": [None], "last": None} for _ in range(n)]
    for response in stub.Generate(request, timeout=timeout_s, metadata=metadata):
        part = parts[response.index]
        part["token_ids"].extend(response.token_ids)
        part["texts"].append(response.text)
        part["logprobs"].extend(map(plain, response.logprobs))
        part["prompt_logprobs"].extend(map(plain, response.prompt_logprobs))
        part["last"] = response
    if any(p["last"] is None or not p["last"].finish_reason for p in parts):
        raise RuntimeError("the server closed the stream without a final message for each completion")
    def stop_reason(last):
        kind = last.WhichOneof("stop_reason")
        return None if kind is None else getattr(last, kind)

    return [{"index": i, "token_ids": p["token_ids"], "text": "".join(p["texts"]),
             "finish_reason": p["last"].finish_reason, "stop_reason": stop_reason(p["last"]),
             "prompt_tokens": p["last"].usage.prompt_tokens,
             "cached_tokens": p["last"].usage.cached_tokens,
             "logprobs": p["logprobs"] if request.sampling.HasField("logprobs") else None,
             "prompt_logprobs": p["prompt_logprobs"] if request.sampling.HasField("prompt_logprobs") and i == 0
             else None} for i, p in enumerate(parts)]


def uses_tls(args) -> bool:
    return bool(args.tls or args.ssl_ca_certs or args.ssl_certfile or args.ssl_keyfile or args.ssl_server_name)


def open_channel(address: str, args) -> grpc.Channel:
    """A channel to --server, over TLS when any TLS flag is given; ValueError naming a bad flag."""
    if not uses_tls(args):
        return grpc.insecure_channel(address)
    credentials = tls.channel_credentials(tls.TlsFiles(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs))
    options = [("grpc.ssl_target_name_override", args.ssl_server_name)] if args.ssl_server_name else []
    return grpc.secure_channel(address, credentials, options=options)


def run_remote_generate(args) -> int:
    """`tandem generate --server ADDR ...`: prints what the local form prints. Returns the exit status."""
    from tandem.cli import UsageError, print_result

    try:
        address = check_address(args.server, "--server")
        request = build_request(args)
        channel = open_channel(address, args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        metadata = auth.client_metadata(args.api_key or os.environ.get(contract.API_KEY_ENV) or None)
        try:
            info = stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=30, metadata=metadata)
            results = collect(stub, request, metadata=metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise UsageError(exc.details()) from None
            print(f"tandem: error: {address}: {_describe(exc, uses_tls(args))}", file=sys.stderr)
            return 1
    for result in results:
        text = result["text"] if info.has_tokenizer else None
        print_result(args, result["token_ids"], text, result["finish_reason"], result["prompt_tokens"],
                     result["cached_tokens"], result["logprobs"], result["prompt_logprobs"], result["index"],
                     result["stop_reason"])
    return 0


def _describe(exc: grpc.RpcError, secure: bool) -> str:
    """One line: what a TLS mismatch's UNAVAILABLE or a refused key means, else the status and details."""
    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
        return (f"the server wants an API key (--api-key, or {contract.API_KEY_ENV}): {exc.code().name}: "
                f"{exc.details()}")
    if exc.code() == grpc.StatusCode.UNAVAILABLE and (hint := tls.explain_unavailable(exc.details(), secure)):
        return hint
    return f"{exc.code().name}: {exc.details()}"
