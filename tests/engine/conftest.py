import pytest
import torch


@pytest.fixture
def chunk_settings(kernel_module):
    """The native kernel (each test module's own `kernel_module`), with its chunk settings (chunks a
    thread, the floor on a chunk's bytes) and torch's threads put back after the test, whatever it set."""
    before = kernel_module.chunks_per_thread(), kernel_module.chunk_bytes(), torch.get_num_threads()
    yield kernel_module
    kernel_module.set_chunks_per_thread(before[0])
    kernel_module.set_chunk_bytes(before[1])
    torch.set_num_threads(before[2])
