"""FusedLAMB and FusedNovoGrad: kernels against their ``*_ref``, optimizers against
references written here in plain torch from the papers' update rules (in the variants
Apex implements), amp's grad_scale / found_inf contract, master weights, checkpoints.

References run in fp64; the kernels compute in fp32, so fp32 results agree to a few
fp32 ulps per step. Without a GPU the kernels run in Triton's interpreter
(tests/conftest.py): tensors stay small and runs short.
"""
import copy
import math

import pytest
import torch
import torch.nn as nn

from conftest import TOL
from tritamp.kernels.l2norm import multi_tensor_l2norm
from tritamp.kernels.lamb import lamb_step, lamb_step_ref
from tritamp.kernels.novograd import novograd_step, novograd_step_ref
from tritamp.optimizers.fused_lamb import FusedLAMB, FusedMixedPrecisionLamb
from tritamp.optimizers.fused_novograd import FusedNovoGrad

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter never contracts a*b+c into an FMA; the GPU may (last-bit differences).
EXACT = DEVICE.type == "cpu"
# Odd shapes; (4099,) spans two programs of 4096 under the interpreter.
SHAPES = ((1,), (257,), (4099,), (3, 7))
STEPS = 3
FP32_TOL = dict(rtol=2e-5, atol=2e-6)  # fp64 reference vs fp32 kernels over a few steps


def _params(dtype=torch.float32, seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).to(DEVICE).requires_grad_()
            for s in shapes]


def _grads(shapes, step, scale=1.0, seed=100):
    # Steps differ in size so that global clipping is sometimes on, sometimes off.
    g = torch.Generator().manual_seed(seed + step)
    mult = (0.02, 3.0, 0.05, 1.5)[step % 4]
    return [torch.randn(s, generator=g).to(DEVICE) * mult * scale for s in shapes]


def _set_grads(params, grads, dtype=None):
    for p, g in zip(params, grads):
        p.grad = g.to(dtype or p.dtype).clone()


def _assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b), f"max difference {(a.double() - b.double()).abs().max().item()}"


class HostReads(torch.overrides.TorchFunctionMode):
    """Records every host read of a tensor value (on a GPU, each is a sync)."""
    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
             torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__,
             torch.Tensor.cpu, torch.Tensor.numpy}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


# --------------------------------------------------------------------------------------
# References from the papers (fp64), in Apex's variants
# --------------------------------------------------------------------------------------
def lamb_reference(params, grad_seq, groups, *, lr, betas=(0.9, 0.999), eps=1e-6,
                   adam_w_mode=True, grad_averaging=True, bias_correction=True,
                   max_grad_norm=1.0, use_nvlamb=False):
    """You et al. 2019, Algorithm 2 (LAMB), as Apex runs it: gradients clipped by their
    global norm first; m, v Adam moments (bias-corrected); r = m^/(sqrt(v^)+eps) (+ wd x
    decoupled, or wd x in the gradient for L2); x -= lr * phi(||x||)/||r|| * r with phi the
    identity, applied only where wd != 0 (or NVLAMB) and both norms are non-zero.

    ``groups`` gives each parameter's weight decay."""
    b1, b2 = betas
    x = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(t) for t in x]
    v = [torch.zeros_like(t) for t in x]
    for t, grads in enumerate(grad_seq, start=1):
        gs = [g.double() for g in grads]
        gnorm = torch.sqrt(sum((g * g).sum() for g in gs))
        clip = gnorm / max_grad_norm if (max_grad_norm and gnorm > max_grad_norm) else 1.0
        for i, g in enumerate(gs):
            wd = groups[i]
            g = g / clip
            if not adam_w_mode:
                g = g + wd * x[i]
            m[i] = b1 * m[i] + ((1 - b1) if grad_averaging else 1.0) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            mh = m[i] / (1 - b1 ** t) if bias_correction else m[i]
            vh = v[i] / (1 - b2 ** t) if bias_correction else v[i]
            r = mh / (vh.sqrt() + eps)
            if adam_w_mode:
                r = r + wd * x[i]
            trust = 1.0
            if wd != 0 or use_nvlamb:
                xn, rn = x[i].norm(), r.norm()
                if xn > 0 and rn > 0:
                    trust = xn / rn
            x[i] = x[i] - lr * trust * r
    return x, m, v


