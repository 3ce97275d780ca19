"""FusedLayerNorm / FusedRMSNorm against torch's layer_norm / rms_norm: forward and forward+backward.

    python -m benchmarks.norms                 # GPU: 8192 and 32768 rows x 768..8192, bf16, fp16
    python -m benchmarks.norms --rows 8192 --widths 4096 --dtypes fp16,bf16
    python -m benchmarks.norms --device cpu    # a small CPU smoke run

Rows in benchmarks/kernels.py's format (that command includes them): time (median,
p20-p80), bytes moved, GB/s, share of the measured copy bandwidth, ratio to torch.
Bytes moved count what the op must touch: forward reads x and writes y (plus the
parameters and per-row statistics); backward reads dy and x (or y) and writes dx, plus
the parameter gradients. torch's baseline is its own fused op (``F.layer_norm`` /
``F.rms_norm``), under autograd for forward+backward.
"""
import argparse
import sys

import torch
import torch.nn.functional as F

if __name__ == "__main__" and not __package__:
    sys.exit("run it as a module from the repository root: python3 -m benchmarks.norms")

from . import optimizers as ob  # noqa: E402  (timer, device facts, table)

from tritamp.normalization import fused_layer_norm_affine, fused_rms_norm_affine  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# On a GPU: realistic token counts (8192 and 32768 rows) at the widths of real models.
DEFAULTS = {"cuda": dict(rows="8192,32768", widths="768,1024,2048,4096,8192",
                         dtypes="bf16,fp16"),
            "cpu": dict(rows="64", widths="1024", dtypes="bf16")}


def _bytes(rows, n, elem, rms, backward):
    params = n * elem * (1 if rms else 2)
    fwd = 2 * rows * n * elem + params + rows * 4 * (1 if rms else 2)
    if not backward:
        return fwd
    return fwd + 3 * rows * n * elem + 2 * params + rows * 4 * (1 if rms else 2)


def norm_cases(rows, n, dtype, device):
    """(kernel, impl, make) with make() -> (step, bytes moved, tensors kept alive)."""
    elem = torch.finfo(dtype).bits // 8
    out = []
    for kind in ("layer_norm", "rms_norm"):
        rms = kind == "rms_norm"

        def tensors(grad):
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(rows, n, device=device, generator=g).to(dtype).requires_grad_(grad)
            w = torch.ones(n, device=device, dtype=dtype, requires_grad=grad)
            b = None if rms else torch.zeros(n, device=device, dtype=dtype, requires_grad=grad)
            dy = torch.randn(rows, n, device=device, generator=g).to(dtype)
            return x, w, b, dy

        def ours(x, w, b, rms=rms):
            return (fused_rms_norm_affine(x, w, (n,), 1e-5) if rms
                    else fused_layer_norm_affine(x, w, b, (n,), 1e-5))

        def theirs(x, w, b, rms=rms):
            return F.rms_norm(x, (n,), w, 1e-5) if rms else F.layer_norm(x, (n,), w, b, 1e-5)

        for impl, fn in (("tritamp", ours), ("torch fused", theirs)):
            def fwd(fn=fn):
                x, w, b, _ = tensors(False)
                return (lambda: fn(x, w, b)), _bytes(rows, n, elem, rms, False), (x, w, b)

            def fwd_bwd(fn=fn):
                x, w, b, dy = tensors(True)
                params = [t for t in (x, w, b) if t is not None]

                def step():
                    y = fn(x, w, b)
                    torch.autograd.grad(y, params, dy)
                return step, _bytes(rows, n, elem, rms, True), (x, w, b, dy)

            out.append((f"{kind} fwd", impl, fwd))
            out.append((f"{kind} fwd+bwd", impl, fwd_bwd))
    return out


def run_case(name, impl, make, rows, n, dtype_name, device, timed, copy_gbps, meta):
    row = dict(meta, optimizer=name, impl=impl, layout=f"{rows}x{n} {dtype_name}",
               size=f"{rows}x{n}/{dtype_name}", params=rows * n, tensors=1)
    return ob.time_row(row, make, device, timed, copy_gbps)


def row_counts(device):
    """The default row counts on ``device``'s kind."""
    return [int(r) for r in DEFAULTS[device.type]["rows"].split(",")]


def norm_rows(device, timed, copy_gbps, meta, rows=None, widths=None, dtypes=None):
    d = DEFAULTS[device.type]
    counts = ([rows] if isinstance(rows, int) else rows) or row_counts(device)
    widths = widths or [int(w) for w in d["widths"].split(",")]
    dtypes = dtypes or d["dtypes"].split(",")
    out = []
    for dt in dtypes:
        for m in counts:
            for n in widths:
                for name, impl, make in norm_cases(m, n, DTYPES[dt], device):
                    out.append(run_case(name, impl, make, m, n, dt, device, timed, copy_gbps,
                                        meta))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None)
    p.add_argument("--rows", default=None, help="row counts, e.g. 8192,32768")
    p.add_argument("--widths", default=None, help="row widths, e.g. 1024,4096")
    p.add_argument("--dtypes", default=None, help="comma-separated: fp32, fp16, bf16")
    p.add_argument("--cpu-reps", type=int, default=5)
    p.add_argument("--out", default="benchmarks/out")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtypes = args.dtypes.split(",") if args.dtypes else None
    for dt in dtypes or []:
        if dt not in DTYPES:
            p.error(f"unknown dtype {dt!r}; choose from {list(DTYPES)}")
    timed, meta, copy_gbps = ob.start_report(
        device, args.cpu_reps, "No GPU in use: these are CPU figures of small sizes (tritamp's "
        "CPU path against torch's CPU ops); they say nothing about GPU speed.")
    widths = [int(w) for w in args.widths.split(",")] if args.widths else None
    counts = [int(r) for r in args.rows.split(",")] if args.rows else None
    rows = norm_rows(device, timed, copy_gbps, meta, counts, widths, dtypes)
    ob.add_ratios(rows)
    return ob.finish_report(rows, meta, copy_gbps, args.out, "norms", device, "kernel")


if __name__ == "__main__":
    ob.freeze_imports()
    sys.exit(main())
