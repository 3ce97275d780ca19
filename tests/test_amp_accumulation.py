"""Optimizer state carried into initialize, accumulation without delay_unscale, and
delay_overflow_check."""
import contextlib

import pytest
import torch
import torch.nn as nn

from conftest import amp_step
from tritamp import amp
from tritamp.optimizers import FusedAdam, FusedSGD


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(n=8):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


@pytest.mark.parametrize("opt_level,state_dtype", [("O2", torch.float32), ("O3", torch.float16)])
def test_existing_optimizer_state_is_recast_onto_the_new_parameters(opt_level, state_dtype):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _batch()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()  # momentum buffers now exist, keyed by the fp32 parameters
    buffers = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    params = list(amp.master_params(opt))
    assert len(opt.state) == len(params)
    for p, before in zip(params, buffers):
        buf = opt.state[p]["momentum_buffer"]
        assert buf.dtype == state_dtype
        assert torch.equal(buf, before.to(state_dtype))
    amp_step(model, opt, x, y, loss_fn=nn.functional.mse_loss, zero_grad=False)
    assert all(torch.isfinite(p).all() for p in amp.master_params(opt))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("fused", [False, True])
def test_accumulating_two_micro_batches_matches_one_batch(opt_level, fused):
    """Each scale_loss exit unscales its own gradients and adds those already there."""
    x, y = _batch(8)
    grads = []
    for micro in (False, True):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
        # a small scale: these summed losses overflow fp16 gradients at 2**16
        model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0, init_scale=256.)
        opt.zero_grad()
        chunks = [(x[:4], y[:4]), (x[4:], y[4:])] if micro else [(x, y)]
        for xb, yb in chunks:
            loss = nn.functional.mse_loss(model(xb), yb, reduction="sum")
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        list(amp.master_params(opt))  # leaves nothing scaled
        grads.append([p.grad.float().clone() for p in amp.master_params(opt)])
        assert all(torch.isfinite(g).all() for g in grads[-1])
    eps = torch.finfo(torch.float16).eps
    for a, b in zip(*grads):
        # The half forward of each micro-batch rounds differently from the full batch:
        # a few half-precision ulps of the gradient's norm. A lost micro-batch or a
        # gradient left scaled is off by 50% or by the scale.
        assert (a - b).norm() <= 4 * eps * b.norm()


def test_delay_overflow_check_is_ignored_the_step_skips_and_the_scale_backs_off():
    """Apex's placeholder (its only effect there: a step on inf/NaN gradients and no
    scale update) changes nothing: an overflow skips the step and halves the scale at
    this exit, every time (it used to keep the scale, so a loop passing the flag at
    every step skipped every step from the first overflow on, silently)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    before = [p.clone() for p in amp.master_params(opt)]
    x, y = _batch()
    for expected_scale in (32768.0, 16384.0):
        loss = nn.functional.mse_loss(model(x), y) * float("inf")
        opt.zero_grad()
        with amp.scale_loss(loss, opt, delay_overflow_check=True) as scaled:
            scaled.backward()
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, amp.master_params(opt)))
        assert amp.state_dict()["loss_scaler0"]["loss_scale"] == expected_scale
    # a finite step with the flag is taken
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    with amp.scale_loss(loss, opt, delay_overflow_check=True) as scaled:
        scaled.backward()
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, amp.master_params(opt)))
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 1


@pytest.mark.parametrize("path", ["kernel", "cpu"])
@pytest.mark.parametrize("make_opt", [
    lambda p: FusedSGD(p, lr=0.1), lambda p: FusedAdam(p, lr=0.1),
    lambda p: torch.optim.SGD(p, lr=0.1)], ids=["FusedSGD", "FusedAdam", "torch-SGD"])
def test_an_unscaled_gradient_the_backward_missed_is_stepped_as_it_is(make_opt, path):
    """O2: an fp32 parameter of the optimizer outside the model gets a gradient from an
    ordinary backward (a regulariser), then the scale_loss backward does not reach it.
    amp puts its gradient back unscaled, as Apex's stash did; a fused optimizer that reads
    the gradients scaled divided it by the loss scale again (FusedSGD moved it by 3e-6
    instead of 0.2)."""
    from tritamp.testing import force_cpu_path
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    extra = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    twin = torch.nn.Parameter(extra.detach().clone())
    opt = make_opt(list(model.parameters()) + [extra])
    ref = make_opt([twin])
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    with force_cpu_path() if path == "cpu" else contextlib.nullcontext():
        for _ in range(2):
            opt.zero_grad()
            ref.zero_grad()
            extra.pow(2).sum().backward()
            twin.pow(2).sum().backward()
            with amp.scale_loss(model(torch.randn(3, 4)).float().mean(), opt) as scaled:
                scaled.backward()
            torch.testing.assert_close(extra.grad, twin.grad, rtol=0, atol=0)
            opt.step()
            ref.step()
            torch.testing.assert_close(extra.detach(), twin.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("delay", [False, True], ids=["plain", "delay_unscale"])
@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.SGD(ps, lr=0.1),
                                      lambda ps: FusedSGD(ps, lr=0.1)],
                         ids=["torch-sgd", "fused-sgd"])
def test_flag_carried_over_zero_grad_is_dropped_by_an_accumulation_too(delay, make_opt, path):
    # An overflowing backward, no step, zero_grad(): the flag it left is about gradients
    # that are gone. The next scale_loss drops it, the first of a delay_unscale chain
    # included (it skipped the clean accumulated step, while the scaler counted that
    # backward as clean: no backoff, no skip counted, no message).
    model = _mlp()
    opt = make_opt(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    x, y = _batch()
    with amp.scale_loss(model(x).float().sum() * float("inf"), opt) as loss:
        loss.backward()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    for k, micro in enumerate((x[:4], x[4:])):
        with amp.scale_loss(model(micro).float().square().mean(), opt,
                            delay_unscale=delay and k == 0) as loss:
            loss.backward()
    opt.step()
    assert not amp.last_step_skipped(opt)
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    state = amp.state_dict()["loss_scaler0"]
    assert state["skipped"] == 1 and state["loss_scale"] == scale


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_one_overflowing_micro_batch_backs_the_scale_off_once(level, path):
    # Accumulation without delay_unscale: every exit checks its own backward; the
    # gradients an earlier exit of the step already judged are not judged again (their
    # overflow stands in the pending flag), so one inf backs off once, as in Apex.
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    x, y = _batch()
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    before = [p.detach().clone() for p in model.parameters()]
    for k in range(4):
        loss = nn.functional.mse_loss(model(x[2 * k:2 * k + 2]).float(), y[2 * k:2 * k + 2])
        with amp.scale_loss(loss * (float("inf") if k == 0 else 1.0), opt) as scaled:
            scaled.backward()
    opt.step()
    assert amp.last_step_skipped(opt)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == scale / 2
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
