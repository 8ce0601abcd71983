"""The kernels' software prefetch of the weight streams (tandem_moe_cpu.set_weight_prefetch), one
distance against another, in the same process, alternating step by step, split by how fast the
memory read just before each timed step.

    python benchmarks/weight_prefetch.py [--checkpoint DIR] [--precision int8] [--prefetch 0,1024]
                                         [--seconds 60] [--threads 2]

Single-stream greedy decode at multi-step 8 (one engine step decodes 8 tokens). Each turn sets the
next `--prefetch` distance, runs one untimed step, reads a 1 GiB float32 buffer with torch `sum`
(flushing the caches, as a serving step's other work would, and measuring the memory at that
moment), runs one more untimed step and then the timed one. Requests of 169 tokens (a prefill
and 21 steps: 7 turns) are added as they finish; 7 turns a request, odd and not a multiple of 3, so
two or three settings taking turns see each place in a request equally often. On the development
VM the rate `sum` reads moves between ~30 and ~55-60 GB/s over seconds, whatever the buffer
(benchmarks/RESULTS.md, round thirty-three), so the steps are split into those after a read below
40 GB/s ("busy") and at 45 or above ("quiet"), each with its median tok/s per distance.
Precisions as benchmarks/compare.py's: f32 and bf16 unquantized; int8 experts and dense layers
int8; int4 experts int4, dense layers int8. Not a test: for RESULTS.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tandem"
# precision -> (dtype, expert quantization, dense quantization), as benchmarks/compare.py runs them
PRECISIONS = {"f32": ("float32", "none", "none"), "bf16": ("bfloat16", "none", "none"),
              "int8": ("float32", "int8", "int8"), "int4": ("float32", "int4", "int8")}
BUSY_BELOW, QUIET_FROM = 40.0, 45.0  # GB/s of the read before a step
# window -> whether a step whose read before ran at that many GB/s falls in it
WINDOWS = {"busy": lambda read: read < BUSY_BELOW, "quiet": lambda read: read >= QUIET_FROM}
MULTI_STEP = 8  # tokens one engine step decodes (EngineConfig.num_scheduler_steps)
STEPS_PER_TURN, TURNS_PER_REQUEST = 3, 7  # see timed_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_args(ap)
    ap.add_argument("--prefetch", default="0,1024", help="bytes ahead to compare, comma-separated")
    args = ap.parse_args()
    settings = [int(b) for b in args.prefetch.split(",")]

    kernel = native_kernel()
    default = kernel.weight_prefetch()
    engine = load_engine(args.checkpoint, args.precision, args.threads)

    def turn(i: int) -> int:
        ahead = settings[i % len(settings)]
        kernel.set_weight_prefetch(ahead)
        return ahead

    try:
        rows = timed_steps(engine, args.seconds, turn)
    finally:
        kernel.set_weight_prefetch(default)
    out = {"precision": args.precision, "default_prefetch": default, "load_average": round(os.getloadavg()[0], 2)}
    print(json.dumps(out | by_window(rows, settings, lambda ahead: f"prefetch_{ahead}")))


def engine_args(ap: argparse.ArgumentParser) -> None:
    """The options of an alternating loop's engine (load_engine) and of its length."""
    ap.add_argument("--checkpoint", type=Path, default=CACHE / "compare-mixtral")
    ap.add_argument("--precision", default="int8", choices=sorted(PRECISIONS))
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--threads", type=int, default=2)


def native_kernel():
    """The native kernel module, whose settings the loops alternate; exits where it cannot load."""
    from tandem.experts import native

    kernel = native.load_kernel()
    if kernel is None:
        raise SystemExit(f"the native kernel is not available: {native.unavailable_reason()}")
    return kernel


def by_window(rows: list[tuple[object, float, float]], settings: list, name=str) -> dict:
    """timed_steps' rows as each window's median tok/s and step count per setting (keyed
    "window.name(setting)"), and the median read."""
    out = {}
    for window, keep in WINDOWS.items():
        for setting in settings:
            tok_s = [tok for s, read, tok in rows if s == setting and keep(read)]
            out[f"{window}.{name(setting)}"] = {"tok_s": round(statistics.median(tok_s), 1) if tok_s else None,
                                                "steps": len(tok_s)}
    out["read_gbs_median"] = round(statistics.median(read for _, read, _ in rows), 1)
    return out


def load_engine(checkpoint: Path, precision: str, threads: int):
    """The comparison checkpoint at `precision`, greedy decode at multi-step MULTI_STEP, on `threads` threads."""
    import torch

    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    dtype, experts, dense = PRECISIONS[precision]
    engine = LLMEngine.from_pretrained(checkpoint, device="cpu", dtype=dtype, expert_threads=threads,
                                       expert_quant=experts, dense_quant=dense,
                                       config=EngineConfig(num_scheduler_steps=MULTI_STEP))
    torch.set_num_threads(threads)
    return engine


def timed_steps(engine, seconds: float, turn=lambda turn: None) -> list[tuple[object, float, float]]:
    """Single-stream decode for `seconds`: each turn calls turn(i) (which sets what is compared and
    returns its label, or None), runs one untimed step, reads 1 GiB with `sum`, runs one more and
    times the next. Returns (label, GB/s of that read, tok/s of the timed step) per timed step,
    tok/s counting the tokens the step returned.

    A request lasts TURNS_PER_REQUEST turns. With 96 tokens (4 turns, before round thirty-five) the
    turns of two alternating settings fell on fixed places in each request, and the second one's
    timed steps included every request's last, which returned 7 tokens and was counted as 8: with
    one setting under both labels, the second read 5% faster in both windows."""
    import torch

    from tandem.engine.sampling_params import SamplingParams

    names = (f"timed-{i}" for i in itertools.count())
    # a prefill's token, then STEPS_PER_TURN steps of MULTI_STEP tokens a turn
    request_tokens = 1 + TURNS_PER_REQUEST * STEPS_PER_TURN * MULTI_STEP
    params = SamplingParams(max_tokens=request_tokens, temperature=0.0, ignore_eos=True)

    def step() -> None:
        if not engine.has_unfinished_requests():
            engine.add_request(next(names), list(range(5, 37)), params)
            engine.step()  # its prefill
        engine.step()

    buffer = torch.rand(1 << 28)
    step()
    rows = []
    start = time.perf_counter()
    for i in itertools.count():
        if time.perf_counter() - start > seconds:
            return rows
        label = turn(i)
        step()
        t = time.perf_counter()
        buffer.sum()
        read = buffer.numel() * 4 / (time.perf_counter() - t) / 1e9
        step()
        if not engine.has_unfinished_requests():
            continue  # the timed step would be a prefill
        t = time.perf_counter()
        tokens = sum(len(o.new_token_ids) for o in engine.step())
        rows.append((label, read, tokens / (time.perf_counter() - t)))


if __name__ == "__main__":
    main()
