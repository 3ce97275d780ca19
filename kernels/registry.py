"""One table of every op :mod:`tritamp.kernels` provides (torch's OpInfo pattern).

Each :class:`OpInfo` in :data:`OPS` names

- the op's **launcher**, the function that dispatches: the Triton kernel on CUDA tensors
  or under ``TRITON_INTERPRET=1``, the production CPU path otherwise (and inside
  :func:`~tritamp.kernels._dispatch.force_cpu_path`);
- its **production CPU path** where that is a function of its own (``*_cpu``; None where
  the launcher runs the reference itself on the CPU);
- its ``*_ref`` **oracle**, which follows the kernel's order of operations;
- the **tolerances** the launcher (``"kernel"``: the interpreted Triton kernel) and the
  CPU path (``"cpu"``) are held to against the oracle, per dtype of the compared tensor,
  with overrides per output; ``Tol(0, 0)`` means bit for bit;
- a **sample-inputs** function: small calls over odd shapes (``(1,)``, ``(1000,)``,
  ``(3, 257)``) in each supported dtype, each a :class:`Sample` whose ``args`` and
  ``kwargs`` both the launcher and the oracle take;
- for multi-tensor ops, the ``*_prepare`` / ``*_launch`` pair a caller keeps between
  steps, and the rows the kernel benchmark times (``benchmarks``).

Who iterates it: tests/test_ops_registry.py (every sample through the kernel and the CPU
path against the oracle; every public launcher and ``*_ref`` of the package is here),
benchmarks/compile_report.py (every multi-tensor op's samples, recorded and compiled for
sm_90, held to the op's register budget), benchmarks/kernels.py (the ``benchmarks`` rows)
and tests/test_kernel_compile.py (the kernel families). A new op is one entry here
(docs/ops.md).

Nothing here runs a kernel or touches CUDA at import time; samples are made on request.
"""
import dataclasses
import importlib
import inspect
import math
from typing import Callable, Mapping, Optional

import torch


def _module(name):
    # (``from . import check_unscale`` would give the function the package exports)
    return importlib.import_module(f"{__package__}.{name}")


_adagrad, _adam, _axpby, _cu, _l2norm, _lamb, _ln, _novograd, _su, _sgd, _bn, _ovf, _larc = map(
    _module, ("adagrad", "adam", "axpby", "check_unscale", "l2norm", "lamb", "layer_norm",
              "novograd", "scale_update", "sgd", "syncbn", "overflow", "larc"))

# Odd shapes: one element, a partial block, a 2-D tensor whose rows are not a power of two.
SHAPES = ((1,), (1000,), (3, 257))
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
PATHS = ("kernel", "cpu")


