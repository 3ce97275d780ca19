"""What the benchmarks promise about their numbers, checked on synthetic inputs without a
GPU and without timing anything: opt_levels' per-round medians, its ratios' direction and
baselines, its targets' verdicts, its defaults and exit status; the host-overhead verdicts
at their limits; how the compile report reads registers, spills and access widths from
the compiled code; the bytes-moved formulas and units of the optimizer and norm rows; the
GPU report's exit status and --only on a (faked) GPU machine."""
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from benchmarks import bf16_weights, gpu_report, norms, opt_levels
from benchmarks import optimizers as ob
from benchmarks.sass import loop_barriers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- opt_levels: rows, ratios, targets ------------------------------------------------------
def _raw(config, times, rounds, round_ids, first=0.5, loss=1.0):
    return dict(config=config, first=first, times=list(times), rounds=list(rounds),
                round_ids=list(round_ids), syncs_per_step=0, peak_memory_mb=10.0,
                final_loss=loss)


def _measured_rows(levels=("O0", "O2-bf16", "torch-fp32", "torch.amp", "torch.amp-bf16")):
    ids = [(0, 0), (1, 0)]
    raw = {
        "torch.amp-bf16": _raw("torch.amp-bf16", [0.010, 0.010, 0.040], [0.010, 0.020], ids),
        "torch.amp": _raw("torch.amp", [0.010], [0.040, 0.040], ids),
        "torch-fp32": _raw("torch-fp32", [0.010], [0.010, 0.010], ids),
        "O2-bf16": _raw("O2-bf16", [0.020, 0.020, 0.080], [0.020, 0.030], ids, loss=1.0),
        "O0": _raw("O0", [0.010], [0.030, 0.030], ids, loss=2.0),
    }
    args = types.SimpleNamespace(levels=list(levels))
    return opt_levels._rows(dict(batch_size=4), {k: raw[k] for k in levels}, args)


def test_rows_give_the_median_step_in_ms_and_the_ratio_of_this_config_to_its_baselines():
    rows = {r["config"]: r for r in _measured_rows()}
    o2 = rows["O2-bf16"]
    assert o2["step_ms"] == pytest.approx(20.0)           # median of 20, 20, 80 ms
    assert o2["samples_per_s"] == pytest.approx(4 / 0.020)
    assert o2["first_step_extra_s"] == pytest.approx(0.5 - 0.020)
    assert o2["round_ms"] == pytest.approx([20.0, 30.0])
    # this configuration's round / the baseline's same round: 2.0 and 1.5, median 1.75
    assert o2["vs_torch_amp_bf16"] == pytest.approx(1.75)
    # a bf16 configuration's same-dtype baseline is torch.amp-bf16, not fp16 torch.amp
    assert o2["vs_torch_same_dtype"] == pytest.approx(1.75)
    assert rows["O0"]["vs_torch_same_dtype"] == pytest.approx(3.0)  # against torch-fp32
    assert rows["O0"]["vs_torch_amp_bf16"] == pytest.approx(2.25)


def test_target_verdicts_take_the_limit_itself_as_met_and_judge_o0_against_fp32_torch():
    rows = [dict(config="O2-bf16", vs_torch_amp_bf16=1.10),
            dict(config="O0", vs_torch_amp_bf16=0.5, vs_torch_same_dtype=1.5),
            dict(config="torch-fp32", vs_torch_amp_bf16=0.4, vs_torch_same_dtype=1.0),
            dict(config="torch.amp-bf16", vs_torch_amp_bf16=1.0, vs_torch_same_dtype=1.0)]
    verdicts = dict((text.split(" ")[0], (text, met))
                    for text, met in opt_levels.target_lines(rows))
    text, met = verdicts["O2-bf16"]
    assert met is True and "1.100x met" in text
    text, met = verdicts["O0"]
    assert met is False and text.startswith("O0 <= 1.02x torch-fp32: 1.500x NOT met")


def test_cpu_defaults_can_judge_every_target_and_run_contiguous_tensors():
    for config, baseline, _ in opt_levels.TARGETS:
        assert config in opt_levels.CPU_LEVELS and baseline in opt_levels.CPU_LEVELS
    args = opt_levels.parse_args(["--device", "cpu"])
    assert all(w["channels_last"] is False for w in args.workload_specs.values())


def test_gpu_defaults_run_every_configuration_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = opt_levels.parse_args(["--device", "cuda"])
    assert args.levels == list(opt_levels.CONFIGS) and args.threads == 0
    assert [w["repeats"] for w in args.workload_specs.values()] == [1, 1]


