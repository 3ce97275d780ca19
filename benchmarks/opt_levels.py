"""Compare tritamp's opt levels with torch.amp on one model, one device, one run.

    python benchmarks/opt_levels.py                  # embedded default model, synthetic data
    python benchmarks/opt_levels.py --device cuda --model resnet50 --batch-size 256

tritamp's configurations train with tritamp.optimizers.FusedSGD, the torch.amp baseline
with torch.optim.SGD(fused=True); with ``--model transformer`` (pre-norm transformer blocks
on synthetic tokens) FusedAdam and tritamp.normalization.FusedLayerNorm against
torch.optim.AdamW(fused=True) and nn.LayerNorm. Each configuration runs in a fresh process (clean
memory peak, clean compile cache) and reports samples/s (median step after warm-up), step time, peak memory (CUDA allocator
peak, or the process's peak RSS on CPU), host-device syncs per training step, the extra
time of the first step (kernel compiles) and the final loss relative to O0. Writes a
table to the terminal, a JSON file and, with matplotlib, a PNG bar chart.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn

CONFIGS = {
    # name: (kind, initialize kwargs)
    "O0": ("tritamp", dict(opt_level="O0")),
    "O1": ("tritamp", dict(opt_level="O1")),
    "O2": ("tritamp", dict(opt_level="O2")),
    "O3": ("tritamp", dict(opt_level="O3")),
    "O3+bn32": ("tritamp", dict(opt_level="O3", keep_batchnorm_fp32=True)),
    "O1-bf16": ("tritamp", dict(opt_level="O1", half_dtype=torch.bfloat16)),
    "O2-bf16": ("tritamp", dict(opt_level="O2", half_dtype=torch.bfloat16)),
    "O3-bf16": ("tritamp", dict(opt_level="O3", half_dtype=torch.bfloat16)),
    "torch.amp": ("torch", dict(dtype=torch.float16)),
    "torch.amp-bf16": ("torch", dict(dtype=torch.bfloat16)),
}


# -- models -------------------------------------------------------------------------
def small_cnn(num_classes=10):
    """The embedded default for CPUs: three conv-BN-ReLU blocks and a classifier."""
    def block(cin, cout, stride):
        return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True)]
    return nn.Sequential(*block(3, 16, 1), *block(16, 32, 2), *block(32, 64, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))


class PreNormBlock(nn.Module):
    """x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, width, heads, norm):
        super().__init__()
        self.ln1, self.ln2 = norm(width), norm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TransformerClassifier(nn.Module):
    """Pre-norm transformer blocks (LayerNorm, attention, MLP) over synthetic tokens:
    the LayerNorm / Adam side of mixed precision, where the CNNs exercise BatchNorm / SGD.
    ``norm`` is the LayerNorm class: tritamp's FusedLayerNorm for tritamp's configurations,
    torch's nn.LayerNorm for the torch.amp baseline (same parameters, same initial values)."""

    def __init__(self, num_classes=10, vocab=1000, width=64, depth=2, heads=4, seq=512,
                 norm=nn.LayerNorm):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq, width))
        self.blocks = nn.Sequential(*(PreNormBlock(width, heads, norm) for _ in range(depth)))
        self.norm = norm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(h)).mean(dim=1))


def build_model(name, num_classes, device_type="cpu", fused_norms=False):
    if name == "small-cnn":
        return small_cnn(num_classes)
    if name == "transformer":
        from tritamp.normalization import FusedLayerNorm
        norm = FusedLayerNorm if fused_norms else nn.LayerNorm
        if device_type == "cuda":
            return TransformerClassifier(num_classes, width=512, depth=6, heads=8, norm=norm)
        return TransformerClassifier(num_classes, norm=norm)
    try:
        import torchvision
    except ImportError:
        sys.exit(f"--model {name} needs torchvision: pip install torchvision "
                 "(or use --model small-cnn)")
    return getattr(torchvision.models, name)(num_classes=num_classes)


