"""Compare tritamp's opt levels with torch.amp: ms per training step, as a ratio to
torch.amp-bf16 measured in interleaved rounds, on one or more workloads.

    python benchmarks/opt_levels.py                   # the device's default workloads
    python benchmarks/opt_levels.py --device cuda --model resnet50 --batch-size 256

Workloads (``--workloads``): ``cnn-sgd`` and ``cnn-adamw`` (a small conv-BN-ReLU CNN on
synthetic images, with SGD + momentum or AdamW) and ``transformer-adamw`` (pre-norm
transformer blocks on synthetic tokens: width 512, 8 heads, 4 layers, sequence 128 on a
CPU). tritamp's configurations train with ``tritamp.optimizers.FusedSGD`` / ``FusedAdam``
(and ``FusedLayerNorm`` in the transformer), the torch baselines with
``torch.optim.SGD/AdamW(fused=True)`` (and ``nn.LayerNorm``). ``--model`` runs one
workload of any model (a torchvision name too).

Each configuration runs in its own process (its own amp state, clean memory peak), kept
alive for the whole run. The driver interleaves them: in every round each configuration
runs a few steps in turn, the order rotating from round to round, so that a slow spell
of the machine hits every configuration alike. The ratio to torch.amp-bf16 is the median
over rounds of (this configuration's median step in the round) / (torch.amp-bf16's).
Also reported: samples/s and ms per step (median step after warm-up), peak memory (CUDA
allocator peak, or the process's peak RSS on CPU), host-device syncs in one step, the
first step's extra time (kernel compiles) and the final loss relative to O0. Writes a
table per workload, a JSON file and, with matplotlib, a PNG chart.
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
    # name: (kind, dtype of the run, initialize kwargs)
    "O0": ("tritamp", torch.float32, dict(opt_level="O0")),
    "O1": ("tritamp", torch.float16, dict(opt_level="O1")),
    "O2": ("tritamp", torch.float16, dict(opt_level="O2")),
    "O3": ("tritamp", torch.float16, dict(opt_level="O3")),
    "O3+bn32": ("tritamp", torch.float16, dict(opt_level="O3", keep_batchnorm_fp32=True)),
    "O1-bf16": ("tritamp", torch.bfloat16, dict(opt_level="O1", half_dtype=torch.bfloat16)),
    "O2-bf16": ("tritamp", torch.bfloat16, dict(opt_level="O2", half_dtype=torch.bfloat16)),
    "O3-bf16": ("tritamp", torch.bfloat16, dict(opt_level="O3", half_dtype=torch.bfloat16)),
    "torch-fp32": ("torch", torch.float32, {}),
    "torch.amp": ("torch", torch.float16, {}),
    "torch.amp-bf16": ("torch", torch.bfloat16, {}),
}
BASELINE = "torch.amp-bf16"
TRANSFORMER_POSITIONS = 512  # the transformer's positional table: its longest sequence
SAME_DTYPE_BASELINE = {torch.float32: "torch-fp32", torch.float16: "torch.amp",
                       torch.bfloat16: "torch.amp-bf16"}
# A CPU has no fp16 arithmetic (about 20x slower than fp32): its default leaves fp16 out.
CPU_LEVELS = ["O0", "O1-bf16", "O2-bf16", "O3-bf16", "torch-fp32", "torch.amp-bf16"]

# ms/step targets on a CPU, as a ratio to the named baseline (see docs/benchmark.md)
TARGETS = [("O1-bf16", BASELINE, 1.00), ("O2-bf16", BASELINE, 1.10),
           ("O3-bf16", BASELINE, 1.00), ("O0", "torch-fp32", 1.02)]

WORKLOADS = {
    # name: model, optimizer, and the sizes of a CPU run
    # (steps per round and warm-up: a round of a few tenths of a second per configuration)
    # (a round of a few tenths of a second per configuration; small models repeated in
    # fresh processes: where their tensors land moves their step time by several percent)
    "cnn-sgd": dict(model="small-cnn", optimizer="sgd", batch_size=16, image_size=16,
                    steps_per_round=30, warmup=10, repeats=5, rounds=3),
    "cnn-adamw": dict(model="small-cnn", optimizer="adamw", batch_size=16, image_size=16,
                      steps_per_round=30, warmup=10, repeats=5, rounds=3),
    "transformer-adamw": dict(model="transformer", optimizer="adamw", batch_size=8,
                              image_size=128, width=512, depth=4, heads=8, steps_per_round=2,
                              warmup=2, repeats=1, rounds=8),
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

    def __init__(self, num_classes=10, vocab=1000, width=64, depth=2, heads=4,
                 seq=TRANSFORMER_POSITIONS,
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


def build_model(name, num_classes, device_type="cpu", fused_norms=False, width=64, depth=2,
                heads=4):
    """A workload's model. The transformer's positional table holds 512 positions."""
    if name == "small-cnn":
        return small_cnn(num_classes)
    if name == "transformer":
        from tritamp.normalization import FusedLayerNorm
        norm = FusedLayerNorm if fused_norms else nn.LayerNorm
        return TransformerClassifier(num_classes, width=width, depth=depth, heads=heads,
                                     norm=norm)
    try:
        import torchvision
    except ImportError:
        sys.exit(f"--model {name} needs torchvision: pip install torchvision "
                 "(or use --model small-cnn)")
    return getattr(torchvision.models, name)(num_classes=num_classes)


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


# -- one configuration (a worker process, driven over stdin/stdout) --------------------------
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak_memory(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: "5" resets the peak resident set size (VmHWM)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_memory(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_optimizer(kind, name, params):
    from tritamp.optimizers import FusedAdam, FusedSGD
    if name == "sgd":
        return FusedSGD(params, lr=0.01, momentum=0.9) if kind == "tritamp" else \
            torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=True)
    if name == "adamw":
        return FusedAdam(params, lr=1e-3, weight_decay=0.01) if kind == "tritamp" else \
            torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    raise ValueError(f"unknown optimizer {name!r}: sgd or adamw")


class Run:
    """One configuration on one workload: the model, the optimizer, the batch, a step."""

    def __init__(self, name, workload, device):
        from tritamp import amp

        kind, dtype, kw = CONFIGS[name]
        self.device = device
        self.batch_size = workload["batch_size"]
        torch.manual_seed(0)
        transformer = workload["model"] == "transformer"
        model = build_model(workload["model"], 10, device.type, fused_norms=kind == "tritamp",
                            **{k: workload[k] for k in ("width", "depth", "heads")
                               if k in workload})
        memory_format = torch.channels_last if workload.get("channels_last") and not transformer \
            else torch.contiguous_format
        model = model.to(device).to(memory_format=memory_format)
        opt = make_optimizer(kind, workload["optimizer"], model.parameters())
        g = torch.Generator().manual_seed(1)
        n, size = workload["batch_size"], workload["image_size"]
        if transformer:  # image_size is the sequence length
            x = torch.randint(0, 1000, (n, size), generator=g).to(device)
        else:
            x = torch.randn(n, 3, size, size, generator=g).to(device)
            x = x.contiguous(memory_format=memory_format)
        y = torch.randint(0, 10, (n,), generator=g).to(device)
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
        elif dtype == torch.float32:
            def step():
                loss = criterion(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                return loss
        else:
            scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

            def step():
                with torch.autocast(device.type, dtype=dtype):
                    loss = criterion(model(x), y)
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                return loss
        self.step = step
        self.loss = None

    def timed(self, steps):
        times = []
        for _ in range(steps):
            _sync(self.device)
            t0 = time.perf_counter()
            self.loss = self.step()
            _sync(self.device)
            times.append(time.perf_counter() - t0)
        return times

    def count_syncs(self):
        counter = SyncCounter(self.device)  # one more step, untimed, every sync counted
        with counter:
            self.loss = self.step()
        return counter.count


def worker(name, args):
    """Serve the driver: one JSON command per input line, one JSON answer per line."""
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    run = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "setup":
            run = None
            import gc
            gc.collect()
            _reset_peak_memory(device)
            run = Run(name, cmd["workload"], device)
            times = run.timed(cmd["warmup"])
            answer = dict(first_step_s=times[0], warmup_s=sum(times))
        elif cmd["cmd"] == "run":
            answer = dict(times=run.timed(cmd["steps"]))
        elif cmd["cmd"] == "finish":
            answer = dict(syncs_per_step=run.count_syncs(), final_loss=float(run.loss.detach()),
                          peak_memory_mb=_peak_memory(device) / 2**20)
        else:
            return 0
        if device.type == "cuda":
            # The workers take turns: an idle one hands its cached blocks (activations)
            # back, so that every configuration's process fits beside the others on one
            # GPU. The next turn allocates them again in its first step; the round's
            # median step leaves that out.
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        print(json.dumps(answer), flush=True)
    return 0


# -- the driver ---------------------------------------------------------------------------------
class Worker:
    def __init__(self, name, argv):
        self.name = name
        # Production code paths only: on a CPU, never Triton's interpreter (a test's).
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)

    def ask(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read()
            raise RuntimeError(f"{self.name}: the worker stopped\n{err[-3000:]}")
        return json.loads(line)

    def close(self):
        try:
            self.proc.stdin.write(json.dumps(dict(cmd="quit")) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def measure(workloads, args):
    """Repetition k starts a fresh set of worker processes and runs, in it, every workload
    with more than k repetitions: warm every configuration up, then interleaved rounds.
    One row per configuration and workload, its ratios the median over every (repetition,
    round) of the per-round ratios: a slow spell of the machine hits every configuration
    of a round alike, and a process that happens to be placed badly (small models are
    sensitive to where their tensors land) is one repetition among several."""
    raw = {name: {} for name in workloads}
    for k in range(max(w["repeats"] for w in workloads.values())):
        workers = [Worker(name, _worker_argv(args, name)) for name in args.levels]
        try:
            for name, spec in workloads.items():
                if spec["repeats"] > k:
                    _one_repetition(spec, workers, args, raw[name], k)
        finally:
            for w in workers:
                w.close()
    return {name: _rows(workloads[name], raw[name], args) for name in workloads}


def _rows(workload, rows, args):
    out = [rows[name] for name in args.levels if name in rows]
    for row in out:
        row["round_ms"] = [t * 1e3 for t in row["rounds"]]
        median = statistics.median(row["times"])
        row.update(samples_per_s=workload["batch_size"] / median, step_ms=median * 1e3,
                   first_step_extra_s=max(row.pop("first") - median, 0.0))
    by_name = {r["config"]: r for r in out}
    for row in out:
        row["vs_torch_amp_bf16"] = _ratio(row, by_name.get(BASELINE))
        row["vs_torch_amp_bf16_middle_half"] = _spread(row, by_name.get(BASELINE))
        same = SAME_DTYPE_BASELINE[CONFIGS[row["config"]][1]]
        row["vs_torch_same_dtype"] = _ratio(row, by_name.get(same))
        row["vs_torch_same_dtype_middle_half"] = _spread(row, by_name.get(same))
    for row in out:
        del row["times"], row["rounds"], row["round_ids"]
    return out


def _one_repetition(workload, workers, args, rows, repetition=0):
    alive = []
    for w in workers:
        try:
            info = w.ask(cmd="setup", workload=workload, warmup=workload["warmup"])
        except (RuntimeError, OSError, EOFError) as e:  # (a worker that died: a broken pipe)
            print(f"{w.name}: failed\n{e}", file=sys.stderr)
            continue
        alive.append(w)
        row = rows.setdefault(w.name, dict(config=w.name, first=info["first_step_s"],
                                           times=[], rounds=[], round_ids=[],
                                           syncs_per_step=0, peak_memory_mb=0.0))
    for r in range(workload["rounds"]):
        k = r % max(len(alive), 1)
        for w in alive[k:] + alive[:k]:
            times = w.ask(cmd="run", steps=workload["steps_per_round"])["times"]
            rows[w.name]["times"].extend(times)
            rows[w.name]["rounds"].append(statistics.median(times))
            # (repetition, round): ratios pair a configuration's round with the same
            # round of the baseline, also when one of them missed a repetition
            rows[w.name]["round_ids"].append((repetition, r))
    for w in alive:
        row = rows[w.name]
        info = w.ask(cmd="finish")
        row.update(syncs_per_step=max(row["syncs_per_step"], info["syncs_per_step"]),
                   peak_memory_mb=max(row["peak_memory_mb"], info["peak_memory_mb"]),
                   final_loss=info["final_loss"])


def _round_ratios(row, base):
    """row's round medians / base's, round by round (the same repetition and round)."""
    if "round_ids" in row and "round_ids" in base:
        theirs = dict(zip(base["round_ids"], base["rounds"]))
        return [a / theirs[i] for i, a in zip(row["round_ids"], row["rounds"]) if i in theirs]
    return [a / b for a, b in zip(row["rounds"], base["rounds"])]


def _ratio(row, base):
    """Median over rounds of row's round median / base's round median (same round)."""
    if base is None:
        return None
    ratios = _round_ratios(row, base)
    return statistics.median(ratios) if ratios else None


def _spread(row, base):
    """The middle half (25th to 75th percentile) of the per-round ratios whose median is
    :func:`_ratio`: how far single rounds of this run scatter around it."""
    if base is None:
        return None
    ratios = sorted(_round_ratios(row, base))
    if len(ratios) < 2:
        return None
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    return [q[0], q[2]]


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def versions():
    import triton

    import tritamp
    return dict(torch=torch.__version__, triton=triton.__version__, tritamp=tritamp.__version__,
                python=platform.python_version())


def _fmt_ratio(x):
    return "-" if x is None else f"{x:.2f}x"


def format_table(rows):
    head = ["config", "samples/s", "step ms", "vs " + BASELINE, "vs torch same dtype",
            "peak MB", "syncs/step", "1st step +s", "loss/O0"]
    base = next((r["final_loss"] for r in rows if r["config"] == "O0"), None)
    lines = []
    for r in rows:
        rel = f"{r['final_loss'] / base:.3f}" if base else "-"
        lines.append([r["config"], f"{r['samples_per_s']:.1f}", f"{r['step_ms']:.1f}",
                      _fmt_ratio(r["vs_torch_amp_bf16"]), _fmt_ratio(r["vs_torch_same_dtype"]),
                      f"{r['peak_memory_mb']:.0f}", str(r["syncs_per_step"]),
                      f"{r['first_step_extra_s']:.2f}", rel])
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
    fmt = "  ".join("{:<%d}" % widths[0] if i == 0 else "{:>%d}" % w
                    for i, w in enumerate(widths))
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*l) for l in lines]
    return "\n".join(out)


def target_lines(rows):
    """The CPU targets this run can judge: (text, met) per target."""
    by_name = {r["config"]: r for r in rows}
    out = []
    for config, baseline, limit in TARGETS:
        row = by_name.get(config)
        if row is None or baseline not in by_name:
            continue
        key = "vs_torch_amp_bf16" if baseline == BASELINE else "vs_torch_same_dtype"
        ratio, spread = row[key], row.get(key + "_middle_half")
        if ratio is None:  # (no round in common with its baseline)
            continue
        met = ratio <= limit
        # digits enough to show which side of the limit it is (1.0004 is not 1.000)
        shown = f"{ratio:.3f}"
        if float(shown) == limit and ratio != limit:
            shown = f"{ratio:.5f}"
        text = f"{config} <= {limit:.2f}x {baseline}: {shown}x {'met' if met else 'NOT met'}"
        if spread:
            lo, hi = spread
            text += f" (rounds' middle half {lo:.3f}-{hi:.3f}x"
            text += ": the target lies within it)" if lo <= limit <= hi else ")"
        out.append((text, met))
    return out


def write_chart(results, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 3.6 * len(results)), squeeze=False)
    for (ax_ratio, ax_mem), res in zip(axes, results):
        rows = res["rows"]
        names = [r["config"] for r in rows]
        ratios = [r["vs_torch_amp_bf16"] or 0.0 for r in rows]
        ax_ratio.bar(names, ratios, color="tab:blue")
        ax_ratio.axhline(1.0, color="black", linewidth=0.8)
        ax_ratio.set_ylabel(f"ms/step / {BASELINE}")
        ax_ratio.set_title(f"{res['workload']}: step time (lower is better)")
        ax_mem.bar(names, [r["peak_memory_mb"] for r in rows], color="tab:orange")
        ax_mem.set_ylabel("MiB")
        ax_mem.set_title(f"{res['workload']}: peak memory (lower is better)")
        for ax in (ax_ratio, ax_mem):
            ax.tick_params(axis="x", rotation=45)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def default_workloads(device):
    """(names, per-name settings) for the device when no --model is given."""
    if device.type != "cuda":
        return {k: dict(v) for k, v in WORKLOADS.items()}
    have_tv = True
    try:
        import torchvision  # noqa: F401
    except ImportError:
        have_tv = False
    cnn = dict(model="resnet50", optimizer="sgd", batch_size=256, image_size=224,
               channels_last=True) if have_tv else \
        dict(model="small-cnn", optimizer="sgd", batch_size=256, image_size=64,
             channels_last=True)
    return {"cnn-sgd": cnn,
            "transformer-adamw": dict(model="transformer", optimizer="adamw", batch_size=32,
                                      image_size=512, width=512, depth=6, heads=8,
                                      gpu_steps_per_round=40)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--workloads", default=None,
                   help="comma-separated: " + ", ".join(WORKLOADS) + " (default: all on a CPU; "
                        "ResNet-50 + SGD and a transformer + AdamW on a GPU)")
    p.add_argument("--model", default=None,
                   help="one workload of this model instead: small-cnn, transformer or a "
                        "torchvision model name")
    p.add_argument("--optimizer", default=None, choices=["sgd", "adamw"],
                   help="with --model (default: adamw for the transformer, else sgd)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--image-size", type=int, default=None,
                   help="image side, or the sequence length of the transformer")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds per workload and repetition (default on a CPU: 3 "
                        "for the small CNN, 8 for the transformer)")
    p.add_argument("--repeats", type=int, default=None,
                   help="fresh sets of worker processes per workload (default on a CPU: 5 "
                        "for the small CNN, 1 for the transformer)")
    p.add_argument("--steps-per-round", type=int, default=None,
                   help="timed steps of each configuration per round")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per worker (default on a CPU: 1, where the machine's "
                        "noise is lowest; 0 keeps torch's default)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--levels", default=None,
                   help="comma-separated configurations: " + ", ".join(CONFIGS) +
                        " (default: all on a GPU; without the fp16 ones on a CPU)")
    p.add_argument("--out", default="benchmarks/out", help="folder for the JSON and PNG")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is present")
    device = torch.device(args.device)
    cpu = device.type != "cuda"
    if args.threads is None:
        args.threads = 1 if cpu else 0
    if any(v is not None and v < 1 for v in (args.rounds, args.warmup, args.steps_per_round,
                                              args.repeats)):
        p.error("--rounds, --repeats, --steps-per-round and --warmup must be >= 1")
    # (a batch of 0 or images of side 0 ran: a table of nan losses and 0 samples/s)
    for flag, value in (("--batch-size", args.batch_size), ("--image-size", args.image_size)):
        if value is not None and value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if args.threads < 0:
        p.error(f"--threads must be >= 0 (0 keeps torch's default), got {args.threads}")
    if args.worker:
        return args
    if args.optimizer is not None and args.model is None:
        p.error("--optimizer applies to --model only (a workload names its optimizer: "
                "cnn-sgd, cnn-adamw, transformer-adamw)")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out!r} is a file; give a folder for the JSON and PNG")
    if args.model is not None:
        if args.workloads is not None:
            p.error("give --model or --workloads, not both")
        transformer = args.model == "transformer"
        base = dict(WORKLOADS["transformer-adamw" if transformer else "cnn-sgd"])
        if not cpu:
            base.update(default_workloads(device).get(
                "transformer-adamw" if transformer else "cnn-sgd", {}))
        base.update(model=args.model,
                    optimizer=args.optimizer or ("adamw" if transformer else "sgd"))
        if not transformer and args.model != "small-cnn":
            base.update(batch_size=256 if not cpu else 8, image_size=224 if not cpu else 64)
        workloads = {f"{args.model}-{base['optimizer']}": base}
    else:
        available = default_workloads(device)
        if args.workloads is not None:  # a name picks the device's sizes where it has them
            available = {**{k: dict(v) for k, v in WORKLOADS.items()}, **available}
        names = list(available) if args.workloads is None else \
            [s.strip() for s in args.workloads.split(",") if s.strip()]
        unknown = [s for s in names if s not in available]
        if unknown:
            p.error(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
        workloads = {k: available[k] for k in names}
    for w in workloads.values():
        if args.batch_size is not None:
            w["batch_size"] = args.batch_size
        if args.image_size is not None:
            w["image_size"] = args.image_size
        if args.channels_last is not None:
            w["channels_last"] = args.channels_last
        w.setdefault("channels_last", not cpu)
        w.setdefault("steps_per_round", 10)
        w.setdefault("warmup", 5)
        w.setdefault("repeats", 1)
        w.setdefault("rounds", 5)
        if args.rounds is not None:
            w["rounds"] = args.rounds
        if not cpu:  # (rounds of about half a second: ~15 ms steps of the transformer
            # are bound by the host's Python, whose jitter a 10-step round does not average)
            w.update(steps_per_round=w.get("gpu_steps_per_round", 10), warmup=5, repeats=1)
        if args.repeats is not None:
            w["repeats"] = args.repeats
        if args.steps_per_round is not None:
            w["steps_per_round"] = args.steps_per_round
        if args.warmup is not None:
            w["warmup"] = args.warmup
    for name, w in workloads.items():
        if w["model"] == "transformer" and w["image_size"] > TRANSFORMER_POSITIONS:
            p.error(f"--image-size {w['image_size']}: {name}'s transformer holds "
                    f"{TRANSFORMER_POSITIONS} positions; give a sequence length <= "
                    f"{TRANSFORMER_POSITIONS}")
    args.workload_specs = workloads
    if args.levels is None:
        levels = CPU_LEVELS if cpu else list(CONFIGS)
        args.fp16_left_out = cpu
    else:
        levels = [s.strip() for s in args.levels.split(",") if s.strip()]
        args.fp16_left_out = False
    unknown = [s for s in levels if s not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    twice = sorted({s for s in levels if levels.count(s) > 1})
    if twice:  # (two workers would share one row and one round's median)
        p.error(f"configuration(s) {twice} named more than once in --levels; name each once")
    args.levels = levels
    return args


def _worker_argv(args, name):
    return [sys.executable, os.path.abspath(__file__), "--worker", name, "--device", args.device,
            "--threads", str(args.threads)]


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker, args)
    device = torch.device(args.device)
    if device.type != "cuda":
        print("No GPU in use: a CPU run of small models; its numbers say nothing about GPU "
              "speed." + (" fp16 configurations are left out (a CPU has no fp16 arithmetic; "
                          "--levels runs them)." if args.fp16_left_out else ""))
    print(f"interleaved rounds, {args.threads or 'default'} thread(s), on "
          f"{device_name(device)}")
    t_start = time.perf_counter()
    results = []
    measured = measure(args.workload_specs, args)
    for wname, spec in args.workload_specs.items():
        data = (f"{spec['image_size']}-token sequences" if spec["model"] == "transformer"
                else f"{spec['image_size']}x{spec['image_size']} images")
        print(f"\n== {wname}: {spec['model']} + {spec['optimizer']}, batch "
              f"{spec['batch_size']}, synthetic {data}; {spec['repeats']} x {spec['rounds']} "
              f"rounds of {spec['steps_per_round']} timed steps per configuration after "
              f"{spec['warmup']} warm-up")
        rows = measured[wname]
        if not rows:
            print("no configuration ran", file=sys.stderr)
            return 1
        print(format_table(rows))
        for text, _ in target_lines(rows) if device.type != "cuda" else []:
            print("  target " + text)
        results.append(dict(workload=wname, **spec, rows=rows))
    complete = all(len(r["rows"]) == len(args.levels) for r in results)
    os.makedirs(args.out, exist_ok=True)
    meta = dict(device=device_name(device), **versions(), threads=args.threads,
                seconds=time.perf_counter() - t_start)
    json_path = os.path.join(args.out, f"opt_levels_{device.type}.json")
    with open(json_path, "w") as f:
        json.dump(dict(meta, workloads=results), f, indent=2)
    title = (f"{meta['device']} | torch {meta['torch']}, triton {meta['triton']}, "
             f"tritamp {meta['tritamp']}")
    png = write_chart(results, os.path.join(args.out, f"opt_levels_{device.type}.png"), title)
    print(f"\nwrote {json_path}" + (f" and {png}" if png else "") +
          f" in {meta['seconds']:.0f} s")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
