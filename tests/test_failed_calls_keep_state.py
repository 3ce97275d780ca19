"""A refused call changes nothing, also once plans are kept: gradients that reach a kept
plan with another dtype or size (assigned through ``.data``, or with a parameter's
``grad_dtype`` lifted) are validated as on the first step; a group option or tensor
hyperparameter the launches would refuse is refused before any group steps; a sparse
state entry or a master of the wrong shape in a checkpoint is refused before anything
loads. Both paths: Triton's interpreter and the production CPU path."""
import contextlib

import pytest
import torch
import torch.nn as nn

from tritamp import amp
from tritamp.fp16_utils import FP16_Optimizer
from tritamp.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from tritamp.testing import force_cpu_path, reset_amp

OPTIMIZERS = {
    "adam": lambda ps: FusedAdam(ps, lr=0.1),
    "sgd": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9),
    "adagrad": lambda ps: FusedAdagrad(ps, lr=0.1),
    "lamb": lambda ps: FusedLAMB(ps, lr=0.1),
    "novograd": lambda ps: FusedNovoGrad(ps, lr=0.1),
}
PATHS = ["triton", "cpu-path"]


def _path(path):
    return force_cpu_path() if path == "cpu-path" else contextlib.nullcontext()


def _snapshot(opt, ps):
    out = [p.detach().clone() for p in ps]
    for p in ps:
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor):
                out.append(v.detach().clone())
    return out


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _params(n=3, size=8):
    return [nn.Parameter(torch.linspace(-1, 1, size) * (i + 1)) for i in range(n)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind", ["float64", "smaller", "bigger"])
def test_a_kept_plan_refuses_a_gradient_of_another_dtype_or_size(name, kind, path):
    """After a step has kept the plan, a gradient swapped through ``.data`` for one of
    another dtype or size (same strides: the plan's key sees only addresses and
    strides) is refused by name, and nothing changes; the next good step matches an
    optimizer that never saw it."""
    with _path(path):
        ps, ref_ps = _params(), _params()
        opt, ref = OPTIMIZERS[name](ps), OPTIMIZERS[name](ref_ps)
        for q in (ps, ref_ps):
            for p in q:
                p.grad = torch.full((8,), 0.5)
        opt.step()
        ref.step()
        for p in ps:
            p.grad = torch.full((8,), 0.25)
        bad = {"float64": torch.full((8,), 0.25, dtype=torch.float64),
               "smaller": torch.full((4,), 0.25), "bigger": torch.full((16,), 0.25)}[kind]
        ps[1].grad.data = bad
        before = _snapshot(opt, ps)
        with pytest.raises((TypeError, ValueError), match=r"grads\[1\]"):
            opt.step()
        assert _same(before, _snapshot(opt, ps))
        for q in (ps, ref_ps):
            for p in q:
                p.grad = torch.full((8,), 0.25)
        opt.step()
        ref.step()
        assert _same(_snapshot(opt, ps), _snapshot(ref, ref_ps))


@pytest.mark.parametrize("path", PATHS)
def test_a_gradient_of_another_dtype_through_grad_dtype_is_handled_as_on_a_first_step(path):
    if not hasattr(torch.Tensor, "grad_dtype"):
        pytest.skip("this torch has no Tensor.grad_dtype")
    with _path(path):
        ps, ref_ps = _params(), _params()
        opt, ref = FusedAdam(ps, lr=0.1), FusedAdam(ref_ps, lr=0.1)
        for q in (ps, ref_ps):
            for p in q:
                p.grad = torch.full((8,), 0.5)
        opt.step()
        ref.step()
        ps[1].grad_dtype = None
        g = torch.linspace(-1, 1, 8)
        for p, r in zip(ps, ref_ps):
            p.grad, r.grad = g.clone(), g.clone()
        ps[1].grad = g.half()          # exactly the same values in fp16
        ref_ps[1].grad = g.half().float()
        opt.step()
        ref.step()
        assert _same(_snapshot(opt, ps), _snapshot(ref, ref_ps))


@pytest.mark.parametrize("path", PATHS)
def test_amp_o2_with_a_smaller_gradient_swapped_in_refuses_the_step(path):
    """The case that corrupted the heap on the CPU path: a half model gradient swapped for
    a smaller one inside scale_loss, after the plans were kept."""
    reset_amp()
    with _path(path):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2))
        opt = FusedAdam(model.parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                    loss_scale="dynamic", verbosity=0)
        x = torch.randn(5, 3)
        for i in range(3):
            opt.zero_grad()
            with amp.scale_loss(model(x.bfloat16()).float().sum(), opt) as scaled:
                scaled.backward()
                if i == 2:
                    model[1].weight.grad.data = torch.ones(2, 4, dtype=torch.bfloat16)
                    weights = [p.detach().clone() for p in model.parameters()]
            if i < 2:
                opt.step()
        with pytest.raises((TypeError, ValueError), match=r"shape \(2, 4\)"):
            opt.step()
        assert _same(weights, [p.detach().clone() for p in model.parameters()])
    reset_amp()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_bad_tensor_hyperparameter_in_a_later_group_is_refused_before_any_group_steps(
        name, path):
    with _path(path):
        a, b = _params(2), _params(2)
        opt = OPTIMIZERS[name](a)
        opt.add_param_group(dict(params=b))
        for p in a + b:
            p.grad = torch.full((8,), 0.5)
        opt.step()
        opt.param_groups[1]["lr"] = torch.tensor(0.1, device="meta")
        before = _snapshot(opt, a + b)
        with pytest.raises(ValueError, match=r"param_groups\[1\]\['lr'\] is a tensor of shape "
                                             r"\(\) on meta"):
            opt.step()
        assert _same(before, _snapshot(opt, a + b))


