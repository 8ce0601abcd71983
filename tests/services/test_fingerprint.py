"""A checkpoint's fingerprint (tandem.rpc.fingerprint): copies agree, other weights or config differ."""

from __future__ import annotations

import json
import os
import shutil

from tandem.rpc.fingerprint import model_fingerprint


def test_copies_of_a_checkpoint_agree(model_dir, tmp_path):
    path = model_dir("mixtral")
    copy = shutil.copytree(path, tmp_path / "elsewhere")  # another path, another volume
    for f in copy.iterdir():
        os.utime(f, ns=(0, 0))
    config = copy / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()), indent=4))  # formatting aside
    assert model_fingerprint(copy) == model_fingerprint(path)
    assert len(model_fingerprint(path)) == 32


def test_same_shapes_with_other_weights_or_config_differ(model_dir, tmp_path):
    path = model_dir("mixtral")
    assert model_fingerprint(model_dir("mixtral", seed=1)) != model_fingerprint(path)  # same shapes
    copy = shutil.copytree(path, tmp_path / "edited")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rope_theta": 1.0}))
    assert model_fingerprint(copy) != model_fingerprint(path)
    assert model_fingerprint(model_dir("qwen3_moe")) != model_fingerprint(path)
