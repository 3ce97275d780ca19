"""FusedAdagrad and its kernel: the kernel against adagrad_step_ref bit for bit, N steps
against torch.optim.Adagrad (and a plain-torch decoupled-decay reference), master weights
in fp16/bf16, the skipped overflow step, state dicts both ways, bad hyperparameters.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py): tensors stay
small, steps few.
"""
import copy
import importlib
import io
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import TOL
from tritamp import amp
from tritamp.kernels.adagrad import adagrad_step, adagrad_step_ref
from tritamp.optimizers.fused_adagrad import FusedAdagrad

ag_mod = importlib.import_module("tritamp.kernels.adagrad")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# On the GPU Triton contracts a * b + c into an FMA; the interpreter and torch never do.
EXACT_FMA_FREE = DEVICE.type == "cpu"
SHAPES = ((1,), (7,), (257,), (3, 257), (4097,))  # the last spans two 4096-programs
HALVES = (torch.float16, torch.bfloat16)
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
HYPOTHESIS = dict(deadline=None, max_examples=20,
                  suppress_health_check=[HealthCheck.too_slow])


def assert_bitwise(actual, expected, what="tensor"):
    """Equal bit for bit, except that any NaN equals any NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    a, e = actual.detach().reshape(-1).cpu(), expected.detach().reshape(-1).cpu()
    an, en = torch.isnan(a), torch.isnan(e)
    bits = _BITS[a.dtype]
    bad = (an != en) | (~an & (a.view(bits) != e.view(bits)))
    assert not bad.any(), f"{what}: {int(bad.sum())} of {a.numel()} elements differ"


def make_params(shapes=SHAPES, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen).to(device=DEVICE, dtype=dtype))
            for s in shapes]


def clone_params(params, dtype=None):
    return [nn.Parameter(p.detach().clone().to(dtype or p.dtype)) for p in params]


def grads_for(params, step, dtype=None, scale=1.0):
    gen = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=gen) * scale).to(device=DEVICE,
                                                            dtype=dtype or p.dtype)
            for p in params]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()


def scalar(v):
    return torch.tensor(v, dtype=torch.float32, device=DEVICE)


# --------------------------------------------------------------------------------------
# the kernel against its reference
# --------------------------------------------------------------------------------------

@settings(**HYPOTHESIS)
@given(data=st.data(), w_mode=st.booleans(), wd=st.sampled_from((0.0, 0.01, 0.5)),
       lr=st.sampled_from((0.1, 1e-3)), lr_tensor=st.booleans(),
       scale=st.sampled_from((None, 1.0, 65536.0, 3.0)),
       found=st.sampled_from((None, 0.0, 1.0)),
       kind=st.sampled_from(("fp32", "master-fp16", "master-bf16", "fp16", "bf16")))
def test_kernel_matches_reference_bitwise(data, w_mode, wd, lr, lr_tensor, scale, found, kind):
    n = data.draw(st.integers(1, 3))
    shapes = data.draw(st.lists(st.sampled_from(SHAPES), min_size=n, max_size=n))
    seed = data.draw(st.integers(0, 2 ** 31 - 1))
    gen = torch.Generator().manual_seed(seed)
    half = {"master-fp16": torch.float16, "master-bf16": torch.bfloat16,
            "fp16": torch.float16, "bf16": torch.bfloat16}.get(kind)
    p_dtype = half if kind in ("fp16", "bf16") else torch.float32
    g_dtype = half or torch.float32
    # small weights let the update's own rounding show in the result
    magnitude = data.draw(st.sampled_from((1.0, 1e-4)))
    params = [(torch.randn(s, generator=gen) * magnitude).to(p_dtype) for s in shapes]
    grads = [(torch.randn(s, generator=gen) * (scale or 1.0)).to(g_dtype) for s in shapes]
    sums = [torch.rand(s, generator=gen) for s in shapes]
    plants = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.floats(0, 1, exclude_max=True),
                                          st.sampled_from((math.inf, -math.inf, math.nan, -0.0))),
                                max_size=2))
    for i, where, value in plants:
        grads[i].view(-1)[int(where * grads[i].numel())] = value
    copies = [p.to(half) for p in params] if kind.startswith("master") else None
    steps = [torch.full((), 3.0) for _ in shapes]
    to_dev = lambda ts: None if ts is None else [t.to(DEVICE, copy=True) for t in ts]  # noqa: E731
    ours = [to_dev(x) for x in (params, sums, copies, steps)]
    ref = [to_dev(x) for x in (params, sums, copies, steps)]
    grads = to_dev(grads)
    kw = dict(lr=scalar(lr) if lr_tensor else lr, eps=1e-10, weight_decay=wd,
              adagrad_w_mode=w_mode, grad_scale=None if scale is None else scalar(scale),
              found_inf=None if found is None else scalar(found))
    adagrad_step(ours[0], grads, ours[1], ours[2], steps=ours[3], **kw)
    adagrad_step_ref(ref[0], grads, ref[1], ref[2], steps=ref[3], **kw)
    for name, a_list, e_list in zip(("param", "sum", "copy", "step"), ours, ref):
        for i, (a, e) in enumerate(zip(a_list or [], e_list or [])):
            if EXACT_FMA_FREE or name == "step":
                assert_bitwise(a, e, f"{name} {i}")
            else:
                torch.testing.assert_close(a, e, equal_nan=True, **TOL[a.dtype])
    if found == 1.0:
        for a, e in zip(ours[0], to_dev(params)):
            assert_bitwise(a, e, "skipped param")
        assert all(s.item() == 3.0 for s in ours[3])
    else:
        assert all(s.item() == 4.0 for s in ours[3])


@pytest.mark.skipif(not ag_mod.use_triton(torch.zeros(1, device=DEVICE)),
                    reason="no GPU and no interpreter: the torch reference runs")
def test_one_launch_per_dtype_group(count_launches):
    counter = count_launches(ag_mod, "_adagrad_step_kernel")
    params = make_params(((5,), (4097,), (1,))) + make_params(((9,),), torch.float16)
    opt = FusedAdagrad(params, lr=0.1)
    set_grads(params, grads_for(params, 0))
    opt.step()
    assert sorted(g[0] for g in counter.grids) == [1, 4]


# --------------------------------------------------------------------------------------
# the optimizer against torch
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_matches_torch_adagrad_fp32(wd):
    ours, theirs = make_params(), make_params()
    o1 = FusedAdagrad(ours, lr=0.1, weight_decay=wd)
    o2 = torch.optim.Adagrad(theirs, lr=0.1, weight_decay=wd)
    for step in range(5):
        set_grads(ours, grads_for(ours, step))
        set_grads(theirs, grads_for(theirs, step))
        o1.step()
        o2.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
        torch.testing.assert_close(o1.state[a]["sum"], o2.state[b]["sum"], **TOL[torch.float32])
        assert o1.state[a]["step"].item() == o2.state[b]["step"].item() == 5


def decoupled_reference(params, grads_per_step, lr, eps, wd):
    """Apex's adagrad_w_mode in plain torch, fp64."""
    ps = [p.detach().double().clone() for p in params]
    hs = [torch.zeros_like(p) for p in ps]
    for grads in grads_per_step:
        for p, h, g in zip(ps, hs, grads):
            g = g.double()
            h += g * g
            p -= lr * (g / (h.sqrt() + eps) + wd * p)
    return ps