_MALFORMED = [("eps", None), ("weight_decay", "0.1"), ("lr", [0.1]),
              ("lr", torch.tensor(0.1 + 0j)), ("betas", (0.9,)), ("betas", (0.9, None)),
              ("momentum", None), ("dampening", "0")]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("first_step", [True, False], ids=["first-step", "kept-plans"])
def test_a_malformed_number_option_in_a_later_group_is_refused_before_any_group_steps(
        name, path, first_step):
    """A number option (its default is a number) or a tuple of them (betas) set on a later
    group after the optimizer was built, malformed: it failed inside that group's launch
    (a raw unpacking or float() error) after group 0 had stepped and kept its state."""
    with _path(path):
        cases = 0
        for key, bad in _MALFORMED:
            a, b = _params(2), _params(2)
            opt = OPTIMIZERS[name](a)
            opt.add_param_group(dict(params=b))
            if key not in opt.param_groups[1]:
                continue
            for p in a + b:
                p.grad = torch.full((8,), 0.5)
            if not first_step:
                opt.step()
            opt.param_groups[1][key] = bad
            before = _snapshot(opt, a + b)
            states = len(opt.state)
            with pytest.raises(TypeError, match=rf"param_groups\[1\]\['{key}'\] is "):
                opt.step()
            assert _same(before, _snapshot(opt, a + b)), key
            assert len(opt.state) == states, key
            cases += 1
        assert cases >= 3


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("layout", ["own group", "mixed"])
def test_a_parameter_on_the_meta_device_is_refused_by_name_before_any_group_steps(
        name, path, layout):
    """A meta parameter (a model built on meta and not materialised) holds no data: the
    step is refused naming it, before the CPU group is written. (A meta group of its own
    stepped the CPU group and then failed in torch's fused kernel, or passed as a no-op; a
    meta parameter among CPU ones failed in an internal storage call.)"""
    with _path(path):
        a = _params(2)
        meta = nn.Parameter(torch.empty(5, device="meta"))
        if layout == "own group":
            opt = OPTIMIZERS[name](a)
            opt.add_param_group(dict(params=[meta]))
        else:
            opt = OPTIMIZERS[name]([a[0], meta, a[1]])
        for p in a:
            p.grad = torch.full((8,), 0.5)
        opt.step()  # the meta parameter without a gradient: the others step
        meta.grad = torch.empty(5, device="meta")
        before = _snapshot(opt, a)
        where = r"params\[0\]" if layout == "own group" else r"params\[1\]"
        with pytest.raises(ValueError, match=where + r" \(shape \(5,\)\) is on the meta "
                                                     r"device, which holds no data"):
            opt.step()
        assert _same(before, _snapshot(opt, a))
        assert meta not in opt.state or not opt.state[meta]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_amp_refuses_a_meta_gradient_by_name_and_changes_nothing(path, level):
    with _path(path):
        reset_amp()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        model.extra = nn.Parameter(torch.empty(5, device="meta"))
        opt = FusedAdam(model.parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                    loss_scale="dynamic", verbosity=0)
        x = torch.randn(5, 3).to(model[0].weight.dtype)
        live = [p for p in model.parameters() if not p.is_meta]
        with amp.scale_loss(model(x).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        before = [p.detach().clone() for p in live]
        with pytest.raises(ValueError, match=r"is on the meta device, which holds no data"):
            with amp.scale_loss(model(x).float().sum(), opt) as scaled:
                scaled.backward()
                model.extra.grad = torch.empty(5, device="meta", dtype=model.extra.dtype)
            opt.step()
        assert _same(before, [p.detach() for p in live])


def test_adagrad_lr_decay_set_on_a_later_group_is_refused_before_any_group_steps():
    a, b = _params(2), _params(2)
    opt = FusedAdagrad(a, lr=0.1)
    opt.add_param_group(dict(params=b))
    for p in a + b:
        p.grad = torch.full((8,), 0.5)
    opt.step()
    opt.param_groups[1]["lr_decay"] = 0.01
    before = _snapshot(opt, a + b)
    with pytest.raises(ValueError, match=r"lr_decay .*param_groups\[1\]"):
        opt.step()
    assert _same(before, _snapshot(opt, a + b))


def test_load_state_dict_refuses_a_sparse_state_entry_before_loading():
    ps = _params(2)
    opt = FusedAdam(ps, lr=0.1)
    for p in ps:
        p.grad = torch.full((8,), 0.5)
    opt.step()
    saved = opt.state_dict()
    saved["state"][1]["exp_avg"] = saved["state"][1]["exp_avg"].to_sparse()
    opt.step()
    before = _snapshot(opt, ps)
    with pytest.raises(ValueError, match="state 'exp_avg' of parameter 1 is a torch.sparse_coo"):
        opt.load_state_dict(saved)
    assert _same(before, _snapshot(opt, ps))


def test_fp16_optimizer_refuses_a_master_of_another_shape_before_loading():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(torch.bfloat16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         static_loss_scale=1.0)
    opt.backward(model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum())
    opt.step()
    saved = opt.state_dict()
    saved["fp32_from_fp16"][0][0] = torch.zeros(4)          # the (4, 4) weight's master
    opt.backward(model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum())
    opt.step()
    masters = [m.detach().clone() for g in opt.fp32_from_fp16_groups for m in g]
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"\['fp32_from_fp16'\]\[0\]\[0\] is a float32 tensor "
                                         r"of shape \(4,\), expected .* shape \(4, 4\)"):
        opt.load_state_dict(saved)
    assert _same(masters, [m.detach().clone() for g in opt.fp32_from_fp16_groups for m in g])
    assert _same(weights, [p.detach().clone() for p in model.parameters()])
