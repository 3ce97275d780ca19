"""Promises of tritamp.fp16_utils that its docstrings make in so many words:
FP16_Optimizer's skip report, its checkpoint's ``overflow``, closure steps (skipped on an
earlier overflow, and giving up at the scale floor), DynamicLossScaler's defaults, and
the manual helpers' handling of a missing gradient.

bf16 models unless fp16 is the point (fp16 math on a CPU is slow: tiny tensors only).
"""
import logging

import pytest
import torch
from torch import nn

from tritamp import amp
from tritamp.fp16_utils import (DynamicLossScaler, FP16_Optimizer, convert_network,
                                model_grads_to_master_grads, prep_param_lists)

INF = float("inf")
X = torch.ones(1, 3, dtype=torch.bfloat16)


def _setup(**kwargs):
    """A bf16 Linear(3, 1) and an FP16_Optimizer over SGD."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1).to(torch.bfloat16)
    kwargs.setdefault("verbose", False)
    return model, FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def _reports(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "tritamp.fp16_utils"
            and r.getMessage().startswith("OVERFLOW!")]


# -- the skip report --------------------------------------------------------------------------

@pytest.mark.parametrize("init_scale,report", [
    (8.0, "OVERFLOW! Skipping step. Attempted loss scale: 8.0, reducing to 4.0"),
    (1.0, "OVERFLOW! Skipping step. Attempted loss scale: 1.0, keeping it"),
], ids=["above-the-floor", "at-the-floor"])
def test_the_skip_report_says_keeping_it_when_the_scale_stays_at_its_floor(caplog, init_scale,
                                                                           report):
    """A skipped step reports 'reducing to X' when the scale went down, and 'keeping it'
    at the floor (1.0), where nothing was reduced."""
    caplog.set_level(logging.WARNING, logger="tritamp.fp16_utils")
    model, opt = _setup(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": init_scale})
    opt.zero_grad()
    opt.backward(model(X).float().sum() * INF)
    opt.step()
    assert _reports(caplog) == [report]


# -- DynamicLossScaler's defaults -------------------------------------------------------------

def test_dynamic_loss_scaler_defaults_are_apexs():
    """DynamicLossScaler() starts at 2**32, grows by 2 every 1000 clean steps (Apex's
    legacy defaults)."""
    s = DynamicLossScaler()
    assert (s.loss_scale, s.scale_factor, s.scale_window) == (4294967296.0, 2.0, 1000)


# -- the checkpoint's overflow ----------------------------------------------------------------

def test_load_state_dict_restores_the_overflow_of_the_checkpoint():
    """A checkpoint taken after an overflowing backward loads as overflowing (the next
    step is skipped), and a clean checkpoint clears an overflow the loading optimizer
    was in."""
    model, a = _setup(dynamic_loss_scale=True)
    a.backward(model(X).float().sum() * INF)
    overflowing = a.state_dict()
    assert overflowing["overflow"] is True

    _, clean_opt = _setup(dynamic_loss_scale=True)
    clean = clean_opt.state_dict()
    assert clean["overflow"] is False

    _, b = _setup(dynamic_loss_scale=True)
    b.load_state_dict(overflowing)
    assert b.overflow is True

    model_c, c = _setup(dynamic_loss_scale=True)
    c.backward(model_c(X).float().sum() * INF)
    assert c.overflow is True
    c.load_state_dict(clean)
    assert c.overflow is False


# -- closure steps ----------------------------------------------------------------------------

def test_a_closure_step_skipped_on_an_earlier_overflow_is_reported_as_skipped():
    """After an overflowing backward, step(closure) skips without running the closure,
    and amp.last_step_skipped(fp16_optimizer.optimizer) says so (a clean closure step
    before it said False)."""
    model, opt = _setup(dynamic_loss_scale=True)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = model(X).float().sum()
        opt.backward(loss)
        return loss

    opt.step(closure)
    assert calls == [1]
    assert amp.last_step_skipped(opt.optimizer) is False
    opt.zero_grad()
    opt.backward(model(X).float().sum() * INF)
    opt.step(closure)
    assert calls == [1]
    assert amp.last_step_skipped(opt.optimizer) is True


def test_a_closure_that_keeps_overflowing_gives_up_once_the_scale_reaches_its_floor():
    """An always-overflowing closure is evaluated at 4, 2 and the floor 1, then the step
    raises "cannot go lower": three evaluations, not one more at the floor (a closure
    retried at the floor would never end)."""
    model, opt = _setup(dynamic_loss_scale=True,
                        dynamic_loss_args={"init_scale": 4.0, "min_loss_scale": 1.0})
    before = [p.detach().clone() for p in model.parameters()]
    scales = []

    def closure():
        scales.append(opt.loss_scale)
        if len(scales) > 10:
            raise AssertionError(f"the closure was evaluated {len(scales)} times at the "
                                 f"scales {scales}")
        opt.zero_grad()
        loss = model(X).float().sum() * INF
        opt.backward(loss)
        return loss

    with pytest.raises(RuntimeError, match="cannot go lower"):
        opt.step(closure)
    assert scales == [4.0, 2.0, 1.0]
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))


# -- a static scale replaced through Apex's attribute -----------------------------------------

def test_setting_loss_scale_on_a_static_optimizer_scales_the_next_backward():
    """FP16_Optimizer(static_loss_scale=1.0) with loss_scale = 128 set afterwards: the
    next backward scales the loss by 128 (the model's gradients carry it) and the masters'
    gradients come out unscaled."""
    model, opt = _setup(static_loss_scale=1.0)
    opt.loss_scale = 128.0
    assert opt.loss_scale == 128.0
    opt.zero_grad()
    opt.backward(model(X).float().sum())
    assert torch.equal(model.weight.grad, torch.full((1, 3), 128.0, dtype=torch.bfloat16))
    master_weight = opt.fp32_from_fp16_groups[0][0]
    assert torch.equal(master_weight.grad, torch.ones(1, 3))


# -- the manual helpers -----------------------------------------------------------------------

def test_a_model_parameter_without_a_gradient_leaves_its_master_without_one():
    """model_grads_to_master_grads: when the bias has no gradient this time, its master
    has none either (not the previous iteration's, which the next step would apply
    again)."""
    model = nn.Linear(3, 1).to(torch.bfloat16)
    model_params, masters = prep_param_lists(model)
    for p in model_params:
        p.grad = torch.ones_like(p)
    model_grads_to_master_grads(model_params, masters)
    assert torch.equal(masters[1].grad, torch.ones(1))
    model_params[1].grad = None
    model_grads_to_master_grads(model_params, masters)
    assert masters[1].grad is None
    assert torch.equal(masters[0].grad, torch.ones(1, 3))


def test_a_missing_gradient_is_a_zero_slice_of_the_flat_master_gradient():
    """With flat_master=True a parameter without a gradient gives a zero slice of the flat
    gradient, whatever the slice held before."""
    model = nn.Linear(3, 1).to(torch.bfloat16)
    model_params, masters = prep_param_lists(model, flat_master=True)
    masters[0].grad.fill_(7.0)
    model_params[0].grad = torch.ones_like(model_params[0])
    model_params[1].grad = None
    model_grads_to_master_grads(model_params, masters, flat_master=True)
    assert masters[0].grad.tolist() == [1.0, 1.0, 1.0, 0.0]


def test_convert_network_casts_an_existing_gradient_with_its_parameter():
    """convert_network casts a parameter's gradient along with it (Apex's
    convert_module cast param._grad too)."""
    model = nn.Linear(3, 1)
    model(torch.ones(1, 3)).sum().backward()
    model = convert_network(model, torch.bfloat16)
    assert model.weight.dtype == torch.bfloat16
    assert model.weight.grad.dtype == torch.bfloat16
    assert torch.equal(model.weight.grad, torch.ones(1, 3, dtype=torch.bfloat16))
