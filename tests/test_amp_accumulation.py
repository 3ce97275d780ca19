"""Optimizer state carried into initialize, accumulation without delay_unscale, and
delay_overflow_check."""
import pytest
import torch
import torch.nn as nn

from conftest import amp_step
from tritamp import amp


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


def test_delay_overflow_check_still_skips_but_keeps_the_scale():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    before = [p.clone() for p in amp.master_params(opt)]
    x, y = _batch()
    loss = nn.functional.mse_loss(model(x), y) * float("inf")
    with amp.scale_loss(loss, opt, delay_overflow_check=True) as scaled:
        scaled.backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, amp.master_params(opt)))
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 65536.0
    # a normal exit afterwards updates the scale again
    amp_step(model, opt, x, y, loss_fn=nn.functional.mse_loss, factor=float("inf"),
             zero_grad=False)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 32768.0
