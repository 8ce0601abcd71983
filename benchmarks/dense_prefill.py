"""An int8 dense layer's prefill GEMM: the weight dequantized whole (the baseline, as before round
twenty-two) against `Int8Kernel`'s blocks of rows, timed in one process, with the float32 bytes
each holds at once.

    python benchmarks/dense_prefill.py [--threads N] [--shapes N:K:T,...] [--against-native]

Prints ms per call (best of 5) for each shape and the ratio baseline / blocks. --against-native
times the native kernel on the same batches too (what `PREFILL_TOKENS` chooses between).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

# The comparison checkpoint's LM head and attention projection, a 4096-wide model's projection at two
# prompt lengths, and a 32k-token vocabulary's LM head under a batch of 64 sequences.
SHAPES = "8000:1024:64,3072:1024:256,4096:4096:64,4096:4096:512,32000:4096:64"


def best_ms(fn, repeat: int = 5) -> float:
    from tandem.bench import best_seconds

    return best_seconds(fn, repeat) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--shapes", default=SHAPES, help="N:K:T (output features, input features, tokens), comma-separated")
    ap.add_argument("--against-native", action="store_true", help="time the native kernel on each batch too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from tandem.model import quant_linear
    from tandem.model.quant_linear import Int8Linear

    print(f"{args.threads} threads; blocks of {quant_linear.DEQUANT_BYTES >> 20} MiB of float32 rows")
    for shape in args.shapes.split(","):
        n, k, t = (int(v) for v in shape.split(":"))
        layer = Int8Linear(nn.Linear(k, n, bias=False))
        q, scale = layer.kernel.q, layer.kernel.scale
        x = torch.randn(t, k)

        def whole():
            return F.linear(x, q.float() * scale[:, None])

        layer.kernel.prefill_tokens = 0  # every batch to the GEMM
        torch.testing.assert_close(layer(x), whole(), rtol=1e-4, atol=1e-3)
        base, blocks = best_ms(whole), best_ms(lambda: layer(x))
        if args.against_native:
            layer.kernel.prefill_tokens = t
            kernel = best_ms(lambda: layer(x))
        rows = max(8, quant_linear.DEQUANT_BYTES // (4 * k))
        print(f"N {n} K {k} T {t}: whole {base:.1f} ms ({2 * n * k * 4 >> 20} MiB at once), "
              f"blocks {blocks:.1f} ms ({min(n, rows) * k * 4 >> 20} MiB): {base / blocks:.2f}x"
              + (f"; native kernel {kernel:.1f} ms, blocks / kernel {blocks / kernel:.2f}" if args.against_native else ""))


if __name__ == "__main__":
    main()
