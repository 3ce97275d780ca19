"""Every kernel benchmark behind one command, in one output format.

    python benchmarks/kernels.py                   # 25M, 100M (and 1B for optimizers) on the GPU
    python benchmarks/kernels.py --sizes 25M --layouts resnet50
    python benchmarks/kernels.py --device cpu      # a small CPU smoke run

Rows: the benchmark rows of the op registry (``tritamp.kernels.registry``; each op's
``benchmarks``), each against its torch baseline here: amp's end-of-backward kernels (the
overflow check alone, and check + unscale of fp16 gradients into fp32 master gradients)
against torch's ``_amp_foreach_non_finite_check_and_unscale_`` (what GradScaler runs), the
multi-tensor l2-norm against ``torch._foreach_norm``, LARC's gradient rewrite against
torch's foreach ops; then LayerNorm / RMSNorm forward and
forward+backward against torch's (benchmarks/norms.py), every fused optimizer step from
benchmarks/optimizers.py, then SyncBatchNorm forward+backward at ResNet-50 shapes against
torch's SyncBatchNorm and cudnn (benchmarks/syncbn.py). Each row: time (median, p20-p80),
bytes moved, GB/s, the share of the device's measured copy bandwidth and the ratio to the
torch baseline. tritamp's multi-tensor rows time the launch of a sweep prepared once, as a
training step pays it (validation and planning happen when the tensors change, not each
step). Timing as in optimizers.py: replays of a CUDA graph on the GPU, a short
wall-clock median of tritamp's CPU path on a CPU (which says nothing about GPU speed).
``--budget-s`` bounds the run: rows that would start after it are skipped unmeasured, and
the table and JSON are still written.
"""
import argparse
import inspect
import sys

import torch

if __name__ == "__main__" and not __package__:
    sys.exit("run it as a module from the repository root: python3 -m benchmarks.kernels")

from tritamp.kernels import registry  # noqa: E402

from . import norms as nb  # noqa: E402  (the norm benchmark)
from . import optimizers as ob  # noqa: E402  (the optimizer benchmark: layouts, timer, table)

DEFAULT_SIZES = {"cuda": "25M,100M", "cpu": "100K"}


def _grads(shapes, device, dtype=torch.float16):
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(s, device=device, generator=g, dtype=torch.float32).to(dtype)
            for s in shapes]


def _torch_unscale(shapes, device):
    grads = _grads(shapes, device)
    inv = torch.ones((), device=device)  # 1.0: repeated runs leave the gradients as they are
    fi = torch.zeros(1, device=device)
    # bytes: the least the check must touch (read each value once), as tritamp's row
    # counts them; torch's op also writes every value back (it has no read-only check)
    return (lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, fi, inv)), \
        sum(g.numel() * 2 for g in grads), grads


def _torch_unscale_to_fp32(shapes, device):
    """The same operation as tritamp's row: fp16 gradients checked and unscaled into fp32
    master gradients, with torch's ops (a foreach copy into the fp32 tensors, then the
    check-and-unscale GradScaler runs, in place on them)."""
    grads = _grads(shapes, device)
    masters = [torch.empty(g.shape, device=device) for g in grads]
    inv = torch.full((), 1.0 / 65536.0, device=device)
    fi = torch.zeros(1, device=device)

    def step():
        torch._foreach_copy_(masters, grads)
        torch._amp_foreach_non_finite_check_and_unscale_(masters, fi, inv)
    # bytes: the operation's least (read fp16, write fp32), as tritamp's row counts them;
    # torch's two passes move 14 bytes an element to do it
    return step, sum(g.numel() * (2 + 4) for g in grads), (grads, masters)


def _torch_norm(shapes, device):
    grads = _grads(shapes, device, torch.float32)
    return (lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))), \
        sum(g.numel() * 4 for g in grads), grads


