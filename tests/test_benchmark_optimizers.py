"""The optimizer benchmark runs its CPU smoke mode in-process and writes a valid JSON.

Under the test session the kernels run in Triton's interpreter, so the smoke run is a
tiny transformer layout; the layouts themselves are checked without running anything.
"""
import contextlib
import json
import os
import subprocess
import sys

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


@pytest.mark.parametrize("estimate_ms, calls", [
    (0.005, bench.GRAPH_MAX_CALLS),   # a 5 us kernel: capped (5 ms would take 1000 calls)
    (0.001, bench.GRAPH_MAX_CALLS),   # below the cap's 5 us: still capped
    (0.05, 100),                      # 100 calls make the graph's 5 ms
    (0.3, 17),                        # rounded up: 17 x 0.3 ms >= 5 ms
    (5.0, 1), (80.0, 1),              # one call is already long enough
    (0.0, bench.GRAPH_MAX_CALLS),     # below the events' resolution
    (float("nan"), bench.GRAPH_MAX_CALLS)])
def test_graph_calls_bounded_by_graph_time_and_capture_cost(estimate_ms, calls):
    assert bench.GRAPH_MS == 5.0 and bench.GRAPH_MAX_CALLS == 1000
    assert bench.graph_calls(estimate_ms) == calls


def test_quantiles_interpolate_between_order_statistics():
    xs = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert bench._quantiles(xs, (0.5, 0.0, 1.0, 0.25)) == [3.0, 1.0, 5.0, 2.0]
    assert bench._quantiles([1.0, 2.0], (0.5, 0.2)) == [1.5, pytest.approx(1.2)]
    assert bench._quantiles([7.0], (0.2, 0.8)) == [7.0, 7.0]


def test_time_budget_skips_the_rows_after_it_and_reports_each(monkeypatch):
    seen, calls = [], []

    def make():
        calls.append(1)
        return (lambda: None), 8, None

    timed = bench.make_timer(torch.device("cpu"), 1)
    bench.set_progress(seen.append)
    try:
        bench.set_budget(60)
        first = bench.time_row({}, make, torch.device("cpu"), timed, 1.0)
        now = bench.time.monotonic()
        monkeypatch.setattr(bench.time, "monotonic", lambda: now + 61)
        late = bench.time_row({}, make, torch.device("cpu"), timed, 1.0)
        bench.set_budget(None)
        after = bench.time_row({}, make, torch.device("cpu"), timed, 1.0)
    finally:
        bench.set_budget(None)
        bench.set_progress(None)
    assert "time_ms" in first and "time_ms" in after and len(calls) == 2  # the late row: no make
    assert late == {"note": "skipped: the time budget (60 s) ran out"}
    assert seen == [first, late, after]


@pytest.mark.parametrize("nbytes, l2, copies", [
    (25_000_000, 50_000_000, 4),      # a norm row of 25 MB under a 50 MB L2: 4 sets
    (60_000_000, 50_000_000, 2),
    (100_000_000, 50_000_000, 1),     # twice the cache or more: one set
    (1_000, 50_000_000, bench.ROTATE_MAX),
    (25_000_000, 0, 1),               # no cache known (a CPU)
])
def test_rotation_covers_twice_the_cache(nbytes, l2, copies):
    assert bench.rotation(nbytes, l2) == copies
    if 1 < copies < bench.ROTATE_MAX:
        assert copies * nbytes >= 2 * l2 > (copies - 1) * nbytes


def test_a_small_row_rotates_its_own_working_sets(monkeypatch):
    """A step that moves less than twice the L2 is made once per set and the sets are
    called in turn, each on its own tensors; the row says how many."""
    made, called = [], []

    def make():
        k = len(made)
        made.append(k)
        return (lambda: called.append(k)), 10_000_000, [torch.zeros(1)]

    monkeypatch.setattr(bench, "l2_bytes", lambda device: 50_000_000)
    timed = bench.make_timer(torch.device("cpu"), 2)
    row = bench.time_row({}, make, torch.device("cpu"), timed, 1.0)
    assert made == list(range(10)) and row["rotated"] == 10
    assert len(called) >= 2 and called == [i % 10 for i in range(len(called))]
    step = bench.Rotating([lambda k=k: called.append(k) for k in range(3)])
    called.clear()
    for _ in range(7):
        step()
    assert called == [0, 1, 2, 0, 1, 2, 0]
    assert row["bytes"] == 10_000_000  # bytes of one call, as before
    assert ", 10 sets" in bench.format_table([dict(row, optimizer="x", impl="tritamp",
                                                   layout="l", params=1, tensors=1)])
    monkeypatch.setattr(bench, "l2_bytes", lambda device: 0)
    made.clear()
    assert "rotated" not in bench.time_row({}, make, torch.device("cpu"), timed, 1.0)
    assert made == [0]


