"""Paged decode attention on the CPU: the native kernel against the torch path it replaced.

    python benchmarks/decode_attention.py [--contexts 64,512,4096] [--heads 32] [--kv-heads 8] [--head-dim 128]
                                          [--value-dim D] [--threads 2] [--batch 1] [--json out.json]
    # DeepSeek-V3's latent cache: 128 absorbed query heads on one 576-wide entry, value its first 512
    python benchmarks/decode_attention.py --heads 128 --kv-heads 1 --head-dim 576 --value-dim 512

One decode query per sequence over a shuffled block table (block size 16), float32, as an
offloaded long-context sequence meets it on the CPU tier. `torch` is `sdpa_paged_attention`
(gather the blocks into a contiguous copy, then SDPA, or two batched GEMMs when all query heads
share one KV head); `native` is torch.ops.tandem.paged_decode_attention (reads K and V in
place). `paged_attention` picks native up to 16 query heads per KV head. Also prints the KV bytes
each call must read and the GB/s that makes.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from tandem.kv.attention import AttentionMetadata, native_decode_attention, sdpa_paged_attention

BS = 16


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="64,512,4096")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--value-dim", type=int, help="narrower values as a view of the keys (a latent cache)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = native_decode_attention()
    if kernel is None:
        raise SystemExit("the native kernel is not built (python -m tandem.experts.build)")
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        per_seq = -(-ctx // BS)
        blocks = per_seq * args.batch
        perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).tolist()
        tables = [perm[i * per_seq:(i + 1) * per_seq] for i in range(args.batch)]
        k = torch.randn(blocks, BS, args.kv_heads, args.head_dim)
        v = k[..., :args.value_dim] if args.value_dim else torch.randn(blocks, BS, args.kv_heads, args.head_dim)
        q = torch.randn(args.batch, args.heads, args.head_dim)
        meta = AttentionMetadata.build([ctx - 1] * args.batch, [1] * args.batch, tables, BS, torch.device("cpu"))
        reps = max(5, 20000 // ctx)
        t_torch = timed(lambda: sdpa_paged_attention(q, k, v, meta, 0.1), reps)
        t_native = timed(lambda: kernel(q, k, v, meta.block_tables, meta.seq_lens, 0.1, 0), reps)
        kv_bytes = (1 if args.value_dim else 2) * args.batch * ctx * args.kv_heads * args.head_dim * 4
        row = {"context": ctx, "torch_us": t_torch * 1e6, "native_us": t_native * 1e6, "speedup": t_torch / t_native,
               "kv_mb": kv_bytes / 1e6, "native_gb_s": kv_bytes / t_native / 1e9}
        rows.append(row)
        print(f"context {ctx:6d}: torch {row['torch_us']:9.0f} us  native {row['native_us']:8.0f} us  "
              f"{row['speedup']:.1f}x  ({row['kv_mb']:.1f} MB of KV, {row['native_gb_s']:.1f} GB/s)")
    print(f"load average {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
