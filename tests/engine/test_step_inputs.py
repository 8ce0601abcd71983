"""A step's inputs built for the decode fast path: RoPE from a table, the attention mask on first use."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from tandem.kv.attention import AttentionMetadata
from tandem.model.layers import RotaryEmbedding


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
])
def test_rope_table_lookup_gives_the_computed_values_and_grows(rope_parameters):
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=rope_parameters,
                      max_position_embeddings=65536)
    rope = RotaryEmbedding(cfg, 64)
    positions = torch.tensor([0, 7, 1023, 5])
    computed = rope.cos_sin(positions, torch.float32)  # no table yet: computed
    rope.reserve(1024, positions.device)
    looked_up = rope.cos_sin(positions, torch.float32, max_position=1023)
    for a, b in zip(looked_up, computed):
        assert a.is_contiguous() and a.shape == (4, 64)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    far = torch.tensor([40000])
    outside = rope.cos_sin(far, torch.float32, max_position=40000)  # past the table: computed
    rope.reserve(40001, far.device)
    assert rope._table.shape[1] >= 40001
    for a, b in zip(rope.cos_sin(far, torch.float32, max_position=40000), outside):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    half = rope.cos_sin(positions, torch.bfloat16, max_position=1023)
    assert half[0].dtype == torch.bfloat16


@pytest.mark.parametrize("window", [None, 3])
def test_attention_mask_is_built_on_first_use_and_is_causal(window):
    # A decode of one sequence at position 9 (block size 4, 3 blocks) and a 2-token prefill chunk
    # of another at positions 2-3: the second builds padded queries.
    meta = AttentionMetadata.build([9, 2], [1, 2], [[5, 1, 7], [2]], 4, torch.device("cpu"), window)
    assert meta._mask is None  # the native decode kernels never ask for it
    mask = meta.mask
    assert mask.shape == (2, 1, 2, 12) and meta.mask is mask  # built once
    keys = torch.arange(12)
    expected_first = keys <= 9
    expected_second = [keys <= 2, keys <= 3]
    if window is not None:
        expected_first &= keys > 9 - window
        expected_second = [m & (keys > p - window) for m, p in zip(expected_second, (2, 3))]
    assert torch.equal(mask[0, 0, 0], expected_first)
    assert torch.equal(mask[1, 0, 0], expected_second[0]) and torch.equal(mask[1, 0, 1], expected_second[1])
    assert bool(mask[0, 0, 1, 0]) and not bool(mask[0, 0, 1, 1:].any())  # the padded query sees key 0 only
