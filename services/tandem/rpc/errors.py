"""Exceptions the services raise, and the gRPC status code a client can act on for each."""

from __future__ import annotations

import grpc

from tandem.engine.scheduler import QueueFull
from tandem.engine.sampling_params import DuplicateRequest, InvalidRequest
from tandem.experts.base import ExpertsUnavailable


class ServerUnavailable(RuntimeError):
    """The server cannot take requests now: loading, shutting down, or experts down (UNAVAILABLE)."""


class NoTokenizer(RuntimeError):
    """The model has no tokenizer, so text cannot be encoded (FAILED_PRECONDITION)."""


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message to answer a request that failed with `exc`."""
    if isinstance(exc, DuplicateRequest):  # a retry can tell it from a malformed request
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, (ServerUnavailable, ExpertsUnavailable)):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, NoTokenizer):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


OUTCOME_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
    grpc.StatusCode.ALREADY_EXISTS: "invalid_argument",
    grpc.StatusCode.FAILED_PRECONDITION: "invalid_argument",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
}


def outcome_of(code: grpc.StatusCode) -> str:
    """The `tandem_requests{outcome}` label for a request rejected with `code`."""
    return OUTCOME_OF_CODE.get(code, "error")
