"""How much of a greedy decode token's time is spent outside the native call, per --num-scheduler-steps.

    python benchmarks/step_overhead.py [--checkpoint DIR] [--steps 1,8] [--rounds 3] [--gen-len 128]
                                       [--expert-quant int4] [--dense-quant int8] [--dtype bfloat16]

One engine per N, all built first; then `--rounds` rounds, each decoding one request of `--gen-len`
greedy tokens on every engine in turn. A timer around `NativeDecode.greedy` (the native call that runs
an engine step's forward passes, LM head and argmax) splits each token's wall time into the native
call and the rest: the scheduler, the step's metadata and the output processing, in Python. The rest
is paid once per engine step, so N steps a run divide it by N.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tandem"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=CACHE / "compare-mixtral")
    ap.add_argument("--steps", default="1,8", help="comma-separated --num-scheduler-steps values")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--expert-quant", default="int4")
    ap.add_argument("--dense-quant", default="int8")
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args()

    from tandem.engine.llm_engine import EngineConfig, LLMEngine
    from tandem.engine.sampling_params import SamplingParams
    from tandem.model import native_decode

    inside = [0.0]
    greedy = native_decode.NativeDecode.greedy

    def timed_greedy(self, *a, **kw):
        start = time.perf_counter()
        try:
            return greedy(self, *a, **kw)
        finally:
            inside[0] += time.perf_counter() - start

    native_decode.NativeDecode.greedy = timed_greedy
    engines = {}
    for n in (int(s) for s in args.steps.split(",")):
        engines[n] = LLMEngine.from_pretrained(args.checkpoint, device="cpu", dtype=args.dtype,
                                               config=EngineConfig(num_scheduler_steps=n),
                                               expert_quant=args.expert_quant, dense_quant=args.dense_quant)
        engines[n].generate([[5, 6, 7, 8] * 8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    params = SamplingParams(max_tokens=args.gen_len + 1, temperature=0.0, ignore_eos=True)
    results: dict[int, list[tuple[float, float]]] = {n: [] for n in engines}
    print(f"load average {os.getloadavg()[0]:.1f}")
    for r in range(args.rounds):
        for n, engine in engines.items():
            engine.add_request(f"round-{r}", [9 + r, 6, 7, 8] * 8, params)
            engine.step()  # the prefill and its token
            inside[0] = 0.0
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            wall = time.perf_counter() - start
            if engine.model.native_path is None or not engine.model.native_path.greedy_steps:
                raise SystemExit(f"N={n}: the native greedy runs did not serve (see the engine's log)")
            results[n].append((wall / args.gen_len, inside[0] / args.gen_len))
            print(f"round {r} N={n}: {wall / args.gen_len * 1e3:.3f} ms a token, "
                  f"{(wall - inside[0]) / args.gen_len * 1e3:.3f} outside the native call", flush=True)
    for n, rows in results.items():
        token = statistics.median(w for w, _ in rows)
        outside = statistics.median(w - i for w, i in rows)
        print(f"N={n}: median {token * 1e3:.3f} ms a token, {outside * 1e3:.3f} ms outside the native call "
              f"({outside / token:.1%})")


if __name__ == "__main__":
    main()
