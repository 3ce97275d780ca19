"""Optimizer checkpoints from the real world: torch's (a step count saved as an int, a float
or a tensor), Apex's (built by hand in Apex's layout: the step count of FusedAdam,
FusedLAMB and FusedNovoGrad kept per parameter group, NovoGrad's second moments as one
tensor per group and dtype), interchange with torch.optim's Adam, AdamW, SGD and Adagrad
in both directions, and the checks a state dict gets before anything is loaded.

Every state dict goes through ``torch.save`` / ``torch.load(weights_only=True)``, as a
checkpoint does. Against torch.optim the tolerance is the one the trajectory tests use
(fp32, rtol=1e-5, atol=1e-6 over a few steps: the kernels and torch round an ulp apart
now and then); tritamp against tritamp is bitwise.
"""
import copy
import io

import pytest
import torch

from conftest import assert_bits_equal
from test_bad_input_optimizers import assert_unchanged, snapshot
from tritamp.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from tritamp.testing import generation_of

FP32 = dict(rtol=1e-5, atol=1e-6)
SHAPES = ((3, 4), (5,), (1,))


def params(shapes=SHAPES, dtypes=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dtypes = dtypes or [torch.float32] * len(shapes)
    return [torch.randn(s, generator=gen).to(d).requires_grad_() for s, d in zip(shapes, dtypes)]


def twin(ps):
    return [p.detach().clone().requires_grad_() for p in ps]


def run(ps, opt, first, n):
    for k in range(first, first + n):
        gen = torch.Generator().manual_seed(100 + k)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def saved(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_same(a, b, exact=True):
    for i, (x, y) in enumerate(zip(a, b)):
        if exact:
            assert_bits_equal(x.detach(), y.detach(), f"param {i}")
        else:
            torch.testing.assert_close(x.detach(), y.detach(), **FP32)


# =====================================================================================
# torch's checkpoints: the step count as an int, a float (older torch) or a tensor
# =====================================================================================

STEP_KINDS = {
    "int": int,
    "float": float,
    "tensor": lambda s: torch.tensor(float(s)),
    "int64-tensor": lambda s: torch.tensor(int(s)),
}


@pytest.mark.parametrize("kind", list(STEP_KINDS))
@pytest.mark.parametrize("torch_cls,ours", [
    (torch.optim.AdamW, lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1)),
    (torch.optim.Adam, lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1, adam_w_mode=False)),
    (torch.optim.Adagrad, lambda ps: FusedAdagrad(ps, lr=1e-2, weight_decay=0.1)),
], ids=["adamw", "adam", "adagrad"])
def test_torch_checkpoint_with_any_step_kind_continues_as_torch(kind, torch_cls, ours):
    theirs_ps = params()
    theirs = torch_cls(theirs_ps, lr=1e-2, weight_decay=0.1)
    run(theirs_ps, theirs, 0, 3)
    sd = saved(theirs.state_dict())
    for st in sd["state"].values():
        st["step"] = STEP_KINDS[kind](st["step"].item())
    # torch itself continues from that dict...
    resumed_ps = twin(theirs_ps)
    resumed = torch_cls(resumed_ps, lr=1e-2, weight_decay=0.1)
    resumed.load_state_dict(copy.deepcopy(sd))
    # ...and so does tritamp
    our_ps = twin(theirs_ps)
    opt = ours(our_ps)
    opt.load_state_dict(sd)
    for p in our_ps:
        step = opt.state[p]["step"]
        assert step.dtype == torch.float32 and step.shape == () and step.item() == 3
    run(resumed_ps, resumed, 3, 3)
    run(our_ps, opt, 3, 3)
    assert_same(our_ps, resumed_ps, exact=False)
    assert all(opt.state[p]["step"].item() == 6 for p in our_ps)


