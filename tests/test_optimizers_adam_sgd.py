"""FusedAdam and FusedSGD: Apex's signatures and defaults, checked against torch.optim.

Golden trajectories (N steps against torch.optim.AdamW / Adam / SGD on the same
parameters and gradients), many odd-sized tensors in one launch, the grad_scale/found_inf
contract (set by hand, by torch.amp.GradScaler and by tritamp.amp at every opt level),
state_dict interchange with torch, capturable lr tensors and zero_grad defaults.

The kernels run in Triton's interpreter on CPU (tests/conftest.py); tensors stay small.
The kernel and torch round differently in at most an ulp or so per step, so fp32
trajectories are compared with rtol=1e-5, atol=1e-6 over 5 steps of lr ~1e-2 (measured:
the worst element uses under a third of that tolerance).
"""
import importlib
import io

import pytest
import torch
from torch import nn

from conftest import TOL
from tritamp import amp
from tritamp.optimizers import FusedAdam, FusedSGD

adam_mod = importlib.import_module("tritamp.kernels.adam")
sgd_mod = importlib.import_module("tritamp.kernels.sgd")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP32 = dict(rtol=1e-5, atol=1e-6)
SIZES = (1, 257, 4097, (3, 257))
N_STEPS = 5
INF = float("inf")
HALVES = [torch.float16, torch.bfloat16]
HALF_IDS = ["fp16", "bf16"]

def make_params(sizes=SIZES, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).to(DEVICE).requires_grad_() for s in sizes]


def make_grads(sizes=SIZES, n=N_STEPS, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen).to(dtype).to(DEVICE) for s in sizes]
            for _ in range(n)]


def twin(params, dtype=None):
    return [p.detach().clone().to(dtype or p.dtype).requires_grad_() for p in params]


def set_grads(params, grads, factor=1.0):
    for p, g in zip(params, grads):
        p.grad = (g * factor).to(p.dtype) if factor != 1.0 else g.clone().to(p.dtype)


def snapshot(opt, params):
    """Every tensor the optimizer owns or updates, cloned."""
    state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
             for i, p in enumerate(params) if p in opt.state}
    return [p.detach().clone() for p in params], state


def assert_snapshots_equal(a, b):
    (pa, sa), (pb, sb) = a, b
    for i, (x, y) in enumerate(zip(pa, pb)):
        assert torch.equal(x, y), f"param {i} changed"
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), f"state[{i}][{k!r}] changed"


# =================================================================================
# golden trajectories against torch.optim
# =================================================================================

ADAM_CASES = {
    "adamw": (dict(), torch.optim.AdamW, dict(weight_decay=0.0)),
    "adamw-wd": (dict(weight_decay=0.1), torch.optim.AdamW, dict(weight_decay=0.1)),
    "adamw-betas-eps": (dict(betas=(0.5, 0.95), eps=1e-3, weight_decay=0.01),
                        torch.optim.AdamW, dict(betas=(0.5, 0.95), eps=1e-3, weight_decay=0.01)),
    "adam": (dict(adam_w_mode=False), torch.optim.Adam, dict()),
    "adam-l2": (dict(adam_w_mode=False, weight_decay=0.1), torch.optim.Adam,
                dict(weight_decay=0.1)),
}


@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_fused_adam_matches_torch(case):
    ours_kw, torch_cls, torch_kw = ADAM_CASES[case]
    ours, theirs = make_params(), make_params()
    opt = FusedAdam(ours, lr=1e-2, **ours_kw)
    ref = torch_cls(theirs, lr=1e-2, **torch_kw)
    for grads in make_grads():
        set_grads(ours, grads)
        set_grads(theirs, grads)
        opt.step()
        ref.step()
    for i, (p, q) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(p, q, **FP32, msg=f"param {i}")
        s, r = opt.state[p], ref.state[q]
        assert set(s) == {"step", "exp_avg", "exp_avg_sq"}
        assert s["step"].item() == r["step"].item() == N_STEPS
        torch.testing.assert_close(s["exp_avg"], r["exp_avg"], **FP32)
        torch.testing.assert_close(s["exp_avg_sq"], r["exp_avg_sq"], **FP32)


SGD_CASES = {
    "plain": dict(),
    "plain-wd": dict(weight_decay=0.1),
    "momentum": dict(momentum=0.9),
    "nesterov-wd": dict(momentum=0.9, nesterov=True, weight_decay=0.1),
    "dampening-wd": dict(momentum=0.9, dampening=0.3, weight_decay=0.01),
}


