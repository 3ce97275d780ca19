"""examples/fsdp2/main.py under torchrun (2 CPU processes, gloo): it trains with amp O1
and with FSDP2's MixedPrecisionPolicy (fp16, dynamic loss scale), and a run stopped
after 5 steps and resumed from its torch.distributed.checkpoint logs the same losses
as one that ran 10 steps straight."""
import os
import re

import pytest
import torch

from conftest import torchrun

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
MAIN = os.path.join(ROOT, "examples", "fsdp2", "main.py")


def _run(*args):
    return torchrun(MAIN, "--device", "cpu", *args)  # the production CPU path, as a user runs it


def _losses(out):
    return {int(s): float(v) for s, v in re.findall(r"^step +(\d+) +loss ([\d.]+)", out, re.M)}


pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available in this build")


def test_amp_o1_trains_and_a_resumed_run_logs_the_same_losses(tmp_path):
    straight = _losses(_run("--steps", "10"))
    assert sorted(straight) == [0, 5, 9]
    assert straight[9] < straight[0] - 0.1
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)  # an empty folder (mktemp -d) is no checkpoint yet: a fresh start
    first = _run("--steps", "5", "--checkpoint", ckpt)
    assert f"saved {ckpt}" in first and "resumed" not in first
    second = _run("--steps", "5", "--checkpoint", ckpt)
    assert f"resumed from {ckpt} at step 5" in second
    assert _losses(second) == {5: straight[5], 9: straight[9]}


def test_fsdp2_mixed_precision_policy_with_fp16_and_a_dynamic_scale_trains():
    losses = _losses(_run("--steps", "10", "--precision", "fsdp", "--half-dtype", "fp16"))
    assert losses[9] < losses[0] - 0.1
