"""`tandem serve` flags as the operator renders them, and the errors a user sees for bad ones."""

from __future__ import annotations

import pytest

from tandem import contract
from tandem.cli import build_parser, main
from tandem.rpc.cli_serve import options_from_args


def parse(*argv: str):
    return options_from_args(build_parser().parse_args(["serve", *argv]))


def test_every_contract_flag_is_accepted(tmp_path):
    values = {"model": str(tmp_path), "listen": "unix:/run/x.sock", "metrics_port": "9500", "role": "attention",
              "experts": contract.EXPERTS_SOCKET, "kv_shm": contract.KV_SHM_PATH, "device": "cpu",
              "dtype": "bfloat16", "threads": "3", "block_size": "32", "gpu_memory_fraction": "0.5",
              "cpu_kv_gib": "2", "expert_quant": "int8", "spin_us": "20000", "num_scheduler_steps": "4",
              "kv_cache_dtype": "fp8", "scheduling_policy": "priority", "health_listen": contract.HEALTH_SOCKET}
    switches = {"cpu_decode": True, "no_cpu_decode": False}  # flags without a value
    # --experts-gguf goes with neither --role attention nor --expert-quant: see the test below;
    # --experts-shm is the experts role's only: below too; the TLS flags read their files: test_grpc_tls.py
    tls = {"ssl_certfile", "ssl_keyfile", "ssl_ca_certs"}
    off = {"no_enable_prefix_caching"}  # a switch the operator renders for the attention role alone
    assert set(values) | set(switches) | {"experts_gguf", "experts_shm"} | tls | off == set(contract.SERVE_FLAGS)
    argv = [a for key, flag in contract.SERVE_FLAGS.items() if key in values for a in (flag, values[key])]
    opts = parse(*argv)
    assert (opts.role, opts.experts, opts.kv_shm, opts.metrics_port) == (
        "attention", contract.EXPERTS_SOCKET, contract.KV_SHM_PATH, 9500)
    assert (opts.threads, opts.block_size, opts.gpu_memory_fraction, opts.expert_quant) == (3, 32, 0.5, "int8")
    assert opts.spin_us == 20000 and opts.num_scheduler_steps == 4 and opts.kv_cache_dtype == "fp8"
    assert opts.scheduling_policy == "priority" and opts.health_listen == contract.HEALTH_SOCKET
    for key, value in switches.items():
        assert parse(*argv, contract.SERVE_FLAGS[key]).cpu_decode is value
    assert parse(*argv, contract.SERVE_FLAGS["no_enable_prefix_caching"]).enable_prefix_caching is False


def test_defaults_follow_the_contract(tmp_path):
    opts = parse("--model", str(tmp_path))
    assert opts.role == "all" and opts.listen == f"0.0.0.0:{contract.GRPC_PORT}"
    assert opts.metrics_port == contract.METRICS_PORT
    # The experts container shares the pod's network namespace: its metrics need their own port.
    assert parse("--model", str(tmp_path), "--role", "experts").metrics_port == contract.EXPERTS_METRICS_PORT
    assert opts.metrics_host is None  # every address, IPv6 and IPv4: the operator renders no --metrics-host
    assert parse("--model", str(tmp_path), "--metrics-host", "127.0.0.1").metrics_host == "127.0.0.1"


def test_prefix_caching_is_on_unless_asked_not_to(tmp_path):
    from tandem.rpc.loading import engine_config

    assert engine_config(parse("--model", str(tmp_path))).enable_prefix_caching is True
    assert engine_config(parse("--model", str(tmp_path), "--enable-prefix-caching")).enable_prefix_caching is True
    off = parse("--model", str(tmp_path), "--no-enable-prefix-caching")
    assert off.enable_prefix_caching is False and engine_config(off).enable_prefix_caching is False


def test_experts_are_page_locked_unless_asked_not_to(tmp_path):
    # CUDA prefill copies the experts from page-locked host memory (tandem.experts.device_prefill)
    from tandem.rpc.loading import engine_config

    assert engine_config(parse("--model", str(tmp_path))).page_lock_experts is True
    opts = parse("--model", str(tmp_path), "--no-page-lock-experts")
    assert opts.page_lock_experts is False and engine_config(opts).page_lock_experts is False


