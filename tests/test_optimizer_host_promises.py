"""Host-side promises of the fused optimizers that the other optimizer tests leave
unchecked: checkpoints of torch's and Apex's optimizers that must load (or be refused)
by the rule they say, hyperparameters and parameter lists changed between steps taking
effect at the next step, and what a refused step leaves behind.

Everything runs on the production CPU path (conftest's ``cpu_path`` fixture) on tiny fp32
tensors; expected values come from torch.optim or are written out from the update rules.
"""
import pytest
import torch

from tritamp.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

FP32 = dict(rtol=1e-5, atol=1e-6)


def _param(values=(1.0, -2.0, 3.0)):
    return torch.nn.Parameter(torch.tensor(values))


def test_adam_state_without_weight_decay_loads_into_adamw_mode(cpu_path):
    # torch.optim.Adam's groups say decoupled_weight_decay=False; with weight_decay=0 the
    # two rules are one, so FusedAdam (adam_w_mode=True) takes it and continues as torch
    p, ref = _param(), _param()
    torch_opt = torch.optim.Adam([ref], lr=0.01)
    grads = [torch.tensor([0.5, -1.0, 2.0]), torch.tensor([-0.25, 0.5, 1.0])]
    ref.grad = grads[0].clone()
    torch_opt.step()
    assert torch_opt.state_dict()["param_groups"][0]["decoupled_weight_decay"] is False
    with torch.no_grad():
        p.copy_(ref)
    opt = FusedAdam([p], lr=0.01)
    opt.load_state_dict(torch_opt.state_dict())
    p.grad = grads[1].clone()
    ref.grad = grads[1].clone()
    opt.step()
    torch_opt.step()
    torch.testing.assert_close(p.detach(), ref.detach(), **FP32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_adam_state_dtype_other_than_fp32_or_bf16_is_refused(dtype):
    with pytest.raises(ValueError, match="state_dtype must be torch.float32 or torch.bfloat16"):
        FusedAdam([_param()], state_dtype=dtype)


def test_sgd_momentum_switched_on_between_steps_takes_effect_like_torch(cpu_path):
    # the kept sweep of a group without momentum holds no buffer: set momentum on the
    # group after a step, the next step must build one (buf = g first), as torch does
    p, ref = _param(), _param()
    opt = FusedSGD([p], lr=0.1)
    torch_opt = torch.optim.SGD([ref], lr=0.1)
    grads = [torch.tensor([0.5, -1.0, 2.0]), torch.tensor([-0.25, 0.5, 1.0]),
             torch.tensor([1.0, 1.0, -1.0])]
    for i, g in enumerate(grads):
        if i == 1:
            opt.param_groups[0]["momentum"] = 0.9
            torch_opt.param_groups[0]["momentum"] = 0.9
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        torch_opt.step()
        torch.testing.assert_close(p.detach(), ref.detach(), **FP32)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"],
                               torch_opt.state[ref]["momentum_buffer"], **FP32)


def test_sgd_momentum_state_without_its_buffer_is_refused_and_nothing_loaded(cpu_path):
    p = _param()
    opt = FusedSGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    sd = opt.state_dict()
    del sd["state"][0]["momentum_buffer"]  # a step count with no buffer: incomplete
    with pytest.raises(ValueError, match="has 'step' but no 'momentum_buffer'"):
        opt.load_state_dict(sd)
    assert set(opt.state[p]) == set(before)
    for k, v in before.items():
        assert torch.equal(opt.state[p][k], v)


def test_sgd_without_momentum_loads_a_state_holding_only_a_step_count(cpu_path):
    p = _param()
    opt = FusedSGD([p], lr=0.1)
    sd = {"state": {0: {"step": torch.tensor(4.0)}},
          "param_groups": [dict(opt.state_dict()["param_groups"][0])]}
    opt.load_state_dict(sd)
    p.grad = torch.ones(3)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([0.9, -2.1, 2.9]), **FP32)


def test_sgd_loaded_buffer_with_step_count_zero_is_unused_by_the_first_step(path):
    # a step count of 0 says the buffer was never used: the first step sets it to the
    # gradient whatever it held
    p = _param()
    opt = FusedSGD([p], lr=0.1, momentum=0.9)
    sd = {"state": {0: {"momentum_buffer": torch.full((3,), 5.0), "step": torch.tensor(0.0)}},
          "param_groups": [dict(opt.state_dict()["param_groups"][0])]}
    opt.load_state_dict(sd)
    g = torch.tensor([0.5, -1.0, 2.0])
    p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], g, **FP32)
    torch.testing.assert_close(p.detach(), torch.tensor([1.0, -2.0, 3.0]) - 0.1 * g, **FP32)


@pytest.mark.parametrize("make", [lambda ps: FusedAdam(ps, lr=0.1), lambda ps: FusedSGD(ps, lr=0.1),
                                  lambda ps: FusedLAMB(ps, lr=0.1)],
                         ids=["FusedAdam", "FusedSGD", "FusedLAMB"])
def test_step_runs_the_closure_with_autograd_on_even_under_no_grad(make, cpu_path):
    # torch's optimizers run the closure under enable_grad: it may call backward
    p = _param()
    opt = make([p])

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert loss.item() == pytest.approx(14.0)
    torch.testing.assert_close(p.grad, torch.tensor([2.0, -4.0, 6.0]))
    assert not torch.equal(p.detach(), torch.tensor([1.0, -2.0, 3.0]))


@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD, FusedAdagrad, FusedLAMB, FusedNovoGrad])
def test_a_learning_rate_of_zero_is_accepted_as_torch_accepts_it(cls, cpu_path):
    # torch refuses lr < 0 only: lr=0 freezes a group (a warm-up's first value, a frozen
    # backbone's group)
    p, frozen = _param(), _param((4.0, 5.0))
    opt = cls([p], lr=0.0)
    opt.add_param_group({"params": [frozen], "lr": 0.0})
    p.grad, frozen.grad = torch.ones(3), torch.ones(2)
    opt.step()
    assert torch.equal(p.detach(), torch.tensor([1.0, -2.0, 3.0]))
    assert torch.equal(frozen.detach(), torch.tensor([4.0, 5.0]))
