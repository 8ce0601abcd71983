"""How a `tandem serve` process ends: SIGTERM while the model still loads exits 0, not an abort."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

# `tandem serve` whose load never ends, busy in torch's intra-op thread pool (2 threads: one thread runs
# parallel regions inline) as a large checkpoint's load is; "busy" once it is.
SLOW_LOAD = """
import sys, torch
from tandem.rpc import loading

def busy(*args, **kwargs):
    torch.set_num_threads(2)
    a = torch.randn(256, 256)
    print("busy", file=sys.stderr, flush=True)
    while True:
        a @ a

loading.load_embedded = busy
from tandem.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_while_loading_exits_0(model_dir):
    argv = [sys.executable, "-c", SLOW_LOAD, "serve", "--model", str(model_dir()), "--listen", "127.0.0.1:0",
            "--metrics-port", "0", "--cpu-kv-gib", "0.01", "--max-model-len", "256"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if line.strip() == "busy":
                break
        else:
            raise AssertionError(f"the server ended ({proc.wait()}) before its load began:\n" + "".join(lines))
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=60)
    finally:
        proc.kill()
    log = "".join(lines) + rest
    assert proc.returncode == 0, log
    assert "stopped while loading" in log
    assert "terminate called" not in log