def _torch_larc(shapes, device):
    """The same rewrite with torch's foreach ops: ``g += decay * p``, ``g *= factor`` with
    one 0-d factor and decay per tensor (views of the two vectors), as a LARC on torch's
    ops would run it."""
    g = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=g) for s in shapes]
    grads = [torch.randn(s, device=device, generator=g) for s in shapes]
    factor = torch.rand(len(shapes), device=device, generator=g)
    decay = torch.full((len(shapes),), 1e-4, device=device)
    factors, decays = list(factor.unbind(0)), list(decay.unbind(0))

    def step():
        torch._foreach_add_(grads, torch._foreach_mul(params, decays))
        torch._foreach_mul_(grads, factors)
    return step, sum(p.numel() * 12 for p in params), (params, grads, factor, decay)


# The torch baseline of each registry benchmark row: make(shapes, device) -> (step
# function, bytes moved, tensors to keep).
TORCH_BASELINES = {
    "amp check": _torch_unscale,            # what GradScaler runs (it has no read-only check)
    "amp unscale->fp32": _torch_unscale_to_fp32,  # the same result with torch's ops
    "l2norm": _torch_norm,
    "larc rescale": _torch_larc,            # LARC's gradient rewrite with foreach ops
}


def prepared_step(op, sample):
    """The step a training loop pays for ``sample``: its sweep prepared once (validation,
    plan, tables), then each call one launch of the kept sweep, as amp and the fused
    optimizers keep theirs between steps. The arguments that the op's ``prepare`` takes
    go to it once; the others to its ``launch`` at every call. An op without the pair, or
    whose arguments do not split so, is called whole (prepared again at every call)."""
    if op.prepare is None or op.launch is None:
        return lambda: sample.call(op.launcher)
    bound = inspect.signature(op.launcher).bind(*sample.args, **sample.kwargs)
    to_prepare = inspect.signature(op.prepare).parameters
    at_launch = inspect.signature(op.launch).parameters
    once = {k: v for k, v in bound.arguments.items() if k in to_prepare}
    each = {k: v for k, v in bound.arguments.items() if k not in to_prepare}
    if not set(each) <= set(at_launch):
        return lambda: sample.call(op.launcher)
    prepared = op.prepare(**once)
    return lambda: op.launch(prepared, **each)


def kernel_cases(shapes, device):
    """(kernel, impl, make) with make() -> (step function, bytes moved, tensors to keep):
    every benchmark row of the op registry (tritamp.kernels.registry), each followed by
    its torch baseline. tritamp's step is the prepared launch (:func:`prepared_step`)."""
    cases = []
    for op in registry.OPS:
        for row, make_sample in op.benchmarks.items():
            def ours(op=op, make_sample=make_sample):
                sample, nbytes = make_sample(shapes, device)
                return prepared_step(op, sample), nbytes, sample

            cases.append((row, "tritamp", ours))
            if row in TORCH_BASELINES:
                cases.append((row, "torch fused",
                              lambda row=row: TORCH_BASELINES[row](shapes, device)))
    return cases