@pytest.mark.parametrize("kind", list(STEP_KINDS))
def test_own_checkpoint_with_int_steps_resumes_bitwise(kind):
    ps = params()
    opt = FusedAdam(ps, lr=1e-2)
    run(ps, opt, 0, 2)
    sd = saved(opt.state_dict())
    for st in sd["state"].values():
        st["step"] = STEP_KINDS[kind](st["step"].item())
    copy_ps = twin(ps)
    resumed = FusedAdam(copy_ps, lr=1e-2)
    resumed.load_state_dict(sd)
    run(ps, opt, 2, 2)
    run(copy_ps, resumed, 2, 2)
    assert_same(copy_ps, ps)


# =====================================================================================
# interchange with torch.optim, both ways
# =====================================================================================

INTERCHANGE = {
    # name: (tritamp optimizer, torch optimizer), both over the same hyperparameters
    "adamw": (lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    "adam-l2": (lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1, adam_w_mode=False),
                lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1)),
    "adamw-into-torch-adam": (lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1),
                              lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1,
                                                          decoupled_weight_decay=True)),
    "sgd-momentum": (lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)),
    "sgd-nesterov": (lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, nesterov=True),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)),
    "sgd-plain": (lambda ps: FusedSGD(ps, lr=0.1),
                  lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "adagrad": (lambda ps: FusedAdagrad(ps, lr=0.1, weight_decay=0.01),
                lambda ps: torch.optim.Adagrad(ps, lr=0.1, weight_decay=0.01)),
}


@pytest.mark.parametrize("case", list(INTERCHANGE))
def test_tritamp_checkpoint_continues_in_torch(case):
    make_ours, make_theirs = INTERCHANGE[case]
    ps = params()
    opt = make_ours(ps)
    run(ps, opt, 0, 3)
    sd = saved(opt.state_dict())
    theirs_ps = twin(ps)
    theirs = make_theirs(theirs_ps)
    theirs.load_state_dict(sd)
    run(ps, opt, 3, 3)
    run(theirs_ps, theirs, 3, 3)
    assert_same(ps, theirs_ps, exact=False)


@pytest.mark.parametrize("case", list(INTERCHANGE))
def test_torch_checkpoint_continues_in_tritamp(case):
    make_ours, make_theirs = INTERCHANGE[case]
    theirs_ps = params()
    theirs = make_theirs(theirs_ps)
    run(theirs_ps, theirs, 0, 3)
    ps = twin(theirs_ps)
    opt = make_ours(ps)
    opt.load_state_dict(saved(theirs.state_dict()))
    for st in opt.state.values():
        assert all(v.dtype == torch.float32 for v in st.values())
    run(ps, opt, 3, 3)
    run(theirs_ps, theirs, 3, 3)
    assert_same(ps, theirs_ps, exact=False)


def test_master_that_went_through_torch_is_not_loaded():
    """torch.optim keeps a master_param it does not know, cast to the bf16 parameter's
    dtype, and never updates it: loaded back as the master, its first step wrote the
    weights from before torch's steps. It is not loaded (a warning says so): the step is
    the one of a checkpoint without it, the master starting from the loaded weights."""
    ps = params(dtypes=[torch.bfloat16] * len(SHAPES))
    opt = FusedAdam(ps, lr=1e-2, master_weights=True)
    run(ps, opt, 0, 2)
    theirs = torch.optim.AdamW(ps, lr=1e-2)
    theirs.load_state_dict(saved(opt.state_dict()))
    run(ps, theirs, 2, 5)  # torch moves the weights; its master_param stays as loaded
    sd = saved(theirs.state_dict())
    assert all(st["master_param"].dtype == torch.bfloat16 for st in sd["state"].values())
    without = copy.deepcopy(sd)
    for st in without["state"].values():
        del st["master_param"]
    a, b = twin(ps), twin(ps)
    opt_a = FusedAdam(a, lr=1e-2, master_weights=True)
    with pytest.warns(UserWarning, match=r"'master_param' of parameter\(s\) 0 "
                                         r"\(torch\.bfloat16\), 1 .* is not fp32"):
        opt_a.load_state_dict(sd)
    opt_b = FusedAdam(b, lr=1e-2, master_weights=True)
    opt_b.load_state_dict(without)
    run(a, opt_a, 7, 2)
    run(b, opt_b, 7, 2)
    assert_same(a, b)
    assert all(st["master_param"].dtype == torch.float32 for st in opt_a.state.values())


