"""The main job's benchmark runs in a smoke mode and writes a valid JSON and a PNG."""
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import opt_levels  # noqa: E402


def test_smoke_run_writes_table_json_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rc = opt_levels.main(["--device", "cpu", "--levels", "O0,O2,O2-bf16,torch.amp",
                          "--batch-size", "2", "--image-size", "8", "--steps", "1",
                          "--warmup", "1", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "samples/s" in out and "O2-bf16" in out and "torch.amp" in out
    data = json.loads((tmp_path / "opt_levels_cpu.json").read_text())
    assert data["torch"] == torch.__version__ and "triton" in data and "tritamp" in data
    assert [r["config"] for r in data["rows"]] == ["O0", "O2", "O2-bf16", "torch.amp"]
    for row in data["rows"]:
        assert row["samples_per_s"] > 0 and row["syncs_per_step"] == 0
    png = (tmp_path / "opt_levels_cpu.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_sync_counter_counts_a_planted_item():
    counter = opt_levels.SyncCounter(torch.device("cpu"))
    x = torch.ones(3)
    with counter:
        y = (x * 2).sum()
        y.item()
        bool(y > 0)
    assert counter.count == 2


def test_unknown_configuration_is_refused():
    with pytest.raises(SystemExit):
        opt_levels.parse_args(["--levels", "O4"])


def test_transformer_option_runs_fused_adam(tmp_path, capsys):
    rc = opt_levels.main(["--device", "cpu", "--model", "transformer", "--levels", "O2,torch.amp",
                          "--batch-size", "2", "--image-size", "8", "--steps", "1",
                          "--warmup", "1", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "opt_levels_cpu.json").read_text())
    assert data["model"] == "transformer"
    assert [r["config"] for r in data["rows"]] == ["O2", "torch.amp"]
    assert all(r["syncs_per_step"] == 0 for r in data["rows"])


def test_transformer_uses_fused_norms_for_tritamp_configs():
    from torch import nn

    from tritamp.normalization import FusedLayerNorm
    torch.manual_seed(0)
    fused = opt_levels.build_model("transformer", 10, "cpu", fused_norms=True)
    torch.manual_seed(0)
    plain = opt_levels.build_model("transformer", 10, "cpu", fused_norms=False)
    norms = [m for m in fused.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 5 and all(type(m) is FusedLayerNorm for m in norms)
    assert not any(isinstance(m, FusedLayerNorm) for m in plain.modules())
    for (k, a), (k2, b) in zip(fused.state_dict().items(), plain.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    tokens = torch.randint(0, 1000, (2, 8))
    torch.testing.assert_close(fused(tokens), plain(tokens), rtol=1e-5, atol=1e-5)
