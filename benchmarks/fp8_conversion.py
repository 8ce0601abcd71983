"""fp8 (e4m3) KV decode attention on CUDA: the GPU's own e4m3 conversion (sm_89 and later) against the
integer one every GPU runs, on the same caches in the same process (tandem.kv.triton_attention).

    python benchmarks/fp8_conversion.py
"""

from __future__ import annotations

import argparse

import torch
import triton

from tandem.kv import fp8, triton_attention

SHAPES = [(128, 1, 576, 512, 1), (128, 1, 576, 512, 8), (32, 8, 128, 128, 8)]  # heads, KV heads, D, Dv, batch


def case(heads, kv_heads, d, dv, batch, ctx, block_size=16):
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks = batch * ctx // block_size
    k = fp8.quantize(torch.randn(blocks, block_size, kv_heads, d, device="cuda", generator=g), 0.05)
    v = k[..., :dv] if dv < d else fp8.quantize(torch.randn(blocks, block_size, kv_heads, dv, device="cuda",
                                                            generator=g), 0.05)
    q = torch.randn(batch, heads, d, device="cuda", generator=g).bfloat16()
    tables = torch.randperm(blocks, device="cuda", generator=g).view(batch, -1)
    lens = torch.full((batch,), ctx, device="cuda")
    return lambda: triton_attention.paged_decode_attention(q, k, v, tables, lens, d ** -0.5, k_scale=0.05,
                                                           v_scale=0.05)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="4096,16384")
    args = p.parse_args()
    native = triton_attention.native_fp8
    if not native(torch.device("cuda")):
        raise SystemExit("this GPU has no e4m3 conversion of its own (compute capability 8.9 and later)")
    for heads, kv_heads, d, dv, batch in SHAPES:
        for ctx in map(int, args.contexts.split(",")):
            run = case(heads, kv_heads, d, dv, batch, ctx)
            times, outs = [], []
            for conversion in (lambda device: False, native):
                triton_attention.native_fp8 = conversion
                outs.append(run().float())
                times.append(triton.testing.do_bench(run, warmup=20, rep=200) * 1000)
            triton_attention.native_fp8 = native
            print(f"{heads} heads on {kv_heads}, D {d}, batch {batch}, {ctx} keys: integer {times[0]:7.1f} us, "
                  f"native {times[1]:7.1f} us, {times[0] / times[1]:.2f}x, outputs equal: {torch.equal(*outs)}",
                  flush=True)


if __name__ == "__main__":
    main()
