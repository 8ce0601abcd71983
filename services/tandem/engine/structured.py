"""Structured outputs: the output held to a JSON schema, a regular expression, a choice of strings
or a grammar (SamplingParams.structured_outputs), enforced token by token by llguidance (one of
vLLM's structured-output backends, and llama.cpp's).

A request's constraint compiles once into a matcher over the model's tokenizer (`Grammars.compile`,
cached by constraint: the same schema again is a copy); each Sequence has its own matcher
(`Constraint`). Before a constrained row is sampled, the tokens its matcher cannot take next are
masked out of its logits (`mask_logits`); after, the sampled token advances the matcher (`advance`).
The sequence finishes with "stop" at the token that completes the constraint (the scheduler checks
`Constraint.completed_at`), with "length" if max_tokens comes first.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.engine.sampling_params import NO_TOKEN, InvalidRequest, StructuredOutputs

log = logging.getLogger(__name__)

CACHED_GRAMMARS = 256  # compiled constraints kept for reuse, least recently used out first
# JSON is written compactly: with whitespace allowed between tokens, a weak model can spend its
# max_tokens on it. A schema's own "x-guidance" options come after these (whitespace_flexible: true).
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(eq=False)
class Constraint:
    """One sequence's matcher and where it stands: `consumed` output tokens taken so far; the count
    at which the constraint was complete (`completed_at`) or the matcher failed (`failed_at`)."""

    matcher: object  # llguidance.LLMatcher
    vocab_size: int  # its masks' width: the logits', or the tokenizer's where that has more tokens
    consumed: int = 0
    completed_at: int | None = None
    failed_at: int | None = None

    @property
    def done(self) -> bool:
        """Whether its sequence takes no more constrained tokens (the ones after are dropped)."""
        return self.completed_at is not None or self.failed_at is not None


class Grammars:
    """Compiles constraints for one tokenizer. Thread-safe: EngineLoop compiles a request's in a
    worker thread before the engine's thread admits it (a complex schema can take a while)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        """tokenizer: a `tokenizers.Tokenizer`; vocab_size: the logits' width."""
        self._hf_tokenizer = tokenizer  # serialized for llguidance on first use, not at every engine's start
        self._vocab_size = max(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer = None  # llguidance.LLTokenizer, made on first use (~1 s for a large vocabulary)
        self._cache: OrderedDict[str, object] = OrderedDict()  # grammar text -> a matcher at its start

    def _tokenizer(self):
        import llguidance

        with self._lock:
            if self._ll_tokenizer is None:
                eos = self._eos[0] if len(self._eos) == 1 else (self._eos or None)
                self._ll_tokenizer = llguidance.LLTokenizer(self._hf_tokenizer.to_str(), n_vocab=self._vocab_size,
                                                            eos_token=eos)
            return self._ll_tokenizer

    def compile(self, constraint: StructuredOutputs) -> Constraint:
        """A fresh matcher for `constraint`; InvalidRequest naming the field when it does not compile."""
        import llguidance

        grammar = _grammar_text(constraint)
        with self._lock:
            start = self._cache.get(grammar)
            if start is not None:
                self._cache.move_to_end(grammar)
        if start is None:
            tokenizer = self._tokenizer()
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
            if failed:
                raise InvalidRequest(f"structured_outputs.{constraint.kind}", f"does not compile: {messages[0]}")
            start = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if start.is_error():
                raise InvalidRequest(f"structured_outputs.{constraint.kind}", f"does not compile: {start.get_error()}")
            with self._lock:
                self._cache[grammar] = start
                if len(self._cache) > CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
        return Constraint(start.deep_copy(), self._vocab_size)


def _grammar_text(constraint: StructuredOutputs) -> str:
    """llguidance's grammar for a constraint (its grammar_from, without a JSON round trip of choices)."""
    from llguidance import LLMatcher, grammar_from

    kind = constraint.kind
    if kind == "json":
        schema = constraint.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequest("structured_outputs.json", f"is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidRequest("structured_outputs.json", "must be a JSON schema object")
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidRequest("structured_outputs.json", str(exc)) from None
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(constraint.regex)
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in constraint.choice))
    try:
        return grammar_from("grammar", constraint.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise InvalidRequest("structured_outputs.grammar", str(exc)) from None


def mask_logits(logits: torch.Tensor, constraints: list[Constraint | None]) -> torch.Tensor:
    """logits [B, V] -> the same with every token a row's matcher cannot take next at -inf (a new
    tensor), or `logits` itself when no row is constrained. Rows without a constraint, or whose
    constraint is done, are left as they are."""
    from llguidance.torch import fill_next_token_bitmask_par

    rows = [i for i, c in enumerate(constraints) if c is not None and not c.done]
    if not rows:
        return logits
    vocab = logits.shape[1]
    words = (max(constraints[i].vocab_size for i in rows) + 31) // 32
    bitmask = torch.zeros((len(rows), words), dtype=torch.int32)  # [R, W]: bit j of word w allows token 32w + j
    fill_next_token_bitmask_par(_executor(), [(constraints[i].matcher, r) for r, i in enumerate(rows)], bitmask)
    # Unpacked with torch ops rather than llguidance.torch's apply (a torch.compile'd kernel: a
    # compiler at serving time, and a recompilation per batch shape): each byte of the mask looks up
    # its 8 tokens' biases, 0 or -inf, added to the logits. A masked_fill with the mask unpacked
    # to bools costs ~6x as much on a CPU core (benchmarks/RESULTS.md, round twenty-four).
    bias = F.embedding(bitmask.view(torch.uint8).to(logits.device).long(), _byte_biases(logits))  # [R, 4W, 8]
    bias = bias.view(len(rows), words * 32)[:, :vocab]  # [R, V]
    if len(rows) == len(constraints):
        return logits + bias
    index = torch.tensor(rows, device=logits.device)
    out = logits.clone()
    out[index] = logits[index] + bias
    return out


def _byte_biases(logits: torch.Tensor) -> torch.Tensor:
    """[256, 8]: for each byte of a mask, its bits' biases, lowest first (0 allows, -inf blocks)."""
    key = (logits.device, logits.dtype)
    table = _BYTE_BIASES.get(key)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1  # [256, 8]
        table = _BYTE_BIASES[key] = torch.where(bits == 1, 0.0, float("-inf")).to(logits.device, logits.dtype)
    return table


_BYTE_BIASES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def advance(constraints: list[Constraint | None], tokens: list[int]) -> None:
    """Each constrained row's sampled token goes into its matcher (tokens: one per row). A row whose
    constraint is done takes no more; a NO_TOKEN row fails by itself (the scheduler ends it)."""
    for c, token in zip(constraints, tokens):
        if c is None or c.done or token == NO_TOKEN:
            continue
        c.consumed += 1
        if not c.matcher.consume_token(token):
            c.failed_at = c.consumed
            log.error("structured output: the matcher refused token %d after %d tokens: %s", token,
                      c.consumed - 1, c.matcher.get_error())
        elif c.matcher.is_stopped():
            c.completed_at = c.consumed


_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _executor():
    """llguidance's thread pool for computing several rows' masks at once (one per process)."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            import llguidance

            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR
