"""The command-line forms other checks drive: make-demo-model and generate, and their errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tandem.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "model"
    assert main(["make-demo-model", str(out), "--arch", "qwen2_moe", "--seed", "3"]) == 0
    return out


def test_make_demo_model_writes_a_loadable_hf_checkpoint(demo):
    import transformers

    assert (demo / "config.json").is_file() and (demo / "tokenizer.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(demo)
    assert type(model).__name__ == "Qwen2MoeForCausalLM"


def test_generate_json_local(demo, capsys):
    assert main(["generate", "--model", str(demo), "--prompt", "The expert said", "--max-tokens", "7",
                 "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) <= 7 and out["finish_reason"] in ("length", "stop")
    assert isinstance(out["text"], str)
    assert main(["generate", "--model", str(demo), "--prompt-ids", "5,6,7", "--max-tokens", "5", "--json",
                 "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "1",
                 "--dtype", "bfloat16"]) == 0
    seeded = json.loads(capsys.readouterr().out)
    assert main(["generate", "--model", str(demo), "--prompt-ids", "5,6,7", "--max-tokens", "5", "--json",
                 "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "1",
                 "--dtype", "bfloat16"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == seeded["token_ids"]


@pytest.mark.parametrize("args,message", [
    (["--model", "/nonexistent/dir", "--prompt", "hi"], "does not exist"),
    (["--prompt", ""], "prompt"),
    (["--prompt-ids", "1,99999"], "outside the vocabulary"),
    (["--prompt-ids", "1,x"], "comma-separated"),
    (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
    (["--prompt", "hi", "--temperature", "-0.5"], "temperature"),
    (["--prompt", "hi", "--top-p", "0"], "top_p"),
    (["--prompt", "hi", "--top-p", "1.5"], "top_p"),
    (["--prompt", "hi", "--repetition-penalty", "0"], "repetition_penalty"),
    (["--prompt", "hi", "--min-p", "2"], "min_p"),
    (["--prompt", "hi", "--logprobs", "21"], "logprobs: must be in [0, 20], got 21"),
    (["--prompt", "hi", "--n", "17"], "n: must be in [1, 16], got 17"),
    (["--prompt", "hi", "--temperature", "inf"], "temperature: must be a number >= 0, got inf"),
    (["--prompt", "hi", "--max-model-len", "0"], "max_model_len must be at least 1, got 0"),
    (["--prompt", "hi", "--max-model-len", "5000"], "max_model_len 5000 is more than the model's context"),
    (["--server", "127.0.0.1:1", "--prompt", "hi", "--threads", "2", "--block-size", "32"],
     "--threads, --block-size: engine flags, for --model; with --server the server's own settings apply"),
])
def test_bad_input_exits_2_with_one_line(demo, args, message, capsys):
    if "--model" not in args and "--server" not in args:
        args = ["--model", str(demo), *args]
    try:
        code = main(["generate", *args])
    except SystemExit as e:  # argparse-level errors
        code = e.code
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_a_failed_forward_pass_exits_1(demo, capsys, monkeypatch):
    from tandem.engine.model_runner import ModelRunner

    def fail(*args, **kwargs):
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(ModelRunner, "execute", fail)
    assert main(["generate", "--model", str(demo), "--prompt-ids", "5,6", "--device", "cpu", "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["finish_reason"] == "error"
    assert captured.err.strip().splitlines()[-1] == "tandem: error: the forward pass failed"


def test_bad_input_in_a_real_process_prints_no_traceback(demo):
    proc = run_cli("generate", "--model", str(demo), "--prompt-ids", "1,99999")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "tandem: error: prompt_token_ids: token id 99999 is outside the vocabulary [0, 384)"]


def test_unknown_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    proc = run_cli("generate", "--model", str(tmp_path), "--prompt", "hi")
    assert proc.returncode == 2
    assert "unsupported architecture 'GPT2LMHeadModel'" in proc.stderr and "MixtralForCausalLM" in proc.stderr
