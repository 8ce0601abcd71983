"""Per-request logits processors: allowed_token_ids, bad_words, min_tokens and logit_bias.

Applied in vLLM's order (vLLM V1's Sampler.apply_logits_processors, vllm/v1/sample/sampler.py: the
allowed token ids' mask, then bad words, then the processors that can change the argmax, in
BUILTIN_LOGITS_PROCESSORS' order MinTokensLogitsProcessor then LogitBiasLogitsProcessor, then the
penalties); the penalties, temperature and the cuts follow in tandem.engine.sampler. A structured
output's mask comes before them all; where together they block every token of a row, the row gets
NO_TOKEN and its sequence finishes with "error".

Like Penalties, each is vectorised over the batch: (row, token id) pairs on the logits' device, built
once for a batch (`LogitsProcessors.of`), and `add` advances what depends on the output by a step's
tokens without leaving the device (a multi-step decode): min_tokens' count of output tokens, and the
last output tokens that a bad word's prefix is matched against. allowed_token_ids is a [R, V] mask
of the rows that set it, built once: such a row blocks all the vocabulary but a few tokens anyway.
"""

from __future__ import annotations

import torch

from tandem.engine.sampling_params import InvalidRequest, SamplingParams, check_in_vocabulary

NOT_YET = -1  # the recent tokens of a row before its output has that many: no token id matches it
ANY = -2  # a bad word's pattern before its prefix (shorter than the longest): matches any token


