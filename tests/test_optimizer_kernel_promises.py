"""Promises of the optimizer kernels' production CPU path (kernels/adam.py, sgd.py,
adagrad.py, lamb.py, novograd.py) that the broader CPU-path tests leave unpinned, found
by mutation testing: Adam's bf16 moments stored back from their fp32 scratch; the
unscaled gradients written back for torch's GradScaler (Adam), and NovoGrad's moments
seeing them unscaled once; LAMB's trust ratio on an all-zero parameter and its bias
corrections without grad averaging; NovoGrad's eps without bias correction; a skipped
step keeping -0.0 moments bitwise; SGD's refusal of a one-element parameter without a
momentum buffer; the stochastic-rounding key of LAMB's and NovoGrad's bf16 parameters.
Each runs the production CPU path (conftest's ``cpu_path``) against the kernels'
``*_ref`` oracles on tiny tensors.
"""
import math

import pytest
import torch

from conftest import (all_tensors, assert_bits_unchanged, assert_close_to_ref, clone_lists,
                      snapshot)
from tritamp.kernels import rounding
from tritamp.kernels.adagrad import adagrad_step
from tritamp.kernels.adam import adam_step, adam_step_ref
from tritamp.kernels.lamb import lamb_step, lamb_step_ref
from tritamp.kernels.novograd import novograd_step, novograd_step_ref
from tritamp.kernels.sgd import sgd_step

ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
LAMB = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6)
NOVOGRAD = dict(lr=1e-2, beta1=0.95, beta2=0.98, eps=1e-8, weight_decay=0.01)