def novograd_reference(params, grad_seq, *, lr, betas=(0.9, 0.999), eps=1e-8,
                       weight_decay=0.0, reg_inside_moment=False, grad_averaging=True,
                       norm_type=2, init_zero=False, bias_correction=True):
    """Ginsburg et al. 2019 (NovoGrad), as Apex runs it. The paper keeps the squared
    layer norm v = b2 v + (1-b2) ||g||^2 (v_1 = ||g_1||^2) and divides by sqrt(v);
    Apex stores sqrt(v) and blends squares, which is the same thing; for the max norm
    (norm_type 0) the norm itself is averaged. With reg_inside_moment the paper's
    m = b1 m + b3 (g / (sqrt(v^) + eps) + wd x), x -= lr m^; by default (Apex's)
    the decay moves to the update: x -= lr (m^ / (sqrt(v^) + eps) + wd x)."""
    b1, b2 = betas
    b3 = (1 - b1) if grad_averaging else 1.0
    x = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(t) for t in x]
    second = [torch.zeros((), dtype=torch.float64, device=t.device) for t in x]
    for t, grads in enumerate(grad_seq, start=1):
        for i, g in enumerate(grads):
            g = g.double()
            if norm_type == 2:
                n = (g * g).sum()                      # squared norm
                if t == 1 and not init_zero:
                    second[i] = n
                second[i] = b2 * second[i] + (1 - b2) * n
                norm = second[i].sqrt()
            else:
                n = g.abs().max()
                if t == 1 and not init_zero:
                    second[i] = n
                second[i] = b2 * second[i] + (1 - b2) * n
                norm = second[i]
            denom = (norm / math.sqrt(1 - b2 ** t) if bias_correction else norm) + eps
            bc1 = (1 - b1 ** t) if bias_correction else 1.0
            if reg_inside_moment:
                m[i] = b1 * m[i] + b3 * (g / denom + weight_decay * x[i])
                x[i] = x[i] - lr * m[i] / bc1
            else:
                m[i] = b1 * m[i] + b3 * g
                x[i] = x[i] - lr * (m[i] / bc1 / denom + weight_decay * x[i])
    stored = [s.sqrt() if norm_type == 2 else s for s in second]
    return x, m, stored


# --------------------------------------------------------------------------------------
# Kernels against their *_ref (same order of operations)
# --------------------------------------------------------------------------------------
# (param dtype, grad dtype, copy dtype): plain fp32; fp32 masters fed half gradients and
# writing half copies; half parameters updated in place.
KERNEL_CASES = [(torch.float32, torch.float32, None), (torch.float32, torch.float16, torch.float16),
                (torch.float32, torch.bfloat16, torch.bfloat16),
                (torch.bfloat16, torch.bfloat16, None), (torch.float16, torch.float16, None)]
KERNEL_IDS = ["fp32", "master-fp16", "master-bf16", "bf16", "fp16"]


def _kernel_run(step_fn, case, per_tensor_v, steps=2, scale=None, **kw):
    p_dtype, g_dtype, c_dtype = case
    params = [p.detach() for p in _params(p_dtype)]
    copies = None if c_dtype is None else [p.to(c_dtype) for p in params]
    m = [torch.zeros(p.shape, device=DEVICE) for p in params]
    v = [torch.zeros((), device=DEVICE) if per_tensor_v else torch.zeros(p.shape, device=DEVICE)
         for p in params]
    st = [torch.zeros((), device=DEVICE) for _ in params]
    gs = None if scale is None else torch.tensor(scale, device=DEVICE)
    for k in range(steps):
        grads = [g.to(g_dtype) for g in _grads(SHAPES, k, scale=scale or 1.0)]
        extra = {}
        if step_fn in (lamb_step, lamb_step_ref):
            extra["global_grad_norm"] = multi_tensor_l2norm(grads, scale=gs)[0]
        step_fn(params, grads, m, v, st, copies, grad_scale=gs, found_inf=None, **kw, **extra)
    return params, copies, m, v, st