def test_torch_adam_l2_checkpoint_is_refused_by_an_adamw_mode_fused_adam():
    theirs_ps = params()
    theirs = torch.optim.Adam(theirs_ps, lr=1e-2, weight_decay=0.1)
    run(theirs_ps, theirs, 0, 2)
    ps = twin(theirs_ps)
    opt = FusedAdam(ps, lr=1e-2, weight_decay=0.1)
    run(ps, opt, 0, 1)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"decoupled_weight_decay=False and weight_decay=0\.1 "
                                         r".*adam_w_mode=False"):
        opt.load_state_dict(saved(theirs.state_dict()))
    assert_unchanged(before, opt)


def test_torch_adagrad_checkpoint_with_weight_decay_is_refused_by_a_w_mode_fused_adagrad():
    """torch.optim.Adagrad's weight decay is an L2 penalty (its only rule): continued with
    decoupled decay the run went elsewhere, silently."""
    theirs_ps = params()
    theirs = torch.optim.Adagrad(theirs_ps, lr=0.1, weight_decay=0.5)
    run(theirs_ps, theirs, 0, 2)
    opt = FusedAdagrad(twin(theirs_ps), lr=0.1, weight_decay=0.5, adagrad_w_mode=True)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"as an L2 penalty \(torch\.optim\.Adagrad's only "
                                         r"rule\).*adagrad_w_mode=False\)"):
        opt.load_state_dict(saved(theirs.state_dict()))
    assert_unchanged(before, opt)
    # without weight decay the two rules are one: it loads
    plain = torch.optim.Adagrad(theirs_ps, lr=0.1)
    run(theirs_ps, plain, 2, 1)
    FusedAdagrad(twin(theirs_ps), lr=0.1, adagrad_w_mode=True).load_state_dict(
        saved(plain.state_dict()))


def test_old_torch_sgd_checkpoint_with_none_momentum_buffers_loads():
    # torch before 2.0 saved momentum_buffer=None for every parameter of an SGD without momentum
    theirs_ps = params()
    theirs = torch.optim.SGD(theirs_ps, lr=0.1)
    run(theirs_ps, theirs, 0, 2)
    sd = saved(theirs.state_dict())
    sd["state"] = {i: {"momentum_buffer": None} for i in range(len(theirs_ps))}
    ps = twin(theirs_ps)
    opt = FusedSGD(ps, lr=0.1)
    opt.load_state_dict(sd)
    assert all(not opt.state[p] for p in ps)
    run(ps, opt, 2, 2)
    run(theirs_ps, theirs, 2, 2)
    assert_same(ps, theirs_ps, exact=False)


# =====================================================================================
# Apex's checkpoints, built by hand in Apex's layout
# =====================================================================================

def apex_layout(sd, per_group_step, step_count):
    """A tritamp state dict in Apex's layout: the step count of each group in the group,
    none per parameter, and no ``decoupled_weight_decay`` (Apex's groups have none)."""
    sd = copy.deepcopy(sd)
    for st in sd["state"].values():
        st.pop("step", None)
    for group in sd["param_groups"]:
        group.pop("decoupled_weight_decay", None)
        if per_group_step:
            group["step"] = step_count(3)
    return sd


APEX_STEPS = {"int": int, "capturable-int32-tensor": lambda n: torch.tensor([n], dtype=torch.int32)}


