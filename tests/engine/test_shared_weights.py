"""The routed experts' weights in a shared-memory file (tandem.experts.shared_weights): the experts
process serves from it exactly what it served from its own memory, a restart with the same
inputs maps it instead of loading, anything else is refused with a reason, and the attention
process's SharedPrefill computes large chunks from its mapping (here on the CPU, where the
copies are no-ops; on CUDA in tests/engine/test_cuda_graphs.py)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from test_experts_cpu import batch, dequantized_reference, layers, rel_err  # noqa: F401 (layers is a fixture)

from tandem.experts import shared_weights
from tandem.experts.base import ExpertsUnavailable, ExpertWeights
from tandem.experts.cpu_executor import CpuExpertExecutor
from tandem.experts.factory import make_expert_executor
from tandem.experts.quant import stored_parts
from tandem.experts.shared_weights import (SharedPrefill, SharedWeightsError, data_path, load_key, manifest_path,
                                           open_shared, share)
from tandem.rpc.gen import experts_pb2

QUANTS = ["none", "int8", "int4"]
KEY = {"model": "m", "dtype": "float32", "quant": "q", "files": []}


def outputs(executor) -> list[torch.Tensor]:
    """Decode-sized (the native kernel) and prefill-sized (the GEMM path) calls of both layers."""
    return [executor.forward(layer, *batch(t, seed=layer + t)) for layer in (3, 5) for t in (2, 400)]


def within(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + buffer.numel()


@pytest.mark.parametrize("quant", QUANTS)
def test_the_executor_serves_the_same_from_the_shared_file(layers, quant, tmp_path):  # noqa: F811
    executor = CpuExpertExecutor(layers, quant=quant, threads=2)
    before = outputs(executor)
    shared = share(executor, tmp_path / "shm" / "weights", KEY)
    for got, want in zip(outputs(executor), before):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # served from the file now: every stored tensor a view of its mapping, nothing left of the old
    for p in executor.layers.values():
        assert all(within(t, shared.buffer) for w in (p.gate_up, p.down) for t in stored_parts(w))
    assert data_path(shared.path).stat().st_size == shared.buffer.numel()
    assert not list((tmp_path / "shm").glob("*.tmp"))


@pytest.mark.parametrize("quant", QUANTS)
def test_a_restart_maps_what_was_published(layers, quant, tmp_path):  # noqa: F811
    executor = CpuExpertExecutor(layers, quant=quant, threads=2)
    published = share(executor, tmp_path / "weights", KEY)
    mapped = open_shared(tmp_path / "weights", KEY)
    assert mapped.generation == published.generation and mapped.quant == quant
    for i, w in mapped.layers.items():
        for got, want in zip((*stored_parts(w.gate_up), *stored_parts(w.down)),
                             (*stored_parts(executor.layers[i].gate_up), *stored_parts(executor.layers[i].down))):
            assert got.dtype == want.dtype and torch.equal(got, want)
    again = make_expert_executor(mapped.layers, threads=2, quant=mapped.quant)
    for got, want in zip(outputs(again), outputs(executor)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_other_inputs_and_damaged_files_are_refused(layers, tmp_path):  # noqa: F811
    path = tmp_path / "weights"
    with pytest.raises(SharedWeightsError, match="no expert weights published"):
        open_shared(path)
    share(CpuExpertExecutor(layers, quant="int8", threads=2), path, KEY)
    with pytest.raises(SharedWeightsError, match="other inputs"):
        open_shared(path, {**KEY, "quant": "int4"})
    manifest = json.loads(manifest_path(path).read_text())

    os.truncate(data_path(path), manifest["nbytes"] - 1)  # a crash while it was written
    with pytest.raises(SharedWeightsError, match="bytes, its manifest describes"):
        open_shared(path, KEY)
    os.truncate(data_path(path), manifest["nbytes"])
    entry = manifest["layers"]["3"]["gate_up"]["parts"][0]
    for damage, match in ((lambda: entry.update(offset=manifest["nbytes"]), "outside the file"),
                          (lambda: entry.update(dtype="complex64"), "damaged manifest"),
                          (lambda: manifest.update(version=0), "not a version 1 manifest")):
        damage()
        manifest_path(path).write_text(json.dumps(manifest))
        with pytest.raises(SharedWeightsError, match=match):
            open_shared(path)
        manifest = json.loads(manifest_path(path).read_text().replace('"version": 0', '"version": 1'))
        entry = manifest["layers"]["3"]["gate_up"]["parts"][0]
        entry.update(offset=0, dtype="int8")
    manifest_path(path).write_text("{not json")
    with pytest.raises(SharedWeightsError, match="unreadable manifest"):
        open_shared(path)


def test_publishing_again_leaves_an_earlier_mapping_intact(layers, tmp_path):  # noqa: F811
    path = tmp_path / "weights"
    first = share(CpuExpertExecutor(layers, quant="int8", threads=2), path, KEY)
    kept = first.layers[3].gate_up.q.clone()
    second = share(CpuExpertExecutor(layers, quant="none", threads=2), path, {**KEY, "quant": "none"})
    assert second.generation != first.generation
    assert torch.equal(first.layers[3].gate_up.q, kept)  # the old file lives on while mapped
    assert open_shared(path).generation == second.generation


class FakeClient:
    """The attention process's client of the experts process: Forward, and what info() last saw."""

    def __init__(self, executor):
        self.executor, self.calls, self.last_info = executor, 0, None

    def advertise(self, path="", generation=""):
        self.last_info = experts_pb2.ExpertsInfo(experts_shm_path=str(path), experts_shm_generation=generation)

    def forward(self, *args):
        self.calls += 1
        return self.executor.forward(*args)


