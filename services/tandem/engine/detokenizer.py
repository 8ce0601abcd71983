"""Incremental detokenization and stop strings.

Text is streamed as deltas. Each token is decoded once, by `tokenizers`' DecodeStream (seeded
with the prompt's last tokens, so that tokenizers which strip a leading space at the start of a
text keep it), so a token costs the same at the 10,000th output token as at the first; a delta
never ends in half a UTF-8 character. While stop strings are set the last few characters are
held back, so a stop string is never streamed before it is recognised; the text stops before the
earliest occurrence of any of them and excludes it, as vLLM's does (or ends with it, with
include_stop_str_in_output, and nothing is held back). As in vLLM, a stop string counts only when
it ends in the text of a token after the first min_tokens.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

CONTEXT_TOKENS = 4  # prompt tokens the stream starts from: enough for any decoder's leading-space rule
MAX_CHARACTER_TOKENS = 3  # a prompt may end in up to 3 bytes (tokens) of a 4-byte UTF-8 character
WINDOW = CONTEXT_TOKENS + MAX_CHARACTER_TOKENS  # the last tokens a stream is started from


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...], *, min_tokens: int = 0,
                 include_stop: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop, self.min_tokens, self.include_stop = stop, min_tokens, include_stop
        self.skip_special_tokens = skip_special_tokens
        self.hold = 0 if include_stop else max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # all output text decoded so far (before stop truncation)
        self.stop_str: str | None = None  # the stop string that ended the text, once one has
        self.emitted = 0  # characters already streamed
        self._prompt_tail = prompt_ids[-WINDOW:]
        self._stream = self._new_stream()
        self._undecoded: list[int] = []  # the last tokens, part of a character not yet complete

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Append tokens; return (text delta, whether a stop string was hit)."""
        start = len(self.text)
        for token in token_ids:
            chunk = self._step(token)
            self.ids.append(token)
            if chunk is None:
                self._undecoded.append(token)
            else:
                self._undecoded.clear()
                self.text += chunk
            if len(self.ids) <= self.min_tokens:
                start = len(self.text)
        # A stop string found now ends in the new text: search only from where it could begin.
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, max(0, start - len(s) + 1))) != -1]
        if hits:
            at, s = min(hits, key=lambda hit: hit[0])
            self.stop_str = s
            return self._emit(at + len(s) if self.include_stop else at), True
        return self._emit(max(self.emitted, len(self.text) - self.hold)), False

    def flush(self) -> str:
        """The held-back tail, when the request finishes for another reason: with the last tokens'
        bytes as the whole output's decode gives them, when they end in half a character."""
        if self._undecoded:
            self.text += self.tokenizer.decode(self._undecoded, skip_special_tokens=self.skip_special_tokens)
            self._undecoded.clear()
        return self._emit(len(self.text))

    def _new_stream(self) -> DecodeStream:
        """A stream that goes on from the last tokens so far: the prompt's, then the output's."""
        skip = self.skip_special_tokens
        context, partial = _context(self.tokenizer, (self._prompt_tail + self.ids[-WINDOW:])[-WINDOW:], skip)
        stream = DecodeStream(ids=context, skip_special_tokens=skip)
        if partial:  # it ends inside a character: the text to come begins with the character
            try:
                stream.step(self.tokenizer, partial)
            except Exception:  # noqa: BLE001 - as in _step; then the character's first bytes are left out
                stream = DecodeStream(ids=context, skip_special_tokens=skip)
        return stream

    def _step(self, token: int) -> str | None:
        # Byte-fallback tokens of invalid UTF-8 can decode differently as more arrive, which a
        # DecodeStream refuses (vllm-project/vllm#17448): go on with a new one from here, and if
        # that refuses the token too, with one that has no context.
        for renew in (lambda: self._stream, self._new_stream,
                      lambda: DecodeStream(skip_special_tokens=self.skip_special_tokens)):
            self._stream = renew()
            try:
                return self._stream.step(self.tokenizer, token)
            except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
                if "Invalid prefix" not in str(exc):
                    raise
                self._undecoded.clear()
        raise AssertionError("a DecodeStream without context has no prefix to refuse")

    def _emit(self, upto: int) -> str:
        delta = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return delta


def _context(tokenizer, tail: list[int], skip_special_tokens: bool) -> tuple[list[int], list[int]]:
    """The last tokens before the stream split into (context, partial): the context begins and
    ends where characters do (a stream seeded with half a character would stream its context again,
    and a byte-fallback decoder turns every byte of a run that begins inside a character into
    U+FFFD), and partial is the first bytes of the character the stream's text completes, if the
    tokens end inside one. Without such a context (invalid UTF-8) the context only ends cleanly,
    or the stream gets none."""
    def text(ids):
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    cuts = range(min(MAX_CHARACTER_TOKENS, len(tail)) + 1)
    for n in cuts:
        for start in cuts:
            context = tail[start:len(tail) - n]
            if context and "\ufffd" not in text(context):
                return context, tail[len(tail) - n:]
    for n in cuts:
        if not text(tail[:len(tail) - n]).endswith("\ufffd"):
            return tail[:len(tail) - n], tail[len(tail) - n:]
    return [], []