@pytest.mark.parametrize("step_kind", list(APEX_STEPS))
@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_apex_checkpoint_with_group_step_continues_bias_correction(name, step_kind):
    make = {"adam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
            "lamb": lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.01)}[name]
    ps = params()
    opt = make(ps)
    run(ps, opt, 0, 3)
    sd = saved(apex_layout(opt.state_dict(), True, APEX_STEPS[step_kind]))
    assert all(set(st) == {"exp_avg", "exp_avg_sq"} for st in sd["state"].values())
    copy_ps = twin(ps)
    resumed = make(copy_ps)
    resumed.load_state_dict(sd)
    assert "step" not in resumed.param_groups[0]
    assert all(resumed.state[p]["step"].item() == 3 for p in copy_ps)
    run(ps, opt, 3, 3)
    run(copy_ps, resumed, 3, 3)
    assert_same(copy_ps, ps)


def test_apex_fused_adam_checkpoint_continues_as_torch_adamw():
    theirs_ps = params()
    theirs = torch.optim.AdamW(theirs_ps, lr=1e-2, weight_decay=0.01)
    run(theirs_ps, theirs, 0, 3)
    tsd = theirs.state_dict()
    # Apex's FusedAdam.state_dict(): torch's layout, step kept in the group
    sd = {"state": {i: {"exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}
                    for i, st in tsd["state"].items()},
          "param_groups": [{"lr": 1e-2, "bias_correction": True, "betas": (0.9, 0.999),
                            "eps": 1e-8, "weight_decay": 0.01, "step": 3,
                            "params": tsd["param_groups"][0]["params"]}]}
    ps = twin(theirs_ps)
    opt = FusedAdam(ps, lr=1e-2, weight_decay=0.01)
    opt.load_state_dict(saved(sd))
    run(ps, opt, 3, 3)
    run(theirs_ps, theirs, 3, 3)
    assert_same(ps, theirs_ps, exact=False)


def test_apex_fused_novograd_checkpoint_with_per_group_norms():
    # one group of fp16 and fp32 parameters: Apex keeps group["exp_avg_sq"] =
    # [norms of the fp16 parameters, norms of the fp32 ones] and exp_avg in the
    # parameter's dtype
    dtypes = [torch.float16, torch.float32, torch.float16, torch.float32]
    shapes = ((3, 4), (5,), (6,), (1,))
    ps = params(shapes, dtypes)
    opt = FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01)
    run(ps, opt, 0, 3)
    sd = opt.state_dict()
    apex = apex_layout(sd, True, int)
    norms = [[], []]
    for i, p in enumerate(ps):
        st = apex["state"][i]
        norms[p.dtype == torch.float32].append(st.pop("exp_avg_sq"))
        st["exp_avg"] = st["exp_avg"].to(p.dtype)
        # the uninterrupted run from the same (rounded) moment, to compare bitwise
        opt.state[p]["exp_avg"].copy_(st["exp_avg"].float())
    apex["param_groups"][0]["exp_avg_sq"] = [torch.stack(norms[0]), torch.stack(norms[1])]
    copy_ps = twin(ps)
    resumed = FusedNovoGrad(copy_ps, lr=1e-2, weight_decay=0.01)
    resumed.load_state_dict(saved(apex))
    assert "exp_avg_sq" not in resumed.param_groups[0] and "step" not in resumed.param_groups[0]
    for p, q in zip(ps, copy_ps):
        assert_bits_equal(resumed.state[q]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
        assert resumed.state[q]["step"].item() == 3
    run(ps, opt, 3, 3)
    run(copy_ps, resumed, 3, 3)
    assert_same(copy_ps, ps)


def test_apex_fused_novograd_norms_of_another_model_are_refused():
    ps = params()
    opt = FusedNovoGrad(ps, lr=1e-2)
    run(ps, opt, 0, 2)
    apex = apex_layout(opt.state_dict(), True, int)
    for st in apex["state"].values():
        st.pop("exp_avg_sq")
    apex["param_groups"][0]["exp_avg_sq"] = [torch.zeros(0), torch.ones(2)]  # 3 fp32 params
    fresh = FusedNovoGrad(twin(ps), lr=1e-2)
    before = snapshot(fresh)
    with pytest.raises(ValueError, match=r"keeps 2 second-moment norms for float32 parameters "
                                         r"\(exp_avg_sq\[1\]\) but has 3"):
        fresh.load_state_dict(apex)
    assert_unchanged(before, fresh)


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_apex_checkpoint_without_step_counts(name):
    # Apex's FusedSGD keeps momentum_buffer alone, its FusedAdagrad sum alone
    make = {"sgd": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
            "adagrad": lambda ps: FusedAdagrad(ps, lr=0.1)}[name]
    ps = params()
    opt = make(ps)
    run(ps, opt, 0, 3)
    sd = saved(apex_layout(opt.state_dict(), False, int))
    copy_ps = twin(ps)
    resumed = make(copy_ps)
    resumed.load_state_dict(sd)
    run(ps, opt, 3, 3)
    run(copy_ps, resumed, 3, 3)
    assert_same(copy_ps, ps)


# =====================================================================================
# checked before anything is loaded; a refused load changes nothing
# =====================================================================================

def trained_adam():
    ps = params()
    opt = FusedAdam(ps, lr=1e-2)
    run(ps, opt, 0, 2)
    return ps, opt


def _without(key, index):
    def edit(sd):
        del sd["state"][index][key]
    return edit


def _set(key, index, value):
    def edit(sd):
        sd["state"][index][key] = value
    return edit


def _group(key, value, **more):
    def edit(sd):
        sd["param_groups"][0][key] = value
        sd["param_groups"][0].update(more)
    return edit


REFUSED = {
    "missing-exp_avg_sq": (_without("exp_avg_sq", 1), ValueError,
                           r"state of parameter 1 has 'exp_avg', 'step' but no 'exp_avg_sq'"),
    "missing-exp_avg": (_without("exp_avg", 2), ValueError,
                        r"state of parameter 2 has 'exp_avg_sq', 'step' but no 'exp_avg'"),
    "missing-step": (_without("step", 0), ValueError,
                     r"state of parameter 0 has 'exp_avg', 'exp_avg_sq' but no 'step'"),
    "wrong-shape": (_set("exp_avg", 1, torch.zeros(4)), ValueError,
                    r"state 'exp_avg' of parameter 1 has shape \(4,\) but the parameter has "
                    r"shape \(5,\)"),
    "transposed": (_set("exp_avg_sq", 0, torch.zeros(4, 3)), ValueError,
                   r"state 'exp_avg_sq' of parameter 0 has shape \(4, 3\) but the parameter "
                   r"has shape \(3, 4\)"),
    "zero-dim-moment": (_set("exp_avg", 1, torch.zeros(())), ValueError,
                        r"state 'exp_avg' of parameter 1 has shape \(\) but the parameter has "
                        r"shape \(5,\)"),
    "master-wrong-shape": (_set("master_param", 1, torch.zeros(6)), ValueError,
                           r"state 'master_param' of parameter 1 has shape \(6,\)"),
    "moment-not-a-tensor": (_set("exp_avg", 0, [0.0] * 12), TypeError,
                            r"state 'exp_avg' of parameter 0 is list"),
    "integer-moment": (_set("exp_avg", 1, torch.zeros(5, dtype=torch.int64)), TypeError,
                       r"state 'exp_avg' of parameter 1 is a int64 tensor"),
    "negative-step": (_set("step", 1, torch.tensor(-1.0)), ValueError,
                      r"state 'step' of parameter 1 is -1\.0; a step count is a whole number"),
    "nan-step": (_set("step", 0, float("nan")), ValueError, r"state 'step' of parameter 0 is nan"),
    "two-element-step": (_set("step", 0, torch.tensor([1.0, 2.0])), ValueError,
                         r"state 'step' of parameter 0 has shape \(2,\), expected one element"),
    "step-string": (_set("step", 0, "3"), TypeError, r"state 'step' of parameter 0 is str '3'"),
    "negative-group-step": (_group("step", -2), ValueError,
                            r"'step' of parameter group 0 is -2"),
    "negative-lr": (_group("lr", -0.1), ValueError,
                    r"Invalid learning rate: -0\.1 \(parameter group 0 of the state dict\)"),
    "beta": (_group("betas", (0.9, 1.0)), ValueError, r"Invalid beta parameter at index 1: 1\.0"),
    "amsgrad": (_group("amsgrad", True), ValueError, r"AMSGrad"),
    "maximize": (_group("maximize", True), ValueError, r"maximize=True"),
    "group-count": (lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0], params=[])),
                    ValueError, r"different number of parameter groups \(2 saved, 1"),
    "group-size": (lambda sd: sd["param_groups"][0]["params"].pop(), ValueError,
                   r"doesn't match the size of optimizer's group \(group 0: 2 parameters saved, 3"),
    "not-a-state-dict": (lambda sd: sd.pop("state"), ValueError, r"has no 'state' entry"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_state_dict_is_refused_and_changes_nothing(case):
    edit, kind, match = REFUSED[case]
    ps, opt = trained_adam()
    src_ps, src = trained_adam()
    sd = saved(src.state_dict())
    if case.startswith("master"):
        for i in sd["state"]:
            sd["state"][i]["master_param"] = torch.zeros(ps[i].shape)
    edit(sd)
    before = snapshot(opt)
    gen, epoch = generation_of(opt), opt.state.epoch.value
    with pytest.raises(kind, match=match):
        opt.load_state_dict(sd)
    assert_unchanged(before, opt)
    assert (generation_of(opt), opt.state.epoch.value) == (gen, epoch)
    # it still steps as an optimizer that never saw the dict
    twin_ps, twin_opt = trained_adam()
    run(ps, opt, 2, 1)
    run(twin_ps, twin_opt, 2, 1)
    assert_same(ps, twin_ps)


@pytest.mark.parametrize("make,edit,match", [
    (lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9),
     _set("momentum_buffer", 0, torch.zeros(12)),
     r"'momentum_buffer' of parameter 0 has shape \(12,\)"),
    (lambda ps: FusedAdagrad(ps), _without("sum", 1),
     r"state of parameter 1 has 'step' but no 'sum'"),
    (lambda ps: FusedAdagrad(ps), _group("lr_decay", 0.1), r"lr_decay"),
    (lambda ps: FusedAdagrad(ps, weight_decay=0.1, adagrad_w_mode=True),
     _group("adagrad_w_mode", False),
     r"weight_decay=0\.1 as an L2 penalty \(adagrad_w_mode=False\), but this FusedAdagrad "
     r"has adagrad_w_mode=True: construct FusedAdagrad\(\.\.\., adagrad_w_mode=False\)"),
    (lambda ps: FusedNovoGrad(ps), _without("exp_avg", 2),
     r"state of parameter 2 has 'step', 'exp_avg_sq' but no 'exp_avg'"),
    (lambda ps: FusedNovoGrad(ps), _set("exp_avg_sq", 0, torch.zeros(2)),
     r"state 'exp_avg_sq' of parameter 0 has shape \(2,\), expected one element"),
    (lambda ps: FusedNovoGrad(ps), _group("norm_type", 1), r"norm_type"),
    (lambda ps: FusedLAMB(ps), _without("exp_avg_sq", 0),
     r"state of parameter 0 has 'exp_avg', 'step' but no 'exp_avg_sq'"),
    (lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9), _group("nesterov", True, momentum=0.0),
     r"Nesterov momentum requires a momentum and zero dampening; got momentum=0\.0"),
    (lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9), _group("nesterov", True, dampening=0.5),
     r"zero dampening; got momentum=0\.9, dampening=0\.5 \(parameter group 0 of the state"),
], ids=["sgd", "adagrad", "adagrad-lr-decay", "adagrad-w-mode", "novograd", "novograd-moment-shape",
        "novograd-norm-type", "lamb", "sgd-nesterov-no-momentum", "sgd-nesterov-dampening"])
