"""Fixtures for the operator tests: KMock as the API server, the operator itself, a real `tandem serve`."""

from __future__ import annotations

import pytest

from kopf_fixtures import cluster, kmock_options, operator  # noqa: F401 (fixtures, re-exported for pytest)
from tandem_serve import tandem_serve


@pytest.fixture(scope="module")
def tandem_server(tmp_path_factory):
    """One real `tandem serve` (demo Mixtral, CPU) per test module; its metrics port is `.metrics_port`."""
    with tandem_serve(tmp_path_factory.mktemp("tandem-serve")) as server:
        yield server
