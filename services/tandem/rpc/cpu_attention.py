"""Decode attention over the CPU KV tier, computed by the experts process on its own cores.

The attention process owns the KV block metadata and writes the CPU tier into shared-memory
files (`--kv-shm PATH` gives `PATH.k`, `PATH.v`, as `tandem.kv.cache` lays them out). Next to
them it publishes the tier's layout (`PATH.layout.json`: entries, dtype and, for an fp8 tier,
each layer's scales), so the experts process maps the same bytes and reads them as they were
written, without loading the model: a CpuAttention request carries only queries, block tables and
lengths, never KV data. The engine's runner sends it the attention of every sequence offloaded
to the CPU tier (`tandem.kv.tiered`); for DeepSeek's latent cache the queries come absorbed and
no weights are needed here.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from tandem.kv import fp8
from tandem.kv.attention import AttentionMetadata
from tandem.kv.tiered import attend_cpu_tier
from tandem.kv.cache import CPU, KVLayout
from tandem.rpc.gen import experts_pb2
from tandem.rpc.tensors import DTYPES, BadTensor, from_proto

LAYOUT_SUFFIX = ".layout.json"
KV_DTYPES = {**DTYPES, "float8_e4m3fn": fp8.FP8}  # a tier's dtype by its name in the layout


class KVNotShared(RuntimeError):
    """The CPU KV tier is not (yet) published by an attention process on this path."""


def layout_path(shm_path: str | Path) -> Path:
    return Path(f"{shm_path}{LAYOUT_SUFFIX}")


def publish_layout(cache, shm_path: str | Path) -> Path:
    """Writes the CPU tier's layout next to its shared-memory files (atomically: readers never see half)."""
    layout = {
        "entries": [[name, list(shape)] for name, shape in cache.layout.entries],
        "num_layers": cache.layout.num_layers,
        "num_blocks": cache.num_blocks(CPU),
        "block_size": cache.block_size,
        "dtype": str(cache.layout.dtype).removeprefix("torch."),
        "scales": [list(s) for s in cache.layout.scales],  # per layer, an fp8 tier's; [] for 1.0
    }
    path = layout_path(shm_path)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(layout))
    os.replace(tmp, path)
    return path


def withdraw_layout(shm_path: str | Path) -> None:
    """Removes the published layout (the attention process is ending): nothing maps the tier from it again."""
    layout_path(shm_path).unlink(missing_ok=True)