@pytest.mark.parametrize("kw", list(SGD_CASES.values()), ids=list(SGD_CASES))
def test_fused_sgd_matches_torch(kw):
    ours, theirs = make_params(), make_params()
    opt = FusedSGD(ours, lr=0.1, **kw)
    ref = torch.optim.SGD(theirs, lr=0.1, **kw)
    for grads in make_grads():
        set_grads(ours, grads)
        set_grads(theirs, grads)
        opt.step()
        ref.step()
    for i, (p, q) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(p, q, **FP32, msg=f"param {i}")
        if kw.get("momentum", 0):
            torch.testing.assert_close(opt.state[p]["momentum_buffer"],
                                       ref.state[q]["momentum_buffer"], **FP32)


def test_fused_sgd_first_momentum_step_is_one_step():
    """Smallest repro: after one step buf == g and p == p0 - lr * g (torch.optim.SGD).
    Actual: buf == (1 + momentum) * g and p == p0 - lr * g - lr * (1 + momentum) * g."""
    p0 = torch.tensor([1.0, -2.0, 0.5], device=DEVICE)
    g = torch.tensor([0.5, 0.25, -1.0], device=DEVICE)
    p = p0.clone().requires_grad_()
    opt = FusedSGD([p], lr=0.1, momentum=0.9)
    p.grad = g.clone()
    opt.step()
    assert torch.equal(opt.state[p]["momentum_buffer"], g)
    torch.testing.assert_close(p.detach(), p0 - 0.1 * g)


def test_fused_sgd_momentum_steady_state_matches_torch():
    """From the same momentum buffers on, FusedSGD follows torch.optim.SGD step for step
    (what the first-step bug above leaves correct)."""
    kw = dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    ours, theirs = make_params(), make_params()
    ref = torch.optim.SGD(theirs, **kw)
    opt = FusedSGD(ours, **kw)
    grads = make_grads()
    set_grads(theirs, grads[0])
    ref.step()
    for p, q in zip(ours, theirs):
        p.data.copy_(q.detach())
        opt.state[p]["momentum_buffer"] = ref.state[q]["momentum_buffer"].clone()
    for g in grads[1:]:
        set_grads(ours, g)
        set_grads(theirs, g)
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, **FP32)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"],
                                   ref.state[q]["momentum_buffer"], **FP32)


@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_fused_adam_master_weights_follow_torch_fp32(dtype):
    """Half parameters with master_weights=True: the fp32 master follows torch.optim.AdamW
    on an fp32 copy fed the same (half) gradients; the half parameter is the master
    rounded, bit for bit."""
    halves = make_params(dtype=dtype)
    fp32 = twin(halves, torch.float32)
    opt = FusedAdam(halves, lr=1e-2, weight_decay=0.01, master_weights=True)
    ref = torch.optim.AdamW(fp32, lr=1e-2, weight_decay=0.01)
    for grads in make_grads(dtype=dtype):
        set_grads(halves, grads)
        set_grads(fp32, [g.float() for g in grads])
        opt.step()
        ref.step()
        for i, (h, q) in enumerate(zip(halves, fp32)):
            master = opt.state[h]["master_param"]
            assert master.dtype == torch.float32
            assert torch.equal(h.detach(), master.to(dtype)), f"param {i} != master.to({dtype})"
    for i, (h, q) in enumerate(zip(halves, fp32)):
        st = opt.state[h]
        torch.testing.assert_close(st["master_param"], q.detach(), **FP32, msg=f"master {i}")
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
        assert st["step"].item() == N_STEPS


# =================================================================================
# many tensors, groups, parameters without gradients, bad arguments
# =================================================================================

@pytest.fixture
def adam_launches(count_launches):
    return count_launches(adam_mod, "_adam_step_kernel")


@pytest.fixture
def sgd_launches(count_launches):
    return count_launches(sgd_mod, "_sgd_step_kernel")


MANY = [1 + (i * 211) % 3000 for i in range(30)]  # 30 odd sizes in 1..3000


def test_many_tensors_fused_adam_one_launch(adam_launches):
    ours, theirs = make_params(MANY), make_params(MANY)
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.01)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.01)
    for grads in make_grads(MANY, n=2):
        set_grads(ours, grads)
        set_grads(theirs, grads)
        opt.step()
        ref.step()
    assert len(adam_launches.grids) == 2, adam_launches.grids  # one per step
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, **FP32)


