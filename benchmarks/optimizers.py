"""Time one mixed-precision optimizer step: tritamp's fused optimizers against torch's.

    python benchmarks/optimizers.py                              # 25M, 100M, 1B on the GPU
    python benchmarks/optimizers.py --sizes 100M --optimizers adam,adagrad
    python benchmarks/optimizers.py --device cpu                 # a small CPU smoke run

For each optimizer, parameter count and layout ("resnet50": ResNet-50's 161 tensors,
big conv weights and many small BatchNorm vectors, widened to the count; "transformer":
many equal matrices and small vectors), one training step's optimizer work is timed:

- tritamp (amp O2): fp32 masters, fp16 model weights and fp16 gradients; the overflow
  check amp runs when the backward ends (one read of the fp16 gradients), then the fused
  step with ``grad_scale`` / ``found_inf`` on the device, unscaling folded in and the
  fp16 model copy written in the same pass.
- torch (torch.amp's layout: fp32 weights and fp32 gradients), driven as
  ``torch.amp.GradScaler`` drives it: fused optimizers get the non-finite check
  (``_amp_foreach_non_finite_check_and_unscale_`` with scale 1, which rewrites the
  gradients) and a step with ``grad_scale`` / ``found_inf``; foreach optimizers get the
  unscale, a host read of ``found_inf`` and the step.

``grad_scale`` holds 1.0 so repeated in-place unscaling leaves the gradients as they were
between repetitions; the arithmetic is the same for any scale. Bytes are the least
traffic the step needs in its layout: every read and write of weight, gradient, state
and copy once, plus the overflow check's (fp32 state; LAMB and NovoGrad really need
more passes). GB/s is bytes / median time; "copy BW" is the share of a large device copy's
measured bandwidth; "vs torch" is torch's time / this row's time (its fused optimizer
where torch has one on the device, else foreach). Timing on the GPU: quantiles 0.5 / 0.2 /
0.8 over replays of the step captured in a CUDA graph (:func:`cuda_graph_ms`); on a CPU a
short wall-clock median of tritamp's CPU path, which says nothing about GPU speed.
"""
import argparse
import gc
import importlib
import importlib.util
import json
import math
import os
import statistics
import sys
import time

import torch
from torch import nn

DEFAULT_SIZES = {"cuda": "25M,100M,1B", "cpu": "100K"}
LAYOUTS = ("resnet50", "transformer")
GRAD_DTYPE = torch.float16  # the half dtype of the default run on a CPU
HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DEFAULT_HALVES = {"cuda": "fp16,bf16", "cpu": "fp16"}


# -- environment: the same device and version facts as the opt-level benchmark ----------
if __name__ == "__main__" and not __package__:
    sys.exit("run it as a module from the repository root: python3 -m benchmarks.optimizers")

from .opt_levels import device_name, versions  # noqa: E402,F401


# -- sizes and layouts ----------------------------------------------------------------------
def parse_size(text):
    """'25M' -> 25_000_000; also K, B (10**9) and plain integers."""
    t = text.strip().upper()
    mult = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "G": 10 ** 9}.get(t[-1:], 1)
    number = t[:-1] if mult != 1 else t
    try:
        value = int(round(float(number) * mult))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 25M, 1B, 50K") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: must be positive")
    return value


def size_label(n):
    for unit, div in (("B", 10 ** 9), ("M", 10 ** 6), ("K", 10 ** 3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def resnet50_shapes(width):
    """ResNet-50's 161 parameter tensors with every channel count times ``width``."""
    c = lambda n: max(1, round(n * width))  # noqa: E731
    shapes = [(c(64), 3, 7, 7), (c(64),), (c(64),)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(c(planes), c(inplanes), 1, 1), (c(planes),), (c(planes),),
                       (c(planes), c(planes), 3, 3), (c(planes),), (c(planes),),
                       (c(planes * 4), c(planes), 1, 1), (c(planes * 4),), (c(planes * 4),)]
            if b == 0:  # the downsample branch
                shapes += [(c(planes * 4), c(inplanes), 1, 1), (c(planes * 4),),
                           (c(planes * 4),)]
            inplanes = planes * 4
    return shapes + [(1000, c(2048)), (1000,)]


def transformer_shapes(n):
    """Layers of (qkv, out, fc1, fc2) matrices with their biases and two LayerNorms."""
    d = 1024 if n >= 500e6 else 512 if n >= 50e6 else 256 if n >= 5e6 else \
        128 if n >= 500e3 else 16
    per_layer = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,),
                 (d,), (d,), (d,), (d,)]
    layers = max(1, round(n / (12 * d * d + 13 * d)))
    return per_layer * layers


