"""CUDA checks: compiled kernels against their references, and a sync-free O2 step.

Skipped (with a reason) where no CUDA device is present; CI has none.
"""
import logging

import pytest
import torch
import torch.nn as nn

from conftest import run_without_sync
from tritamp import amp
from tritamp.kernels import (FOUND_INF, HYSTERESIS, SCALE, STATE_SIZE, check_unscale,
                             check_unscale_ref, scale_update, scale_update_ref)
from tritamp.testing import amp_state

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_check_unscale_compiled_matches_ref_and_torch(dtype):
    torch.manual_seed(0)
    sizes = [1, 257, 1000, 70_001, 3 * 257]
    grads = [(torch.randn(n, device="cuda") * 1000).to(dtype) for n in sizes]
    grads[2][5] = float("inf")
    scale = torch.tensor(1024.0, device="cuda")
    mine = [g.clone() for g in grads]
    ref = [g.clone() for g in grads]
    theirs = [g.clone() for g in grads]
    f_mine, f_ref, f_theirs = (torch.zeros((), device="cuda") for _ in range(3))
    check_unscale(mine, scale, f_mine)
    check_unscale_ref(ref, scale, f_ref)
    inv = scale.double().reciprocal().float()
    if dtype == torch.bfloat16:
        # torch's CUDA unscale kernel takes no bf16: its arithmetic, spelled out (fp32
        # multiply, one rounding back, the flag from any non-finite value)
        f_theirs.fill_(float(any(not torch.isfinite(g).all() for g in theirs)))
        theirs = [(g.float() * inv).to(dtype) for g in theirs]
    else:
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, f_theirs.view(1), inv)
    assert f_mine.item() == f_ref.item() == f_theirs.item() == 1.0
    for a, b, c in zip(mine, ref, theirs):
        assert torch.equal(a, b) and torch.equal(a, c)
    masters = [torch.empty(n, device="cuda") for n in sizes]
    check_unscale(grads, scale, None, dsts=masters)
    for g, m in zip(grads, masters):
        assert torch.equal(m, g.float() * scale.double().reciprocal().float())


def test_scale_update_compiled_matches_ref():
    a = torch.zeros(STATE_SIZE, device="cuda")
    a[SCALE], a[HYSTERESIS] = 65536.0, 2.0
    b = a.clone()
    for found in [0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1]:
        a[FOUND_INF] = b[FOUND_INF] = found
        scale_update(a, 2.0, 0.5, 3, 2, 1.0, 2.0**24, True)
        scale_update_ref(b, 2.0, 0.5, 3, 2, 1.0, 2.0**24, True)
        assert torch.equal(a, b)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fused_step_makes_no_host_sync(opt_level):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    x = torch.randn(4, 3, 8, 8, device="cuda")
    y = torch.randint(0, 10, (4,), device="cuda")

    def step():
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    run_without_sync(step)


def test_skip_is_logged_once_the_device_catches_up(caplog):
    torch.manual_seed(0)
    model = nn.Linear(8, 2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    model, opt = amp.initialize(model, opt, opt_level="O2")
    before = model.weight.detach().clone()
    loss = model(torch.randn(4, 8, device="cuda")).sum() * float("inf")
    with caplog.at_level(logging.WARNING, logger="tritamp.amp"):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        torch.cuda.synchronize()
        amp_state().loss_scalers[0].poll_reports()
    assert torch.equal(model.weight, before)
    assert "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0" \
        in caplog.text


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_steps_survive_the_cache_handing_the_last_gradients_blocks_back(opt_level):
    """The kept check/unscale sweeps hand their kernels no pointer into a gradient that
    is gone: between steps the gradients are freed (``set_to_none``), their blocks handed
    back to the device (``torch.cuda.empty_cache()``), and this step's land elsewhere.
    Triton's launcher refuses a pointer the device no longer maps; it did so for O1 in
    fp16 on an H100 before the fix (tests/test_triton_rebind.py checks the same on CPU)."""
    from tritamp.optimizers import FusedAdam
    from tritamp.testing import reset_amp
    reset_amp()
    torch.manual_seed(0)
    # gradients of 32 MB and more: each in a block of its own, which empty_cache frees
    model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 8)).cuda()
    model, opt = amp.initialize(model, FusedAdam(model.parameters(), lr=1e-4),
                                opt_level=opt_level, loss_scale="dynamic", verbosity=0)
    x = torch.randn(16, 4096, device="cuda")
    before = None
    for step in range(5):
        opt.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        hold = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # takes the old block
        with amp.scale_loss(model(x).float().square().mean(), opt) as scaled:
            scaled.backward()
            del hold  # the last step's gradient memory is no longer the device's...
            torch.cuda.empty_cache()  # ...when the exit's check/unscale launches
        opt.step()
        weights = [p.detach().float().clone() for p in model.parameters()]
        if before is not None:
            assert any(not torch.equal(a, b) for a, b in zip(before, weights))
        before = weights
    torch.cuda.synchronize()
    assert all(torch.isfinite(w).all() for w in before)
    reset_amp()