def test_many_tensors_fused_sgd_one_launch(sgd_launches):
    ours, theirs = make_params(MANY), make_params(MANY)
    kw = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
    opt = FusedSGD(ours, **kw)
    for p in ours:  # steady state: every buffer exists
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    grads = make_grads(MANY, n=1)[0]
    set_grads(ours, grads)
    opt.step()
    assert len(sgd_launches.grids) == 1, sgd_launches.grids
    # zero buffers and dampening 0: buf = g, the same as torch's first step
    ref = torch.optim.SGD(theirs, **kw)
    set_grads(theirs, grads)
    ref.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, **FP32)


def test_mixed_dtypes_one_launch_per_dtype(adam_launches):
    params = [p for dt in (torch.float32, torch.float16, torch.bfloat16)
              for p in make_params((7, 300, 1000), dtype=dt)]
    opt = FusedAdam(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert len(adam_launches.grids) == 3, adam_launches.grids
    for p in params:
        st = opt.state[p]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32


@pytest.mark.parametrize("make", [lambda g: FusedAdam(g, lr=1e-2),
                                  lambda g: FusedAdam(g, lr=1e-2, capturable=True),
                                  lambda g: FusedSGD(g, lr=0.1, momentum=0.9)],
                         ids=["adam", "adam-capturable", "sgd"])
def test_empty_param_groups(make):
    a, = make_params((300,))
    before = a.detach().clone()
    opt = make([{"params": []}, {"params": [a]}, {"params": []}])
    opt.add_param_group({"params": []})
    a.grad = torch.ones_like(a)
    opt.step()
    opt.step()
    assert not torch.equal(a.detach(), before) and a.isfinite().all()
    assert list(opt.state) == [a]


@pytest.mark.parametrize("make", [lambda g: FusedAdam(g, lr=1e-2),
                                  lambda g: FusedSGD(g, lr=0.1, momentum=0.9)],
                         ids=["adam", "sgd"])
def test_params_without_grads_are_untouched(make):
    a, b, c = make_params((5, 300, 4097))
    before_b = b.detach().clone()
    opt = make([a, b, c])
    a.grad, c.grad = torch.randn_like(a), torch.randn_like(c)
    opt.step()
    assert torch.equal(b.detach(), before_b)
    assert b not in opt.state
    assert a in opt.state and c in opt.state


@pytest.mark.parametrize("cls,kw", [(FusedAdam, {}), (FusedSGD, dict(lr=0.1))],
                         ids=["adam", "sgd"])
def test_sparse_grads_raise(cls, kw):
    p = torch.zeros(4, 3, device=DEVICE, requires_grad=True)
    opt = cls([p], **kw)
    p.grad = torch.eye(4, 3, device=DEVICE).to_sparse()
    with pytest.raises(RuntimeError, match=f"{cls.__name__} does not support sparse gradients"):
        opt.step()


@pytest.mark.parametrize("make,match", [
    (lambda p: FusedAdam(p, lr=-1e-3), "learning rate"),
    (lambda p: FusedAdam(p, betas=(1.0, 0.999)), "beta parameter at index 0"),
    (lambda p: FusedAdam(p, betas=(-0.1, 0.999)), "beta parameter at index 0"),
    (lambda p: FusedAdam(p, betas=(0.9, 1.0)), "beta parameter at index 1"),
    (lambda p: FusedAdam(p, eps=-1e-8), "epsilon"),
    (lambda p: FusedAdam(p, weight_decay=-0.1), "weight_decay"),
    (lambda p: FusedSGD(p, lr=-0.1), "learning rate"),
    (lambda p: FusedSGD(p, lr=0.1, momentum=-0.5), "momentum"),
    (lambda p: FusedSGD(p, lr=0.1, weight_decay=-1.0), "weight_decay"),
    (lambda p: FusedSGD(p, lr=0.1, nesterov=True), "Nesterov"),
    (lambda p: FusedSGD(p, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "Nesterov"),
    (lambda p: FusedSGD(p), "learning rate"),
], ids=["adam-lr", "adam-beta1-1", "adam-beta1-neg", "adam-beta2-1", "adam-eps",
        "adam-wd", "sgd-lr", "sgd-momentum", "sgd-wd", "sgd-nesterov-no-momentum",
        "sgd-nesterov-dampening", "sgd-no-lr"])
def test_invalid_hyperparameters_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make(make_params((3,)))


def test_amsgrad_raises():
    with pytest.raises(RuntimeError, match=r"^FusedAdam does not support the AMSGrad variant\.$"):
        FusedAdam(make_params((3,)), amsgrad=True)


# =================================================================================
# grad_scale / found_inf set by hand (torch.amp.GradScaler's contract)
# =================================================================================

OVERFLOW_CASES = {
    "adam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
    "adam-l2": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01, adam_w_mode=False),
    "sgd-nesterov": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                        weight_decay=0.01),
    "sgd-plain": lambda ps: FusedSGD(ps, lr=0.1),
}