@dataclasses.dataclass(frozen=True)
class Tol:
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise, NaN where the
    oracle has NaN. ``Tol(0, 0)`` is bit for bit (NaN payloads aside)."""
    rtol: float
    atol: float

    @property
    def exact(self):
        return self.rtol == 0 and self.atol == 0

    def as_dict(self):
        return dict(rtol=self.rtol, atol=self.atol)


EXACT = Tol(0.0, 0.0)


def per_dtype(fp32, fp16, bf16):
    return {torch.float32: fp32, torch.float16: fp16, torch.bfloat16: bf16}


def _eps(dtype):
    return torch.finfo(dtype).eps


ALL_EXACT = per_dtype(EXACT, EXACT, EXACT)
# torch's default assertEqual tolerances per dtype (tests/conftest.py's TOL table).
TORCH_TOL = per_dtype(Tol(1.3e-6, 1e-5), Tol(1e-3, 1e-5), Tol(1.6e-2, 1e-5))
# The optimizers' production CPU paths (torch's fused CPU kernels round a few operations
# differently from the oracles): fp32 within rtol = atol = 1e-6, half values (the rounding
# of such an fp32 value) within one ulp of their dtype.
CPU_OPTIM_TOL = per_dtype(Tol(1e-6, 1e-6), Tol(_eps(torch.float16), 1e-6),
                          Tol(_eps(torch.bfloat16), 1e-6))
# LAMB and NovoGrad kernels: norms in another order than torch's, so the trust ratio and
# NovoGrad's second moment differ in the last bits: fp32 within rtol 1e-5 / atol 1e-7,
# half values within TORCH_TOL.
KERNEL_NORM_OPTIM_TOL = per_dtype(Tol(1e-5, 1e-7), TORCH_TOL[torch.float16],
                                  TORCH_TOL[torch.bfloat16])


@dataclasses.dataclass
class Sample:
    """One call: ``launcher(*args, **kwargs)`` and ``ref(*args, **kwargs)``. ``dtype`` is
    the dtype the sample exercises (the gradients' of an optimizer step, the input's of a
    norm)."""
    name: str
    dtype: torch.dtype
    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)

    def clone(self):
        """The same call on copies of every tensor (a launcher writes in place)."""
        return Sample(self.name, self.dtype, _clone(self.args), _clone(self.kwargs))

    def call(self, fn):
        return fn(*self.args, **self.kwargs)


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, list):
        return [_clone(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def _named_tensors(name, x):
    """(name, tensor) for every tensor in ``x`` (lists indexed: ``params[2]``); None
    entries of a list are kept as (name, None)."""
    if isinstance(x, torch.Tensor):
        return [(name, x)]
    if isinstance(x, (list, tuple)):
        out = []
        for i, v in enumerate(x):
            if v is None:
                out.append((f"{name}[{i}]", None))
            else:
                out += _named_tensors(f"{name}[{i}]", v)
        return out
    return []


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """One op of :mod:`tritamp.kernels` (see the module docstring)."""
    name: str
    launcher: Callable
    ref: Callable
    sample_inputs: Callable     # (device="cpu", shapes=None) -> [Sample]; shapes: multi-tensor
    tol: Mapping[str, Mapping[torch.dtype, Tol]]  # {"kernel": {dtype: Tol}, "cpu": {...}}
    cpu: Optional[Callable] = None
    prepare: Optional[Callable] = None
    launch: Optional[Callable] = None
    multi_tensor: bool = False  # lists of tensors through the multi-tensor engine
    # Multi-tensor ops: the prefix of their Triton kernels' names (the compile report's
    # family) and the registers per thread their sweeps may use on the aligned path
    # (BLOCK=1024, num_warps=4) compiled for sm_90.
    kernel_family: Optional[str] = None
    register_budget: Optional[int] = None
    dtypes: tuple = DTYPES      # the dtypes its samples cover
    # Names of the launcher's return values, or a function of the result returning
    # {name: tensor} (a result the kernel and the oracle give in different forms).
    results: object = ()
    # Per output (an argument's or a result's name, without index): {path: {dtype: Tol}}.
    output_tol: Mapping[str, Mapping[str, Mapping[torch.dtype, Tol]]] = \
        dataclasses.field(default_factory=dict)
    # Benchmark rows: {row name: make(shapes, device) -> (Sample, bytes moved)}.
    benchmarks: Mapping[str, Callable] = dataclasses.field(default_factory=dict)

    def tolerance(self, path, output, dtype):
        """The :class:`Tol` for ``output`` (a name from :meth:`outputs`) of ``dtype`` on
        ``path`` ("kernel" or "cpu"). Tensors of dtypes the table does not name (flags,
        counts) are compared exactly."""
        base = output.split("[")[0]
        table = self.output_tol.get(base, {}).get(path) or self.tol[path]
        return table.get(dtype, EXACT)

    def outputs(self, sample, result):
        """What a call produced, as [(name, tensor or None)]: the launcher's (or oracle's)
        return values, then every tensor argument after the call (in-place writes; the
        inputs a call must leave alone). Arguments are named as in the launcher's
        signature."""
        if callable(self.results):
            out = list(self.results(result).items())
        elif self.results:
            values = result if isinstance(result, tuple) else (result,)
            out = []
            for name, v in zip(self.results, values):
                out += [(name, None)] if v is None else _named_tensors(name, v)
        else:
            out = _named_tensors("out", result)
        return out + self.arguments(sample)

    def arguments(self, sample):
        """[(name, tensor or None)] of every tensor argument of ``sample``, named as in the
        launcher's signature (``params[2]``, ``found_inf``)."""
        bound = inspect.signature(self.launcher).bind(*sample.args, **sample.kwargs)
        out = []
        for name, value in bound.arguments.items():
            out += _named_tensors(name, value)
        return out


# --- sample helpers ------------------------------------------------------------------------

def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(shape, dtype, device, gen, scale=1.0, shift=0.0):
    return (torch.randn(shape, generator=gen) * scale + shift).to(dtype).to(device)


def _rand(shape, device, gen, scale=1.0):
    return (torch.rand(shape, generator=gen) * scale).to(device)


def _scalar(value, device, dtype=torch.float32, shape=()):
    return torch.full(shape, value, dtype=dtype, device=device)


def _scaler_slots(device, found=0.0):
    """(scale, found_inf) as amp's loss scaler hands them to a sweep: 0-d views of its
    state vector (tritamp.kernels.scale_update), the overflow slot 12 bytes into it."""
    state = torch.zeros(_su.STATE_SIZE, device=device)
    state[_su.USED_SCALE] = GRAD_SCALE
    state[_su.FOUND_INF] = found
    return state[_su.USED_SCALE], state[_su.FOUND_INF]


def _plant_inf(tensors):
    tensors[-1].view(-1)[0] = math.inf
    return tensors


# --- multi-tensor ops ----------------------------------------------------------------------

GRAD_SCALE = 1024.0


def _check_unscale_samples(device="cpu", shapes=SHAPES):
    out = []
    for dt in DTYPES:
        n = DTYPE_NAMES[dt]
        g = _gen(1)

        def grads():
            return [_randn(s, dt, device, g, GRAD_SCALE) for s in shapes]

        def amp():
            scale, found = _scaler_slots(device)
            return dict(scale=scale, found_inf=found)

        out.append(Sample(f"check {n}", dt, (_plant_inf(grads()),), dict(amp(), write=False)))
        out.append(Sample(f"unscale {n}", dt, (grads(),), amp()))
        out.append(Sample(f"unscale {n} into fp32", dt, (grads(),), dict(
            amp(), dsts=[torch.full(s, 7.0, device=device) for s in shapes])))
        # a second loss into fp32 master gradients: the addends are checked too
        out.append(Sample(f"accumulate {n} into fp32", dt, (grads(),), dict(
            amp(), dsts=[torch.full(s, 7.0, device=device) for s in shapes],
            adds=[torch.full(s, 0.5, device=device) for s in shapes])))
    return out