def test_adagrad_w_mode_matches_decoupled_reference():
    params = make_params()
    start = clone_params(params)
    opt = FusedAdagrad(params, lr=0.05, weight_decay=0.1, adagrad_w_mode=True)
    history = []
    for step in range(5):
        grads = grads_for(params, step)
        history.append(grads)
        set_grads(params, grads)
        opt.step()
    expected = decoupled_reference(start, history, 0.05, 1e-10, 0.1)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p, e.float(), **TOL[torch.float32])
    # and it is not the L2 rule
    l2 = make_params()
    l2_opt = torch.optim.Adagrad(l2, lr=0.05, weight_decay=0.1)
    for grads in history:
        set_grads(l2, grads)
        l2_opt.step()
    assert not torch.allclose(params[2], l2[2], **TOL[torch.float32])


@pytest.mark.parametrize("half", HALVES)
def test_master_weights_in_half_precision(half):
    ours = make_params(dtype=half)
    masters = clone_params(ours, torch.float32)
    o1 = FusedAdagrad(ours, lr=0.05, weight_decay=0.01, master_weights=True)
    o2 = torch.optim.Adagrad(masters, lr=0.05, weight_decay=0.01)
    for step in range(4):
        grads = grads_for(ours, step, dtype=half, scale=1024.0)
        set_grads(ours, grads)
        o1.grad_scale = scalar(1024.0)  # a power of two: unscaling is exact
        o1.found_inf = scalar(0.0)
        o1.step()
        set_grads(masters, [g.float() / 1024.0 for g in grads])
        o2.step()
    for p, m in zip(ours, masters):
        master = o1.state[p]["master_param"]
        assert master.dtype == torch.float32 and o1.state[p]["sum"].dtype == torch.float32
        torch.testing.assert_close(master, m, **TOL[torch.float32])
        assert_bitwise(p.detach(), master.to(half), "half copy of the master")
        torch.testing.assert_close(p.detach(), m.detach().to(half), **TOL[half])