def _compare_kernel_to_ref(kernel, ref, case, per_tensor_v, **kw):
    a = _kernel_run(kernel, case, per_tensor_v, **kw)
    b = _kernel_run(ref, case, per_tensor_v, **kw)
    for xs, ys in zip(a[:4], b[:4]):
        if xs is None:
            assert ys is None
            continue
        for x, y in zip(xs, ys):
            tol = TOL[x.dtype] if x.dtype != torch.float32 else dict(rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(x, y, **tol)
    for x, y in zip(a[4], b[4]):
        _assert_bitwise(x, y)


@pytest.mark.parametrize("case", KERNEL_CASES, ids=KERNEL_IDS)
def test_lamb_kernel_matches_ref(case):
    _compare_kernel_to_ref(lamb_step, lamb_step_ref, case, False, lr=1e-2, beta1=0.9,
                           beta2=0.999, eps=1e-6, weight_decay=0.01, max_grad_norm=1.0,
                           scale=2.0 ** 10)


@pytest.mark.parametrize("variant", [dict(adam_w_mode=False), dict(weight_decay=0.0),
                                     dict(weight_decay=0.0, use_nvlamb=True),
                                     dict(bias_correction=False, grad_averaging=False)],
                         ids=["l2", "no-decay", "nvlamb", "no-bc-no-avg"])
def test_lamb_kernel_variants_match_ref(variant):
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, max_grad_norm=1.0)
    kw.update(variant)
    _compare_kernel_to_ref(lamb_step, lamb_step_ref, KERNEL_CASES[0], False, **kw)


@pytest.mark.parametrize("case", KERNEL_CASES, ids=KERNEL_IDS)
def test_novograd_kernel_matches_ref(case):
    _compare_kernel_to_ref(novograd_step, novograd_step_ref, case, True, lr=1e-2, beta1=0.95,
                           beta2=0.98, eps=1e-8, weight_decay=0.01, scale=2.0 ** 10)


@pytest.mark.parametrize("variant", [dict(norm_type=0), dict(reg_inside_moment=True),
                                     dict(init_zero=True, grad_averaging=False),
                                     dict(norm_type=0, bias_correction=False)],
                         ids=["max-norm", "reg-inside", "init-zero-no-avg", "max-no-bc"])
def test_novograd_kernel_variants_match_ref(variant):
    kw = dict(lr=1e-2, beta1=0.95, beta2=0.98, eps=1e-8, weight_decay=0.01)
    kw.update(variant)
    _compare_kernel_to_ref(novograd_step, novograd_step_ref, KERNEL_CASES[0], True, **kw)


def test_kernels_skip_on_found_inf_like_their_refs():
    for fn, vec in ((lamb_step, False), (lamb_step_ref, False), (novograd_step, True),
                    (novograd_step_ref, True)):
        params = [p.detach() for p in _params()]
        copies = [p.to(torch.float16) for p in params]
        copies[0].add_(1.0)  # a copy that does not match its master is left as it is too
        before = [t.clone() for t in params + copies]
        m = [torch.ones(p.shape, device=DEVICE) for p in params]
        v = [torch.ones(() if vec else p.shape, device=DEVICE) for p in params]
        st = [torch.full((), 3.0, device=DEVICE) for _ in params]
        grads = [g.half() for g in _grads(SHAPES, 0)]
        grads[1][0] = math.inf
        kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)
        if fn in (lamb_step, lamb_step_ref):
            kw["global_grad_norm"] = multi_tensor_l2norm(grads)[0]
        fn(params, grads, m, v, st, copies, found_inf=torch.ones((), device=DEVICE),
           grad_scale=torch.tensor(4.0, device=DEVICE), **kw)
        for a, b in zip(params + copies, before):
            _assert_bitwise(a, b)
        assert all(float(s) == 3.0 for s in st)
        assert all(bool((x == 1).all()) for x in m + v)


