"""Decode steps replayed from CUDA graphs, with the routed experts run on the CPU between them.

A decode step on the GPU is hundreds of small kernels (norms, projections, RoPE, the KV write,
attention, the router) per layer; launched one by one from Python they cost more than they
compute. vLLM captures the whole step in one CUDA graph per batch size. Here the step cannot be
one graph: each MoE layer's routed experts run on the CPU socket, in the middle of the layer. So
the step is cut at those points (as vLLM's piecewise graphs are cut at attention), and each
piece is a graph:

    piece 0      embeddings, RoPE rows, layer 0's attention block, its router
    piece k      layer k-1's MoE output (routed sum in from host memory, shared experts) and
                 residual, layer k's attention block, its router
    last piece   the final norm

Each piece ends by copying the router's input, ids and weights into pinned host buffers; the host
waits for the stream, the expert executor computes the routed sum into another pinned buffer, and
the next piece starts by copying it back. Dense layers ride inside the piece they fall in.

Batches are padded to a captured size. Padding rows write their K and V nowhere (slot -1) and
attend to nothing (length 0), which the Triton decode kernels (`tandem.kv.triton_attention`) honour;
their routing is computed and ignored, and the CPU never runs experts for them. The engine
captures every size at start-up (`capture_all`); all sizes share one memory pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tandem.kv import triton_attention
from tandem.kv.attention import AttentionMetadata, slots_of
from tandem.kv.cache import KVCache
from tandem.kv.tiered import LayerKV, StepAttention
from tandem.model.attention import Attention
from tandem.model.deepseek_attention import MlaAttention
from tandem.model.model import CausalLM

# Attention whose decode steps launch fixed shapes and never wait on the host: grouped-query
# attention, and MLA's absorbed form (tandem.model.deepseek_mla.absorbed_decode), both through the
# Triton decode kernel.
GRAPHED_ATTENTION = (Attention, MlaAttention)
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
MAX_GRAPH_BATCH = BATCH_SIZES[-1]  # larger decode batches run eagerly: launches matter less there


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The padded sizes captured for batches of up to `max_batch` sequences."""
    sizes = tuple(b for b in BATCH_SIZES if b < max_batch)
    return sizes + (max_batch,)


def unsupported_reason(model: CausalLM, cache: KVCache) -> str | None:
    """Why decode steps of this model cannot be graphed (None: they can)."""
    if cache.device.type != "cuda":
        return "the compute device is not CUDA"
    if not triton_attention.available(cache.device):
        return "Triton is not installed (the graphed decode attention is a Triton kernel)"
    if any(not isinstance(layer.self_attn, GRAPHED_ATTENTION) for layer in model.model.layers):
        return "the model's attention has no graphed decode path"
    if cache.block_size & (cache.block_size - 1):
        return f"the KV block size {cache.block_size} is not a power of two"
    return None


def _routes_experts(layer) -> bool:
    return hasattr(layer.mlp, "route") and hasattr(layer.mlp, "executor")


@dataclass
class _Batch:
    """The static tensors of one padded batch size and the graphs that read and write them."""

    size: int
    host_in: torch.Tensor  # [4 * size + size * max_blocks] int64 pinned: ids, positions, slots, lengths, tables
    device_in: torch.Tensor  # the same on the GPU; the views below point into it
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    x: torch.Tensor  # [size, H] the residual stream between pieces
    h: torch.Tensor  # [size, H] the MoE block's input (normed), kept for its shared experts
    routed: torch.Tensor  # [size, H] the routed experts' sum, back on the GPU
    host_h: torch.Tensor  # pinned copies for the CPU side
    host_ids: torch.Tensor
    host_weights: torch.Tensor
    host_routed: torch.Tensor
    out: torch.Tensor  # [size, H] final hidden states
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)


