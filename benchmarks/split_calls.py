"""Split mode's expert calls from the attention side: the step and one Forward round trip, timed
around `GrpcExpertExecutor.forward`, on the comparison checkpoint, int8 experts and dense layers.

    python benchmarks/split_calls.py --cores shared|disjoint [--spin-us N] [--attention-threads N] [--checkpoint DIR]

Starts `tandem serve --role experts` as `tandem bench --mode split` does (shared: both processes
on every core; disjoint: one core each; a thread per core on each side), decodes one stream, and
prints the best of three 40-step windows. To compare two checkouts, run each with PYTHONPATH pointing at
its `services/`, alternating.
"""

from __future__ import annotations

import argparse
import inspect
import os
import time
from pathlib import Path
from types import SimpleNamespace

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tandem"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", choices=["shared", "disjoint"], required=True)
    ap.add_argument("--spin-us", type=int, default=20000)
    ap.add_argument("--attention-threads", type=int, help="default: one per attention core")
    ap.add_argument("--checkpoint", type=Path, default=CACHE / "compare-mixtral")
    args = ap.parse_args()

    import torch

    from tandem import engine_bench
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    cores = sorted(os.sched_getaffinity(0))
    attention, experts = (cores, cores) if args.cores == "shared" else engine_bench.split_cores(cores)
    opts = SimpleNamespace(model=str(args.checkpoint), expert_quant="int8", dtype=None)
    spin_us = args.spin_us
    if "spin_us" in inspect.signature(engine_bench.start_split_experts).parameters:
        proc, client = engine_bench.start_split_experts(opts, experts, spin_us)
    else:  # a checkout from before --spin-us, which set OMP_WAIT_POLICY=PASSIVE on shared cores
        popen = engine_bench.subprocess.Popen
        engine_bench.subprocess.Popen = lambda cmd, *a, **kw: popen(cmd, *a, **{**kw, "env": None})
        proc, client = engine_bench.start_split_experts(opts, experts)
        engine_bench.subprocess.Popen = popen
        spin_us = 0
    try:
        engine_bench.pin_process(attention)
        engine = LLMEngine.from_pretrained(args.checkpoint, device="cpu", dtype="float32", expert_quant="int8",
                                           dense_quant="int8", expert_executor=client)
        torch.set_num_threads(args.attention_threads or len(attention))
        calls = {"seconds": 0.0, "n": 0}
        forward = client.forward

        def timed_forward(*a):
            start = time.perf_counter()
            try:
                return forward(*a)
            finally:
                calls["seconds"] += time.perf_counter() - start
                calls["n"] += 1

        client.forward = timed_forward
        if hasattr(client, "record_call"):  # the native decode step's own calls (data_plane_calls)
            record = client.record_call

            def counted_record(seconds):
                calls["seconds"] += seconds
                calls["n"] += 1
                record(seconds)

            client.record_call = counted_record
        engine.add_request("calls", list(range(5, 37)), SamplingParams(max_tokens=1000, temperature=0.0,
                                                                         ignore_eos=True))
        for _ in range(5):  # prefill and warm-up
            engine.step()
        steps, per_call = [], []
        for _ in range(3):
            calls.update(seconds=0.0, n=0)
            start = time.perf_counter()
            for _ in range(40):
                engine.step()
            steps.append((time.perf_counter() - start) / 40 * 1e3)
            per_call.append(calls["seconds"] / calls["n"] * 1e6)
        print(f"{args.cores} cores, {torch.get_num_threads()} attention threads, spin {spin_us} us: step {min(steps):.2f} ms "
              f"(windows {', '.join(f'{s:.1f}' for s in steps)}), expert call {min(per_call):.0f} us, "
              f"load average {os.getloadavg()[0]:.2f}")
    finally:
        client.close()  # the experts process serves a connected client on past SIGTERM
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