def _count_nonfinite_samples(device="cpu", shapes=SHAPES):
    out = []
    for dt in DTYPES:
        n = DTYPE_NAMES[dt]
        g = _gen(2)
        for found in (1.0, 0.0):
            srcs = [_randn(s, dt, device, g) for s in shapes]
            srcs[0].view(-1)[0] = math.inf
            srcs[-1].view(-1)[1::3] = math.nan  # NaNs in every third element of the last
            counts = torch.full((len(shapes),), 5, dtype=torch.int32, device=device)
            state = torch.zeros(_su.STATE_SIZE, device=device)
            state[_su.FOUND_INF] = found
            what = "skipped" if found else "clean"
            out.append(Sample(f"count {n} {what}", dt, (srcs, counts, state[_su.FOUND_INF])))
    return out


def _bench_check(shapes, device):
    g = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(s, device=device, generator=g).half() for s in shapes]
    return (Sample("amp check", torch.float16, (grads,),
                   dict(scale=None, found_inf=_scalar(0.0, device), write=False)),
            sum(t.numel() * 2 for t in grads))


def _bench_unscale(shapes, device):
    g = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(s, device=device, generator=g).half() for s in shapes]
    masters = [torch.empty(t.shape, device=device) for t in grads]
    return (Sample("amp unscale->fp32", torch.float16, (grads,),
                   dict(scale=_scalar(65536.0, device), found_inf=_scalar(0.0, device),
                        dsts=masters)),
            sum(t.numel() * (2 + 4) for t in grads))


def _l2norm_samples(device="cpu", shapes=SHAPES):
    out = []
    for dt in DTYPES:
        n = DTYPE_NAMES[dt]
        g = _gen(2)
        out.append(Sample(f"total {n}", dt, ([_randn(s, dt, device, g) for s in shapes],)))
        out.append(Sample(f"per tensor {n}", dt, ([_randn(s, dt, device, g) for s in shapes],),
                          dict(per_tensor=True)))
        out.append(Sample(f"unscaled {n}", dt,
                          ([_randn(s, dt, device, g, GRAD_SCALE) for s in shapes],),
                          dict(zip(("scale", "found_inf"), _scaler_slots(device)),
                               per_tensor=True)))
    return out


def _bench_l2norm(shapes, device):
    g = torch.Generator(device=device).manual_seed(0)
    xs = [torch.randn(s, device=device, generator=g) for s in shapes]
    return (Sample("l2norm", torch.float32, (xs,), dict(per_tensor=True)),
            sum(t.numel() * 4 for t in xs))


def _flag(device):
    return torch.zeros(1, dtype=torch.int32, device=device)


def _scale_samples(device="cpu", shapes=SHAPES):
    out = []
    for dt in DTYPES:
        n = DTYPE_NAMES[dt]
        g = _gen(3)
        srcs = _plant_inf([_randn(s, dt, device, g) for s in shapes])
        out.append(Sample(f"{n} to fp32", dt, (
            srcs, [torch.full(s, 7.0, device=device) for s in shapes], 0.5, _flag(device))))
        if dt != torch.float32:
            srcs = [_randn(s, torch.float32, device, g) for s in shapes]
            out.append(Sample(f"fp32 to {n}", dt, (
                srcs, [torch.zeros(s, dtype=dt, device=device) for s in shapes], 0.5,
                _flag(device))))
    return out


def _axpby_samples(device="cpu", shapes=SHAPES):
    out = []
    for dt in DTYPES:
        g = _gen(4)
        xs = [_randn(s, dt, device, g) for s in shapes]
        ys = [_randn(s, torch.float32, device, g) for s in shapes]
        outs = [torch.zeros(s, dtype=dt, device=device) for s in shapes]
        out.append(Sample(f"{DTYPE_NAMES[dt]} x, fp32 y", dt,
                          (xs, ys, outs, 0.5, 2.0, _flag(device), -1)))
    return out


def _larc_samples(device="cpu", shapes=SHAPES):
    """Per dtype: a decay and a factor per row (the last row left alone: factor 1, decay
    0, as LARC leaves a parameter whose norm is 0); fp32 without decay."""
    out = []
    n_rows = len(shapes)
    for dt in DTYPES:
        g = _gen(7)
        params = [_randn(s, dt, device, g) for s in shapes]
        grads = [_randn(s, dt, device, g, scale=1e-2) for s in shapes]
        factor = _rand((n_rows,), device, g, scale=3.0)
        decay = _rand((n_rows,), device, g, scale=1e-3)
        factor[-1], decay[-1] = 1.0, 0.0
        out.append(Sample(f"{DTYPE_NAMES[dt]} with decay", dt, (params, grads, factor, decay)))
    g = _gen(8)
    out.append(Sample("fp32 without decay", torch.float32, (
        [_randn(s, torch.float32, device, g) for s in shapes],
        [_randn(s, torch.float32, device, g) for s in shapes],
        _rand((n_rows,), device, g, scale=3.0), None)))
    return out


def _bench_larc(shapes, device):
    g = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=g) for s in shapes]
    grads = [torch.randn(s, device=device, generator=g) for s in shapes]
    n = len(shapes)
    factor = torch.rand(n, device=device, generator=g)
    decay = torch.full((n,), 1e-4, device=device)
    # reads p and g, writes g (fp32)
    return (Sample("larc rescale", torch.float32, (params, grads, factor, decay)),
            sum(t.numel() * 12 for t in params))


def _state(values, device):
    state = torch.zeros(_su.STATE_SIZE, device=device)
    for slot, v in values.items():
        state[slot] = v
    return state


