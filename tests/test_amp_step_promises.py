"""Promises of tritamp.amp's loss scaler and amp-wrapped step that the other amp tests
left unpinned (found by a mutation audit): LossScaler's default backoff of
1 / scale_factor, step counts of a loaded checkpoint saturating at 2**24, a loaded floor
streak of exactly 10 counting as warned, scale_loss's fp32 product for a half loss that
is not 0-d and its refusal of a loss that is not a tensor, and torch's LR schedulers
seeing amp's step (run or skipped) as called.

Steps run at O0 with a dynamic scale (fp32 math on a CPU); tensors are tiny.
"""
import warnings

import pytest
import torch
from torch import nn

from conftest import amp_step
from tritamp import amp

INF = float("inf")


def _sum(out, _y):
    return out.sum()


def _o0_dynamic(**kwargs):
    """A Linear(3, 1) and its SGD at O0 with a dynamic scale."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs.setdefault("verbosity", 0)
    return amp.initialize(model, opt, opt_level="O0", loss_scale="dynamic", **kwargs)


def _scaler0():
    return amp.state_dict()["loss_scaler0"]


# -- LossScaler's arguments --------------------------------------------------------------------

@pytest.mark.parametrize("scale_factor", [4.0, 3.0])
def test_loss_scaler_backs_off_by_one_over_its_scale_factor_by_default(scale_factor):
    s = amp.LossScaler("dynamic", init_scale=2.**12, scale_factor=scale_factor)
    assert s.backoff_factor == 1.0 / scale_factor


# -- checkpoints -------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["unskipped", "skipped", "floor_streak"])
def test_a_huge_saved_step_count_loads_saturated_at_two_to_the_24(key):
    # fp32 counters: 10**40 would be inf on the device (and state_dict's int() would fail)
    _o0_dynamic(init_scale=2.**10)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.**10, "unskipped": 0, key: 10 ** 40}})
    assert _scaler0()[key] == 2 ** 24


def test_a_checkpoint_with_a_floor_streak_of_exactly_ten_but_no_floor_warned_key_counts_as_warned():
    # the warning comes at the 10th overflowing step at the floor: a streak of 10 had it
    model, opt = _o0_dynamic(init_scale=1.0, min_loss_scale=1.0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0, "floor_streak": 10}})
    assert _scaler0()["floor_warned"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second floor warning on the next overflow
        amp_step(model, opt, torch.ones(2, 3), loss_fn=_sum, factor=INF)
    assert _scaler0()["floor_streak"] == 11


# -- scale_loss ---------------------------------------------------------------------------------

def test_scale_loss_multiplies_a_half_loss_vector_in_fp32():
    # loss.float() * scale: a (1,)-shaped fp16 loss times 2**16 would overflow fp16
    model, opt = _o0_dynamic()
    loss = (model(torch.ones(2, 3)).sum() * 2.0 + 4.0).half().reshape(1)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.dtype == torch.float32
        assert torch.isfinite(scaled).all()
        assert scaled.item() == ((loss.float() * 2.**16)).item()
        scaled.sum().backward()


@pytest.mark.parametrize("loss", [3.0, None])
def test_scale_loss_refuses_a_loss_that_is_not_a_tensor_by_type(loss):
    model, opt = _o0_dynamic()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=f"scale_loss expects the loss as a torch.Tensor, got "
                                        f"{type(loss).__name__}"):
        with amp.scale_loss(loss, opt):
            pass
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert _scaler0()["loss_scale"] == 2.**16


# -- torch's LR schedulers -----------------------------------------------------------------------

@pytest.mark.parametrize("made", ["before", "after"])
@pytest.mark.parametrize("factor", [1.0, INF])
def test_an_lr_scheduler_sees_the_amp_step_called_even_when_it_was_skipped(made, factor):
    # torch warns "Detected call of `lr_scheduler.step()` before `optimizer.step()`" unless
    # the step marked the optimizer _opt_called
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1) if made == "before" else None
    model, opt = amp.initialize(model, opt, opt_level="O0", loss_scale="dynamic", verbosity=0)
    if sched is None:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    amp_step(model, opt, torch.ones(2, 3), loss_fn=_sum, factor=factor)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
