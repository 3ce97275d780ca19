"""Promises of the fused optimizers that the comparison tests cannot see: options checked
against closed-form updates (not against another path reading the same option), the
refusal of NaN and infinite values wherever a hyperparameter or a step count comes in,
checkpoint details (rule keys, Apex's norms, group step counts, capturable lr, 0-d state,
old pickles), LAMB's trust-ratio fallback on the production CPU path, and a refused step
handing back the loss scale it was given.

Everything runs on the production CPU path (conftest's ``cpu_path`` fixture) on tiny fp32
(or bf16) tensors; expected values are written out from the update rules.
"""
import copy
import math
import pickle

import pytest
import torch

from test_bad_input_optimizers import assert_unchanged, snapshot
from tritamp.contract import StepState
from tritamp.optimizers import (FusedAdagrad, FusedAdam, FusedLAMB, FusedMixedPrecisionLamb,
                                FusedNovoGrad, FusedSGD)

NAN = float("nan")
FP32 = dict(rtol=1e-5, atol=1e-6)


# =====================================================================================
# options against their closed-form updates
# =====================================================================================

def test_adam_without_bias_correction_takes_the_uncorrected_step(cpu_path):
    """FusedAdam(bias_correction=False): m and v are used as they are, so the first step is
    (1 - beta1) / sqrt(1 - beta2) ~ 3.2 times the bias-corrected one."""
    lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8
    p0 = torch.tensor([1.0, -2.0, 3.0])
    grads = [torch.tensor([0.5, -1.0, 2.0]), torch.tensor([-0.25, 0.5, 1.0])]
    p = torch.nn.Parameter(p0.clone())
    opt = FusedAdam([p], lr=lr, betas=(b1, b2), eps=eps, bias_correction=False)
    ref, m, v = p0.clone(), torch.zeros(3), torch.zeros(3)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        ref = ref - lr * m / (v.sqrt() + eps)
    torch.testing.assert_close(p.detach(), ref, **FP32)
    assert opt.state[p]["step"].item() == 2


def test_sgd_wd_after_momentum_keeps_the_decay_out_of_the_buffer(cpu_path):
    """FusedSGD(wd_after_momentum=True), Apex's rule: buf = momentum * buf + g (buf = g on
    the first step), then p -= lr * (buf + wd * p); the decay never enters the buffer, so
    from the second step on the trajectory differs from torch's rule."""
    lr, mom, wd = 0.1, 0.9, 0.1
    p0 = torch.tensor([1.0, -2.0, 3.0])
    grads = [torch.tensor([0.5, -1.0, 2.0]), torch.tensor([-0.25, 0.5, 1.0])]
    p = torch.nn.Parameter(p0.clone())
    opt = FusedSGD([p], lr=lr, momentum=mom, weight_decay=wd, wd_after_momentum=True)
    after, before = p0.clone(), p0.clone()  # Apex's rule, torch's rule
    buf_after = buf_before = None
    for g in grads:
        p.grad = g.clone()
        opt.step()
        buf_after = g.clone() if buf_after is None else mom * buf_after + g
        after = after - lr * (buf_after + wd * after)
        d = g + wd * before
        buf_before = d if buf_before is None else mom * buf_before + d
        before = before - lr * buf_before
    torch.testing.assert_close(p.detach(), after, **FP32)
    assert (after - before).abs().max() > 1e-3  # the two rules are told apart here
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf_after, **FP32)


# =====================================================================================
# LAMB's trust ratio falls back to 1 where a norm is 0 (Apex, the kernels, the reference)
# =====================================================================================

def _lamb_first_step(ps, gs, lr, eps, wd, max_grad_norm=1.0):
    """Closed form of LAMB's first step (bias-corrected moments: m_hat = g, v_hat = g^2,
    after the global-norm clip), the ratio ||p|| / ||u|| taken as 1 where a norm is 0."""
    norm = torch.cat([g.reshape(-1) for g in gs]).norm()
    clip = norm / max_grad_norm if norm > max_grad_norm else 1.0
    out = []
    for p, g in zip(ps, gs):
        g = g / clip
        u = g / (g.abs() + eps) + wd * p
        pn, un = p.norm(), u.norm()
        ratio = pn / un if pn != 0 and un != 0 else 1.0
        out.append(p - lr * ratio * u)
    return out


