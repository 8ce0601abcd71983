"""Per-request sampling settings, checked on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


class InvalidRequest(ValueError):
    """A request the user can fix. `field` names what is wrong (gRPC maps it to INVALID_ARGUMENT)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


DEFAULT_MAX_TOKENS = 16


class DuplicateRequest(InvalidRequest):
    """A request_id already in flight (gRPC: ALREADY_EXISTS)."""

    def __init__(self, request_id: str):
        super().__init__("request_id", f"{request_id!r} is already running")


@dataclass(frozen=True)
class SamplingParams:
    # None: DEFAULT_MAX_TOKENS, or fewer where the context ends first (the request then finishes
    # with "length" at the context's end, as vLLM's does). One that is set must fit the context.
    max_tokens: int | None = None
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequest("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not 0 <= self.temperature < math.inf:
            raise InvalidRequest("temperature", f"must be a number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest("top_k", f"must be >= 0 (0 turns it off), got {self.top_k}")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop", "stop strings must not be empty")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(1 << 63) <= self.seed < 1 << 64):
            raise InvalidRequest("seed", f"must be an integer in [-2**63, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def within(self, room: int) -> SamplingParams:
        """These params with max_tokens resolved for a prompt that leaves `room` tokens of context."""
        return self if self.max_tokens is not None else replace(self, max_tokens=min(DEFAULT_MAX_TOKENS, room))


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_output_tokens: int = 0
    text: str = ""  # detokenized delta for new_token_ids (empty without a tokenizer)
