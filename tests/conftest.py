"""Shared fixtures: tiny random-weight checkpoints made with transformers' own classes."""

from __future__ import annotations

import os

import pytest
import torch

# Two cores: one intra-op thread per test process keeps runs predictable and fast.
torch.set_num_threads(int(os.environ.get("TANDEM_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    """`demo_model_dir(arch, **config overrides)` -> a saved checkpoint directory (cached per session)."""
    from tandem.demo import make_demo_model

    cache = {}

    def make(arch: str = "mixtral", seed: int = 0, **overrides):
        key = (arch, seed, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-{seed}")
            cache[key] = make_demo_model(out, arch=arch, seed=seed, **overrides)
        return cache[key]

    return make
