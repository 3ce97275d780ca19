"""One command for a machine with a GPU: the GPU tests and every benchmark, one report.

    python -m benchmarks.gpu_report                  # about 10 minutes on one H100
    python -m benchmarks.gpu_report --dry-run        # print the plan, run nothing

On a machine with a CUDA device it runs, each in its own process with its own time limit
(the limits add up to under 10 minutes):

1. ``benchmarks.compile_report`` (registers, spills and access widths of what the
   launchers compile for the device's architecture family, checked for sm_90), first,
   with one compile process per CPU (at most 16): what it compiles lands in Triton's
   cache under the keys the launches of the later steps look up, so they load those
   kernels instead of compiling them one at a time;
2. the tests marked ``gpu`` (``pytest -m gpu``);
3. ``benchmarks.opt_levels`` (the main job: every opt level on the default workloads);
4. ``benchmarks.kernels`` (amp's check/unscale, l2-norm, LayerNorm/RMSNorm at
   realistic token counts, every fused optimizer in fp16 and bf16 against torch,
   SyncBatchNorm, with GPU time from CUDA graphs, host time apart, bytes moved and the
   share of the measured copy bandwidth), with a time budget 15 s under its limit: the
   rows it has not reached by then are listed as skipped, and its table is still written;
5. ``benchmarks.host_overhead --quick`` (the host's share of a step and of a norm call);
6. SyncBatchNorm across 2 processes with ``torchrun`` (NCCL) when there are 2+ GPUs.

and writes ``benchmarks/results/<device>-<date>.json`` and ``.md``: the device, driver,
CUDA, torch and triton versions, and every step's outcome, time and table. A step that
fails or runs out of time is reported as such; the others still run. On a machine
without a CUDA device it prints one line saying so and exits.
"""
import argparse
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
NO_GPU = "gpu_report: no CUDA device on this machine; nothing was run (run it where one is)."


KERNELS_MARGIN_S = 15  # the kernel benchmark's budget ends this long before its limit


def plan(gpus):
    """[(name, argv, time limit in seconds)]: what runs, in order. The limits sum to
    under 10 minutes."""
    py = sys.executable
    kernels_limit = 130
    steps = [
        ("compile report", [py, "-m", "benchmarks.compile_report"], 50),
        ("gpu tests", [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                       "tests"], 85),
        ("opt levels", [py, "-m", "benchmarks.opt_levels", "--rounds", "5"], 260),
        ("kernels", [py, "-m", "benchmarks.kernels", "--sizes", "25M",
                     "--optimizer-sizes", "25M,100M",
                     "--budget-s", str(kernels_limit - KERNELS_MARGIN_S)], kernels_limit),
        ("host overhead", [py, "-m", "benchmarks.host_overhead", "--quick"], 30),
    ]
    if gpus >= 2:
        steps.append(("syncbn 2 processes", [py, "-m", "torch.distributed.run",
                                             "--nproc_per_node", "2", "-m",
                                             "benchmarks.syncbn", "--distributed"], 40))
    return steps


def _slug(text):
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "device"


def environment():
    """The device and every version that shapes a number in the report."""
    import triton
    props = torch.cuda.get_device_properties(0)
    driver = None
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                 "--format=csv,noheader"], capture_output=True, text=True,
                                timeout=30).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return dict(device=props.name, gpus=torch.cuda.device_count(),
                capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                memory_gib=round(props.total_memory / 2**30, 1), driver=driver,
                cuda=torch.version.cuda, torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), host=platform.node())


