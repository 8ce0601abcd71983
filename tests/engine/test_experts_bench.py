"""The roofline pieces in tandem.bench: bandwidth measurement, roofline share, expert sizes."""

from __future__ import annotations

import pytest
import torch

from tandem.bench import expert_bytes_per_layer, measure_read_bandwidth, roofline_share
from tandem.experts.base import ExpertWeights
from tandem.experts.factory import make_expert_executor
from tandem.experts.torch_executor import TorchExpertExecutor


def test_read_bandwidth_is_a_positive_rate_and_keeps_threads():
    before = torch.get_num_threads()
    bw = measure_read_bandwidth(size_bytes=8 << 20, repeats=2, threads=1)
    assert bw > 0.1  # GB/s: any machine reads 8 MiB faster than in 80 ms
    assert torch.get_num_threads() == before


def test_gemv_read_bandwidth_is_a_positive_rate_and_keeps_threads():
    before = torch.get_num_threads()
    assert measure_read_bandwidth(size_bytes=8 << 20, repeats=2, threads=1, method="gemv") > 0.1
    assert torch.get_num_threads() == before


def test_read_bandwidth_refuses_tiny_sizes_and_unknown_methods():
    with pytest.raises(ValueError, match="at least 1 MiB"):
        measure_read_bandwidth(size_bytes=1000)
    with pytest.raises(ValueError, match="'sum' or 'gemv'"):
        measure_read_bandwidth(size_bytes=8 << 20, method="copy")
    with pytest.raises(ValueError, match="statistic must be 'best' or 'median'"):
        measure_read_bandwidth(size_bytes=8 << 20, statistic="mean")


def test_read_bandwidth_takes_the_best_or_the_median_read(monkeypatch):
    import tandem.bench

    monkeypatch.setattr(tandem.bench, "timed_seconds", lambda fn, repeats: [0.004, 0.001, 0.002])
    size = 8 << 20
    assert measure_read_bandwidth(size_bytes=size) == pytest.approx(size / 0.001 / 1e9)
    assert measure_read_bandwidth(size_bytes=size, statistic="median") == pytest.approx(size / 0.002 / 1e9)


def test_roofline_share():
    # 0.5 GB per step at 36 steps/s is 18 GB/s: half of 36 GB/s
    assert roofline_share(0.5e9, 36.0, 36.0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        roofline_share(1.0, 1.0, 0.0)


def test_expert_bytes_per_layer_follow_the_storage():
    layers = {2: ExpertWeights(torch.randn(4, 64, 32), torch.randn(4, 32, 32))}
    assert expert_bytes_per_layer(TorchExpertExecutor(layers)) == {2: 3 * 32 * 32 * 4}
    assert expert_bytes_per_layer(make_expert_executor(layers, quant="int8")) == {2: 3 * 32 * 32 + (64 + 32) * 4}
    assert expert_bytes_per_layer(object()) is None