def test_overflow_step_changes_nothing_bitwise():
    params = make_params(dtype=torch.float16)
    opt = FusedAdagrad(params, lr=0.1, master_weights=True)
    set_grads(params, grads_for(params, 0))
    opt.step()
    snap = {id(p): [p.detach().clone()] + [opt.state[p][k].clone()
                                           for k in ("master_param", "sum", "step")]
            for p in params}
    grads = grads_for(params, 1, scale=8.0)
    grads[1].view(-1)[3] = math.inf
    set_grads(params, grads)
    opt.grad_scale, opt.found_inf = scalar(8.0), scalar(1.0)
    opt.step()
    for p in params:
        now = [p.detach()] + [opt.state[p][k] for k in ("master_param", "sum", "step")]
        for name, a, e in zip(("param", "master", "sum", "step"), now, snap[id(p)]):
            assert_bitwise(a, e, name)
    opt.found_inf = scalar(0.0)
    grads[1].view(-1)[3] = 1.0
    set_grads(params, grads)
    opt.step()
    assert all(opt.state[p]["step"].item() == 2 for p in params)
    assert not torch.equal(params[0].detach(), snap[id(params[0])][0])


def test_step_makes_no_host_read(monkeypatch):
    params = make_params(((7,), (300,)), dtype=torch.bfloat16)
    opt = FusedAdagrad(params, lr=0.1, master_weights=True, adagrad_w_mode=True,
                       weight_decay=0.01)
    set_grads(params, grads_for(params, 0))
    opt.grad_scale, opt.found_inf = scalar(4.0), scalar(0.0)

    def host_read(*args, **kwargs):
        raise AssertionError("FusedAdagrad.step read a tensor value on the host")
    with monkeypatch.context() as mp:
        for name in ("__bool__", "__float__", "__int__", "item", "tolist"):
            mp.setattr(torch.Tensor, name, host_read)
        opt.step()
        opt.step()