# --------------------------------------------------------------------------------------
# Optimizers against the papers' rules
# --------------------------------------------------------------------------------------
LAMB_VARIANTS = {
    "default": dict(),
    "l2": dict(adam_w_mode=False),
    "nvlamb": dict(use_nvlamb=True),
    "no-bc-no-avg": dict(bias_correction=False, grad_averaging=False),
    "no-clip": dict(max_grad_norm=0.0),
}


@pytest.mark.parametrize("variant", LAMB_VARIANTS.values(), ids=LAMB_VARIANTS.keys())
def test_lamb_matches_paper_fp32(variant):
    params = _params()
    # Two groups: weight decay (trust ratio on) and none (off unless NVLAMB).
    opt = FusedLAMB([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}],
                    lr=1e-2, weight_decay=0.05, **variant)
    seq = [_grads(SHAPES, k) for k in range(STEPS)]
    for grads in seq:
        _set_grads(params, grads)
        opt.step()
    start = _params()
    x, m, v = lamb_reference(start, seq, [0.05, 0.05, 0.0, 0.0], lr=1e-2, **variant)
    for p, p0, xr, mr, vr in zip(params, start, x, m, v):
        assert not torch.equal(p.detach(), p0.detach())  # it moved
        torch.testing.assert_close(p.detach().double(), xr, **FP32_TOL)
        st = opt.state[p]
        torch.testing.assert_close(st["exp_avg"].double(), mr, **FP32_TOL)
        torch.testing.assert_close(st["exp_avg_sq"].double(), vr, rtol=2e-5, atol=1e-12)
        assert st["step"].dtype == torch.float32 and float(st["step"]) == STEPS


def test_lamb_reference_moves_params_from_the_reference_start():
    # The reference must start from the optimizer's initial values: guard the helper.
    params = _params()
    x, _, _ = lamb_reference(params, [], [0.0] * len(params), lr=1.0)
    for p, xr in zip(params, x):
        assert torch.equal(p.detach().double(), xr)


NOVOGRAD_VARIANTS = {
    "default": dict(),
    "decay": dict(weight_decay=0.01),
    "max-norm": dict(norm_type=0, weight_decay=0.01),
    "reg-inside": dict(reg_inside_moment=True, weight_decay=0.01),
    "init-zero": dict(init_zero=True, grad_averaging=False),
    "no-bc": dict(bias_correction=False, norm_type=0, init_zero=True),
}


@pytest.mark.parametrize("variant", NOVOGRAD_VARIANTS.values(), ids=NOVOGRAD_VARIANTS.keys())
def test_novograd_matches_paper_fp32(variant):
    params = _params()
    opt = FusedNovoGrad(params, lr=1e-2, betas=(0.95, 0.98), **variant)
    seq = [_grads(SHAPES, k) for k in range(STEPS)]
    for grads in seq:
        _set_grads(params, grads)
        opt.step()
    start = _params()
    x, m, v = novograd_reference(start, seq, lr=1e-2, betas=(0.95, 0.98), **variant)
    for p, p0, xr, mr, vr in zip(params, start, x, m, v):
        assert not torch.equal(p.detach(), p0.detach())
        torch.testing.assert_close(p.detach().double(), xr, **FP32_TOL)
        st = opt.state[p]
        torch.testing.assert_close(st["exp_avg"].double(), mr, **FP32_TOL)
        assert st["exp_avg_sq"].shape == () and st["exp_avg_sq"].dtype == torch.float32
        torch.testing.assert_close(st["exp_avg_sq"].double(), vr, rtol=2e-6, atol=0)
        assert float(st["step"]) == STEPS


