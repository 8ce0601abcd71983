"""What streaming text costs a token as the output grows: the engine's IncrementalDetokenizer
(tokenizers' DecodeStream, each token decoded once) against the baseline it replaced, which
decoded the whole output again at every token, in the same process on the demo tokenizer.

    python benchmarks/detokenize.py [--lengths 128,1024,8192] [--stop "never here"]

Prints, at each output length, the microseconds a token costs over the last 128 tokens before that
length, for both, and their ratio. It runs on the engine loop's thread, once per running sequence
per step, so it adds to every step's latency.
"""

from __future__ import annotations

import argparse
import time

from tandem.demo import train_tokenizer
from tandem.engine.detokenizer import IncrementalDetokenizer

WINDOW = 128


class WholeOutputDecode:
    """The baseline: decode context + output at every token and slice the new text off."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer, self.context, self.ids = tokenizer, prompt_ids[-4:], []
        self.context_len = len(tokenizer.decode(self.context, skip_special_tokens=True))
        self.emitted = 0

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        text = self.tokenizer.decode(self.context + self.ids, skip_special_tokens=True)[self.context_len:]
        end = len(text.rstrip("\ufffd"))
        delta, self.emitted = text[self.emitted:end], max(self.emitted, end)
        return delta


def per_token_us(detok, ids: list[int], lengths: list[int]) -> dict[int, float]:
    """Microseconds a token over the WINDOW tokens before each length."""
    out, done = {}, 0
    for length in lengths:
        for token in ids[done:length - WINDOW]:
            detok.add([token])
        start = time.perf_counter()
        for token in ids[length - WINDOW:length]:
            detok.add([token])
        out[length] = (time.perf_counter() - start) / WINDOW * 1e6
        done = length
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="128,1024,8192")
    ap.add_argument("--stop", action="append", default=[], help="stop strings (held back text, searched)")
    args = ap.parse_args()
    lengths = sorted(int(n) for n in args.lengths.split(","))
    tok = train_tokenizer()
    text = "The expert said the GPU runs attention and the CPU socket runs the routed experts. "
    ids = tok.encode(text * (lengths[-1] // 8 + 1)).ids[:lengths[-1] + 4]
    prompt, output = ids[:4], ids[4:]
    new = per_token_us(IncrementalDetokenizer(tok, prompt, tuple(args.stop)), output, lengths)
    old = per_token_us(WholeOutputDecode(tok, prompt), output, lengths)
    print(f"{'output tokens':>13} {'whole decode us':>16} {'DecodeStream us':>16} {'ratio':>7}")
    for n in lengths:
        print(f"{n:>13} {old[n]:>16.1f} {new[n]:>16.1f} {old[n] / new[n]:>6.0f}x")


if __name__ == "__main__":
    main()