def test_every_optimizer_refuses_a_bad_state_and_changes_nothing(make, edit, match):
    ps = params()
    opt = make(ps)
    run(ps, opt, 0, 2)
    sd = saved(opt.state_dict())
    edit(sd)
    before = snapshot(opt)
    with pytest.raises((ValueError, TypeError), match=match):
        opt.load_state_dict(sd)
    assert_unchanged(before, opt)


@pytest.mark.parametrize("cls", [FusedAdam, FusedAdagrad, FusedSGD, FusedLAMB, FusedNovoGrad])
def test_a_bad_stochastic_rounding_seed_is_refused_at_load(cls):
    """FusedAdagrad took a negative seed from a state dict and stepped with it."""
    ps = params(dtypes=[torch.bfloat16] * len(SHAPES))
    opt = cls(ps, lr=1e-2, stochastic_rounding=True, seed=1)
    run(ps, opt, 0, 2)
    sd = saved(opt.state_dict())
    sd["param_groups"][0]["seed"] = -7
    before = snapshot(opt)
    with pytest.raises(ValueError, match=rf"{cls.__name__}: seed must be in \[0, 2\*\*64\) "
                                         r"\(parameter group 0 of the state dict\), got -7"):
        opt.load_state_dict(sd)
    assert_unchanged(before, opt)


