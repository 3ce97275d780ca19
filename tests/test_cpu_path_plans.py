"""The production CPU path keeps one validated plan per parameter group: on a CPU a
gradient's address changes every step, and the plan takes this step's gradients
(rebind) instead of being re-prepared; it holds no gradient between steps."""
import gc
import weakref

import pytest
import torch
import torch.nn as nn

from tritamp.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from tritamp.testing import plans_of, stash_of


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _backward(model, scale=1.0):
    x = torch.randn(5, 8)
    (model(x).square().mean() * scale).backward()


@pytest.mark.parametrize("make", [lambda p: FusedAdam(p, lr=1e-2),
                                  lambda p: FusedSGD(p, lr=1e-2, momentum=0.9)],
                         ids=["adam", "sgd"])
def test_moving_gradients_rebind_one_plan(cpu_path, make):
    model = _model()
    opt = make(model.parameters())
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        _backward(model)
        opt.step()
    (cache,) = plans_of(opt).values()
    assert cache.builds == 1
    assert cache.prepared.triton is False


def test_the_kept_plan_holds_no_gradient_between_steps(cpu_path):
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    _backward(model)
    opt.step()
    grad = weakref.ref(model[0].weight.grad)
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert grad() is None


ALL = {
    "adam": lambda p: FusedAdam(p, lr=1e-2),
    "sgd": lambda p: FusedSGD(p, lr=1e-2, momentum=0.9),
    "adagrad": lambda p: FusedAdagrad(p, lr=1e-2),
    "lamb": lambda p: FusedLAMB(p, lr=1e-2),
    "novograd": lambda p: FusedNovoGrad(p, lr=1e-2),
}


@pytest.mark.parametrize("name", ALL)
def test_rebound_steps_match_fresh_plans(cpu_path, name):
    """Steps through one rebound plan equal steps through plans built anew each step
    (LAMB: its global gradient norm follows the rebound gradients too)."""
    a, b = _model(), _model()
    opt_a = ALL[name](a.parameters())
    opt_b = ALL[name](b.parameters())
    for step in range(3):
        for model, opt in ((a, opt_a), (b, opt_b)):
            torch.manual_seed(step)
            opt.zero_grad(set_to_none=True)
            _backward(model)
        opt_b._plans.clear()  # b re-prepares every step
        opt_b.__dict__.pop("_norm_plan", None)
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    (cache,) = opt_a._plans.values()
    assert cache.builds == 1


def test_a_gradient_with_other_strides_is_re_prepared(cpu_path):
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    _backward(model)
    opt.step()
    w = model[0].weight
    before = w.detach().clone()
    opt.zero_grad(set_to_none=True)
    _backward(model)
    g = w.grad
    w.grad = g.t().contiguous().t()  # same values, column-major
    assert w.grad.stride() != w.stride()
    opt.step()
    (cache,) = plans_of(opt).values()
    assert cache.builds == 2
    assert not torch.equal(before, w.detach())


@pytest.mark.parametrize("level,sweep", [("O2", "check"), ("O1", "unscale_own")])
def test_amp_check_is_rebound_and_still_catches_an_overflow(cpu_path, level, sweep):
    """A dynamic scale on the CPU path: the read-only check of O2's half gradients, or
    O1's unscale of the parameters' own gradients in place, is prepared once, takes each
    step's gradients (holding none between steps), and an overflow is still seen."""
    from tritamp import amp
    model = _model()
    model, opt = amp.initialize(model, FusedAdam(model.parameters(), lr=1e-2),
                                opt_level=level, half_dtype=torch.bfloat16, loss_scale="dynamic",
                                verbosity=0)
    x = torch.randn(5, 8)
    for factor in (1.0, 1.0, float("inf"), 1.0):
        opt.zero_grad(set_to_none=True)
        # (the groups, not amp.master_params: read before the first backward, that makes
        # every exit unscale into the masters' gradients, and no check sweep is kept)
        before = [m.detach().clone() for g in opt.param_groups for m in g["params"]]
        with amp.scale_loss(model(x).float().square().mean() * factor, opt) as scaled:
            scaled.backward()
        grad = weakref.ref(model[0].weight.grad)
        opt.step()
        after = list(amp.master_params(opt))
        changed = any(not torch.equal(b, a) for b, a in zip(before, after))
        assert changed == (factor == 1.0)
    cache = stash_of(opt)._sweeps[sweep]
    assert cache.builds == 1
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert grad() is None
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0 ** 15


def test_step_counts_share_one_buffer_and_advance_in_one_op(cpu_path):
    """The CPU path re-homes a group's step counts into one buffer (same tensor objects,
    same values): one in-place add advances them all, and a checkpoint keeps them."""
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        _backward(model)
        opt.step()
    steps = [opt.state[p]["step"] for p in model.parameters()]
    assert all(s.item() == 3.0 and s.dim() == 0 for s in steps)
    base = steps[0].untyped_storage().data_ptr()
    assert all(s.untyped_storage().data_ptr() == base for s in steps)
    (cache,) = plans_of(opt).values()
    (group,) = cache.prepared.cpu_groups
    assert len(group.counted("steps")) == 1
    # a checkpoint of views restores independent counts that keep advancing
    import copy
    other = FusedAdam(_model().parameters(), lr=1e-2)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    steps[0].add_(10.0)
    assert all(other.state[p]["step"].item() == 3.0 for p in other.state)


def test_bad_input_on_the_cpu_path_is_refused_before_anything_changes(cpu_path):
    """The engine's validation runs before the CPU path writes: a gradient of the wrong
    shape is refused naming the list and the index, and no tensor changes."""
    from tritamp.kernels.adam import adam_step
    params = [torch.randn(4, 3), torch.randn(5)]
    grads = [torch.randn(4, 3), torch.randn(6)]  # the second has the wrong shape
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.zeros(()), torch.zeros(())]
    every = params + grads + m + v + steps
    before = [t.clone() for t in every]
    with pytest.raises(ValueError, match=r"grads\[1\] has shape"):
        adam_step(params, grads, m, v, steps, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                  weight_decay=0.0)
    assert all(torch.equal(b, t) for b, t in zip(before, every))