@pytest.mark.parametrize("quant", QUANTS)
def test_shared_prefill_computes_large_chunks_from_the_mapping(layers, quant, tmp_path):  # noqa: F811
    executor = CpuExpertExecutor(layers, quant=quant, threads=2)
    shared = share(executor, tmp_path / "weights", KEY)
    client = FakeClient(executor)
    client.advertise(shared.path, shared.generation)
    prefill = SharedPrefill(client, min_tokens=16, pin=False)
    for layer in (3, 5):
        hidden, ids, weights = batch(48, seed=layer)
        got = prefill.forward_on_device(layer, hidden, ids, weights)
        assert got is not None and got.dtype == hidden.dtype
        assert rel_err(got, dequantized_reference(executor, layer).forward(layer, hidden, ids, weights)) < 1e-5
    assert prefill.prefill.calls == prefill.calls == 2 and client.calls == 0
    assert prefill.forward_on_device(3, *batch(8)) is None  # a small chunk: the experts process's
    hidden, ids, weights = batch(4)
    torch.testing.assert_close(prefill.forward(3, hidden, ids, weights), executor.forward(3, hidden, ids, weights))
    assert client.calls == 1


def test_shared_prefill_follows_what_the_experts_process_advertises(layers, tmp_path, caplog):  # noqa: F811
    path = tmp_path / "weights"
    executor = CpuExpertExecutor(layers, quant="int8", threads=2)
    client = FakeClient(executor)
    prefill = SharedPrefill(client, min_tokens=16, pin=False)
    chunk = batch(32)
    assert prefill.forward_on_device(3, *chunk) is None  # nothing advertised (not started with --experts-shm)

    client.advertise(path, "g1")  # advertised, but nothing there (another host)
    with caplog.at_level(logging.WARNING, logger=shared_weights.__name__):
        assert prefill.forward_on_device(3, *chunk) is None
        assert prefill.forward_on_device(3, *chunk) is None
    assert len([r for r in caplog.records if "stay on the experts process" in r.message]) == 1  # warned once

    first = share(executor, path, KEY)
    client.advertise(path, first.generation)
    assert prefill.prepare("cpu") and prefill.shared.generation == first.generation  # mapped ahead of a prefill
    assert prefill.forward_on_device(3, *chunk) is not None and prefill.shared.generation == first.generation

    # the experts process restarted on other weights: the new generation is mapped
    floats = CpuExpertExecutor(layers, quant="none", threads=2)
    second = share(floats, path, {**KEY, "quant": "none"})
    client.advertise(path, second.generation)
    got = prefill.forward_on_device(5, *chunk)
    assert prefill.shared.generation == second.generation
    assert rel_err(got, floats.forward(5, *chunk)) < 1e-5

    client.executor = None  # the experts process goes down: the mapping is let go with the failed call
    client.forward = lambda *args: (_ for _ in ()).throw(ExpertsUnavailable("down"))
    with pytest.raises(ExpertsUnavailable):
        prefill.forward(5, *batch(2))
    assert prefill.shared is None and prefill.prefill is None
    assert prefill.forward_on_device(5, *chunk) is not None  # mapped again while advertised

    client.advertise(path, "another")  # a generation the file does not hold: declined, not mixed
    assert prefill.forward_on_device(3, *chunk) is None and prefill.shared is None
    client.advertise()  # no longer shared: the mapping is let go
    assert prefill.forward_on_device(3, *chunk) is None and prefill.prefill is None


