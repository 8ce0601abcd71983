"""Multi-step decode against single-step, in one process, the two alternating.

    python benchmarks/multi_step.py [--checkpoint DIR] [--expert-quant int4] [--dense-quant int8]
                                    [--steps 8] [--gen-len 128] [--rounds 4]

One greedy stream on the engine (no gRPC), ms per decode token: an engine step of
`num_scheduler_steps` = 1 (a token a step) against `--steps` (a run of tokens a step), on the
same engine, switching the scheduler's setting between requests. Prints one JSON line per round
and the median ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tandem"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=CACHE / "compare-mixtral")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--expert-quant", default="int4")
    ap.add_argument("--dense-quant", default="int8")
    ap.add_argument("--steps", type=int, default=8, help="num_scheduler_steps of the multi-step runs")
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()

    import torch

    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_pretrained(args.checkpoint, device="cpu", dtype="float32", expert_threads=args.threads,
                                       expert_quant=args.expert_quant, dense_quant=args.dense_quant)
    torch.set_num_threads(args.threads)

    def ms_per_token(steps: int, gen_len: int) -> float:
        engine.scheduler.config.num_scheduler_steps = steps
        engine.add_request(f"ms-{time.perf_counter()}", list(range(5, 37)),
                           SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True))
        engine.step()  # the prefill
        start, tokens = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            tokens += sum(len(o.new_token_ids) for o in engine.step())
        return (time.perf_counter() - start) / tokens * 1e3

    ms_per_token(args.steps, 16)  # warm-up
    ratios = []
    for _ in range(args.rounds):
        single = ms_per_token(1, args.gen_len)
        multi = ms_per_token(args.steps, args.gen_len)
        ratios.append(single / multi)
        print(json.dumps({"single_ms": round(single, 3), f"steps_{args.steps}_ms": round(multi, 3),
                          "speedup": round(ratios[-1], 3), "load_average": round(os.getloadavg()[0], 2)}))
    print(json.dumps({"median_speedup": round(statistics.median(ratios), 3)}))


if __name__ == "__main__":
    main()
