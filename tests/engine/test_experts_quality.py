"""Quantized experts inside the whole model: greedy tokens agree with the unquantized model.

Agreement is measured with teacher forcing: at every position of the unquantized model's greedy
continuation, the quantized model is given the same prefix and must pick the same next token.
(Free-running comparison would let one early near-tie flip every later position.)
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.experts.factory import make_expert_executor
from tandem.experts.torch_executor import TorchExpertExecutor
from tandem.model.loader import load_expert_weights
from tandem.model.quant_linear import quantize_dense_

GEN = 12
PROMPTS = [[5, 17, 42, 9, 100, 3], [250, 7, 7, 81], [11, 12, 13, 14, 15, 16, 17, 18], [300, 2 + 1, 64, 128, 200]]


# A larger init spread than the default gives logits with real margins, as a trained model has.
QUALITY_MODEL = dict(arch="mixtral", initializer_range=0.2)


@pytest.fixture(scope="module")
def model_dir(demo_model_dir):
    return demo_model_dir(**QUALITY_MODEL)


def engine(model_dir, quant: str, dense_quant: str = "none") -> LLMEngine:
    eng = LLMEngine.from_pretrained(model_dir, device="cpu", dtype="float32", expert_quant=quant, expert_threads=2)
    quantize_dense_(eng.model, dense_quant)
    return eng


def greedy(eng: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in eng.generate(prompts, params)]


def teacher_forced_agreement(reference: LLMEngine, candidate: LLMEngine, prompts=PROMPTS, gen: int = GEN) -> float:
    """Share of the reference's greedy positions at which `candidate`, given the same prefix, picks
    the same next token."""
    continuations = greedy(reference, prompts, gen)
    forced = [p + ref[:i] for p, ref in zip(prompts, continuations) for i in range(gen)]
    got = [t[0] for t in greedy(candidate, forced, 1)]
    want = [ref[i] for ref in continuations for i in range(gen)]
    return sum(g == w for g, w in zip(got, want)) / len(want)


# int8 must meet the 95%. int4 on random Gaussian weights (14% error per MoE layer, see
# test_experts_cpu) flips many of this tiny random model's narrow margins, so its bar only says
# "mostly the same model": a broken int4 kernel agrees on ~1/vocab of positions.
@pytest.mark.parametrize("quant,min_agreement", [("int8", 0.95), ("int4", 0.5)])
def test_quantized_greedy_tokens_agree_with_unquantized(model_dir, quant, min_agreement):
    agreement = teacher_forced_agreement(engine(model_dir, "none"), engine(model_dir, quant))
    assert agreement >= min_agreement, f"{quant}: {agreement:.0%} of {len(PROMPTS) * GEN} positions agree"


def forced_against(eng, want_tokens: list[list[int]], prompts=PROMPTS, gen: int = GEN) -> tuple[float, torch.Tensor]:
    """Teacher forcing on a reference's greedy continuations: at each of their positions, the same
    prefix. (the share of positions whose greedy token is the reference's, the logits there
    [prompts * gen, V])."""
    logits = {}
    eng.runner.logits_hook = lambda rid, row: logits.setdefault(rid, row.clone())
    forced = [p + ref[:i] for p, ref in zip(prompts, want_tokens) for i in range(gen)]
    done = eng.generate(forced, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    agree = sum(c.token_ids[0] == t for c, t in zip(done, (t for ref in want_tokens for t in ref))) / len(done)
    return agree, torch.stack([logits[c.request_id] for c in done])


def transformers_logits(model_dir, prompts=PROMPTS, gen: int = GEN) -> tuple[list[list[int]], torch.Tensor]:
    """transformers' own greedy continuations of `prompts` and its logits at each of their positions."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=gen, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            logits.append(torch.stack([step[0] for step in out.logits]))  # [gen, V]
    return tokens, torch.cat(logits)  # [prompts * gen, V]


def test_int8_experts_against_transformers_tokens_and_logits(demo_model_dir):
    # The bar against transformers itself, with teacher forcing: the same greedy tokens and
    # logits within 0.5% of its own (relative norm over every position) on the default demo Mixtral,
    # whose margins int8 cannot flip (the wide model above flips routing: ~11% logits error there).
    # Measured: int8 0.13%, int4 2.4%, an int8 quantizer whose codes are 3% small 1.9%.
    path = demo_model_dir("mixtral")
    want_tokens, want_logits = transformers_logits(path)
    agree, got = forced_against(engine(path, "int8"), want_tokens)
    err = ((got - want_logits).norm() / want_logits.norm()).item()
    assert agree >= 0.95 and 0 < err < 5e-3, (agree, err)


def test_int8_expert_outputs_on_real_checkpoint_weights_are_close(model_dir):
    # The bound the token test rests on, on the checkpoint's own weights: per MoE layer, int8
    # experts stay within 3% (relative) of the float32 ones (see test_experts_cpu for why 3%).
    layers = load_expert_weights(model_dir, dtype=torch.float32)
    exact, int8 = TorchExpertExecutor(layers), make_expert_executor(layers, quant="int8", threads=2)
    g = torch.Generator().manual_seed(0)
    for layer, w in layers.items():
        hidden = torch.randn(8, w.gate_up.shape[2], generator=g)
        ids = torch.stack([torch.randperm(w.num_experts, generator=g)[:2] for _ in range(8)])
        weights = torch.full((8, 2), 0.5)
        want = exact.forward(layer, hidden, ids, weights)
        err = (int8.forward(layer, hidden, ids, weights) - want).norm() / want.norm()
        assert 0 < err < 0.03