def _amp_attrs(opt, grad_scale=None, found_inf=None):
    opt.grad_scale = None if grad_scale is None else \
        torch.full((), grad_scale, dtype=torch.float32, device=DEVICE)
    opt.found_inf = torch.full((), found_inf, dtype=torch.float32, device=DEVICE)


def _clear_amp_attrs(opt):
    del opt.grad_scale
    del opt.found_inf


@pytest.mark.parametrize("case", list(OVERFLOW_CASES))
@pytest.mark.parametrize("scale", [None, 1024.0])
def test_found_inf_changes_nothing(case, scale):
    params = make_params()
    opt = OVERFLOW_CASES[case](params)
    grads = make_grads(n=3)
    for g in grads[:2]:
        set_grads(params, g)
        opt.step()
    before = snapshot(opt, params)
    set_grads(params, grads[2], factor=scale or 1.0)
    params[1].grad.view(-1)[3] = INF
    params[2].grad.view(-1)[-1] = float("nan")
    _amp_attrs(opt, scale, 1.0)
    opt.step()
    _clear_amp_attrs(opt)
    assert_snapshots_equal(snapshot(opt, params), before)


@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_found_inf_changes_nothing_with_master_weights(dtype):
    halves = make_params(dtype=dtype)
    opt = FusedAdam(halves, lr=1e-2, master_weights=True)
    for g in make_grads(n=2, dtype=dtype):
        set_grads(halves, g)
        opt.step()
    before = snapshot(opt, halves)
    set_grads(halves, make_grads(n=1, dtype=dtype, seed=9)[0], factor=INF)
    _amp_attrs(opt, 65536.0, 1.0)
    opt.step()
    _clear_amp_attrs(opt)
    assert_snapshots_equal(snapshot(opt, halves), before)


def test_skipped_first_step_leaves_no_trace_adam():
    """A skipped first step creates zero state at step 0: the next clean step is exactly a
    fresh optimizer's first step."""
    ours, fresh = make_params(), make_params()
    grads = make_grads(n=2)
    opt, ref = FusedAdam(ours, lr=1e-2), FusedAdam(fresh, lr=1e-2)
    set_grads(ours, grads[0], factor=INF)
    _amp_attrs(opt, 2.0 ** 16, 1.0)
    opt.step()
    _clear_amp_attrs(opt)
    for p, q in zip(ours, fresh):
        assert torch.equal(p, q)
        assert opt.state[p]["step"].item() == 0.0
    set_grads(ours, grads[1])
    set_grads(fresh, grads[1])
    opt.step()
    ref.step()
    assert_snapshots_equal(snapshot(opt, ours), snapshot(ref, fresh))


def test_skipped_first_step_leaves_no_trace_sgd_dampening():
    ours, theirs = make_params(), make_params()
    grads = make_grads(n=2)
    kw = dict(lr=0.1, momentum=0.9, dampening=0.5)
    opt, ref = FusedSGD(ours, **kw), torch.optim.SGD(theirs, **kw)
    set_grads(ours, grads[0], factor=INF)
    _amp_attrs(opt, 2.0 ** 16, 1.0)
    opt.step()
    _clear_amp_attrs(opt)
    set_grads(ours, grads[1])
    set_grads(theirs, grads[1])
    opt.step()
    ref.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"],
                                   ref.state[q]["momentum_buffer"], **FP32)
        torch.testing.assert_close(p, q, **FP32)