def run_kernel(name, impl, make, layout, n, device, timed, copy_gbps, meta):
    shapes = ob.layout_shapes(layout, n)
    row = dict(meta, optimizer=name, impl=impl, layout=layout, size=ob.size_label(n),
               params=ob.numel(shapes), tensors=len(shapes))
    return ob.time_row(row, make, device, timed, copy_gbps)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None)
    p.add_argument("--sizes", default=None, help="parameter counts, e.g. 25M,100M")
    p.add_argument("--optimizer-sizes", default=None,
                   help="sizes for the optimizer rows (default: --sizes, plus 1B on a GPU)")
    p.add_argument("--layouts", default=",".join(ob.LAYOUTS))
    p.add_argument("--no-optimizers", action="store_true", help="only amp's and the norm kernels")
    p.add_argument("--no-norms", action="store_true", help="leave out the LayerNorm/RMSNorm rows")
    p.add_argument("--no-syncbn", action="store_true", help="leave out SyncBatchNorm")
    p.add_argument("--cpu-reps", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds after which the rows not yet started are skipped (the table "
                        "and the JSON are still written)")
    p.add_argument("--out", default="benchmarks/out")
    args = p.parse_args(argv)
    if args.budget_s is not None and not args.budget_s >= 0:
        p.error(f"--budget-s must be a number of seconds >= 0; got {args.budget_s}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(args.device).type
    args.sizes = [ob.parse_size(s) for s in (args.sizes or DEFAULT_SIZES[kind]).split(",")]
    opt_sizes = args.optimizer_sizes or (ob.DEFAULT_SIZES[kind] if args.optimizer_sizes is None
                                         and kind == "cuda" else None)
    args.optimizer_sizes = [ob.parse_size(s) for s in opt_sizes.split(",")] if opt_sizes \
        else args.sizes
    args.layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    unknown = [s for s in args.layouts if s not in ob.LAYOUTS]
    if unknown:
        p.error(f"unknown layout(s) {unknown}; choose from {list(ob.LAYOUTS)}")
    return args


def progress(row):
    """One line on stderr as each row is measured or skipped: a run stopped at a time
    limit (the GPU report's) still shows the rows it finished."""
    t = row.get("time_ms")
    what = f"{t:.4g} ms" if t is not None else row.get("note", "no time")
    print(f"kernels: {row.get('optimizer')} [{row.get('impl')}] {row.get('layout')} "
          f"{row.get('size', '')}{' ' + row['half_dtype'] if row.get('half_dtype') else ''}"
          f": {what}", file=sys.stderr, flush=True)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    ob.set_budget(args.budget_s)
    ob.set_progress(progress)
    try:
        return _run(args, device)
    finally:
        ob.set_budget(None)
        ob.set_progress(None)


def _run(args, device):
    """The rows in priority order, so that a run stopped by its budget loses the later
    sizes (the larger ones, by default) rather than whole kinds of rows: amp's sweeps, the
    norms at the first row count, the optimizers at the first size, SyncBatchNorm, then
    the other row counts and sizes. The table keeps the usual order (SyncBatchNorm last: its rows carry their own
    ratios)."""
    timed, meta, copy_gbps = ob.start_report(
        device, args.cpu_reps, "No GPU in use: these are CPU figures of small sizes (tritamp's "
        "CPU path against torch's CPU ops); they say nothing about GPU speed.")
    first = []
    for n in args.sizes:
        for layout in args.layouts:
            for name, impl, make in kernel_cases(ob.layout_shapes(layout, n), device):
                first.append(run_kernel(name, impl, make, layout, n, device, timed, copy_gbps,
                                        meta))
    norm_counts = nb.row_counts(device)

    def norms(counts):
        return nb.norm_rows(device, timed, copy_gbps, meta, counts) if counts else []

    def optimizers(sizes):
        rows = []
        for n in sizes:
            for layout in args.layouts:
                for spec in ob.optimizer_specs().values():
                    for half in ob.DEFAULT_HALVES.get(device.type, "fp16").split(","):
                        rows.append(ob.run_one(spec, "tritamp", None, layout, n, device, timed,
                                               copy_gbps, meta, half))
                    for impl, factory in spec.torch_impls:
                        rows.append(ob.run_one(spec, impl, factory, layout, n, device, timed,
                                               copy_gbps, meta))
        return rows

    norm_first = norms(norm_counts[:1]) if not args.no_norms else []
    opt_first = optimizers(args.optimizer_sizes[:1]) if not args.no_optimizers else []
    syncbn = []
    if not args.no_syncbn:
        from . import syncbn as sbn  # its rows carry their own ratios
        syncbn = sbn.syncbn_rows(device, timed, copy_gbps, meta,
                                 shapes=None if device.type == "cuda" else sbn.cpu_shapes()[:2])
    norm_later = norms(norm_counts[1:]) if not args.no_norms else []
    opt_later = optimizers(args.optimizer_sizes[1:]) if not args.no_optimizers else []
    rows = first + norm_first + norm_later + opt_first + opt_later
    ob.add_ratios(rows)
    return ob.finish_report(rows + syncbn, meta, copy_gbps, args.out, "kernels", device,
                            "kernel")


if __name__ == "__main__":
    ob.freeze_imports()
    sys.exit(main())