def run_step(name, argv, limit, cwd=ROOT):
    """Run one step; returns {name, argv, limit_s, seconds, status, returncode, output,
    stdout, stderr} (``output`` is both streams, stdout first).

    The step runs in a session of its own: at its limit the whole process group is
    killed, the worker processes it started included (opt_levels' workers hold GPU
    memory the next step needs), and what it printed until then is kept."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    except OSError as e:  # (not started: the report says so and the next step runs)
        msg = f"could not start: {type(e).__name__}: {e}"
        return dict(name=name, argv=argv, limit_s=limit, seconds=0.0, status="failed",
                    returncode=None, output=msg, stdout="", stderr=msg)
    try:
        out, err = proc.communicate(timeout=limit)
        status = "ok" if proc.returncode == 0 else "failed"
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        try:  # (every writer of the pipes in the group is gone: the rest comes at once)
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process outside the group holds a pipe
            proc.kill()
            out, err = "", "(the output could not be collected after the kill)"
        status, rc = "timed out", None
    finally:
        if proc.poll() is None:  # (interrupted: leave nothing behind)
            _kill_group(proc)
            proc.wait()
    output = out + err
    return dict(name=name, argv=argv, limit_s=limit, seconds=round(time.perf_counter() - t0, 1),
                status=status, returncode=rc, output=output, stdout=out, stderr=err)


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # (already gone)
        pass


STDOUT_CHARS = 80000  # of a step's standard output in the Markdown report (its tables)
STDERR_CHARS = 4000  # of its standard error (progress lines, warnings, a traceback): the end


def markdown(env, results):
    """The report as Markdown: the environment, a summary line per step, every output:
    a step's standard output (its tables, which the benchmarks print there) and the end
    of its standard error apart, so progress lines cannot push a table out. The JSON
    keeps both whole."""
    lines = [f"# GPU report: {env['device']}, {env['date']}", "",
             "| | |", "|---|---|"]
    for key in ("device", "gpus", "capability", "sms", "memory_gib", "driver", "cuda", "torch",
                "triton", "python"):
        lines.append(f"| {key} | {env.get(key)} |")
    lines += ["", "| step | status | seconds (limit) |", "|---|---|---|"]
    for r in results:
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']} ({r['limit_s']}) |")
    for r in results:
        lines += ["", f"## {r['name']}", "", f"`{' '.join(r['argv'][1:])}`: {r['status']}"]
        out, err = r.get("stdout"), r.get("stderr")
        if out is None:  # (a report from before the streams were kept apart)
            out, err = r["output"], ""
        out, err = out.rstrip(), err.rstrip()
        if len(out) > STDOUT_CHARS:
            out = f"(the first {STDOUT_CHARS} characters; the JSON has all)\n" + out[:STDOUT_CHARS]
        if out:
            lines += ["", "```text", out, "```"]
        if err:
            lines += ["", "standard error" + (f", its last {STDERR_CHARS} characters:"
                                               if len(err) > STDERR_CHARS else ":"),
                      "", "```text", err[-STDERR_CHARS:], "```"]
    return "\n".join(lines) + "\n"


def write_report(env, results, out_dir=RESULTS):
    """Write ``<device>-<date>.json`` and ``.md`` under ``out_dir``; returns both paths."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"{_slug(env['device'])}-{env['date']}")
    with open(base + ".json", "w") as f:
        json.dump(dict(environment=env, steps=results), f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(env, results))
    return base + ".json", base + ".md"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    ap.add_argument("--out", default=RESULTS, help="folder for the report")
    ap.add_argument("--only", default=None,
                    help="comma-separated step names to run (default: every step)")
    args = ap.parse_args(argv)
    wanted = None
    if args.only is not None:  # checked on any machine: every step name a plan can hold
        names = [name for name, _, _ in plan(2)]
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = [w for w in wanted if w not in names]
        if unknown or not wanted:
            ap.error(f"--only: unknown step(s) {unknown or [args.only]}; the steps are "
                     f"{names}")
    if not torch.cuda.is_available():
        print(NO_GPU)
        return 0
    steps = plan(torch.cuda.device_count())
    if wanted is not None:
        steps = [s for s in steps if s[0] in wanted]
        if not steps:
            names = ", ".join(s[0] for s in plan(torch.cuda.device_count()))
            print(f"gpu_report: no step of this machine is named {sorted(wanted)}; its steps: "
                  f"{names}")
            return 2
    if args.dry_run:
        for name, cmd, limit in steps:
            print(f"{name} ({limit} s): {' '.join(cmd[1:])}")
        return 0
    env = dict(environment(), date=datetime.date.today().isoformat())
    results = []
    for name, cmd, limit in steps:
        print(f"gpu_report: {name} ...", flush=True)
        results.append(run_step(name, cmd, limit))
        print(f"gpu_report: {name}: {results[-1]['status']} in {results[-1]['seconds']} s",
              flush=True)
        # written after every step: a run cut short still leaves the steps it finished
        paths = write_report(env, results, args.out)
    print("gpu_report: wrote " + " and ".join(os.path.relpath(p, ROOT) for p in paths))
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
