"""The HybridModel CRD upgrades with the chart (rendered as a template) and survives uninstall."""

from __future__ import annotations

import yaml

from conftest import CHART_DIR, CRD_SOURCE, by_kind, load_hack, one, render_objects

COPY = CHART_DIR / "files" / "hybridmodels.tandem.dev.yaml"


def test_template_copy_matches_the_crds_source():
    # files/ is what the chart renders; crds/ is the operator's source of truth.
    assert COPY.read_bytes() == CRD_SOURCE.read_bytes(), "run: python charts/tandem/hack/sync.py"


def test_sync_check_reports_no_drift():
    assert load_hack("sync").main(["--check"]) == 0


def test_sync_check_notices_drift(tmp_path, monkeypatch):
    sync = load_hack("sync")
    stale = tmp_path / "copy.yaml"
    stale.write_text(CRD_SOURCE.read_text().replace("HybridModel", "HybridModle", 1))
    monkeypatch.setattr(sync, "CRD_COPY", stale)
    monkeypatch.setattr(sync, "CHART", tmp_path)
    assert sync.main(["--check"]) == 1
    assert sync.main([]) == 0 and stale.read_bytes() == CRD_SOURCE.read_bytes()


def test_rendered_crd_is_the_source_plus_release_metadata(chart):
    source = yaml.safe_load(CRD_SOURCE.read_text())
    crd = one(render_objects(chart), "CustomResourceDefinition")
    # Nothing of the schema may change on the way through fromYaml/toYaml.
    assert crd["spec"] == source["spec"]
    assert crd["metadata"]["name"] == source["metadata"]["name"]
    assert source["metadata"]["labels"].items() <= crd["metadata"]["labels"].items()
    assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}


def test_keep_policy_and_crd_rendering_are_optional(chart):
    crd = one(render_objects(chart, {"crds": {"keep": False}}), "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in crd["metadata"].get("annotations", {})
    assert not by_kind(render_objects(chart, {"crds": {"enabled": False}}), "CustomResourceDefinition")


def test_helm_does_not_load_crds_dir(chart):
    # Helm installs crds/ on first install and then skips it forever; loading it as well as
    # the template would create the CRD twice and fail the release's ownership check.
    assert chart.crds == []
    assert not [f for f in chart.files if f["name"].startswith("crds/")]


def test_the_name_rule_renders_at_the_root_and_reads_only_the_name(chart):
    # At the root of the schema a CEL rule may read metadata.name and generateName, nothing
    # else; kubernetes-validate (test_kubernetes_validate) checks the CRD's shape, not CEL.
    crd = one(render_objects(chart), "CustomResourceDefinition")
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    (rule,) = root["x-kubernetes-validations"]
    assert "self.metadata.name.matches(" in rule["rule"] and "size(self.metadata.name) <= 63" in rule["rule"]
    assert "self.metadata." not in rule["rule"].replace("self.metadata.name", "")
    assert "DNS-1035" in rule["message"]


def test_notes_say_what_uninstall_keeps_and_deletes(chart):
    def notes(values):
        return chart.render(values, name="tandem", namespace="tandem-system")["tandem/templates/NOTES.txt"]
    # A user about to uninstall must learn that crds.keep false takes every HybridModel with it.
    assert "deletes the CRD" in notes({"crds": {"keep": False}})
    kept = notes({})
    assert "helm uninstall tandem -n tandem-system" in kept and "CRD and every other HybridModel stay" in kept
    assert "deletes the CRD" not in kept
