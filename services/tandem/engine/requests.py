"""The engine's requests, from admission to their last output: each request's SamplingParams.n
completions, a Sequence each with its own generator, structured-output matcher and detokenizer,
and what each has reported so far (a RequestOutput carries what is new since the last).

Plain bookkeeping: the scheduler decides what runs and when a sequence finishes; `Requests` turns
the sequences' progress into RequestOutputs and forgets a request once its last completion is done.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import torch

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.sampling_params import RequestOutput, SamplingParams, TokenLogprobs
from tandem.engine.sequence import Sequence
from tandem.engine.structured import Constraint


@dataclass
class Completion:
    """A finished completion of a request, as `LLMEngine.generate` returns it."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked for them
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token (None for the first)
    index: int = 0  # which of the request's SamplingParams.n completions (prompt_logprobs come with 0's)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (not EOS)

    @classmethod
    def from_outputs(cls, outputs: list[RequestOutput]) -> Completion:
        """The completion that `outputs`, all of one completion's in order, make up."""
        last = outputs[-1]
        logprobs = None if last.logprobs is None else [lp for o in outputs for lp in o.logprobs]
        prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
        return cls(last.request_id, [t for o in outputs for t in o.new_token_ids], "".join(o.text for o in outputs),
                   last.finish_reason, last.num_prompt_tokens, last.num_cached_tokens, logprobs, prompt_logprobs,
                   last.index, last.stop_reason)


@dataclass
class CompletionState:
    """One completion of a request: its sequence, and what of it has been reported."""

    request_id: str
    index: int
    seq: Sequence
    generator: torch.Generator | None
    detok: IncrementalDetokenizer | None
    reported: int = 0  # output tokens already returned
    pending_text: str = ""
    stopped_by_string: bool = False  # its text ends before a stop string
    prompt_reported: bool = False  # its prompt logprobs returned

    def detokenize(self) -> str | None:
        """Decode the tokens not reported yet; the stop string one of them completed, if any (the
        sequence's tokens after it are dropped here; finishing it is the caller's)."""
        seq, detok = self.seq, self.detok
        if detok is None:
            return None
        new = seq.output_token_ids[self.reported:]
        # With stop strings, the tokens of a multi-step decode go in one at a time: those after
        # the token that completes a stop string are dropped, as the scheduler drops a stop token's.
        for i, chunk in enumerate([[t] for t in new] if detok.stop and len(new) > 1 else [new]):
            delta, hit = detok.add(chunk)
            self.pending_text += delta
            if hit:
                del seq.output_token_ids[self.reported + i + len(chunk):]
                self.stopped_by_string = True
                return detok.stop_str
        return None

    def output(self, finished: bool) -> RequestOutput:
        """What is new since the last output: tokens, text, logprobs (and the prompt's, once)."""
        seq = self.seq
        new = seq.output_token_ids[self.reported:]
        logprobs = None if seq.logprobs is None else seq.logprobs[self.reported:seq.num_output_tokens]
        prompt_logprobs = None
        if seq.prompt_logprobs is not None and not self.prompt_reported and not seq.needs_prompt_logprobs:
            prompt_logprobs, self.prompt_reported = list(seq.prompt_logprobs), True
        text, self.pending_text = self.pending_text, ""
        if self.detok is not None:
            if len(self.detok.ids) < seq.num_output_tokens:
                delta, _ = self.detok.add(seq.output_token_ids[len(self.detok.ids):])
                text += delta
            if finished and not self.stopped_by_string:  # the tail held back in case a stop string began there
                text += self.detok.flush()
        self.reported = seq.num_output_tokens
        return RequestOutput(
            request_id=self.request_id, new_token_ids=list(new), finished=finished,
            finish_reason=seq.finish_reason if finished else None, num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens, num_output_tokens=seq.num_output_tokens, text=text,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, index=self.index,
            stop_reason=seq.stop_reason if finished else None, first_scheduled=seq.first_scheduled,
        )


