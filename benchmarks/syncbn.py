"""Time SyncBatchNorm's training step at ResNet-50's BatchNorm shapes: tritamp against torch.

    python benchmarks/syncbn.py                           # GPU: batch 256, fp16 NHWC and fp32 NCHW
    python benchmarks/syncbn.py --batch 128 --configs fp16-nhwc --shapes 64x56x56,2048x7x7
    python benchmarks/syncbn.py --device cpu              # a small CPU smoke run
    torchrun --nproc_per_node 2 -m benchmarks.syncbn --distributed   # across 2 processes

For every shape (N x C x H x W of a ResNet-50 BatchNorm input) one training step of one
layer is timed: the forward (statistics, running-statistics update, normalisation) and
the backward (input, weight and bias gradients), for

- ``tritamp``: ``tritamp.parallel.SyncBatchNorm``. In one process it exchanges nothing,
  so this is its statistics, normalisation and gradient kernels;
- ``torch sync``: torch's SyncBatchNorm autograd function on a 1-rank process group, the
  path ``torch.nn.SyncBatchNorm`` takes with several GPUs (``batch_norm_stats``, an
  all_gather, ``batch_norm_gather_stats_with_counts``, ``batch_norm_elemt``;
  ``batch_norm_backward_reduce``, an all_reduce, ``batch_norm_backward_elemt``). Its two
  1-rank collectives are included (microseconds). CUDA only;
- ``cudnn``: ``torch.nn.BatchNorm2d`` on one GPU, no synchronisation at all (what
  ``torch.nn.SyncBatchNorm`` falls back to in one process).

Bytes are the least traffic of the step, the same for every row: the forward reads x
twice (statistics, normalisation) and writes y, the backward reads dy and x twice
(reductions, input gradient) and writes dx: 8 passes over the activation. "vs torch" is
the ``torch sync`` row's time / this row's time (on a CPU: torch's BatchNorm2d row's);
``vs_cudnn`` in the JSON likewise against the ``cudnn`` row.
Timing as in benchmarks/optimizers.py: replays of a CUDA graph on the GPU, a short
wall-clock median on a CPU, where tritamp runs its CPU path (or Triton's
interpreter under ``TRITON_INTERPRET=1``) and the figures say nothing about GPU speed.

``syncbn_rows`` returns the rows in benchmarks/kernels.py's format for inclusion there.
"""
import argparse
import contextlib
import io
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

if __name__ == "__main__" and not __package__:
    sys.exit("run it as a module from the repository root: python3 -m benchmarks.syncbn")

from . import optimizers as ob  # noqa: E402  (timer, device facts, table)

# (C, H, W) of ResNet-50's BatchNorm inputs at 224x224 (each distinct shape once)
RESNET50_SHAPES = [(64, 112, 112), (64, 56, 56), (256, 56, 56), (128, 56, 56), (128, 28, 28),
                   (512, 28, 28), (256, 28, 28), (256, 14, 14), (1024, 14, 14), (512, 14, 14),
                   (512, 7, 7), (2048, 7, 7)]
CONFIGS = {"fp16-nhwc": (torch.float16, True), "bf16-nhwc": (torch.bfloat16, True),
           "fp32-nchw": (torch.float32, False), "fp16-nchw": (torch.float16, False)}
DEFAULTS = {"cuda": dict(batch=256, configs="fp16-nhwc,fp32-nchw"),
            "cpu": dict(batch=4, configs="fp32-nchw,fp16-nhwc")}
KERNEL = "syncbn fwd+bwd"


