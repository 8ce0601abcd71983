"""Prefill chunks' routed experts on the GPU, their weights streamed from host memory per call.

Decode reads each routed expert once per token: the CPU socket, next to the weights, is the
place for it. A prefill chunk is the opposite case: with hundreds of tokens every expert of a
layer is routed and each one's weights serve many tokens, so the arithmetic outgrows the cores
(Mixtral-8x7B-shaped layers, 512 tokens: ~0.85 s a layer on 16 cores) while copying the layer's
weights to the GPU takes tens of milliseconds. llama.cpp does the same for large batches of a
model whose weights stay in host memory.

`DevicePrefill` wraps the in-process CPU executor. Chunks of at least `min_tokens` tokens run
here: the routed experts' weights are copied on a side stream, a few experts ahead of the one
being computed (at most `ahead` in flight, so GPU memory holds a few experts, not the layer),
and each expert's tokens are one GEMM pair. Quantized experts (int8, int4, and the GGUF formats
read as them) are copied as stored, half or a quarter of the bytes, and dequantized on the GPU
to the activations' dtype, as the CPU executor dequantizes them for its own prefill GEMMs.

With `pin` the weights are page-locked first (cudaHostRegister, as vLLM pins the weights it
offloads to the CPU): the copies then run at full speed without staging, 7.75x and 8.7x the
prefill from pageable memory on an H100 (benchmarks/RESULTS.md, round sixteen), and the pages
stay in RAM. The engine asks for it on CUDA (EngineConfig's page_lock_experts). Only memory with
pages of its own is locked: locking a page that other memory shares would lock that too, for as
long as this wrapper lives. Storages of at least PAGE_LOCK_MIN_BYTES have pages of their own; the
engine moves the smaller ones (scales) into a mapping of their own first
(`shared_weights.give_pages_of_their_own`), and the split pair's weights are one such mapping.
If a registration fails, the copies run from pageable memory.
"""

from __future__ import annotations

import logging
import mmap

import torch
import torch.nn.functional as F

from tandem.experts.quant import Int4Weight, Int8Weight, Stored, dequantize, stored_parts
from tandem.experts.routing import group_by_expert
from tandem.experts.torch_kernels import moe_with_linears

log = logging.getLogger(__name__)

DEFAULT_MIN_TOKENS = 128


class DevicePrefill:
    """An expert executor: `forward` is the CPU executor's; `forward_on_device` takes large chunks."""

    def __init__(self, inner, device: torch.device, min_tokens: int = DEFAULT_MIN_TOKENS, ahead: int = 4,
                 pin: bool = False, *, weights: dict[int, tuple[Stored, Stored]] | None = None,
                 own_pages: bool = False):
        """`weights`: layer -> (gate_up, down) in host memory, by default `inner.layers`' (the
        attention process passes those it maps from the experts process, whose client is `inner`:
        tandem.experts.shared_weights); `own_pages`: their storages are mappings no other memory
        shares a page with, so all of them are locked, whatever their size."""
        if min_tokens < 1 or ahead < 1:
            raise ValueError(f"min_tokens and ahead must be at least 1, got {min_tokens} and {ahead}")
        self.inner, self.device = inner, torch.device(device)
        self.min_tokens, self.ahead = min_tokens, ahead
        # layer -> (gate_up [E, 2I, H], down [E, H, I]) in host memory, as the executor stores them
        self.weights = weights if weights is not None else {i: (p.gate_up, p.down) for i, p in inner.layers.items()}
        self.own_pages = own_pages
        self.locked: list[int] = []  # starts of the page ranges registered
        if pin and self.device.type == "cuda":
            self.lock()
        self._copies = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.calls = 0  # chunks computed here

    @property
    def pinned(self) -> bool:
        """The weights are page-locked."""
        return bool(self.locked)

    @property
    def layers(self):
        return self.inner.layers

    def forward(self, layer, hidden, topk_ids, topk_weights):
        return self.inner.forward(layer, hidden, topk_ids, topk_weights)

    def lock(self) -> None:
        """Page-lock the weights (see page_lock); `pinned` says whether it took."""
        self.unlock()
        self.locked = page_lock([t for pair in self.weights.values() for w in pair for t in stored_parts(w)],
                                min_bytes=1 if self.own_pages else PAGE_LOCK_MIN_BYTES)

    def unlock(self) -> None:
        """Leave the weights pageable again (page-locked memory must be unlocked before it is freed)."""
        locked, self.locked = getattr(self, "locked", []), []
        if locked:
            cudart = torch.cuda.cudart()
            for start in locked:
                cudart.cudaHostUnregister(start)

    def __del__(self):
        self.unlock()

    def forward_on_device(self, layer: int, x: torch.Tensor, ids: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor | None:
        """x [T, H], ids/weights [T, k] on the compute device -> [T, H] there, or None to decline
        (a chunk under min_tokens, or a layer without routed experts)."""
        if x.shape[0] < self.min_tokens or layer not in self.weights:
            return None
        gate_up, down = self.weights[layer]
        groups = group_by_expert(ids, weights, _num_experts(gate_up))
        staged = _Staged(self, gate_up, down, [e for e, n in enumerate(groups.counts) if n])
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        moe_with_linears(x, groups, staged.gate_up, staged.down, out)
        self.calls += 1
        return out.to(x.dtype)


class _Staged:
    """One call's routed experts, copied to the device `ahead` experts in front of the one that
    `moe_with_linears` computes (which takes them in expert order): its two products."""

    def __init__(self, owner: DevicePrefill, gate_up: Stored, down: Stored, routed: list[int]):
        self.owner, self.gate_up_w, self.down_w, self.routed = owner, gate_up, down, routed
        self.copies = owner._copies  # None on the CPU: the copies are plain .to() calls
        self.staged: dict[int, tuple] = {}  # expert -> (gate_up's parts, down's parts, ready event)
        self.next = 0  # index in `routed` of the next expert to copy
        for _ in range(min(owner.ahead, len(routed))):
            self._copy_next(after=None)

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gu, _, ready = self.staged[expert]
        if ready is not None:
            torch.cuda.current_stream(x.device).wait_event(ready)
        return F.linear(x, _expert(self.gate_up_w, gu, x.dtype))  # [n, 2I]

    def down(self, expert: int, act: torch.Tensor) -> torch.Tensor:
        _, dn, _ = self.staged.pop(expert)
        y = F.linear(act, _expert(self.down_w, dn, act.dtype))  # [n, H]
        done = None
        if self.copies is not None:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(act.device))
        if self.next < len(self.routed):  # the next expert's copy starts once this one is computed
            self._copy_next(after=done)
        return y

    def _copy_next(self, after) -> None:
        """Copy the next routed expert's weights as stored; on CUDA on the side stream, after event
        `after` (None: after the compute stream's work so far)."""
        expert = self.routed[self.next]
        self.next += 1
        device = self.owner.device
        if self.copies is None:
            self.staged[expert] = (*(tuple(t[expert].to(device) for t in stored_parts(w))
                                     for w in (self.gate_up_w, self.down_w)), None)
            return
        compute = torch.cuda.current_stream(device)
        self.copies.wait_stream(compute) if after is None else self.copies.wait_event(after)
        with torch.cuda.stream(self.copies):
            # asynchronous from page-locked memory; from pageable memory the copy is staged
            gu, dn = (tuple(t[expert].to(device, non_blocking=True) for t in stored_parts(w))
                      for w in (self.gate_up_w, self.down_w))
            ready = torch.cuda.Event()
            ready.record(self.copies)
        # Allocated on the copy stream, used and freed on the compute one.
        for t in (*gu, *dn):
            t.record_stream(compute)
        self.staged[expert] = (gu, dn, ready)


