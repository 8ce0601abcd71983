"""The KV cache tensors: a device tier and a CPU tier of fixed-size blocks.

Block bookkeeping lives in `block_manager` and never touches these tensors; this module only
holds the data and copies blocks between tiers when the scheduler swaps a sequence.

Every tier holds one or more tensors shaped [layers, blocks, block_size, *entry]: K and V
([heads, head_dim] each) for ordinary attention, one latent tensor for MLA. The CPU tier can
live in a shared-memory file so a second process (the experts side) maps the same bytes.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.kv import fp8

DEVICE, CPU = "device", "cpu"
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVLayout:
    """What one token of one layer stores: named entries with their shapes, in `dtype`.

    An fp8 layout (`tandem.kv.fp8`) may give each layer's entries their scales: scales[layer][i]
    is entry i's (stored number = value / scale); none given, every scale is 1.0."""

    entries: tuple[tuple[str, tuple[int, ...]], ...]  # e.g. (("k", (8, 128)), ("v", (8, 128)))
    num_layers: int
    dtype: torch.dtype
    scales: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self):
        if not self.scales:
            return
        if self.dtype != fp8.FP8:
            raise ValueError(f"KV scales are for an fp8 cache, not a {self.dtype} one")
        if len(self.scales) != self.num_layers or any(len(s) != len(self.entries) for s in self.scales):
            raise ValueError(f"KV scales must be one per entry ({len(self.entries)}) for each of the "
                             f"{self.num_layers} layers")
        for layer, scales in enumerate(self.scales):
            for (name, _), scale in zip(self.entries, scales):
                fp8.check_scale(scale, f"layer {layer}'s {name} scale")

    @classmethod
    def for_model(cls, entries, num_layers: int, model_dtype: torch.dtype, kv_cache_dtype: str = "auto",
                  scales: tuple[tuple[float, ...], ...] = ()) -> "KVLayout":
        """A model's cache layout under --kv-cache-dtype: in the model's dtype ("auto"), or fp8 with
        `scales`, the checkpoint's calibrated ones (an "auto" cache ignores them, as vLLM does)."""
        dtype = fp8.cache_dtype(kv_cache_dtype, model_dtype)
        if dtype != fp8.FP8:
            return cls(tuple(entries), num_layers, dtype)
        scales = tuple(tuple(float(s) for s in layer) for layer in scales)
        if all(s == 1.0 for layer in scales for s in layer):
            _log.info("fp8 KV cache with scales 1.0: the checkpoint has no calibrated KV scales, values are cast "
                      "(saturating at +-448)")
            scales = ()
        return cls(tuple(entries), num_layers, dtype, scales)

    def entry_scales(self, layer: int) -> dict[str, float]:
        """Each entry's scale in `layer` (1.0 where none was given)."""
        scales = self.scales[layer] if self.scales else (1.0,) * len(self.entries)
        return {name: scale for (name, _), scale in zip(self.entries, scales)}

    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * sum(math.prod(shape) for _, shape in self.entries) * elem

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token() * block_size


