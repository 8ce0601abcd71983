"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeds.

The masking is vectorised over the batch; only the random draw is per row, from the row's own
generator, so a seeded request gets the same tokens whatever else shares its batch. The draw
is the exponential race (argmax of p / q with q ~ Exp(1)), which samples from p exactly.
"""

from __future__ import annotations

import torch

from tandem.engine.sampling_params import SamplingParams

# Below this, dividing by the temperature overflows float32; such rows are treated as greedy.
_MIN_TEMPERATURE = 1e-5


class Sampler:
    """Turns the last position's logits of each sequence into its next token id."""

    def __init__(self, seed: int | None = None):
        self._default = torch.Generator()
        if seed is None:
            self._default.seed()
        else:
            self._default.manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> torch.Tensor:
        """logits [B, V] -> token ids [B] long. Rows with no generator draw from the sampler's own."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        if not len(params) == len(generators) == logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logits rows, {len(params)} params, "
                             f"{len(generators)} generators: they must match")
        logits = logits.float()  # [B, V]
        tokens = logits.argmax(dim=-1)  # [B]
        rows = [i for i, p in enumerate(params) if not self.is_greedy(p)]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            probs = self.probs(logits[index], [params[i] for i in rows])  # [R, V]
            drawn = self._race(probs, [generators[i] for i in rows])  # [R]
            tokens[index] = drawn
        return tokens

    @staticmethod
    def is_greedy(params: SamplingParams) -> bool:
        """Whether `sample` takes the argmax for these params (temperature 0, or too small to divide by)."""
        return params.temperature < _MIN_TEMPERATURE

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution sampled from: softmax(logits / T), restricted by top-k then top-p."""
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)  # [B]
        top_k = torch.tensor([p.top_k for p in params], device=device)  # [B]
        top_p = torch.tensor([p.top_p for p in params], device=device)  # [B]
        scaled = logits / temperature[:, None]  # [B, V]
        if not any(p.top_k or p.top_p < 1 for p in params):
            return scaled.softmax(dim=-1)  # [B, V]: nothing to cut, so no sort
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V]
        vocab = logits.shape[1]
        rank = torch.arange(vocab, device=device)  # [V]
        k = torch.where(top_k > 0, top_k, vocab)  # [B]
        sorted_logits = sorted_logits.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)  # [B, V]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, V]
        # top_p == 1 keeps everything even where rounding pushes the cumulative mass past 1;
        # the top token always has zero mass before it, so at least one token survives.
        drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)  # [B, V]

    def _race(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        vocab = probs.shape[1]
        noise = []
        for g in generators:
            g = self._default if g is None else g
            q = torch.empty(vocab, device=g.device).exponential_(generator=g)  # [V]
            noise.append(q.to(probs.device))
        q = torch.stack(noise).clamp_min_(torch.finfo(torch.float32).tiny)  # [B, V]
        return (probs / q).argmax(dim=-1)  # [B]
