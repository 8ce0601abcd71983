"""Paged decode attention on the CPU: the native kernel against the torch path it replaced.

    python benchmarks/decode_attention.py [--contexts 64,512,4096] [--heads 32] [--kv-heads 8] [--head-dim 128]
                                          [--value-dim D] [--threads 1,2] [--batch 1] [--cold] [--rounds 7]
                                          [--kv-dtypes float32,bfloat16,fp8] [--baseline REV] [--json out.json]
    # DeepSeek-V3's latent cache: 128 absorbed query heads on one 576-wide entry, value its first 512
    python benchmarks/decode_attention.py --heads 128 --kv-heads 1 --head-dim 576 --value-dim 512

One decode query per sequence over a shuffled block table (block size 16), float32 by default, as an
offloaded long-context sequence meets it on the CPU tier. --kv-dtypes times the caches in each of
the dtypes given, in one run: float32, bfloat16 (a bfloat16 query) and fp8 (`--kv-cache-dtype fp8`:
e4m3 blocks with scales, a float32 query, as the native decode layer sends it). `torch` is `sdpa_paged_attention`
(gather the blocks into a contiguous copy, then SDPA, or two batched GEMMs when all query heads
share one KV head); `native` is torch.ops.tandem.paged_decode_attention (reads K and V in
place). `paged_attention` picks native up to 16 query heads per KV head. Also prints the KV bytes
each call must read, the GB/s that makes, and the native kernel's ns per (query head, token).

With --device cuda the same comparison runs on the GPU, `native` then being the Triton decode
kernel (tandem.kv.triton_attention) that CUDA graphs capture, bfloat16 as served there:

    python benchmarks/decode_attention.py --device cuda --heads 128 --kv-heads 1 --head-dim 576 \
        --value-dim 512 --batch 8 --contexts 512,4096,16384

--baseline REV also times the native kernel as git revision REV has it and as the working tree has
it, each one's paged_attention.cpp and headers built alone as an op library, so
both run in one process, alternating with the others: before and after a kernel change, under the
same load, built alike (with the torch path between them, float32 KV in the whole extension measured
10-20% slower than the same sources built alone, bfloat16 alike: compare the two built alike).

Each figure is the median over --rounds rounds (torch and native alternate round by round) of
the mean call in a round. By default the same KV is read every call, so short contexts stay in
cache (each round starts with an untimed call); --cold gives every call another sequence's blocks
from a pool of at least 512 MB, so the KV comes from RAM, as it does in serving, where a step
reads every layer's KV once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from tandem.kv.attention import AttentionMetadata, native_decode_attention, sdpa_paged_attention

BS = 16


def timed(fns: list, reps: int, rounds: int, sync=lambda: None, warm: bool = False) -> list[float]:
    """Seconds a call of each fn (fn(i) is call i), the median of `rounds` rounds that alternate the fns;
    `sync` waits for the device's queued work before the clock is read. The order turns round by round:
    on the CPU, the kernel timed right after the torch path ran up to 1.3x slower than the one after it,
    even after an untimed call (2 vCPUs of Zen 1). `warm`: each round of a fn starts with an untimed
    call, so that one reading the same data every call finds its own in cache, not the last fn's."""
    for fn in fns:
        fn(0)
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for j in range(len(fns)):
            fn, t = fns[(j + r) % len(fns)], times[(j + r) % len(fns)]
            if warm:
                fn(0)
            sync()
            start = time.perf_counter()
            for i in range(reps):
                fn(i)
            sync()
            t.append((time.perf_counter() - start) / reps)
    return [statistics.median(t) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="64,512,4096")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--value-dim", type=int, help="narrower values as a view of the keys (a latent cache)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", default="2", help="thread counts, comma-separated")
    ap.add_argument("--cold", action="store_true", help="KV from RAM: every call reads other blocks")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--kv-dtypes", help="KV cache dtypes, comma-separated, from float32, bfloat16, fp8 "
                                        "(default: float32 on the CPU, bfloat16 on CUDA)")
    ap.add_argument("--baseline", metavar="REV",
                    help="also time the CPU kernel of this git revision and of the working tree, built alike")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.device == "cuda":
        from tandem.kv.triton_attention import paged_decode_attention as kernel
    else:
        kernel = native_decode_attention()
        if kernel is None:
            raise SystemExit("the native kernel is not built (python -m tandem.experts.build)")
    if args.baseline and args.device != "cpu":
        raise SystemExit("--baseline times the CPU kernel: leave out --device cuda")
    revisions = (op_library(args.baseline), op_library(None)) if args.baseline else ()
    names = (args.kv_dtypes or ("bfloat16" if args.device == "cuda" else "float32")).split(",")
    unknown = set(names) - set(KV_DTYPES)
    if unknown:
        raise SystemExit(f"--kv-dtypes: unknown {', '.join(sorted(unknown))}; choose from {', '.join(KV_DTYPES)}")
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for ctx in (int(c) for c in args.contexts.split(",")):
            for name in names:
                rows.append(measure(kernel, ctx, threads, name, args, revisions))
    print(f"load average {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


# cache dtype, query dtype
KV_DTYPES = {"float32": (torch.float32, torch.float32), "bfloat16": (torch.bfloat16, torch.bfloat16),
             "fp8": (torch.float8_e4m3fn, torch.float32)}
FP8_SCALES = (0.5, 2.0)  # k_scale, v_scale: not 1, so the folded scales cost what they cost


def op_library(rev: str | None):
    """paged_decode_attention as git revision `rev` (None: the working tree) has it, its attention sources
    built alone as an op library: two revisions built alike run in one process."""
    csrc = Path(__file__).parent.parent / "services/tandem/experts/csrc"
    if rev is None:
        sources = {path.name: path.read_text() for path in [csrc / "paged_attention.cpp", *sorted(csrc.glob("*.h"))]}
    else:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], check=True, capture_output=True, text=True, cwd=csrc).stdout

        listed = git("ls-tree", "--name-only", "--full-tree", rev, "services/tandem/experts/csrc/").split()
        names = ["paged_attention.cpp", *(Path(path).name for path in listed if path.endswith(".h"))]
        sources = {name: git("show", f"{rev}:services/tandem/experts/csrc/{name}") for name in names}
    namespace = "tandem_tree" if rev is None else "tandem_baseline"
    sources["paged_attention.cpp"] = sources["paged_attention.cpp"].replace(
        "TORCH_LIBRARY_FRAGMENT(tandem, m)", f"TORCH_LIBRARY_FRAGMENT({namespace}, m)")
    digest = hashlib.sha256("".join(sources.values()).encode()).hexdigest()[:16]
    build = Path(tempfile.gettempdir()) / f"tandem-attention-{digest}"
    build.mkdir(exist_ok=True)
    for name, text in sources.items():
        (build / name).write_text(text)
    from torch.utils.cpp_extension import load

    load(name=f"tandem_attention_{digest}", sources=[str(build / "paged_attention.cpp")],
         extra_include_paths=[str(build)], extra_cflags=["-O3", "-fopenmp", "-ffp-contract=fast"],
         extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False)
    return getattr(torch.ops, namespace).paged_decode_attention


