"""One request's tokens and progress as the scheduler sees it. Plain Python, no torch."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from tandem.engine.sampling_params import InvalidRequest, SamplingParams

_arrivals = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued: not started, or preempted to be recomputed
    RUNNING = "running"  # its KV is on the device tier
    SWAPPED = "swapped"  # preempted, its KV parked on the CPU tier
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A prompt and the tokens generated for it so far.

    `num_computed_tokens` counts tokens whose KV is in the cache; the scheduler advances it.
    `rank` orders requests: by `priority` (lower first, as vLLM's; always 0 under the first-come,
    first-served policy), then `arrival` (earlier first); the last in that order is preempted first.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first admission
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    arrival: int = field(default_factory=lambda: next(_arrivals))
    priority: int = 0
    cache_salt: str | None = None  # the prefix cache shares blocks only among sequences with the same salt
    first_scheduled: float | None = None  # time.perf_counter() when first admitted to the batch
    # With params.logprobs set, the model runner appends each sampled token's (TokenLogprobs) as it is
    # sampled, before the scheduler appends the token: entry i is output token i's. Entries past the
    # output belong to tokens dropped after a stop.
    logprobs: list | None = None
    # With params.prompt_logprobs set, the runner appends prompt token i's as its prefill computes
    # position i - 1 (entry 0, the first token's, is None): complete at num_prompt_tokens entries.
    prompt_logprobs: list | None = None
    # With params.structured_outputs set: its matcher (tandem.engine.structured.Constraint), which the
    # model runner masks the logits with and advances as it samples.
    constraint: object | None = None
    # With params.bad_words set: the token sequences they ban, tokenized by the engine
    # (tandem.engine.logits_processors.bad_words_token_ids).
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self):
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequest("request_id", "must be a non-empty string")
        tokens = list(self.prompt_token_ids)
        if not tokens:
            raise InvalidRequest("prompt", "must contain at least one token")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in tokens):
            raise InvalidRequest("prompt", "token ids must be non-negative integers")
        self.prompt_token_ids = tokens
        if not isinstance(self.params, SamplingParams):
            raise InvalidRequest("params", f"must be SamplingParams, got {type(self.params).__name__}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise InvalidRequest("priority", f"must be an integer, got {self.priority!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InvalidRequest("cache_salt", "must be a non-empty string when given")
        if self.logprobs is None and self.params.logprobs is not None:
            self.logprobs = []
        if self.prompt_logprobs is None and self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def rank(self) -> tuple[int, int]:
        """The scheduler's order: admitted (and kept) from the lowest, preempted from the highest."""
        return self.priority, self.arrival

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs were asked for and some are still to compute (no prefix-cache hits then)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]
