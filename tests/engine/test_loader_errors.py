"""Checkpoints that cannot be served as they are: each is a ModelError naming the file, tensor or
field at fault, raised while loading (the CLI prints it as one line and exits 2), never a traceback
and never a model that silently computes something else."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.cli import main
from tandem.demo import make_demo_model
from tandem.model import loader
from tandem.model.config import ModelError, load_config


@pytest.fixture
def checkpoint(demo_model_dir, tmp_path):
    """A copy of the mixtral demo checkpoint to break: 2 layers of 8 experts, hidden 64, intermediate 128."""
    return shutil.copytree(demo_model_dir("mixtral"), tmp_path / "model")


def edit_config(model_dir, **fields):
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(dict(config, **fields)))
    return model_dir


def edit_tensors(model_dir, edit):
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir


def in_process(model_dir):
    return loader.load_model(model_dir, expert_threads=1)


def experts_only(model_dir):
    return loader.build_expert_executor(model_dir, threads=1)


# config.json


@pytest.mark.parametrize("text, message", [
    ('{"architectures": ["MixtralForCausalLM"]', r"config\.json is not valid JSON: Expecting"),
    ("\udcff", r"config\.json is not valid JSON"),
    ("[1, 2]", r"config\.json must hold a JSON object, not a list"),
    ("{}", r'config\.json has no "architectures" list'),
    ('{"architectures": "MixtralForCausalLM"}', r'"architectures" in .*config\.json must be a non-empty list'),
    ('{"architectures": []}', r'"architectures" in .*config\.json must be a non-empty list'),
])
def test_a_config_json_that_names_no_model_is_named(checkpoint, text, message):
    (checkpoint / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ModelError, match=message):
        load_config(checkpoint)


@pytest.mark.parametrize("fields, message", [
    (dict(hidden_size="64"), r"config\.json: transformers cannot read it: .*'hidden_size' expected int"),
    (dict(model_type="llama"), r"config\.json: model_type 'llama' is not MixtralForCausalLM's 'mixtral'"),
    (dict(architectures=[["MixtralForCausalLM"]]), r"unsupported architecture \['MixtralForCausalLM'\]"),
])
def test_a_config_field_of_the_wrong_kind_is_named(checkpoint, fields, message):
    with pytest.raises(ModelError, match=message):
        load_config(edit_config(checkpoint, **fields))


def test_the_config_file_in_place_of_its_directory_is_named(checkpoint):
    with pytest.raises(ModelError, match=r"config\.json' is not a directory"):
        load_config(checkpoint / "config.json")


# safetensors files


def test_a_bad_index_is_named(checkpoint):
    index = checkpoint / "model.safetensors.index.json"
    index.write_text("{")
    with pytest.raises(ModelError, match=r"model\.safetensors\.index\.json is not valid JSON"):
        loader.load_model(checkpoint)
    index.write_text('{"metadata": {}}')
    with pytest.raises(ModelError, match=r'index\.json has no "weight_map"'):
        loader.load_model(checkpoint)
    names = list(load_file(checkpoint / "model.safetensors"))
    weight_map = {name: "model.safetensors" for name in names} | {names[-1]: "model-00002-of-00002.safetensors"}
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelError, match=r"names 1 shard\(s\) that .* does not hold, e\.g\. model-00002-of-00002"):
        loader.load_model(checkpoint)


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_an_unreadable_safetensors_file_is_named(checkpoint, damage):
    path = checkpoint / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"empty": b"", "truncated": data[: len(data) // 2], "garbage": bytes(range(256)) * 4}[damage])
    for load in (in_process, experts_only):
        with pytest.raises(ModelError, match=r"model\.safetensors is not a readable safetensors file"):
            load(checkpoint)


def test_the_cli_prints_a_load_error_as_one_line(checkpoint, capsys):
    (checkpoint / "model.safetensors").write_bytes(b"")
    capsys.readouterr()
    assert main(["generate", "--model", str(checkpoint), "--prompt-ids", "5", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors is not a readable safetensors file" in err and err.count("\n") == 1


def test_a_corrupt_tokenizer_is_named(checkpoint):
    assert loader.load_tokenizer(checkpoint).encode("Hello world").ids
    (checkpoint / "tokenizer.json").write_text("{")
    with pytest.raises(ModelError, match=r"tokenizer\.json is not a tokenizer"):
        loader.load_tokenizer(checkpoint)
    (checkpoint / "tokenizer.json").unlink()
    assert loader.load_tokenizer(checkpoint) is None


# tensors


@pytest.mark.parametrize("name, shape", [
    ("model.layers.0.self_attn.o_proj.bias", (64,)),  # a bias the config does not ask for: Mixtral has none
    ("model.layers.1.mlp.shared_expert_gate.weight", (1, 64)),  # another architecture's
])
def test_a_tensor_the_model_has_no_place_for_is_named(checkpoint, name, shape):
    edit_tensors(checkpoint, lambda tensors: tensors.__setitem__(name, torch.ones(shape)))
    with pytest.raises(ModelError, match=rf"checkpoint tensor {name} is not a weight of MixtralForCausalLM"):
        loader.load_model(checkpoint)


def test_rotary_frequencies_in_a_checkpoint_are_not_weights(checkpoint):
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    edit_tensors(checkpoint, lambda tensors: tensors.__setitem__(name, torch.ones(8)))
    model, _ = loader.load_model(checkpoint)
    assert name not in dict(model.named_parameters())


@pytest.mark.parametrize("load", [in_process, experts_only])
def test_a_layer_past_the_configs_last_is_named(checkpoint, load):
    edit_config(checkpoint, num_hidden_layers=1)
    with pytest.raises(ModelError, match=r"model\.layers\.1\..* is in layer 1, but the config has num_hidden_layers 1"):
        load(checkpoint)


@pytest.mark.parametrize("mtp_key", ["num_nextn_predict_layers", "num_mtp_layers"])
def test_only_deepseeks_multi_token_prediction_layers_are_skipped(demo_model_dir, tmp_path, mtp_key):
    # The 3-layer demo read as 2 layers: its last layer (an MoE layer) is where DeepSeek-V3 keeps its MTP module.
    model_dir = shutil.copytree(demo_model_dir("deepseek_v3"), tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("num_nextn_predict_layers", "num_mtp_layers")}
    (model_dir / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=2, **{mtp_key: 1})))
    model, _ = in_process(model_dir)
    assert len(model.model.layers) == 2
    assert sorted(experts_only(model_dir).layers) == [1]
    edit_config(model_dir, **{mtp_key: 0})
    for load in (in_process, experts_only):
        with pytest.raises(ModelError, match="is in layer 2, but the config has num_hidden_layers 2"):
            load(model_dir)


# dtype


def test_a_float16_checkpoint_loads_as_float32_unless_asked_otherwise(tmp_path, caplog):
    model_dir = make_demo_model(tmp_path / "fp16", "mixtral", dtype="float16")
    embed = load_file(model_dir / "model.safetensors")["model.embed_tokens.weight"]
    assert embed.dtype == torch.float16
    with caplog.at_level(logging.INFO, logger="tandem.model.loader"):
        model, _ = loader.load_model(model_dir)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert torch.equal(model.model.embed_tokens.weight, embed.float())  # every float16 value, exactly
    [record] = [r for r in caplog.records if r.name == "tandem.model.loader"]
    assert record.levelno == logging.INFO and "float16" in record.message and "--dtype bfloat16" in record.message
    model, _ = loader.load_model(model_dir, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ModelError, match="unsupported dtype 'float16'; supported: float32, bfloat16"):
        loader.load_model(model_dir, dtype="float16")


# GGUF experts


def write_experts_gguf(path, layers, experts=8, inter=128, hidden=64, projs=("gate", "up", "down")):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for layer in layers:
        for proj in projs:
            shape = (experts, hidden, inter) if proj == "down" else (experts, inter, hidden)
            writer.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("layout, message", [
    (dict(experts=4), r"layer 0 has 4 experts of \[128, 64\] \(gate\), the checkpoint 8 experts of \[128, 64\]"),
    (dict(hidden=32), r"layer 0 has 8 experts of \[128, 32\] \(gate\), the checkpoint 8 experts of \[128, 64\]"),
    (dict(projs=("gate", "up")), r"layer 0 has no tensor \(down\), the checkpoint 8 experts of \[64, 128\]"),
    (dict(layers=[0]), r"routed experts for layers \[0\], but the checkpoint's MoE layers are \[0, 1\]"),
])
def test_a_gguf_file_off_the_config_is_refused_before_any_weight_is_read(checkpoint, tmp_path, monkeypatch,
                                                                         layout, message):
    path = write_experts_gguf(tmp_path / "experts.gguf", **{"layers": [0, 1], **layout})

    def read(*args, **kwargs):
        raise AssertionError("a checkpoint tensor was read")

    monkeypatch.setattr(loader, "iter_tensors", read)
    with pytest.raises(ModelError, match=message):
        loader.load_model(checkpoint, experts_gguf=path)
    with pytest.raises(ModelError, match=message):
        loader.build_expert_executor(checkpoint, experts_gguf=path)