# --------------------------------------------------------------------------------------
# Half parameters with fp32 master weights
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("which", ["lamb", "novograd"])
def test_master_weights_track_the_fp32_reference(which, half):
    params = _params(half)
    if which == "lamb":
        opt = FusedLAMB(params, lr=1e-2, weight_decay=0.05, master_weights=True)
    else:
        opt = FusedNovoGrad(params, lr=1e-2, weight_decay=0.01, master_weights=True)
    seq = [[g.to(half) for g in _grads(SHAPES, k)] for k in range(STEPS)]
    for grads in seq:
        _set_grads(params, grads)
        opt.step()
    # The reference starts from the half values and sees the half gradients, in fp64.
    params_start = _params(half)
    if which == "lamb":
        x, _, _ = lamb_reference(params_start, seq, [0.05] * 4, lr=1e-2)
    else:
        x, _, _ = novograd_reference(params_start, seq, lr=1e-2, weight_decay=0.01)
    for p, p0, xr in zip(params, params_start, x):
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and p.dtype == half
        torch.testing.assert_close(master.double(), xr, **FP32_TOL)
        _assert_bitwise(p.detach(), master.to(half))  # the half copy written in the same pass
        assert not torch.equal(p.detach(), p0.detach())
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert opt.state[p][k].dtype == torch.float32


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("which", ["lamb", "novograd"])
def test_half_params_without_masters_within_dtype_tolerance(which, half):
    params = _params(half)
    ref = _params(torch.float32)
    with torch.no_grad():
        for r, p in zip(ref, params):
            r.copy_(p.float())
    make = (lambda ps: FusedLAMB(ps, lr=1e-2)) if which == "lamb" else \
        (lambda ps: FusedNovoGrad(ps, lr=1e-2))
    opt, ref_opt = make(params), make(ref)
    for k in range(2):
        grads = [g.to(half) for g in _grads(SHAPES, k)]
        _set_grads(params, grads)
        _set_grads(ref, [g.float() for g in grads])
        opt.step()
        ref_opt.step()
    for p, r in zip(params, ref):
        # One rounding to the half dtype per step, on values of order 1.
        torch.testing.assert_close(p.detach().float(), r.detach(), rtol=0,
                                   atol=2 * 2 * torch.finfo(half).eps)


# --------------------------------------------------------------------------------------
# grad_scale / found_inf (torch.amp.GradScaler's and tritamp.amp's contract)
# --------------------------------------------------------------------------------------
def _make(which, params, **kw):
    if which == "lamb":
        return FusedLAMB(params, lr=1e-2, weight_decay=0.05, **kw)
    return FusedNovoGrad(params, lr=1e-2, weight_decay=0.01, **kw)


def _snapshot(opt, params):
    snap = [p.detach().clone() for p in params]
    for p in params:
        for k, v in sorted(opt.state[p].items()):
            snap.append(v.clone())
    return snap


@pytest.mark.parametrize("which", ["lamb", "novograd"])
def test_found_inf_skips_bitwise_and_keeps_step_counts(which):
    params = _params(torch.float16)
    opt = _make(which, params, master_weights=True)
    _set_grads(params, _grads(SHAPES, 0))
    opt.step()
    before = _snapshot(opt, params)
    grads = _grads(SHAPES, 1, scale=2.0 ** 16)
    grads[2][5] = math.nan
    _set_grads(params, grads)
    opt.grad_scale = torch.tensor(2.0 ** 16, device=DEVICE)
    opt.found_inf = torch.ones((), device=DEVICE)
    opt.step()
    after = _snapshot(opt, params)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        _assert_bitwise(a, b)
    assert all(float(opt.state[p]["step"]) == 1.0 for p in params)


@pytest.mark.parametrize("which", ["lamb", "novograd"])
def test_skipped_first_step_leaves_no_trace(which):
    # NovoGrad's second moment starts at the first *taken* step's norm.
    params, ref = _params(), _params()
    opt, ref_opt = _make(which, params), _make(which, ref)
    _set_grads(params, _grads(SHAPES, 7))
    opt.found_inf = torch.ones((), device=DEVICE)
    opt.step()
    del opt.found_inf
    for k in range(2):
        _set_grads(params, _grads(SHAPES, k))
        _set_grads(ref, _grads(SHAPES, k))
        opt.step()
        ref_opt.step()
    for p, r in zip(params, ref):
        _assert_bitwise(p.detach(), r.detach())
        for key in ("exp_avg", "exp_avg_sq", "step"):
            _assert_bitwise(opt.state[p][key], ref_opt.state[r][key])


