"""One step's attention over both KV tiers.

A running sequence's KV lives in one tier. Sequences on the device tier attend on the compute
device as usual. Sequences on the CPU tier (offloaded when the device tier ran short: long
contexts) keep running: their new K/V are written into the CPU tier and their attention is
computed on the CPU socket, next to the data, by a `CpuAttentionBackend` — in this process
(`LocalCpuAttention`) or in the experts process over gRPC, which maps the same shared-memory
tier. Only queries travel; the KV never moves back to the device.

The runner orders a step's tokens device-tier sequences first, so each tier's tokens are one
contiguous slice: [0, num_device_tokens) and [num_device_tokens, T).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tandem.kv.attention import AttentionMetadata, paged_attention, write_kv
from tandem.kv.cache import CPU, DEVICE, KVCache

CPU_DEVICE = torch.device("cpu")


@dataclass
class CpuBatch:
    """The CPU-tier sequences of one step: what a CpuAttention request carries, and its metadata."""

    starts: list[int]  # position of each sequence's first new token
    query_lens: list[int]  # new tokens per sequence; their queries are consecutive rows
    block_tables: list[list[int]]  # CPU-tier block ids
    sliding_window: int | None
    meta: AttentionMetadata  # built over the CPU-tier blocks, tensors on the CPU

    @classmethod
    def build(cls, starts: list[int], query_lens: list[int], block_tables: list[list[int]], block_size: int,
              sliding_window: int | None = None) -> "CpuBatch":
        meta = AttentionMetadata.build(starts, query_lens, block_tables, block_size, CPU_DEVICE, sliding_window)
        return cls(list(starts), list(query_lens), [list(t) for t in block_tables], sliding_window, meta)

    @property
    def seq_lens(self) -> list[int]:
        """KV tokens per sequence after this step's tokens are written."""
        return [s + n for s, n in zip(self.starts, self.query_lens)]


class CpuAttentionBackend(Protocol):
    def __call__(self, layer: int, query: torch.Tensor, batch: CpuBatch, scale: float,
                 value_dim: int = 0) -> torch.Tensor:
        """query [Tc, heads, D] on the CPU -> [Tc, heads, Dv] on the CPU (see `attend_cpu_tier`)."""


def attend_cpu_tier(tensors: dict[str, torch.Tensor], query: torch.Tensor, meta: AttentionMetadata, scale: float,
                    value_dim: int = 0, scales: dict[str, float] | None = None) -> torch.Tensor:
    """Attention of `query` [T, heads, D] over one layer's CPU-tier tensors.

    A K/V layout ({"k", "v"}: [blocks, block_size, kv_heads, D]) is ordinary grouped-query
    attention. A single-entry layout is a latent cache ([blocks, block_size, W], MLA): one key
    head shared by all query heads, whose first `value_dim` numbers are also the value; the
    caller sends queries already absorbed into the latent space and gets [T, heads, value_dim].
    `scales`: each entry's, for an fp8 tier (`tandem.kv.fp8`); none, 1.0.
    """
    scales = scales or {}
    # No transformers run to track here: the native kernel serves every dtype it takes.
    if "k" in tensors and "v" in tensors:
        return paged_attention(query, tensors["k"], tensors["v"], meta, scale, k_scale=scales.get("k", 1.0),
                               v_scale=scales.get("v", 1.0), native_any_dtype=True)
    if len(tensors) != 1:
        raise ValueError(f"a CPU KV tier has entries 'k' and 'v', or a single latent; got {sorted(tensors)}")
    ((name, latent),) = tensors.items()
    if not 0 < value_dim <= latent.shape[-1]:
        raise ValueError(f"value_dim must be in [1, {latent.shape[-1]}] for a latent cache, got {value_dim}")
    keys = latent[:, :, None]  # [blocks, block_size, 1, W]: one shared head
    s = scales.get(name, 1.0)  # the value is the latent too: one scale for both
    return paged_attention(query, keys, keys[..., :value_dim], meta, scale, k_scale=s, v_scale=s,
                           native_any_dtype=True)


class LocalCpuAttention:
    """The CpuAttentionBackend of one process: the CPU tier is this process's own memory."""

    def __init__(self, cache: KVCache):
        self.cache = cache

    def __call__(self, layer: int, query: torch.Tensor, batch: CpuBatch, scale: float,
                 value_dim: int = 0) -> torch.Tensor:
        return attend_cpu_tier(self.cache.layer(layer, CPU), query, batch.meta, scale, value_dim,
                               self.cache.scales[layer])


@dataclass
class LayerKV:
    """One decoder layer's cache tensors in both tiers (name -> [blocks, block_size, *entry]), and
    each entry's scale (an fp8 cache's, `tandem.kv.fp8`; 1.0 for others, which ignore it)."""

    index: int
    device: dict[str, torch.Tensor]
    cpu: dict[str, torch.Tensor]
    scales: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, cache: KVCache, layer: int) -> "LayerKV":
        return cls(layer, cache.layer(layer, DEVICE), cache.layer(layer, CPU), cache.scales[layer])

    def scale(self, name: str) -> float:
        return self.scales.get(name, 1.0)


@dataclass
class StepAttention:
    """Per-step attention inputs shared by every layer. Either part may be None (no such sequences)."""

    device: AttentionMetadata | None  # tokens [0, num_device_tokens), on the compute device
    cpu: CpuBatch | None  # tokens [num_device_tokens, T)
    num_device_tokens: int
    cpu_attention: CpuAttentionBackend | None = None

    @classmethod
    def device_only(cls, meta: AttentionMetadata) -> "StepAttention":
        return cls(meta, None, int(meta.slot_mapping.shape[0]))

    def write(self, kv: LayerKV, entries: dict[str, torch.Tensor]) -> None:
        """Store this step's new entries ([T, *entry] each) in the tier each token's sequence is in."""
        n = self.num_device_tokens
        for name, values in entries.items():
            if self.device is not None:
                write_kv(kv.device[name], self.device.slot_mapping, values[:n], kv.scale(name))
            if self.cpu is not None:
                write_kv(kv.cpu[name], self.cpu.meta.slot_mapping, values[n:].to(CPU_DEVICE), kv.scale(name))

    def attend_cpu(self, kv: LayerKV, query: torch.Tensor, scale: float, value_dim: int = 0) -> torch.Tensor:
        """Attention of the CPU-tier tokens' queries [Tc, heads, D], returned on query's device."""
        if self.cpu_attention is None:
            raise RuntimeError("CPU-tier sequences were scheduled but the runner has no CPU attention backend")
        out = self.cpu_attention(kv.index, query.to(CPU_DEVICE), self.cpu, scale, value_dim)
        return out.to(query.device)

    def attend(self, on_device: Callable[[slice], torch.Tensor],
               on_cpu: Callable[[slice], torch.Tensor]) -> torch.Tensor:
        """Each tier's share of a layer's attention, back in token order: `on_device(rows)` for the
        device-tier tokens (over `self.device`), `on_cpu(rows)` for the CPU-tier ones (usually
        through `attend_cpu`); `rows` slices the step's T tokens. Tiers with no tokens are skipped."""
        n = self.num_device_tokens
        parts = []
        if self.device is not None:
            parts.append(on_device(slice(0, n)))
        if self.cpu is not None:
            parts.append(on_cpu(slice(n, None)))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