@dataclass
class Request:
    request_id: str
    completions: list[CompletionState]  # by index; the request is over when the last one finishes

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.completions]


class Requests(Mapping[str, Request]):
    """The requests by id until their last completion finishes, and their unfinished completions
    by sequence id. Not thread-safe: the engine's thread owns it."""

    def __init__(self, tokenizer, device: torch.device):
        self.tokenizer, self.device = tokenizer, device  # tokenizer None: no text, no stop strings
        self._requests: dict[str, Request] = {}
        self._unfinished: dict[str, CompletionState] = {}  # by their sequence's id

    def __getitem__(self, request_id: str) -> Request:
        return self._requests[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def create(self, request_id: str, prompt: list[int], params: SamplingParams, constraint: Constraint | None,
               bad_words: list[list[int]] | None, priority: int = 0, cache_salt: str | None = None) -> Request:
        """A request's SamplingParams.n completions, not tracked until `add`. `constraint`, the
        request's structured output compiled (at its start), is completion 0's; the others get copies."""
        constraints = [constraint] * params.n
        if constraint is not None:
            constraints[1:] = [replace(constraint, matcher=constraint.matcher.deep_copy()) for _ in constraints[1:]]
        return Request(request_id, [self._completion(request_id, i, prompt, params, constraints[i], bad_words,
                                                     priority, cache_salt) for i in range(params.n)])

    def _completion(self, request_id: str, index: int, prompt: list[int], params: SamplingParams,
                    constraint: Constraint | None, bad_words: list[list[int]] | None, priority: int,
                    cache_salt: str | None) -> CompletionState:
        """Completion `index` of a request: its sequence, its generator (seeded with seed + index)
        and its detokenizer."""
        if index > 0:  # the prompt is scored once, by completion 0
            params = replace(params, prompt_logprobs=None)
        seq = Sequence(sequence_id(request_id, index, params.n), list(prompt), params,
                       constraint=constraint, bad_words_token_ids=bad_words, priority=priority,
                       cache_salt=cache_salt)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(completion_seed(params.seed, index))
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, params.stop, min_tokens=params.min_tokens,
                include_stop=params.include_stop_str_in_output, skip_special_tokens=params.skip_special_tokens)
        return CompletionState(request_id, index, seq, generator, detok)

    def add(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._unfinished.update((c.seq.request_id, c) for c in request.completions)

    def completion(self, seq: Sequence) -> CompletionState | None:
        """The completion whose sequence `seq` is; None once it has finished (or was aborted)."""
        return self._unfinished.get(seq.request_id)

    def unfinished(self, request_id: str) -> list[CompletionState]:
        """The request's completions not finished yet; none for a request unknown or finished."""
        req = self._requests.get(request_id)
        return [] if req is None else [c for c in req.completions if c.seq.request_id in self._unfinished]

    def output(self, comp: CompletionState, finished: bool) -> RequestOutput:
        """`comp`'s output since its last. A finished completion is forgotten, its request with the last."""
        out = comp.output(finished)
        if finished:
            del self._unfinished[comp.seq.request_id]
            if not self.unfinished(comp.request_id):
                del self._requests[comp.request_id]
        return out


def sequence_id(request_id: str, index: int, n: int) -> str:
    """The scheduler's id of completion `index` of a request for `n`: the request's own id for one
    completion (unless it holds a '#'), else f"{request_id}#{index}". Two (request id, index) pairs
    never share one: an id with a '#' splits back into them at its last '#'."""
    return request_id if n == 1 and "#" not in request_id else f"{request_id}#{index}"


def completion_seed(seed: int, index: int) -> int:
    """Completion `index`'s seed: seed + index, wrapped past torch's largest seed (2**64 - 1) into
    the negative seeds it also takes."""
    seeded = seed + index
    return seeded - (1 << 64) if seed < 1 << 64 <= seeded else seeded