def defaults_for(device):
    if device.type == "cuda":
        have_tv = True
        try:
            import torchvision  # noqa: F401
        except ImportError:
            have_tv = False
        if have_tv:
            return dict(model="resnet50", batch_size=256, image_size=224, steps=30, warmup=5,
                        channels_last=True)
        return dict(model="small-cnn", batch_size=256, image_size=64, steps=30, warmup=5,
                    channels_last=True)
    # about two minutes on a 2-core CPU for all configurations (fp16 math is slow there)
    return dict(model="small-cnn", batch_size=16, image_size=16, steps=10, warmup=2,
                channels_last=False)


# -- counting host-device syncs -----------------------------------------------------------
class SyncCounter(torch.overrides.TorchFunctionMode):
    """Counts host reads of tensor values (.item(), bool(), float(), .tolist(), .cpu()).

    On CUDA it also counts the syncs torch reports in sync-debug mode, which catches
    those made inside torch's own code."""
    HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
                  torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__,
                  torch.Tensor.cpu, torch.Tensor.numpy}

    def __init__(self, device):
        super().__init__()
        self.device = device
        self.count = 0
        self._warnings = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.HOST_READS and self.device.type != "cuda":
            self.count += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        if self.device.type == "cuda":
            import warnings
            self._catcher = warnings.catch_warnings(record=True)
            self._warnings = self._catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
            self.count += sum("synchroniz" in str(w.message) for w in self._warnings)
            self._catcher.__exit__(None, None, None)
        return out


# -- one configuration (worker process) ------------------------------------------------------
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_config(name, args):
    from tritamp import amp

    kind, kw = CONFIGS[name]
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(args.model, 10, device.type, fused_norms=kind == "tritamp").to(device)
    transformer = args.model == "transformer"
    memory_format = torch.channels_last if args.channels_last and not transformer \
        else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    from tritamp.optimizers import FusedAdam, FusedSGD
    if transformer:
        opt = FusedAdam(model.parameters(), lr=1e-3) if kind == "tritamp" else \
            torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    elif kind == "tritamp":
        opt = FusedSGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
    g = torch.Generator().manual_seed(1)
    if transformer:  # image_size is the sequence length
        x = torch.randint(0, 1000, (args.batch_size, args.image_size), generator=g)
    else:
        x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)
    x = x.to(device).contiguous(memory_format=memory_format) if not transformer else x.to(device)
    y = y.to(device)
    criterion = nn.CrossEntropyLoss()

    if kind == "tritamp":
        model, opt = amp.initialize(model, opt, verbosity=0, **kw)

        def step():
            loss = criterion(model(x), y)
            opt.zero_grad(set_to_none=True)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            return loss
    else:
        dtype = kw["dtype"]
        scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

        def step():
            with torch.autocast(device.type, dtype=dtype):
                loss = criterion(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.warmup + args.steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    counter = SyncCounter(device)  # one more step, untimed, with every sync counted
    with counter:
        loss = step()
    syncs = counter.count
    timed = times[args.warmup:]
    median = statistics.median(timed)
    return dict(config=name, samples_per_s=args.batch_size / median, step_ms=median * 1e3,
                peak_memory_mb=_peak_memory(device) / 2**20, syncs_per_step=syncs,
                first_step_extra_s=max(times[0] - median, 0.0), final_loss=float(loss.detach()))


# -- driver ---------------------------------------------------------------------------
def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def versions():
    import triton

    import tritamp
    return dict(torch=torch.__version__, triton=triton.__version__, tritamp=tritamp.__version__,
                python=platform.python_version())


def _progress(items):
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
            return tqdm(items, desc="configs", unit="cfg")
        except ImportError:
            pass
    return items


def format_table(rows):
    head = ["config", "samples/s", "step ms", "peak MB", "syncs/step", "1st step +s", "loss/O0"]
    base = next((r["final_loss"] for r in rows if r["config"] == "O0"), None)
    lines = []
    for r in rows:
        rel = f"{r['final_loss'] / base:.3f}" if base else "-"
        lines.append([r["config"], f"{r['samples_per_s']:.1f}", f"{r['step_ms']:.1f}",
                      f"{r['peak_memory_mb']:.0f}", str(r["syncs_per_step"]),
                      f"{r['first_step_extra_s']:.2f}", rel])
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
    fmt = "  ".join("{:<%d}" % widths[0] if i == 0 else "{:>%d}" % w
                    for i, w in enumerate(widths))
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*l) for l in lines]
    return "\n".join(out)


