"""LARC's checks across parameter groups, before any gradient is written: group
hyperparameters that are not numbers (or a missing ``lr`` under ``clip=True``) in a later
group, and one gradient tensor given to parameters of two groups, were refused (or not)
only after the earlier groups' gradients had been rewritten."""
import re

import pytest
import torch

from conftest import assert_bits_unchanged, snapshot
from tritamp.parallel import LARC


def _two_groups(shared_grad=False):
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4, generator=g)) for _ in range(3)]
    for p in ps:
        p.grad = torch.randn(4, generator=g)
    if shared_grad:
        ps[2].grad = ps[0].grad  # one gradient tensor, two parameters in two groups
    opt = torch.optim.SGD([{"params": ps[:2], "weight_decay": 0.1},
                           {"params": ps[2:], "weight_decay": 0.2}], lr=0.1, momentum=0.9)
    return ps, opt


def _state(ps):
    return [p.detach() for p in ps] + [p.grad for p in ps]


@pytest.mark.parametrize("name,value", [("lr", None), ("lr", "0.1"),
                                        ("weight_decay", None), ("weight_decay", "0.01")])
def test_larc_group_hyperparameter_not_a_number_refused_before_any_gradient_rewritten(
        path, name, value):
    ps, opt = _two_groups()
    larc = LARC(opt)
    opt.param_groups[1][name] = value
    before = snapshot(_state(ps))
    with pytest.raises(TypeError) as refused:
        larc.step()
    assert_bits_unchanged(before, _state(ps))  # (group 0's were rewritten before)
    assert re.search(rf"param_groups\[1\]\['{name}'\]", str(refused.value))
    assert [g["weight_decay"] for g in opt.param_groups] == [
        0.1, value if name == "weight_decay" else 0.2]
    assert not opt.state


def test_larc_group_without_lr_under_clip_refused_before_any_gradient_rewritten(path):
    ps, opt = _two_groups()
    larc = LARC(opt, clip=True)
    del opt.param_groups[1]["lr"]
    before = snapshot(_state(ps))
    with pytest.raises((ValueError, KeyError)) as refused:  # (a bare KeyError('lr') before)
        larc.step()
    assert_bits_unchanged(before, _state(ps))
    assert re.search(r"param_groups\[1\] has no 'lr'.*clip=False", str(refused.value))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.2]


def test_larc_gradient_shared_by_two_groups_refused_before_anything_written(path):
    ps, opt = _two_groups(shared_grad=True)
    larc = LARC(opt)
    before = snapshot(_state(ps))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*"
                                         r"param_groups\[1\]\['params'\]\[0\].*share memory"):
        larc.step()
    assert_bits_unchanged(before, _state(ps))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.2]
    assert not opt.state
    # with its own gradient the same step runs (the groups' disjoint gradients pass)
    ps[2].grad = ps[0].grad.clone()
    larc.step()
    assert len(opt.state) == 3


def test_larc_gradient_shared_after_steps_with_kept_plans_is_refused(path):
    # The check across groups runs whenever a group's gradients are not the ones its
    # kept plan checked: a gradient given to a second group's parameter after a step
    ps, opt = _two_groups()
    larc = LARC(opt)
    larc.step()
    larc.step()  # (the plans kept, the same gradients: nothing checked again)
    ps[2].grad = ps[0].grad
    before = snapshot(_state(ps) + [s["momentum_buffer"] for s in opt.state.values()])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\].*share memory"):
        larc.step()
    assert_bits_unchanged(before, _state(ps) + [s["momentum_buffer"]
                                                 for s in opt.state.values()])