def test_lamb_moves_a_zero_initialised_parameter(cpu_path):
    """A parameter whose norm is 0 (a bias initialised to zeros) takes a trust ratio of 1
    and moves by lr * u on its first step; a ratio of 0 would keep it at 0 for ever."""
    lr, eps, wd = 1e-2, 1e-6, 0.01
    b0, w0 = torch.zeros(4), torch.ones(3)
    gb, gw = torch.tensor([0.5, -1.0, 0.25, 2.0]), torch.tensor([0.1, 0.2, -0.3])
    b, w = torch.nn.Parameter(b0.clone()), torch.nn.Parameter(w0.clone())
    b.grad, w.grad = gb.clone(), gw.clone()
    FusedLAMB([b, w], lr=lr, eps=eps, weight_decay=wd).step()
    ref_b, ref_w = _lamb_first_step([b0, w0], [gb, gw], lr, eps, wd)
    assert (b.detach().abs() > 1e-3).all()  # (about lr each: u ~ sign(g))
    torch.testing.assert_close(b.detach(), ref_b, **FP32)
    torch.testing.assert_close(w.detach(), ref_w, **FP32)


def test_lamb_with_an_all_zero_update_leaves_the_weights_finite_and_unchanged(cpu_path):
    """use_nvlamb=True without decay: an all-zero gradient gives u = 0, the ratio falls
    back to 1 and the weights stay as they are (never ||p|| / 0 * 0 = NaN)."""
    lr, eps = 1e-2, 1e-6
    p0, q0 = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.5, 0.5])
    gp, gq = torch.zeros(3), torch.tensor([0.1, -0.2])
    p, q = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(q0.clone())
    p.grad, q.grad = gp.clone(), gq.clone()
    FusedLAMB([p, q], lr=lr, eps=eps, weight_decay=0.0, use_nvlamb=True).step()
    assert torch.isfinite(p).all()
    assert torch.equal(p.detach(), p0)
    torch.testing.assert_close(q.detach(), _lamb_first_step([p0, q0], [gp, gq], lr, eps, 0.0)[1],
                               **FP32)


# =====================================================================================
# NaN and infinity refused wherever they come in
# =====================================================================================

NAN_HYPER = {
    "adam-eps": (FusedAdam, dict(eps=NAN), r"Invalid epsilon value: nan"),
    "adam-weight_decay": (FusedAdam, dict(weight_decay=NAN), r"Invalid weight_decay value: nan"),
    "adam-beta1": (FusedAdam, dict(betas=(NAN, 0.999)), r"Invalid beta parameter at index 0: nan"),
    "adam-beta2": (FusedAdam, dict(betas=(0.9, NAN)), r"Invalid beta parameter at index 1: nan"),
    "sgd-momentum": (FusedSGD, dict(lr=0.1, momentum=NAN), r"Invalid momentum value: nan"),
    "sgd-weight_decay": (FusedSGD, dict(lr=0.1, weight_decay=NAN),
                         r"Invalid weight_decay value: nan"),
    "adagrad-eps": (FusedAdagrad, dict(eps=NAN), r"Invalid epsilon value: nan"),
    "adagrad-weight_decay": (FusedAdagrad, dict(weight_decay=NAN),
                             r"Invalid weight_decay value: nan"),
    "lamb-eps": (FusedLAMB, dict(eps=NAN), r"Invalid epsilon value: nan"),
    "lamb-beta1": (FusedLAMB, dict(betas=(NAN, 0.999)), r"Invalid beta parameter at index 0: nan"),
    "novograd-weight_decay": (FusedNovoGrad, dict(weight_decay=NAN),
                              r"Invalid weight_decay value: nan"),
    "novograd-beta2": (FusedNovoGrad, dict(betas=(0.9, NAN)),
                       r"Invalid beta parameter at index 1: nan"),
}


@pytest.mark.parametrize("case", list(NAN_HYPER))
def test_nan_hyperparameter_is_refused_at_construction(case):
    """A NaN eps, weight_decay, momentum or beta is refused as a negative one is: one step
    with it would turn every weight NaN."""
    cls, kw, match = NAN_HYPER[case]
    with pytest.raises(ValueError, match=match):
        cls([torch.nn.Parameter(torch.zeros(3))], **kw)


@pytest.mark.parametrize("case", ["adam-eps", "adam-beta1", "sgd-momentum"])
def test_nan_hyperparameter_in_a_group_added_or_loaded_is_refused_unchanged(case, cpu_path):
    """The same NaN in a group given to add_param_group or in a loaded state dict: refused
    naming the group, the optimizer as it was."""
    cls, kw, match = NAN_HYPER[case]
    base = dict(lr=0.1) if cls is FusedSGD else {}
    p = torch.nn.Parameter(torch.ones(3))
    opt = cls([p], **base)
    p.grad = torch.ones(3)
    opt.step()
    before = snapshot(opt)
    with pytest.raises(ValueError, match=match + r" \(parameter group 1\)"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(2))], **kw))
    assert_unchanged(before, opt)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0].update(kw)
    with pytest.raises(ValueError, match=match + r" \(parameter group 0 of the state dict\)"):
        opt.load_state_dict(sd)
    assert_unchanged(before, opt)