def measure(kernel, ctx: int, threads: int, kv_dtype: str, args, revisions: tuple = ()) -> dict:
    per_seq = -(-ctx // BS)
    device = torch.device(args.device)
    dtype, q_dtype = KV_DTYPES[kv_dtype]
    if device.type == "cuda" and q_dtype == torch.float32:
        q_dtype = torch.bfloat16  # as served there
    scales = FP8_SCALES if dtype == torch.float8_e4m3fn else (1.0, 1.0)
    kv_bytes = (1 if args.value_dim else 2) * args.batch * ctx * args.kv_heads * args.head_dim * dtype.itemsize
    sets = min(256, -(-512_000_000 // kv_bytes)) if args.cold else 1  # sets of sequences, one a call
    blocks = per_seq * args.batch * sets
    perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).tolist()
    k = torch.randn(blocks, BS, args.kv_heads, args.head_dim, device=device).to(dtype)
    v = (k[..., :args.value_dim] if args.value_dim
         else torch.randn(blocks, BS, args.kv_heads, args.head_dim, device=device).to(dtype))
    q = torch.randn(args.batch, args.heads, args.head_dim, dtype=q_dtype, device=device)
    metas = []
    for s in range(sets):
        tables = [perm[(s * args.batch + i) * per_seq:(s * args.batch + i + 1) * per_seq] for i in range(args.batch)]
        metas.append(AttentionMetadata.build([ctx - 1] * args.batch, [1] * args.batch, tables, BS, device))
    reps = max(sets, 5, 20000 // ctx)
    fns = [lambda i: sdpa_paged_attention(q, k, v, metas[i % sets], 0.1, *scales)]
    for op in [kernel, *revisions]:
        fns.append(lambda i, op=op: op(q, k, v, metas[i % sets].block_tables, metas[i % sets].seq_lens, 0.1, 0,
                                      k_scale=scales[0], v_scale=scales[1]))
    t_torch, t_native, *t_revisions = timed(fns, reps, args.rounds,
                                           torch.cuda.synchronize if device.type == "cuda" else lambda: None,
                                           warm=not args.cold)
    row = {"context": ctx, "threads": threads, "kv_dtype": kv_dtype, "device": args.device, "cold": args.cold,
           "torch_us": t_torch * 1e6,
           "native_us": t_native * 1e6, "speedup": t_torch / t_native, "kv_mb": kv_bytes / 1e6,
           "native_gb_s": kv_bytes / t_native / 1e9,
           "native_ns_per_head_token": t_native * 1e9 / (args.batch * args.heads * ctx)}
    before = ""
    if t_revisions:
        row["baseline_us"], row["tree_us"] = (t * 1e6 for t in t_revisions)
        before = (f"  baseline {row['baseline_us']:8.1f} us, this tree built alike {row['tree_us']:8.1f} us "
                  f"({t_revisions[0] / t_revisions[1]:.2f}x)")
    print(f"threads {threads} context {ctx:6d} {kv_dtype:>8}: torch {row['torch_us']:9.0f} us  "
          f"native {row['native_us']:8.1f} us  "
          f"{row['speedup']:.1f}x  ({row['kv_mb']:.1f} MB of KV, {row['native_gb_s']:.1f} GB/s, "
          f"{row['native_ns_per_head_token']:.2f} ns per head and token){before}")
    return row


if __name__ == "__main__":
    main()