@pytest.mark.parametrize("flag", ["--rounds", "--repeats", "--steps-per-round", "--warmup"])
def test_zero_rounds_steps_or_repeats_are_refused(flag, capsys):
    with pytest.raises(SystemExit):
        opt_levels.parse_args(["--device", "cpu", flag, "0"])
    assert "must be >= 1" in capsys.readouterr().err


def test_a_configuration_named_twice_is_refused(capsys):
    # (two workers under one name would share a row, and each round two medians)
    with pytest.raises(SystemExit):
        opt_levels.parse_args(["--device", "cpu", "--levels", "O0,torch.amp-bf16,O0"])
    assert "['O0'] named more than once in --levels" in capsys.readouterr().err


class _FakeWorker:
    """A configuration's worker: each run answers [1, 5, 2] ms (median 2 ms, min 1 ms)."""
    calls = []
    started = []

    def __init__(self, name, argv=None, peak=10.0):
        self.name, self.peak = name, peak
        _FakeWorker.started.append(name)

    def ask(self, cmd, **kw):
        _FakeWorker.calls.append((cmd, self.name))
        if cmd == "setup":
            return dict(first_step_s=0.5, warmup_s=0.5)
        if cmd == "run":
            return dict(times=[0.001, 0.005, 0.002][:kw["steps"]])
        return dict(syncs_per_step=0, final_loss=1.0, peak_memory_mb=self.peak)

    def close(self):
        pass


def test_rounds_rotate_the_order_and_record_the_round_median_per_repetition():
    _FakeWorker.calls = []
    workers = [_FakeWorker(n) for n in "ABC"]
    spec = dict(warmup=1, rounds=3, steps_per_round=3)
    rows = {}
    opt_levels._one_repetition(spec, workers, None, rows, repetition=0)
    runs = [name for cmd, name in _FakeWorker.calls if cmd == "run"]
    assert runs == list("ABC" "BCA" "CAB")
    assert rows["A"]["rounds"] == [0.002] * 3 and len(rows["A"]["times"]) == 9
    # a second repetition: its rounds keep their repetition, the peak memory its maximum
    workers = [_FakeWorker(n, peak=4.0) for n in "ABC"]
    opt_levels._one_repetition(spec, workers, None, rows, repetition=1)
    assert rows["B"]["round_ids"] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert rows["B"]["peak_memory_mb"] == 10.0


def test_a_workload_runs_only_its_own_repetitions(monkeypatch):
    monkeypatch.setattr(opt_levels, "Worker", _FakeWorker)
    _FakeWorker.started = []
    base = dict(warmup=1, rounds=1, steps_per_round=1, batch_size=2)
    workloads = {"once": dict(base, repeats=1), "twice": dict(base, repeats=2)}
    args = types.SimpleNamespace(levels=["O0", "torch.amp-bf16"], device="cpu", threads=1)
    out = opt_levels.measure(workloads, args)
    assert len(_FakeWorker.started) == 4  # two fresh sets of workers
    assert [len(r["round_ms"]) for r in out["once"]] == [1, 1]
    assert [len(r["round_ms"]) for r in out["twice"]] == [2, 2]


def test_a_run_missing_a_configuration_fails_and_its_table_keeps_its_columns(
        monkeypatch, tmp_path, capsys):
    levels = ["O0", "O2-bf16", "torch-fp32", "torch.amp", "torch.amp-bf16"]
    monkeypatch.setattr(opt_levels, "measure",
                        lambda specs, args: {w: _measured_rows(levels[:-2] + levels[-1:])
                                             for w in specs})
    monkeypatch.setattr(opt_levels, "write_chart", lambda *a: None)
    rc = opt_levels.main(["--device", "cpu", "--workloads", "cnn-sgd", "--levels",
                          ",".join(levels), "--out", str(tmp_path)])
    assert rc == 1  # torch.amp did not run
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("O0 ")]
    # config, samples/s, step ms, vs torch.amp-bf16, vs same dtype, peak, syncs, 1st, loss/O0
    assert line.split()[3:5] == ["2.25x", "3.00x"] and line.split()[-1] == "1.000"
    (line,) = [ln for ln in out.splitlines() if ln.startswith("O2-bf16 ")]
    assert line.split()[-1] == "0.500"  # its final loss / O0's
    data = json.loads((tmp_path / "opt_levels_cpu.json").read_text())
    assert [r["config"] for r in data["workloads"][0]["rows"]] == \
        ["O0", "O2-bf16", "torch-fp32", "torch.amp-bf16"]