@pytest.mark.parametrize("case", list(OVERFLOW_CASES))
@pytest.mark.parametrize("scale", [1024.0, 3000.0], ids=["pow2", "odd"])
def test_grad_scale_is_folded_in(case, scale):
    """grads * S with grad_scale=S steps like the plain grads without grad_scale: bitwise
    for a power of two (the unscale is exact), within fp32 rounding otherwise."""
    scaled, plain = make_params(), make_params()
    opt_s, opt_p = OVERFLOW_CASES[case](scaled), OVERFLOW_CASES[case](plain)
    for g in make_grads(n=3):
        set_grads(scaled, g, factor=scale)
        set_grads(plain, g)
        _amp_attrs(opt_s, scale, 0.0)
        opt_s.step()
        _clear_amp_attrs(opt_s)
        opt_p.step()
    a, b = snapshot(opt_s, scaled), snapshot(opt_p, plain)
    if scale == 1024.0:
        assert_snapshots_equal(a, b)
    else:
        for x, y in zip(a[0], b[0]):
            torch.testing.assert_close(x, y, **FP32)


# =================================================================================
# torch.amp.GradScaler + torch.autocast drive the fused optimizers
# =================================================================================

def linear_model():
    torch.manual_seed(0)
    return nn.Linear(8, 4).to(DEVICE)


def batches(n, rows=6, d_in=8, d_out=4):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, d_in, generator=gen).to(DEVICE),
             torch.randn(rows, d_out, generator=gen).to(DEVICE)) for _ in range(n)]


def mse(out, y):
    return ((out.float() - y) ** 2).mean()


def grad_scaler_run(model, opt, data, factors, clip=None):
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0 ** 10)
    scales = []
    for (x, y), factor in zip(data, factors):
        opt.zero_grad()
        with torch.autocast(DEVICE.type, dtype=torch.float16):
            loss = mse(model(x), y)
        scaler.scale(loss * factor).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("clip", [None, 0.5], ids=["plain", "unscale_-clip"])
@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_grad_scaler_drives_fused_like_torch(kind, clip):
    data = batches(5)
    factors = [1.0, 1.0, INF, 1.0, 1.0]  # an overflow: both skip, the scale halves
    ours, theirs = linear_model(), linear_model()
    if kind == "adam":
        opt = FusedAdam(ours.parameters(), lr=1e-2, weight_decay=0.01)
        ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    else:
        opt = FusedSGD(ours.parameters(), lr=0.1, weight_decay=0.01)
        ref = torch.optim.SGD(theirs.parameters(), lr=0.1, weight_decay=0.01)
    s_ours = grad_scaler_run(ours, opt, data, factors, clip)
    s_ref = grad_scaler_run(theirs, ref, data, factors, clip)
    assert s_ours == s_ref == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, **FP32)
        if kind == "adam":
            assert opt.state[p]["step"].item() == ref.state[q]["step"].item() == 4


# =================================================================================
# tritamp.amp at every opt level
# =================================================================================

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(DEVICE)


def fused_opt(kind, params, **kw):
    if kind == "adam":
        return FusedAdam(params, lr=kw.pop("lr", 1e-2), **kw)
    return FusedSGD(params, lr=kw.pop("lr", 0.05), **kw)


def amp_step(model, opt, x, y, factor=1.0, clip=None):
    opt.zero_grad()
    loss = mse(model(x), y)
    with amp.scale_loss(loss * factor, opt) as scaled:
        scaled.backward()
    if clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), clip)
    opt.step()
    return loss.detach() if clip is None else norm