class DecodeGraphs:
    """Decode steps of device-tier sequences, replayed from CUDA graphs (see the module docstring)."""

    def __init__(self, model: CausalLM, cache: KVCache, max_model_len: int, max_batch: int):
        reason = unsupported_reason(model, cache)
        if reason is not None:
            raise ValueError(f"CUDA graphs cannot serve this model: {reason}")
        self.model, self.cache = model, cache
        self.device = cache.device
        self.sizes = batch_sizes(max_batch)
        self.max_blocks = math.ceil(max_model_len / cache.block_size)
        self.max_model_len = max_model_len
        layers = model.model.layers
        # Pieces end after these layers' routers: [(first layer, last layer, routes experts)].
        self.pieces: list[tuple[int, int, bool]] = []
        start = 0
        for i, layer in enumerate(layers):
            if _routes_experts(layer):
                self.pieces.append((start, i, True))
                start = i + 1
        self.pieces.append((start, len(layers) - 1, False))
        self.kv = [LayerKV.of(cache, i) for i in range(len(layers))]
        self._batches: dict[int, _Batch] = {}
        self._pool = None
        self._dtype = next(model.parameters()).dtype
        model.rotary.reserve(max_model_len, self.device)
        self._rope_table = model.rotary._table  # held: the graphs read it by address
        self.steps = 0  # decode steps replayed

    def serves(self, num_seqs: int) -> bool:
        return 0 < num_seqs <= self.sizes[-1]

    def capture_all(self) -> None:
        """Capture every batch size now (as vLLM does at start-up) rather than at first use."""
        for size in self.sizes:
            if size not in self._batches:
                self._capture(size)

    @torch.inference_mode()
    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """One decode step: a token per sequence at its position -> final hidden states [B, H]."""
        n = len(token_ids)
        size = next(s for s in self.sizes if s >= n)
        b = self._batches.get(size) or self._capture(size)
        self._load_inputs(b, token_ids, positions, block_tables)
        layers = self.model.model.layers
        for graph, (_, last, routes) in zip(b.graphs, self.pieces):
            graph.replay()
            if routes:
                torch.cuda.current_stream(self.device).synchronize()  # the router's outputs are in host memory
                mlp = layers[last].mlp
                b.host_routed[:n].copy_(mlp.executor.forward(mlp.layer, b.host_h[:n], b.host_ids[:n],
                                                             b.host_weights[:n]))
        self.steps += 1
        return b.out[:n]

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._batches)

    def _load_inputs(self, b: _Batch, token_ids, positions, block_tables) -> None:
        n, size = len(token_ids), b.size
        slots = slots_of(positions, block_tables, self.cache.block_size)
        pad = size - n
        head = torch.tensor(token_ids + [0] * pad + positions + [0] * pad + slots + [-1] * pad
                            + [p + 1 for p in positions] + [0] * pad, dtype=torch.long)
        b.host_in[: 4 * size] = head
        tables = b.host_in[4 * size:].view(size, self.max_blocks)
        width = max(len(t) for t in block_tables)
        tables[:n, :width] = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
        b.device_in.copy_(b.host_in, non_blocking=True)

    # capture

    def _capture(self, size: int) -> _Batch:
        b = self._allocate(size)
        pieces = [self._piece(b, k) for k in range(len(self.pieces))]
        # Warm up on a side stream, as torch asks: Triton compiles, cuBLAS makes its handles.
        # Every row is padding (slot -1, length 0): nothing is written to the cache.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                for piece in pieces:
                    piece()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for piece in pieces:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    piece()
                b.graphs.append(graph)
        self._batches[size] = b
        return b

    def _allocate(self, size: int) -> _Batch:
        dev, hidden = self.device, self.model.cfg.hidden_size
        top_k = self.model.cfg.top_k
        host_in = torch.zeros(4 * size + size * self.max_blocks, dtype=torch.long, pin_memory=True)
        host_in[2 * size: 3 * size] = -1  # slots: padding until the first step fills them
        device_in = host_in.to(dev)
        ids, pos, slots, lens = (device_in[i * size:(i + 1) * size] for i in range(4))
        tables = device_in[4 * size:].view(size, self.max_blocks)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables,
                                 query_index=torch.arange(size, device=dev).view(-1, 1),
                                 query_valid=torch.ones(size, 1, dtype=torch.bool, device=dev),
                                 query_pos=pos.view(-1, 1), seq_lens=lens,
                                 key_len=self.max_blocks * self.cache.block_size,
                                 sliding_window=self.model.cfg.sliding_window)

        def on_device():
            return torch.zeros(size, hidden, dtype=self._dtype, device=dev)

        def pinned(*shape, dtype=self._dtype):
            return torch.zeros(*shape, dtype=dtype, pin_memory=True)

        return _Batch(size, host_in, device_in, ids, pos, meta, on_device(), on_device(), on_device(),
                      pinned(size, hidden), pinned(size, top_k, dtype=torch.long),
                      pinned(size, top_k, dtype=torch.float32), pinned(size, hidden), on_device())

    def _piece(self, b: _Batch, k: int):
        """Piece k of the step as a function of the static tensors (what a graph captures)."""
        model, layers = self.model, self.model.model.layers
        first, last, routes = self.pieces[k]
        step = StepAttention.device_only(b.meta)

        def piece():
            if k == 0:
                x = model.model.embed_tokens(b.input_ids)  # [size, H]
            else:
                mlp = layers[first - 1].mlp
                b.routed.copy_(b.host_routed, non_blocking=True)
                x = b.x + mlp.combine(b.h, b.routed)
            cos_sin = model.rotary.cos_sin(b.positions, self._dtype, max_position=self.max_model_len - 1)
            for i in range(first, last + 1):
                layer = layers[i]
                x = layer.attention_block(x, cos_sin, self.kv[i], step)
                h = layer.post_attention_layernorm(x)
                if i < last or not routes:
                    x = x + layer.mlp(h)
            if not routes:
                b.out.copy_(model.model.norm(x))
                return
            weights, ids = layers[last].mlp.route(h)
            b.x.copy_(x)
            b.h.copy_(h)
            b.host_h.copy_(h, non_blocking=True)
            b.host_ids.copy_(ids, non_blocking=True)
            b.host_weights.copy_(weights, non_blocking=True)

        return piece
