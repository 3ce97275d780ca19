"""benchmarks/host_overhead.py --quick runs on CPU without a GPU and reports the launch
counts that do not vary: 3 per dtype group for an O2 FusedAdam step (check, Adam, and the
scale update with the scaler's snapshot copy) and no host read."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_run_reports_launches_and_times(tmp_path):
    pytest.importorskip("torchvision")
    out = tmp_path / "host_overhead.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "host_overhead.py"),
                           "--quick", "--rounds", "1", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| O2 FusedAdam fp16 | same |" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    adam = next(r for r in rows if r["config"] == "O2 FusedAdam fp16" and r["regime"] == "same")
    assert adam["error"] is None
    assert adam["steady"]["median_us"] > 0
    assert adam["launches"]["per_group"] == 3.0
    assert adam["launches"]["torch_host_reads"] == {}
    torch_row = next(r for r in rows if r["optimizer"] == "torch")
    assert torch_row["error"] is None and torch_row["steady"]["median_us"] > 0
    # New gradients every step (plain, or FSDP2's DTensors): the kept sweeps take their
    # addresses (one table copy per sweep and dtype group) instead of being rebuilt.
    for regime in ("fresh", "fsdp2"):
        row = next(r for r in rows if r["config"] == "O1 FusedAdam fp16"
                   and r["regime"] == regime)
        assert row["error"] is None, row
        done = int(row["steps_with_all_new_addresses"].split("/")[1])
        assert done > 0 and row["steps_with_all_new_addresses"] == f"{done}/{done}"
        la = row["launches"]
        assert la["triton"] == {"_check_unscale_sweep_kernel": 1, "_scale_update_kernel": 1,
                                "_adam_step_kernel": 1}, la
        assert la["torch"]["copy_"] == 3, la  # the scaler's snapshot, two tables
        # (a mesh of one rank has nothing to agree on: no all-reduce of the overflow flag)
        assert "allreduce_" not in la["torch"], la
        assert la["torch_host_reads"] == {}, la


def _run_one_section(flag, tmp_path):
    """(stdout, JSON report) of ``benchmarks.host_overhead --quick`` with ``flag``."""
    out = tmp_path / "host_overhead.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.host_overhead", flag,
                           "--quick", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_norm_host_cost_rows(tmp_path):
    """--norms-only: FusedLayerNorm / FusedRMSNorm forward, forward+backward and forward
    under no_grad on the GPU code path beside torch's modules; the launches a call records
    do not vary (the forward kernel; then the backward kernel and one reduction pass for
    one row), and the launch floor records the same launches."""
    stdout, report = _run_one_section("--norms-only", tmp_path)
    rows = {r["case"]: r for r in report["norms"]}
    assert set(rows) == {f"{n} {k}" for n in ("LayerNorm", "RMSNorm")
                         for k in ("forward", "forward+backward", "forward, no_grad")}
    assert rows["LayerNorm forward, no_grad"]["target_us"] is None
    for name, r in rows.items():
        assert r["ours_us"] > 0 and r["torch_us"] > 0 and r["floor_us"] > 0
        assert r["launch_floor_us"] > 0
        assert r["launch_floor_launches"] == r["launches"]
        if name.endswith("forward+backward"):
            assert r["launches"] == ["_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel",
                                     "_layer_norm_bwd_reduce_kernel"]
        else:
            assert r["launches"] == ["_layer_norm_fwd_kernel"]
    assert "| LayerNorm forward |" in stdout
    assert "Python Function floor (us) | launch floor (us)" in stdout


def test_larc_host_cost_rows(tmp_path):
    """--larc-only: LARC's step over ResNet-50's 161 parameter tensors with new gradients
    every step. Its kept sweeps launch what does not vary with the tensor count: two
    norms (a partial pass and a segment pass each) and one rewrite, 14 small torch ops
    on the vectors of rates; the per-parameter rewrite runs ops per tensor. No host
    read on either."""
    stdout, report = _run_one_section("--larc-only", tmp_path)
    rows = {r["case"]: r for r in report["larc"]}
    kept, each = rows["kept sweeps"], rows["per-parameter rewrite"]
    assert kept["launches"]["triton"] == {"_l2norm_partial_kernel": 2,
                                          "_l2norm_segment_kernel": 2,
                                          "_larc_rescale_kernel": 1}, kept
    assert kept["launches"]["torch"] == 14, kept
    assert each["launches"]["torch"] >= 3 * 161, each
    for r in (kept, each):
        assert r["launches"]["host_reads"] == 0 and r["us"] > 0, r
    assert "| kept sweeps |" in stdout


def test_syncbn_host_cost_rows(tmp_path):
    """--syncbn-only: SyncBatchNorm (one process) forward and forward+backward, NCHW and
    channels-last, beside torch's BatchNorm2d; a steady call launches its three (six)
    kernels, none of them through Triton's binding."""
    stdout, report = _run_one_section("--syncbn-only", tmp_path)
    rows = {r["case"]: r for r in report["syncbn"]}
    assert set(rows) == {f"{layout} {k}" for layout in ("NCHW", "channels-last")
                         for k in ("forward", "forward+backward")}
    fwd = ["_syncbn_stats_kernel", "_syncbn_merge_kernel", "_syncbn_forward_kernel"]
    for name, r in rows.items():
        assert r["ours_us"] > 0 and r["torch_us"] > 0 and r["triton_binds"] == 0, r
        assert r["launches"] == (fwd + ["_syncbn_backward_reduce_kernel",
                                        "_syncbn_reduce_merge_kernel",
                                        "_syncbn_backward_input_kernel"]
                                 if name.endswith("forward+backward") else fwd), r
    assert "| NCHW forward |" in stdout and "through Triton's binding" in stdout


def test_the_p20_p80_of_few_samples_are_deciles_not_the_extremes():
    """--quick times 3 rounds x 3 steps: with fewer than 10 samples the 20th and 80th
    percentiles were the minimum and maximum."""
    # (in a process of its own: importing host_overhead switches Triton's interpreter off)
    code = ("import json; from benchmarks.host_overhead import _stats; "
            "print(json.dumps([_stats([i * 1e-6 for i in range(100, 1000, 100)]), "
            "_stats([5e-6])]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    nine, one = json.loads(proc.stdout.strip().splitlines()[-1])   # 100 ... 900 us
    assert nine["median_us"] == pytest.approx(500.0)
    assert nine["p20_us"] == pytest.approx(260.0) and nine["p80_us"] == pytest.approx(740.0)
    assert one["p20_us"] == pytest.approx(5.0)
