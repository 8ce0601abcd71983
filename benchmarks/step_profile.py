"""Where one decode step's time goes: routed experts, int8 dense layers, the rest of the model's
forward, and the engine outside it, on the comparison checkpoint.

    python benchmarks/step_profile.py [--checkpoint DIR] [--threads 1] [--expert-quant int8] [--dense-quant int8]

Wall-clock timers around the expert executor, every int8 dense layer and the model's forward and
logits, over 40-step decode windows of one stream (best of 3). One thread by default, so the
split is not distorted by waits at the end of parallel regions.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tandem"


def timed(acc: dict, key: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - start
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=CACHE / "compare-mixtral")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--expert-quant", default="int8")
    ap.add_argument("--dense-quant", default="int8")
    args = ap.parse_args()

    import torch

    import tandem.model.quant_linear as ql
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_pretrained(args.checkpoint, device="cpu", dtype="float32", expert_threads=args.threads,
                                       expert_quant=args.expert_quant)
    ql.quantize_dense_(engine.model, args.dense_quant)
    torch.set_num_threads(args.threads)
    engine.add_request("profile", list(range(5, 37)), SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    for _ in range(5):  # prefill and warm-up
        engine.step()
    acc = dict.fromkeys(("experts", "dense_int8", "model_forward", "logits"), 0.0)
    executor = engine.model.model.layers[0].mlp.executor
    executor.forward = timed(acc, "experts", executor.forward)
    ql.Int8Kernel.__call__ = timed(acc, "dense_int8", ql.Int8Kernel.__call__)
    engine.model.forward = timed(acc, "model_forward", engine.model.forward)
    engine.model.compute_logits = timed(acc, "logits", engine.model.compute_logits)
    best = None
    for _ in range(3):
        acc.update(dict.fromkeys(acc, 0.0))
        steps, start = 40, time.perf_counter()
        for _ in range(steps):
            engine.step()
        row = {"step_ms": (time.perf_counter() - start) / steps * 1e3, **{k: v / steps * 1e3 for k, v in acc.items()}}
        if best is None or row["step_ms"] < best["step_ms"]:
            best = row
    best["load_average"] = os.getloadavg()[0]
    print(json.dumps({k: round(v, 2) for k, v in best.items()}))


if __name__ == "__main__":
    main()