def layout_shapes(layout, n):
    if layout == "transformer":
        return transformer_shapes(n)
    lo, hi = 1e-3, 100.0  # bisect the width multiplier onto the count
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if numel(resnet50_shapes(mid)) < n:
            lo = mid
        else:
            hi = mid
    return resnet50_shapes(hi)


def numel(shapes):
    return sum(math.prod(s) for s in shapes)


# -- optimizers --------------------------------------------------------------------------
class Spec:
    def __init__(self, name, states, make_tritamp, torch_impls):
        self.name = name
        self.states = states            # fp32 state values per element
        self.make_tritamp = make_tritamp
        self.torch_impls = torch_impls  # [(impl name, factory(params, device))]


def optimizer_specs():
    """Every optimizer this checkout has: FusedLAMB / FusedNovoGrad only where present."""
    from tritamp.optimizers.fused_adagrad import FusedAdagrad
    from tritamp.optimizers.fused_adam import FusedAdam
    from tritamp.optimizers.fused_sgd import FusedSGD

    specs = {
        "adam": Spec("adam", 2, lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01), [
            # capturable on a GPU: its step count stays on the device and the step can be
            # captured in a CUDA graph like tritamp's (it was timed with events around plain
            # calls, host time and all: 0.55-2.9 ms against 0.33 ms, run 3 of
            # docs/gpu-results.md)
            ("torch fused", lambda ps, dev: torch.optim.AdamW(
                ps, lr=1e-3, weight_decay=0.01, fused=True, capturable=dev.type == "cuda")),
            ("torch foreach", lambda ps, dev: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01,
                                                                foreach=True))]),
        "sgd": Spec("sgd", 1, lambda ps: FusedSGD(ps, lr=0.01, momentum=0.9), [
            ("torch fused", lambda ps, dev: torch.optim.SGD(ps, lr=0.01, momentum=0.9,
                                                            fused=True)),
            ("torch foreach", lambda ps, dev: torch.optim.SGD(ps, lr=0.01, momentum=0.9,
                                                              foreach=True))]),
        # torch's fused Adagrad is CPU-only
        "adagrad": Spec("adagrad", 1, lambda ps: FusedAdagrad(ps, lr=0.01), [
            ("torch fused", lambda ps, dev: torch.optim.Adagrad(ps, lr=0.01, fused=True)
             if dev.type == "cpu" else None),
            ("torch foreach", lambda ps, dev: torch.optim.Adagrad(ps, lr=0.01, foreach=True))]),
    }
    lamb = _optional_module("tritamp.optimizers.fused_lamb")
    if lamb is not None:
        specs["lamb"] = Spec("lamb", 2, lambda ps: lamb.FusedLAMB(ps, lr=1e-3), [])
    novograd = _optional_module("tritamp.optimizers.fused_novograd")
    if novograd is not None:
        specs["novograd"] = Spec("novograd", 1, lambda ps: novograd.FusedNovoGrad(ps, lr=1e-3),
                                 [])
    return specs


def _optional_module(name):
    if importlib.util.find_spec(name) is None:
        return None
    try:
        return importlib.import_module(name)
    except Exception as exc:  # present but broken: say so, benchmark the rest
        print(f"{name} does not import ({type(exc).__name__}: {exc}); left out", file=sys.stderr)
        return None


