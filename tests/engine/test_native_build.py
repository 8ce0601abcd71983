"""The native kernel's build directory: a build killed halfway does not block the next one, and
one environment's build is not another's."""

from __future__ import annotations

import subprocess
import sys
import threading

from tandem.experts import native

HOLD_AND_DIE = """
import os, sys
from pathlib import Path
from tandem.experts import native
with native._build_lock(Path(sys.argv[1])):
    (Path(sys.argv[1]) / "lock").touch()  # torch's baton, as a build has it
    print("holding", flush=True)
    os._exit(9)  # killed mid-build: no cleanup runs
"""


def enters(build_dir, timeout_s: float = 30) -> bool:
    entered = threading.Event()

    def take():
        with native._build_lock(build_dir):
            entered.set()

    threading.Thread(target=take, daemon=True).start()
    return entered.wait(timeout_s)


def test_a_build_killed_halfway_leaves_nothing_that_blocks_the_next(tmp_path):
    died = subprocess.run([sys.executable, "-c", HOLD_AND_DIE, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert died.returncode == 9 and "holding" in died.stdout
    assert (tmp_path / "lock").exists()  # what made every later torch load wait forever
    assert enters(tmp_path)
    assert not (tmp_path / "lock").exists()


def test_the_lock_excludes_a_second_builder_until_the_first_is_done(tmp_path):
    with native._build_lock(tmp_path):
        (tmp_path / "lock").touch()  # a live build's baton: left alone while its builder runs
        assert not enters(tmp_path, timeout_s=0.5)
        assert (tmp_path / "lock").exists()
        (tmp_path / "lock").unlink()
    assert enters(tmp_path)


def test_a_build_directory_marked_built_loads_read_only_without_a_compiler(monkeypatch):
    import torch.utils.cpp_extension

    if native.load_kernel() is None:
        import pytest

        pytest.skip(f"no native kernel here: {native.unavailable_reason()}")

    def no_toolchain(*args, **kwargs):
        raise AssertionError("torch.utils.cpp_extension.load was called: it needs ninja, a compiler and writes")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_toolchain)
    monkeypatch.setattr(native, "_build_lock", None)  # and no lock file (a read-only directory)
    module = native._build(verbose=False)  # what a container image's prebuilt kernel takes
    assert module.__file__ == native.load_kernel().__file__ and hasattr(module, "moe_forward")
