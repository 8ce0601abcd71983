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

from weight_prefetch import by_window, engine_args, load_engine, native_kernel, timed_steps  # this folder
from work_chunks import use_chunks  # this folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_args(ap)
    ap.add_argument("--settings", default="8:0,8", help="chunks a thread[:fewest bytes a chunk], comma-separated")
    args = ap.parse_args()
    settings = args.settings.split(",")

    kernel = native_kernel()
    default_chunks, default_bytes = kernel.chunks_per_thread(), kernel.chunk_bytes()
    engine = load_engine(args.checkpoint, args.precision, args.threads)

    def turn(i: int) -> str:
        setting = settings[i % len(settings)]
        use_chunks(kernel, setting, default_bytes)
        return setting

    try:
        rows = timed_steps(engine, args.seconds, turn)
    finally:
        kernel.set_chunks_per_thread(default_chunks)
        kernel.set_chunk_bytes(default_bytes)
    out = {"precision": args.precision, "default_chunk_bytes": default_bytes,
           "load_average": round(os.getloadavg()[0], 2)}
    print(json.dumps(out | by_window(rows, settings)))


if __name__ == "__main__":
    main()