def test_torch_amsgrad_checkpoint_is_refused():
    theirs_ps = params()
    theirs = torch.optim.Adam(theirs_ps, lr=1e-2, amsgrad=True)
    run(theirs_ps, theirs, 0, 2)
    opt = FusedAdam(twin(theirs_ps), lr=1e-2)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"AMSGrad variant \(amsgrad=True \(parameter group 0 "
                                         r"of the state dict\)\)"):
        opt.load_state_dict(saved(theirs.state_dict()))
    assert_unchanged(before, opt)


def test_load_hooks_run_once_around_the_checked_dict():
    ps, opt = trained_adam()
    sd = saved(opt.state_dict())
    calls = []

    def pre(optimizer, state_dict):
        calls.append("pre")
        state_dict = dict(state_dict)
        state_dict["param_groups"] = [dict(g, lr=0.5) for g in state_dict["param_groups"]]
        return state_dict

    opt.register_load_state_dict_pre_hook(pre)
    opt.register_load_state_dict_post_hook(lambda optimizer: calls.append("post"))
    opt.load_state_dict(sd)
    assert calls == ["pre", "post"]
    assert opt.param_groups[0]["lr"] == 0.5
    calls.clear()
    sd["param_groups"][0]["lr"] = -1.0  # the hook's value is the one checked and loaded
    opt.load_state_dict(sd)
    assert calls == ["pre", "post"]