def loss_scale():
    return amp.state_dict()["loss_scaler0"]["loss_scale"]


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("half", HALVES, ids=HALF_IDS)
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_amp_trains(level, half, kind):
    model = mlp()
    opt = fused_opt(kind, model.parameters(), **({"momentum": 0.9} if kind == "sgd" else {}))
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0)
    (x, y), = batches(1, rows=8)
    losses = [amp_step(model, opt, x, y).item() for _ in range(5)]
    with torch.no_grad():
        final = mse(model(x), y).item()
    assert all(l == l for l in losses), losses
    assert final < 0.8 * losses[0], losses + [final]
    for p in model.parameters():
        assert torch.isfinite(p).all()


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("half", HALVES, ids=HALF_IDS)
def test_o2_fused_reads_half_grads_and_writes_half_params(half, kind):
    model = mlp()
    opt = fused_opt(kind, model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=half, verbosity=0)
    # (the groups, not amp.master_params: read before the first backward, that makes
    # every exit unscale into the masters' gradients)
    masters = [m for g in opt.param_groups for m in g["params"]]
    halves = list(model.parameters())
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(h.dtype == half for h in halves)
    for x, y in batches(3):
        before = [m.detach().clone() for m in masters]
        opt.zero_grad()
        with amp.scale_loss(mse(model(x), y), opt) as scaled:
            scaled.backward()
        # the fused step reads the (still scaled) half gradients itself
        assert all(m.grad is None for m in masters)
        assert all(h.grad is not None and h.grad.dtype == half for h in halves)
        opt.step()
        assert all(m.grad is None for m in masters)
        for i, (m, h) in enumerate(zip(masters, halves)):
            assert torch.equal(h.detach(), m.detach().to(half)), f"param {i} != master.to(half)"
        assert any(not torch.equal(m, b) for m, b in zip(masters, before))


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("level,half,extra", [
    ("O1", torch.float16, {}),
    ("O2", torch.float16, {}),
    ("O2", torch.bfloat16, dict(loss_scale="dynamic")),
], ids=["O1-fp16", "O2-fp16", "O2-bf16-dynamic"])
def test_amp_overflow_skips_bitwise_and_halves_scale(level, half, extra, kind):
    model = mlp()
    opt = fused_opt(kind, model.parameters(), **({"momentum": 0.9} if kind == "sgd" else {}))
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0,
                                **extra)
    data = batches(3)
    for x, y in data[:2]:
        amp_step(model, opt, x, y)
    masters = list(amp.master_params(opt))
    before_model = [p.detach().clone() for p in model.parameters()]
    before = snapshot(opt, masters)
    scale = loss_scale()
    x, y = data[2]
    amp_step(model, opt, x, y, factor=INF)
    assert loss_scale() == scale / 2
    assert_snapshots_equal(snapshot(opt, masters), before)
    for p, b in zip(model.parameters(), before_model):
        assert torch.equal(p.detach(), b)
    if kind == "adam":
        assert all(opt.state[m]["step"].item() == 2.0 for m in masters)


@pytest.mark.parametrize("half", HALVES, ids=HALF_IDS)
def test_o2_fused_adam_matches_o2_torch_fused_adamw(half):
    data = batches(5)
    runs = []
    for make in (lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
                 lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, fused=True)):
        model = mlp()
        model, opt = amp.initialize(model, make(model.parameters()), opt_level="O2",
                                    half_dtype=half, verbosity=0)
        for x, y in data:
            amp_step(model, opt, x, y)
        runs.append(([m.detach().clone() for m in amp.master_params(opt)],
                     [p.detach().clone() for p in model.parameters()], opt))
    (m_ours, h_ours, opt), (m_ref, h_ref, ref) = runs
    for a, b in zip(m_ours, m_ref):
        torch.testing.assert_close(a, b, **FP32)
    for a, b in zip(h_ours, h_ref):
        torch.testing.assert_close(a, b, **TOL[half])
    for a, b in zip(opt.state.values(), ref.state.values()):
        assert a["step"].item() == b["step"].item() == 5


def test_o2_clipping_with_fused_sgd_matches_torch_sgd():
    """clip_grad_norm_(amp.master_params(opt)) after scale_loss: master_params materialises
    unscaled fp32 master gradients; the clipped fused step follows torch SGD at O2."""
    data = batches(4)
    runs = []
    for make in (lambda ps: FusedSGD(ps, lr=0.1, weight_decay=1e-3),
                 lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=1e-3)):
        model = mlp()
        model, opt = amp.initialize(model, make(model.parameters()), opt_level="O2",
                                    verbosity=0)
        norms = []
        for x, y in data:
            opt.zero_grad()
            with amp.scale_loss(mse(model(x), y), opt) as scaled:
                scaled.backward()
            masters = list(amp.master_params(opt))
            assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in masters)
            # the master gradients are unscaled: the half gradients / the loss scale
            scale = loss_scale()
            for m, h in zip(masters, model.parameters()):
                torch.testing.assert_close(m.grad, h.grad.float() / scale, rtol=1e-6, atol=0)
            norms.append(float(torch.nn.utils.clip_grad_norm_(masters, 0.05)))
            opt.step()
        runs.append(([m.detach().clone() for m in amp.master_params(opt)], norms))
    (m_ours, n_ours), (m_ref, n_ref) = runs
    assert all(n > 0.05 for n in n_ours), n_ours  # clipping did something
    assert n_ours == pytest.approx(n_ref, rel=1e-5)
    for a, b in zip(m_ours, m_ref):
        torch.testing.assert_close(a, b, **FP32)


# =================================================================================
# state_dict
# =================================================================================

def _run(params, opt, grads):
    for g in grads:
        set_grads(params, g)
        opt.step()