@pytest.mark.parametrize("argv, message", [
    (["--role", "attention"], "--role attention needs --experts"),
    (["--experts", "unix:/x.sock"], "--experts is only for --role attention"),
    (["--listen", "localhost"], "--listen: expected host:port or unix:/path"),
    (["--listen", "0.0.0.0:99999"], "--listen: port must be a number in 0..65535"),
    (["--role", "attention", "--experts", "nowhere"], "--experts: expected host:port"),
    (["--metrics-port", "-1"], "--metrics-port must be in 0..65535"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--max-num-seqs", "0"], "max_num_seqs must be at least 1, got 0"),
    (["--num-scheduler-steps", "0"], "num_scheduler_steps must be at least 1, got 0"),
    (["--shutdown-grace", "nan"], "--shutdown-grace must be a number of seconds >= 0, got nan"),
    (["--shutdown-grace", "-1"], "--shutdown-grace must be a number of seconds >= 0"),
    (["--expert-timeout", "inf"], "--expert-timeout must be a number of seconds > 0, got inf"),
    (["--cpu-kv-gib", "nan"], "cpu_kv_gib must be a number of GiB >= 0, got nan"),
    (["--max-model-len", "0"], "max_model_len must be at least 1, got 0"),
    (["--kv-shm", ""], "--kv-shm: an empty path"),
    (["--role", "experts", "--listen", "unix:/run/x.sock", "--experts-shm", " "], "--experts-shm: an empty path"),
])
def test_bad_flags_exit_2_with_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", "--model", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_model_directory_must_exist(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("config, message", [
    ('{"architectures": ["GPT2LMHeadModel"]}', "unsupported architecture 'GPT2LMHeadModel'"),
    (None, "no config.json"),
])
def test_a_checkpoint_that_cannot_load_is_refused_before_the_server_starts(tmp_path, capsys, config, message):
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    assert main(["serve", "--model", str(tmp_path), "--listen", "127.0.0.1:0", "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_max_model_len_beyond_the_models_context_is_refused(demo_model_dir, capsys):
    model = str(demo_model_dir())  # max_position_embeddings 4096
    capsys.readouterr()  # the checkpoint's writing
    argv = ["serve", "--model", model, "--listen", "127.0.0.1:0", "--metrics-port", "0", "--max-model-len", "4097"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--max-model-len 4097 is more than the model's context, max_position_embeddings 4096" in err
    assert err.count("\n") == 1


def test_device_cuda_without_cuda_is_refused(demo_model_dir, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    argv = ["serve", "--model", str(demo_model_dir()), "--listen", "127.0.0.1:0", "--metrics-port", "0",
            "--device", "cuda"]
    capsys.readouterr()  # the checkpoint's writing
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--device cuda: no CUDA device" in err and err.count("\n") == 1


def test_dense_quant_reaches_the_options_and_bad_values_exit_2(tmp_path, capsys):
    assert parse("--model", str(tmp_path)).dense_quant == "none"
    assert parse("--model", str(tmp_path), contract.DENSE_QUANT_FLAG, "int8").dense_quant == "int8"
    with pytest.raises(SystemExit) as exc:
        parse("--model", str(tmp_path), contract.DENSE_QUANT_FLAG, "int3")
    assert exc.value.code == 2


def test_kv_cache_dtype_reaches_the_engine_and_bad_values_exit_2(tmp_path, capsys):
    from tandem.rpc.loading import engine_config

    flag = contract.SERVE_FLAGS["kv_cache_dtype"]
    assert engine_config(parse("--model", str(tmp_path))).kv_cache_dtype == "auto"
    for value in ("fp8", "fp8_e4m3"):
        assert engine_config(parse("--model", str(tmp_path), flag, value)).kv_cache_dtype == value
    with pytest.raises(SystemExit) as exc:
        parse("--model", str(tmp_path), flag, "fp9")
    assert exc.value.code == 2 and "invalid choice: 'fp9'" in capsys.readouterr().err


def test_experts_gguf_is_for_the_process_holding_the_experts_in_the_files_format(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "experts.gguf").write_bytes(b"GGUF")
    flag, path = contract.SERVE_FLAGS["experts_gguf"], str(tmp_path / "experts.gguf")
    for role in ("all", "experts"):
        assert parse("--model", str(tmp_path), "--role", role, flag, path).experts_gguf == path
    assert parse("--model", str(tmp_path)).experts_gguf is None
    for argv, message in [
        (["--role", "attention", "--experts", contract.EXPERTS_SOCKET, flag, path], "not --role attention"),
        ([flag, path, "--expert-quant", "int4"], "--experts-gguf and --expert-quant exclude each other"),
        ([flag, str(tmp_path / "absent.gguf")], "absent.gguf is not a file"),
    ]:
        assert main(["serve", "--model", str(tmp_path), *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def test_experts_shm_is_for_the_experts_role(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    flag = contract.SERVE_FLAGS["experts_shm"]
    opts = parse("--model", str(tmp_path), "--role", "experts", flag, contract.EXPERTS_SHM_PATH)
    assert opts.experts_shm == contract.EXPERTS_SHM_PATH
    assert parse("--model", str(tmp_path), "--role", "experts").experts_shm is None
    for argv in (["--role", "attention", "--experts", contract.EXPERTS_SOCKET], ["--role", "all"]):
        assert main(["serve", "--model", str(tmp_path), *argv, flag, contract.EXPERTS_SHM_PATH]) == 2
        err = capsys.readouterr().err
        assert "--experts-shm is for --role experts" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda"], "--device cuda: --role experts computes on the CPU"),
    ([contract.DENSE_QUANT_FLAG, "int8"], "--dense-quant is for the engine of --role all or attention"),
    (["--enforce-eager"], "--enforce-eager is for the engine"),
    (["--num-scheduler-steps", "4"], "--num-scheduler-steps is for the engine"),
    (["--no-cpu-decode"], "--no-cpu-decode is for the engine"),
    (["--no-page-lock-experts"], "--no-page-lock-experts is for the engine"),
    (["--expert-timeout", "5"], "--expert-timeout is for the engine"),
    (["--max-num-seqs", "1"], "--max-num-seqs is for the engine"),
    (["--max-model-len", "512"], "--max-model-len is for the engine"),
    (["--gpu-memory-fraction", "0.5"], "--gpu-memory-fraction is for the engine"),
    (["--num-device-blocks", "8"], "--num-device-blocks is for the engine"),
    # the experts process reads the CPU tier's dtype and scales from the layout the attention process publishes
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype is for the engine"),
    (["--no-enable-prefix-caching"], "--no-enable-prefix-caching is for the engine"),
    (["--spin-us", "20000", "--listen", "127.0.0.1:9000"],
     "--spin-us polls the data plane, which needs a Unix socket: --role experts with --listen 127.0.0.1:9000"),
])
def test_the_experts_role_refuses_flags_it_would_ignore(tmp_path, capsys, argv, message):
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", "--model", str(tmp_path), "--role", "experts", "--listen", "unix:/run/x.sock", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_experts_role_takes_the_flags_common_to_both_roles_and_engine_defaults(tmp_path):
    # What the operator renders for both containers of a pair, and engine flags at their defaults.
    opts = parse("--model", str(tmp_path), "--role", "experts", "--listen", contract.EXPERTS_SOCKET,
                 "--device", "cpu", "--block-size", "32", "--cpu-kv-gib", "64", "--kv-shm", contract.KV_SHM_PATH,
                 "--spin-us", "20000", "--max-num-seqs", "64", "--expert-timeout", "30", "--cpu-decode",
                 "--shutdown-grace", "120")
    assert (opts.block_size, opts.cpu_kv_gib, opts.spin_us, opts.shutdown_grace_s) == (32, 64.0, 20000, 120.0)


@pytest.mark.parametrize("argv, message", [
    (["--spin-us", "20000"], "--spin-us is for the split roles (attention, experts), not --role all"),
    (["--role", "attention", "--experts", "127.0.0.1:9000", "--spin-us", "20000"],
     "--spin-us polls the data plane, which needs a Unix socket: --role attention with --experts 127.0.0.1:9000"),
    (["--role", "attention", "--experts", contract.EXPERTS_SOCKET, "--max-num-batched-tokens", "65537"],
     "--max-num-batched-tokens must be at most 65536 for --role attention"),
])
def test_data_plane_flags_need_a_data_plane(tmp_path, capsys, argv, message):
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", "--model", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
