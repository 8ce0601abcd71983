"""Where a split decode step's time goes, against embedded, on the comparison checkpoint (int8
experts and dense layers): the attention process's native phases per step (DecodeLayer's own
clock; "experts" is the round trip to the experts process), and the experts process's compute
per call (its expert-call histogram).

    python benchmarks/split_profile.py embedded|split [--threads N] [--spin-us N] [--per-layer] [--checkpoint DIR]

split starts `tandem serve --role experts` as `tandem bench --mode split --split-cores shared` does
(both processes on every core). --per-layer runs the attention side's layers one native call
each, with a Python Forward call between them, as before the step became one call. Prints the best
of three 40-step windows. Run the modes alternately: this VM's speed drifts.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tandem"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expert_calls(port: int | None) -> tuple[float, float]:
    """(seconds, count) of the experts process's forward-latency histogram so far."""
    if port is None:
        return 0.0, 0.0
    from tandem import contract

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith(contract.EXPERTS_FORWARD_LATENCY + suffix + " "):
                values[suffix] = float(line.split()[-1])
    return values["_sum"], values["_count"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["embedded", "split"])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--spin-us", type=int, default=20000)
    ap.add_argument("--per-layer", action="store_true")
    ap.add_argument("--checkpoint", type=Path, default=CACHE / "compare-mixtral")
    args = ap.parse_args()

    import torch

    from tandem import engine_bench
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams
    from tandem.experts import native

    proc = client = port = None
    if args.mode == "split":
        port = free_port()
        popen = subprocess.Popen

        def with_metrics(cmd, *a, **kw):  # the bench starts it without a metrics endpoint of known port
            i = cmd.index("--metrics-port")
            return popen([*cmd[:i + 1], str(port), *cmd[i + 2:]], *a, **kw)

        engine_bench.subprocess.Popen = with_metrics
        opts = SimpleNamespace(model=str(args.checkpoint), expert_quant="int8", dtype=None, experts_gguf=None,
                               experts_shm=None)
        proc, client = engine_bench.start_split_experts(opts, sorted(os.sched_getaffinity(0)), args.spin_us)
        engine_bench.subprocess.Popen = popen
    try:
        engine = LLMEngine.from_pretrained(args.checkpoint, device="cpu", dtype="float32", expert_quant="int8",
                                           dense_quant="int8", expert_executor=client)
        torch.set_num_threads(args.threads)
        engine.add_request("p", list(range(5, 37)), SamplingParams(max_tokens=1000, temperature=0.0,
                                                                   ignore_eos=True))
        for _ in range(5):  # prefill and warm-up
            engine.step()
        if args.per_layer:
            engine.model.native_path.natives = None
        kernel, best = native.load_kernel(), None
        for _ in range(3):
            kernel.set_decode_profile(True)
            before = expert_calls(port)
            start = time.perf_counter()
            for _ in range(40):
                engine.step()
            step = (time.perf_counter() - start) / 40 * 1e3
            phases, after = kernel.decode_profile(), expert_calls(port)
            kernel.set_decode_profile(False)
            if best is None or step < best[0]:
                best = (step, phases, (after[0] - before[0]) / max(1.0, after[1] - before[1]))
        step, phases, per_call = best
        calls = phases.pop("calls")
        print(f"{args.mode}{' per-layer' if args.per_layer else ''}, {args.threads} threads, spin {args.spin_us} us: "
              f"step {step:.2f} ms; native phases a step: "
              + ", ".join(f"{name} {seconds / 40 * 1e3:.2f}" for name, seconds in phases.items())
              + f" ms ({calls} layer calls); experts process compute {per_call * 1e6:.0f} us a call; "
              f"load average {os.getloadavg()[0]:.2f}")
    finally:
        if proc is not None:
            client.close()  # the experts process serves a connected client on past SIGTERM
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