def test_state_stays_fp32_for_half_parameters_and_loads_onto_their_layout():
    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    ps = params(dtypes=dtypes)
    opt = FusedAdam(ps, lr=1e-2, master_weights=True)
    run(ps, opt, 0, 2)
    sd = saved(opt.state_dict())
    copy_ps = twin(ps)
    resumed = FusedAdam(copy_ps, lr=1e-2, master_weights=True)
    resumed.load_state_dict(sd)
    for p, q in zip(ps, copy_ps):
        assert opt.state[p].keys() == resumed.state[q].keys()
        for k, v in opt.state[p].items():
            assert_bits_equal(resumed.state[q][k], v, k)
            assert resumed.state[q][k].data_ptr() != sd["state"][0][k].data_ptr()
    run(ps, opt, 2, 2)
    run(copy_ps, resumed, 2, 2)
    assert_same(copy_ps, ps)


@pytest.mark.parametrize("cls,kw,bad,match", [
    (FusedAdam, {}, lambda t: t.bool(),
     r"state 'kahan_comp' of parameter 0 is a bool tensor of shape \(3, 4\), expected a "
     r"floating-point tensor"),
    (FusedSGD, dict(lr=0.1, momentum=0.9), lambda t: torch.ones(7, dtype=torch.int64),
     r"'kahan_comp' of parameter 0 is a int64 tensor of shape \(7,\)"),
    (FusedLAMB, {}, lambda t: "oops", r"'kahan_comp' of parameter 0 is str 'oops'"),
    (FusedNovoGrad, {}, lambda t: t[:1].clone(), r"'kahan_comp' of parameter 0 has shape "
                                                 r"\(1, 4\)"),
    (FusedAdagrad, {}, lambda t: t.int(), r"'kahan_comp' of parameter 0 is a int32 tensor"),
], ids=["adam-bool", "sgd-int64", "lamb-str", "novograd-shape", "adagrad-int32"])
def test_a_kahan_compensation_that_is_not_a_float_tensor_is_refused(cls, kw, bad, match):
    # (a bool one was loaded as 1.0 and moved the weights at a step with a zero gradient)
    ps = params(dtypes=[torch.bfloat16] * len(SHAPES))
    opt = cls(ps, kahan_summation=True, **kw)
    run(ps, opt, 0, 2)
    sd = saved(opt.state_dict())
    sd["state"][0]["kahan_comp"] = bad(sd["state"][0]["kahan_comp"])
    before = snapshot(opt)
    with pytest.raises(ValueError if "has shape" in match else TypeError, match=match):
        opt.load_state_dict(sd)
    assert_unchanged(before, opt)


