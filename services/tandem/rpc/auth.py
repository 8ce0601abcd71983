"""API keys on the public API, as vLLM's `--api-key`: every call of `tandem.v1.Inference` must carry
the metadata `authorization: Bearer <key>` with one of the server's keys, else it ends
UNAUTHENTICATED before its handler runs (nothing admitted, nothing counted). The health service
and reflection stay open, as vLLM leaves /health open: probes and grpcurl's listing need no key.

Keys come from `--api-key` (repeatable: an old and a new key both pass while clients move over)
and the `TANDEM_API_KEY` environment variable, which keeps a key out of the process's arguments
(the operator sets it from a Secret). Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Sequence

import grpc

from tandem import contract

ENV = contract.API_KEY_ENV
HEADER = "authorization"
SCHEME = "bearer"


def server_keys(flags: Iterable[str] | None, environ=os.environ) -> tuple[str, ...]:
    """The keys a server accepts: each `--api-key`, then TANDEM_API_KEY's; () for none (no check).

    An empty or blank key would let any caller that sends an empty one through: refused."""
    keys = tuple(dict.fromkeys([*(flags or ()), *([environ[ENV]] if ENV in environ else [])]))
    check_keys(keys)
    return keys


def check_keys(keys: Sequence[str]) -> None:
    """ValueError for a key no client could send, or that anyone could."""
    for key in keys:
        if not key.strip():
            raise ValueError(f"an empty API key (--api-key or {ENV}): give a key or none")
        if key != key.strip() or any(not c.isprintable() for c in key):
            raise ValueError(f"an API key (--api-key or {ENV}) with spaces around it or unprintable characters:"
                             " gRPC metadata cannot carry it as given")


def client_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends with each call for `key` (None: none)."""
    return () if key is None else ((HEADER, f"Bearer {key}"),)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call of `service`'s methods without one of `keys` UNAUTHENTICATED; others pass."""

    def __init__(self, keys: Sequence[str], service: str):
        if not keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self._keys = [key.encode() for key in keys]
        self._prefix = f"/{service}/"

    def authorized(self, metadata) -> bool:
        values = [value for name, value in metadata or () if name == HEADER]
        if len(values) != 1 or not isinstance(values[0], str):
            return False
        scheme, _, token = values[0].partition(" ")
        if scheme.lower() != SCHEME:
            return False
        given = token.strip().encode()
        # Every key compared, whatever matches: the time taken says nothing about which.
        return sum(hmac.compare_digest(given, key) for key in self._keys) > 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefix):
            return handler
        if self.authorized(handler_call_details.invocation_metadata):
            return handler
        return _refusal(handler)


MESSAGE = f"missing or unknown API key: send the metadata '{HEADER}: Bearer <key>'"


async def _refuse(request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s shape that refuses the call: the request is neither decoded nor handled."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse)
    return grpc.unary_unary_rpc_method_handler(_refuse)
