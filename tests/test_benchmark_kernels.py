"""benchmarks/kernels.py gathers every kernel benchmark in one format; CPU smoke run."""
import json

import pytest

from benchmarks import kernels as kb  # noqa: E402


def test_smoke_run_writes_one_table(tmp_path, capsys):
    rc = kb.main(["--device", "cpu", "--sizes", "20K", "--optimizer-sizes", "20K,2K",
                  "--layouts", "transformer", "--cpu-reps", "1", "--out", str(tmp_path)])
    assert rc == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "CPU figures" in out and "amp check" in out and "adam" in out
    data = json.loads((tmp_path / "kernels_cpu.json").read_text())
    # one progress line per row on stderr, as it is measured (a run cut short keeps them)
    progress = [line for line in captured.err.splitlines() if line.startswith("kernels: ")]
    assert len(progress) == len(data["rows"])
    assert progress[0].startswith("kernels: amp check [tritamp] transformer")
    names = {r["optimizer"] for r in data["rows"]}
    assert {"amp check", "amp unscale->fp32", "l2norm", "adam", "sgd", "layer_norm fwd",
            "layer_norm fwd+bwd", "rms_norm fwd", "rms_norm fwd+bwd"} <= names
    assert any(n.startswith("syncbn") for n in names), names
    for r in data["rows"]:
        assert r["device"] == data["device"] and "torch" in r and "tritamp" in r
        if "time_ms" in r:
            assert r["gbps"] > 0 and r["bytes"] > 0
    # run order: the second optimizer size (2K) after SyncBatchNorm (a budget cuts the later
    # sizes, not a whole kind of row); the table keeps SyncBatchNorm last
    kinds = [("syncbn" if "kernels: syncbn" in line else "2K" if " 2K" in line else
              "20K-opt" if line.startswith(("kernels: adam ", "kernels: sgd ")) else None)
             for line in progress]
    first_sync, last_sync = kinds.index("syncbn"), len(kinds) - 1 - kinds[::-1].index("syncbn")
    assert "20K-opt" in kinds[:first_sync] and "2K" not in kinds[:last_sync + 1]
    assert "2K" in kinds[last_sync + 1:]
    names = [r["optimizer"] for r in data["rows"]]
    first_syncbn = next(i for i, n in enumerate(names) if n.startswith("syncbn"))
    assert all(n.startswith("syncbn") for n in names[first_syncbn:])
    assert any(r["size"] == "2K" for r in data["rows"][:first_syncbn])


def test_a_spent_budget_still_writes_the_table_with_every_row_skipped(tmp_path, capsys):
    rc = kb.main(["--device", "cpu", "--sizes", "20K", "--layouts", "transformer",
                  "--cpu-reps", "1", "--no-syncbn", "--budget-s", "0", "--out", str(tmp_path)])
    assert rc == 0  # skipped rows are not failures
    captured = capsys.readouterr()
    data = json.loads((tmp_path / "kernels_cpu.json").read_text())
    assert data["rows"] and all(
        r.get("note") == "skipped: the time budget (0 s) ran out" and "time_ms" not in r
        for r in data["rows"])
    progress = [line for line in captured.err.splitlines() if line.startswith("kernels: ")]
    assert len(progress) == len(data["rows"])
    assert progress[0].endswith(": skipped: the time budget (0 s) ran out")
    assert "ran out" in captured.out  # the table shows why


def test_budget_must_be_a_number_of_seconds(capsys):
    with pytest.raises(SystemExit):
        kb.parse_args(["--device", "cpu", "--budget-s", "-1"])
    assert "--budget-s must be a number of seconds >= 0; got -1.0" in capsys.readouterr().err


def _results(out):
    return [t.clone() if t is not None else None
            for t in (out if isinstance(out, tuple) else (out,))]


def test_the_registry_rows_time_the_prepared_launch_and_compute_what_the_launcher_does():
    """tritamp's amp / l2norm rows time one launch of a sweep prepared once (what a
    training step pays), and that launch gives what the one-shot launcher gives."""
    import torch
    from tritamp.kernels import registry
    shapes = [(64,), (33, 5), (7,)]
    device = torch.device("cpu")
    seen = set()
    for op in registry.OPS:
        for row, make_sample in op.benchmarks.items():
            seen.add(row)
            whole, _ = make_sample(shapes, device)
            kept, _ = make_sample(shapes, device)
            step = kb.prepared_step(op, kept)
            assert "launch" in step.__code__.co_names, row  # not the one-shot launcher
            for _ in range(2):  # the kept sweep called again: the same result each time
                got = _results(step())
                want = _results(whole.call(op.launcher))
                for g, w in zip(got, want):
                    assert (g is None) == (w is None)
                    if g is not None:
                        torch.testing.assert_close(g, w, rtol=0, atol=0)
                for (name, a), (_, b) in zip(op.arguments(kept), op.arguments(whole)):
                    if a is not None:
                        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{row}: {name}")
    assert {"amp check", "amp unscale->fp32", "l2norm"} <= seen
