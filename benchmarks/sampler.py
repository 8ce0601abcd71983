"""A sampling step's top-k / top-p cut: the sort of the whole vocabulary (the baseline, before round
twenty-two) against the cut among the most likely tokens (`tandem.engine.sampler`), timed in one
process on the same logits.

    python benchmarks/sampler.py [--threads N] [--batches 1,8,32] [--vocabs 32000,152064]

Logits are random normal times 3 (a peaked row, as a language model's are: top_p 0.9 falls within
the first thousand tokens). Prints ms per call (best of 5) and the ratio. Then the cost of the
repetition, presence and frequency penalties (a 512-token prompt, 256 tokens out) on a greedy
step, against the same step without them.
"""

from __future__ import annotations

import argparse

import torch


def best_ms(fn, repeat: int = 5) -> float:
    from tandem.bench import best_seconds

    return best_seconds(fn, repeat) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--vocabs", default="32000,152064")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from tandem.engine import sampler
    from tandem.engine.sampling_params import SamplingParams

    cases = {"top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
             "top_k 50, top_p 0.95": SamplingParams(temperature=0.8, top_k=50, top_p=0.95)}
    print(f"{args.threads} threads; candidates {sampler.CANDIDATES}")
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 3
            for name, params in cases.items():
                s = sampler.Sampler()
                ours = s.probs(logits, [params] * batch)
                candidates = sampler._cut_among_candidates
                sampler._cut_among_candidates = lambda *a: None  # the baseline: always the full sort
                base = best_ms(lambda: s.probs(logits, [params] * batch))
                # the same cut but for a boundary token the cumulative mass's rounding may flip
                torch.testing.assert_close(s.probs(logits, [params] * batch), ours, rtol=0, atol=1e-3)
                sampler._cut_among_candidates = candidates
                now = best_ms(lambda: s.probs(logits, [params] * batch))
                print(f"V {vocab} B {batch} {name}: full sort {base:.2f} ms, candidates {now:.2f} ms: "
                      f"{base / now:.1f}x")
            penalties(vocab, batch)


def penalties(vocab: int, batch: int) -> None:
    from tandem.engine.sampler import Penalties, Sampler
    from tandem.engine.sampling_params import SamplingParams
    from tandem.engine.sequence import Sequence

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(batch, vocab, generator=g) * 3
    prompt, output = torch.randint(vocab, (512,), generator=g).tolist(), torch.randint(vocab, (256,), generator=g)

    def step(**params) -> float:
        seqs = [Sequence(f"r{i}", prompt, SamplingParams(temperature=0, **params)) for i in range(batch)]
        for s in seqs:
            s.output_token_ids = output.tolist()
        sampler, device = Sampler(), torch.device("cpu")
        return best_ms(lambda: sampler.sample(logits, [s.params for s in seqs], [None] * batch,
                                              Penalties.of(seqs, device)))

    base = step()
    now = step(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.5)
    print(f"V {vocab} B {batch} greedy: plain {base:.2f} ms, with the three penalties {now:.2f} ms: "
          f"{now / base:.1f}x")


if __name__ == "__main__":
    main()
