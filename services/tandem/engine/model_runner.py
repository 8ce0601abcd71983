"""The model runner: turns one scheduler step into tensors, runs the model, samples."""

from __future__ import annotations

from typing import Callable

import torch

from tandem.engine.sampler import Sampler
from tandem.kv.attention import AttentionMetadata
from tandem.kv.cache import CPU, DEVICE, KVCache
from tandem.model.model import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, cache: KVCache, device: torch.device):
        self.model, self.cache, self.device = model, cache, device
        self.sampler = Sampler()
        self.sliding_window = model.cfg.sliding_window
        # Test and debugging hook: called with (request_id, logits [V]) for every sampled position.
        self.logits_hook: Callable[[str, torch.Tensor], None] | None = None

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        # Out before in: a block freed by a swap-out may be the target of a swap-in in the same step.
        self.cache.swap(swap_out, DEVICE, CPU)
        self.cache.swap(swap_in, CPU, DEVICE)

    def execute(self, scheduled, generators: dict[str, torch.Generator | None]) -> dict[str, int]:
        """Run one forward pass over the scheduled chunks; returns request_id -> sampled token."""
        if not scheduled:
            return {}
        tokens, positions = [], []
        for s in scheduled:
            tokens.extend(s.token_ids)
            positions.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)  # [T]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
        meta = AttentionMetadata.build(
            [s.start_pos for s in scheduled], [len(s.token_ids) for s in scheduled],
            [s.block_table for s in scheduled], self.cache.block_size, self.device, self.sliding_window,
        )
        hidden = self.model(input_ids, pos, self.cache, meta)  # [T, H]
        # Sample from the last position of each chunk that reaches the end of its sequence.
        last, ends = [], 0
        for s in scheduled:
            ends += len(s.token_ids)
            if s.sample:
                last.append(ends - 1)
        sampling = [s for s in scheduled if s.sample]
        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[last])  # [B, V]
        if self.logits_hook is not None:
            for s, row in zip(sampling, logits):
                self.logits_hook(s.seq.request_id, row)
        ids = self.sampler.sample(
            logits, [s.seq.params for s in sampling], [generators.get(s.seq.request_id) for s in sampling]
        )
        return {s.seq.request_id: int(t) for s, t in zip(sampling, ids.tolist())}
