"""The KV cache tensors: a device tier and a CPU tier of fixed-size blocks.

Block bookkeeping lives in `block_manager` and never touches these tensors; this module only
holds the data and copies blocks between tiers when the scheduler swaps a sequence.

Every tier holds one or more tensors shaped [layers, blocks, block_size, *entry]: K and V
([heads, head_dim] each) for ordinary attention, one latent tensor for MLA. The CPU tier can
live in a shared-memory file so a second process (the experts side) maps the same bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

DEVICE, CPU = "device", "cpu"


@dataclass(frozen=True)
class KVLayout:
    """What one token of one layer stores: named entries with their shapes."""

    entries: tuple[tuple[str, tuple[int, ...]], ...]  # e.g. (("k", (8, 128)), ("v", (8, 128)))
    num_layers: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * sum(math.prod(shape) for _, shape in self.entries) * elem

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token() * block_size


class KVCache:
    def __init__(self, layout: KVLayout, block_size: int, num_device_blocks: int, num_cpu_blocks: int,
                 device: torch.device | str, cpu_shm_path: str | Path | None = None):
        self.layout = layout
        self.block_size = block_size
        self.device = torch.device(device)
        self.tiers = {
            DEVICE: self._allocate(num_device_blocks, self.device),
            CPU: self._allocate(num_cpu_blocks, torch.device("cpu"), cpu_shm_path),
        }
        self._layers: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # views, made once

    def _allocate(self, num_blocks: int, device: torch.device, shm_path=None) -> dict[str, torch.Tensor]:
        tensors = {}
        for i, (name, shape) in enumerate(self.layout.entries):
            full = (self.layout.num_layers, num_blocks, self.block_size, *shape)
            if shm_path is None:
                tensors[name] = torch.zeros(full, dtype=self.layout.dtype, device=device)
            else:
                tensors[name] = map_shared(Path(f"{shm_path}.{name}"), full, self.layout.dtype)
        return tensors

    def num_blocks(self, tier: str) -> int:
        return next(iter(self.tiers[tier].values())).shape[1]

    def layer(self, layer: int, tier: str = DEVICE) -> dict[str, torch.Tensor]:
        """The tensors of one layer: name -> [blocks, block_size, *entry] (views; every step reuses them)."""
        views = self._layers.get((layer, tier))
        if views is None:
            views = self._layers[(layer, tier)] = {name: t[layer] for name, t in self.tiers[tier].items()}
        return views

    def swap(self, pairs: list[tuple[int, int]], src: str, dst: str) -> None:
        """Copy blocks src_id -> dst_id from tier `src` to tier `dst`, all layers at once."""
        if not pairs:
            return
        src_ids = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst_ids = torch.tensor([d for _, d in pairs], dtype=torch.long)
        for name, s in self.tiers[src].items():
            d = self.tiers[dst][name]
            d[:, dst_ids.to(d.device)] = s[:, src_ids.to(s.device)].to(d.device)


def map_shared(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor backed by a file (in /dev/shm or a memory emptyDir) that other processes can map too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    with open(path, "ab") as f:
        if f.tell() < nbytes:
            f.truncate(nbytes)
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)
