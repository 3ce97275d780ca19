"""tritamp.parallel.LARC against Apex's LARC algorithm, written out in float64 per
parameter, around torch's SGD and tritamp's FusedSGD; the wrapper's proxying contract."""
import pickle

import pytest
import torch

from conftest import TOL
from tritamp.optimizers import FusedSGD
from tritamp.parallel import LARC

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (7,), (2, 2, 3), (4,)]
    ps = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(DEVICE)) for s in shapes]
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(DEVICE)
    with torch.no_grad():
        ps[3].zero_()              # ||p|| = 0: LARC leaves its gradient alone
    ps[1].grad.zero_()             # ||g|| = 0: likewise
    return ps


def _apex_step(params, grads, lr, weight_decay, trust, clip, eps):
    """Apex's LARC.step followed by plain SGD, in float64, one parameter at a time."""
    out = []
    for p, g in zip(params, grads):
        p, g = p.double(), g.double()
        pn, gn = p.norm().item(), g.norm().item()
        if pn != 0 and gn != 0:
            adaptive = trust * pn / (gn + pn * weight_decay + eps)
            if clip:
                adaptive = min(adaptive / lr, 1.0)
            g = (g + weight_decay * p) * adaptive
        out.append(p - lr * g)
    return out


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("inner", ["sgd", "fused_sgd"])
def test_step_matches_apex_larc(clip, weight_decay, inner):
    params = _params()
    before = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    lr = 0.5
    make = torch.optim.SGD if inner == "sgd" else FusedSGD
    opt = LARC(make(params, lr=lr, weight_decay=weight_decay), trust_coefficient=0.02,
               clip=clip)
    opt.step()
    expect = _apex_step(before, grads, lr, weight_decay, 0.02, clip, 1e-8)
    for p, e in zip(params, expect):
        torch.testing.assert_close(p.detach(), e.float(), **TOL[torch.float32])
    assert opt.param_groups[0]["weight_decay"] == weight_decay  # handed back after the step
    # zero weights: the plain gradient step (no rate, no decay); zero gradient: no decay
    torch.testing.assert_close(params[3].detach(), -lr * grads[3], **TOL[torch.float32])
    assert torch.equal(params[1].detach(), before[1])


def test_clip_caps_the_rate_at_the_optimizers_lr():
    """With a tiny lr the local rate exceeds it: clip=True then uses lr itself."""
    params = _params(1)
    before = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    LARC(torch.optim.SGD(params, lr=1e-4), clip=True).step()
    for p, b, g in zip(params, before, grads):
        torch.testing.assert_close(p.detach(), b - 1e-4 * g, **TOL[torch.float32])


def test_parameters_without_gradients_and_several_groups():
    a, b = _params(2)[:2]
    c = torch.nn.Parameter(torch.ones(3, device=DEVICE))
    b.grad = None
    opt = LARC(torch.optim.SGD([{"params": [a, b]}, {"params": [c], "lr": 0.1}], lr=0.3,
                               momentum=0.9))
    a0, b0 = a.detach().clone(), b.detach().clone()
    c.grad = torch.full((3,), 2.0, device=DEVICE)
    opt.step()
    assert torch.equal(b.detach(), b0)
    assert not torch.equal(a.detach(), a0)
    # c: ||p|| = sqrt(3), ||g|| = 2 sqrt(3): local lr = 0.02 / 2 = 0.01 < 0.1, so the step
    # is 0.01 * g
    torch.testing.assert_close(c.detach(), torch.full((3,), 1.0 - 0.01 * 2.0, device=DEVICE),
                               **TOL[torch.float32])


def test_wrapper_proxies_the_optimizer(monkeypatch):
    params = _params(3)
    inner = torch.optim.SGD(params[:2], lr=0.1, momentum=0.9)
    opt = LARC(inner, trust_coefficient=0.01, clip=False, eps=1e-6)
    assert opt.optim is inner
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    assert opt.defaults is inner.defaults
    assert repr(opt) == repr(inner)
    opt.add_param_group({"params": params[2:]})
    assert len(inner.param_groups) == 2
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"] == inner.state_dict()["param_groups"]
    assert len(sd["state"]) == 4  # momentum buffers: every parameter had a gradient
    others = _params(4)
    fresh = LARC(torch.optim.SGD(others[:2], lr=0.1, momentum=0.9))
    fresh.add_param_group({"params": others[2:]})
    fresh.load_state_dict(sd)
    assert fresh.state_dict()["state"].keys() == sd["state"].keys()
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    groups = [dict(g) for g in opt.param_groups]
    opt.param_groups = groups
    assert inner.param_groups is groups
    restored = pickle.loads(pickle.dumps(opt))
    assert isinstance(restored, LARC) and restored.optim.defaults["lr"] == 0.1


def test_step_makes_no_host_sync(monkeypatch):
    params = _params(5)
    opt = LARC(torch.optim.SGD(params, lr=0.1, weight_decay=1e-4))

    def refuse(*args, **kwargs):
        raise AssertionError("LARC.step read a device value on the host")

    monkeypatch.setattr(torch.Tensor, "item", refuse)
    monkeypatch.setattr(torch.Tensor, "__bool__", refuse)
    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    opt.step()


def test_closure_is_passed_on():
    params = _params(6)
    opt = LARC(torch.optim.SGD(params, lr=0.1))
    assert opt.step(lambda: torch.tensor(3.0)).item() == 3.0


def test_bad_arguments():
    params = _params(7)
    with pytest.raises(TypeError, match="wraps an optimizer"):
        LARC(params)
    with pytest.raises(ValueError, match="trust_coefficient"):
        LARC(torch.optim.SGD(params, lr=0.1), trust_coefficient=0.0)
    with pytest.raises(ValueError, match="already wrapped"):
        LARC(LARC(torch.optim.SGD(params, lr=0.1)))
