"""Loading routed experts layer by layer: each layer is stacked and quantized as soon as its last
tensor is read, so loading never holds the whole model's experts unquantized."""

from __future__ import annotations

import gc
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.experts import cpu_executor
from tandem.experts.base import ExpertWeights
from tandem.experts.cpu_executor import CpuExpertExecutor
from tandem.model import loader
from tandem.model.config import ModelError, load_config

LAYERS, EXPERTS, HIDDEN, INTER = 4, 8, 64, 96


@pytest.fixture
def mixtral(demo_model_dir):
    return demo_model_dir("mixtral", num_hidden_layers=LAYERS, intermediate_size=INTER)


def expert_name(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight"


def stacked_by_hand(model_dir) -> dict[int, ExpertWeights]:
    """Every layer's experts stacked at once, as the loader did before it streamed."""
    tensors = load_file(model_dir / "model.safetensors")

    def stack(layer, proj):
        return torch.stack([tensors[expert_name(layer, e, proj)] for e in range(EXPERTS)])

    return {layer: ExpertWeights(torch.cat([stack(layer, "w1"), stack(layer, "w3")], dim=1), stack(layer, "w2"))
            for layer in range(LAYERS)}


def in_process(model_dir, quant):
    return loader.load_model(model_dir, expert_quant=quant, expert_threads=1)[1]


def experts_only(model_dir, quant):
    return loader.build_expert_executor(model_dir, quant=quant, threads=1)


LOADS = [in_process, experts_only]


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_streamed_executor_is_bit_identical_to_the_dict_built_one(mixtral, load, quant):
    want = CpuExpertExecutor(stacked_by_hand(mixtral), quant=quant, threads=1)
    got = load(mixtral, quant)
    assert sorted(got.layers) == list(range(LAYERS))
    gen = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        for a, b in zip(got.layers[layer].native_args(), want.layers[layer].native_args(), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
        for tokens in (3, 400):  # the native kernel's decode path, and the GEMM path
            hidden = torch.randn(tokens, HIDDEN, generator=gen)  # [T, H]
            ids = torch.randint(0, EXPERTS, (tokens, 2), generator=gen)  # [T, k]
            weights = torch.rand(tokens, 2, generator=gen)  # [T, k]
            assert torch.equal(got.forward(layer, hidden, ids, weights), want.forward(layer, hidden, ids, weights))


def unquantized_expert_bytes() -> int:
    """Bytes of the live float tensors shaped like stacked or per-expert routed-expert weights."""
    shapes = {(EXPERTS, 2 * INTER, HIDDEN), (EXPERTS, HIDDEN, INTER), (INTER, HIDDEN), (HIDDEN, INTER)}
    gc.collect()
    tensors = (o for o in gc.get_objects() if issubclass(type(o), torch.Tensor))  # isinstance would warn on
    return sum(t.numel() * t.element_size() for t in tensors  # torch's deprecated module attributes
               if t.is_floating_point() and tuple(t.shape) in shapes)


@pytest.mark.parametrize("load", LOADS)
def test_int4_loading_holds_about_one_layer_unquantized(mixtral, monkeypatch, load):
    layer_bytes = 3 * EXPERTS * INTER * HIDDEN * 4  # float32, as the checkpoint and the model are
    baseline = unquantized_expert_bytes()
    held = []  # unquantized layers alive each time a layer is quantized
    prepare = cpu_executor.prepare_layer

    def counting_prepare(w, *args, **kwargs):
        held.append((unquantized_expert_bytes() - baseline) / layer_bytes)
        return prepare(w, *args, **kwargs)

    monkeypatch.setattr(cpu_executor, "prepare_layer", counting_prepare)
    load(mixtral, "int4")
    assert len(held) == LAYERS
    assert max(held) <= 1.5, f"unquantized layers alive at each layer's quantization: {held}"


def without(model_dir, tmp_path, drop) -> Path:
    """A copy of the checkpoint without the tensors `drop(name)` is true for."""
    tensors = {k: v for k, v in load_file(model_dir / "model.safetensors").items() if not drop(k)}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    return tmp_path


@pytest.mark.parametrize("load", [*LOADS, lambda d, q: loader.load_expert_weights(d)])
def test_missing_expert_tensor_is_named(mixtral, tmp_path, load):
    path = without(mixtral, tmp_path, lambda name: name == expert_name(2, 3, "w3"))
    with pytest.raises(ModelError, match=r"layer 2: missing expert tensor \('up', 3\)"):
        load(path, "int4")


@pytest.mark.parametrize("load", [*LOADS, lambda d, q: loader.load_expert_weights(d)])
def test_missing_moe_layer_is_named(mixtral, tmp_path, load):
    path = without(mixtral, tmp_path, lambda name: name.startswith("model.layers.1.block_sparse_moe.experts."))
    with pytest.raises(ModelError, match="checkpoint has no routed-expert weights for MoE layer 1"):
        load(path, "none")


@pytest.mark.parametrize("load", LOADS)
def test_only_the_tensors_a_process_serves_are_read(mixtral, monkeypatch, load):
    # The experts process reads the routed experts only (DeepSeek-V3's multi-token-prediction layer,
    # a whole MoE layer, is read by neither: tests/engine/test_loader_errors.py).
    read = []
    real_open = loader.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    load(mixtral, "none")
    names = set(load_file(mixtral / "model.safetensors"))
    experts = {n for n in names if loader.is_expert_tensor(n)}
    assert set(read) == (experts if load is experts_only else names) and len(read) == len(set(read))


def collect(cfg, items) -> tuple[list[int], dict[int, ExpertWeights], loader.ExpertCollector]:
    order, layers = [], {}

    def on_layer(layer, w):
        order.append(layer)
        layers[layer] = w

    collector = loader.ExpertCollector(cfg, torch.float32, on_layer)
    for name, tensor in items:
        collector.add(name, tensor)
    collector.finish()
    return order, layers, collector


def test_each_layer_is_handed_on_once_complete_in_any_order(mixtral):
    cfg = load_config(mixtral)
    items = list(load_file(mixtral / "model.safetensors").items())
    random.Random(0).shuffle(items)
    order, layers, collector = collect(cfg, items)
    assert sorted(order) == list(range(LAYERS)) and not collector.parts
    for layer, want in stacked_by_hand(mixtral).items():
        assert torch.equal(layers[layer].gate_up, want.gate_up) and torch.equal(layers[layer].down, want.down)


def test_stacked_checkpoint_tensors_are_taken_as_they_are(mixtral):
    cfg = load_config(mixtral)
    want = stacked_by_hand(mixtral)
    items = [(f"model.layers.{layer}.mlp.experts.{name}", getattr(w, attr))
             for layer, w in want.items() for name, attr in (("down_proj", "down"), ("gate_up_proj", "gate_up"))]
    order, layers, _ = collect(cfg, items)
    assert order == list(range(LAYERS))
    assert all(layers[i].gate_up is want[i].gate_up and layers[i].down is want[i].down for i in range(LAYERS))


@pytest.mark.parametrize("name, shape", [
    ("gate_up_proj", (EXPERTS // 2, 2 * INTER, HIDDEN)),  # fewer experts than the config's
    ("gate_up_proj", (EXPERTS, 2 * INTER, HIDDEN // 2)),  # another hidden size
    ("down_proj", (EXPERTS, INTER, HIDDEN)),  # [E, I, H]: transposed
])
def test_stacked_experts_off_the_config_are_a_clear_error(mixtral, name, shape):
    cfg = load_config(mixtral)
    w = stacked_by_hand(mixtral)[1]
    items = {"gate_up_proj": w.gate_up, "down_proj": w.down} | {name: torch.zeros(shape)}
    with pytest.raises(ModelError, match=rf"layer 1 mlp.experts.{name}: checkpoint shape {re.escape(str(shape))} "
                                         r"!= expected \("):
        collect(cfg, [(f"model.layers.1.mlp.experts.{k}", v) for k, v in items.items()])


def test_expert_tensors_of_a_layer_without_experts_are_a_clear_error(mixtral):
    cfg = load_config(mixtral)
    for name in (expert_name(LAYERS, 0, "w1"), f"model.layers.{LAYERS}.mlp.experts.down_proj"):
        with pytest.raises(ModelError, match=f"{re.escape(name)} is in layer {LAYERS}, but the config has "
                                             f"num_hidden_layers {LAYERS}"):
            collect(cfg, [(name, torch.zeros(1))])


def test_expert_shape_or_index_off_the_config_is_a_clear_error(mixtral):
    cfg = load_config(mixtral)
    with pytest.raises(ModelError, match="expert 8, but the config has 8 experts"):
        collect(cfg, [(expert_name(0, 8, "w1"), torch.zeros(INTER, HIDDEN))])
    parts = [(expert_name(0, e, p), torch.zeros(INTER, HIDDEN)) for e in range(EXPERTS) for p in ("w1", "w3")]
    parts += [(expert_name(0, e, "w2"), torch.zeros(HIDDEN, INTER + (e == 5))) for e in range(EXPERTS)]
    with pytest.raises(ModelError, match=r"layer 0 expert 5 down: checkpoint shape \(64, 97\) != expected \(64, 96\)"):
        collect(cfg, parts)
