"""benchmarks/bf16_weights.py: the bytes per parameter it reports are counted from the
tensors (14 with fp32 masters, 10 stochastic, 12 Kahan, 6 with bf16 moments), every mode
trains, and the table and JSON say so."""
import json

from benchmarks import bf16_weights


def test_bytes_per_param_and_losses(tmp_path, capsys):
    out = tmp_path / "bf16.json"
    assert bf16_weights.main(["--steps", "30", "--width", "64", "--device", "cpu",
                              "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == list(bf16_weights.MODES)
    for r in rows:
        assert r["bytes_per_param"] == r["expected_bytes"] == bf16_weights.EXPECTED_BYTES[r["mode"]]
        assert 0 < r["loss"] < 5 and r["ms_per_step"] > 0
    table = capsys.readouterr().out
    assert "| bf16 kahan | 12.00 |" in table and "| O2 masters | 14.00 |" in table
