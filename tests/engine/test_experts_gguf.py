"""Q8_0 expert tensors from a GGUF file (written here by the gguf package's own writer from a
random checkpoint) into the executor's int8 format."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tandem.experts.base import ExpertWeights
from tandem.experts.factory import make_expert_executor
from tandem.experts.gguf_q8 import load_q8_0_experts, q8_0_to_int8
from tandem.experts.torch_executor import TorchExpertExecutor

Q8_0 = gguf.GGMLQuantizationType.Q8_0
E, H, I, K = 4, 128, 96, 2


def rel_err(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def checkpoint():
    """layer -> (gate [E, I, H], up [E, I, H], down [E, H, I]) float32, as a model's experts."""
    g = torch.Generator().manual_seed(0)
    return {layer: (torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5,
                    torch.randn(E, H, I, generator=g) / I**0.5) for layer in (0, 1)}


def write_gguf(path, checkpoint, qtype=Q8_0, skip: str = ""):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(len(checkpoint))
    writer.add_expert_count(E)
    for layer, tensors in checkpoint.items():
        for name, w in zip(("gate", "up", "down"), tensors):
            if name == skip:
                continue
            data = w.numpy()
            if qtype == Q8_0:
                writer.add_tensor(f"blk.{layer}.ffn_{name}_exps.weight", gguf.quants.quantize(data, Q8_0),
                                  raw_dtype=Q8_0)
            else:
                writer.add_tensor(f"blk.{layer}.ffn_{name}_exps.weight", data)
    writer.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))  # not an expert: ignored
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_q8_0_experts_compute_what_the_float_checkpoint_does(tmp_path, checkpoint):
    layers = load_q8_0_experts(write_gguf(tmp_path / "m.gguf", checkpoint))
    assert sorted(layers) == [0, 1] and layers[0].gate_up.shape == (E, 2 * I, H)
    assert layers[0].gate_up.q.dtype == torch.int8 and layers[0].down.shape == (E, H, I)
    ex = make_expert_executor(layers, quant="int8", threads=1)
    exact = TorchExpertExecutor({layer: ExpertWeights(torch.cat([g, u], dim=1), d)
                                 for layer, (g, u, d) in checkpoint.items()})
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(5)])
    weights = torch.full((5, K), 0.5)
    for layer in (0, 1):
        # Q8_0 (~0.5%), requantized per row (~0.6% more), Q8 activations (~0.5%): under 2.5%
        err = rel_err(ex.forward(layer, hidden, ids, weights), exact.forward(layer, hidden, ids, weights))
        assert 0 < err < 0.025


def test_requantized_rows_stay_within_half_a_step_of_q8_0():
    w = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(2)).numpy()
    blocks = gguf.quants.quantize(w, Q8_0)
    q8 = torch.from_numpy(gguf.quants.dequantize(blocks, Q8_0))  # [2, 8, 64]
    int8 = q8_0_to_int8(blocks)
    deq = int8.q.float() * int8.scale[..., None]
    assert ((deq - q8).abs() <= int8.scale[..., None] / 2 + 1e-6).all()
    assert int8.q.abs().amax(dim=-1).eq(127).all()  # each row's largest weight uses the full range


def test_other_types_missing_tensors_and_non_gguf_files_are_refused(tmp_path, checkpoint):
    with pytest.raises(ValueError, match="only Q8_0"):
        load_q8_0_experts(write_gguf(tmp_path / "f32.gguf", checkpoint, qtype=None))
    with pytest.raises(ValueError, match="no ffn_up_exps"):
        load_q8_0_experts(write_gguf(tmp_path / "noup.gguf", checkpoint, skip="up"))
    with pytest.raises(ValueError, match="is not a file"):
        load_q8_0_experts(tmp_path / "absent.gguf")


def test_int8_weights_need_int8_quant(tmp_path, checkpoint):
    layers = load_q8_0_experts(write_gguf(tmp_path / "m.gguf", checkpoint))
    with pytest.raises(ValueError, match="need quant='int8'"):
        make_expert_executor(layers, quant="none", threads=1)