def _scale_update_samples(device="cpu", shapes=None):
    S = _su
    cases = [
        ("clean step that grows", {S.SCALE: 65536.0, S.UNSKIPPED: 1999.0, S.HYSTERESIS: 1.0},
         dict(growth_interval=2000)),
        ("growth clamped at max_scale", {S.SCALE: 2.0 ** 24, S.UNSKIPPED: 9.0,
                                         S.HYSTERESIS: 1.0},
         dict(growth_interval=10, max_scale=2.0 ** 24)),
        ("overflow tolerated by hysteresis", {S.SCALE: 65536.0, S.UNSKIPPED: 5.0,
                                              S.HYSTERESIS: 2.0, S.FOUND_INF: 1.0},
         dict(hysteresis=2)),
        ("overflow at the floor", {S.SCALE: 1.0, S.HYSTERESIS: 1.0, S.FOUND_INF: 1.0,
                                   S.FLOOR_STREAK: 3.0},
         dict(min_scale=1.0)),
        ("overflow in the other slot", {S.SCALE: 1024.0, S.HYSTERESIS: 1.0,
                                        S.FOUND_INF_NEXT: 1.0, S.SKIPPED: 4.0},
         dict(found_slot=S.FOUND_INF_NEXT)),
        ("static", {S.SCALE: 128.0, S.UNSKIPPED: 7.0, S.FOUND_INF: 1.0},
         dict(dynamic=False)),
    ]
    return [Sample(name, torch.float32, (_state(values, device),), kw)
            for name, values, kw in cases]


# --- optimizer steps -----------------------------------------------------------------------

def _optim_lists(dt, device, shapes, seed, half_params=False):
    """(params, grads, copies) as amp lays them out: fp32 parameters with fp32 gradients,
    fp32 masters with ``dt`` gradients and ``dt`` model copies (O2), or ``dt`` parameters
    updated directly (``half_params``). Gradients carry the loss scale."""
    g = _gen(seed)
    p_dt = dt if half_params else torch.float32
    params = [_randn(s, p_dt, device, g) for s in shapes]
    grads = [_randn(s, dt, device, g, GRAD_SCALE) for s in shapes]
    copies = None if p_dt == dt else [p.to(dt) for p in params]
    return params, grads, copies


def _steps(shapes, device):
    # a different count per tensor (bias corrections are per tensor; 0: a first step)
    return [_scalar(float(2 * i), device) for i in range(len(shapes))]


def _amp_kw(device, skipped=False):
    scale, found = _scaler_slots(device, 1.0 if skipped else 0.0)
    return dict(grad_scale=scale, found_inf=found)


def _optim_samples(make, seed):
    """Samples of an optimizer step: per dtype, amp's layout and the same step skipped
    (``found_inf`` set: nothing may change); half parameters updated directly."""
    def samples(device="cpu", shapes=SHAPES):
        out = []
        for dt in DTYPES:
            n = DTYPE_NAMES[dt]
            layouts = [(n if dt == torch.float32 else f"fp32 masters, {n} grads", False)]
            if dt != torch.float32:
                layouts.append((f"{n} params", True))
            for label, half in layouts:
                for skipped in (False, True):
                    params, grads, copies = _optim_lists(dt, device, shapes, seed, half)
                    if skipped:
                        _plant_inf(grads)
                    args, kw = make(params, grads, copies, device, shapes)
                    kw.update(_amp_kw(device, skipped))
                    if "global_grad_norm" in kw:
                        kw["global_grad_norm"] = _l2norm.multi_tensor_l2norm_ref(
                            grads, scale=kw["grad_scale"])[0]
                    out.append(Sample(label + (" skipped" if skipped else ""), dt, args, kw))
        return out
    return samples


def _moments(shapes, device, gen):
    return ([_randn(s, torch.float32, device, gen, 0.1) for s in shapes],
            [_rand(s, device, gen, 0.01) for s in shapes])


def _adam_args(params, grads, copies, device, shapes):
    m, v = _moments(shapes, device, _gen(10))
    return ((params, grads, m, v, _steps(shapes, device), copies),
            dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01))


def _sgd_args(params, grads, copies, device, shapes):
    bufs = [_randn(s, torch.float32, device, _gen(11), 0.1) for s in shapes]
    return ((params, grads, bufs, copies),
            dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01,
                 steps=_steps(shapes, device)))


def _adagrad_args(params, grads, copies, device, shapes):
    sums = [_rand(s, device, _gen(12), 0.1) for s in shapes]
    return ((params, grads, sums, copies),
            dict(lr=0.1, eps=1e-10, weight_decay=0.01, steps=_steps(shapes, device)))


def _lamb_args(params, grads, copies, device, shapes):
    m, v = _moments(shapes, device, _gen(13))
    return ((params, grads, m, v, _steps(shapes, device), copies),
            dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01,
                 max_grad_norm=1.0, global_grad_norm=None))


def _novograd_args(params, grads, copies, device, shapes):
    gen = _gen(14)
    m = [_randn(s, torch.float32, device, gen, 0.1) for s in shapes]
    v = [_rand((), device, gen, 10.0) for _ in shapes]  # one value per tensor
    return ((params, grads, m, v, _steps(shapes, device), copies),
            dict(lr=1e-2, beta1=0.95, beta2=0.98, eps=1e-8, weight_decay=0.01))


# The step counts are held exactly on both paths.
_OPTIM_EXACT = {"steps": {"kernel": ALL_EXACT, "cpu": ALL_EXACT}}


# --- LayerNorm / RMSNorm ---------------------------------------------------------------------

def _norm_params(n, dt, rms, gen, device):
    w = _randn(n, dt, device, gen, 0.5, 1.0)
    b = None if rms else _randn(n, dt, device, gen, 0.5)
    return w, b


