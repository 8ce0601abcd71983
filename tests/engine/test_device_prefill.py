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
    assert len(layers) > 1 and made == [{"pin": True, "own_pages": True}]
    [wrapper] = {id(layer.mlp.executor): layer.mlp.executor for layer in layers}.values()
    assert isinstance(wrapper, DevicePrefill) and not wrapper.pinned  # nothing to page-lock off CUDA
    # to be locked, this tiny model's weights moved into one mapping of their own, and are computed from there
    from tandem.experts.quant import stored_parts

    storages = {t.untyped_storage().data_ptr() for gate_up, down in wrapper.weights.values()
                for t in (*stored_parts(gate_up), *stored_parts(down))}
    executor_storages = {t.untyped_storage().data_ptr() for p in wrapper.inner.layers.values()
                         for t in (*stored_parts(p.gate_up), *stored_parts(p.down))}
    assert len(storages) == 1 and storages == executor_storages


class FakeCudart:
    """torch.cuda.cudart() as page_lock uses it, recording registrations; `fail_at` fails that one."""

    def __init__(self, fail_at: int | None = None):
        self.registered: dict[int, int] = {}
        self.calls, self.fail_at = 0, fail_at

    def cudaHostRegister(self, ptr, size, flags):
        self.calls += 1
        if self.calls == self.fail_at:
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        assert all(ptr + size <= start or start + n <= ptr for start, n in self.registered.items()), "a page twice"
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        del self.registered[ptr]
        return 0

    def cudaGetErrorString(self, status):
        return "already registered"


def test_page_lock_registers_every_weight_page_once(monkeypatch):
    from tandem.experts import device_prefill

    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    mapping = torch.zeros(5 * 4096 + 100, dtype=torch.uint8)  # views of one buffer: locked once, whole
    small = [torch.ones(n) for n in (3, 5, 17, 1000)]  # scales: they may share pages with each other
    tensors = [mapping[:4096].view(torch.int8), mapping[8192:9000], *small, torch.empty(0)]
    locked = device_prefill.page_lock(tensors, min_bytes=1)  # as for a mapping of the weights' own
    assert locked and sorted(locked) == sorted(cudart.registered)
    for t in tensors[:-1]:  # every byte of every storage lies in one registered range
        s = t.untyped_storage()
        assert any(start <= s.data_ptr() and s.data_ptr() + s.nbytes() <= start + n
                   for start, n in cudart.registered.items())
    assert all(start % 4096 == 0 and n % 4096 == 0 for start, n in cudart.registered.items())
    # by default only storages large enough to have pages of their own
    default = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: default)
    large = torch.zeros(device_prefill.PAGE_LOCK_MIN_BYTES, dtype=torch.uint8)
    assert len(device_prefill.page_lock([*small, large])) == 1
    [(start, n)] = default.registered.items()
    assert start <= large.data_ptr() and large.data_ptr() + large.numel() <= start + n

    # The last registration fails: the ones before it are undone (all or nothing).
    separate = [torch.zeros(1 << 16, dtype=torch.uint8), torch.ones(3), torch.zeros(1 << 20)]
    counting = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: counting)
    device_prefill.page_lock(separate, min_bytes=1)
    failing = FakeCudart(fail_at=counting.calls)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: failing)
    monkeypatch.setattr(device_prefill, "_drop_pending_error", lambda: None)
    assert device_prefill.page_lock(separate, min_bytes=1) == [] and failing.registered == {}
    assert failing.calls == counting.calls


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_small_tensors_move_to_pages_of_their_own_and_compute_the_same(layers, quant, monkeypatch):  # noqa: F811
    import mmap

    from tandem.experts import device_prefill, shared_weights
    from tandem.experts.quant import stored_parts

    executor = CpuExpertExecutor(layers, quant=quant, threads=2)
    calls = [(layer, *batch(t, seed=t)) for layer in (3, 5) for t in (2, 400)]  # the native kernel, the GEMMs
    before = [executor.forward(*call) for call in calls]
    # the largest part stays where it is, as one of at least PAGE_LOCK_MIN_BYTES would
    parts = [t for p in executor.layers.values() for w in (p.gate_up, p.down) for t in stored_parts(w)]
    largest = max(t.untyped_storage().nbytes() for t in parts)
    monkeypatch.setattr(device_prefill, "PAGE_LOCK_MIN_BYTES", largest)
    kept = {t.data_ptr() for t in parts if t.untyped_storage().nbytes() == largest}

    buffer = shared_weights.give_pages_of_their_own(executor)
    assert buffer is not None and buffer.data_ptr() % mmap.PAGESIZE == 0
    now = [t for p in executor.layers.values() for w in (p.gate_up, p.down) for t in stored_parts(w)]
    for t in now:
        inside = buffer.data_ptr() <= t.data_ptr() < buffer.data_ptr() + buffer.numel()
        assert inside != (t.data_ptr() in kept) and t.data_ptr() % 64 == 0
    for call, want in zip(calls, before):
        torch.testing.assert_close(executor.forward(*call), want, rtol=0, atol=0)

    cudart = FakeCudart()  # every storage now has pages of its own: locked whole, no page twice
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    assert len(device_prefill.page_lock(now, min_bytes=1)) <= 1 + len(kept)
