"""Routed-expert time per MoE layer by tokens per call: decode-sized batches to prefill-sized ones.

    python benchmarks/expert_tokens.py [--quant int8] [--tokens 1,8,32,64,128,256] [--threads 2] [--skew 1]
                                       [--chunks 1,8] [--dtype bfloat16] [--isa avx512,avx512bf16]

CpuExpertExecutor over `--layers` layers of 8 experts of 1024 x 2816 (the comparison checkpoint's
shape), random weights, top-2 of random experts (uniformly, or with `--skew s` expert e drawn with
weight 1 / (e + 1)^s, as trained routers favour some experts); the layers are cycled so that their
weights (~69 MB a layer at int8) come from RAM, not the cache. Prints the median of 7 passes per
token count, in ms a layer and in GMAC/s (tokens x 2 experts x 3 projections x 1024 x 2816 a layer).
With `--chunks a,b` the passes alternate between the kernel's two settings of chunks a thread
(set_chunks_per_thread), 9 of each, and the median of the pairs' ratios (b over a) is printed too;
`--isa a,b` alternates the kernel's instruction sets so (set_isa). `--dtype bfloat16` stores
unquantized experts as bf16.
Not a test: for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tandem.experts.base import ExpertWeights
from tandem.experts.cpu_executor import CpuExpertExecutor

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 1024, 2816, 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", default="int8", choices=("none", "int8", "int4"))
    ap.add_argument("--tokens", default="1,8,32,64,128,256")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--skew", type=float, default=0.0, help="routing weight 1 / (e + 1)^skew (0: uniform)")
    ap.add_argument("--chunks", default="", help="two chunks-a-thread settings to alternate, e.g. 1,8")
    ap.add_argument("--isa", default="", help="two instruction sets to alternate, e.g. avx512,avx512bf16")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="unquantized experts' dtype")
    args = ap.parse_args()
    if args.chunks and args.isa:
        ap.error("alternate --chunks or --isa, not both")
    settings = (args.chunks or args.isa).split(",") if args.chunks or args.isa else [None]
    if len(settings) not in (1, 2):
        ap.error("--chunks and --isa take two settings")
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    layers = {i: ExpertWeights((torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN) * 0.02).to(dtype),
                               (torch.randn(EXPERTS, HIDDEN, INTERMEDIATE) * 0.02).to(dtype))
              for i in range(args.layers)}
    executor = CpuExpertExecutor(layers, quant=args.quant, threads=args.threads)
    del layers

    def apply(setting: str | None) -> None:
        if setting is None:
            return
        if args.chunks:
            executor.native.set_chunks_per_thread(int(setting))
        else:
            executor.native.set_isa(setting)

    print(f"{args.quant} experts ({args.dtype}), {args.threads} threads, skew {args.skew}, "
          f"load average {os.getloadavg()[0]:.1f}")
    for n in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(n, HIDDEN)
        popularity = 1.0 / torch.arange(1, EXPERTS + 1, dtype=torch.float64) ** args.skew
        ids = torch.multinomial(popularity.expand(n, EXPERTS), TOP_K)  # without replacement
        weights = torch.rand(n, TOP_K)
        passes = {c: [] for c in settings}
        for _ in range(7 if settings == [None] else 9):
            for c in settings:
                apply(c)
                start = time.perf_counter()
                for layer in range(args.layers):
                    executor.forward(layer, x, ids, weights)
                passes[c].append((time.perf_counter() - start) / args.layers)
        macs = n * TOP_K * 3 * HIDDEN * INTERMEDIATE
        cells = []
        for c in settings:
            seconds = statistics.median(passes[c])
            label = "" if c is None else f"{c} chunks a thread: " if args.chunks else f"{c}: "
            cells.append(f"{label}{seconds * 1e3:7.2f} ms a layer, {macs / seconds / 1e9:6.1f} GMAC/s")
        if len(settings) == 2:
            a, b = settings
            cells.append(f"{b} / {a}: {statistics.median(y / x for x, y in zip(passes[a], passes[b])):.3f}x")
        print(f"  {n:4d} tokens: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
