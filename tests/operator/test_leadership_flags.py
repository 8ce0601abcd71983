"""tandem-operator's leader-election flags: parsed apart from kopf's, from flags or environment."""

from __future__ import annotations

import pytest

from tandem_operator import leadership, main


@pytest.fixture(autouse=True)
def no_election_env(monkeypatch):
    for name in ("LEADER_ELECT", "LEADER_ELECTION_NAMESPACE", "LEADER_ELECTION_ID", "LEADER_ELECTION_LEASE_DURATION",
                 "LEADER_ELECTION_RENEW_DEADLINE", "LEADER_ELECTION_RETRY_PERIOD"):
        monkeypatch.delenv(leadership.ENV_PREFIX + name, raising=False)
    for name in ("POD_NAMESPACE", "POD_NAME"):
        monkeypatch.delenv(name, raising=False)


def test_kopf_options_pass_through_in_order_and_untouched():
    kopf_args = ["--standalone", "-n", "models", "--liveness=http://0.0.0.0:8080/healthz", "--verbose", "extra.py"]
    election, rest = leadership.parse_args(kopf_args)
    assert rest == kopf_args and not election.enabled

    election, rest = leadership.parse_args(["--leader-elect", "-n", "models", "--leader-election-id=my-lease",
                                            "--leader-election-lease-duration=1m30s", "--verbose",
                                            "--leader-election-renew-deadline", "20s",
                                            "--leader-election-retry-period=500ms", "--leader-election-namespace=ops"])
    assert rest == ["-n", "models", "--verbose"]
    assert election == leadership.ElectionOptions(enabled=True, namespace="ops", lease_name="my-lease",
                                                  lease_duration=90, renew_deadline=20, retry_period=0.5)


def test_every_flag_has_an_environment_variable(monkeypatch):
    for name, value in {"LEADER_ELECT": "true", "LEADER_ELECTION_NAMESPACE": "ops", "LEADER_ELECTION_ID": "lease",
                        "LEADER_ELECTION_LEASE_DURATION": "30", "LEADER_ELECTION_RENEW_DEADLINE": "20s",
                        "LEADER_ELECTION_RETRY_PERIOD": "4"}.items():
        monkeypatch.setenv(leadership.ENV_PREFIX + name, value)
    election, _ = leadership.parse_args([])
    assert election == leadership.ElectionOptions(True, "ops", "lease", 30, 20, 4)
    assert not leadership.parse_args(["--no-leader-elect"])[0].enabled  # a flag wins over the variable


@pytest.mark.parametrize("args", [["--leader-election-retry-period=0"], ["--leader-election-lease-duration=soon"],
                                  ["--leader-election-renew-deadline=10x"]])
def test_bad_durations_are_usage_errors(args, capsys):
    assert main.main(["--leader-elect", *args, "-A"]) == 2
    assert "--leader-election-" in capsys.readouterr().err


def test_the_namespace_comes_from_the_pod(monkeypatch, tmp_path):
    options = leadership.ElectionOptions(enabled=True)
    monkeypatch.setattr(leadership, "SERVICE_ACCOUNT_NAMESPACE", tmp_path / "namespace")
    with pytest.raises(ValueError, match="--leader-election-namespace is needed"):
        options.config()
    (tmp_path / "namespace").write_text("from-service-account\n")
    assert options.config().namespace == "from-service-account"
    monkeypatch.setenv("POD_NAMESPACE", "from-downward-api")
    monkeypatch.setenv("POD_NAME", "operator-abc")
    config = options.config()
    assert config.namespace == "from-downward-api" and config.name == "tandem-operator"
    assert config.identity.startswith("operator-abc_") and config.identity != options.config().identity


@pytest.mark.parametrize("kopf_args, message", [
    (["-A", "--peering=tandem"], "leave out --peering"),
    (["-A", "--no-such-kopf-option"], "no-such-kopf-option"),
])
def test_options_that_cannot_work_fail_before_waiting_for_the_lease(kopf_args, message, capsys):
    assert main.main(["--leader-elect", "--leader-election-namespace=ops", *kopf_args]) == 2
    assert message in capsys.readouterr().err