def test_the_experts_role_maps_weights_an_earlier_process_published(demo_model_dir, tmp_path, monkeypatch):
    from tandem.rpc import loading
    from tandem.rpc.server import ServeOptions

    model = demo_model_dir("mixtral")
    opts = ServeOptions(model=str(model), role="experts", listen="unix:/tmp/x.sock", device="cpu",
                        expert_quant="int8", experts_shm=str(tmp_path / "weights"))
    executor, info = loading.load_experts(opts)
    assert info.experts_shm_path == opts.experts_shm and info.experts_shm_generation
    hidden, ids, weights = batch_for(info)
    want = executor.forward(info.moe_layers[0], hidden, ids, weights)

    loads = []
    real_build = loading.build_expert_executor
    monkeypatch.setattr(loading, "build_expert_executor", lambda *a, **kw: loads.append(kw) or real_build(*a, **kw))
    again, info_again = loading.load_experts(opts)  # a restart: mapped, not loaded
    assert not loads and info_again.experts_shm_generation == info.experts_shm_generation
    torch.testing.assert_close(again.forward(info.moe_layers[0], hidden, ids, weights), want, rtol=0, atol=0)

    opts.expert_quant = "int4"  # other inputs: loaded and published afresh
    _, info_int4 = loading.load_experts(opts)
    assert len(loads) == 1 and info_int4.experts_shm_generation != info.experts_shm_generation


def batch_for(info):
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(info.num_experts, generator=g)[:2] for _ in range(3)])
    return torch.randn(3, info.hidden_size, generator=g), ids, torch.full((3, 2), 0.5)


def test_only_the_experts_role_takes_experts_shm():
    from tandem.rpc.server import ServeOptions

    with pytest.raises(ValueError, match="--experts-shm is for --role experts"):
        ServeOptions(model="m", role="attention", experts="unix:/tmp/e.sock", experts_shm="/dev/shm/w")
    assert SimpleNamespace(**vars(ServeOptions(model="m", role="experts", experts_shm="/dev/shm/w"))).experts_shm


def test_load_key_changes_with_the_model_files(demo_model_dir):
    model = demo_model_dir("mixtral", seed=7)  # this test's own: it touches a file
    key = load_key(model, "float32", "int8")
    assert load_key(model, "float32", "int8") == key
    assert load_key(model, "bfloat16", "int8") != key and load_key(model, "float32", "int4") != key
    config = model / "config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert load_key(model, "float32", "int8") != key