@pytest.mark.parametrize("inf", [torch.tensor(math.inf), math.inf], ids=["tensor", "float"])
def test_infinite_saved_step_count_is_refused_unchanged(inf, cpu_path):
    """A step count is a whole number >= 0: +inf would turn bias correction off for good."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    p.grad = torch.tensor([0.5, -1.0, 2.0])
    opt = FusedAdam([p], lr=1e-2)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["step"] = inf
    q = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    fresh = FusedAdam([q], lr=1e-2)
    before = snapshot(fresh)
    with pytest.raises(ValueError, match=r"state 'step' of parameter 0 is inf; a step count is "
                                         r"a whole number >= 0"):
        fresh.load_state_dict(sd)
    assert_unchanged(before, fresh)
    assert q not in fresh.state


def test_fractional_saved_step_count_is_refused_unchanged(cpu_path):
    """A step count of 1.5 is no count: refused at load (per parameter, and in a group,
    where FusedMixedPrecisionLamb's int32 step would have truncated it to 1), the
    optimizer as it was. torch's own float counts (3.0) load."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    p.grad = torch.tensor([0.5, -1.0, 2.0])
    opt = FusedAdam([p], lr=1e-2)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["step"] = torch.tensor(1.5)
    fresh = FusedAdam([torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))], lr=1e-2)
    before = snapshot(fresh)
    with pytest.raises(ValueError, match=r"state 'step' of parameter 0 is 1\.5; a step count "
                                         r"is a whole number >= 0"):
        fresh.load_state_dict(sd)
    assert_unchanged(before, fresh)
    sd["state"][0]["step"] = torch.tensor(3.0)
    fresh.load_state_dict(sd)  # torch's float count
    w = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    lamb = FusedMixedPrecisionLamb([w], step=2)
    sd = copy.deepcopy(lamb.state_dict())
    sd["param_groups"][0]["step"] = torch.tensor([1.5])
    before = snapshot(lamb)
    with pytest.raises(ValueError, match=r"'step' of parameter group 0 is 1\.5; a step count "
                                         r"is a whole number >= 0"):
        lamb.load_state_dict(sd)
    assert_unchanged(before, lamb)
    assert lamb.param_groups[0]["step"].tolist() == [2]


@pytest.mark.parametrize("bad", [NAN, math.inf, torch.tensor(NAN)], ids=["nan", "inf", "tensor"])
def test_sgd_non_finite_dampening_is_refused_wherever_it_comes_in(bad):
    """torch checks no dampening; a NaN or infinite one would turn every weight NaN from the
    second momentum step on. Refused by the constructor, add_param_group and a load,
    naming the value, the optimizer as it was."""
    with pytest.raises(ValueError, match=r"Invalid dampening value: .*dampening must be a "
                                         r"finite number"):
        FusedSGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9, dampening=bad)
    opt = FusedSGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9, dampening=0.5)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"Invalid dampening value: .* \(parameter group 1\)"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "dampening": bad})
    assert_unchanged(before, opt)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["dampening"] = bad
    with pytest.raises(ValueError, match=r"Invalid dampening value: .* \(parameter group 0 "
                                         r"of the state dict\)"):
        opt.load_state_dict(sd)
    assert_unchanged(before, opt)
    assert opt.param_groups[0]["dampening"] == 0.5


def test_sgd_group_with_negative_momentum_is_refused_when_added_or_loaded():
    """The constructor's momentum check holds for a group added later and a loaded one."""
    a = torch.nn.Parameter(torch.zeros(2))
    opt = FusedSGD([a], lr=0.1, momentum=0.9)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"Invalid momentum value: -0\.5 \(parameter group 1\)"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "momentum": -0.5})
    assert_unchanged(before, opt)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["momentum"] = -0.5
    with pytest.raises(ValueError, match=r"Invalid momentum value: -0\.5 \(parameter group 0 "
                                         r"of the state dict\)"):
        opt.load_state_dict(sd)
    assert_unchanged(before, opt)
    assert opt.param_groups[0]["momentum"] == 0.9


