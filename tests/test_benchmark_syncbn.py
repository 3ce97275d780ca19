"""benchmarks/syncbn.py --distributed: SyncBatchNorm across 2 processes under torchrun
(gloo on a CPU), rank 0 writing the rows."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_ranks_under_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "-m", "benchmarks.syncbn", "--distributed", "--device", "cpu", "--shapes", "8x4x4",
         "--configs", "fp32-nchw", "--batch", "4", "--reps", "3", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "syncbn_dist_cpu.json").read_text())
    assert data["world_size"] == 2 and data["backend"] == "gloo"
    rows = {r["impl"]: r for r in data["rows"]}
    assert rows["tritamp"]["time_ms"] > 0
    assert rows["tritamp"]["timing"] == "wall clock, slowest rank"
    assert rows["tritamp"]["layout"] == "fp32-nchw 8x4x4 x2 ranks"
    assert rows["torch sync"]["note"].startswith("skipped")
    assert proc.stdout.count("wrote ") == 1  # rank 0 only