def test_the_engine_gives_a_client_of_the_experts_process_one_shared_prefill(layers, demo_model_dir,  # noqa: F811
                                                                              tmp_path):
    from tandem.engine.llm_engine import LLMEngine, stream_prefill_experts

    client = FakeClient(CpuExpertExecutor(layers, threads=2))
    engine = LLMEngine.from_pretrained(demo_model_dir("mixtral"), device="cpu", expert_executor=client)
    # what the engine does on CUDA
    engine.gpu_prefill = made = stream_prefill_experts(engine.model, torch.device("cpu"), 16, pin=False)
    wrappers = {id(layer.mlp.executor): layer.mlp.executor for layer in engine.model.model.layers}
    [wrapper] = wrappers.values()
    assert made == [wrapper]  # what the engine's stats() count the GPU calls of
    assert isinstance(wrapper, SharedPrefill) and wrapper.inner is client and wrapper.min_tokens == 16

    # what the serving loop's probe does once the experts process answers: map what it shares
    from tandem.rpc.loading import prepare_shared_prefill

    prepare_shared_prefill(engine)
    assert wrapper.shared is None  # nothing advertised yet
    published = share(client.executor, tmp_path / "weights", KEY)
    client.advertise(published.path, published.generation)
    prepare_shared_prefill(engine)
    assert wrapper.shared.generation == published.generation


def test_a_volume_too_small_is_refused_before_writing(layers, tmp_path, monkeypatch):  # noqa: F811
    executor = CpuExpertExecutor(layers, quant="int8", threads=2)
    before = outputs(executor)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(OSError, match="has 0.00 GB free, the routed experts' weights need"):
        share(executor, tmp_path / "weights", KEY)
    # nothing written but the publishers' lock, and the executor still serves its own
    assert [p.name for p in tmp_path.iterdir()] == ["weights.lock"]
    for got, want in zip(outputs(executor), before):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_two_processes_publishing_at_one_path_take_turns(layers, tmp_path, monkeypatch):  # noqa: F811
    """Two experts processes started on one --experts-shm path (two threads here, each copy slowed
    so that they overlap): both publish, one after the other, the manifest describes the weights
    the file holds, and each serves its own weights still."""
    import threading
    import time

    move = shared_weights._move_into
    monkeypatch.setattr(shared_weights, "_move_into", lambda *a, **kw: time.sleep(0.5) or move(*a, **kw))
    doubled = {i: ExpertWeights(w.gate_up * 2, w.down * 2) for i, w in layers.items()}
    executors = {"a": CpuExpertExecutor(layers, threads=2), "b": CpuExpertExecutor(doubled, threads=2)}
    before = {name: outputs(executor) for name, executor in executors.items()}
    path, errors = tmp_path / "weights", []

    def publish(name):
        try:
            share(executors[name], path, {**KEY, "model": name})
        except Exception as exc:  # noqa: BLE001 - the test's assertion reports it
            errors.append(exc)

    threads = [threading.Thread(target=publish, args=(name,)) for name in executors]
    for thread in threads:
        thread.start()
        time.sleep(0.2)  # the second starts while the first copies
    for thread in threads:
        thread.join()
    assert errors == []
    published = open_shared(path)
    name = published.manifest["key"]["model"]
    assert name == "b"  # the second waited for the first, then published over it
    for got, want in zip(outputs(make_expert_executor(published.layers, threads=2)), before[name]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for name, executor in executors.items():
        for got, want in zip(outputs(executor), before[name]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not list(tmp_path.glob("*.tmp"))


def test_a_publisher_that_died_leaves_nothing_behind_the_next(layers, tmp_path):  # noqa: F811
    path = tmp_path / "weights"
    stale = [tmp_path / "weights.bin.4242-deadbeef.tmp", tmp_path / "weights.json.4242-deadbeef.tmp"]
    other = tmp_path / "weights.b.bin.4242-deadbeef.tmp"  # another path's: may be being written
    for f in (*stale, other):
        f.write_bytes(b"half written")
    share(CpuExpertExecutor(layers, threads=2), path, KEY)
    assert not any(f.exists() for f in stale) and other.exists()