@pytest.mark.parametrize("step,match", [
    (torch.tensor([True]), r"step must be an integer or a one-element integer tensor, got a "
                           r"bool tensor"),
    (torch.tensor([1, 2], dtype=torch.int32), r"step must be .*one-element.* shape \(2,\)"),
], ids=["bool", "two-elements"])
def test_mixed_precision_lamb_refuses_a_step_tensor_that_is_not_one_integer(step, match):
    """FusedMixedPrecisionLamb's step (constructor or group): a bool tensor is not read
    as 1, and a tensor of several counts is refused by name, not by a reshape error."""
    kinds = TypeError if step.dtype == torch.bool else ValueError  # (a shape: as at load)
    with pytest.raises(kinds, match=match):
        FusedMixedPrecisionLamb([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))],
                                step=step)
    opt = FusedMixedPrecisionLamb([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))])
    with pytest.raises(kinds, match=match + r".*\(parameter group 1\)"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))],
                             "step": step})
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["step"].tolist() == [0]


# =====================================================================================
# checkpoints
# =====================================================================================

def test_adagrad_state_dict_says_its_rule_and_the_other_rule_refuses_it(cpu_path):
    """FusedAdagrad's state dict names adagrad_w_mode, so a FusedAdagrad applying the
    other weight-decay rule refuses it instead of continuing under another rule."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    p.grad = torch.tensor([0.5, -1.0, 2.0, 0.25])
    opt = FusedAdagrad([p], lr=0.1, weight_decay=0.01, adagrad_w_mode=True)
    opt.step()
    sd = opt.state_dict()
    q = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    l2 = FusedAdagrad([q], lr=0.1, weight_decay=0.01, adagrad_w_mode=False)
    before = snapshot(l2)
    with pytest.raises(ValueError, match=r"applied weight_decay=0\.01 as decoupled weight decay "
                                         r"\(adagrad_w_mode=True\).*construct "
                                         r"FusedAdagrad\(\.\.\., adagrad_w_mode=True\)"):
        l2.load_state_dict(copy.deepcopy(sd))
    assert_unchanged(before, l2)
    assert sd["param_groups"][0]["adagrad_w_mode"] is True
    assert l2.state_dict()["param_groups"][0]["adagrad_w_mode"] is False
    FusedAdagrad([q], lr=0.1, weight_decay=0.01, adagrad_w_mode=True).load_state_dict(sd)


def test_apex_novograd_checkpoint_with_more_norms_than_parameters_is_refused(cpu_path):
    """Apex's FusedNovoGrad keeps one second-moment norm per parameter in each group: a
    checkpoint with more norms than parameters belongs to another model."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in ((3, 4), (5,), (2,))]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = FusedNovoGrad(ps, lr=1e-2)
    opt.step()
    sd = opt.state_dict()
    apex = {"state": {k: {"exp_avg": v["exp_avg"].clone()} for k, v in sd["state"].items()},
            "param_groups": [dict(sd["param_groups"][0], step=1,
                                  exp_avg_sq=[torch.zeros(0), torch.ones(4)])]}
    fresh = FusedNovoGrad([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=1e-2)
    before = snapshot(fresh)
    with pytest.raises(ValueError, match=r"keeps 4 second-moment norms for float32 parameters "
                                         r"\(exp_avg_sq\[1\]\) but has 3"):
        fresh.load_state_dict(apex)
    assert_unchanged(before, fresh)


def test_mixed_precision_lamb_takes_the_group_step_from_a_fused_lamb_checkpoint(cpu_path):
    """A FusedLAMB checkpoint (no group step) loaded into FusedMixedPrecisionLamb: the
    group has taken as many steps as its most-stepped parameter (one without a gradient
    on some steps counts fewer)."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4).to(torch.bfloat16)) for _ in range(2)]
    opt = FusedLAMB(ps, lr=1e-2)
    for i in range(3):
        ps[0].grad = torch.randn(4).to(torch.bfloat16)
        ps[1].grad = torch.randn(4).to(torch.bfloat16) if i == 0 else None
        opt.step()
    assert [float(opt.state[p]["step"]) for p in ps] == [3.0, 1.0]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    mixed = FusedMixedPrecisionLamb(qs, lr=1e-2)
    mixed.load_state_dict(opt.state_dict())
    assert mixed.param_groups[0]["step"].tolist() == [3]
    assert [float(mixed.state[q]["step"]) for q in qs] == [3.0, 1.0]


def test_capturable_lr_is_a_device_tensor_again_after_loading_a_float_lr(cpu_path):
    """FusedAdam(capturable=True) and FusedMixedPrecisionLamb keep every group's lr as an
    fp32 tensor on the parameters' device: loading a checkpoint whose groups hold a float
    lr (torch.optim.AdamW's, FusedLAMB's) leaves it one, with the checkpoint's value."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    p.grad = torch.tensor([0.5, -1.0, 2.0])
    theirs = torch.optim.AdamW([p], lr=1e-2)
    theirs.step()
    adam = FusedAdam([torch.nn.Parameter(p.detach().clone())], lr=1e-3, capturable=True)
    adam.load_state_dict(theirs.state_dict())
    h = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0], dtype=torch.bfloat16))
    h.grad = torch.tensor([0.5, -1.0, 2.0], dtype=torch.bfloat16)
    lamb = FusedLAMB([h], lr=1e-2)
    lamb.step()
    mixed = FusedMixedPrecisionLamb([torch.nn.Parameter(h.detach().clone())], lr=1e-3)
    mixed.load_state_dict(lamb.state_dict())
    for name, opt in (("adam", adam), ("mixed", mixed)):
        lr = opt.param_groups[0]["lr"]
        assert isinstance(lr, torch.Tensor), name
        assert lr.dtype == torch.float32 and lr.device == p.device, name
        assert lr.item() == pytest.approx(1e-2, rel=1e-6), name


