"""How the native kernels cut a parallel region into chunks (tandem_moe_cpu.set_chunks_per_thread and
set_chunk_bytes), one setting against another, in the same process, alternating step by step, split
by how fast the memory read just before each timed step.

    python benchmarks/chunk_floor.py [--checkpoint DIR] [--precision int8] [--settings 8:0,8]
                                     [--seconds 60] [--threads 2]

A setting is chunks a thread and, after a colon, the fewest bytes of weights a chunk reads (left
out: the kernel's default). The loop is benchmarks/weight_prefetch.py's (`timed_steps`):
single-stream greedy decode at multi-step 8, each timed step after a 1 GiB `sum` read, steps split
into "busy" (after a read below 40 GB/s) and "quiet" (45 or above), each with its median tok/s per
setting. benchmarks/work_chunks.py compares the same settings on batched decode and prefill.
Not a test: for RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from weight_prefetch import CACHE, PRECISIONS, WINDOWS, load_engine, timed_steps  # this folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=CACHE / "compare-mixtral")
    ap.add_argument("--precision", default="int8", choices=sorted(PRECISIONS))
    ap.add_argument("--settings", default="8:0,8", help="chunks a thread[:fewest bytes a chunk], comma-separated")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    settings = args.settings.split(",")

    from tandem.experts import native

    kernel = native.load_kernel()
    if kernel is None:
        raise SystemExit(f"the native kernel is not available: {native.unavailable_reason()}")
    default_chunks, default_bytes = kernel.chunks_per_thread(), kernel.chunk_bytes()
    engine = load_engine(args.checkpoint, args.precision, args.threads)

    def turn(i: int) -> str:
        setting = settings[i % len(settings)]
        chunks, _, floor = setting.partition(":")
        kernel.set_chunks_per_thread(int(chunks))
        kernel.set_chunk_bytes(int(floor) if floor else default_bytes)
        return setting

    try:
        rows = timed_steps(engine, args.seconds, turn)
    finally:
        kernel.set_chunks_per_thread(default_chunks)
        kernel.set_chunk_bytes(default_bytes)
    out = {"precision": args.precision, "default_chunk_bytes": default_bytes,
           "load_average": round(os.getloadavg()[0], 2)}
    for window, keep in WINDOWS.items():
        for setting in settings:
            tok_s = [tok for s, read, tok in rows if s == setting and keep(read)]
            out[f"{window}.{setting}"] = {"tok_s": round(statistics.median(tok_s), 1) if tok_s else None,
                                          "steps": len(tok_s)}
    out["read_gbs_median"] = round(statistics.median(read for _, read, _ in rows), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
