"""Multi-step decode and native greedy runs against single-step decode sampled in Python, in one
process, the settings alternating.

    python benchmarks/multi_step.py [--checkpoint DIR] [--expert-quant int4] [--dense-quant int8]
                                    [--steps 8] [--gen-len 128] [--rounds 4]

One greedy stream on the engine (no gRPC), ms per decode token, four settings on the same
engine, switched between requests: `num_scheduler_steps` 1 (a token an engine step) or `--steps`
(a run of tokens a step), each with every token sampled in Python (a logits hook that does
nothing watches the logits, as before greedy runs existed) or through the native greedy run
(`CausalLM.greedy_steps`: embedding, layers, head and argmax in one call). Prints one JSON line
per round, each setting's speedup over N = 1 sampled in Python, and the medians.
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

    def ms_per_token(steps: int, native_greedy: bool, gen_len: int) -> float:
        engine.scheduler.config.num_scheduler_steps = steps
        engine.runner.logits_hook = None if native_greedy else (lambda rid, row: None)
        engine.add_request(f"ms-{time.perf_counter()}", list(range(5, 37)),
                           SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True))
        engine.step()  # the prefill
        start, tokens = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            tokens += sum(len(o.new_token_ids) for o in engine.step())
        return (time.perf_counter() - start) / tokens * 1e3

    settings = {"n1_python": (1, False), "n1_native": (1, True), f"n{args.steps}_python": (args.steps, False),
                f"n{args.steps}_native": (args.steps, True)}
    ms_per_token(args.steps, True, 16)  # warm-up
    speedups: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        ms = {name: ms_per_token(steps, native, args.gen_len) for name, (steps, native) in settings.items()}
        for name in settings:
            speedups[name].append(ms["n1_python"] / ms[name])
        print(json.dumps({**{f"{name}_ms": round(v, 3) for name, v in ms.items()},
                          "load_average": round(os.getloadavg()[0], 2)}))
    print(json.dumps({f"median_speedup_{name}": round(statistics.median(v), 3) for name, v in speedups.items()}))
    assert engine.model.native_path is not None and engine.model.native_path.greedy_steps > 0

if __name__ == "__main__":
    main()
