"""The weights on 2 MiB pages (tandem.model.huge_pages, what the loader does) against 4 KiB pages:
single-stream decode in alternating processes, split by how fast the memory read just before
each timed step.

    python benchmarks/huge_pages.py [--checkpoint DIR] [--precision int8] [--pairs 3] [--seconds 45]
                                    [--threads 2]

Pages are a property of a process's memory, so the two sides cannot alternate step by step in
one process as benchmarks/weight_prefetch.py does: each pair runs one process with the loader's
huge pages turned off (`huge_pages.collapse` replaced by a no-op) and one as shipped, one after
the other. Inside each process the loop is weight_prefetch.py's (`timed_steps`): greedy decode at multi-step 8,
each timed step after a 1 GiB `sum` read that sorts it into "busy" (below 40 GB/s) or "quiet"
(45 GB/s or more), since this VM's memory moves between ~30 and ~55-60 GB/s over seconds. Prints
one JSON line per process (with its AnonHugePages) and the median of each side's medians. Not a
test: for RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from weight_prefetch import CACHE, PRECISIONS, WINDOWS, load_engine, timed_steps  # this folder


def worker(args) -> dict:
    from tandem.model import huge_pages

    if args.worker == "off":
        huge_pages.collapse = lambda tensors: 0  # the loader's call, skipped
    engine = load_engine(args.checkpoint, args.precision, args.threads)
    rows = [(read, tok) for _, read, tok in timed_steps(engine, args.seconds)]  # (GB/s read before, tok/s)
    with open("/proc/self/smaps_rollup") as f:
        anon_huge_kib = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
    out = {"pages": args.worker, "precision": args.precision, "anon_huge_mib": anon_huge_kib >> 10}
    for window, keep in WINDOWS.items():
        tok_s = [tok for read, tok in rows if keep(read)]
        out[window] = {"tok_s": round(statistics.median(tok_s), 1) if tok_s else None, "steps": len(tok_s)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=CACHE / "compare-mixtral")
    ap.add_argument("--precision", default="int8", choices=sorted(PRECISIONS))
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=45.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", choices=("on", "off"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    runs = []
    for _ in range(args.pairs):
        for side in ("off", "on"):
            cmd = [sys.executable, __file__, "--worker", side, "--checkpoint", str(args.checkpoint),
                   "--precision", args.precision, "--seconds", str(args.seconds), "--threads", str(args.threads)]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            runs.append(json.loads(line))
            print(line, flush=True)
    summary = {"precision": args.precision}
    for window in WINDOWS:
        for side in ("off", "on"):
            medians = [r[window]["tok_s"] for r in runs if r["pages"] == side and r[window]["tok_s"] is not None]
            summary[f"{window}.{side}"] = round(statistics.median(medians), 1) if medians else None
        off, on = summary[f"{window}.off"], summary[f"{window}.on"]
        summary[f"{window}.ratio"] = round(on / off, 3) if off and on else None
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
