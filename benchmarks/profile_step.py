"""Where one opt-level configuration's training step spends its time.

    python -m benchmarks.profile_step           # the transformer; the GPU sizes on a GPU
    python -m benchmarks.profile_step --configs O1,O1+nn-norm,torch.amp --workload cnn-sgd

For each configuration of ``benchmarks.opt_levels`` (same model, optimizer, batch and step
as the opt-level benchmark) it prints, after a warm-up:

- the step time (synced before and after each step) and the host's share of it: the time
  until ``step()`` returns, before the final sync. Where the two are close, the host's
  Python sets the pace (the step is host-bound); where the host time is well under the
  step time, the device does;
- the number of kernels (or, on a CPU, operators) a step launches and their device time,
  from ``torch.profiler`` over a few more steps;
- the kernels that took the most device time per step (on a CPU: the operators that took
  the most host time).

Two variants isolate tritamp's parts: ``<config>+nn-norm`` builds the model with torch's
``nn.LayerNorm`` instead of ``FusedLayerNorm`` and ``<config>+torch-opt`` gives
``amp.initialize`` torch's fused optimizer instead of tritamp's. Configurations run one
after another in one process, on the opt-level benchmark's workload sizes for the device.
"""
import argparse
import statistics
import sys
import time

import torch

from benchmarks import opt_levels as ol

VARIANTS = ("+nn-norm", "+torch-opt")


def _split(name):
    for v in VARIANTS:
        if name.endswith(v):
            return name[: -len(v)], v
    return name, ""


def check(name):
    """(configuration, variant) of a name, or SystemExit naming the choices."""
    base, variant = _split(name)
    if base not in ol.CONFIGS:
        raise SystemExit(f"--configs: unknown configuration {name!r}; the configurations are "
                         f"{sorted(ol.CONFIGS)}, each optionally followed by one of {VARIANTS}")
    if variant and ol.CONFIGS[base][0] != "tritamp":
        raise SystemExit(f"--configs: {name!r}: the variants apply to tritamp's configurations")
    return base, variant


def build(name, workload, device):
    """An ``opt_levels.Run`` for a configuration name, with a variant applied."""
    base, variant = check(name)
    build_model, make_optimizer = ol.build_model, ol.make_optimizer
    try:
        if variant == "+nn-norm":
            ol.build_model = lambda *a, **k: build_model(*a, **dict(k, fused_norms=False))
        elif variant == "+torch-opt":
            ol.make_optimizer = lambda kind, opt, params: make_optimizer("torch", opt, params)
        return ol.Run(base, workload, device)
    finally:
        ol.build_model, ol.make_optimizer = build_model, make_optimizer


def timed(run, steps):
    """[(step seconds, host seconds)]: synced before each step and after it."""
    out = []
    for _ in range(steps):
        ol._sync(run.device)
        t0 = time.perf_counter()
        run.loss = run.step()
        t1 = time.perf_counter()
        ol._sync(run.device)
        out.append((time.perf_counter() - t0, t1 - t0))
    return out


def profiled(run, steps, top):
    """(events per step, device or host ms per step, [(name, calls per step, ms per step)],
    the same list for the host's operators by their own host time)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = run.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    ol._sync(run.device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run.loss = run.step()
        ol._sync(run.device)
    rows, host = [], []
    for e in prof.key_averages():
        on_host = str(getattr(e, "device_type", "CPU")).endswith("CPU")
        if on_host and e.self_cpu_time_total > 0:
            host.append((e.key, e.count / steps, e.self_cpu_time_total / 1e3 / steps))
        if cuda and not on_host:
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = e.self_cuda_time_total
            if t > 0:
                rows.append((e.key, e.count / steps, t / 1e3 / steps))
    if not cuda:
        rows = host
    rows.sort(key=lambda r: -r[2])
    host.sort(key=lambda r: -r[2])
    events = sum(r[1] for r in rows)
    total = sum(r[2] for r in rows)
    return events, total, rows[:top], host[:top]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="transformer-adamw",
                    help="an opt-level workload (default: transformer-adamw)")
    ap.add_argument("--configs", default="torch.amp,O1,O1+nn-norm,O1+torch-opt,O2,"
                    "torch.amp-bf16,O1-bf16",
                    help="comma-separated configurations, each optionally +nn-norm or +torch-opt")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    ap.add_argument("--profiled-steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=12,
                    help="kernels (and host operators) listed per configuration; 0: none")
    args = ap.parse_args(argv)
    if min(args.warmup, args.top) < 0 or min(args.steps, args.profiled_steps) < 1:
        ap.error("--warmup and --top take 0 or more, --steps and --profiled-steps 1 or more")
    device = torch.device(args.device)
    workloads = ol.default_workloads(device)
    if args.workload not in workloads:
        raise SystemExit(f"--workload: unknown {args.workload!r}; one of {sorted(workloads)}")
    workload = workloads[args.workload]
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if not names:
        ap.error("--configs names no configuration")
    for name in names:  # (every name checked before the first runs)
        check(name)
    failed = []
    what = "kernels" if device.type == "cuda" else "operators"
    print(f"{args.workload} on {ol.device_name(device)}: {workload}")
    summary = []
    for name in names:
        try:
            run = build(name, workload, device)
            timed(run, args.warmup)
            times = timed(run, args.steps)
            step = statistics.median(t for t, _ in times) * 1e3
            host = statistics.median(h for _, h in times) * 1e3
            events, total, top, host_top = profiled(run, args.profiled_steps, args.top)
        except Exception as exc:  # one configuration failing leaves the others' numbers
            print(f"\n== {name}: failed: {type(exc).__name__}: {exc}", flush=True)
            failed.append(name)
            continue
        summary.append((name, step, host, events, total))
        print(f"\n== {name}: step {step:.2f} ms, host until step() returns {host:.2f} ms; "
              f"{events:.0f} {what} a step, {total:.2f} ms of "
              f"{'device' if device.type == 'cuda' else 'host'} time")
        for key, calls, ms in top:
            print(f"  {ms:8.3f} ms  {calls:6.1f}x  {key[:110]}")
        if device.type == "cuda" and host_top:
            print("  host operators by their own host time:")
            for key, calls, ms in host_top:
                print(f"  {ms:8.3f} ms  {calls:6.1f}x  {key[:110]}")
        sys.stdout.flush()
        del run
        import gc
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n| config | step ms | host ms | {what} / step | {what} ms / step |")
    print("|---|---:|---:|---:|---:|")
    for name, step, host, events, total in summary:
        print(f"| {name} | {step:.2f} | {host:.2f} | {events:.0f} | {total:.2f} |")
    if failed:  # (the others' numbers are above; the status says the table is not whole)
        print(f"\nprofile_step: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