@pytest.mark.parametrize("which", ["lamb", "novograd"])
def test_grad_scale_is_folded_in(which):
    # A power-of-two scale unscales exactly: same result as unscaled gradients (the
    # global norm included), bit for bit where no FMA is formed.
    params, ref = _params(), _params()
    opt, ref_opt = _make(which, params), _make(which, ref)
    for k in range(2):
        _set_grads(params, _grads(SHAPES, k, scale=2.0 ** 12))
        _set_grads(ref, _grads(SHAPES, k))
        opt.grad_scale = torch.tensor(2.0 ** 12, device=DEVICE)
        opt.found_inf = torch.zeros((), device=DEVICE)
        opt.step()
        ref_opt.step()
    for p, r in zip(params, ref):
        if EXACT:
            _assert_bitwise(p.detach(), r.detach())
        else:
            torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("which", ["lamb", "novograd"])
def test_driven_by_torch_grad_scaler(which):
    params, ref = _params(), _params()
    opt, ref_opt = _make(which, params), _make(which, ref)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0 ** 8, growth_interval=1)
    for k in range(3):
        grads = _grads(SHAPES, k)
        if k == 1:
            grads[0][0] = math.inf  # skipped; the scale backs off
        scaler.scale(torch.ones((), device=DEVICE))  # as a loss would: sets up the scale
        _set_grads(params, [g * scaler.get_scale() for g in grads])
        scaler.step(opt)
        scaler.update()
        if k != 1:
            _set_grads(ref, grads)
            ref_opt.step()
    assert scaler.get_scale() == 2.0 ** 9  # grew, backed off, grew
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
        assert float(opt.state[p]["step"]) == 2.0


@pytest.mark.parametrize("which", ["lamb", "novograd"])
def test_amp_o2_trains_without_host_reads(which):
    from tritamp import amp
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(DEVICE)
    model, opt = amp.initialize(model, _make(which, model.parameters()), opt_level="O2",
                                loss_scale="dynamic", verbosity=0)
    x = torch.randn(16, 6, device=DEVICE)
    y = torch.randint(0, 3, (16,), device=DEVICE)

    def step():
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        return loss.detach()

    first = step()
    reads = HostReads()
    with reads:
        for _ in range(3):
            last = step()
    assert reads.calls == []
    assert float(last) < float(first)
    for p in model.parameters():
        assert p.dtype == torch.float16


# --------------------------------------------------------------------------------------
# Checkpoints, validation, misuse
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["lamb", "novograd"])
def test_save_load_keep_stepping_identical(which):
    params = _params(torch.bfloat16)
    opt = _make(which, params, master_weights=True)
    for k in range(2):
        _set_grads(params, _grads(SHAPES, k))
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    params2 = [p.detach().clone().requires_grad_() for p in params]
    opt2 = _make(which, params2, master_weights=True)
    opt2.load_state_dict(saved)
    for p, p2 in zip(params, params2):
        for k, v in opt.state[p].items():
            _assert_bitwise(opt2.state[p2][k], v)  # fp32 state stays fp32
    for k in range(2, 4):
        _set_grads(params, _grads(SHAPES, k))
        _set_grads(params2, _grads(SHAPES, k))
        opt.step()
        opt2.step()
    for p, p2 in zip(params, params2):
        _assert_bitwise(p.detach(), p2.detach())
        for k, v in opt.state[p].items():
            _assert_bitwise(opt2.state[p2][k], v)


@pytest.mark.parametrize("kw", [dict(lr=-1.0), dict(betas=(1.0, 0.9)), dict(betas=(0.9, -0.1)),
                                dict(eps=-1e-6), dict(weight_decay=-0.1),
                                dict(max_grad_norm=-1.0)],
                         ids=["lr", "beta1", "beta2", "eps", "wd", "max_grad_norm"])
def test_lamb_invalid_hyperparameters(kw):
    with pytest.raises(ValueError, match="Invalid"):
        FusedLAMB(_params(), **kw)