@pytest.mark.parametrize("make", [
    lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1, adam_w_mode=False),
    lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: FusedLAMB(ps, lr=1e-2),
    lambda ps: FusedNovoGrad(ps, lr=1e-2),
    lambda ps: FusedAdagrad(ps, lr=1e-2, weight_decay=0.1, adagrad_w_mode=True),
    lambda ps: FusedAdam(ps, lr=1e-2, master_weights=True),
], ids=["adam-l2", "sgd-nesterov", "lamb", "novograd", "adagrad-w", "adam-masters"])
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_pickled_or_copied_optimizer_steps_on_as_the_original(make, how):
    # torch's Optimizer pickles (defaults, state, param_groups) only: the optimizer's own
    # settings (adam_w_mode, master_weights, the rounding mode) were lost, and the copy's
    # first step raised
    import pickle
    dtypes = [torch.bfloat16, torch.float32, torch.float16]
    ps = params(dtypes=dtypes)
    opt = make(ps)
    run(ps, opt, 0, 2)
    ps2, opt2 = (pickle.loads(pickle.dumps((ps, opt))) if how == "pickle"
                 else copy.deepcopy((ps, opt)))
    run(ps, opt, 2, 2)
    run(ps2, opt2, 2, 2)
    for a, b in zip(ps, ps2):
        assert_bits_equal(a.detach(), b.detach(), "parameter")


def test_meta_tensors_in_a_checkpoint_are_refused_by_name_and_nothing_loads():
    # (refused before, but in torch's words: "Cannot copy out of meta tensor", ".item()
    # cannot be called on meta tensors")
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = FusedAdam([p], lr=0.1)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    for edit, match in (
            (lambda s: s["state"][0].__setitem__("exp_avg", torch.empty(3, device="meta")),
             r"FusedAdam.load_state_dict: state 'exp_avg' of parameter 0 is on the meta "
             r"device, which holds no data"),
            (lambda s: s["state"][0].__setitem__("step", torch.tensor(1.0, device="meta")),
             r"FusedAdam.load_state_dict: state 'step' of parameter 0 is on the meta device"),
            (lambda s: s["param_groups"][0].__setitem__("lr", torch.tensor(0.1, device="meta")),
             r"Tensor lr is on the meta device, which holds no data \(parameter group 0 of "
             r"the state dict\)")):
        broken = copy.deepcopy(saved)
        edit(broken)
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(broken)
        assert torch.equal(opt.state[p]["exp_avg"], saved["state"][0]["exp_avg"])
        assert opt.param_groups[0]["lr"] == 0.1
