"""An Apex script that changes only its import runs at each opt level on CPU."""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
import apex_style_train  # noqa: E402


@pytest.mark.parametrize("argv", [
    ["--opt-level", "O0"],
    ["--opt-level", "O1"],
    ["--opt-level", "O2"],
    ["--opt-level", "O2", "--keep-batchnorm-fp32", "False", "--loss-scale", "128.0"],
    ["--opt-level", "O3"],
    ["--opt-level", "O3", "--keep-batchnorm-fp32", "True", "--loss-scale", "dynamic"],
], ids=lambda a: "_".join(a[1::2]))
def test_apex_script_runs_with_only_the_import_changed(argv, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    losses = apex_style_train.main(argv + ["--checkpoint", str(ckpt)])
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    saved = torch.load(ckpt)
    assert set(saved["amp"]) == {"loss_scaler0"}
    assert {"loss_scale", "unskipped"} <= set(saved["amp"]["loss_scaler0"])
    assert all(v.dtype == torch.float32 for v in saved["model"].values() if v.is_floating_point())


@pytest.mark.parametrize("optimizer", ["fused-sgd", "fused-adam", "fused-lamb", "fused-novograd",
                                       "fused-adagrad"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_apex_script_with_fused_optimizers(optimizer, opt_level, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    losses = apex_style_train.main(["--opt-level", opt_level, "--optimizer", optimizer,
                                    "--steps", "5", "--checkpoint", str(ckpt)])
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    assert "state" in torch.load(ckpt)["optimizer"]
