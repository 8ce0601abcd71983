"""Routed-expert time per MoE layer by tokens per call: decode-sized batches to prefill-sized ones.

    python benchmarks/expert_tokens.py [--quant int8] [--tokens 1,8,32,64,128,256] [--threads 2] [--skew 1]

CpuExpertExecutor over `--layers` layers of 8 experts of 1024 x 2816 (the comparison checkpoint's
shape), random weights, top-2 of random experts (uniformly, or with `--skew s` expert e drawn with
weight 1 / (e + 1)^s, as trained routers favour some experts); the layers are cycled so that their
weights (~69 MB a layer at int8) come from RAM, not the cache. Prints the median of 7 passes per
token count, in ms a layer and in GMAC/s (tokens x 2 experts x 3 projections x 1024 x 2816 a layer).
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
    args = ap.parse_args()
    torch.manual_seed(0)
    layers = {i: ExpertWeights(torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN) * 0.02,
                               torch.randn(EXPERTS, HIDDEN, INTERMEDIATE) * 0.02) for i in range(args.layers)}
    executor = CpuExpertExecutor(layers, quant=args.quant, threads=args.threads)
    del layers
    print(f"{args.quant} experts, {args.threads} threads, skew {args.skew}, load average {os.getloadavg()[0]:.1f}")
    for n in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(n, HIDDEN)
        popularity = 1.0 / torch.arange(1, EXPERTS + 1, dtype=torch.float64) ** args.skew
        ids = torch.multinomial(popularity.expand(n, EXPERTS), TOP_K)  # without replacement
        weights = torch.rand(n, TOP_K)
        passes = []
        for _ in range(7):
            start = time.perf_counter()
            for layer in range(args.layers):
                executor.forward(layer, x, ids, weights)
            passes.append((time.perf_counter() - start) / args.layers)
        seconds = statistics.median(passes)
        macs = n * TOP_K * 3 * HIDDEN * INTERMEDIATE
        print(f"  {n:4d} tokens: {seconds * 1e3:7.2f} ms a layer, {macs / seconds / 1e9:6.1f} GMAC/s", flush=True)


if __name__ == "__main__":
    main()