def _lists(shapes, n_state, seed=0, moment_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    state = [[(torch.rand(s, generator=gen) * 0.1).to(moment_dtype) for s in shapes]
             for _ in range(n_state)]
    steps = [torch.full((), 2.0) for _ in shapes]
    return params, grads, state, steps


def test_adam_bf16_moments_are_stored_back_after_the_step(cpu_path):
    # The fused CPU kernel steps fp32 scratch copies of bf16 moments: both must land.
    params, grads, (m, v), steps = _lists(((5,), (2, 3)), 2, moment_dtype=torch.bfloat16)
    ours = [params, m, v, steps]
    ref = clone_lists(ours)
    for _ in range(2):
        adam_step(ours[0], grads, ours[1], ours[2], ours[3], **ADAM)
        adam_step_ref(ref[0], grads, ref[1], ref[2], ref[3], **ADAM)
    for name, a, b in zip(("params", "exp_avgs", "exp_avg_sqs", "steps"), ours, ref):
        assert_close_to_ref(a, b, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_adam_write_grads_leaves_the_unscaled_gradients(dtype, cpu_path):
    params, grads, (m, v), steps = _lists(((4,), (3,)), 2)
    params = [p.to(dtype) for p in params]
    scaled = [(g * 1024).to(dtype) for g in grads]
    adam_step(params, scaled, m, v, steps, **ADAM, grad_scale=torch.tensor(1024.0),
              write_grads=True)
    for g, s in zip(grads, scaled):
        assert torch.equal(s, g.to(dtype))  # a power-of-two scale unscales exactly


@pytest.mark.parametrize("kw", [dict(weight_decay=0.01), dict(weight_decay=0.0, use_nvlamb=True)],
                         ids=["decay", "nvlamb"])
def test_lamb_all_zero_parameter_takes_the_plain_lr_step(kw, cpu_path):
    # ||p|| == 0: the trust ratio is lr itself (not lr * 0), so the parameter moves.
    params, grads, (m, v), steps = _lists(((4,), (3,)), 2)
    params[0].zero_()
    ours = [params, m, v, steps]
    ref = clone_lists(ours)
    lamb_step(*ours[:1], grads, *ours[1:], **LAMB, **kw)
    lamb_step_ref(*ref[:1], grads, *ref[1:], **LAMB, **kw)
    assert params[0].abs().max() > 0
    for name, a, b in zip(("params", "exp_avgs", "exp_avg_sqs", "steps"), ours, ref):
        assert_close_to_ref(a, b, name)


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["decoupled", "l2"])
def test_lamb_without_grad_averaging_keeps_bias_correction(adam_w_mode, cpu_path):
    # grad_averaging=False runs LAMB's foreach moments: both corrections still apply.
    params, grads, (m, v), steps = _lists(((6,), (2, 2)), 2)
    for s in steps:
        s.zero_()  # the first steps: bc1 = 0.1, bc2 = 0.001, far from 1
    ours = [params, m, v, steps]
    ref = clone_lists(ours)
    kw = dict(LAMB, weight_decay=0.01, adam_w_mode=adam_w_mode, grad_averaging=False)
    for _ in range(2):
        lamb_step(*ours[:1], grads, *ours[1:], **kw)
        lamb_step_ref(*ref[:1], grads, *ref[1:], **kw)
    for name, a, b in zip(("params", "exp_avgs", "exp_avg_sqs", "steps"), ours, ref):
        assert_close_to_ref(a, b, name)


def test_novograd_without_bias_correction_adds_eps_to_the_denominator(cpu_path):
    # eps of the gradient norms' size: leaving it out would double the update.
    params, grads, (m,), steps = _lists(((5,), (3,)), 1)
    vs = [torch.full((), 0.5) for _ in params]
    ours = [params, m, vs, steps]
    ref = clone_lists(ours)
    kw = dict(NOVOGRAD, eps=0.5, bias_correction=False)
    novograd_step(ours[0], grads, *ours[1:], **kw)
    novograd_step_ref(ref[0], grads, *ref[1:], **kw)
    for name, a, b in zip(("params", "exp_avgs", "exp_avg_sqs", "steps"), ours, ref):
        assert_close_to_ref(a, b, name)


@pytest.mark.parametrize("reg_inside_moment", [False, True], ids=["decoupled", "reg_inside"])
def test_novograd_write_grads_unscales_once(reg_inside_moment, cpu_path):
    # The moments see the gradients unscaled once, as a step on unscaled gradients does
    # (NovoGrad's update is nearly scale-free: the first moment is where it shows).
    params, grads, (m,), steps = _lists(((5,), (3,)), 1)
    vs = [torch.full((), 0.5) for _ in params]
    ours = [params, m, vs, steps]
    ref = clone_lists(ours)
    kw = dict(NOVOGRAD, reg_inside_moment=reg_inside_moment)
    scaled = [g * 1024 for g in grads]
    novograd_step(ours[0], scaled, *ours[1:], **kw, grad_scale=torch.tensor(1024.0),
                  found_inf=torch.tensor(0.0), write_grads=True)
    novograd_step_ref(ref[0], grads, *ref[1:], **kw)
    assert all(torch.equal(s, g) for s, g in zip(scaled, grads))
    for name, a, b in zip(("params", "exp_avgs", "exp_avg_sqs", "steps"), ours, ref):
        assert_close_to_ref(a, b, name)


@pytest.mark.parametrize("op,decay_in_gradient", [("lamb", False), ("lamb", True),
                                                   ("novograd", False), ("novograd", True)],
                         ids=["lamb", "lamb-l2", "novograd", "novograd-reg_inside"])
def test_skipped_step_keeps_negative_zero_moments(op, decay_in_gradient, cpu_path):
    # The gated gradient of a skipped step is -0.0: m + (-0.0) keeps a -0.0 moment's sign.
    # (A -0.0 moment comes from a loaded state only; a skipped step still keeps it.)
    # With the decay added to the gradient (LAMB's L2 mode, NovoGrad's reg_inside_moment)
    # a gated 0 * p added to it gave +0.0, and a +0.0 moment.
    params, grads, (m, v), steps = _lists(((6,),), 2)
    params[0][:3] = torch.tensor([1.0, 2.0, -1.0])
    m[0][:3] = -0.0
    grads[0][1] = math.inf
    if op == "novograd":
        v = [torch.full((), 0.5)]
    else:  # v + (1 - beta2) * g * g with the gated g gave +0.0 for a -0.0 element
        v[0][4] = -0.0
    lists = [params, m, v, steps]
    everything = all_tensors(grads, *lists)
    start = snapshot(everything)
    found = torch.tensor(1.0)
    if op == "lamb":  # without grad averaging: LAMB's foreach moments, gated gradient
        lamb_step(params, grads, m, v, steps, **LAMB, weight_decay=0.01, grad_averaging=False,
                  adam_w_mode=not decay_in_gradient, found_inf=found)
    else:
        novograd_step(params, grads, m, v, steps, **NOVOGRAD, found_inf=found,
                      reg_inside_moment=decay_in_gradient)
    assert_bits_unchanged(start, everything)


def _one_step(op, **amp):
    """One step of ``op`` on fresh tiny lists: (every tensor it may write, the call)."""
    params, grads, (m, v), steps = _lists(((5,), (3,)), 2)
    if op == "novograd":
        v = [torch.full((), 0.5), torch.full((), 0.5)]
    calls = {
        "adam": lambda: adam_step(params, grads, m, v, steps, **ADAM, **amp),
        "sgd": lambda: sgd_step(params, grads, m, lr=0.1, momentum=0.9, steps=steps, **amp),
        "adagrad": lambda: adagrad_step(params, grads, m, lr=0.1, eps=1e-8, steps=steps,
                                        **amp),
        "lamb": lambda: lamb_step(params, grads, m, v, steps, **LAMB, weight_decay=0.01,
                                  **amp),
        "novograd": lambda: novograd_step(params, grads, m, v, steps, **NOVOGRAD, **amp)}
    return all_tensors(params, grads, m, v, steps), calls[op]


AMP_ARGS = [("adam", "grad_scale"), ("adam", "found_inf"), ("sgd", "grad_scale"),
            ("sgd", "found_inf"), ("adagrad", "grad_scale"), ("adagrad", "found_inf"),
            ("lamb", "grad_scale"), ("lamb", "found_inf"), ("lamb", "global_grad_norm"),
            ("novograd", "grad_scale"), ("novograd", "found_inf")]


@pytest.mark.parametrize("op,name", AMP_ARGS, ids=["-".join(a) for a in AMP_ARGS])
def test_amp_tensors_not_one_value_on_the_tensors_device_are_refused_by_name(op, name,
                                                                            path):
    # One on the meta device was read as no scale (Adam advanced its step counts and
    # updated nothing, LAMB updated p but not m); two values were refused by torch after
    # part of the step, in words that named nothing.
    for bad, match in ((torch.tensor(1.0, device="meta"), rf"{name} is on meta but the "
                        r"tensors are on cpu; pass a tensor on cpu"),
                       (torch.tensor([1.0, 1.0]), rf"{name} must be a one-element tensor, "
                        r"got shape \(2,\); pass the"),
                       (1.0, rf"{name} must be a one-element tensor or None, got float")):
        everything, step = _one_step(op, **{name: bad})
        start = snapshot(everything)
        with pytest.raises((ValueError, TypeError), match=match):
            step()
        assert_bits_unchanged(start, everything)


@pytest.mark.parametrize("op", ["lamb", "novograd"])
def test_lamb_and_novograd_refuse_a_bad_lr_tensor_before_anything_is_written(op, path):
    # (their CPU path converted lr without the check the other steps make: m was updated,
    # and LAMB's step counts advanced, before torch refused an lr on another device)
    for bad, match in ((torch.tensor(0.1, device="meta"), r"lr is on meta but the tensors "
                        r"are on cpu"),
                       (torch.tensor([0.1, 0.1]), r"lr must be a float or a one-element "
                        r"tensor, got shape \(2,\)")):
        params, grads, (m, v), steps = _lists(((5,),), 2)
        if op == "novograd":
            v = [torch.full((), 0.5)]
        everything = all_tensors(params, grads, m, v, steps)
        start = snapshot(everything)
        kw = dict(LAMB, weight_decay=0.01) if op == "lamb" else dict(NOVOGRAD)
        kw["lr"] = bad
        step = lamb_step if op == "lamb" else novograd_step
        with pytest.raises(ValueError, match=match):
            step(params, grads, m, v, steps, **kw, found_inf=torch.tensor(0.0))
        assert_bits_unchanged(start, everything)


def test_sgd_one_element_parameter_without_momentum_buffer_is_refused(cpu_path):
    p = torch.ones(1)
    with pytest.raises(ValueError, match=r"momentum_buffers is None"):
        sgd_step([p], [torch.ones(1)], lr=0.1, momentum=0.9)
    assert torch.equal(p, torch.ones(1))


@pytest.mark.parametrize("op", ["lamb", "novograd"])
def test_stochastic_rounding_draws_the_oracles_key(op, cpu_path):
    # bf16 parameters rounded stochastically: the key mixes in the step count after this
    # step, so the CPU path rounds each value as the oracle does (fp32 values a last bit
    # apart could round apart only where the random threshold falls between them).
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(64, generator=gen).to(torch.bfloat16)]
    grads = [torch.randn(64, generator=gen).to(torch.bfloat16)]
    m = [torch.randn(64, generator=gen) * 0.1]
    v = [torch.rand(64, generator=gen) * 0.01] if op == "lamb" else [torch.full((), 2.0)]
    steps = [torch.tensor(3.0)]
    keys = [torch.tensor(rounding.param_key(1234, 0))]
    ours = [params, m, v, steps]
    ref = clone_lists(ours)
    step, step_ref, kw = ((lamb_step, lamb_step_ref, dict(LAMB, weight_decay=0.01))
                          if op == "lamb" else (novograd_step, novograd_step_ref, NOVOGRAD))
    step(ours[0], grads, *ours[1:], None, None, keys, **kw)
    step_ref(ref[0], grads, *ref[1:], None, None, keys, **kw)
    assert (ours[0][0] != ref[0][0]).sum() <= 1
