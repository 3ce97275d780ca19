"""benchmarks/gpu_report.py: one line and nothing run without a GPU; the plan it would run
on one (every benchmark, the GPU tests, under 10 minutes of limits); the report it writes."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks import gpu_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_without_a_gpu_it_prints_one_line_and_runs_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_report", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [gpu_report.NO_GPU]
    assert list(tmp_path.iterdir()) == []


def test_the_plan_runs_every_benchmark_and_the_gpu_tests_within_ten_minutes():
    for gpus, distributed in ((1, False), (2, True)):
        steps = gpu_report.plan(gpus)
        assert sum(limit for _, _, limit in steps) < 600
        commands = [" ".join(cmd[1:]) for _, cmd, _ in steps]
        assert any("pytest -q -m gpu" in c for c in commands)
        for module in ("opt_levels", "kernels", "host_overhead", "compile_report"):
            assert any(f"-m benchmarks.{module}" in c for c in commands), module
            assert os.path.exists(os.path.join(ROOT, "benchmarks", f"{module}.py"))
        assert any("torch.distributed.run --nproc_per_node 2 -m benchmarks.syncbn "
                   "--distributed" in c for c in commands) == distributed
        # the compile report first (it fills Triton's cache for the later steps)
        assert steps[0][0] == "compile report" and "--workers" not in steps[0][1]
        # the kernel benchmark stops starting rows before its limit, so its table is written
        (name, cmd, limit), = [s for s in steps if s[0] == "kernels"]
        budget = float(cmd[cmd.index("--budget-s") + 1])
        assert 0 < budget <= limit - 10


def test_a_step_that_fails_or_runs_out_of_time_is_reported():
    ok = gpu_report.run_step("ok", [sys.executable, "-c", "print('table')"], 60)
    assert (ok["status"], ok["returncode"], ok["output"].strip()) == ("ok", 0, "table")
    bad = gpu_report.run_step("bad", [sys.executable, "-c", "import sys; sys.exit(3)"], 60)
    assert (bad["status"], bad["returncode"]) == ("failed", 3)
    slow = gpu_report.run_step("slow", [sys.executable, "-c", "import time; time.sleep(30)"], 1)
    assert slow["status"] == "timed out" and slow["returncode"] is None


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def test_a_step_out_of_time_takes_its_child_processes_with_it(tmp_path):
    """The benchmarks start worker processes (opt_levels: one per configuration, each
    holding GPU memory; the compile report: a pool): at the step's limit they go too,
    and what the step printed before it is kept."""
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n")
    t0 = time.monotonic()
    slow = gpu_report.run_step("slow", [sys.executable, "-c", script], 3)
    assert slow["status"] == "timed out" and time.monotonic() - t0 < 30
    assert "started" in slow["output"]
    pid = int(pid_file.read_text())
    for _ in range(100):  # gone within moments of the kill (or a zombie not yet reaped)
        if not _alive(pid):
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        raise AssertionError("the step's child process outlived the step's time limit")


def test_the_report_has_the_environment_and_every_step(tmp_path):
    env = dict(device="NVIDIA H100 80GB HBM3", gpus=1, capability="9.0", sms=132,
               memory_gib=79.1, driver="560.35", cuda="12.6", torch="2.14.1", triton="3.8.0",
               python="3.11.7", host="h", date="2026-11-25")
    results = [dict(name="kernels", argv=["python", "-m", "benchmarks.kernels"], limit_s=150,
                    seconds=12.5, status="ok", returncode=0, output="| row | 1.0 |\n"),
               dict(name="gpu tests", argv=["python", "-m", "pytest"], limit_s=150,
                    seconds=150.0, status="timed out", returncode=None, output="")]
    js, md = gpu_report.write_report(env, results, str(tmp_path))
    assert os.path.basename(js) == "nvidia-h100-80gb-hbm3-2026-11-25.json"
    data = json.loads(open(js).read())
    assert data["environment"]["driver"] == "560.35" and len(data["steps"]) == 2
    text = open(md).read()
    for fact in ("NVIDIA H100 80GB HBM3", "| driver | 560.35 |", "| triton | 3.8.0 |",
                 "| kernels | ok | 12.5 (150) |", "| gpu tests | timed out |",
                 "| row | 1.0 |"):
        assert fact in text, fact


def test_the_report_keeps_a_table_that_long_progress_lines_follow(tmp_path):
    """benchmarks.kernels prints its table on stdout and a progress line per row on
    stderr: the Markdown report shows the whole table and only the end of the rest."""
    script = ("import sys\n"
              "print('| the table | 1.0 |')\n"
              "for i in range(4000): print(f'kernels: row {i}: 0.1 ms', file=sys.stderr)\n")
    step = gpu_report.run_step("kernels", [sys.executable, "-c", script], 60)
    assert step["stdout"].strip() == "| the table | 1.0 |"
    assert step["stderr"].count("kernels: row") == 4000
    assert step["output"] == step["stdout"] + step["stderr"]
    env = dict(device="NVIDIA H100 80GB HBM3", date="2026-11-26")
    js, md = gpu_report.write_report(env, [step], str(tmp_path))
    text = open(md).read()
    assert "| the table | 1.0 |" in text and "kernels: row 3999: 0.1 ms" in text
    assert "kernels: row 0: 0.1 ms" not in text  # (the start of stderr gives way)
    assert json.loads(open(js).read())["steps"][0]["stderr"].count("kernels: row") == 4000


def test_only_refuses_an_unknown_step_on_any_machine(tmp_path, capsys):
    for only in ("gpu tests,kernals", " , "):
        with pytest.raises(SystemExit) as exc:
            gpu_report.main(["--only", only, "--out", str(tmp_path)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--only: unknown step(s)" in err and "'kernels'" in err
    assert list(tmp_path.iterdir()) == []
