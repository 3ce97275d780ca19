"""examples/fsdp2/main.py under torchrun (2 CPU processes, gloo): it trains with amp O1
and with FSDP2's MixedPrecisionPolicy (fp16, dynamic loss scale), and a run stopped
after 5 steps and resumed from its torch.distributed.checkpoint logs the same losses
as one that ran 10 steps straight."""
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
MAIN = os.path.join(ROOT, "examples", "fsdp2", "main.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the production CPU path, as a user runs it
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={_free_port()}", "--master_addr=127.0.0.1", MAIN,
           "--device", "cpu", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _losses(out):
    return {int(s): float(v) for s, v in re.findall(r"^step +(\d+) +loss ([\d.]+)", out, re.M)}


pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available in this build")


def test_amp_o1_trains_and_a_resumed_run_logs_the_same_losses(tmp_path):
    straight = _losses(_run("--steps", "10"))
    assert sorted(straight) == [0, 5, 9]
    assert straight[9] < straight[0] - 0.1
    ckpt = str(tmp_path / "ckpt")
    first = _run("--steps", "5", "--checkpoint", ckpt)
    assert f"saved {ckpt}" in first
    second = _run("--steps", "5", "--checkpoint", ckpt)
    assert f"resumed from {ckpt} at step 5" in second
    assert _losses(second) == {5: straight[5], 9: straight[9]}


def test_fsdp2_mixed_precision_policy_with_fp16_and_a_dynamic_scale_trains():
    losses = _losses(_run("--steps", "10", "--precision", "fsdp", "--half-dtype", "fp16"))
    assert losses[9] < losses[0] - 0.1
