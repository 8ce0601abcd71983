"""Checkpoint loading: sharded safetensors, progress, and clear errors for bad checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.model import loader
from tandem.model.config import ModelError, load_config


def test_sharded_checkpoint_loads_like_the_single_file(demo_model_dir, tmp_path):
    single = demo_model_dir("qwen3_moe", initializer_range=0.2)
    model = transformers.AutoModelForCausalLM.from_pretrained(single)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="60KB")
    (sharded / "tokenizer.json").write_bytes((single / "tokenizer.json").read_bytes())
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a = LLMEngine.from_pretrained(single, device="cpu").generate([[5, 6, 7, 8]], params)
    b = LLMEngine.from_pretrained(sharded, device="cpu").generate([[5, 6, 7, 8]], params)
    assert a[0].token_ids == b[0].token_ids


def test_progress_bar_for_large_checkpoints(demo_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 0)
    loader.load_model(demo_model_dir("mixtral"), device="cpu")
    assert "loading weights" in capsys.readouterr().err


def test_missing_tensor_is_named(demo_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = demo_model_dir("llama")
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_bytes((src / "config.json").read_bytes())
    with pytest.raises(ModelError, match="model.layers.1.self_attn.o_proj.weight"):
        loader.load_model(tmp_path, device="cpu")


def test_no_weights_and_unsupported_rope_are_clear_errors(demo_model_dir, tmp_path):
    cfg = json.loads((demo_model_dir("mixtral") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="no model.safetensors"):
        loader.load_model(tmp_path, device="cpu")
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="rope type 'dynamic' is not supported"):
        load_config(tmp_path)


def test_weights_land_on_the_requested_dtype(demo_model_dir):
    model, executor = loader.load_model(demo_model_dir("mixtral"), device="cpu", dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert executor is not None