def _norm_cases(rms, device, shapes):
    """(label, dtype, x, weight, bias, out_dtype) per dtype and shape: affine in the
    input's dtype, without parameters, and (half inputs) with fp32 parameters and an
    fp32 output (Apex O1's FusedLayerNorm)."""
    for dt in DTYPES:
        n_dt = DTYPE_NAMES[dt]
        for shape in shapes:
            n = shape[-1]
            g = _gen(20 + n)
            x = _randn(shape, dt, device, g, 2.0, 0.5)
            w, b = _norm_params(n, dt, rms, g, device)
            yield f"{n_dt} {shape} affine", dt, x, w, b, None
            yield f"{n_dt} {shape} plain", dt, x.clone(), None, None, None
            if dt != torch.float32:
                w32, b32 = _norm_params(n, torch.float32, rms, g, device)
                yield f"{n_dt} {shape} fp32 params", dt, x.clone(), w32, b32, torch.float32


def _norm_fwd_samples(rms):
    def samples(device="cpu", shapes=SHAPES):
        return [Sample(label, dt, (x, x.shape[-1], w, b, 1e-5, rms, out_dtype))
                for label, dt, x, w, b, out_dtype in _norm_cases(rms, device, shapes)]
    return samples


def _norm_bwd_samples(rms):
    def samples(device="cpu", shapes=SHAPES):
        out = []
        for label, dt, x, w, b, out_dtype in _norm_cases(rms, device, shapes):
            n = x.shape[-1]
            y, mean, rstd = _ln.layer_norm_fwd_ref(x, n, w, b, 1e-5, rms, out_dtype)
            dy = _randn(y.shape, y.dtype, device, _gen(30 + n))
            out.append(Sample(label, dt, (dy, x, n, w, b, mean, rstd, rms)))
            if rms and out_dtype is None:
                # memory_efficient: xhat rebuilt from the output
                out.append(Sample(label + " from output", dt, (dy.clone(), y, n, w, b, None,
                                                               rstd.clone(), rms, True)))
        return out
    return samples


# The CPU path on half inputs runs torch's mixed-dtype LayerNorm kernel: one ulp of the
# output's dtype, 4 fp32 ulps of the statistics; it forms y as x * rstd - mean * rstd, so an
# exact 0 (a row of one element) comes out as a few 1e-6: TORCH_TOL's atol of 1e-5.
_LN_CPU_FWD = per_dtype(EXACT, Tol(_eps(torch.float16), 1e-5), Tol(_eps(torch.bfloat16), 1e-5))
_LN_CPU_STATS = {torch.float32: Tol(4 * 2.0 ** -23, 0.0)}
_LN_CPU_MEAN = {torch.float32: Tol(4 * 2.0 ** -23, 4 * 2.0 ** -23 * 3)}
# The kernels against the oracle (test_kernel_layer_norm.py's test_ref_matches_kernel):
# outputs within torch's tolerance of their dtype, gradients with an atol of 1e-4, rstd
# within rtol 1e-6.
_LN_KERNEL_GRADS = per_dtype(Tol(TORCH_TOL[torch.float32].rtol, 1e-4),
                             Tol(TORCH_TOL[torch.float16].rtol, 1e-4),
                             Tol(TORCH_TOL[torch.bfloat16].rtol, 1e-4))
_LN_KERNEL_RSTD = {torch.float32: Tol(1e-6, 0.0)}


# --- SyncBatchNorm ---------------------------------------------------------------------------

# [M, C] channels last (2-D) or [N, C, B] channels first: one channel; many rows; channels
# that are not a power of two; planes.
SYNCBN_VIEWS = ((7, 1), (1000, 3), (3, 257), (2, 3, 257))


def _bn_x(shape, dt, device, seed):
    g = _gen(seed)
    c = shape[1]
    offset = torch.linspace(-2.0, 3.0, c).view([1, c] + [1] * (len(shape) - 2))
    return (torch.randn(shape, generator=g) * 2.0 + 1.0 + offset).to(dt).to(device)


def _bn_cases(device):
    """(label, dtype, x, dy, z, weight, bias, mean, invstd, count) per dtype and view,
    the statistics from the oracles."""
    for dt in DTYPES:
        for shape in SYNCBN_VIEWS:
            c = shape[1]
            x = _bn_x(shape, dt, device, 40)
            dy = _bn_x(shape, dt, device, 41)
            z = _bn_x(shape, dt, device, 42)
            g = _gen(43)
            w = _rand(c, device, g).add_(0.5)
            b = _randn(c, torch.float32, device, g)
            rows, _ = _bn.syncbn_stats_ref(x)
            mean, invstd, count = _bn.syncbn_finalize_ref(rows, 1e-5)
            yield f"{DTYPE_NAMES[dt]} {shape}", dt, x, dy, z, w, b, mean, invstd, count


def _syncbn_stats_samples(device="cpu", shapes=None):
    return [Sample(label, dt, (x,)) for label, dt, x, *_ in _bn_cases(device)]


def _rank_rows(x, ranks=3):
    """Each of ``ranks`` slices of the batch as one rank's row of absolute statistics (an
    empty rank included when the batch is small)."""
    parts = torch.tensor_split(x, ranks, dim=0)
    return torch.stack([_bn.syncbn_combine_ref(*_bn.syncbn_stats_ref(p)) for p in parts])


