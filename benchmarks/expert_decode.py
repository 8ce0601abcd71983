"""Expert decode bandwidth: GB/s of expert weights streamed per batch-1 step, per storage and kernel.

Decode reads each touched expert's weights from RAM once per step, so the figure of merit is
bytes of weights read per second against the machine's read bandwidth (torch `sum` over
1 GiB). The working set of every format is sized well past the last-level cache and the
routing walks every expert before coming back to one, so no step is served from cache.

    python benchmarks/expert_decode.py                 # Mixtral-like shape, ~1 GiB per format
    python benchmarks/expert_decode.py --quick         # a small shape, for a smoke run
    python benchmarks/expert_decode.py --json out.json
    python benchmarks/expert_decode.py --kernels native --direct   # the kernel without the executor's Python
    python benchmarks/expert_decode.py --kernels native --direct --formats int4,int8
    python benchmarks/expert_decode.py --kernels native --direct --formats int4,int4-fp16  # AVX2's integer scales
    python benchmarks/expert_decode.py --kernels native --direct --isa avx2,avx512   # each instruction set

Not a test: it prints a table (and optionally JSON) for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F

from tandem.bench import measure_read_bandwidth
from tandem.experts.base import ExpertWeights
from tandem.experts.cpu_executor import CpuExpertExecutor, prepare_layer
from tandem.experts.native import load_kernel
from tandem.experts.quant import Int4Weight, Int8Weight
from tandem.experts.torch_kernels import decode_linear, prefill_linear

FORMATS = [  # (label, weights dtype, quant)
    ("f32", torch.float32, "none"),
    ("bf16", torch.bfloat16, "none"),
    ("int8", torch.float32, "int8"),
    ("int4", torch.float32, "int4"),  # the executor's storage: integer scales where its kernel runs AVX2
    ("int4-fp16", torch.float32, "int4"),  # int4 with fp16 scales, as stored before integer scales
]


def clone_stored(w):
    if isinstance(w, Int8Weight):
        return Int8Weight(w.q.clone(), w.scale.clone())
    if isinstance(w, Int4Weight):
        return Int4Weight(w.packed.clone(), w.scale.clone(), w.min.clone(), w.group_size)
    return w.clone()


def build_executor(base: ExpertWeights, dtype, quant: str, kernel: str, working_set: int, threads: int,
                   fp16_scales: bool = False):
    """An executor whose layers are copies of one prepared layer, enough to fill `working_set` bytes."""
    ex = CpuExpertExecutor({}, threads=threads, quant=quant, kernel=kernel)
    src = ExpertWeights(base.gate_up.to(dtype), base.down.to(dtype))
    first = prepare_layer(src, quant, torch_decode=ex.native is None,
                          integer_scales=ex._integer_scales() and not fp16_scales)
    per_layer = first.expert_nbytes * first.num_experts
    layers = max(2, math.ceil(working_set / per_layer))
    ex.layers[0] = first
    for i in range(1, layers):
        ex.layers[i] = _copy_layer(first)
    return ex


def _copy_layer(p):
    q = type(p)(clone_stored(p.gate_up), clone_stored(p.down), p.num_experts, p.hidden_size,
                p.intermediate_size, p.group_size)
    q.prefill = (prefill_linear(q.gate_up), prefill_linear(q.down))
    if p.decode:
        q.decode = (decode_linear(q.gate_up), decode_linear(q.down))
    return q


def decode_bandwidth(ex: CpuExpertExecutor, steps: int, top_k: int = 2, direct: bool = False) -> tuple[float, float]:
    """(GB/s of expert weights read, ms per layer call) over `steps` batch-1 calls.

    direct: call the native kernel itself with arguments made beforehand, as the native decode
    layer does, instead of the executor's forward (its checks and tensor conversions)."""
    layers = sorted(ex.layers)
    p = ex.layers[layers[0]]
    e = p.num_experts
    hidden = torch.randn(1, p.hidden_size)
    weights = torch.full((1, top_k), 1.0 / top_k)
    groups = e // top_k

    def group(step: int) -> int:  # layer-major walk over disjoint expert groups: every expert read once a cycle
        return (step // len(layers)) % groups

    if direct:
        args = {layer: ex.layers[layer].native_args() for layer in layers}
        out, scratch = torch.empty(1, p.hidden_size), torch.empty(top_k * p.intermediate_size)
        ids = [torch.arange(g * top_k, (g + 1) * top_k).reshape(1, top_k) for g in range(groups)]

        def call(step: int) -> None:
            layer = layers[step % len(layers)]
            ex.native.moe_forward(hidden, ids[group(step)], weights, p.kind, p.group_size, *args[layer], out, scratch)
    else:
        def call(step: int) -> None:
            g = group(step)
            ex.forward(layers[step % len(layers)], hidden, torch.arange(g * top_k, (g + 1) * top_k).reshape(1, top_k),
                       weights)

    for s in range(len(layers) * groups):  # warm-up: one full cycle
        call(s)
    start = time.perf_counter()
    for s in range(steps):
        call(s)
    elapsed = time.perf_counter() - start
    return steps * top_k * p.expert_nbytes / elapsed / 1e9, elapsed / steps * 1e3


def bare_gemv_bandwidth(n: int, k: int, dtype, repeats: int = 20) -> float:
    """F.linear batch-1 over a weight bigger than the cache: torch's own GEMV, for reference."""
    copies = max(2, math.ceil((512 << 20) / (n * k * torch.finfo(dtype).bits // 8)))
    ws = [torch.randn(n, k).to(dtype) for _ in range(copies)]
    x = torch.randn(1, k).to(dtype)
    for w in ws:
        F.linear(x, w)
    start = time.perf_counter()
    for r in range(repeats):
        F.linear(x, ws[r % copies])
    return repeats * ws[0].numel() * ws[0].element_size() / (time.perf_counter() - start) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--working-set-gib", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", default="native,torch")
    ap.add_argument("--formats", default=",".join(f[0] for f in FORMATS),
                    help="comma-separated: f32,bf16,int8,int4,int4-fp16 (int4 with fp16 scales)")
    ap.add_argument("--direct", action="store_true", help="native: call the kernel itself, not the executor")
    ap.add_argument("--quick", action="store_true", help="small shapes and few steps: a smoke run")
    ap.add_argument("--isa", default="", help="native: comma-separated instruction sets to run it at "
                    "(scalar, avx2, avx512, avx512bf16; default the best this CPU has)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.intermediate, args.working_set_gib, args.steps = 256, 512, 0.05, 20

    torch.set_num_threads(args.threads)
    bw = measure_read_bandwidth(size_bytes=256 << 20 if args.quick else 1 << 30)
    print(f"read bandwidth (torch sum, {args.threads} threads): {bw:.1f} GB/s; load average {os.getloadavg()[0]:.1f}")
    gemv = {} if args.quick else {
        "f32": bare_gemv_bandwidth(14336, 4096, torch.float32),
        "bf16": bare_gemv_bandwidth(14336, 4096, torch.bfloat16),
    }
    for name, v in gemv.items():
        print(f"bare F.linear GEMV 14336x4096 {name}: {v:.1f} GB/s ({v / bw:.0%})")

    g = torch.Generator().manual_seed(0)
    e, h, i = args.experts, args.hidden, args.intermediate
    base = ExpertWeights(torch.randn(e, 2 * i, h, generator=g) / h**0.5, torch.randn(e, h, i, generator=g) / i**0.5)
    rows = []
    print(f"{'format':9} {'kernel':7} {'GB/s':>6} {'roofline':>8} {'ms/layer':>9} {'MB/expert':>9}")
    for label, dtype, quant in [f for f in FORMATS if f[0] in args.formats.split(",")]:
        for kernel in args.kernels.split(","):
            ex = build_executor(base, dtype, quant, kernel, int(args.working_set_gib * (1 << 30)), args.threads,
                                fp16_scales=label == "int4-fp16")
            if ex.kernel != kernel:
                print(f"{label:9} {kernel:7} unavailable")
                continue
            module = load_kernel() if kernel == "native" else None
            best = module.isa() if module is not None else None
            for isa in (args.isa.split(",") if args.isa and module is not None else [best]):
                if module is not None:
                    module.set_isa(isa)
                name = kernel if isa == best and not args.isa else f"{kernel}/{isa}"
                gbs, ms = decode_bandwidth(ex, args.steps, direct=args.direct and kernel == "native")
                mb = ex.layers[0].expert_nbytes / 1e6
                rows.append({"format": label, "kernel": name, "gb_per_s": gbs, "roofline": gbs / bw,
                             "ms_per_layer": ms, "mb_per_expert": mb, "layers": len(ex.layers)})
                print(f"{label:9} {name:7} {gbs:6.1f} {gbs / bw:8.0%} {ms:9.3f} {mb:9.2f}")
            if module is not None:
                module.set_isa(best)
            del ex
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_average": os.getloadavg(), "read_bandwidth_gb_per_s": bw, "bare_gemv_gb_per_s": gemv, "threads": args.threads,
                       "shape": {"experts": e, "hidden": h, "intermediate": i}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
