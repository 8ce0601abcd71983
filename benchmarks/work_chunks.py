"""Cutting the native kernels' parallel regions into chunks that the threads take as they come free,
against one range a thread, in the same process, alternating: prefill and decode on the comparison
checkpoint.

    python benchmarks/work_chunks.py [--checkpoint DIR] [--chunks 1,8:0] [--expert-quant int8] [--dense-quant int8]
                                     [--streams 8] [--prompt-len 32] [--rounds 7] [--threads 2]
                                     [--device cpu|cuda] [--dtype float32]

Each round runs every `--chunks` setting once, in turn: chunks a thread (set_chunks_per_thread), and
after a colon the fewest bytes of weights a chunk reads (set_chunk_bytes; left out: the default).
A round prefills `--streams` prompts of `--prompt-len` tokens as one batch, then times a 30-step
decode window of `--streams` sequences. Prints each setting's median prefill and decode step time
and the median of the rounds' ratios to the first setting (below 1: faster). A noisy VM's drift falls on both
settings of a round alike, which single runs of two builds cannot give. With `--device cuda` the
attention runs on the GPU and the routed experts on this machine's cores (the hybrid path). Not a
test: for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tandem"
DECODE_STEPS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=CACHE / "compare-mixtral")
    ap.add_argument("--chunks", default="1,8:0",
                    help="settings to compare, the first the baseline: chunks per thread[:fewest bytes a chunk]")
    ap.add_argument("--expert-quant", default="int8")
    ap.add_argument("--dense-quant", default="int8")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    settings = args.chunks.split(",")

    import torch

    from tandem.engine.llm_engine import EngineConfig, LLMEngine
    from tandem.engine.sampling_params import SamplingParams
    from weight_prefetch import native_kernel  # this folder

    kernel = native_kernel()
    default_bytes = kernel.chunk_bytes()
    engine = LLMEngine.from_pretrained(args.checkpoint, device=args.device, dtype=args.dtype,
                                       expert_threads=args.threads, expert_quant=args.expert_quant,
                                       dense_quant=args.dense_quant,
                                       config=EngineConfig(max_num_seqs=args.streams))
    torch.manual_seed(0)
    vocab = engine.model.cfg.vocab_size
    serial = itertools.count()

    def add(n: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for _ in range(n):
            engine.add_request(f"r{next(serial)}", torch.randint(10, vocab - 10, (args.prompt_len,)).tolist(), params)

    def prefill() -> float:
        add(args.streams, 1)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    def decode() -> float:
        for _ in range(DECODE_STEPS):  # the decoding batch's own prefill and first steps, untimed
            engine.step()
        start = time.perf_counter()
        for _ in range(DECODE_STEPS):
            engine.step()
        return (time.perf_counter() - start) / DECODE_STEPS

    for c in settings:  # warm-up: every setting once
        use_chunks(kernel, c, default_bytes)
        prefill()
    times = {c: {"prefill": [], "decode": []} for c in settings}
    for _ in range(args.rounds):
        for c in settings:
            use_chunks(kernel, c, default_bytes)
            times[c]["prefill"].append(prefill())
            add(args.streams, 2 * DECODE_STEPS + 1)
            times[c]["decode"].append(decode())
            while engine.has_unfinished_requests():  # the batch finishes its last token
                engine.step()
    base = settings[0]
    print(f"{args.expert_quant} experts, {args.dense_quant} dense, {args.threads} threads, {args.streams} streams, "
          f"{args.rounds} rounds, {args.device}; load average {os.getloadavg()[0]:.1f}; "
          f"default chunk bytes {default_bytes}")
    for c in settings:
        row = []
        for phase, unit in (("prefill", "ms"), ("decode", "ms a step")):
            ms = statistics.median(times[c][phase]) * 1e3
            ratio = statistics.median(a / b for a, b in zip(times[c][phase], times[base][phase]))
            row.append(f"{phase} {ms:7.1f} {unit} ({ratio:.3f}x)")
        print(f"  {c:>12} (chunks a thread[:bytes]): " + ", ".join(row), flush=True)


def use_chunks(kernel, setting: str, default_bytes: int) -> None:
    """Sets the kernel's chunking to `setting`: chunks a thread, and after a colon the fewest bytes
    a chunk reads (left out: `default_bytes`)."""
    chunks, _, floor = setting.partition(":")
    kernel.set_chunks_per_thread(int(chunks))
    kernel.set_chunk_bytes(int(floor) if floor else default_bytes)


if __name__ == "__main__":
    main()
