"""Every fused optimizer on layouts the sweep must not get wrong (interpreter).

Each case either equals the contiguous result to 1e-6 or raises the documented error
with every tensor unchanged: channels-last parameters resumed from contiguous state,
column-major and expanded gradients, strided-view parameters, state of another shape
(same numel or not) loaded from a checkpoint.
"""
import copy

import pytest
import torch

from tritamp.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from tritamp.testing import plans_of

OPTIMIZERS = {
    "adam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
    "sgd": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9),
    "lamb": lambda ps: FusedLAMB(ps, lr=1e-2),
    "adagrad": lambda ps: FusedAdagrad(ps, lr=0.1),
    "novograd": lambda ps: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01),
}


def _grads(shape, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(n)]


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _snapshot(opt, params):
    return ([p.detach().clone() for p in params],
            {k: {n: v.clone() for n, v in st.items() if isinstance(v, torch.Tensor)}
             for k, st in enumerate(opt.state[p] for p in params)})


def _assert_unchanged(before, opt, params):
    for a, p in zip(before[0], params):
        assert torch.equal(a, p.detach())
    for k, p in enumerate(params):
        for n, v in opt.state[p].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(before[1][k][n], v), n


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_channels_last_resumed_from_contiguous_state(name):
    make = OPTIMIZERS[name]
    torch.manual_seed(0)
    w = torch.randn(4, 3, 3, 5)
    g = _grads(w.shape, 3)
    ref = torch.nn.Parameter(w.clone())
    opt_ref = make([ref])
    ref.grad = g[0].clone()
    opt_ref.step()
    saved = copy.deepcopy(opt_ref.state_dict())  # contiguous state
    cl = torch.nn.Parameter(ref.detach().clone().to(memory_format=torch.channels_last))
    opt_cl = make([cl])
    opt_cl.load_state_dict(saved)
    for grad in g[1:]:
        ref.grad = grad.clone()
        cl.grad = grad.clone().to(memory_format=torch.channels_last)  # autograd's layout
        opt_ref.step()
        opt_cl.step()
    assert cl.is_contiguous(memory_format=torch.channels_last)
    _close(cl.detach(), ref.detach())
    for key, value in opt_ref.state[ref].items():
        if isinstance(value, torch.Tensor):
            _close(opt_cl.state[cl][key], value)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("layout", ["column_major", "expanded"])
def test_gradients_with_other_strides_match_contiguous(name, layout):
    make = OPTIMIZERS[name]
    torch.manual_seed(1)
    w = torch.randn(6, 10)
    ref, odd = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    opt_ref, opt_odd = make([ref]), make([odd])
    for step in range(2):
        if layout == "column_major":
            g = torch.randn(6, 10)
            strange = g.t().contiguous().t()
            assert strange.stride() == (1, 6)
        else:
            g = torch.randn(1, 10).expand(6, 10).contiguous()
            strange = g[:1].expand(6, 10)
            assert strange.stride() == (0, 1)
        ref.grad = g.clone()
        odd.grad = strange
        opt_ref.step()
        opt_odd.step()
        _close(odd.detach(), ref.detach())
    assert odd.grad.stride() == strange.stride()  # the user's gradient is left as it was


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_strided_view_parameter_is_refused_and_nothing_changes(name):
    make = OPTIMIZERS[name]
    torch.manual_seed(2)
    base = torch.randn(8, 8)
    first = torch.nn.Parameter(torch.randn(5))
    view = torch.nn.Parameter(base[:, ::2])  # a view: every other column
    assert view.stride() == (8, 2)
    opt = make([first, view])
    first.grad, view.grad = torch.randn(5), torch.randn(8, 4)
    base_before = base.clone()
    before = _snapshot(opt, [first, view])
    with pytest.raises(ValueError, match=r"params\[1\].*strides \(8, 2\).*contiguous"):
        opt.step()
    assert torch.equal(base, base_before)
    _assert_unchanged(before, opt, [first, view])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("other", [(10, 3), (4, 4)], ids=["same_numel", "other_numel"])
def test_state_of_another_shape_is_refused_at_load_and_nothing_changes(name, other):
    make = OPTIMIZERS[name]
    torch.manual_seed(3)
    a, b = torch.nn.Parameter(torch.randn(3, 10)), torch.nn.Parameter(torch.randn(7))
    opt = make([a, b])
    a.grad, b.grad = torch.randn(3, 10), torch.randn(7)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    shaped = [k for k, v in saved["state"][0].items() if isinstance(v, torch.Tensor)
              and v.dim() > 0]
    assert shaped
    for key in shaped:
        saved["state"][0][key] = torch.zeros(other)
    before = _snapshot(opt, [a, b])
    with pytest.raises(ValueError, match=r"parameter 0 has shape .* but the parameter has shape "
                                         r"\(3, 10\)"):
        opt.load_state_dict(saved)
    _assert_unchanged(before, opt, [a, b])
    opt.step()  # still usable


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_plans_are_kept_while_the_tensors_stay_and_rebuilt_when_they_change(name):
    make = OPTIMIZERS[name]
    ps = [torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.randn(16))]
    opt = make(ps)
    grads = [torch.randn(4, 8), torch.randn(16)]
    for p, g in zip(ps, grads):
        p.grad = g
    opt.step()
    opt.step()
    cache = plans_of(opt)[0]
    assert cache.builds == 1
    ps[0].grad = torch.randn(8, 4).t()  # other strides: a new plan
    opt.step()
    assert cache.builds == 2


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_kept_plan_reads_this_steps_values_of_an_odd_layout_gradient(name):
    # The same column-major gradient tensor, rewritten in place between steps: the plan is
    # kept (same address and strides), and its dense copy must be refreshed every launch.
    make = OPTIMIZERS[name]
    torch.manual_seed(4)
    w = torch.randn(6, 10)
    ref, odd = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    opt_ref, opt_odd = make([ref]), make([odd])
    strange = torch.empty(10, 6).t()
    odd.grad = strange
    for _ in range(3):
        g = torch.randn(6, 10)
        strange.copy_(g)
        ref.grad = g
        opt_ref.step()
        opt_odd.step()
        _close(odd.detach(), ref.detach())
    assert opt_odd._plans[0].builds == 1


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_kept_plan_does_not_keep_gradients_alive(name):
    # After zero_grad(set_to_none=True) the gradients must be freed, so the next
    # backward's land where they were (the plan is kept) and no second set stays allocated.
    import weakref
    make = OPTIMIZERS[name]
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = make([p])
    g = torch.randn(8, 8).t()  # an odd layout too: its dense copy must not hold it either
    p.grad = g
    opt.step()
    gone = weakref.ref(g)
    del g
    opt.zero_grad(set_to_none=True)
    assert gone() is None


def test_amp_kept_sweeps_do_not_keep_gradients_alive():
    import weakref
    from tritamp import amp
    model = torch.nn.Linear(8, 8)
    model, opt = amp.initialize(model, FusedAdam(model.parameters(), lr=1e-3),
                                opt_level="O2", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    loss = model(torch.randn(2, 8)).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    gone = [weakref.ref(p.grad) for p in model.parameters()]
    opt.zero_grad(set_to_none=True)  # (zero_grad() with masters zeroes them in place, as Apex)
    assert all(r() is None for r in gone)