def bytes_per_element(impl, states):
    if impl == "tritamp":
        # check: read fp16 grad; step: read master, grad, states; write master, states, copy
        return 2 + (4 + 2 + 4 * states) + (4 + 4 * states + 2)
    # check/unscale: read + write fp32 grad; step: read param, grad, states; write param, states
    return 8 + (4 + 4 + 4 * states) + (4 + 4 * states)


def resident_bytes(impl, states, n):
    if impl == "tritamp":  # fp32 model while amp casts it, masters, half weights and grads
        return n * (4 + 4 + 2 + 2 + 4 * states)
    extra = 8 if "foreach" in impl else 0  # foreach temporaries
    return n * (4 + 4 + 4 * states + extra)


def free_bytes(device):
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


# -- timing ------------------------------------------------------------------------------
HOST_CALLS = 50  # calls of a step timed on the host (no synchronisation inside)


def host_ms(fn, calls=HOST_CALLS):
    """Host time of one call: ``calls`` calls back to back, the device not waited for
    inside the loop (what the Python, the dispatch and the launches cost the host)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / calls


GRAPH_MS = 5.0          # device time one captured graph aims at
GRAPH_MAX_CALLS = 1000  # calls captured in one graph at most
GRAPH_REPLAYS = 20      # replays timed, each between its own pair of CUDA events


def graph_calls(estimate_ms, graph_ms=GRAPH_MS, max_calls=GRAPH_MAX_CALLS):
    """Calls of a step captured in one CUDA graph: enough for ``graph_ms`` of device time
    at ``estimate_ms`` a call (events around a replay then time milliseconds), at least 1
    and at most ``max_calls``: capturing costs the host one call's Python per call, and
    an uncapped count (``rep / estimate``) made a microsecond kernel's row cost seconds of
    capture."""
    if not estimate_ms > 0:  # (0 or nan: below the events' resolution)
        return max_calls
    return max(1, min(max_calls, math.ceil(graph_ms / estimate_ms)))


def _quantiles(samples, qs):
    """Quantiles ``qs`` of ``samples``, linearly interpolated between order statistics."""
    xs = sorted(samples)
    out = []
    for q in qs:
        pos = q * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        out.append(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))
    return out


def cuda_graph_ms(fn, quantiles=(0.5, 0.2, 0.8), replays=GRAPH_REPLAYS):
    """Device ms of one call of ``fn``: ``graph_calls`` calls captured in one CUDA graph,
    the graph replayed ``replays`` times, each replay between CUDA events; the
    ``quantiles`` of (replay time / calls). Raises if ``fn`` cannot be captured."""
    with torch.cuda.stream(torch.cuda.Stream()):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        calls = graph_calls(start.elapsed_time(end) / 5)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        torch.cuda.synchronize()
        graph.replay()  # (the first replay uploads the graph)
        samples = []
        for _ in range(replays):
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / calls)
    return _quantiles(samples, quantiles)


def make_timer(device, cpu_reps):
    """``timed(fn) -> [median ms, p20 ms, p80 ms, timing, host ms]``.

    On a GPU the device time comes from replaying ``fn`` captured in a CUDA graph
    (:func:`cuda_graph_ms`: CUDA events around each replay of a graph of up to
    ``GRAPH_MAX_CALLS`` calls, so the host's launch cost is not in it); a step that cannot
    be captured (it reads a device value on the host, as GradScaler's unscale_ + step of a
    non-fused optimizer does) is timed with CUDA events around plain calls
    (``triton.testing.do_bench``) and says so. The host time of one call is measured apart
    (:func:`host_ms`). On a CPU: a short wall-clock median."""
    if device.type == "cuda":
        import triton.testing

        def timed(fn):
            fn()  # first call: state, plans, compilation
            torch.cuda.synchronize()
            host = host_ms(fn)
            try:
                res = cuda_graph_ms(fn)
                how = "cuda graph"
            except Exception:  # not capturable: events around plain calls
                torch.cuda.synchronize()
                res = triton.testing.do_bench(fn, warmup=25, rep=100,
                                              quantiles=[0.5, 0.2, 0.8])
                how = "cuda events"
            return [*res, how, host]
        return timed

    def timed(fn):
        fn()  # warm-up: state allocation, first-call work
        samples = []
        for _ in range(cpu_reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        samples.sort()
        q = lambda f: samples[min(len(samples) - 1, int(f * len(samples)))]  # noqa: E731
        return [statistics.median(samples), q(0.2), q(0.8), "cpu wall clock", None]
    return timed


def copy_bandwidth(device, timed):
    """GB/s of a large device-to-device copy (read + write)."""
    n = (256 << 20) if device.type == "cuda" else (16 << 20)
    n = min(n, free_bytes(device) // 16)
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src))[0]
    return 2 * 4 * n / (ms * 1e-3) / 1e9


# -- one configuration ----------------------------------------------------------------------
class Params(nn.Module):
    def __init__(self, shapes, device):
        super().__init__()
        gen = torch.Generator(device=device).manual_seed(0)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(s, device=device, generator=gen) * 0.02) for s in shapes)


def _grads_like(params, dtype, device):
    gen = torch.Generator(device=device).manual_seed(1)
    for p in params:
        p.grad = (torch.randn(p.shape, device=device, generator=gen) * 1e-3).to(dtype)


def tritamp_step(spec, shapes, device, half=GRAD_DTYPE):
    """Set up amp O2 (``half``: the model's half dtype) and return the step: amp's
    overflow check, then the fused step."""
    from tritamp import amp
    from tritamp.kernels import check_unscale_launch, check_unscale_prepare

    model = Params(shapes, device)
    opt = spec.make_tritamp(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=half, verbosity=0)
    halves = list(model.parameters())
    _grads_like(halves, half, device)
    grads = [p.grad for p in halves]
    found_inf = torch.zeros((), device=device)
    scale = torch.ones((), device=device)
    # amp wraps the bound step in its state machine (it needs a backward); after the lazy
    # check it calls the class's own step with these two attributes set, as done here.
    fused_step = type(opt).step
    # scale_loss's exit keeps its check prepared between steps (the gradients' addresses
    # are its key): one launch a step, no validation, no table uploaded
    check = check_unscale_prepare(grads, write=False)

    def step():
        found_inf.zero_()
        check_unscale_launch(check, found_inf=found_inf)  # what scale_loss's exit runs
        opt.grad_scale, opt.found_inf = scale, found_inf
        fused_step(opt)
    return step, (model, opt)


def torch_step(factory, shapes, device):
    model = Params(shapes, device)
    params = list(model.parameters())
    opt = factory(params, device)
    if opt is None:
        return None, None
    _grads_like(params, torch.float32, device)
    grads = [p.grad for p in params]
    found_inf = torch.zeros((), device=device)
    scale = torch.ones((), device=device)
    inv_scale = scale.double().reciprocal().float()
    if getattr(opt, "_step_supports_amp_scaling", False):
        def step():  # GradScaler: _check_inf_per_device, then the fused step
            found_inf.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, scale)
            opt.grad_scale, opt.found_inf = scale, found_inf
            opt.step()
    else:
        def step():  # GradScaler: unscale_, a host read of found_inf, the step
            found_inf.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            if not found_inf.item():
                opt.step()
    return step, (model, opt)


def freeze_imports():
    """Move every object alive now (the modules, torch, triton, tritamp) to the garbage
    collector's permanent generation: the ``gc.collect()`` after each row then scans only
    the objects made since, which took one from about 90 ms on a 2-core x86-64 machine
    (hundreds of rows: tens of seconds of a time-limited GPU run) to microseconds. For a
    benchmark run as a program, before its ``main``."""
    gc.collect()
    gc.freeze()


def _release(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class SkipRow(Exception):
    """Raised by a measurement that cannot run here; the row says ``skipped: <reason>``."""


_BUDGET = [None, None]  # [monotonic deadline, the budget in seconds]
_PROGRESS = [None]      # called with each row once it is measured or skipped


def set_progress(fn):
    """Call ``fn(row)`` as each row of :func:`time_row` (or :func:`run_one`) is done, or
    stop with ``None``."""
    _PROGRESS[0] = fn


def _done(row):
    if _PROGRESS[0] is not None:
        _PROGRESS[0](row)
    return row


def set_budget(seconds):
    """From now on, rows that would start more than ``seconds`` later are not measured
    (:func:`time_row` marks them skipped), so a run under a time limit still ends with
    its table and JSON. ``None``: no budget."""
    _BUDGET[:] = ([None, None] if seconds is None
                  else [time.monotonic() + seconds, seconds])


ROTATE_MAX = 16  # working sets rotated at most, for a step that moves few bytes


def l2_bytes(device):
    """The device's last-level cache in bytes (0 on a CPU: no rotation there)."""
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 0)


def rotation(nbytes, l2):
    """How many working sets of ``nbytes`` a row rotates through so that each call
    reads from device memory, not from what the last call left in an ``l2``-byte cache:
    enough to cover twice the cache, at most ``ROTATE_MAX``; 1 when one set is larger."""
    if l2 <= 0 or nbytes <= 0 or nbytes >= 2 * l2:
        return 1
    return min(ROTATE_MAX, math.ceil(2 * l2 / nbytes))


class Rotating:
    """A step that calls ``steps[0]``, ``steps[1]``, ... in turn: each made by its own
    ``make()``, over its own tensors, so back-to-back calls (a captured graph's) do not
    find their inputs in the cache."""

    def __init__(self, steps):
        self.steps = list(steps)
        self.i = 0

    def __call__(self):
        step = self.steps[self.i]
        self.i = (self.i + 1) % len(self.steps)
        return step()


def time_row(row, make, device, timed, copy_gbps):
    """Fill ``row`` with the timing of the step from ``make() -> (step, bytes moved,
    tensors kept alive while it is timed)`` (every benchmark's row format): quantiles,
    bytes moved, GB/s and the share of the copy bandwidth. A step that moves less than
    twice the device's L2 cache is made several times and the copies are called in turn
    (:func:`rotation`; ``row["rotated"]``), so its bytes come from device memory as in a
    training step, and its share of the copy bandwidth means what it says. A failure is
    reported in ``note`` and the run goes on; the tensors are released before the next
    configuration. Once the time budget (:func:`set_budget`) has run out, the row is
    skipped unmeasured."""
    if _BUDGET[0] is not None and time.monotonic() > _BUDGET[0]:
        row["note"] = f"skipped: the time budget ({_BUDGET[1]:g} s) ran out"
        return _done(row)
    step = keep = None
    try:
        step, nbytes, keep = make()
        copies = rotation(nbytes, l2_bytes(device))
        if copies > 1:
            made = [(step, keep)] + [make()[::2] for _ in range(copies - 1)]
            step, keep = Rotating(s for s, _ in made), [k for _, k in made]
            row["rotated"] = copies
        med, p20, p80, *how = timed(step)
    except SkipRow as why:
        row["note"] = f"skipped: {why}"
        return _done(row)
    except torch.cuda.OutOfMemoryError:
        row["note"] = "skipped: out of device memory"
        return _done(row)
    except Exception as exc:  # a failing configuration is reported, the run goes on
        row["note"] = f"failed: {type(exc).__name__}: {exc}"[:300]
        return _done(row)
    finally:
        step = keep = None  # noqa: F841
        _release(device)
    gbps = nbytes / (med * 1e-3) / 1e9
    row.update(time_ms=med, time_ms_p20=p20, time_ms_p80=p80, bytes=nbytes, gbps=gbps,
               copy_bw_fraction=gbps / copy_gbps if copy_gbps else None,
               timing=how[0] if how else None, host_ms=how[1] if len(how) > 1 else None)
    return _done(row)


def start_report(device, cpu_reps, cpu_notice):
    """Print what runs where; return the timer, the facts every row carries and the
    measured copy bandwidth."""
    if device.type == "cuda":
        if device.index is not None:  # ("cuda" alone: the current device)
            torch.cuda.set_device(device.index)
    else:
        # one thread for both sides: torch's multi-threaded CPU ops slow down a
        # hundredfold when the other core is busy, tritamp's Python does not
        torch.set_num_threads(1)
        print(cpu_notice + " One thread.")
    timed = make_timer(device, cpu_reps)
    meta = dict(device=device_name(device), **versions())
    copy_gbps = copy_bandwidth(device, timed)
    print(f"{meta['device']} | torch {meta['torch']}, triton {meta['triton']}, "
          f"tritamp {meta['tritamp']} | measured copy bandwidth {copy_gbps:.1f} GB/s")
    return timed, meta, copy_gbps


def finish_report(rows, meta, copy_gbps, out_dir, name, device, first_column="optimizer",
                  **extra):
    """Print the table, write ``<out_dir>/<name>_<device>.json``; 0 unless a row failed."""
    print(format_table(rows).replace("optimizer", first_column.ljust(len("optimizer")), 1))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}_{device.type}.json")
    with open(path, "w") as f:
        json.dump(dict(meta, copy_bandwidth_gbps=copy_gbps, **extra, rows=rows), f, indent=2)
    print(f"wrote {path}")
    return 0 if all("time_ms" in r or r.get("note", "").startswith("skipped") for r in rows) \
        else 1


