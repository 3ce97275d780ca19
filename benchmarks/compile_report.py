"""What the launchers really compile for an H100 (sm_90): registers, spills, access widths.

    python benchmarks/compile_report.py            # table + benchmarks/out/compile_report.json
    python benchmarks/compile_report.py --json -   # JSON on stdout (table on stderr)

No GPU needed. Two parts:

1. **Record** (:func:`record_specialisations`): every fused optimizer of
   ``tritamp.optimizers`` (FusedAdam, FusedSGD with momentum, FusedLAMB, FusedAdagrad,
   FusedNovoGrad) steps twice under ``tritamp.amp`` at O1 and O2 with fp16 and bf16,
   inside :func:`tritamp.kernels.recorder.record_launches`: on CPU tensors, down the
   CUDA code path, with Triton specialising every argument for a stand-in sm_90 device.
   Twice per configuration: a model whose every parameter numel is a multiple of 8 (the
   aligned, vectorised path ``VEC`` > 1 is taken) and the same model with one odd-sized
   parameter (its dtype group takes the masked path, ``VEC = 1``). Each optimizer also
   steps fp32 parameters under ``torch.amp.GradScaler``, whose steps write the unscaled
   gradients back (the kernels' ``WRITE_GRAD`` variants); FusedLAMB and FusedNovoGrad
   also step as over DTensor shards (their per-tensor norms reduced between stages: the
   NovoGrad blend's two-stage variants), and every one steps bf16 parameters without
   masters, stochastically rounded and Kahan-compensated (FusedAdam also with bf16
   moments). Then every multi-tensor op
   of the op registry (``tritamp.kernels.registry``: check/unscale, l2norm, scale, axpby
   and the optimizer steps) directly, on the registry's samples of each dtype, with both
   kinds of lists.
   Each kernel-cache miss is one specialisation: the kernel, its argument dtypes, the
   alignment Triton proved (``tt.divisibility``), the constexprs and ``num_warps``,
   exactly as a GPU run would compile it.
2. **Compile** each distinct specialisation with
   ``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=sm_90)`` (the
   recorded attrs, so the alignment specialisation matches), in a pool of worker
   processes (one per available CPU, at most 16: ``--workers``), and read the cubin:
   registers and spills (``REG``, ``STACK``, ``LOCAL`` from ``cuobjdump -res-usage``),
   and every global load and store in the SASS
   (``nvdisasm``) by width: ``LDG.E.128`` moves 16 bytes, ``LDG.E.64`` 8, ``LDG.E`` 4,
   ``LDG.E.U16`` 2. The PTX is checked for ``.target sm_90``, approximate square roots or
   divisions (``sqrt.approx``, ``div.full``) and round-to-nearest bf16 conversions
   (``cvt.rn.bf16.f32``, or ``cvt.rn.bf16x2.f32`` for packed pairs).

Configurations that fail (a launcher mid-port, an API change) are reported with their
error; the rest still runs.

Each compile goes through Triton's cache (``~/.triton/cache`` or ``TRITON_CACHE_DIR``)
under the key a launch of the same specialisation computes (the same source, signature,
constexprs, attributes, options and target): on an sm_90 device, kernels the report
compiled are loaded from the cache on first launch instead of compiled again. The GPU
report runs it first for that reason.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

os.environ["TRITON_INTERPRET"] = "0"  # before tritamp is imported: compiled-mode kernels

import torch  # noqa: E402
from torch import nn  # noqa: E402

from tritamp.kernels import registry  # noqa: E402  (the op registry: samples, budgets)

if __package__:
    from .sass import barriers, loop_barriers  # noqa: E402  (reading SASS listings)
else:  # run as a script (python benchmarks/compile_report.py): benchmarks/ is on the path
    from sass import barriers, loop_barriers  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out", "compile_report.json")
OPTIMIZERS = ("FusedAdam", "FusedSGD", "FusedLAMB", "FusedAdagrad", "FusedNovoGrad")
LEVELS = ("O1", "O2")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Register budgets on the aligned path (BLOCK=1024, num_warps=4), per kernel family: the
# op registry's.
REGISTER_BUDGET = {op.kernel_family: op.register_budget for op in registry.OPS
                   if op.register_budget is not None}


def family(kernel_name):
    """'_lamb_moments_kernel' -> 'lamb' (the REGISTER_BUDGET key), or None."""
    for f in REGISTER_BUDGET:
        if kernel_name.lstrip("_").startswith(f):
            return f
    return None


# --- recording -------------------------------------------------------------------------
class _Model(nn.Module):
    """Linear layers and a BatchNorm (kept fp32 at O2): every numel a multiple of 8,
    unless ``odd`` adds a 7-element parameter."""

    def __init__(self, odd=False):
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 16)
        self.odd = nn.Parameter(torch.randn(7)) if odd else None


def _optimizer(name, params):
    import tritamp.optimizers as O
    cls = getattr(O, name)
    if name == "FusedSGD":
        return cls(params, lr=0.1, momentum=0.9)
    return cls(params, lr=1e-3)


def _amp_steps(opt_name, level, dtype_name, odd, steps=2):
    from tritamp import amp
    torch.manual_seed(0)
    model = _Model(odd)
    opt = _optimizer(opt_name, model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=DTYPES[dtype_name],
                                loss_scale="dynamic", verbosity=0)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.full_like(p, 1e-3) for p in params]
    for _ in range(steps):
        with amp.scale_loss(torch.zeros(()), opt):
            for p, g in zip(params, grads):
                p.grad = g
        opt.step()
        opt.zero_grad()


def _grad_scaler_steps(opt_name, odd, steps=2):
    """torch.amp.GradScaler driving the optimizer (fp32 parameters): its step writes the
    unscaled gradients back (the ``WRITE_GRAD`` variants of the kernels)."""
    torch.manual_seed(0)
    model = _Model(odd)
    opt = _optimizer(opt_name, model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.full_like(p, 1e-3) for p in params]
    for _ in range(steps):
        scaler.scale(torch.zeros(()))  # what a backward of the scaled loss would start with
        for p, g in zip(params, grads):
            p.grad = g.clone()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def _sharded_steps(opt_name, odd, norm_type=2, steps=2):
    """FusedLAMB / FusedNovoGrad steps as over DTensor shards: per-tensor norms reduced
    across processes between stages (``norm_reduce``; here a one-process reduce, which
    changes nothing), so the stages that run around the reduce are recorded."""
    torch.manual_seed(0)
    model = _Model(odd)
    params = [p for p in model.parameters() if p.requires_grad]
    import tritamp.optimizers as O
    opt = (O.FusedNovoGrad(params, lr=1e-3, norm_type=norm_type) if opt_name == "FusedNovoGrad"
           else O.FusedLAMB(params, lr=1e-3))
    opt._norm_reduce = lambda: (lambda t, op: t)
    _constant_grad_steps(opt, params, steps)


def _constant_grad_steps(opt, params, steps):
    """``steps`` plain steps of ``opt`` with every gradient 1e-3."""
    grads = [torch.full_like(p, 1e-3) for p in params]
    for _ in range(steps):
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        opt.zero_grad()


def _rounding_steps(opt_name, mode, odd=False, steps=2):
    """bf16 parameters without masters (an fp32 BatchNorm beside them), stored with
    stochastic rounding or a Kahan compensation; ``"bf16 moments"``: FusedAdam with
    ``state_dtype=torch.bfloat16`` and stochastic rounding."""
    torch.manual_seed(0)
    model = _Model(odd)
    model.fc1.to(torch.bfloat16)
    model.fc2.to(torch.bfloat16)
    if model.odd is not None:
        model.odd.data = model.odd.data.to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    import tritamp.optimizers as O
    flags = (dict(kahan_summation=True) if mode == "kahan"
             else dict(stochastic_rounding=True, seed=0))
    if mode == "bf16 moments":
        flags["state_dtype"] = torch.bfloat16
    cls = getattr(O, opt_name)
    opt = (cls(params, lr=0.1, momentum=0.9, **flags) if opt_name == "FusedSGD"
           else cls(params, lr=1e-3, **flags))
    _constant_grad_steps(opt, params, steps)


def _shapes(odd):
    """Every numel a multiple of 8 (the aligned, vectorised path), or with one 7-element
    tensor (its dtype group takes the masked path)."""
    return [(n,) for n in [2048, 32, 512, 16] + ([7] if odd else [])]


def _direct_calls():
    """Every multi-tensor op of the registry (tritamp.kernels.registry) called directly on
    its samples: name -> callable. One scenario per op, dtype (fp32, fp16, bf16) and kind
    of list (aligned, or ``+odd``), running every sample of that dtype."""
    calls = {}
    for op in registry.OPS:
        if not op.multi_tensor:
            continue
        for dt in op.dtypes:
            for odd in (False, True):
                def run(op=op, dt=dt, odd=odd):
                    for sample in op.sample_inputs("cpu", _shapes(odd)):
                        if sample.dtype == dt:
                            sample.call(op.launcher)

                calls[f"{op.name} {registry.DTYPE_NAMES[dt]}{' +odd' if odd else ''}"] = run
    return calls


def record_specialisations(optimizers=OPTIMIZERS, log=None):
    """Run every scenario under the recorder. Returns (specialisations, sources, errors):
    distinct :class:`~tritamp.kernels.recorder.Specialisation` in order of first use,
    {id(spec): [scenario, ...]} and {scenario: error}."""
    scenarios = {}
    for opt_name in optimizers:
        for level in LEVELS:
            for dname in DTYPES:
                for odd in (False, True):
                    scenarios[f"{opt_name} {level} {dname}{' +odd' if odd else ''}"] = (
                        lambda o=opt_name, lv=level, d=dname, od=odd: _amp_steps(o, lv, d, od))
        for odd in (False, True):
            scenarios[f"{opt_name} GradScaler fp32{' +odd' if odd else ''}"] = (
                lambda o=opt_name, od=odd: _grad_scaler_steps(o, od))
    for odd in (False, True):
        tail = " +odd" if odd else ""
        if "FusedLAMB" in optimizers:
            scenarios[f"FusedLAMB sharded fp32{tail}"] = (
                lambda od=odd: _sharded_steps("FusedLAMB", od))
        if "FusedNovoGrad" in optimizers:
            for norm_type in (2, 0):
                scenarios[f"FusedNovoGrad norm_type={norm_type} sharded fp32{tail}"] = (
                    lambda od=odd, nt=norm_type: _sharded_steps("FusedNovoGrad", od, nt))
    for opt_name in optimizers:
        for mode in ("stochastic", "kahan"):
            scenarios[f"{opt_name} bf16 {mode}"] = (
                lambda o=opt_name, m=mode: _rounding_steps(o, m))
    if "FusedAdam" in optimizers:
        scenarios["FusedAdam bf16 moments"] = lambda: _rounding_steps("FusedAdam",
                                                                      "bf16 moments")
    scenarios.update(_direct_calls())
    specs, sources, _, errors = record_scenarios(scenarios, log)
    return specs, sources, errors


# --- the norms: LayerNorm / RMSNorm at representative widths ------------------------------
NORM_WIDTHS = (256, 768, 1024, 4096, 8192, 12288, 32768, 65536)
NORM_ROWS = 512          # more rows than 2 x SM: the backward's grid is its full 2 x SM
NORM_DTYPES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
               "fp16/fp32 weight": (torch.float16, torch.float32)}
NORM_REGISTER_LIMIT = 64  # LayerNorm / RMSNorm forward and backward up to width 8192
NORM_REGISTER_LIMIT_WIDTH = 8192


def _norm_scenarios():
    """{name: callable}: forward and backward of LayerNorm and RMSNorm (from the input, and
    from the output as memory_efficient does) at every width of NORM_WIDTHS, per dtype.
    The tensors are allocated, never filled: nothing runs."""
    from tritamp.kernels.layer_norm import layer_norm_bwd, layer_norm_fwd

    def run(n, dt, wdt, rms, from_output):
        x = torch.empty(NORM_ROWS, n, dtype=dt)
        w = torch.empty(n, dtype=wdt)
        b = None if rms else torch.empty(n, dtype=wdt)
        y, mean, rstd = layer_norm_fwd(x, n, w, b, 1e-5, rms)
        layer_norm_bwd(torch.empty_like(y), y if from_output else x, n, w, b, mean, rstd, rms,
                       from_output=from_output, x_dtype=dt)

    out = {}
    for n in NORM_WIDTHS:
        for dname, (dt, wdt) in NORM_DTYPES.items():
            for rms in (False, True):
                for from_output in (False, True):
                    name = (f"{'rms' if rms else 'layer'}_norm n={n} {dname}"
                            f"{' from_output' if from_output else ''}")
                    out[name] = (lambda n=n, dt=dt, wdt=wdt, rms=rms, fo=from_output:
                                 run(n, dt, wdt, rms, fo))
    return out


# SyncBatchNorm at ResNet-50's BatchNorm shapes: (C, H, W) at each spatial size
SYNCBN_SHAPES = ((64, 56, 56), (256, 56, 56), (128, 28, 28), (512, 28, 28), (256, 14, 14),
                 (1024, 14, 14), (512, 7, 7), (2048, 7, 7))
SYNCBN_BATCH = 4
SYNCBN_LOOP_BATCH = 256
SYNCBN_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SYNCBN_REGISTER_LIMIT = 80


def _syncbn_scenarios():
    """{name: callable}: a training step (forward, backward) of tritamp's SyncBatchNorm in
    one process at every shape of SYNCBN_SHAPES, channels last and first, per dtype, and
    with a residual input and a fused ReLU (SyncBatchNorm's functional form) at 14x14."""
    from tritamp.parallel import SyncBatchNorm

    def run(shape, dt, channels_last):
        c = shape[1]
        x = torch.empty(shape, dtype=dt)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        layer = SyncBatchNorm(c)  # a channels_last tensor is read in its memory order
        y = layer(x)
        y.backward(torch.empty_like(y))

    out = {}
    for dname, dt in SYNCBN_DTYPES.items():
        for channels_last in (True, False):
            for c, h, w in SYNCBN_SHAPES:
                name = f"syncbn {'CL' if channels_last else 'CF'} {c}x{h}x{w} {dname}"
                out[name] = (lambda s=(SYNCBN_BATCH, c, h, w), dt=dt, cl=channels_last:
                             run(s, dt, cl))
    # At batch 4 most reductions give each program one tile (the loop is compiled away);
    # a batch of 256 at 7x7 gives the small-plane tiles a loop too.
    for channels_last in (True, False):
        name = f"syncbn {'CL' if channels_last else 'CF'} 512x7x7 fp16 b{SYNCBN_LOOP_BATCH}"
        out[name] = (lambda s=(SYNCBN_LOOP_BATCH, 512, 7, 7), cl=channels_last:
                     run(s, torch.float16, cl))
    return out


def record_norms(log=None, scenarios=None):
    """The norm scenarios (or ``scenarios``) under the recorder: see
    :func:`record_scenarios`."""
    return record_scenarios(scenarios or _norm_scenarios(), log)


def record_scenarios(scenarios, log=None):
    """``scenarios`` ({name: callable}) under the recorder: (specialisations, sources,
    launches, errors): distinct specialisations in order of first use, {id(spec):
    [scenario, ...]}, launches as {scenario, kernel, grid, spec} (spec: index into
    specialisations) and {scenario: error}."""
    from tritamp.kernels.recorder import record_launches
    specs, index, sources, launches, errors = [], {}, {}, [], {}
    with record_launches() as rec:
        for name, run in scenarios.items():
            rec.launches.clear()
            try:
                run()
            except Exception as e:
                errors[name] = f"{type(e).__name__}: {e}"
                if log:
                    log(f"  {name}: {errors[name]}")
            for launch in rec.launches:
                spec = launch.specialisation
                if id(spec) not in index:
                    index[id(spec)] = len(specs)
                    specs.append(spec)
                    sources[id(spec)] = []
                if name not in sources[id(spec)]:
                    sources[id(spec)].append(name)
                launches.append(dict(scenario=name, kernel=spec.name,
                                     grid=[int(g) for g in launch.grid],
                                     spec=index[id(spec)]))
    return specs, sources, launches, errors


# --- compiling and reading the cubin -----------------------------------------------------
def _tool(name):
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else name


_ACCESS = re.compile(r"(@!?U?P[T0-9]+\s+)?\b(LDG|STG)\.E((?:\.[A-Z0-9_]+)*)")
_WIDTH = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def access_widths(sass):
    """Global loads and stores by width in bytes: {'load': {bytes: count}, 'store': ...,
    'masked_load': ..., 'masked_store': ...}. Masked = predicated (``@P0 LDG...``): in a
    sweep the element accesses are (the mask), the per-tensor scalar reads are not."""
    out = {"load": {}, "store": {}, "masked_load": {}, "masked_store": {}}
    for pred, op, mods in _ACCESS.findall(sass):
        width = 4
        for m in mods.split(".")[1:]:
            width = _WIDTH.get(m, width)
        kind = "load" if op == "LDG" else "store"
        for k in (kind, "masked_" + kind) if pred else (kind,):
            out[k][width] = out[k].get(width, 0) + 1
    return out


def resource_usage(res):
    """REG / STACK / LOCAL / SHARED from ``cuobjdump -res-usage`` output."""
    out = {}
    for field in ("REG", "STACK", "SHARED", "LOCAL"):
        m = re.search(rf"\b{field}:(\d+)", res)
        out[field.lower()] = int(m.group(1)) if m else None
    return out


_SPECS = []  # the specialisations, for the forked workers


def _compile_index(i):
    spec = _SPECS[i]
    t0 = time.perf_counter()
    try:
        compiled = spec.compile()
    except Exception as e:
        msg = "".join(traceback.format_exception_only(type(e), e)).strip()
        return dict(error=f"compile: {msg[-1500:]}", compile_s=time.perf_counter() - t0)
    ptx = compiled.asm.get("ptx", "")
    cubin = compiled.asm["cubin"]
    out = dict(compile_s=time.perf_counter() - t0, sm90=".target sm_90" in ptx,
               approx=("sqrt.approx" in ptx or "div.full" in ptx),
               rn_bf16=("cvt.rn.bf16.f32" in ptx or "cvt.rn.bf16x2.f32" in ptx))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        try:
            res = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True,
                                 text=True, timeout=60).stdout
            sass = subprocess.run([_tool("nvdisasm"), path], capture_output=True, text=True,
                                  timeout=60).stdout
        except (OSError, subprocess.SubprocessError) as e:
            out["error"] = f"cuobjdump/nvdisasm: {e}"
            return out
    out.update(resource_usage(res))
    out["spills"] = (out["stack"] or 0) + (out["local"] or 0)
    widths = access_widths(sass)
    out["loads"] = widths["load"]
    out["stores"] = widths["store"]
    out["masked_loads"] = widths["masked_load"]
    out["masked_stores"] = widths["masked_store"]
    out["loops"], out["loop_barriers"] = loop_barriers(sass)
    out["barriers"] = barriers(sass)
    out["widest_load"] = max(widths["load"], default=None)
    out["widest_store"] = max(widths["store"], default=None)
    return out


