"""Next-token sampling: penalties, greedy, temperature, min-p, top-k, top-p, per-request seeds,
and the log-probabilities requests ask for.

In vLLM's order, after the logits processors (tandem.engine.logits_processors): the repetition,
presence and frequency penalties change the logits (greedy sampling included), then temperature
scales them, then min-p, top-k and top-p cut. The masking
is vectorised over the batch; only the random draw of a seeded row is its own, from the row's
generator, so a seeded request gets the same tokens whatever else shares its batch.
The draw is the exponential race (argmax of p / q with q ~ Exp(1)), which samples from p exactly.
A row whose logits hold a NaN or +inf, or no finite value, gets NO_TOKEN rather than a token
that looks real: the model went wrong for that sequence, or its masks (structured output, logits
processors) left no token (the scheduler finishes it with "error").
"""

from __future__ import annotations

import torch

from tandem.engine.sampling_params import NO_TOKEN, SamplingParams, TokenLogprobs


class Sampler:
    """Turns the last position's logits of each sequence into its next token id."""

    def __init__(self, seed: int | None = None):
        self._seed = seed
        self._defaults: dict[torch.device, torch.Generator] = {}  # for unseeded rows, one per device

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None], penalties: Penalties | None = None) -> torch.Tensor:
        """logits [B, V] -> token ids [B] long. Rows with no generator draw from the sampler's own;
        `penalties` holds the tokens seen by the rows whose params set a penalty (Penalties.of)."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        if not len(params) == len(generators) == logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logits rows, {len(params)} params, "
                             f"{len(generators)} generators: they must match")
        if penalties is None and any(p.penalized for p in params):
            raise ValueError("a request sets a penalty: sample needs the tokens its rows have seen (Penalties)")
        logits = logits.float()  # [B, V]
        # argmax prefers a NaN to any number, as max does: the top logit is finite only in a sound row
        top, tokens = logits.max(dim=-1)  # [B] each: the first of tied maxima, as argmax takes
        broken = ~top.isfinite()  # [B]
        if penalties is not None:
            logits = penalties.apply(logits)  # [B, V], a new tensor
            tokens = logits.argmax(dim=-1)  # [B]
        rows = [i for i, p in enumerate(params) if not self.is_greedy(p)]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            probs = self.probs(logits[index], [params[i] for i in rows])  # [R, V]
            drawn = self._race(probs, [generators[i] for i in rows])  # [R]
            tokens[index] = drawn
        return tokens.masked_fill_(broken, NO_TOKEN)

    @staticmethod
    def is_greedy(params: SamplingParams) -> bool:
        """Whether `sample` takes the argmax for these params (temperature 0, or too small to divide by)."""
        return params.greedy

    @staticmethod
    def argmax_only(params: SamplingParams) -> bool:
        """Whether the token is the argmax of the raw logits and nothing else is asked of them (no
        penalty, no logits processor, no logprobs, no structured output): what a fused greedy decode
        (CausalLM.greedy_steps) computes."""
        return (params.greedy and not params.penalized and not params.processes_logits and params.logprobs is None
                and params.structured_outputs is None)

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: torch.Tensor, counts: list[int | None]) -> list[TokenLogprobs | None]:
        """For each row i with counts[i] set: tokens[i]'s log-probability under softmax(logits[i])
        (the raw logits, before penalties and temperature), its rank, and the counts[i] likeliest."""
        rows = [i for i, n in enumerate(counts) if n is not None]
        out: list[TokenLogprobs | None] = [None] * len(counts)
        if not rows:
            return out
        index = torch.tensor(rows, device=logits.device)
        logp = logits[index].float().log_softmax(dim=-1)  # [R, V]
        chosen = logp.gather(1, tokens[index].clamp_min(0)[:, None])  # [R, 1]
        ranks = ((logp > chosen).sum(dim=-1) + 1).tolist()  # [R]
        width = min(max(counts[i] for i in rows), logp.shape[1])
        top_values, top_ids = (v.tolist() for v in logp.topk(width, dim=-1))  # [R, W] each
        for r, (i, logprob) in enumerate(zip(rows, chosen.squeeze(1).tolist())):
            n = counts[i]
            out[i] = TokenLogprobs(logprob, ranks[r], tuple(zip(top_ids[r][:n], top_values[r][:n])))
        return out

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution sampled from: softmax(logits / T), restricted by min-p, then top-k, then top-p."""
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)  # [B]
        scaled = logits / temperature[:, None]  # [B, V]
        if any(p.min_p > 0 for p in params):
            # min-p keeps the tokens whose probability is at least min_p times the top one's: a cut of
            # the logits at the top one's plus log(min_p) (-inf for min_p 0: nothing cut)
            min_p = torch.tensor([p.min_p for p in params], device=device)  # [B]
            floor = scaled.max(dim=-1).values + min_p.log()  # [B]
            scaled = scaled.masked_fill(scaled < floor[:, None], float("-inf"))
        return self._top_k_top_p(scaled, params)

    def _top_k_top_p(self, scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """softmax(scaled) [B, V] restricted by each row's top-k, then top-p."""
        device = scaled.device
        cut = [i for i, p in enumerate(params) if p.top_k or p.top_p < 1]
        if not cut:
            return scaled.softmax(dim=-1)  # [B, V]: nothing to cut, so no sort
        if len(cut) < len(params):  # the rows that cut, apart: the others are their softmax
            out = scaled.softmax(dim=-1)  # [B, V]
            index = torch.tensor(cut, device=device)
            out[index] = self._top_k_top_p(scaled[index], [params[i] for i in cut])
            return out
        top_k = torch.tensor([p.top_k for p in params], device=device)  # [B]
        top_p = torch.tensor([p.top_p for p in params], device=device)  # [B]
        width = max(CANDIDATES, max(p.top_k for p in params) + 1)
        log_total = scaled.logsumexp(dim=-1, keepdim=True) if width < scaled.shape[1] else None  # [B, 1]
        for width in (width, 8 * width):  # a flat row's top_p needs more: 8x as many, then the sort
            if width >= scaled.shape[1]:
                break
            probs = _cut_among_candidates(scaled, log_total, top_k, top_p, width)
            if probs is not None:
                return probs
        return _cut(scaled, top_k, top_p)

    def _race(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        rows, vocab = probs.shape
        # Seeded rows each from their own generator; the unseeded ones in one draw, on the device.
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == rows:
            q = _exponential(rows, vocab, self._default(probs.device))  # [R, V]
        else:
            q = torch.empty_like(probs)  # [R, V]
            for i, g in enumerate(generators):
                if g is not None:
                    q[i] = _exponential(1, vocab, g)[0]
            if unseeded:
                q[torch.tensor(unseeded, device=probs.device)] = _exponential(
                    len(unseeded), vocab, self._default(probs.device))
        q.clamp_min_(torch.finfo(torch.float32).tiny)
        return (probs / q).argmax(dim=-1)  # [R]

    def _default(self, device: torch.device) -> torch.Generator:
        g = self._defaults.get(device)
        if g is None:
            g = self._defaults[device] = torch.Generator(device=device)
            if self._seed is None:
                g.seed()
            else:
                g.manual_seed(self._seed)
        return g


class Penalties:
    """The tokens seen by the rows of a batch whose params set a penalty, as (row, token id) pairs on
    the logits' device: each distinct prompt or output token for the repetition penalty, each output
    token occurrence for presence and frequency. Sparse: a step touches the seen tokens' logits, not
    the vocabulary's (a dense [R, V] state cost about 3 ms a row a step at 152k tokens, mostly in
    page faults; RESULTS round twenty-three). A multi-step decode `add`s each step's tokens without
    leaving the device."""

    def __init__(self, rows: list[int], params: list[SamplingParams], prompts: list[list[int]],
                 outputs: list[list[int]], device: torch.device):
        self.index = torch.tensor(rows, dtype=torch.long, device=device)  # [R]: the batch rows penalized
        seen_rows, seen_ids, out_rows, out_ids = [], [], [], []
        for r, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
            if p.repetition_penalty != 1:
                seen = set(prompt).union(output)
                seen_rows += [r] * len(seen)
                seen_ids += seen
            if p.presence_penalty or p.frequency_penalty:
                out_rows += [r] * len(output)
                out_ids += output

        def tensor(values: list, dtype=torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        self.seen = (tensor(seen_rows), tensor(seen_ids))  # ([S], [S]): repetition's pairs, distinct
        self.out = (tensor(out_rows), tensor(out_ids))  # ([O], [O]): each output token, repeated as it is
        self.repetition, self.presence, self.frequency = (
            tensor([getattr(p, name) for p in params], torch.float32)
            for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"))  # [R] each

    @classmethod
    def of(cls, seqs, device: torch.device) -> Penalties | None:
        """For a batch of Sequences (tandem.engine.sequence) in row order; None when none is penalized."""
        rows = [i for i, s in enumerate(seqs) if s.params.penalized]
        if not rows:
            return None
        return cls(rows, [seqs[i].params for i in rows], [seqs[i].prompt_token_ids for i in rows],
                   [seqs[i].output_token_ids for i in rows], device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] float32 -> penalized logits [B, V] (a new tensor).

        A pair listed twice writes the same value twice: each write is computed from the logits as
        they were before that write, so repetition and presence count a token once whatever its
        count, and frequency (accumulated) counts each occurrence."""
        out = logits.clone()  # [B, V]
        r, t = self.seen  # r: among the R penalized rows; b = self.index[r]: the batch's
        if len(t):
            b = self.index[r]  # [S]
            v = out[b, t]  # [S]
            f = self.repetition[r]  # [S]
            out[b, t] = torch.where(v < 0, v * f, v / f)
        r, t = self.out
        if len(t):
            b = self.index[r]  # [O]
            out.index_put_((b, t), -self.frequency[r], accumulate=True)
            out[b, t] = out[b, t] - self.presence[r]
        return out

    def add(self, tokens: torch.Tensor) -> None:
        """A step's tokens [B] join the outputs they were sampled for. Every penalized row's token
        joins both lists: a penalty of 1 (or 0) leaves its logit as it is. A NO_TOKEN counts as
        token 0: its sequence finishes with "error", and the tokens sampled after it are dropped."""
        new = tokens[self.index].clamp_min(0)  # [R]
        every = torch.arange(len(new), device=new.device)  # [R]
        self.seen = (torch.cat([self.seen[0], every]), torch.cat([self.seen[1], new]))
        self.out = (torch.cat([self.out[0], every]), torch.cat([self.out[1], new]))


CANDIDATES = 1024  # the most likely tokens a cut looks at first (_cut_among_candidates)


def _cut_among_candidates(scaled: torch.Tensor, log_total: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                          width: int) -> torch.Tensor | None:
    """`_cut` from the `width` most likely tokens of each row instead of a sort of the vocabulary
    (a stable sort of 152k logits costs milliseconds a row on a CPU core), or None where some
    row's cut could reach past them (log_total [B, 1]: each whole row's logsumexp). A row's top-k
    must end above the width-th logit, and a row without top-k must reach top_p with the tokens
    above it; then nothing past the candidates survives, and the candidates are in the full
    sort's order (by logit, ties by token id). The cut is the full sort's but for rounding: a
    token whose mass before it is within a float's rounding of top_p may fall on the other side."""
    values, ids = scaled.topk(width, dim=-1)  # [B, W], descending
    floor = values[:, -1]  # [B]: no other token's logit is above this
    has_k = top_k > 0  # [B]
    kth = values.gather(1, (top_k.clamp_min(1) - 1)[:, None]).squeeze(1)  # [B]
    above_floor = ((values - log_total).exp() * (values > floor[:, None])).sum(dim=-1)  # [B]
    if not bool(torch.where(has_k, kth > floor, above_floor >= top_p).all()):
        return None
    ids, by_id = ids.sort(dim=-1)  # [B, W]: the candidates by token id, then stably by logit
    sorted_logits, order = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)  # [B, W]
    probs = _cut_sorted(sorted_logits, top_k, top_p, log_total)  # [B, W]
    return torch.zeros_like(scaled).scatter_(1, ids.gather(1, order), probs)  # [B, V]


def _cut(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """softmax(scaled) [B, V] restricted by top-k (0: off) then top-p, over a sort of the vocabulary."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V]
    return torch.zeros_like(scaled).scatter_(1, order, _cut_sorted(sorted_logits, top_k, top_p))


def _cut_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                log_total: torch.Tensor | None = None) -> torch.Tensor:
    """Probabilities [B, N] over logits sorted descending, top-k (0: off) then top-p applied and
    renormalised. The N logits may be a prefix of each row that holds every token the cut keeps;
    then log_total [B, 1] is the logsumexp of the whole row, the mass top-p measures against for
    a row without top-k (a row with one has its mass within its k, inside the prefix)."""
    k = torch.where(top_k > 0, top_k.clamp_max(sorted_logits.shape[1]), sorted_logits.shape[1])  # [B]
    # Tokens tied with the k-th are kept, as transformers' TopKLogitsWarper and vLLM keep them.
    kth = sorted_logits.gather(1, (k - 1)[:, None])  # [B, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if log_total is None:
        sorted_probs = sorted_logits.softmax(dim=-1)  # [B, N]
    else:
        total = torch.where((top_k > 0)[:, None], sorted_logits.logsumexp(dim=-1, keepdim=True), log_total)
        sorted_probs = (sorted_logits - total).exp()  # [B, N]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, N]
    # top_p == 1 keeps everything even where rounding pushes the cumulative mass past 1;
    # the top token always has zero mass before it, so at least one token survives.
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)


def _exponential(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] float32 on the generator's device. On the CPU it is -log of float64
    uniforms: as fine-grained as exponential_ (which draws float64 there too) and 2-3x faster."""
    if generator.device.type == "cpu":
        u = torch.empty(rows, vocab, dtype=torch.float64).uniform_(generator=generator)  # [R, V] in [0, 1)
        return u.log_().neg_().float()
    return torch.empty(rows, vocab, device=generator.device).exponential_(generator=generator)
