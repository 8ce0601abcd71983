"""Where one decode step's time goes, on the native decode path and on the torch path it replaces,
in the same process, on the comparison checkpoint.

    python benchmarks/step_profile.py [--checkpoint DIR] [--threads 2] [--expert-quant int8] [--dense-quant int8]
                                      [--streams 1] [--dtype bfloat16] [--isa avx512,avx512bf16]
                                      [--num-scheduler-steps 8] [--stream]

Wall-clock timers around the routed experts (seen through an observing executor wrapper, as the
serving metrics see them), the model's forward and its logits, and the attention metadata, over
40-token decode windows of `--streams` concurrent streams (one batch a step), best of 3 per path,
the paths alternating. The torch path's "rest of forward" is its forward less the experts; the
native path's steps bypass the model's forward (its timer reads 0), and its `native.*` entries
split the native calls by phase (DecodeLayer's own clock), all layers together; a greedy run's
`native.head_argmax` (LM head and argmax) and `native.on_step` (the engine's callback as each
token ends) are once a token. With --num-scheduler-steps N, an engine step decodes N tokens (greedy
runs: N steps in one native call) and every figure is per token. --stream steps the engine as the
server does, streaming each token as its step ends (LLMEngine.step's emit), so the callback runs.
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


class ExpertTimer:
    """An observing wrapper: the native path reports its expert calls to `observe`, the torch path
    calls `forward`; both land in acc["experts"]."""

    def __init__(self, inner, acc: dict):
        self.inner, self.acc = inner, acc
        self.forward = timed(acc, "experts", inner.forward)

    def observe(self, layer, topk_ids, seconds: float) -> None:
        self.acc["experts"] += seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=CACHE / "compare-mixtral")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--expert-quant", default="int8")
    ap.add_argument("--dense-quant", default="int8")
    ap.add_argument("--streams", type=int, default=1, help="concurrent requests, decoded as one batch")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--num-scheduler-steps", type=int, default=1, metavar="N",
                    help="decode tokens an engine step (multi-step: greedy runs in one native call)")
    ap.add_argument("--stream", action="store_true", help="stream each token as its step ends, as serving does")
    ap.add_argument("--isa", default="", help="two instruction sets for the native path to alternate (e.g. "
                    "avx512,avx512bf16), in place of the native and torch paths")
    args = ap.parse_args()
    if args.num_scheduler_steps < 1 or 40 % args.num_scheduler_steps:
        ap.error("--num-scheduler-steps must divide the 40 tokens a window decodes")
    isas = args.isa.split(",") if args.isa else []
    if isas and len(isas) != 2:
        ap.error("--isa takes two instruction sets")

    import torch

    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams
    from tandem.experts import native

    engine = LLMEngine.from_pretrained(args.checkpoint, device="cpu", dtype=args.dtype, expert_threads=args.threads,
                                       expert_quant=args.expert_quant, dense_quant=args.dense_quant,
                                       config=EngineConfig(num_scheduler_steps=args.num_scheduler_steps))
    torch.set_num_threads(args.threads)
    acc = dict.fromkeys(("experts", "model_forward", "logits", "metadata"), 0.0)
    model = engine.model
    kernel = native.load_kernel()
    timer = ExpertTimer(model.model.layers[0].mlp.executor, acc)
    for layer in model.model.layers:
        layer.mlp.executor = timer
    model.forward = timed(acc, "model_forward", model.forward)
    model.compute_logits = timed(acc, "logits", model.compute_logits)
    engine.runner._step_attention = timed(acc, "metadata", engine.runner._step_attention)
    for i in range(args.streams):
        engine.add_request(f"profile-{i}", list(range(5 + i, 37 + i)),
                           SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
    for _ in range(4 + args.streams):  # prefill and warm-up
        engine.step()
    best: dict[str, dict] = {}
    for _ in range(3):
        for path in isas or ("native", "torch"):
            model.native_decode = path != "torch"
            if isas:
                kernel.set_isa(path)
            engine.step()  # the first step after a switch builds or drops the native layers
            acc.update(dict.fromkeys(acc, 0.0))
            kernel.set_decode_profile(path != "torch")
            steps, start = 40, time.perf_counter()  # tokens, per stream
            for _ in range(steps // args.num_scheduler_steps):
                engine.step(emit=(lambda outputs: None) if args.stream else None)
            row = {"step_ms": (time.perf_counter() - start) / steps * 1e3,
                   **{k: v / steps * 1e3 for k, v in acc.items()}}
            if path != "torch":  # inside the native layer calls, all layers together
                phases = kernel.decode_profile()
                kernel.set_decode_profile(False)
                assert phases.pop("calls") == steps * len(model.model.layers)
                row.update({f"native.{k}": v / steps * 1e3 for k, v in phases.items()})
            if row["model_forward"]:  # the native path's steps bypass the model's forward
                row["rest_of_forward"] = row["model_forward"] - row["experts"]
            row["outside_forward"] = row["step_ms"] - row["model_forward"] - row["logits"]
            if path not in best or row["step_ms"] < best[path]["step_ms"]:
                best[path] = row
    assert model.native_path is not None, "the native decode path did not serve this model"
    out = {path: {k: round(v, 2) for k, v in row.items()} for path, row in best.items()}
    a, b = isas or ("torch", "native")
    out[f"{a}_over_{b}"] = round(best[a]["step_ms"] / best[b]["step_ms"], 2)
    out["load_average"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
