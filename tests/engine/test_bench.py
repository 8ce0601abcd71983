"""`tandem bench`: the report's shape and the weight-traffic accounting behind the roofline share."""

from __future__ import annotations

import gc
import json
import statistics
from collections import namedtuple

import pytest
import torch

from tandem.cli import main
from tandem.engine_bench import ExpertTraffic, dense_weight_bytes, steal_share


class _Echo:
    def forward(self, layer, hidden, topk_ids, topk_weights):
        return hidden


def test_expert_traffic_counts_distinct_experts_per_call():
    traffic = ExpertTraffic(_Echo(), {0: 100, 1: 10})
    traffic.forward(0, torch.zeros(3, 4), torch.tensor([[0, 1], [1, 2], [0, 2]]), torch.ones(3, 2))
    traffic.forward(1, torch.zeros(1, 4), torch.tensor([[5, 6]]), torch.ones(1, 2))
    assert traffic.bytes == 3 * 100 + 2 * 10


def test_a_batch_step_reads_the_distinct_experts_of_its_tokens_summed_over_layers():
    traffic = ExpertTraffic(_Echo(), {0: 100, 1: 10})
    traffic.forward(0, torch.zeros(5, 4), torch.tensor([[0, 1]] * 5), torch.ones(5, 2))  # a prefill: 5 tokens
    mark = traffic.calls
    assert mark == 1
    for ids0, ids1 in (([[0, 1], [2, 3]], [[0, 1], [0, 1]]), ([[0, 1], [1, 0]], [[4, 5], [6, 7]])):
        traffic.forward(0, torch.zeros(2, 4), torch.tensor(ids0), torch.ones(2, 2))
        traffic.forward(1, torch.zeros(2, 4), torch.tensor(ids1), torch.ones(2, 2))
    traffic.forward(0, torch.zeros(1, 4), torch.tensor([[0, 7]]), torch.ones(1, 2))  # one stream left
    # two-token steps: layer 0 touched 4 then 2 experts (mean 300 bytes), layer 1 2 then 4 (mean 30)
    assert traffic.step_bytes(mark, 2) == pytest.approx(300 + 30)
    assert traffic.step_bytes(mark, 1) == pytest.approx(200)
    assert traffic.step_bytes(mark, 5) is None  # the prefill is before the mark
    assert traffic.step_bytes(0, 5) == pytest.approx(200)
    assert traffic.bytes == 200 + 400 + 20 + 200 + 40 + 200


def test_dense_bytes_count_the_tied_head_once(demo_model_dir):
    from tandem.model.loader import load_model

    model, _ = load_model(demo_model_dir("llama"), device="cpu")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert dense_weight_bytes(model) == params  # the embedding matrix is read whole, as the LM head


