"""What a structured output costs a sampling step: the greedy step of a batch whose every row holds
a JSON schema (`tandem.engine.structured`: llguidance's masks computed, unpacked and applied, then
the matchers advanced) against the same step unconstrained, timed in one process on the same logits.

    python benchmarks/structured.py [--threads N] [--batches 1,8,32] [--vocabs 32000,152064]

No download: the tokenizer is a byte-level BPE trained here, to the vocabulary size asked, on the
Python standard library's sources (llguidance's cost follows the vocabulary and its token trie).
Each row's matcher stands inside a JSON string (where most tokens are allowed: the widest mask) or
between the schema's fields (few allowed). Prints the schema's compile time, first and cached;
then ms per step (best of 5) and the ratio; then the mask's application alone, as the engine adds
it and as a masked_fill of the mask unpacked to bools.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
STATES = {"in a string": '{"name":"Ada Love', "between fields": '{"name":"Ada","age":36'}


def best_ms(fn, repeat: int = 5) -> float:
    from tandem.bench import best_seconds

    return best_seconds(fn, repeat) * 1e3


def tokenizer_of(vocab: int):
    """A byte-level BPE `tokenizers.Tokenizer` of `vocab` tokens, trained on this Python's standard
    library sources (code and English, as a model's vocabulary holds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            try:
                yield path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):  # a few test files are other encodings on purpose
                continue

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(texts(), trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=alphabet,
                                                         show_progress=False))
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--vocabs", default="32000,152064")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from tandem.engine import structured
    from tandem.engine.sampler import Sampler
    from tandem.engine.sampling_params import SamplingParams, StructuredOutputs

    print(f"{args.threads} threads")
    greedy = SamplingParams(temperature=0)
    for vocab in (int(v) for v in args.vocabs.split(",")):
        tok = tokenizer_of(vocab)
        grammars = structured.Grammars(tok, vocab, [0])
        constraint = StructuredOutputs(json=json.dumps(SCHEMA))
        started = time.perf_counter()
        grammars.compile(constraint)
        first = time.perf_counter() - started
        started = time.perf_counter()
        grammars.compile(constraint)
        print(f"V {vocab}: schema compiled in {first * 1e3:.0f} ms (the tokenizer's first use included), "
              f"{(time.perf_counter() - started) * 1e3:.2f} ms cached")
        for state, prefix in STATES.items():
            for batch in (int(b) for b in args.batches.split(",")):
                logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 3
                rows = []
                for _ in range(batch):
                    c = grammars.compile(constraint)
                    assert c.matcher.consume_tokens(tok.encode(prefix).ids), c.matcher.get_error()
                    rows.append(c)
                sampler, params, gens = Sampler(), [greedy] * batch, [None] * batch
                base = best_ms(lambda: sampler.sample(logits, params, gens))

                def constrained():
                    tokens = sampler.sample(structured.mask_logits(logits, rows), params, gens)
                    structured.advance(rows, tokens.tolist())
                    for c in rows:  # back to the same state for the next round
                        c.matcher.rollback(1)
                        c.consumed, c.completed_at = c.consumed - 1, None

                now = best_ms(constrained)
                print(f"V {vocab} B {batch} {state}: unconstrained {base:.2f} ms, JSON schema {now:.2f} ms: "
                      f"{now / base:.1f}x, +{(now - base) / batch:.3f} ms a row")
        applying(vocab, [int(b) for b in args.batches.split(",")])


def applying(vocab: int, batches: list[int]) -> None:
    """The mask's application alone: the per-byte bias lookup structured.mask_logits adds, against
    the mask unpacked to bools and masked_fill (round twenty-four's baseline), on random masks."""
    from tandem.engine import structured

    words = (vocab + 31) // 32
    bits = torch.arange(32, dtype=torch.int32)
    for batch in batches:
        bitmask = torch.randint(-(1 << 31), (1 << 31) - 1, (batch, words), dtype=torch.int32,
                                generator=torch.Generator().manual_seed(1))
        logits = torch.randn(batch, vocab)

        def masked_fill():
            allowed = ((bitmask[:, :, None] >> bits) & 1).view(batch, words * 32)[:, :vocab].bool()
            return logits.masked_fill(~allowed, float("-inf"))

        def biases():
            table = structured._byte_biases(logits)
            bias = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), table)
            return logits + bias.view(batch, words * 32)[:, :vocab]

        assert torch.equal(masked_fill(), biases())
        base, now = best_ms(masked_fill), best_ms(biases)
        print(f"V {vocab} B {batch} applying a mask: masked_fill {base:.2f} ms, byte biases {now:.2f} ms: "
              f"{base / now:.1f}x")


if __name__ == "__main__":
    main()