def _shifted(rows, x):
    c = rows.shape[1] // 2
    shift = x.float().reshape(x.shape[0], c, -1)[0, :, 0].contiguous()
    rel = rows.clone()
    rel[:, :c] -= shift
    return rel, shift


def _syncbn_combine_samples(device="cpu", shapes=None):
    out = []
    for label, dt, x, *_ in _bn_cases(device):
        rows = _rank_rows(x)
        out.append(Sample(f"{label} ranks", dt, (rows,)))
        rel, shift = _shifted(rows, x)
        out.append(Sample(f"{label} ranks, shifted", dt, (rel, shift)))
    return out


def _syncbn_finalize_samples(device="cpu", shapes=None):
    out = []
    for label, dt, x, *_ in _bn_cases(device):
        c = x.shape[1]
        rows = _rank_rows(x)
        out.append(Sample(f"{label} ranks", dt, (rows, 1e-5)))
        running = dict(running_mean=torch.zeros(c, dtype=dt, device=device),
                       running_var=torch.ones(c, dtype=dt, device=device))
        rel, shift = _shifted(rows, x)
        out.append(Sample(f"{label} shifted, running {DTYPE_NAMES[dt]}", dt, (rel, 1e-5),
                          dict(running, momentum=0.1, shift=shift)))
        out.append(Sample(f"{label} cumulative average", dt, (rows, 1e-5), dict(
            _clone(running), momentum=None,
            num_batches_tracked=torch.tensor(3, dtype=torch.long, device=device))))
    return out


def _syncbn_forward_samples(device="cpu", shapes=None):
    out = []
    for label, dt, x, dy, z, w, b, mean, invstd, count in _bn_cases(device):
        out.append(Sample(f"{label} affine", dt, (x, mean, invstd, w, b)))
        out.append(Sample(f"{label} residual relu", dt, (x, mean, invstd, w, b, z, True)))
        out.append(Sample(f"{label} plain", dt, (x, mean, invstd)))
    return out


def _syncbn_backward_reduce_samples(device="cpu", shapes=None):
    out = []
    for label, dt, x, dy, z, w, b, mean, invstd, count in _bn_cases(device):
        out.append(Sample(f"{label} affine", dt, (dy, x, mean, invstd, w, b)))
        out.append(Sample(f"{label} residual relu", dt, (dy, x, mean, invstd, w, b, z, True)))
        out.append(Sample(f"{label} plain", dt, (dy, x, mean, invstd)))
    return out


def _syncbn_backward_input_samples(device="cpu", shapes=None):
    out = []
    for label, dt, x, dy, z, w, b, mean, invstd, count in _bn_cases(device):
        sums, _, _ = _bn.syncbn_backward_reduce_ref(dy, x, mean, invstd, w, b)
        out.append(Sample(f"{label} affine", dt, (dy, x, mean, invstd, w, sums, count)))
        sums_z, _, _ = _bn.syncbn_backward_reduce_ref(dy, x, mean, invstd, w, b, z, True)
        out.append(Sample(f"{label} residual relu", dt, (dy, x, mean, invstd, w, sums_z, count,
                                                        b, z, True), dict(need_dz=True)))
        out.append(Sample(f"{label} running statistics", dt, (dy, x, mean, invstd, w)))
    return out


def _row_parts(row):
    """A statistics row ``[2C + 1]`` as its mean, m2 and count."""
    c = row.shape[-1] // 2
    return {"mean": row[..., :c], "m2": row[..., c:2 * c], "count": row[..., 2 * c:]}


def _absolute_row(result):
    """``syncbn_stats``'s ``(rows, shift)`` as one row of absolute statistics: the kernel
    gives per-program partials relative to a shift, the oracle and the CPU path one row."""
    rows, shift = result
    return _row_parts(_bn.syncbn_combine_ref(rows, shift))


# The kernels against their oracles (test_kernel_syncbn.py's test_kernels_agree_with_their_refs):
# means within TORCH_TOL's fp32 row; m2 (sums of squares in another order) within rtol 2e-6,
# atol 1e-5; invstd within rtol 2e-6; counts exact; the local sums of the backward within
# atol 1e-6 of the largest sum of |dy (x - mean)| (about 1e3 for these samples), and the
# parameter gradients formed from them within their dtype's rtol and that atol.
_BN_SUM_ATOL = 1e-3
_BN_KERNEL_STATS = {
    "mean": {"kernel": {torch.float32: TORCH_TOL[torch.float32]}},
    "m2": {"kernel": {torch.float32: Tol(2e-6, 1e-5)}},
    "invstd": {"kernel": {torch.float32: Tol(2e-6, 0.0)}},
    "count": {"kernel": ALL_EXACT, "cpu": ALL_EXACT},
}
# The production CPU path of syncbn_stats: two passes instead of torch's Welford loop
# (test_cpu_path_check_scale_norms.py): means within rtol 1e-6, m2 within rtol 1e-5.
_BN_STATS = dict(_BN_KERNEL_STATS,
                 mean={"kernel": {torch.float32: TORCH_TOL[torch.float32]},
                       "cpu": {torch.float32: Tol(1e-6, 0.0)}},
                 m2={"kernel": {torch.float32: Tol(2e-6, 1e-5)},
                     "cpu": {torch.float32: Tol(1e-5, 0.0)}})
_BN_KERNEL_GRADS = per_dtype(Tol(TORCH_TOL[torch.float32].rtol, _BN_SUM_ATOL),
                             Tol(TORCH_TOL[torch.float16].rtol, _BN_SUM_ATOL),
                             Tol(TORCH_TOL[torch.bfloat16].rtol, _BN_SUM_ATOL))