def test_tritamp_and_torch_configurations_step_the_same_optimizer():
    params = [torch.nn.Parameter(torch.ones(2))]
    for name in ("sgd", "adamw"):
        ours = opt_levels.make_optimizer("tritamp", name, params).param_groups[0]
        theirs = opt_levels.make_optimizer("torch", name, params).param_groups[0]
        shared = (set(ours) & set(theirs)) - {"params"}
        assert {"lr", "weight_decay"} <= shared
        assert {k: ours[k] for k in shared} == {k: theirs[k] for k in shared}, name


def test_torch_baselines_use_torchs_layer_norm_and_scale_only_fp16(monkeypatch):
    seen = []
    build = opt_levels.build_model

    def spy(*a, fused_norms=False, **kw):
        seen.append(fused_norms)
        return build(*a, fused_norms=fused_norms, **kw)

    monkeypatch.setattr(opt_levels, "build_model", spy)
    workload = dict(model="transformer", optimizer="adamw", batch_size=1, image_size=4,
                    width=16, depth=1, heads=2)
    for name, scaled in (("torch.amp-bf16", False), ("torch.amp", True)):
        run = opt_levels.Run(name, workload, torch.device("cpu"))
        (scaler,) = [c.cell_contents for c in run.step.__closure__
                     if isinstance(c.cell_contents, torch.amp.GradScaler)]
        assert scaler.is_enabled() is scaled, name
    assert seen == [False, False]