def default_workers():
    """Compile processes: one per CPU this process may run on, at most 16 (each is a
    forked copy of the recording process)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(16, cpus))


def compile_all(specs, workers=2):
    """Compile every specialisation; returns one result dict per spec, in order."""
    global _SPECS
    _SPECS = list(specs)
    if workers <= 1 or len(specs) < 2:
        return [_compile_index(i) for i in range(len(specs))]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("fork")) as pool:
        return list(pool.map(_compile_index, range(len(specs))))


def toolchain_error():
    """None when Triton can compile for sm_90 here and cuobjdump/nvdisasm run, else why not."""
    try:
        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        @triton.jit
        def _probe_kernel(x_ptr, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1.0)

        compiled = triton.compile(ASTSource(fn=_probe_kernel, signature={"x_ptr": "*fp32",
                                                                          "BLOCK": "constexpr"},
                                            constexprs={"BLOCK": 128}),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "probe.cubin")
            with open(path, "wb") as f:
                f.write(compiled.asm["cubin"])
            for tool in ("cuobjdump", "nvdisasm"):
                args = [_tool(tool)] + (["-res-usage"] if tool == "cuobjdump" else []) + [path]
                proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
                if proc.returncode != 0:
                    return f"{tool} failed: {proc.stderr[-300:]}"
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[-500:]}"
    return None


def build_report(optimizers=OPTIMIZERS, workers=2, log=None):
    t0 = time.perf_counter()
    problem = toolchain_error()
    if problem is not None:
        return dict(target="cuda sm_90", toolchain_error=problem, specialisations=[],
                    errors={}, n_specialisations=0, record_s=0.0, compile_s=0.0)
    specs, sources, errors = record_specialisations(optimizers, log)
    norm_specs, norm_sources, norm_launches, norm_errors = record_norms(log)
    bn_specs, bn_sources, bn_launches, bn_errors = record_norms(log, _syncbn_scenarios())
    t1 = time.perf_counter()
    results = compile_all(list(specs) + list(norm_specs) + list(bn_specs), workers)
    bn_results = results[len(specs) + len(norm_specs):]
    norm_results = results[len(specs):len(specs) + len(norm_specs)]
    results = results[:len(specs)]
    t2 = time.perf_counter()
    rows = []
    for spec, res in zip(specs, results):
        d = spec.as_dict()
        cx = d["constexprs"]
        names = list(d["signature"])
        row = dict(d, family=family(spec.name), sources=sources[id(spec)],
                   engine=names[:3] == ["meta_ptr", "blocks_ptr", "counters_ptr"],
                   sweep=names[:2] == ["meta_ptr", "blocks_ptr"],
                   vec=cx.get("VEC"), block=cx.get("BLOCK"), **res)
        rows.append(row)
    norm_rows = []
    for spec, res in zip(norm_specs, norm_results):
        d = spec.as_dict()
        norm_rows.append(dict(d, sources=norm_sources[id(spec)],
                              block=d["constexprs"].get("BLOCK",
                                                        d["constexprs"].get("BLOCK_N")),
                              **res))
    bn_rows = []
    for spec, res in zip(bn_specs, bn_results):
        d = spec.as_dict()
        bn_rows.append(dict(d, sources=bn_sources[id(spec)], **res))
    import triton
    return dict(target="cuda sm_90 (GPUTarget('cuda', 90, 32))", toolchain_error=None,
                torch=torch.__version__,
                triton=triton.__version__, record_s=t1 - t0, compile_s=t2 - t1,
                n_specialisations=len(rows), errors=errors, specialisations=rows,
                norms=dict(specialisations=norm_rows, launches=norm_launches,
                           errors=norm_errors, widths=list(NORM_WIDTHS), rows=NORM_ROWS,
                           sm_count=_sm_count()),
                syncbn=dict(specialisations=bn_rows, launches=bn_launches, errors=bn_errors,
                            shapes=[list(s) for s in SYNCBN_SHAPES], batch=SYNCBN_BATCH))


def _sm_count():
    from tritamp.kernels.engine import force_gpu_path, sm_count
    with force_gpu_path():
        return sm_count(torch.device("cpu"))


def _dtypes(row):
    return ",".join(v[1:] for k, v in row["signature"].items()
                    if k.endswith("_proto"))


def table(report):
    lines = ["| kernel | protos | VEC | flags | warps | REG | spills | widest LDG / STG (B) "
             "| loads by width | stores by width |",
             "|---|---|---:|---|---:|---:|---:|---|---|---|"]
    skip = {"VEC", "BLOCK", "EMULATE_BF16_ROUNDING"}
    for r in sorted(report["specialisations"], key=lambda r: (r["kernel"], str(r.get("vec")))):
        flags = " ".join(k for k, v in r["constexprs"].items() if v is True and k not in skip)
        if r.get("error") and "reg" not in r:
            lines.append(f"| {r['kernel']} | {_dtypes(r)} | {r.get('vec')} | {flags} | "
                         f"{r['num_warps']} | error | | {r['error'][:80]} | | |")
            continue
        fmt = lambda d: " ".join(f"{w}B×{n}" for w, n in sorted(d.items()))  # noqa: E731
        lines.append(f"| {r['kernel']} | {_dtypes(r)} | {r.get('vec')} | {flags} | "
                     f"{r['num_warps']} | {r['reg']} | {r['spills']} | {r['widest_load']} / "
                     f"{r['widest_store']} | {fmt(r['loads'])} | {fmt(r['stores'])} |")
    return "\n".join(lines)


def _norm_dtypes(row):
    keys = ("x_ptr", "v_ptr", "w_ptr", "y_ptr", "dx_ptr", "dw_ptr")
    return ",".join(f"{k[:-4]}:{row['signature'][k][1:]}" for k in keys if k in row["signature"])


def _widths(sources):
    found = sorted({int(m) for s in sources for m in re.findall(r"n=(\d+)", s)})
    return ",".join(map(str, found))


def norm_table(report):
    """LayerNorm / RMSNorm specialisations: widths that use each, block, warps, registers,
    spills, widest accesses; and the programs each reduction pass runs per width."""
    norms = report.get("norms") or {}
    lines = ["| kernel | dtypes | widths | BLOCK | warps | REG | spills | widest LDG / STG (B) |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for r in sorted(norms.get("specialisations", []),
                    key=lambda r: (r["kernel"], r.get("block") or 0)):
        if r.get("error") and "reg" not in r:
            lines.append(f"| {r['kernel']} | {_norm_dtypes(r)} | {_widths(r['sources'])} | "
                         f"{r.get('block')} | {r['num_warps']} | error | | {r['error'][:80]} |")
            continue
        lines.append(f"| {r['kernel']} | {_norm_dtypes(r)} | {_widths(r['sources'])} | "
                     f"{r.get('block')} | {r['num_warps']} | {r['reg']} | {r['spills']} | "
                     f"{r['widest_load']} / {r['widest_store']} |")
    grids = {}
    for launch in norms.get("launches", []):
        if launch["kernel"] == "_layer_norm_bwd_reduce_kernel":
            n = int(re.search(r"n=(\d+)", launch["scenario"]).group(1))
            grids.setdefault(n, [])
            programs = launch["grid"][0] * launch["grid"][1] * launch["grid"][2]
            if programs not in grids[n]:
                grids[n].append(programs)
    if grids:
        lines += ["", "Weight-gradient reduction, programs per pass (main, final) by width: "
                  + "; ".join(f"{n}: {' + '.join(map(str, g))}" for n, g in sorted(grids.items()))]
    return "\n".join(lines)


def syncbn_table(report):
    """SyncBatchNorm specialisations: the shapes that use each, tile, warps, registers,
    spills, widest accesses."""
    part = report.get("syncbn") or {}
    lines = ["| kernel | tile (BLOCK_R x BLOCK_C or P x C) | layout | warps | REG | spills | "
             "widest LDG / STG (B) | loops (BAR.SYNC in them) | used by |",
             "|---|---|---|---:|---:|---:|---|---|---|"]
    for r in sorted(part.get("specialisations", []), key=lambda r: r["kernel"]):
        cx = r["constexprs"]
        tile = (f"{cx.get('BLOCK_R')} x {cx.get('BLOCK_C')}" if "BLOCK_R" in cx
                else f"{cx.get('BLOCK_P')} x {cx.get('BLOCK_C')}")
        layout = {True: "CL", False: "CF"}.get(cx.get("CHANNELS_LAST"), "-")
        used = f"{r['sources'][0]} (+{len(r['sources']) - 1})"
        if r.get("error") and "reg" not in r:
            lines.append(f"| {r['kernel']} | {tile} | {layout} | {r['num_warps']} | error | | "
                         f"{r['error'][:80]} | | {used} |")
            continue
        lines.append(f"| {r['kernel']} | {tile} | {layout} | {r['num_warps']} | {r['reg']} | "
                     f"{r['spills']} | {r['widest_load']} / {r['widest_store']} | "
                     f"{r.get('loops')} ({r.get('loop_barriers')}) | {used} |")
    return "\n".join(lines)


def _jsonable(report):
    def fix(x):
        if isinstance(x, dict):
            return {str(k): fix(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [fix(v) for v in x]
        return x
    return fix(report)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=OUT, help="output path, or - for stdout")
    ap.add_argument("--workers", type=int, default=None,
                    help="compile processes (default: one per available CPU, at most 16)")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    args = ap.parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        report = build_report(tuple(o for o in args.optimizers.split(",") if o),
                              args.workers or default_workers(), log)
    except Exception as e:
        log(f"compile_report: cannot run ({type(e).__name__}: {e})")
        traceback.print_exc()
        return 1
    if report.get("toolchain_error"):
        log(f"compile_report: Triton's CUDA toolchain is not usable here: "
            f"{report['toolchain_error']}")
    text = (f"{report['n_specialisations']} specialisations for {report['target']}: recorded in "
            f"{report['record_s']:.1f} s, compiled in {report['compile_s']:.1f} s\n\n"
            + table(report) + "\n\nNorms (LayerNorm / RMSNorm, forward and backward, "
            f"{report.get('norms', {}).get('rows')} rows):\n\n" + norm_table(report)
            + "\n\nSyncBatchNorm (ResNet-50's shapes, batch "
            f"{report.get('syncbn', {}).get('batch')}):\n\n" + syncbn_table(report))
    for part in ("norms", "syncbn"):
        if report.get(part, {}).get("errors"):
            report["errors"] = dict(report["errors"], **report[part]["errors"])
    if report["errors"]:
        text += "\n\nScenarios that failed:\n" + "\n".join(
            f"- {k}: {v[:200]}" for k, v in report["errors"].items())
    data = _jsonable(report)
    if args.json == "-":
        print(text, file=sys.stderr)
        json.dump(data, sys.stdout)
    else:
        print(text)
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
        print(f"\nwrote {os.path.relpath(args.json)}")
    # (the report is written either way; the status says whether it covers everything)
    rows = list(report.get("specialisations", ()))
    for part in ("norms", "syncbn"):
        rows += report.get(part, {}).get("specialisations", [])
    failed = list(report["errors"]) + [r.get("kernel", "?") for r in rows
                                       if isinstance(r, dict) and r.get("error")]
    if report.get("toolchain_error") or failed:
        log(f"compile_report: incomplete ({len(failed)} scenario(s) or kernel(s) failed"
            + (", no CUDA toolchain" if report.get("toolchain_error") else "") + ")")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