def test_zero_dim_parameter_state_loaded_from_float64_is_fp32_and_steps(cpu_path):
    """A learnable scalar (a 0-d parameter) has 0-d state: a checkpoint saved in float64
    loads as fp32, as every other state does, and the next step continues Adam."""
    lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8
    t = torch.nn.Parameter(torch.tensor(1.0))
    t.grad = torch.tensor(0.5)
    opt = FusedAdam([t], lr=lr)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0] = {k: v.double() for k, v in sd["state"][0].items()}
    u = torch.nn.Parameter(t.detach().clone())
    resumed = FusedAdam([u], lr=lr)
    resumed.load_state_dict(sd)
    assert {k: v.dtype for k, v in resumed.state[u].items()} == {
        k: torch.float32 for k in ("step", "exp_avg", "exp_avg_sq")}
    assert all(v.shape == () for v in resumed.state[u].values())
    u.grad = torch.tensor(-0.25)
    resumed.step()
    # Adam from 1.0: g = 0.5 (m = 0.05, v = 0.00025), then g = -0.25
    first = 1.0 - lr * 0.5 / (0.5 + eps)
    m = b1 * 0.05 + (1 - b1) * -0.25
    v = b2 * 0.00025 + (1 - b2) * 0.0625
    expected = first - lr * (m / (1 - b1 ** 2)) / (math.sqrt(v / (1 - b2 ** 2)) + eps)
    assert u.item() == pytest.approx(expected, rel=1e-6)
    assert resumed.state[u]["step"].item() == 2


def test_sgd_pickled_before_the_nesterov_key_unpickles_and_steps(cpu_path):
    """A FusedSGD pickled when its groups had no "nesterov" key (torch.optim.SGD's
    __setstate__ default) unpickles without Nesterov and steps."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedSGD([p], lr=0.1, momentum=0.9)
    del opt.param_groups[0]["nesterov"]
    restored = pickle.loads(pickle.dumps(opt))
    assert restored.param_groups[0]["nesterov"] is False
    q = restored.param_groups[0]["params"][0]
    for _ in range(2):
        q.grad = torch.ones(3)
        restored.step()
    # plain momentum: buf = 1, then 1.9; q = 1 - 0.1 - 0.19
    torch.testing.assert_close(q.detach(), torch.full((3,), 0.71), **FP32)


# =====================================================================================
# a refused step hands back what a driver handed it
# =====================================================================================

def test_refused_step_drops_the_loss_scale_it_was_handed(cpu_path):
    """A step refused before anything is written resets the handoff: the next, plain
    step reads .grad unscaled, not divided by the stale loss scale."""
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    opt = FusedSGD([p], lr=1.0)
    opt.step_handoff.hand(StepState.SCALED, grad_scale=torch.tensor(1024.0))
    opt.param_groups[0]["lr"] = [0.1]  # malformed: refused before any write
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['lr'\] is list \[0\.1\]"):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(3))
    assert opt.step_handoff.state is StepState.READY
    assert opt.step_handoff.grad_scale is None
    opt.param_groups[0]["lr"] = 1.0
    opt.step()
    assert torch.equal(p.detach(), torch.full((3,), -1.0))
