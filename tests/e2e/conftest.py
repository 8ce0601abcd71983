"""Fixtures of the end-to-end tests: a real Prometheus server's binary (Debian's `prometheus`)."""

from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    """The `prometheus` binary; skips without one, except in CI (.ci/run installs it), where it fails."""
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("prometheus is not installed (apt-get install prometheus); CI must run this test")
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    return path