# --- the table -------------------------------------------------------------------------------

OPS = (
    OpInfo("check_unscale", _cu.check_unscale, _cu.check_unscale_ref, _check_unscale_samples,
           # one fp32 multiply and one rounding, as torch's own unscale: bit for bit
           tol={"kernel": ALL_EXACT, "cpu": ALL_EXACT}, cpu=_cu.check_unscale_cpu,
           prepare=_cu.check_unscale_prepare, launch=_cu.check_unscale_launch,
           multi_tensor=True, kernel_family="check_unscale", register_budget=48,
           benchmarks={"amp check": _bench_check, "amp unscale->fp32": _bench_unscale}),
    OpInfo("count_nonfinite", _ovf.count_nonfinite, _ovf.count_nonfinite_ref,
           _count_nonfinite_samples,
           # whole counts: exact
           tol={"kernel": ALL_EXACT, "cpu": ALL_EXACT}, cpu=_ovf.count_nonfinite_cpu,
           prepare=_ovf.count_nonfinite_prepare, launch=_ovf.count_nonfinite_launch,
           multi_tensor=True, kernel_family="count_nonfinite", register_budget=48),
    OpInfo("multi_tensor_l2norm", _l2norm.multi_tensor_l2norm, _l2norm.multi_tensor_l2norm_ref,
           _l2norm_samples,
           # fp32 sums in another order: a few fp32 ulps (the flag exactly)
           tol={"kernel": {torch.float32: Tol(2e-6, 1e-6)},
                "cpu": {torch.float32: Tol(1e-6, 0.0)}},
           cpu=_l2norm.multi_tensor_l2norm_cpu, prepare=_l2norm.multi_tensor_l2norm_prepare,
           launch=_l2norm.multi_tensor_l2norm_launch, multi_tensor=True,
           kernel_family="l2norm", register_budget=48,
           results=("total", "per_tensor"),
           output_tol={"found_inf": {"kernel": ALL_EXACT, "cpu": ALL_EXACT}},
           benchmarks={"l2norm": _bench_l2norm}),
    OpInfo("multi_tensor_scale", _axpby.multi_tensor_scale, _axpby.multi_tensor_scale_ref,
           _scale_samples, tol={"kernel": ALL_EXACT, "cpu": ALL_EXACT},
           cpu=_axpby.multi_tensor_scale_cpu, prepare=_axpby.multi_tensor_scale_prepare,
           launch=_axpby.multi_tensor_scale_launch, multi_tensor=True,
           kernel_family="axpby", register_budget=48),  # axpby without y
    OpInfo("multi_tensor_axpby", _axpby.multi_tensor_axpby, _axpby.multi_tensor_axpby_ref,
           # fp32 products and sum, one rounding; the interpreter never contracts an FMA
           _axpby_samples, tol={"kernel": ALL_EXACT, "cpu": ALL_EXACT},
           cpu=_axpby.multi_tensor_axpby_cpu, prepare=_axpby.multi_tensor_axpby_prepare,
           launch=_axpby.multi_tensor_axpby_launch, multi_tensor=True,
           kernel_family="axpby", register_budget=48),
    OpInfo("larc_rescale", _larc.larc_rescale, _larc.larc_rescale_ref, _larc_samples,
           # fp32 products and sum in the oracle's order, one rounding (the interpreter
           # never contracts an FMA)
           tol={"kernel": ALL_EXACT, "cpu": ALL_EXACT}, cpu=_larc.larc_rescale_cpu,
           prepare=_larc.larc_rescale_prepare, launch=_larc.larc_rescale_launch,
           multi_tensor=True, kernel_family="larc", register_budget=48,
           benchmarks={"larc rescale": _bench_larc}),
    OpInfo("scale_update", _su.scale_update, _su.scale_update_ref, _scale_update_samples,
           # the scaler's state is one fp32 vector
           tol={"kernel": ALL_EXACT, "cpu": ALL_EXACT}, cpu=_su.scale_update_cpu,
           dtypes=(torch.float32,)),
    OpInfo("adam_step", _adam.adam_step, _adam.adam_step_ref, _optim_samples(_adam_args, 5),
           # the kernel runs the oracle's fp32 operations in its order: bit for bit
           tol={"kernel": ALL_EXACT, "cpu": CPU_OPTIM_TOL}, cpu=_adam.adam_step_cpu,
           prepare=_adam.adam_prepare, launch=_adam.adam_launch, multi_tensor=True,
           kernel_family="adam", register_budget=72,
           output_tol=_OPTIM_EXACT),
    OpInfo("sgd_step", _sgd.sgd_step, _sgd.sgd_step_ref, _optim_samples(_sgd_args, 6),
           tol={"kernel": ALL_EXACT, "cpu": CPU_OPTIM_TOL}, cpu=_sgd.sgd_step_cpu,
           prepare=_sgd.sgd_prepare, launch=_sgd.sgd_launch, multi_tensor=True,
           kernel_family="sgd", register_budget=48,
           output_tol=_OPTIM_EXACT),
    OpInfo("adagrad_step", _adagrad.adagrad_step, _adagrad.adagrad_step_ref,
           _optim_samples(_adagrad_args, 7),
           tol={"kernel": ALL_EXACT, "cpu": CPU_OPTIM_TOL}, cpu=_adagrad.adagrad_step_cpu,
           prepare=_adagrad.adagrad_prepare, launch=_adagrad.adagrad_launch, multi_tensor=True,
           kernel_family="adagrad", register_budget=72,
           output_tol=_OPTIM_EXACT),
    OpInfo("lamb_step", _lamb.lamb_step, _lamb.lamb_step_ref, _optim_samples(_lamb_args, 8),
           tol={"kernel": KERNEL_NORM_OPTIM_TOL, "cpu": CPU_OPTIM_TOL}, cpu=_lamb.lamb_step_cpu,
           prepare=_lamb.lamb_prepare, launch=_lamb.lamb_launch, multi_tensor=True,
           kernel_family="lamb", register_budget=72,
           output_tol=_OPTIM_EXACT),
    OpInfo("novograd_step", _novograd.novograd_step, _novograd.novograd_step_ref,
           _optim_samples(_novograd_args, 9),
           tol={"kernel": KERNEL_NORM_OPTIM_TOL, "cpu": CPU_OPTIM_TOL},
           cpu=_novograd.novograd_step_cpu, prepare=_novograd.novograd_prepare,
           launch=_novograd.novograd_launch, multi_tensor=True, output_tol=_OPTIM_EXACT,
           kernel_family="novograd", register_budget=72),
    OpInfo("layer_norm_fwd", _ln.layer_norm_fwd, _ln.layer_norm_fwd_ref, _norm_fwd_samples(False),
           tol={"kernel": TORCH_TOL, "cpu": _LN_CPU_FWD}, cpu=_ln.layer_norm_fwd_cpu,
           results=("y", "mean", "rstd"),
           output_tol={"mean": {"cpu": _LN_CPU_MEAN},
                       "rstd": {"kernel": _LN_KERNEL_RSTD, "cpu": _LN_CPU_STATS}}),
    OpInfo("rms_norm_fwd", _ln.layer_norm_fwd, _ln.layer_norm_fwd_ref, _norm_fwd_samples(True),
           # the CPU path is torch's RMSNorm kernel, the oracle's arithmetic: bit for bit
           tol={"kernel": TORCH_TOL, "cpu": ALL_EXACT}, cpu=_ln.layer_norm_fwd_cpu,
           results=("y", "mean", "rstd"), output_tol={"rstd": {"kernel": _LN_KERNEL_RSTD}}),
    OpInfo("layer_norm_bwd", _ln.layer_norm_bwd, _ln.layer_norm_bwd_ref,
           _norm_bwd_samples(False),
           # from the input the CPU path is the oracle's torch kernel: bit for bit
           tol={"kernel": _LN_KERNEL_GRADS, "cpu": ALL_EXACT}, cpu=_ln.layer_norm_bwd_cpu,
           results=("dx", "dweight", "dbias")),
    OpInfo("rms_norm_bwd", _ln.layer_norm_bwd, _ln.layer_norm_bwd_ref, _norm_bwd_samples(True),
           tol={"kernel": _LN_KERNEL_GRADS, "cpu": ALL_EXACT}, cpu=_ln.layer_norm_bwd_cpu,
           results=("dx", "dweight", "dbias")),
    OpInfo("syncbn_stats", _bn.syncbn_stats, _bn.syncbn_stats_ref, _syncbn_stats_samples,
           tol={"kernel": ALL_EXACT, "cpu": ALL_EXACT}, cpu=_bn.syncbn_stats_cpu,
           results=_absolute_row, output_tol=_BN_STATS),
    OpInfo("syncbn_combine", _bn.syncbn_combine, _bn.syncbn_combine_ref,
           _syncbn_combine_samples,
           # on the CPU the launcher runs the oracle (a few ops on the small rows)
           tol={"kernel": ALL_EXACT, "cpu": ALL_EXACT}, results=_row_parts,
           output_tol=_BN_KERNEL_STATS),
    OpInfo("syncbn_finalize", _bn.syncbn_finalize, _bn.syncbn_finalize_ref,
           _syncbn_finalize_samples,
           tol={"kernel": TORCH_TOL, "cpu": ALL_EXACT}, results=("mean", "invstd", "count"),
           output_tol=_BN_KERNEL_STATS),
    OpInfo("syncbn_forward", _bn.syncbn_forward, _bn.syncbn_forward_ref, _syncbn_forward_samples,
           # one rounding from fp32 arithmetic in the oracle's order
           tol={"kernel": TORCH_TOL, "cpu": ALL_EXACT}, cpu=_bn.syncbn_forward_cpu,
           results=("y",)),
    OpInfo("syncbn_backward_reduce", _bn.syncbn_backward_reduce, _bn.syncbn_backward_reduce_ref,
           _syncbn_backward_reduce_samples,
           tol={"kernel": _BN_KERNEL_GRADS, "cpu": ALL_EXACT},
           cpu=_bn.syncbn_backward_reduce_cpu, results=("sums", "grad_weight", "grad_bias"),
           output_tol={"sums": {"kernel": {torch.float32: Tol(0.0, _BN_SUM_ATOL)}}}),
    OpInfo("syncbn_backward_input", _bn.syncbn_backward_input, _bn.syncbn_backward_input_ref,
           _syncbn_backward_input_samples,
           tol={"kernel": TORCH_TOL, "cpu": ALL_EXACT}, cpu=_bn.syncbn_backward_input_cpu,
           results=("dx", "dz"), output_tol={"dz": {"kernel": ALL_EXACT}}),
)

BY_NAME = {op.name: op for op in OPS}


def op(name):
    """The :class:`OpInfo` called ``name``."""
    return BY_NAME[name]