def test_gradscaler_drives_it_like_torch_adagrad():
    """torch.amp.GradScaler with an overflow in step 2: same trajectory as torch's Adagrad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).to(DEVICE)
    ref = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).to(DEVICE)
    ref.load_state_dict(model.state_dict())
    opt = FusedAdagrad(model.parameters(), lr=0.05, weight_decay=0.01)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.05, weight_decay=0.01)
    s1 = torch.amp.GradScaler(DEVICE.type, init_scale=2.0 ** 10)
    s2 = torch.amp.GradScaler(DEVICE.type, init_scale=2.0 ** 10)
    gen = torch.Generator().manual_seed(5)
    for factor in (1.0, math.inf, 1.0, 1.0):
        x = torch.randn(4, 6, generator=gen).to(DEVICE)
        y = torch.randn(4, 2, generator=gen).to(DEVICE)
        for m, o, s in ((model, opt, s1), (ref, ref_opt, s2)):
            o.zero_grad()
            s.scale(((m(x) - y) ** 2).mean() * factor).backward()
            s.step(o)
            s.update()
    assert s1.get_scale() == s2.get_scale() == 2.0 ** 9
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, **TOL[torch.float32])
        assert opt.state[p]["step"].item() == 3  # the overflow step does not count


def test_amp_o2_writes_the_half_model_and_skips_overflow():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).to(DEVICE)
    opt = FusedAdagrad(model.parameters(), lr=0.05)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = torch.randn(5, 8, device=DEVICE), torch.randn(5, 3, device=DEVICE)
    before = None
    for factor in (1.0, math.inf, 1.0):
        if factor != 1.0:
            before = [p.detach().clone() for p in amp.master_params(opt)]
        opt.zero_grad()
        loss = ((model(x).float() - y) ** 2).mean() * factor
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        if factor != 1.0:
            for b, p in zip(before, amp.master_params(opt)):
                assert_bitwise(p.detach(), b, "master after the skipped step")
    masters = list(amp.master_params(opt))
    halves = [p for p in model.parameters()]
    assert all(p.dtype == torch.float16 for p in halves)
    for m, h in zip(masters, halves):
        assert m.dtype == torch.float32
        assert_bitwise(h.detach(), m.detach().half(), "model copy")
        assert opt.state[m]["step"].item() == 2


# --------------------------------------------------------------------------------------
# state dicts
# --------------------------------------------------------------------------------------

def roundtrip(state_dict):
    """Through bytes, as a checkpoint would (torch's load_state_dict aliases tensors)."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf)


def test_state_dict_into_torch_adagrad_and_back():
    ours = make_params()
    o1 = FusedAdagrad(ours, lr=0.1, weight_decay=0.01)
    for step in range(2):
        set_grads(ours, grads_for(ours, step))
        o1.step()
    sd = o1.state_dict()
    assert set(sd["state"][0]) == {"step", "sum"}
    # ours -> torch
    theirs = clone_params(ours)
    o2 = torch.optim.Adagrad(theirs, lr=0.1, weight_decay=0.01)
    o2.load_state_dict(roundtrip(sd))
    for step in range(2, 4):
        for ps, o in ((ours, o1), (theirs, o2)):
            set_grads(ps, grads_for(ps, step))
            o.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
        assert o2.state[b]["step"].item() == 4
    # torch -> ours
    again = clone_params(theirs)
    o3 = FusedAdagrad(again, lr=0.3)
    o3.load_state_dict(roundtrip(o2.state_dict()))
    assert o3.param_groups[0]["lr"] == 0.1
    for ps, o in ((theirs, o2), (again, o3)):
        set_grads(ps, grads_for(ps, 4))
        o.step()
    for a, b in zip(again, theirs):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
        assert o3.state[a]["step"].item() == 5 and o3.state[a]["step"].device == a.device


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_save_load_keep_stepping_is_bitwise(dtype):
    kw = dict(lr=0.05, weight_decay=0.02, adagrad_w_mode=dtype == torch.float16,
              master_weights=dtype != torch.float32)
    ours = make_params(((7,), (300,)), dtype)
    o1 = FusedAdagrad(ours, **kw)
    for step in range(2):
        set_grads(ours, grads_for(ours, step))
        o1.step()
    copy = clone_params(ours)
    o2 = FusedAdagrad(copy, **kw)
    o2.load_state_dict(roundtrip(o1.state_dict()))
    for step in range(2, 5):
        for ps, o in ((ours, o1), (copy, o2)):
            set_grads(ps, grads_for(ps, step))
            o.step()
    for a, b in zip(ours, copy):
        assert_bitwise(a.detach(), b.detach(), "param")
        for k in o1.state[a]:
            assert o2.state[b][k].dtype == o1.state[a][k].dtype
            assert_bitwise(o2.state[b][k], o1.state[a][k], k)


def test_lr_decay_from_torch_state_is_refused():
    theirs = make_params(((3,),))
    o2 = torch.optim.Adagrad(theirs, lr=0.1, lr_decay=0.01)
    ours = clone_params(theirs)
    opt = FusedAdagrad(ours)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="lr_decay"):
        opt.load_state_dict(o2.state_dict())
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"] and after["state"] == {}


@pytest.mark.parametrize("key,value,error", [
    ("initial_accumulator_value", -0.1, ValueError),
    ("initial_accumulator_value", "0.1", TypeError)])
def test_a_bad_initial_accumulator_value_in_a_checkpoint_is_refused_at_load(key, value, error):
    ours = make_params(((3,),))
    opt = FusedAdagrad(ours, lr=0.1)
    set_grads(ours, grads_for(ours, 0))
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(saved)
    bad["param_groups"][0][key] = value
    with pytest.raises(error, match=key):
        opt.load_state_dict(bad)
    assert opt.state_dict()["param_groups"] == saved["param_groups"]


# --------------------------------------------------------------------------------------
# hyperparameters and small contracts
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(lr=-0.1), "learning rate"),
    (dict(eps=-1e-10), "epsilon"),
    (dict(weight_decay=-0.1), "weight_decay"),
])
def test_bad_hyperparameters_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        FusedAdagrad(make_params(((3,),)), **kw)


def test_defaults_and_zero_grad():
    params = make_params(((3,),))
    opt = FusedAdagrad(params)
    g = opt.param_groups[0]
    assert (g["lr"], g["eps"], g["weight_decay"], opt.adagrad_w_mode) == (1e-2, 1e-10, 0.0, 0)
    assert opt._step_supports_amp_scaling
    set_grads(params, grads_for(params, 0))
    opt.zero_grad()
    assert params[0].grad is None
    opt = FusedAdagrad(params, set_grad_none=False)
    set_grads(params, grads_for(params, 0))
    opt.zero_grad()
    assert params[0].grad is not None and not params[0].grad.any()


def test_sparse_gradient_is_refused():
    p = nn.Parameter(torch.zeros(4, device=DEVICE))
    p.grad = torch.zeros(4, device=DEVICE).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        FusedAdagrad([p]).step()