@pytest.mark.parametrize("cls", [FusedLAMB, FusedMixedPrecisionLamb])
@pytest.mark.parametrize("value,error", [(-1.0, ValueError), ("1.0", TypeError)])
def test_lamb_bad_max_grad_norm_in_a_checkpoint_is_refused_at_load(cls, value, error):
    # (was loaded; the step reads the constructor's value, a group's is a checkpoint's)
    opt = cls(_params(), lr=1e-3)
    saved = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(saved)
    bad["param_groups"][0]["max_grad_norm"] = value
    with pytest.raises(error, match="max_grad_norm"):
        opt.load_state_dict(bad)
    assert opt.state_dict() == saved
    bad["param_groups"][0]["max_grad_norm"] = None  # clipping off: loads
    opt.load_state_dict(bad)


@pytest.mark.parametrize("kw", [dict(lr=-1.0), dict(betas=(0.9, 1.0)), dict(eps=-1.0),
                                dict(weight_decay=-0.1), dict(norm_type=1),
                                dict(norm_type=float("inf"))],
                         ids=["lr", "beta2", "eps", "wd", "norm1", "norm-inf"])
def test_novograd_invalid_hyperparameters(kw):
    with pytest.raises(ValueError, match="Invalid"):
        FusedNovoGrad(_params(), **kw)


@pytest.mark.parametrize("cls", [FusedLAMB, FusedNovoGrad])
def test_amsgrad_refused_like_apex(cls):
    with pytest.raises(RuntimeError, match="does not support the AMSGrad variant"):
        cls(_params(), amsgrad=True)


@pytest.mark.parametrize("cls", [FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad])
def test_amsgrad_in_a_group_is_refused(cls):
    # LAMB's two optimizers took amsgrad=True on a group and ran plain LAMB
    with pytest.raises(ValueError, match=r"does not support the AMSGrad variant \(amsgrad=True "
                                         r"\(parameter group 1\)\)"):
        cls(_params()).add_param_group({"params": _params(), "amsgrad": True})
    opt = cls(_params())
    opt.param_groups[0]["amsgrad"] = True
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    with pytest.raises(ValueError, match=r"amsgrad=True \(param_groups\[0\]\)"):
        opt.step()
    for b, p in zip(before, opt.param_groups[0]["params"]):
        assert torch.equal(b, p.detach())


@pytest.mark.parametrize("cls", [FusedLAMB, FusedNovoGrad])
def test_sparse_gradients_raise(cls):
    emb = nn.Embedding(10, 3, sparse=True).to(DEVICE)
    emb(torch.tensor([1, 2], device=DEVICE)).sum().backward()
    opt = cls(emb.parameters())
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()


@pytest.mark.parametrize("cls", [FusedLAMB, FusedNovoGrad])
def test_apex_defaults_and_zero_grad(cls):
    params = _params()
    opt = cls(params)
    d = opt.defaults
    assert d["lr"] == 1e-3 and d["betas"] == (0.9, 0.999) and d["bias_correction"] is True
    if cls is FusedLAMB:
        assert d["eps"] == 1e-6 and d["weight_decay"] == 0.01 and d["max_grad_norm"] == 1.0
        assert opt.adam_w_mode == 1 and opt.use_nvlamb is False
    else:
        assert d["eps"] == 1e-8 and d["weight_decay"] == 0.0 and d["norm_type"] == 2
        assert d["init_zero"] is False and opt.moment_mode == 1
    assert opt._step_supports_amp_scaling
    _set_grads(params, _grads(SHAPES, 0))
    opt.zero_grad()
    assert all(p.grad is None for p in params)  # set_grad_none=True


def test_params_without_grads_are_left_alone():
    params = _params()
    opt = FusedLAMB(params, lr=1e-2)
    _set_grads(params[:2], _grads(SHAPES[:2], 0))
    before = [p.detach().clone() for p in params[2:]]
    opt.step()
    for p, b in zip(params[2:], before):
        _assert_bitwise(p.detach(), b)
        assert p not in opt.state
