"""The main job's benchmark runs in a smoke mode and writes a valid JSON and a PNG."""
import json
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from benchmarks import opt_levels  # noqa: E402


def test_smoke_run_writes_table_json_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rc = opt_levels.main(["--device", "cpu", "--workloads", "cnn-sgd",
                          "--levels", "O0,O2,O2-bf16,torch.amp,torch.amp-bf16",
                          "--batch-size", "2", "--image-size", "8", "--rounds", "2",
                          "--repeats", "1", "--steps-per-round", "1", "--warmup", "1",
                          "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "samples/s" in out and "O2-bf16" in out and "vs torch.amp-bf16" in out
    assert "target O2-bf16 <= 1.10x torch.amp-bf16" in out
    data = json.loads((tmp_path / "opt_levels_cpu.json").read_text())
    assert data["torch"] == torch.__version__ and "triton" in data and "tritamp" in data
    assert data["threads"] == 1
    (res,) = data["workloads"]
    assert res["workload"] == "cnn-sgd" and res["model"] == "small-cnn" and res["rounds"] == 2
    assert [r["config"] for r in res["rows"]] == ["O0", "O2", "O2-bf16", "torch.amp",
                                                  "torch.amp-bf16"]
    for row in res["rows"]:
        assert row["samples_per_s"] > 0 and row["syncs_per_step"] == 0
        assert len(row["round_ms"]) == 2
    rows = {r["config"]: r for r in res["rows"]}
    assert rows["torch.amp-bf16"]["vs_torch_amp_bf16"] == 1.0
    assert rows["torch.amp"]["vs_torch_same_dtype"] == 1.0
    assert rows["O0"]["vs_torch_same_dtype"] is None  # no torch-fp32 row in this run
    png = (tmp_path / "opt_levels_cpu.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_ratio_is_the_median_of_per_round_ratios():
    row = dict(rounds=[2.0, 9.0, 3.0])
    base = dict(rounds=[1.0, 3.0, 2.0])
    assert opt_levels._ratio(row, base) == 2.0  # median of 2.0, 3.0, 1.5


def test_target_lines_give_the_rounds_middle_half():
    """Each target's verdict is the median's; beside it the middle half of the per-round
    ratios, and whether the target lies inside it (a verdict the machine's noise can
    flip)."""
    base = dict(config="torch.amp-bf16", rounds=[1.0] * 5)
    near = dict(config="O1-bf16", rounds=[0.97, 0.99, 1.01, 1.02, 1.05])
    far = dict(config="O3-bf16", rounds=[0.80, 0.82, 0.85, 0.86, 0.90])
    rows = []
    for r in (near, far, base):
        rows.append(dict(config=r["config"], vs_torch_amp_bf16=opt_levels._ratio(r, base),
                         vs_torch_amp_bf16_middle_half=opt_levels._spread(r, base)))
    (near_text, near_met), (far_text, far_met) = opt_levels.target_lines(rows)
    assert near_met is False and "1.010x NOT met" in near_text
    assert "middle half 0.990-1.020x: the target lies within it" in near_text
    assert far_met is True and "middle half 0.820-0.860x)" in far_text
    assert opt_levels._spread(dict(rounds=[1.0]), dict(rounds=[1.0])) is None
    # a ratio that rounds to the limit shows the digits that put it over (it printed
    # "1.000x NOT met")
    over = [dict(config="O1-bf16", vs_torch_amp_bf16=1.0004), dict(config="torch.amp-bf16",
                                                                   vs_torch_amp_bf16=1.0)]
    (text, met), = opt_levels.target_lines(over)
    assert met is False and "1.00040x NOT met" in text


def test_rounds_pair_with_the_same_round_of_the_baseline():
    """A configuration that failed its set-up in one repetition has fewer rounds: paired
    by position, every later round met another round of the baseline (a true 1.0 came
    out 1.5). Rounds pair by (repetition, round)."""
    base = dict(config="torch.amp-bf16", rounds=[2.0, 2.0, 3.0, 3.0],
                round_ids=[(0, 0), (0, 1), (1, 0), (1, 1)])
    late = dict(config="O1-bf16", rounds=[3.0, 3.0], round_ids=[(1, 0), (1, 1)])
    assert opt_levels._ratio(late, base) == 1.0
    assert opt_levels._spread(late, base) == [1.0, 1.0]
    alone = dict(config="O2-bf16", rounds=[1.0], round_ids=[(2, 0)])
    assert opt_levels._ratio(alone, base) is None


def test_cpu_defaults_run_three_workloads_without_fp16():
    args = opt_levels.parse_args(["--device", "cpu"])
    assert list(args.workload_specs) == ["cnn-sgd", "cnn-adamw", "transformer-adamw"]
    t = args.workload_specs["transformer-adamw"]
    assert (t["width"], t["heads"], t["depth"], t["image_size"], t["batch_size"]) == \
        (512, 8, 4, 128, 8)
    assert args.levels == opt_levels.CPU_LEVELS and args.threads == 1
    assert [w["repeats"] for w in args.workload_specs.values()] == [5, 5, 1]
    assert [w["rounds"] for w in args.workload_specs.values()] == [3, 3, 8]
    assert not any(opt_levels.CONFIGS[c][1] == torch.float16 for c in args.levels)


def test_gpu_defaults_give_the_host_bound_transformer_longer_rounds(monkeypatch):
    """On a GPU a transformer step takes ~15 ms, bound by the host's Python: its rounds
    are 40 steps (about half a second, as ResNet-50's 10), so host jitter averages out."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = opt_levels.parse_args(["--device", "cuda", "--rounds", "5"])
    specs = args.workload_specs
    assert list(specs) == ["cnn-sgd", "transformer-adamw"]
    assert [(w["steps_per_round"], w["warmup"], w["rounds"]) for w in specs.values()] == \
        [(10, 5, 5), (40, 5, 5)]
    args = opt_levels.parse_args(["--device", "cuda", "--model", "transformer"])
    assert [w["steps_per_round"] for w in args.workload_specs.values()] == [40]
    # a workload named on a GPU keeps the GPU's sizes (it ran the CPU's once)
    args = opt_levels.parse_args(["--device", "cuda", "--workloads", "transformer-adamw"])
    (t,) = args.workload_specs.values()
    assert (t["batch_size"], t["image_size"], t["depth"], t["steps_per_round"]) == \
        (32, 512, 6, 40)
    args = opt_levels.parse_args(["--device", "cuda", "--steps-per-round", "7"])
    assert [w["steps_per_round"] for w in args.workload_specs.values()] == [7, 7]


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
    rc = opt_levels.main(["--device", "cpu", "--model", "transformer", "--levels", "O2-bf16,torch.amp-bf16",
                          "--batch-size", "2", "--image-size", "8", "--rounds", "1",
                          "--steps-per-round", "1", "--warmup", "1", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "opt_levels_cpu.json").read_text())
    (res,) = data["workloads"]
    assert res["model"] == "transformer" and res["optimizer"] == "adamw"
    assert [r["config"] for r in res["rows"]] == ["O2-bf16", "torch.amp-bf16"]
    assert all(r["syncs_per_step"] == 0 for r in res["rows"])


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