def _round_trip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_fused_adam_state_dict_loads_into_torch_adamw():
    # torch.optim.AdamW's load_state_dict takes the hyperparameters from the saved groups; a
    # FusedAdam group says decoupled_weight_decay (adam_w_mode), so the decay carries over
    grads = make_grads()
    ours, theirs = make_params(), make_params()
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.05)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.05)
    _run(ours, opt, grads[:2])
    sd = _round_trip(opt.state_dict())
    assert all(g["decoupled_weight_decay"] is True for g in sd["param_groups"])
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in sd["state"].values())
    with torch.no_grad():
        for p, q in zip(ours, theirs):
            q.copy_(p)
    ref.load_state_dict(sd)
    _run(ours, opt, grads[2:])
    _run(theirs, ref, grads[2:])
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, **FP32)
        assert opt.state[p]["step"].item() == ref.state[q]["step"].item() == N_STEPS


def test_torch_adamw_state_dict_loads_into_fused_adam():
    grads = make_grads()
    ours, theirs = make_params(), make_params()
    opt = FusedAdam(ours, lr=1e-2)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.0)
    _run(theirs, ref, grads[:2])
    with torch.no_grad():
        for p, q in zip(ours, theirs):
            p.copy_(q)
    opt.load_state_dict(_round_trip(ref.state_dict()))
    _run(ours, opt, grads[2:])
    _run(theirs, ref, grads[2:])
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, **FP32)


RESUME_CASES = {
    "adam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
    "adam-l2-nobc": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01, adam_w_mode=False,
                                         bias_correction=False),
    "adam-capturable": lambda ps: FusedAdam(ps, lr=1e-2, capturable=True),
    "sgd-momentum": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd-plain": lambda ps: FusedSGD(ps, lr=0.1),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_save_load_keep_stepping_is_bitwise(case):
    grads = make_grads(n=6)
    ours = make_params()
    opt = RESUME_CASES[case](ours)
    _run(ours, opt, grads[:3])
    copy_params = twin(ours)
    resumed = RESUME_CASES[case](copy_params)
    resumed.load_state_dict(_round_trip(opt.state_dict()))
    _run(ours, opt, grads[3:])
    _run(copy_params, resumed, grads[3:])
    assert_snapshots_equal(snapshot(resumed, copy_params), snapshot(opt, ours))




@pytest.mark.parametrize("case", ["adam-master-fp16", "adam-master-bf16", "adam-fp16",
                                  "sgd-momentum-bf16"])
def test_half_params_state_survives_round_trip_bitwise(case):
    dtype = torch.float16 if case.endswith("fp16") else torch.bfloat16
    if case.startswith("adam"):
        def make(ps):
            return FusedAdam(ps, lr=1e-2, master_weights="master" in case)
    else:
        def make(ps):
            return FusedSGD(ps, lr=0.1, momentum=0.9)
    grads = make_grads(n=4, dtype=dtype)
    halves = make_params(dtype=dtype)
    opt = make(halves)
    _run(halves, opt, grads[:2])
    copy_params = twin(halves)
    resumed = make(copy_params)
    resumed.load_state_dict(_round_trip(opt.state_dict()))
    for p, q in zip(halves, copy_params):
        for k, v in opt.state[p].items():
            assert resumed.state[q][k].dtype == v.dtype, k
            assert torch.equal(resumed.state[q][k], v), f"state[{k!r}] not restored bitwise"
    _run(halves, opt, grads[2:])
    _run(copy_params, resumed, grads[2:])
    assert_snapshots_equal(snapshot(resumed, copy_params), snapshot(opt, halves))


# =================================================================================
# capturable, zero_grad
# =================================================================================