def run_one(spec, impl, factory, layout, n, device, timed, copy_gbps, meta, half="fp16"):
    shapes = layout_shapes(layout, n)
    count = numel(shapes)
    row = dict(meta, optimizer=spec.name, impl=impl, layout=layout, size=size_label(n),
               params=count, tensors=len(shapes))
    if impl == "tritamp":
        row["half_dtype"] = half
    need = resident_bytes(impl, spec.states, count)
    if need > 0.9 * free_bytes(device):
        row["note"] = (f"skipped: needs about {need / 2**30:.1f} GiB, "
                       f"{free_bytes(device) / 2**30:.1f} GiB free")
        return _done(row)
    nbytes = bytes_per_element(impl, spec.states) * count

    def make():
        step, keep = (tritamp_step(spec, shapes, device, HALF_DTYPES[half])
                      if impl == "tritamp" else torch_step(factory, shapes, device))
        if step is None:
            raise SkipRow(f"no {impl} implementation on {device.type}")
        return step, nbytes, keep
    return time_row(row, make, device, timed, copy_gbps)


def add_ratios(rows):
    """vs torch = the torch baseline's time / this row's time (same optimizer, layout, size)."""
    for r in rows:
        if "time_ms" not in r:
            continue
        base = None
        for impl in ("torch fused", "torch foreach"):
            base = next((b for b in rows if b["impl"] == impl and "time_ms" in b and
                         (b["optimizer"], b["layout"], b["size"]) ==
                         (r["optimizer"], r["layout"], r["size"])), None)
            if base is not None:
                break
        r["baseline"] = base["impl"] if base else None
        r["ratio_to_torch"] = base["time_ms"] / r["time_ms"] if base else None
        if base is not None and base.get("timing") != r.get("timing"):
            # A baseline that could not be captured in a CUDA graph (a host read of the
            # overflow flag) is timed with events around plain calls: its time holds the
            # host's launches and sync, this row's does not. No ratio between the two.
            r["ratio_to_torch"] = None
            r["ratio_note"] = (f"no ratio: {base['impl']} timed by {base.get('timing')}, "
                               f"this row by {r.get('timing')}")


