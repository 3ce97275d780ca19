"""The fused optimizers used the way torch optimizers are used: what a
user sets by hand or loads, which must either work as Apex's does or be refused before
anything is written.

- FusedMixedPrecisionLamb's group step count (``param_groups[i]['step']``) set to a
  Python number after the optimizer was built: an int is taken (Apex's
  ``group['step'] += ...`` takes one) and steps as the same count given as a tensor; a
  count that is not a whole number is refused with weights and state bitwise unchanged.
- A FusedMixedPrecisionLamb checkpoint whose group says ``step: None`` loads as one
  without a group count (the checks read None as absent), not half loaded.
- Hyperparameters given to the constructor as real numbers of other types (a
  ``fractions.Fraction``), which its checks take: read as floats, so the production CPU
  paths of LAMB and NovoGrad step with them as with floats (they failed inside torch's
  foreach ops, LAMB's after its moments and step counts had been written); one set on a
  group later is refused before anything is written.
- FP16_Optimizer (which always keeps fp32 masters) refuses an optimizer built with
  stochastic_rounding / kahan_summation (bf16 weights without masters) when it is
  built, as amp.initialize does, instead of adopting it and refusing every step.
"""
import copy
from fractions import Fraction

import pytest
import torch

from conftest import all_tensors, assert_bits_unchanged, snapshot, step_alike
from tritamp.fp16_utils import FP16_Optimizer
from tritamp.optimizers import FusedAdam, FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad


def _mpl_after_one_step(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.randn(3, 4, generator=gen).requires_grad_(),
          torch.randn(5, generator=gen).requires_grad_()]
    opt = FusedMixedPrecisionLamb(ps, lr=0.1, weight_decay=0.01)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    return ps, opt


def _mpl_tensors(ps, opt):
    out = [p.detach() for p in ps]
    for p in ps:
        out += [v for _, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]
    return out + [g["step"] for g in opt.param_groups if isinstance(g["step"], torch.Tensor)]


def test_mixed_precision_lamb_group_step_set_to_an_int_steps_as_the_same_count_tensor(path):
    ps, opt = _mpl_after_one_step()
    ref_ps, ref = _mpl_after_one_step()
    opt.param_groups[0]["step"] = 5
    ref.param_groups[0]["step"] = torch.tensor([5], dtype=torch.int32)
    opt.step()
    ref.step()
    step = opt.param_groups[0]["step"]
    assert isinstance(step, torch.Tensor) and step.dtype == torch.int32
    assert step.tolist() == [6]
    for p, q in zip(ps, ref_ps):
        assert torch.equal(p, q)


@pytest.mark.parametrize("value", [2.5, -1])
def test_mixed_precision_lamb_group_step_not_a_whole_number_refused_with_nothing_changed(
        path, value):
    ps, opt = _mpl_after_one_step()
    opt.param_groups[0]["step"] = value
    before = snapshot(_mpl_tensors(ps, opt))
    with pytest.raises((TypeError, ValueError), match=r"param_groups\[0\]\['step'\]"):
        opt.step()
    assert_bits_unchanged(before, _mpl_tensors(ps, opt))


def test_mixed_precision_lamb_checkpoint_with_group_step_none_loads_as_no_group_count():
    ps, opt = _mpl_after_one_step()
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["step"] = None
    gen = torch.Generator().manual_seed(3)
    fresh = [torch.randn(3, 4, generator=gen).requires_grad_(),
             torch.randn(5, generator=gen).requires_grad_()]
    other = FusedMixedPrecisionLamb(fresh, lr=0.5)
    other.load_state_dict(sd)
    # the group's count from its parameters' counts (one step taken), as for a
    # checkpoint without one
    assert other.param_groups[0]["step"].tolist() == [1]
    assert float(other.param_groups[0]["lr"]) == pytest.approx(0.1)


@pytest.mark.parametrize("flag", ["stochastic_rounding", "kahan_summation"])
def test_fp16_optimizer_refuses_a_masterless_rounding_optimizer_when_built(flag):
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(4, 3).bfloat16()
    inner = FusedAdam(model.parameters(), lr=0.01, **{flag: True})
    params = list(inner.param_groups[0]["params"])
    with pytest.raises(ValueError, match=flag):
        FP16_Optimizer(inner, verbose=False)
    # nothing adopted: the optimizer still steps the bf16 model on its own
    assert not hasattr(inner, "_amp_stash")
    assert all(a is b for a, b in zip(inner.param_groups[0]["params"], params))
    x = torch.randn(2, 4, generator=gen).bfloat16()
    model(x).float().sum().backward()
    before = snapshot([p.detach() for p in params])
    inner.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, params))


@pytest.mark.parametrize("make, exact, odd", [
    (FusedLAMB, dict(weight_decay=0.1), dict(weight_decay=Fraction(1, 10))),
    (FusedLAMB, dict(betas=(0.75, 0.99)), dict(betas=(Fraction(3, 4), 0.99))),
    (FusedNovoGrad, dict(betas=(0.9, 0.75)), dict(betas=(0.9, Fraction(3, 4)))),
    (FusedNovoGrad, dict(weight_decay=0.25), dict(weight_decay=Fraction(1, 4))),
    (FusedMixedPrecisionLamb, dict(weight_decay=0.1), dict(weight_decay=Fraction(1, 10))),
])
def test_fraction_hyperparameters_step_as_floats_on_the_cpu_path(cpu_path, make, exact, odd):
    gen = torch.Generator().manual_seed(1)
    ps = [torch.randn(3, 4, generator=gen).requires_grad_(),
          torch.randn(5, generator=gen).requires_grad_()]
    qs = [p.detach().clone().requires_grad_() for p in ps]
    opt, ref = make(ps, lr=0.1, **odd), make(qs, lr=0.1, **exact)
    step_alike(ps, qs, opt, ref, gen)


def test_fraction_set_on_a_group_after_construction_is_refused_with_nothing_changed(
        cpu_path):
    # (the constructor reads a Fraction as a float; one set on a group later failed inside
    # torch's foreach ops after LAMB's moments and step counts had been written)
    gen = torch.Generator().manual_seed(2)
    ps = [torch.randn(3, 4, generator=gen).requires_grad_()]
    opt = FusedLAMB(ps, lr=0.1)
    ps[0].grad = torch.randn(3, 4, generator=gen)
    opt.step()
    opt.param_groups[0]["weight_decay"] = Fraction(1, 4)
    everything = all_tensors(ps, [ps[0].grad], list(opt.state[ps[0]].values()))
    before = snapshot(everything)
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['weight_decay'\] is Fraction "
                                        r"Fraction\(1, 4\); it must be a real number \(an "
                                        r"int, a float, a numpy number"):
        opt.step()
    assert_bits_unchanged(before, everything)