def write_chart(rows, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)")
        return None
    names = [r["config"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    axes[0].bar(names, [r["samples_per_s"] for r in rows], color="tab:blue")
    axes[0].set_ylabel("samples / s")
    axes[0].set_title("throughput (higher is better)")
    axes[1].bar(names, [r["peak_memory_mb"] for r in rows], color="tab:orange")
    axes[1].set_ylabel("MiB")
    axes[1].set_title("peak memory (lower is better)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--model", default=None,
                   help="small-cnn, transformer (pre-norm blocks, FusedAdam vs fused AdamW) or a "
                        "torchvision model name")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--image-size", type=int, default=None,
                   help="image side, or the sequence length with --model transformer")
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--levels", default=",".join(CONFIGS),
                   help="comma-separated configurations: " + ", ".join(CONFIGS))
    p.add_argument("--out", default="benchmarks/out", help="folder for the JSON and PNG")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is present")
    for k, v in defaults_for(torch.device(args.device)).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.warmup < 1 or args.steps < 1:
        p.error("--steps and --warmup must be >= 1")
    levels = [s.strip() for s in args.levels.split(",") if s.strip()]
    unknown = [s for s in levels if s not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    args.levels = levels
    return args


def _worker_argv(args, name):
    argv = [sys.executable, os.path.abspath(__file__), "--worker", name, "--device", args.device,
            "--model", args.model, "--batch-size", str(args.batch_size),
            "--image-size", str(args.image_size), "--steps", str(args.steps),
            "--warmup", str(args.warmup)]
    argv.append("--channels-last" if args.channels_last else "--no-channels-last")
    return argv


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_config(args.worker, args)))
        return 0
    device = torch.device(args.device)
    if device.type != "cuda":
        print("No GPU in use: this is a CPU run of a small model; its numbers say nothing "
              "about GPU speed (fp16 math on a CPU is far slower than fp32).")
    data = (f"{args.image_size}-token synthetic sequences" if args.model == "transformer"
            else f"{args.image_size}x{args.image_size} synthetic images")
    print(f"model {args.model}, batch {args.batch_size}, {data}, "
          f"{args.steps} timed steps after {args.warmup} warm-up, "
          f"on {device_name(device)}")
    rows = []
    for name in _progress(args.levels):
        proc = subprocess.run(_worker_argv(args, name), capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    if not rows:
        print("no configuration ran", file=sys.stderr)
        return 1
    print(format_table(rows))
    os.makedirs(args.out, exist_ok=True)
    meta = dict(device=device_name(device), **versions(), model=args.model,
                batch_size=args.batch_size, image_size=args.image_size, steps=args.steps,
                warmup=args.warmup, channels_last=args.channels_last)
    json_path = os.path.join(args.out, f"opt_levels_{device.type}.json")
    with open(json_path, "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=2)
    title = (f"{args.model}, batch {args.batch_size} on {meta['device']} | torch {meta['torch']}, "
             f"triton {meta['triton']}, tritamp {meta['tritamp']}")
    png = write_chart(rows, os.path.join(args.out, f"opt_levels_{device.type}.png"), title)
    print(f"wrote {json_path}" + (f" and {png}" if png else ""))
    return 0 if len(rows) == len(args.levels) else 1


if __name__ == "__main__":
    sys.exit(main())