# -- output ------------------------------------------------------------------------------
def format_table(rows):
    head = ["optimizer", "impl", "layout", "params", "tensors", "step ms", "p20-p80 ms",
            "MB moved", "GB/s", "copy BW", "vs torch", "host ms", "timing", "note"]
    lines = []
    for r in rows:
        t = "time_ms" in r
        lines.append([
            r["optimizer"], r["impl"] + (f" {r['half_dtype']}" if r.get("half_dtype") else ""),
            r["layout"], size_label(r["params"]), str(r["tensors"]),
            f"{r['time_ms']:.3f}" if t else "-",
            f"{r['time_ms_p20']:.3f}-{r['time_ms_p80']:.3f}" if t else "-",
            f"{r['bytes'] / 1e6:.1f}" if t else "-",
            f"{r['gbps']:.1f}" if t else "-",
            f"{r['copy_bw_fraction']:.0%}" if t and r.get("copy_bw_fraction") else "-",
            f"{r['ratio_to_torch']:.2f}x" if t and r.get("ratio_to_torch") else "-",
            f"{r['host_ms']:.3f}" if t and r.get("host_ms") is not None else "-",
            (r.get("timing") or "-") + (f", {r['rotated']} sets" if r.get("rotated") else ""),
            "; ".join(n for n in (r.get("note", ""), r.get("ratio_note", "")) if n)])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(("{:<%d}" if i in (0, 1, 2, 12, 13) else "{:>%d}") % w
                    for i, w in enumerate(widths))
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    return "\n".join(line.rstrip() for line in out + [fmt.format(*cells) for cells in lines])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated parameter counts (default: 25M,100M,1B on a GPU, "
                        "100K on a CPU)")
    p.add_argument("--optimizers", default=None,
                   help="comma-separated: adam, sgd, adagrad (+ lamb, novograd where present)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="resnet50, transformer")
    p.add_argument("--no-torch", action="store_true", help="skip the torch baselines")
    p.add_argument("--halves", default=None,
                   help="half dtypes of tritamp's O2 rows: fp16, bf16 (default: both on a "
                        "GPU, fp16 on a CPU)")
    p.add_argument("--cpu-reps", type=int, default=3, help="timed repetitions on a CPU")
    p.add_argument("--out", default="benchmarks/out", help="folder for the JSON")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is present")
    device = torch.device(args.device)
    try:
        args.sizes = [parse_size(s) for s in (args.sizes or DEFAULT_SIZES.get(device.type, "1M"))
                      .split(",") if s.strip()]
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    specs = optimizer_specs()
    names = [s.strip() for s in (args.optimizers or ",".join(specs)).split(",") if s.strip()]
    unknown = [s for s in names if s not in specs]
    if unknown:
        p.error(f"unknown optimizer(s) {unknown}; this checkout has {list(specs)}")
    args.specs = [specs[s] for s in names]
    args.layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    bad = [s for s in args.layouts if s not in LAYOUTS]
    if bad:
        p.error(f"unknown layout(s) {bad}; choose from {list(LAYOUTS)}")
    if args.cpu_reps < 1:
        p.error("--cpu-reps must be >= 1")
    args.halves = [s.strip() for s in (args.halves or DEFAULT_HALVES.get(device.type, "fp16"))
                   .split(",") if s.strip()]
    bad = [s for s in args.halves if s not in HALF_DTYPES]
    if bad:
        p.error(f"unknown half dtype(s) {bad}; choose from {list(HALF_DTYPES)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    timed, meta, copy_gbps = start_report(
        device, args.cpu_reps, "No GPU in use: these are CPU figures of small sizes (tritamp's "
        "CPU path, or Triton's interpreter, against torch's CPU ops); they say nothing about "
        "GPU speed.")
    rows = []
    for n in args.sizes:
        for layout in args.layouts:
            for spec in args.specs:
                for half in args.halves:
                    rows.append(run_one(spec, "tritamp", None, layout, n, device, timed,
                                        copy_gbps, meta, half))
                for impl, factory in ([] if args.no_torch else spec.torch_impls):
                    rows.append(run_one(spec, impl, factory, layout, n, device, timed,
                                        copy_gbps, meta))
    add_ratios(rows)
    return finish_report(rows, meta, copy_gbps, args.out, "optimizers", device,
                         half_dtypes=args.halves)


if __name__ == "__main__":
    freeze_imports()
    sys.exit(main())
