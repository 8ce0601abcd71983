"""DevicePrefill: large prefill chunks' routed experts computed where the hidden states are, the
weights copied there a few experts ahead. On the CPU the copies are no-ops, which checks the
grouping and the pipeline's bookkeeping against the torch reference executor; the streamed CUDA
path runs in tests/engine/test_cuda_graphs.py on a GPU machine."""

from __future__ import annotations

import pytest
import torch

from test_experts_cpu import batch, dequantized_reference, layers, rel_err  # noqa: F401 (layers is a fixture)

from tandem.experts.cpu_executor import CpuExpertExecutor
from tandem.experts.device_prefill import DevicePrefill
from tandem.experts.torch_executor import TorchExpertExecutor


@pytest.mark.parametrize("ahead", [1, 3, 16])
@pytest.mark.parametrize("tokens", [16, 61])
def test_large_chunks_match_the_reference_executor(layers, ahead, tokens):  # noqa: F811
    device_path = DevicePrefill(CpuExpertExecutor(layers, kernel="torch", threads=1), torch.device("cpu"),
                                min_tokens=16, ahead=ahead)
    reference = TorchExpertExecutor(layers)
    for layer in (3, 5):
        hidden, ids, weights = batch(tokens, seed=layer)
        got = device_path.forward_on_device(layer, hidden, ids, weights)
        assert got is not None and got.shape == hidden.shape and got.dtype == hidden.dtype
        assert rel_err(got, reference.forward(layer, hidden, ids, weights)) < 1e-5
    assert device_path.calls == 2


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_experts_are_copied_as_stored_and_dequantized_there(layers, quant, monkeypatch):  # noqa: F811
    # What the CPU executor computes with: its quantized weights, dequantized (tandem.experts.quant).
    cpu = CpuExpertExecutor(layers, quant=quant, kernel="torch", threads=1)
    device_path = DevicePrefill(cpu, torch.device("cpu"), min_tokens=16, ahead=2)
    moved, to = [], torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **kw: moved.append(t.dtype) or to(t, *a, **kw))
    for layer in (3, 5):
        hidden, ids, weights = batch(40, seed=layer)
        got = device_path.forward_on_device(layer, hidden, ids, weights)
        assert got is not None and got.dtype == hidden.dtype
        assert rel_err(got, dequantized_reference(cpu, layer).forward(layer, hidden, ids, weights)) < 1e-5
    # the stored codes were moved, not dequantized floats: int8 rows, or int4's packed bytes
    assert (torch.int8 if quant == "int8" else torch.uint8) in moved
    assert device_path.calls == 2


def test_small_chunks_and_other_layers_stay_on_the_cpu(layers):  # noqa: F811
    hidden, ids, weights = batch(8)
    floats = DevicePrefill(CpuExpertExecutor(layers, kernel="torch", threads=1), torch.device("cpu"), min_tokens=9)
    assert floats.forward_on_device(3, hidden, ids, weights) is None  # below min_tokens
    assert floats.forward_on_device(4, *batch(20)) is None  # a layer with no routed experts here
    # what declines goes to the CPU executor, unchanged
    torch.testing.assert_close(floats.forward(3, hidden, ids, weights), floats.inner.forward(3, hidden, ids, weights))


def test_bad_settings_are_refused(layers):  # noqa: F811
    with pytest.raises(ValueError, match="at least 1"):
        DevicePrefill(CpuExpertExecutor(layers, kernel="torch", threads=1), torch.device("cpu"), min_tokens=0)


def test_the_engine_wraps_each_executor_once(demo_model_dir, monkeypatch):
    # The layers share one CPU executor; a wrapper per layer would page-lock the same memory again
    # (cudaErrorHostMemoryAlreadyRegistered, reported by the next kernel launch).
    from tandem.engine import llm_engine

    made = []
    monkeypatch.setattr(llm_engine, "DevicePrefill", lambda *a, **kw: made.append(kw) or DevicePrefill(*a, **kw))
    engine = llm_engine.LLMEngine.from_pretrained(demo_model_dir("mixtral"), device="cpu",
                                                  config=llm_engine.EngineConfig())
    layers = engine.model.model.layers
    llm_engine.stream_prefill_experts(engine.model, torch.device("cpu"), 8, pin=True)
    assert len(layers) > 1 and made == [{"pin": True}]
    [wrapper] = {id(layer.mlp.executor): layer.mlp.executor for layer in layers}.values()
    assert isinstance(wrapper, DevicePrefill) and not wrapper.pinned  # nothing to page-lock off CUDA