class KVCache:
    """With `cpu_shm_path`, the CPU tier lives in the files `{cpu_shm_path}.{entry}`, which this
    cache owns (one owner a path) and removes on `close()`, when it is collected or when the
    process exits: the KV in them means nothing without this process's block tables."""

    def __init__(self, layout: KVLayout, block_size: int, num_device_blocks: int, num_cpu_blocks: int,
                 device: torch.device | str, cpu_shm_path: str | Path | None = None):
        self.layout = layout
        self.block_size = block_size
        self.device = torch.device(device)
        self._shm_files: list[tuple[Path, int, int]] = []  # (path, st_dev, st_ino) of the files made here
        # Bound to the list, not to self: it runs once, on close(), collection or interpreter exit.
        self._finalizer = weakref.finalize(self, _remove_files, self._shm_files)
        try:
            cpu = self._allocate_shared(num_cpu_blocks, cpu_shm_path) if cpu_shm_path is not None else \
                self._allocate(num_cpu_blocks, torch.device("cpu"))
            self.tiers = {DEVICE: self._allocate(num_device_blocks, self.device), CPU: cpu}
        except BaseException:
            self.close()
            raise
        self._layers: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # views, made once
        self.scales = [layout.entry_scales(i) for i in range(layout.num_layers)]  # per layer: entry -> scale

    def close(self) -> None:
        """Remove the CPU tier's shared-memory files. Its memory goes once no process maps them
        (this one's tensors stay valid)."""
        self._finalizer()

    def _shape(self, num_blocks: int, entry: tuple[int, ...]) -> tuple[int, ...]:
        return (self.layout.num_layers, num_blocks, self.block_size, *entry)

    def _allocate(self, num_blocks: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(self._shape(num_blocks, shape), dtype=self.layout.dtype, device=device)
                for name, shape in self.layout.entries}

    def _allocate_shared(self, num_blocks: int, shm_path: str | Path) -> dict[str, torch.Tensor]:
        elem = torch.empty((), dtype=self.layout.dtype).element_size()
        shapes = {name: self._shape(num_blocks, entry) for name, entry in self.layout.entries}
        paths = {name: Path(f"{shm_path}.{name}") for name in shapes}
        # Files of the right size that an earlier process left (it died, or its container restarts in
        # the same pod) are taken over: a process still mapping them (the experts side) then shares
        # them instead of holding a second copy of the tier. Their stale bytes are never read
        # (tandem.kv.attention.gather_kv). Files of another size go.
        taken = 0  # bytes of the tier already in memory
        for name, path in paths.items():
            if path.exists():
                st = path.stat()
                if st.st_size == math.prod(shapes[name]) * elem:
                    taken += st.st_blocks * 512
                else:
                    path.unlink()
        nbytes = self.layout.bytes_per_block(self.block_size) * num_blocks
        parent = Path(shm_path).parent
        parent.mkdir(parents=True, exist_ok=True)
        # A tmpfs file is sparse until written, and a write past the volume's size kills the process
        # (SIGBUS) when a sequence first reaches that block: refuse at startup instead.
        free = shutil.disk_usage(parent).free
        if free + taken < nbytes:
            raise ValueError(f"--kv-shm: {parent} has {free / 2**30:.2f} GiB free, the CPU KV tier needs "
                             f"{(nbytes - taken) / 2**30:.2f} GiB more ({num_blocks} blocks): lower --cpu-kv-gib "
                             f"or give that volume more room")
        tensors = {}
        for name, shape in shapes.items():
            tensors[name] = map_shared(paths[name], shape, self.layout.dtype)
            st = paths[name].stat()
            self._shm_files.append((paths[name], st.st_dev, st.st_ino))
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
        """Copy blocks src_id -> dst_id from tier `src` to tier `dst`, all layers at once; bytes as
        they are (both tiers have the layout's dtype and scales)."""
        if not pairs:
            return
        src_ids = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst_ids = torch.tensor([d for _, d in pairs], dtype=torch.long)
        for name, s in self.tiers[src].items():
            d, s = fp8.as_bytes(self.tiers[dst][name]), fp8.as_bytes(s)  # fp8 indexing is not everywhere
            d[:, dst_ids.to(d.device)] = s[:, src_ids.to(s.device)].to(d.device)


def map_shared(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor backed by a file (in /dev/shm or a memory emptyDir) that other processes can map
    too: a new one, zero-filled, or the one at `path` if it has exactly that size, as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    with open(path, "ab") as f:
        if f.tell() != nbytes:
            if f.tell():  # never shrink or grow a file another process may map (it would SIGBUS)
                raise ValueError(f"--kv-shm: {path} exists with another size than the tier's {nbytes} bytes")
            f.truncate(nbytes)
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)


def _remove_files(files: list[tuple[Path, int, int]]) -> None:
    """Unlink each file that is still the one made (a later cache on the same path made its own)."""
    for path, dev, ino in files:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        if (st.st_dev, st.st_ino) == (dev, ino):
            path.unlink(missing_ok=True)
    files.clear()
