"""Roofline pieces for `tandem bench` and benchmarks/: this machine's read bandwidth, the share
of it decode achieves, and the bytes an executor's experts occupy.

Decode streams every weight it uses from RAM once per step, so its speed limit is memory
bandwidth: bytes actually read per step (the distinct experts the batch touched, plus the
dense weights: attention, norms, router, head) times steps per second, over the bandwidth a
plain `sum` reaches, is the share of that limit the engine achieves. The same share against
what a BLAS GEMV reads (`method="gemv"`) is reported beside it: where it reads faster than
`sum`, the `sum` roofline is the reader's limit, not the memory's.
"""

from __future__ import annotations

import statistics
import time

import torch


def timed_seconds(fn, repeats: int = 5) -> list[float]:
    """`repeats` timed calls of fn, after one untimed call (warm-up: first-touch page faults,
    caches, lazy initialisation)."""
    fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def best_seconds(fn, repeats: int = 5) -> float:
    """The fastest of `repeats` timed calls of fn (see timed_seconds)."""
    return min(timed_seconds(fn, repeats))


def measure_read_bandwidth(size_bytes: int = 1 << 30, repeats: int = 5, threads: int | None = None,
                           method: str = "sum", statistic: str = "best") -> float:
    """Read bandwidth in GB/s: the best (or, statistic "median", the median) of `repeats` reads of
    `size_bytes` of float32. The best is what STREAM reports; the median is the rate the reads keep,
    which one fast or slow read does not move. Neither escapes the moment they are taken in: on the
    development VM the memory gives ~30 GB/s for a while, then ~55 for seconds at a time, whatever
    the buffer (benchmarks/RESULTS.md, round thirty-three), and five reads fit inside one such spell.

    method "sum" (the roofline decode is measured against): a torch `sum`, which reads every
    byte once and writes nothing, the access pattern of decode streaming weights.
    method "gemv": a batch-1 F.linear over a [N, 4096] weight of that size (torch's BLAS GEMV).
    It keeps several rows in flight, and on some machines it reads well past what `sum` does
    (24.5 against 18.8 GB/s on the development VM), so it shows how much of that roofline is
    the reader's and not the memory's.
    """
    if size_bytes < 1 << 20:
        raise ValueError(f"size_bytes must be at least 1 MiB to measure RAM, got {size_bytes}")
    if method not in ("sum", "gemv"):
        raise ValueError(f"method must be 'sum' or 'gemv', got {method!r}")
    if statistic not in ("best", "median"):
        raise ValueError(f"statistic must be 'best' or 'median', got {statistic!r}")
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        if method == "sum":
            x = torch.ones(size_bytes // 4, dtype=torch.float32)  # touched: no page faults while timed
            read = x.sum
        else:
            x = torch.ones(size_bytes // (4 * 4096), 4096, dtype=torch.float32)  # 1 MiB and up: >= 64 rows
            v = torch.ones(1, 4096, dtype=torch.float32)
            read = lambda: torch.nn.functional.linear(v, x)  # noqa: E731
        seconds = timed_seconds(read, repeats)
        return x.numel() * 4 / (min(seconds) if statistic == "best" else statistics.median(seconds)) / 1e9
    finally:
        torch.set_num_threads(before)


def roofline_share(bytes_per_step: float, steps_per_s: float, bandwidth_gb_s: float) -> float:
    """Fraction of the memory-bandwidth limit achieved: bytes/step x steps/s / bandwidth."""
    if bandwidth_gb_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_gb_s}")
    return bytes_per_step * steps_per_s / (bandwidth_gb_s * 1e9)


def expert_bytes_per_layer(executor) -> dict[int, int] | None:
    """Bytes one routed expert occupies per layer, as `executor` stores it (quantized sizes and
    scales included), or None when the executor cannot say (a remote one)."""
    layers = getattr(executor, "layers", None)
    if not isinstance(layers, dict):
        return None
    out = {}
    for layer, w in layers.items():
        if hasattr(w, "expert_nbytes"):  # CpuExpertExecutor's prepared layers
            out[layer] = w.expert_nbytes
        elif hasattr(w, "gate_up"):  # plain ExpertWeights
            out[layer] = (w.gate_up.nbytes + w.down.nbytes) // w.gate_up.shape[0]
        else:
            return None
    return out
