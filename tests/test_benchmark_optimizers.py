"""The optimizer benchmark runs its CPU smoke mode in-process and writes a valid JSON.

Under the test session the kernels run in Triton's interpreter, so the smoke run is a
tiny transformer layout; the layouts themselves are checked without running anything.
"""
import json
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from benchmarks import optimizers as bench  # noqa: E402


def test_cpu_smoke_run_writes_table_and_json(tmp_path, capsys):
    rc = bench.main(["--device", "cpu", "--sizes", "2K", "--layouts", "transformer",
                     "--optimizers", "adam,sgd,adagrad", "--cpu-reps", "1",
                     "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "CPU figures" in out and "GB/s" in out and "vs torch" in out
    data = json.loads((tmp_path / "optimizers_cpu.json").read_text())
    assert data["torch"] == torch.__version__ and data["copy_bandwidth_gbps"] > 0
    rows = data["rows"]
    assert {(r["optimizer"], r["impl"]) for r in rows} == {
        (o, i) for o in ("adam", "sgd", "adagrad")
        for i in ("tritamp", "torch fused", "torch foreach")}
    for r in rows:
        assert r["device"] == data["device"] and r["torch"] == torch.__version__
        assert r["triton"] == data["triton"] and r["tritamp"] == data["tritamp"]
        assert r["layout"] == "transformer" and r["tensors"] == 12
        assert r["time_ms"] > 0 and r["time_ms_p20"] <= r["time_ms_p80"]
        assert r["bytes"] == bench.bytes_per_element(r["impl"], 2 if r["optimizer"] == "adam"
                                                     else 1) * r["params"]
        assert r["gbps"] > 0 and r["ratio_to_torch"] > 0
    fused = [r for r in rows if r["impl"] == "torch fused"]
    assert all(r["ratio_to_torch"] == 1.0 for r in fused)


def test_a_size_that_does_not_fit_is_skipped_with_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "free_bytes", lambda device: 1 << 20)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device, timed: 1.0)
    rc = bench.main(["--device", "cpu", "--sizes", "1B", "--layouts", "resnet50",
                     "--optimizers", "adagrad", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "optimizers_cpu.json").read_text())["rows"]
    assert len(rows) == 3 and all(r["note"].startswith("skipped: needs about") for r in rows)
    assert "skipped" in capsys.readouterr().out


@pytest.mark.parametrize("n", [25_000_000, 100_000_000, 1_000_000_000])
def test_layouts_hit_the_parameter_count(n):
    resnet = bench.layout_shapes("resnet50", n)
    assert len(resnet) == 161
    assert abs(bench.numel(resnet) - n) / n < 0.02
    assert sum(len(s) == 1 for s in resnet) == 107  # BatchNorm vectors and the fc bias
    transformer = bench.layout_shapes("transformer", n)
    assert abs(bench.numel(transformer) - n) / n < 0.1
    matrices = [s for s in transformer if len(s) == 2]
    assert len(matrices) >= 32 and len(set(matrices)) == 4  # qkv, out, fc1, fc2


def test_resnet50_width_one_is_resnet50():
    assert bench.numel(bench.resnet50_shapes(1.0)) == 25_557_032  # torchvision's count


def test_sizes_and_unknown_names():
    assert [bench.parse_size(s) for s in ("25M", "1B", "50k", "0.5M", "1234")] == \
        [25_000_000, 10 ** 9, 50_000, 500_000, 1234]
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--optimizers", "adamax"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--sizes", "lots"])