def cpu_shapes():
    """ResNet-50's shapes with channels / 8 and sides / 8 (each once): a smoke run."""
    shapes = [(max(1, c // 8), max(1, h // 8), max(1, w // 8)) for c, h, w in RESNET50_SHAPES]
    return list(dict.fromkeys(shapes))


def _one_rank_group(device):
    """(group, created): a 1-rank process group for torch's sync path (None if none can be
    had), and whether it was created here (then the caller destroys it)."""
    if dist.is_initialized():
        return (dist.group.WORLD if dist.get_world_size() == 1 else None), False
    if device.type != "cuda":
        return None, False  # torch's sync kernels are CUDA-only: no group needed
    try:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    except Exception:  # no NCCL: the torch sync rows say so
        return None, False
    return dist.group.WORLD, True


def _layer_step(impl, shape, dtype, channels_last, device, group, world=1):
    """(step, tensors to keep alive) for one implementation at one shape."""
    from tritamp.parallel import SyncBatchNorm

    n, c, h, w = shape
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, device=device, generator=g).to(dtype)
    dy = torch.randn(shape, device=device, generator=g).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        dy = dy.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    if impl == "tritamp":
        layer = SyncBatchNorm(c).to(device)
    else:
        layer = torch.nn.BatchNorm2d(c).to(device)
    inputs = (x, layer.weight, layer.bias)
    if impl == "torch sync":
        if device.type != "cuda":
            raise ob.SkipRow("torch's SyncBatchNorm kernels are CUDA-only")
        if group is None:
            raise ob.SkipRow("no 1-rank process group could be created")
        from torch.nn.modules._functions import SyncBatchNorm as TorchSyncFunction

        def forward():
            return TorchSyncFunction.apply(x, layer.weight, layer.bias, layer.running_mean,
                                           layer.running_var, layer.eps, layer.momentum, group,
                                           world)
    else:
        def forward():
            return layer(x)

    def step():
        y = forward()
        torch.autograd.grad(y, inputs, dy)
    return step, (x, dy, layer)


def syncbn_rows(device, timed, copy_gbps, meta, batch=None, configs=None, shapes=None):
    """Rows in benchmarks/kernels.py's format: one per (config, shape, implementation).

    ``ratio_to_torch`` / ``baseline`` are filled in here (against ``torch sync``); append
    these rows after ``optimizers.add_ratios`` has run on the others, which would reset
    them."""
    kind = device.type if device.type in DEFAULTS else "cpu"
    batch = batch or DEFAULTS[kind]["batch"]
    configs = configs or DEFAULTS[kind]["configs"].split(",")
    shapes = shapes or (RESNET50_SHAPES if kind == "cuda" else cpu_shapes())
    group, created = _one_rank_group(device)
    try:
        rows = _rows(device, timed, copy_gbps, meta, batch, configs, shapes, group)
    finally:
        if created:
            dist.destroy_process_group()
    _ratios(rows)
    return rows


def _rows(device, timed, copy_gbps, meta, batch, configs, shapes, group, world=1):
    rows = []
    for config in configs:
        dtype, channels_last = CONFIGS[config]
        for c, h, w in shapes:
            shape = (batch, c, h, w)
            numel = batch * c * h * w
            nbytes = 8 * numel * torch.finfo(dtype).bits // 8
            for impl in ("tritamp", "torch sync", "cudnn"):
                name = "torch BatchNorm2d" if impl == "cudnn" and device.type != "cuda" else impl
                row = dict(meta, optimizer=KERNEL, impl=name, layout=f"{config} {c}x{h}x{w}",
                           size=ob.size_label(numel), params=numel, tensors=1, shape=list(shape))
                rows.append(row)

                def make(impl=impl, shape=shape, dtype=dtype, channels_last=channels_last):
                    step, keep = _layer_step(impl, shape, dtype, channels_last, device, group,
                                             world)
                    return step, nbytes, keep
                ob.time_row(row, make, device, timed, copy_gbps)
    return rows


def _ratios(rows):
    def base(r, impl_prefix):
        return next((b for b in rows if b["impl"].startswith(impl_prefix) and "time_ms" in b
                     and b["layout"] == r["layout"] and b["size"] == r["size"]), None)

    for r in rows:
        if "time_ms" not in r:
            continue
        # torch's sync path where it runs (CUDA), else torch's BatchNorm2d on the CPU
        torch_base = base(r, "torch sync") or base(r, "torch BatchNorm2d")
        cudnn = base(r, "cudnn")
        r["baseline"] = torch_base["impl"] if torch_base else None
        r["ratio_to_torch"] = torch_base["time_ms"] / r["time_ms"] if torch_base else None
        r["vs_cudnn"] = cudnn["time_ms"] / r["time_ms"] if cudnn else None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--batch", type=int, default=None, help="N (default 256 on a GPU, 4 on a CPU)")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated, from {', '.join(CONFIGS)}")
    p.add_argument("--shapes", default=None,
                   help="comma-separated CxHxW (default: ResNet-50's; scaled down on a CPU)")
    p.add_argument("--cpu-reps", type=int, default=3)
    p.add_argument("--distributed", action="store_true",
                   help="under torchrun: every rank holds its own batch and the statistics "
                        "and gradients are exchanged (NCCL on GPUs, gloo on CPUs)")
    p.add_argument("--reps", type=int, default=20, help="timed steps per row (--distributed)")
    p.add_argument("--out", default="benchmarks/out")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is present")
    if args.configs is not None:
        args.configs = [s.strip() for s in args.configs.split(",") if s.strip()]
        unknown = [s for s in args.configs if s not in CONFIGS]
        if unknown:
            p.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    if args.batch is not None and args.batch < 1:
        p.error("--batch must be positive")
    if args.shapes is not None:
        try:
            args.shapes = [tuple(int(v) for v in s.lower().split("x"))
                           for s in args.shapes.split(",") if s.strip()]
        except ValueError:
            p.error(f"bad --shapes {args.shapes!r}: use e.g. 64x56x56,256x14x14")
        if not args.shapes or any(len(t) != 3 or min(t) < 1 for t in args.shapes):
            p.error(f"bad --shapes {args.shapes!r}: use e.g. 64x56x56,256x14x14")
    return args


def _dist_timer(device, reps):
    """``timed(fn)``: every rank runs ``fn`` together (a barrier before each step, the
    device waited for after it); a step's time is the slowest rank's (MAX all-reduce)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn):
        fn()
        sync()
        samples = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            samples.append((time.perf_counter() - t0) * 1e3)
        t = torch.tensor(samples, dtype=torch.float64,
                         device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        samples = sorted(t.tolist())
        q = lambda f: samples[min(len(samples) - 1, int(f * len(samples)))]  # noqa: E731
        return [statistics.median(samples), q(0.2), q(0.8), "wall clock, slowest rank", None]
    return timed


def main_distributed(args):
    """SyncBatchNorm across the ranks torchrun started: tritamp's against torch's
    SyncBatchNorm (CUDA; NCCL) or against each rank's own BatchNorm2d (CPU; gloo, where
    torch's sync kernels do not run). Rank 0 prints and writes syncbn_dist_<device>.json."""
    cuda = args.device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda \
        else torch.device("cpu")
    quiet = contextlib.redirect_stdout(io.StringIO()) if rank else contextlib.nullcontext()
    try:
        with quiet:
            _, meta, copy_gbps = ob.start_report(
                device, args.cpu_reps, f"No GPU in use: a CPU smoke run over {world} gloo "
                "ranks; the figures say nothing about GPU speed.")
            meta = dict(meta, world_size=world, backend=dist.get_backend())
            kind = "cuda" if cuda else "cpu"
            rows = _rows(device, _dist_timer(device, args.reps), copy_gbps, meta,
                         args.batch or DEFAULTS[kind]["batch"],
                         args.configs or DEFAULTS[kind]["configs"].split(","),
                         args.shapes or (RESNET50_SHAPES if cuda else cpu_shapes()),
                         dist.group.WORLD, world)
            _ratios(rows)
            for r in rows:
                r["layout"] = f"{r['layout']} x{world} ranks"
            rc = ob.finish_report(rows, meta, copy_gbps, args.out, "syncbn_dist", device,
                                  "kernel") if rank == 0 else 0
    finally:
        dist.destroy_process_group()
    return rc


def main(argv=None):
    args = parse_args(argv)
    if args.distributed:
        return main_distributed(args)
    device = torch.device(args.device)
    timed, meta, copy_gbps = ob.start_report(
        device, args.cpu_reps, "No GPU in use: a CPU smoke run of small shapes (tritamp's "
        "CPU path, or Triton's interpreter); the figures say nothing about GPU speed.")
    rows = syncbn_rows(device, timed, copy_gbps, meta, args.batch, args.configs, args.shapes)
    return ob.finish_report(rows, meta, copy_gbps, args.out, "syncbn", device, "kernel")


if __name__ == "__main__":
    ob.freeze_imports()
    sys.exit(main())