def test_bench_reports_speeds_and_roofline(demo_model_dir, capsys, monkeypatch):
    import tandem.bench
    import tandem.engine_bench

    paired = iter([20.0, 40.0, 18.0, 42.0])  # the reads around each paired round: a mean of 30 each

    def read(threads=None, method="sum", statistic="best"):
        return {"sum": 10.0, "gemv": 12.5}[method] if statistic == "best" else next(paired)

    monkeypatch.setattr(tandem.bench, "measure_read_bandwidth", read)
    frozen, real_run = [], tandem.engine_bench.run_requests

    def recording_run(engine, prompts, gen_len):
        frozen.append(gc.get_freeze_count())
        return real_run(engine, prompts, gen_len)

    monkeypatch.setattr(tandem.engine_bench, "run_requests", recording_run)
    assert main(["bench", "--model", str(demo_model_dir("mixtral")), "--prompt-len", "8", "--gen-len", "6",
                 "--concurrency", "1,2", "--device", "cpu", "--paired-rounds", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # every timed run with the loaded heap out of the collector's walks, and the heap thawed after
    assert len(frozen) >= 6 and min(frozen) > 0 and gc.get_freeze_count() == 0
    assert next(paired, None) is None  # two reads a round
    # each paired round's share is read against the mean of the two reads beside it
    assert report["read_bandwidth_paired_gbs"] == 30.0
    rounds = report["paired_rounds"]
    assert [r["read_bandwidth_gbs"] for r in rounds] == [[20.0, 40.0], [18.0, 42.0]]
    for r in rounds:
        assert r["decode_tok_s"] > 0 and r["weight_bytes_per_step"] >= report["weight_bytes_per_step"] * 0.5
        assert r["roofline_share"] == pytest.approx(r["weight_bytes_per_step"] * r["decode_tok_s"] / 30e9)
    assert report["roofline_share_paired"] == pytest.approx(statistics.median(r["roofline_share"] for r in rounds))
    assert report["decode_tok_s"] > 0 and report["prefill_tok_s"] > 0
    assert report["decode_path"] == "native"  # the float32 Mixtral decodes through the native layers
    assert report["itl_p50_s"] <= report["itl_p95_s"]
    assert set(report["concurrency"]) == {"1", "2"}
    # a concurrency's step reads its tokens' distinct experts: two streams' at least one stream's
    # (the demo Mixtral: 4 layers of 4 experts, each token picks 2), at most every expert
    from tandem.model.loader import load_model

    dense = dense_weight_bytes(load_model(demo_model_dir("mixtral"), device="cpu")[0])
    cfg = json.loads((demo_model_dir("mixtral") / "config.json").read_text())
    expert = 3 * cfg["hidden_size"] * cfg["intermediate_size"] * 4
    layers, picks, experts = cfg["num_hidden_layers"], cfg["num_experts_per_tok"], cfg["num_local_experts"]
    one, two = report["concurrency"]["1"], report["concurrency"]["2"]
    assert one["weight_bytes_per_step"] == pytest.approx(dense + layers * picks * expert)
    assert one["weight_bytes_per_step"] <= two["weight_bytes_per_step"] <= dense + layers * experts * expert
    for row in (one, two):
        assert row["roofline_share"] == pytest.approx(row["weight_bytes_per_step"] / row["itl_p50_s"] / 10e9)
    expected_roofline = 10.0e9 / report["weight_bytes_per_step"]
    assert abs(report["roofline_tok_s"] - expected_roofline) < 1e-6 * expected_roofline
    assert abs(report["roofline_share"] - report["decode_tok_s"] / report["roofline_tok_s"]) < 1e-9
    assert report["gemv_read_bandwidth_gbs"] == 12.5
    assert report["roofline_share_gemv"] == pytest.approx(report["roofline_share"] * 10.0 / 12.5)
    # KV read a step, from the checkpoint's config: K and V of every layer, float32, over the
    # decode steps' contexts 8 + 1 .. 8 + 5 (mean 11 tokens)
    cfg = json.loads((demo_model_dir("mixtral") / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 4
    assert report["kv_bytes_per_step"] == pytest.approx(per_token * 11)
    weights = report["weight_bytes_per_step"]
    assert report["roofline_share_with_kv"] == pytest.approx(
        report["roofline_share"] * (weights + per_token * 11) / weights)


def test_split_cores_are_disjoint_and_favour_the_experts():
    from tandem.engine_bench import split_cores

    assert split_cores([0, 1]) == ([0], [1])
    assert split_cores(list(range(8))) == ([0, 1], [2, 3, 4, 5, 6, 7])
    with pytest.raises(ValueError, match="at least 2 cores"):
        split_cores([3])


@pytest.mark.parametrize("split", ["disjoint", "shared"])
def test_split_bench_pins_cores_passes_quant_and_compares_with_embedded(demo_model_dir, capsys, monkeypatch, split):
    import os
    import subprocess
    import weakref

    import tandem.cli
    import tandem.engine_bench
    from tandem.experts.cores import available_cores

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("split mode needs 2 cores")
    started, procs = [], []
    real_popen = subprocess.Popen

    def recording_popen(cmd, *a, **kw):
        proc = real_popen(cmd, *a, **kw)
        if isinstance(cmd, list) and cmd and str(cmd[0]).endswith("taskset"):  # not a kernel build's ninja
            started.append((cmd, kw.get("env")))
            procs.append(proc)
        return proc

    # Which engine each decode ran on, and on which cores and threads: the process's, as run_requests saw them.
    side_of, engines, runs = {}, [], []
    real_build, real_run = tandem.cli.build_engine, tandem.engine_bench.run_requests

    def recording_build(args):
        engine = real_build(args)
        side_of[id(engine)] = "split" if getattr(args, "expert_executor", None) else "embedded"
        engines.append(weakref.ref(engine))
        return engine

    def recording_run(engine, prompts, gen_len):
        run = real_run(engine, prompts, gen_len)
        runs.append((side_of[id(engine)], sorted(os.sched_getaffinity(0)), torch.get_num_threads(), run["itl"]))
        return run

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    monkeypatch.setattr(tandem.cli, "build_engine", recording_build)
    monkeypatch.setattr(tandem.engine_bench, "run_requests", recording_run)
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    assert main(["bench", "--model", str(demo_model_dir("mixtral")), "--prompt-len", "6", "--gen-len", "3",
                 "--concurrency", "1", "--device", "cpu", "--mode", "split", "--split-cores", split,
                 "--expert-quant", "int8", "--no-bandwidth", "--rounds", "3", "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    attention, experts = report["cores"]["attention"], report["cores"]["experts"]
    [(cmd, env)] = started
    assert env is None  # the experts process keeps this one's OpenMP settings
    if split == "disjoint":  # cores of its own
        assert attention and experts and not set(attention) & set(experts)
    else:  # taking turns on every core
        assert attention == experts == sorted(affinity)
    # a thread per core on each side, both ends of the data plane polling
    assert report["cores"]["attention_threads"] == len(attention)
    assert cmd[cmd.index("--spin-us") + 1] == "20000" and report["cores"]["spin_us"] == 20000
    assert cmd[cmd.index("-c") + 1] == ",".join(map(str, experts))  # taskset pins the experts process
    assert cmd[cmd.index("--expert-quant") + 1] == "int8"
    assert cmd[cmd.index("--threads") + 1] == str(len(experts))
    # every decode, the full benches' and the rounds', ran on its side's cores with its side's threads
    places = {"embedded": (sorted(affinity), available_cores()), "split": (attention, len(attention))}
    assert all((cores, n) == places[side] for side, cores, n, _ in runs)
    # the full benches first, embedded then split, then the rounds, each on both sides, taking turns at going first
    full = [side for side, *_ in runs[:-6]]
    assert full and full == ["embedded"] * (len(full) // 2) + ["split"] * (len(full) // 2)
    assert [side for side, *_ in runs[-6:]] == ["embedded", "split", "split", "embedded", "embedded", "split"]
    measured = {}
    for i, (side, _, _, itl) in enumerate(runs[-6:]):
        measured[i // 2, side] = len(itl) / sum(itl)
    assert len(report["rounds"]) == 3
    for i, r in enumerate(report["rounds"]):
        assert r["embedded_decode_tok_s"] == measured[i, "embedded"] and r["split_decode_tok_s"] == measured[i, "split"]
        assert r["ratio"] == r["split_decode_tok_s"] / r["embedded_decode_tok_s"]
        assert all(0.0 <= r[f"{side}_steal"] <= 1.0 for side in ("embedded", "split"))  # this is Linux
    ratios = sorted(r["ratio"] for r in report["rounds"])
    assert report["split_vs_embedded_decode"] == ratios[1]  # the median of three
    assert "x embedded" in err and "median of 3 alternating rounds" in err and "the hypervisor stole" in err
    assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == threads  # restored
    assert procs[0].poll() is not None  # the experts process is gone
    assert len(engines) == 2 and all(engine() is None for engine in engines)  # both engines freed


def test_bench_rejects_zero_rounds(demo_model_dir, capsys):
    assert main(["bench", "--model", str(demo_model_dir("mixtral")), "--mode", "split", "--rounds", "0",
                 "--no-bandwidth"]) == 2
    assert "--rounds >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--prompt-len", "4000", "--gen-len", "200"], "--prompt-len 4000 + --gen-len 200 is more than the 4096 tokens"),
    (["--max-model-len", "64", "--prompt-len", "60", "--gen-len", "8"], "is more than the 64 tokens"),
    (["--max-model-len", "5000"], "--max-model-len 5000 is more than the model's context"),
    (["--rounds", "3", "--spin-us", "0"], "--rounds, --spin-us: for --mode split"),
    (["--paired-rounds", "-1"], "--paired-rounds must be >= 0, got -1"),
])
def test_bench_refuses_what_it_cannot_run_before_measuring_anything(demo_model_dir, capsys, monkeypatch, argv,
                                                                     message):
    import tandem.bench

    model = str(demo_model_dir("mixtral"))  # a context of 4096 tokens
    capsys.readouterr()
    monkeypatch.setattr(tandem.bench, "measure_read_bandwidth", lambda **kw: pytest.fail("measured"))
    assert main(["bench", "--model", model, "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_multi_step_runs_time_each_token_as_it_is_streamed(demo_model_dir):
    from tandem.engine.llm_engine import EngineConfig, LLMEngine
    from tandem.engine_bench import run_requests

    engine = LLMEngine.from_pretrained(demo_model_dir("mixtral"), device="cpu", dtype="float32",
                                       config=EngineConfig(num_scheduler_steps=4))
    real, batches = engine.step, []

    def step(emit=None, interrupted=None):  # every output batch, emitted during the step or returned
        returned = real(emit=lambda outputs: (batches.append(outputs), emit(outputs)), interrupted=interrupted)
        batches.append(returned)
        return returned

    engine.step = step
    run = run_requests(engine, [[5, 6, 7, 8]], 9)  # the prefill's token, then runs of 4 and 4
    assert len(batches) == 3 + 8  # three engine steps; the runs' eight tokens each emitted as it came
    assert [len(o.new_token_ids) for b in batches for o in b] == [1] * 9
    assert run["generated"] == 9 and len(run["ttft"]) == 1
    assert len(run["itl"]) == 8 and all(gap > 0 for gap in run["itl"])
    assert run["ttft"][0] + sum(run["itl"]) <= run["wall_s"]


def test_steal_share_is_the_stolen_part_of_all_cpu_time():
    times = namedtuple("scputimes", "user system idle steal")
    assert steal_share(times(10, 5, 80, 5), times(40, 10, 120, 30)) == 25 / 100
    assert steal_share(times(1, 1, 1, 1), times(1, 1, 1, 1)) == 0.0  # no time passed
    assert steal_share(namedtuple("t", "user idle")(1, 2), namedtuple("t", "user idle")(3, 4)) is None  # not counted