def _num_experts(w: Stored) -> int:
    return stored_parts(w)[0].shape[0]


def _expert(w: Stored, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    """One expert's [N, K] weights in `dtype`, from its parts as copied (quant.dequantize's numbers)."""
    if isinstance(w, Int8Weight):
        return dequantize(Int8Weight(*(t[None] for t in parts)))[0].to(dtype)
    if isinstance(w, Int4Weight):
        return dequantize(Int4Weight(*(t[None] for t in parts), group_size=w.group_size))[0].to(dtype)
    return parts[0].to(dtype)


# The C allocator maps allocations of 32 MiB and more (glibc's largest mmap threshold) on pages of
# their own. A smaller one may share a page with other memory: locking that page would lock memory
# this process frees and reuses elsewhere, and registering a page twice fails.
PAGE_LOCK_MIN_BYTES = 32 << 20


def page_lock(tensors: list[torch.Tensor], min_bytes: int = PAGE_LOCK_MIN_BYTES) -> list[int]:
    """cudaHostRegister the tensors' storages of at least `min_bytes`, whole pages, each page once
    (views of one storage lock it once, whole): copies from them then run without a staging
    buffer. Smaller ones stay pageable. Returns the starts of the ranges registered: all, or none
    when a registration fails (then every copy runs from pageable memory)."""
    cudart = torch.cuda.cudart()
    page = mmap.PAGESIZE
    spans = sorted((s.data_ptr() // page * page, -(-(s.data_ptr() + s.nbytes()) // page) * page)
                   for s in (t.untyped_storage() for t in tensors) if s.nbytes() and s.nbytes() >= min_bytes)
    ranges: list[list[int]] = []
    for start, end in spans:
        if ranges and start <= ranges[-1][1]:
            ranges[-1][1] = max(ranges[-1][1], end)
        else:
            ranges.append([start, end])
    for i, (start, end) in enumerate(ranges):
        status = cudart.cudaHostRegister(start, end - start, 0)
        if int(status) != 0:
            for done, _ in ranges[:i]:
                cudart.cudaHostUnregister(done)
            _drop_pending_error()
            log.warning("could not page-lock the expert weights (cudaError %s: %s): prefill copies them "
                        "from pageable memory", int(status), cudart.cudaGetErrorString(status))
            return []
    return [start for start, _ in ranges]


def _drop_pending_error() -> None:
    """A failed runtime call leaves its error pending, and the next kernel launch would report it
    as its own (torch.cuda.cudart() has no cudaGetLastError): launch one here and drop it."""
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:  # torch.AcceleratorError
        pass