class SharedCpuKV:
    """The CPU KV tier as the experts process sees it: the attention process's files, mapped shared."""

    def __init__(self, shm_path: str | Path):
        self.shm_path = str(shm_path)
        self._mapped: tuple[dict, dict[str, torch.Tensor]] | None = None
        self._published: tuple[int, int] | None = None  # (inode, mtime) of the layout mapped

    def tensors(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """(layout, {entry name: [layers, blocks, block_size, *entry]}), mapped on first use and
        mapped again when the attention process (restarted) publishes a new layout."""
        path = layout_path(self.shm_path)
        try:
            st = path.stat()
        except FileNotFoundError:
            raise KVNotShared(f"kv_shm: no CPU KV tier published at {path}: is the attention process running "
                              f"with the same --kv-shm {self.shm_path}?") from None
        mapped = self._mapped  # once: release_if_withdrawn may clear it from another thread
        if mapped is None or self._published != (st.st_ino, st.st_mtime_ns):
            mapped = self._mapped = self._map(path)
            self._published = (st.st_ino, st.st_mtime_ns)
        return mapped

    def release_if_withdrawn(self) -> None:
        """Unmaps the tier once its attention process has withdrawn the layout (it ended): the
        files' memory is then freed, and a restarted attention process finds the volume's room."""
        if self._mapped is not None and not layout_path(self.shm_path).exists():
            self._mapped = self._published = None

    def _map(self, path: Path):
        layout = json.loads(path.read_text())
        dtype = KV_DTYPES[layout["dtype"]]
        entries = tuple((name, tuple(shape)) for name, shape in layout["entries"])
        scales = tuple(tuple(s) for s in layout.get("scales", ()))  # checked as the attention side made them
        # added to the layout as read: each layer's {entry: scale}, what attend_cpu_tier takes
        layout["layer_scales"] = [KVLayout(entries, layout["num_layers"], dtype, scales).entry_scales(i)
                                  for i in range(layout["num_layers"])]
        tensors = {}
        for name, shape in layout["entries"]:
            full = (layout["num_layers"], layout["num_blocks"], layout["block_size"], *shape)
            tensors[name] = _map_existing(Path(f"{self.shm_path}.{name}"), full, dtype)
        return layout, tensors


def _map_existing(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # Unlike tandem.kv.cache.map_shared this never creates or grows a file: the attention side owns them.
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not path.is_file() or path.stat().st_size < nbytes:
        raise KVNotShared(f"kv_shm: {path} is missing or smaller than its published layout ({nbytes} bytes)")
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)


class CpuAttention:
    """Answers CpuAttention requests: the new tokens' queries of each sequence over its CPU-tier blocks."""

    def __init__(self, kv: SharedCpuKV):
        self.kv = kv

    def handle(self, request: experts_pb2.CpuAttentionRequest) -> torch.Tensor:
        layout, tensors = self.kv.tensors()
        query = from_proto(request.query, "query")  # [T, H, D]
        tables, lens = [list(t.block_ids) for t in request.block_tables], list(request.seq_lens)
        query_lens = list(request.query_lens) or [1] * len(lens)
        self._check(request, query, tables, lens, query_lens, layout, tensors)
        layer = {name: t[request.layer] for name, t in tensors.items()}  # [blocks, block_size, *entry]
        starts = [n - q for n, q in zip(lens, query_lens)]
        meta = AttentionMetadata.build(starts, query_lens, tables, layout["block_size"], torch.device("cpu"),
                                       request.sliding_window or None)
        scale = request.scale or 1.0 / math.sqrt(query.shape[-1])
        dtype = next(iter(layer.values())).dtype
        if dtype == fp8.FP8:  # the kernels read fp8 blocks with a query of the model's dtype
            dtype = query.dtype
        out = attend_cpu_tier(layer, query.to(dtype), meta, scale, request.value_dim,
                              layout["layer_scales"][request.layer])
        return out.to(query.dtype)

    @staticmethod
    def _check(request, query, tables, lens, query_lens, layout, tensors) -> None:
        layer = request.layer
        if not 0 <= layer < layout["num_layers"]:
            raise BadTensor("layer", f"{layer} is not a layer of this model (0..{layout['num_layers'] - 1})")
        if query.dim() != 3 or not query.is_floating_point():
            raise BadTensor("query", f"must be a float tensor [T, heads, head_dim], got {list(query.shape)}")
        if "k" in tensors:
            k = tensors["k"]
            if query.shape[-1] != k.shape[-1] or query.shape[1] % k.shape[-2]:
                raise BadTensor("query", f"heads x head_dim {list(query.shape[1:])} do not fit the cache's "
                                f"{k.shape[-2]} KV heads of {k.shape[-1]}")
            if request.value_dim:
                raise BadTensor("value_dim", "applies to a latent cache only; this one holds K and V")
        else:
            (latent,) = tensors.values()
            width = latent.shape[-1]
            if query.shape[-1] != width:
                raise BadTensor("query", f"must be absorbed into the latent cache's width {width}, "
                                f"got head_dim {query.shape[-1]}")
            if not 0 < request.value_dim <= width:
                raise BadTensor("value_dim", f"must be in [1, {width}] for this latent cache, got {request.value_dim}")
        if not len(tables) == len(lens) == len(query_lens):
            raise BadTensor("block_tables", f"{len(tables)} block tables, {len(lens)} seq_lens and "
                            f"{len(query_lens)} query_lens: one of each per sequence")
        if sum(query_lens) != query.shape[0]:
            if not request.query_lens:  # one decode query per sequence
                raise BadTensor("block_tables", f"{len(tables)} sequences for {query.shape[0]} decode queries")
            raise BadTensor("query_lens", f"add up to {sum(query_lens)} queries, query has {query.shape[0]}")
        size, num_blocks = layout["block_size"], layout["num_blocks"]
        for i, (table, n, q) in enumerate(zip(tables, lens, query_lens)):
            if n < 1 or len(table) * size < n:
                raise BadTensor("seq_lens", f"sequence {i}: {n} tokens do not fit {len(table)} blocks of {size}")
            if not 1 <= q <= n:
                raise BadTensor("query_lens", f"sequence {i}: {q} queries for {n} tokens of KV")
            if any(b >= num_blocks for b in table):
                raise BadTensor("block_tables", f"sequence {i}: block ids must be < {num_blocks}")