def test_freeze_imports_leaves_the_collections_between_rows_only_new_objects():
    # in a child: freezing is process-wide (the benchmarks call it as programs)
    code = ("import gc\n"
            "from benchmarks import optimizers as ob\n"
            "ob.freeze_imports()\n"
            "frozen = gc.get_freeze_count()\n"
            "assert frozen > 10000, frozen  # torch, triton, tritamp\n"
            "x = [[]]; x[0].append(x)  # new cyclic garbage is still collected\n"
            "del x\n"
            "assert gc.collect() >= 2 and gc.get_freeze_count() == frozen\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


class _FakeCuda:
    """Stand-ins for the torch.cuda calls of cuda_graph_ms: a device clock that a call of
    the step advances by ``call_ms`` (when not capturing) and a replay by its captured
    calls x ``call_ms`` x the next factor of ``replay_factors``."""

    def __init__(self, call_ms, replay_factors):
        self.clock, self.call_ms, self.factors = 0.0, call_ms, list(replay_factors)
        self.capturing, self.captured, self.replays, self.outside = False, 0, 0, 0
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None

            def record(self):
                self.t = fake.clock

            def elapsed_time(self, end):
                return end.t - self.t

        class CUDAGraph:
            def replay(self):
                fake.replays += 1
                fake.clock += fake.captured * fake.call_ms * fake.factors.pop(0)

        self.Event, self.CUDAGraph = Event, CUDAGraph

    def step(self):
        if self.capturing:
            self.captured += 1
        else:
            self.outside += 1
            self.clock += self.call_ms

    def graph(self, g):
        @contextlib.contextmanager
        def capture():
            self.capturing = True
            yield
            self.capturing = False
        return capture()


@pytest.mark.parametrize("call_ms, calls", [(0.004, 1000), (0.05, 100), (2.0, 3), (9.0, 1)])
def test_cuda_graph_timer_captures_graph_calls_and_times_each_replay(monkeypatch, call_ms,
                                                                     calls):
    # the first replay uploads the graph (untimed), then 20 timed replays
    factors = [5.0] + [1.0 + 0.01 * i for i in range(bench.GRAPH_REPLAYS)]
    fake = _FakeCuda(call_ms, factors)
    for name, value in (("Event", fake.Event), ("CUDAGraph", fake.CUDAGraph),
                        ("graph", fake.graph), ("Stream", lambda: None),
                        ("stream", lambda s: contextlib.nullcontext()),
                        ("synchronize", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, value)
    med, p20, p80 = bench.cuda_graph_ms(fake.step)
    assert fake.captured == calls == bench.graph_calls(call_ms)
    assert fake.outside == 6 and fake.replays == 1 + bench.GRAPH_REPLAYS
    # per call: the replay's time / calls; quantiles over the 20 timed replays
    per_call = [call_ms * f for f in factors[1:]]
    assert med == pytest.approx(bench._quantiles(per_call, [0.5])[0])
    assert (p20, p80) == (pytest.approx(bench._quantiles(per_call, [0.2])[0]),
                          pytest.approx(bench._quantiles(per_call, [0.8])[0]))
    assert p20 < med < p80 and med < 5 * call_ms  # the upload replay is left out


def test_the_tritamp_row_steps_as_a_training_step_does_preparing_nothing():
    """The tritamp row's step is amp's steady state: the overflow check prepared once
    (it timed the one-shot check before: validation, tables and their upload at every
    call, 1-4 ms of host time a step on the GPU machine), then the fused step."""
    import tritamp.kernels as K
    from tritamp.testing import recording_uploads
    spec = bench.optimizer_specs()["adam"]
    shapes = bench.layout_shapes("transformer", bench.parse_size("20K"))
    prepares = []
    real = K.check_unscale_prepare
    K.check_unscale_prepare = lambda *a, **k: prepares.append(1) or real(*a, **k)
    try:
        step, keep = bench.tritamp_step(spec, shapes, torch.device("cpu"), torch.bfloat16)
        step()
        step()
        prepares.clear()
        with recording_uploads() as uploads:
            for _ in range(3):
                step()
    finally:
        K.check_unscale_prepare = real
    assert prepares == [] and uploads == []


def test_no_ratio_between_rows_timed_differently():
    """A torch baseline that cannot be captured in a CUDA graph (its step reads the
    overflow flag on the host) is timed with events around plain calls, host included;
    dividing it by a graph replay's device time gave Adagrad's 15-38x. No ratio there."""
    key = dict(optimizer="adagrad", layout="resnet50", size="25M", params=25_000_000,
               tensors=161, time_ms_p20=0.2, time_ms_p80=0.3, bytes=1e8, gbps=400.0)
    ours = dict(key, impl="tritamp", time_ms=0.25, timing="cuda graph")
    theirs = dict(key, impl="torch foreach", time_ms=3.7, timing="cuda events")
    same = dict(key, optimizer="adam", impl="tritamp", time_ms=1.0, timing="cuda graph")
    fused = dict(same, impl="torch fused", time_ms=1.5)
    rows = [ours, theirs, same, fused]
    bench.add_ratios(rows)
    assert ours["ratio_to_torch"] is None and "timed by cuda events" in ours["ratio_note"]
    assert same["ratio_to_torch"] == 1.5 and "ratio_note" not in same
    assert "no ratio" in bench.format_table(rows)