# -- host_overhead and compile_report (each switches Triton's interpreter off on import:
#    in a process of their own) ---------------------------------------------------------
_CHILD = r"""
import json, types
from benchmarks import compile_report as cr, host_overhead as ho
out = {}
torch_row = dict(config="torch AdamW", level=None, optimizer="torch", regime="same",
                 error=None, steady=dict(median_us=310.0), launches=None)
ours = dict(config="O2 FusedAdam fp16", level="O2", optimizer="adam", regime="same",
            error=None, steady=dict(median_us=150.0), launches=dict(per_group=3.0))
fresh = dict(ours, regime="fresh", steady=dict(median_us=900.0),
             launches=dict(per_group=9.0))
out["verdict"] = ho.verdict([torch_row, ours, fresh])
out["norm_table"] = ho.norm_table([dict(case="LayerNorm forward", ours_us=10.0, torch_us=5.0,
                                        ratio=2.0, floor_us=1.0, launch_floor_us=2.0,
                                        target_us=10.0, launches=["k"])])
out["norm_rows"] = ho.run_norms(rounds=1, calls_per_round=1, warmup=1)[:1]
sass = '''
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0010*/               @P0 LDG.E.U16 R6, desc[UR4][R2.64] ;
        /*0020*/                   LDG.E R7, desc[UR4][R2.64] ;
        /*0030*/               @!P1 STG.E.64 desc[UR4][R8.64], R4 ;
'''
out["widths"] = cr.access_widths(sass)
res = "Function k:\n REG:40 STACK:8 SHARED:0 LOCAL:16 CONSTANT[0]:900 TEXTURE:0"
cr.subprocess.run = lambda argv, **kw: types.SimpleNamespace(
    stdout=res if "cuobjdump" in argv[0] else sass)
asm = {"ptx": ".target sm_90", "cubin": b"cubin"}
cr._SPECS[:] = [types.SimpleNamespace(compile=lambda: types.SimpleNamespace(asm=asm))]
out["compiled"] = cr._compile_index(0)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def child():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_host_overhead_verdict_meets_its_limits_exactly_and_judges_the_same_regime(child):
    lines = child["verdict"].splitlines()
    assert len(lines) == 1  # the O2 FusedAdam row with gradients keeping their addresses
    (line,) = lines
    assert "steady state 150 us (absolute target <= 150: met)" in line
    assert "; 0.48x the torch baseline of this run" in line and "310 us: met)" in line
    assert "launches per dtype group 3.0 (target <= 3: met)" in line
    assert "NOT" not in line


def test_norm_table_meets_its_target_exactly_and_the_ratio_is_ours_over_torchs(child):
    assert "| 10 (met) |" in child["norm_table"]
    (row,) = child["norm_rows"]
    assert row["ratio"] == pytest.approx(row["ours_us"] / row["torch_us"])


def test_compile_report_reads_widths_masks_registers_and_spills(child):
    w = child["widths"]
    assert w["load"] == {"16": 1, "2": 1, "4": 1} and w["masked_load"] == {"2": 1}
    assert w["store"] == {"8": 1} and w["masked_store"] == {"8": 1}
    c = child["compiled"]
    assert c.get("error") is None and c["sm90"] is True
    assert (c["reg"], c["stack"], c["local"], c["spills"]) == (40, 8, 16, 24)
    assert (c["widest_load"], c["widest_store"]) == (16, 8)


def test_a_barrier_before_a_loops_label_is_not_in_the_loop():
    sass = """
        /*0000*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_0:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   FADD R4, R4, R5 ;
        /*0030*/               @P0 BRA `(.L_x_0) ;
        /*0040*/                   EXIT ;
"""
    assert loop_barriers(sass) == (1, 0)


# -- bytes moved, units, ratios of the CPU rows ---------------------------------------------
def test_optimizer_bytes_per_element_count_every_read_and_write():
    # fp16 grad checked (2); master, grad, states read; master, states, half copy written
    assert ob.bytes_per_element("tritamp", 2) == 2 + (4 + 2 + 8) + (4 + 8 + 2) == 30
    assert ob.bytes_per_element("tritamp", 1) == 22
    # fp32 grad unscaled in place (read + write); param, grad, states read; param, states
    assert ob.bytes_per_element("torch fused", 2) == 8 + (4 + 4 + 8) + (4 + 8) == 36
    assert ob.bytes_per_element("torch foreach", 1) == 28


def test_a_row_reports_gb_per_s_from_ms_and_its_share_of_the_copy_bandwidth():
    timed = lambda step: [2.0, 1.0, 3.0, "cpu wall clock", None]  # noqa: E731
    make = lambda: (lambda: None, 4_000_000, None)  # noqa: E731
    row = ob.time_row(dict(optimizer="adam", impl="tritamp"), make, torch.device("cpu"),
                      timed, 4.0)
    assert row["time_ms"] == 2.0 and row["bytes"] == 4_000_000
    assert row["gbps"] == pytest.approx(2.0)  # 4 MB in 2 ms
    assert row["copy_bw_fraction"] == pytest.approx(0.5)


def test_copy_bandwidth_counts_the_read_and_the_write(monkeypatch):
    monkeypatch.setattr(ob, "free_bytes", lambda device: 16 * 1024)  # 1024 elements
    gbps = ob.copy_bandwidth(torch.device("cpu"), lambda fn: [1e-3])
    assert gbps == pytest.approx(2 * 4 * 1024 / 1e-6 / 1e9)


def test_the_cpu_timer_reports_the_median_sample(monkeypatch):
    ticks = iter([0.0, 0.001, 1.0, 1.005, 2.0, 2.002])  # 1, 5 and 2 ms
    monkeypatch.setattr(ob, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    med, p20, p80, how, host = ob.make_timer(torch.device("cpu"), 3)(lambda: None)
    assert med == pytest.approx(2.0) and how == "cpu wall clock" and host is None


def test_norm_rows_bytes_moved():
    # LayerNorm 2 x 4 bf16: x read, y written, weight and bias, fp32 mean and rstd per row
    assert norms._bytes(2, 4, 2, False, False) == 2 * 16 + 16 + 16 == 64
    # backward: dy and x read, dx written, weight read, two gradients written, mean/rstd
    assert norms._bytes(2, 4, 2, False, True) == 64 + 3 * 16 + 2 * 16 + 16 == 160
    assert norms._bytes(2, 4, 2, True, False) == 2 * 16 + 8 + 8 == 48
    assert norms._bytes(2, 4, 2, True, True) == 48 + 3 * 16 + 2 * 8 + 8 == 120


def test_bf16_weights_table_gives_loss_over_the_masters_loss():
    rows = [dict(mode="O2 masters", bytes_per_param=14.0, loss=2.0, ms_per_step=1.0),
            dict(mode="bf16 kahan", bytes_per_param=12.0, loss=1.0, ms_per_step=1.0)]
    assert "| bf16 kahan | 12.00 | 1.0000 | 0.500 | 1.00 |" in bf16_weights.format_table(rows)


# -- gpu_report on a machine with a (faked) GPU ---------------------------------------------
def test_gpu_report_runs_only_the_named_steps_and_fails_when_one_fails(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gpu_report, "environment", lambda: dict(device="Fake GPU"))
    ran = []

    def run_step(name, argv, limit):
        ran.append(name)
        return dict(name=name, argv=argv, limit_s=limit, seconds=1.0, returncode=0,
                    status="ok" if name == "kernels" else "failed", output="", stdout="",
                    stderr="")

    monkeypatch.setattr(gpu_report, "run_step", run_step)
    rc = gpu_report.main(["--only", "kernels,opt levels", "--out", str(tmp_path)])
    assert ran == ["opt levels", "kernels"] and rc == 1
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 2 and names[0].startswith("fake-gpu-") and names[0].endswith(".json")
    assert names[1] == names[0][:-len(".json")] + ".md"
    ran.clear()
    assert gpu_report.main(["--only", "kernels", "--out", str(tmp_path)]) == 0
    assert ran == ["kernels"]
