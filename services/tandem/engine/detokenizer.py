"""Incremental detokenization and stop strings.

Text is streamed as deltas. A delta never ends in half a UTF-8 character, and while stop strings
are set the last few characters are held back, so a stop string is never streamed before it is
recognised (the returned text excludes it, as vLLM does).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # all output text decoded so far (before stop truncation)
        self.emitted = 0  # characters already streamed
        # Decoding in context keeps leading spaces right for tokenizers that strip them at the start.
        self.context = prompt_ids[-4:]
        self.context_len = len(tokenizer.decode(self.context, skip_special_tokens=True)) if self.context else 0

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Append tokens; return (text delta, whether a stop string was hit)."""
        self.ids.extend(token_ids)
        full = self.tokenizer.decode(self.context + self.ids, skip_special_tokens=True)
        self.text = full[self.context_len:]
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1:
                return self._emit(at), True
        end = len(self.text)
        if self.text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            end = len(self.text.rstrip("\ufffd"))
        return self._emit(max(self.emitted, end - self.hold)), False

    def flush(self) -> str:
        """The held-back tail, when the request finishes for another reason."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        delta = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return delta
