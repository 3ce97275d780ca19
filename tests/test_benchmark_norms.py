"""benchmarks/norms.py: CPU smoke run (one small shape) writes its table and JSON."""
import json

from benchmarks import norms as nb  # noqa: E402


def test_norm_benchmark_smoke(tmp_path, capsys):
    rc = nb.main(["--device", "cpu", "--rows", "8", "--widths", "96", "--dtypes", "fp32,bf16",
                  "--cpu-reps", "1", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "CPU figures" in out and "layer_norm fwd+bwd" in out and "rms_norm fwd" in out
    data = json.loads((tmp_path / "norms_cpu.json").read_text())
    assert len(data["rows"]) == 2 * 2 * 2 * 2   # dtypes x {layer, rms} x {fwd, fwd+bwd} x impls
    for r in data["rows"]:
        assert r["time_ms"] > 0 and r["gbps"] > 0 and r["device"] == data["device"]
        if r["impl"] == "tritamp":
            assert r["ratio_to_torch"] > 0 and r["baseline"] == "torch fused"
