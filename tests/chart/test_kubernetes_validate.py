"""Every rendered object passes kubernetes-validate in strict mode (unknown fields are errors),
for the oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest one
kubernetes-validate ships. Custom resources have no schema there: see test_servicemonitor.py
and test_examples.py for those."""

from __future__ import annotations

import copy

import pytest
from kubernetes_validate import utils as kv

from conftest import NON_DEFAULT_VALUES, one, render_objects

CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "HybridModel"}
VERSIONS = ["1.28.0", kv.latest_version()]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("values", [{}, *NON_DEFAULT_VALUES.values()],
                         ids=["default", *NON_DEFAULT_VALUES])
def test_rendered_objects_are_valid_kubernetes(chart, values, version):
    objects = [obj for obj in render_objects(chart, values) if obj["kind"] not in CUSTOM_KINDS]
    assert objects
    for obj in objects:
        kv.validate(obj, version, strict=True)


def test_strict_validation_catches_a_misspelled_field(chart):
    # The check above can fail: the same validator rejects a typo in a rendered Deployment.
    deployment = copy.deepcopy(one(render_objects(chart), "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicey"] = "Always"
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, VERSIONS[0], strict=True)


def test_custom_resources_have_no_builtin_schema(chart):
    model = one(render_objects(chart, NON_DEFAULT_VALUES["everything"]), "HybridModel")
    with pytest.raises(kv.SchemaNotFoundError):
        kv.validate(model, VERSIONS[0], strict=True)