@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_capturable_lr_is_a_tensor_and_steps_like_float_lr(wd):
    grads = make_grads(n=4)
    cap, plain = make_params(), make_params()
    opt_c = FusedAdam(cap, lr=1e-2, weight_decay=wd, capturable=True)
    opt_p = FusedAdam(plain, lr=1e-2, weight_decay=wd)
    lr = opt_c.param_groups[0]["lr"]
    assert torch.is_tensor(lr) and lr.dtype == torch.float32 and lr.device == cap[0].device
    _run(cap, opt_c, grads[:3])
    _run(plain, opt_p, grads[:3])
    if wd == 0.0:  # the same fp32 lr in the same arithmetic
        assert_snapshots_equal(snapshot(opt_c, cap), snapshot(opt_p, plain))
    else:  # 1 - lr * wd is rounded on the host for a float lr, on the device for a tensor
        for p, q in zip(cap, plain):
            torch.testing.assert_close(p, q, **FP32)
    # the lr tensor is read at every step: changing it in place changes the step
    lr.fill_(0.05)
    opt_p.param_groups[0]["lr"] = 0.05
    _run(cap, opt_c, grads[3:])
    _run(plain, opt_p, grads[3:])
    for p, q in zip(cap, plain):
        torch.testing.assert_close(p, q, **FP32)
    lr.fill_(0.0)
    before = [p.detach().clone() for p in cap]
    steps = [opt_c.state[p]["step"].item() for p in cap]
    _run(cap, opt_c, grads[:1])
    for p, b, s in zip(cap, before, steps):
        assert torch.equal(p.detach(), b)  # lr 0: no decay, no update
        assert opt_c.state[p]["step"].item() == s + 1


def test_capturable_with_a_per_group_float_lr():
    a, b = make_params((5, 7))
    opt = FusedAdam([{"params": [a], "lr": 0.1}, {"params": [b]}], lr=1e-2, capturable=True)
    assert [float(g["lr"]) for g in opt.param_groups] == pytest.approx([0.1, 1e-2])
    assert all(torch.is_tensor(g["lr"]) for g in opt.param_groups)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt.step()


def test_zero_grad_defaults_follow_apex():
    a, b = make_params((3,)), make_params((3,))
    opt_a, opt_s = FusedAdam(a, lr=1e-3), FusedSGD(b, lr=0.1)
    assert opt_a.set_grad_none is True and opt_s.set_grad_none is False
    for p in a + b:
        p.grad = torch.ones_like(p)
    grad_b = b[0].grad
    opt_a.zero_grad()
    opt_s.zero_grad()
    assert a[0].grad is None
    assert b[0].grad is grad_b and torch.equal(grad_b, torch.zeros_like(grad_b))
    opt_s.zero_grad(set_to_none=True)
    assert b[0].grad is None
    opt_n = FusedAdam(a, lr=1e-3, set_grad_none=False)
    a[0].grad = torch.ones_like(a[0])
    opt_n.zero_grad()
    assert torch.equal(a[0].grad, torch.zeros_like(a[0]))


def test_fused_sgd_accepts_apex_materialize_master_grads_keyword():
    # Apex's keyword stays accepted (either value) and changes nothing on the fused path
    runs = []
    for flag in (True, False):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(6))
        opt = FusedSGD([p], lr=0.1, momentum=0.9, materialize_master_grads=flag)
        for k in range(2):
            p.grad = torch.full_like(p, 0.5 + k)
            opt.step()
        runs.append(p.detach().clone())
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("path", ["kernel", "cpu"])
@pytest.mark.parametrize("how", ["load_state_dict", "no_grad copy_", "new storage"])
def test_master_weights_follow_weights_written_between_steps(path, how):
    """master_weights=True: weights written into a bf16 parameter after steps (a best
    checkpoint restored, EMA weights copied in) were overwritten by the stale fp32 master
    at the next step (the weight went back to where training had taken it). The master
    now takes the written value first: the step goes on from 5.0."""
    import contextlib
    from tritamp.testing import force_cpu_path
    with force_cpu_path() if path == "cpu" else contextlib.nullcontext():
        model = nn.Linear(4, 1, bias=False).to(torch.bfloat16)
        opt = FusedAdam(model.parameters(), lr=0.01, master_weights=True)
        for _ in range(2):
            model.weight.grad = torch.ones_like(model.weight)
            opt.step()
        new = torch.full((1, 4), 5.0, dtype=torch.bfloat16)
        if how == "load_state_dict":
            model.load_state_dict({"weight": new})
        elif how == "no_grad copy_":
            with torch.no_grad():
                model.weight.copy_(new)
        else:
            model.weight.data = new.clone()
        model.weight.grad = torch.ones_like(model.weight)
        opt.step()
        master = opt.state[model.weight]["master_param"]
        torch.testing.assert_close(master, torch.full((1, 4), 4.99), rtol=0, atol=1e-6)
        # a step without a write in between: the master is not taken from the weight
        # again (the bf16 weight holds 5.0, the master 4.99 - 0.01)
        model.weight.grad = torch.ones_like(model.weight)
        opt.step()
        torch.testing.assert_close(master, torch.full((1, 4), 4.98), rtol=0, atol=1e-5)
