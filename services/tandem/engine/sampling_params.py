"""Per-request sampling settings, checked on construction."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace


class InvalidRequest(ValueError):
    """A request the user can fix. `field` names what is wrong (gRPC maps it to INVALID_ARGUMENT)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


DEFAULT_MAX_TOKENS = 16

# The token sampled for a sequence whose logits hold a NaN or +inf, or nothing finite: the model went
# wrong for it, or its masks blocked every token; the scheduler finishes it with "error" (tandem.engine.sampler).
NO_TOKEN = -1

# A temperature below this samples greedily: dividing by it would overflow float32 (vLLM's _SAMPLING_EPS).
GREEDY_BELOW = 1e-5

# The most top logprobs a request may ask for per token (vLLM's and OpenAI's default limit).
MAX_LOGPROBS = 20

# The most completions one request may ask for (SamplingParams.n).
MAX_N = 16

# The largest logit bias either way (OpenAI's and vLLM's range).
MAX_LOGIT_BIAS = 100


def check_in_vocabulary(field_name: str, token_ids, vocab: int) -> None:
    """InvalidRequest naming `field_name` for the first of `token_ids` outside [0, vocab)."""
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(field_name, f"token id {bad} is outside the vocabulary [0, {vocab})")


class DuplicateRequest(InvalidRequest):
    """A request_id already in flight (gRPC: ALREADY_EXISTS)."""

    def __init__(self, request_id: str):
        super().__init__("request_id", f"{request_id!r} is already running")


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output, exactly one of (vLLM's StructuredOutputsParams): `json`, a JSON
    schema (a dict, or its JSON text); `regex`, a regular expression the whole output matches;
    `choice`, strings of which the output is one; `grammar`, a Lark or GBNF grammar; `json_object`,
    any JSON object. Compiled for the model's tokenizer by tandem.engine.structured."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise InvalidRequest("structured_outputs.choice", f"must be a list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise InvalidRequest("structured_outputs.choice", "must be non-empty strings, at least one")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequest(f"structured_outputs.{name}", f"must be a non-empty string, got {value!r}")
        if self.json is not None and (not isinstance(self.json, (str, dict)) or not self.json):
            raise InvalidRequest("structured_outputs.json", "must be a JSON schema: an object or its JSON text")
        if not isinstance(self.json_object, bool):
            raise InvalidRequest("structured_outputs.json_object", f"must be true or false, got {self.json_object!r}")
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequest("structured_outputs", f"give exactly one of json, regex, choice, grammar and "
                                 f"json_object, got {', '.join(given) or 'none'}")

    @property
    def kind(self) -> str:
        """Which constraint it is: json, regex, choice, grammar or json_object."""
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None) \
            if not self.json_object else "json_object"