class LogitsProcessors:
    """The processors of the rows of a batch whose params set one (SamplingParams.processes_logits)."""

    def __init__(self, rows: list[int], params: list[SamplingParams], outputs: list[list[int]],
                 bad_words: list[list[list[int]]], eos_token_ids, vocab: int, device: torch.device):
        """rows: the batch rows; for each, its params, output token ids so far, and bad words' token
        sequences (Sequence.bad_words_token_ids); vocab: the logits' width."""
        self.index = _tensor(rows, device)  # [R]: the batch rows
        allowed = [r for r, p in enumerate(params) if p.allowed_token_ids is not None]
        self.allowed = self.index[_tensor(allowed, device)]  # [A]
        self.blocked = _blocked(allowed, params, vocab).to(device)  # [A, V]
        self.words, self.recent = _bad_words(bad_words, outputs, device)
        # min_tokens: each row's EOS and stop tokens (vLLM's all_stop_token_ids), while its output is shorter
        stops = [(r, t) for r, p in enumerate(params) if len(outputs[r]) < p.min_tokens
                 for t in set(eos_token_ids).union(p.stop_token_ids)]
        self.stops = tuple(_tensor([pair[i] for pair in stops], device) for i in (0, 1))  # ([M], [M])
        self.counts = _tensor([len(out) for out in outputs], device)  # [R]
        self.min_tokens = _tensor([p.min_tokens for p in params], device)  # [R]
        bias = [(r, t, b) for r, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        self.bias = (self.index[_tensor([r for r, _, _ in bias], device)], _tensor([t for _, t, _ in bias], device),
                     _tensor([b for _, _, b in bias], device, torch.float32))  # ([N], [N], [N])

    @classmethod
    def of(cls, seqs, eos_token_ids, vocab: int, device: torch.device) -> LogitsProcessors | None:
        """For a batch of Sequences (tandem.engine.sequence) in row order; None when none sets one."""
        rows = [i for i, s in enumerate(seqs) if s.params.processes_logits]
        if not rows:
            return None
        return cls(rows, [seqs[i].params for i in rows], [seqs[i].output_token_ids for i in rows],
                   [seqs[i].bad_words_token_ids or [] for i in rows], eos_token_ids, vocab, device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> processed float32 logits [B, V] (a new tensor). A blocked token's logit
        is -inf; blocks are added as -inf (and 0 where a pair does not block), so that pairs listed
        twice (two words ending in the same token) never race."""
        out = logits.to(torch.float32, copy=True)  # [B, V]
        if len(self.allowed):
            out[self.allowed] = out[self.allowed].masked_fill(self.blocked, float("-inf"))
        rows, patterns, lasts = self.words
        if len(lasts):
            recent = self.recent[rows]  # [W, K]
            match = ((recent == patterns) | (patterns == ANY)).all(dim=1)  # [W]
            out.index_put_((self.index[rows], lasts), _blocks(match), accumulate=True)
        rows, ids = self.stops
        if len(ids):
            short = self.counts[rows] < self.min_tokens[rows]  # [M]
            out.index_put_((self.index[rows], ids), _blocks(short), accumulate=True)
        rows, ids, bias = self.bias
        if len(ids):
            out.index_put_((rows, ids), bias, accumulate=True)
        return out

    def add(self, tokens: torch.Tensor) -> None:
        """A step's tokens [B] join the outputs they were sampled for. A NO_TOKEN counts as token 0:
        its sequence finishes with "error", and the tokens sampled after it are dropped."""
        new = tokens[self.index].clamp_min(0)  # [R]
        self.counts = self.counts + 1
        if self.recent.shape[1]:
            self.recent = torch.cat([self.recent[:, 1:], new[:, None]], dim=1)  # [R, K]


def _tensor(values: list, device: torch.device, dtype=torch.long) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _blocked(allowed: list[int], params: list[SamplingParams], vocab: int) -> torch.Tensor:
    """[A, V] bool, on the CPU: for each row r in `allowed`, the tokens outside params[r].allowed_token_ids."""
    blocked = torch.ones(len(allowed), vocab, dtype=torch.bool)  # [A, V]
    for a, r in enumerate(allowed):
        blocked[a, list(params[r].allowed_token_ids)] = False
    return blocked


def _bad_words(bad_words: list[list[list[int]]], outputs: list[list[int]], device: torch.device):
    """The rows' bad words as (word row [W], pattern [W, K], last token [W]), and each row's last K output
    tokens [R, K] (NOT_YET before the first), K the longest prefix: a pattern is a word's prefix
    right-aligned, ANY before it, so that a word matches where its pattern equals the last tokens."""
    width = max((len(w) - 1 for words in bad_words for w in words), default=0)
    words = [(r, [ANY] * (width + 1 - len(w)) + w[:-1], w[-1]) for r, ws in enumerate(bad_words) for w in ws]
    rows, patterns, lasts = ([word[i] for word in words] for i in (0, 1, 2))
    recent = [([NOT_YET] * width + out)[-width:] if width else [] for out in outputs]
    return ((_tensor(rows, device), _tensor(patterns, device).view(len(words), width), _tensor(lasts, device)),
            _tensor(recent, device).view(len(outputs), width))


def _blocks(blocked: torch.Tensor) -> torch.Tensor:
    """-inf where blocked [N] bool, else 0: what blocking adds to a logit."""
    return torch.zeros(blocked.shape, device=blocked.device).masked_fill_(blocked, float("-inf"))


def bad_words_token_ids(tokenizer, words: tuple[str, ...], vocab: int) -> list[list[int]]:
    """The token sequences `words` ban, by vLLM's rule (SamplingParams.update_from_tokenizer): each
    word, left-stripped, as the tokenizer encodes it, and after a space where that encodes to as many
    tokens with another first one (a word inside a text, where tokenizers fold the space into it).
    InvalidRequest naming bad_words for a token outside the vocabulary."""
    out = []
    for word in words:
        alone, spaced = (tokenizer.encode(text, add_special_tokens=False).ids
                         for text in (word.lstrip(), " " + word.lstrip()))
        if not alone:
            raise InvalidRequest("bad_words", f"{word!r} encodes to no tokens")
        out.append(alone)
        if len(spaced) == len(alone) and spaced[0] != alone[0]:
            out.append(spaced)
    check_in_vocabulary("bad_words", (t for ids in out for t in ids), vocab)
    return out