@dataclass(frozen=True)
class SamplingParams:
    # None: DEFAULT_MAX_TOKENS, or fewer where the context ends first (the request then finishes
    # with "length" at the context's end, as vLLM's does). One that is set must fit the context.
    max_tokens: int | None = None
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, as vLLM spells it) means off
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the likeliest; 0 means off
    # Penalties on the logits before temperature, as vLLM applies them: repetition over the prompt's
    # and the output's tokens (a positive logit divided by it, a negative one multiplied, as in
    # transformers' RepetitionPenaltyLogitsProcessor); presence and frequency over the output's
    # (OpenAI's: minus presence once a token appeared, minus frequency times its count).
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Log-probabilities of each generated token, with this many of the likeliest alternatives
    # (0: the generated token's alone); None: none. From the model's raw distribution, before
    # penalties, temperature and cuts (vLLM's default, raw logprobs).
    logprobs: int | None = None
    # The same for each prompt token after the first (under the model's distribution given the
    # tokens before it): scoring a text. Such a request takes no prefix-cache hits.
    prompt_logprobs: int | None = None
    seed: int | None = None
    # The output constrained to a JSON schema, regex, choice or grammar; None: unconstrained.
    structured_outputs: StructuredOutputs | None = None
    # Completions generated for the prompt, each sampled on its own (completion i with seed + i).
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Logits processors, applied before the penalties in vLLM's order: allowed_token_ids, bad_words,
    # min_tokens, logit_bias (tandem.engine.logits_processors). Token ids must be in the vocabulary.
    # Before min_tokens output tokens, EOS (ignore_eos or not, as vLLM) and stop_token_ids cannot be
    # sampled, and stop strings are not looked for: one counts only when it ends in the text of a later
    # token (vLLM's). At most max_tokens.
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled; None: any
    # Strings never generated: each (left-stripped) is tokenized as it is, and after a space where that
    # gives as many tokens and another first one (vLLM's rule); a token sequence's last token is
    # blocked right after the output's last tokens are the ones before it. Needs a tokenizer.
    bad_words: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False  # the text ends with the stop string that ended it
    skip_special_tokens: bool = True  # leave special tokens (e.g. </s>) out of the text
    # Keep only the prompt's last k tokens (vLLM's left truncation); -1: as many as leave room for one
    # output token in the context; None: the whole prompt (too long a one is refused).
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        self._check_kinds()
        self._check_processors()
        # One string is one stop string (as vLLM takes it), not a tuple of its characters.
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(s, str) for s in self.stop):
            raise InvalidRequest("stop", f"must be strings, got {self.stop!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids", f"must be token ids >= 0, got {self.stop_token_ids!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequest("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not 0 <= self.temperature < math.inf:
            raise InvalidRequest("temperature", f"must be a number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequest("top_k", f"must be >= 0 (0 or -1 turns it off), got {self.top_k}")
        object.__setattr__(self, "top_k", max(self.top_k, 0))
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty < math.inf:
            raise InvalidRequest("repetition_penalty", f"must be a number > 0 (1 turns it off), "
                                 f"got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequest(name, f"must be in [-2, 2], got {getattr(self, name)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequest(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop", "stop strings must not be empty")
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequest("n", f"must be in [1, {MAX_N}], got {self.n}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise InvalidRequest("structured_outputs", f"must be StructuredOutputs, got "
                                 f"{type(self.structured_outputs).__name__}")
        if self.truncate_prompt_tokens is not None and (not _is_int(self.truncate_prompt_tokens) or not (
                self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)):
            raise InvalidRequest("truncate_prompt_tokens", f"must be an integer >= 1, or -1 (as many as fit), "
                                 f"got {self.truncate_prompt_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(1 << 63) <= self.seed < 1 << 64):
            raise InvalidRequest("seed", f"must be an integer in [-2**63, 2**64), got {self.seed!r}")

    def _check_kinds(self) -> None:
        if self.max_tokens is not None and not _is_int(self.max_tokens):
            raise InvalidRequest("max_tokens", f"must be an integer, got {self.max_tokens!r}")
        for name in ("top_k", "n", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if not _is_int(value) and not (name in ("logprobs", "prompt_logprobs") and value is None):
                raise InvalidRequest(name, f"must be an integer, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise InvalidRequest(name, f"must be a number, got {value!r}")
        if not isinstance(self.stop, (str, list, tuple)):
            raise InvalidRequest("stop", f"must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidRequest("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(name, f"must be true or false, got {getattr(self, name)!r}")

    def _check_processors(self) -> None:
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidRequest("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest("min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise InvalidRequest("allowed_token_ids", f"must be a non-empty list of token ids, "
                                     f"got {self.allowed_token_ids!r}")
            if any(not _is_int(t) or t < 0 for t in self.allowed_token_ids):
                raise InvalidRequest("allowed_token_ids", f"must be token ids >= 0, got {self.allowed_token_ids!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        # One string is one word, as one stop string is.
        words = (self.bad_words,) if isinstance(self.bad_words, str) else self.bad_words
        if not isinstance(words, (list, tuple)) or any(not isinstance(w, str) or not w.lstrip() for w in words):
            raise InvalidRequest("bad_words", f"must be strings with more than spaces, got {self.bad_words!r}")
        object.__setattr__(self, "bad_words", tuple(words))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether the logits are changed by the tokens seen so far (so even greedy depends on them)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def processes_logits(self) -> bool:
        """Whether a logits processor changes the logits (min_tokens, logit_bias, allowed_token_ids, bad_words)."""
        return bool(self.min_tokens or self.logit_bias or self.allowed_token_ids is not None or self.bad_words)

    def within(self, room: int) -> SamplingParams:
        """These params with max_tokens resolved for a prompt that leaves `room` tokens of context."""
        return self if self.max_tokens is not None else replace(self, max_tokens=min(DEFAULT_MAX_TOKENS, room))


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _checked_logit_bias(value) -> dict[int, float] | None:
    """A logit_bias as {token id: float bias}, None when empty; InvalidRequest naming it otherwise."""
    if not isinstance(value, dict):
        raise InvalidRequest("logit_bias", f"must map token ids to biases, got {value!r}")
    # JSON's keys are strings: "50256" is token 50256 (vLLM takes int(key) too)
    bias = {int(t) if isinstance(t, str) and t.isdecimal() else t: b for t, b in value.items()}
    if any(not _is_int(t) or t < 0 for t in bias):
        raise InvalidRequest("logit_bias", f"keys must be token ids >= 0, got {list(value)!r}")
    bad = next((b for b in bias.values() if isinstance(b, bool) or not isinstance(b, numbers.Real)
                or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS), None)
    if bad is not None:
        raise InvalidRequest("logit_bias", f"biases must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {bad!r}")
    return {int(t): float(b) for t, b in bias.items()} or None


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability under the model's raw distribution, its rank there (1:
    the likeliest), and the likeliest tokens' (token id, log-probability), likeliest first."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """What one engine step produced for one completion of a request (one of its SamplingParams.n)."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_output_tokens: int = 0
    text: str = ""  # detokenized delta for new_token_ids (empty without a tokenizer)
    logprobs: list[TokenLogprobs] | None = None  # one per new_token_ids entry, when the request asked
    # One per prompt token (None for the first), in the first output after the prompt is computed
    # (of completion 0 only: the prompt is scored once).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    index: int = 0  # which of the request's SamplingParams.n completions this output is of
    # When finished "stop": the stop token id (of stop_token_ids) or stop string that ended it; None
    # for an end-of-sequence token or a complete structured output (as vLLM's CompletionOutput).
    stop_reason: int | str | None = None
    # time.perf_counter() when the completion's sequence was first scheduled (its prefill's start).
    first_scheduled: float | None = None
