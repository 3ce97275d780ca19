"""zero_grad(set_to_none=False): one foreach zero per (device, dtype); under amp the
zeroed gradients are checked read-only, never unscaled into fp32 master gradients."""
import torch
import torch.nn as nn

from tritamp import amp
from tritamp.optimizers import FusedSGD
from tritamp.testing import stash_of


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def test_zero_grad_is_one_foreach_zero_per_dtype(monkeypatch):
    model = _model().to(torch.bfloat16)
    model[1].float()
    opt = FusedSGD(model.parameters(), lr=0.1)  # Apex's default: set_grad_none=False
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    calls = []
    real = torch._foreach_zero_
    monkeypatch.setattr(torch, "_foreach_zero_", lambda ts: (calls.append(len(ts)), real(ts)))
    monkeypatch.setattr(torch.Tensor, "zero_", lambda *a: (_ for _ in ()).throw(
        AssertionError("a per-tensor zero_")))
    opt.zero_grad()
    assert sorted(calls) == [2, 4]  # bf16 linear weights and biases; fp32 BatchNorm
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_zeroed_gradients_are_checked_read_only_at_o2():
    runs = []
    for set_to_none in (False, True):
        from tritamp.testing import amp_state
        amp_state().loss_scalers = []
        model = _model()
        model, opt = amp.initialize(model, FusedSGD(model.parameters(), lr=0.1, momentum=0.9),
                                    opt_level="O2", half_dtype=torch.bfloat16,
                                    loss_scale="dynamic", verbosity=0)
        x = torch.randn(4, 8)
        for _ in range(3):
            opt.zero_grad(set_to_none=set_to_none)
            with amp.scale_loss(model(x).float().square().mean(), opt) as scaled:
                scaled.backward()
            # no fp32 master gradient was materialised: the step reads the half ones
            assert all(m.grad is None for m in stash_of(opt).masters)
            opt.step()
        runs.append([p.detach().clone() for p in amp.master_params(opt)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_a_backward_outside_scale_loss_into_zeroed_gradients_is_kept_unscaled():
    """zero_grad(set_to_none=False), then a backward outside scale_loss, then scale_loss:
    the earlier gradient is kept as it was and this backward's is added unscaled (Apex's
    stash), not divided by the scale as if the zeros were untouched. Without the outside
    backward the zeroed gradients still count as scale_loss's own (read-only check)."""
    for level, kw in (("O1", {}), ("O0", dict(loss_scale=1024.0))):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)
        x = torch.randn(8, 4)
        with amp.scale_loss(model(x).float().mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        model(x).float().mean().backward()
        outside = model.weight.grad.clone()
        with amp.scale_loss(model(x).float().mean(), opt) as scaled:
            scaled.backward()
        torch.testing.assert_close(model.weight.grad, 2 * outside, rtol=2e-3, atol=0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        zeroed = [p.grad for p in model.parameters()]
        with amp.scale_loss(model(x).float().mean(), opt) as scaled:
            scaled.backward()
        # the zeros were this backward's: accumulated into in place, nothing stashed
        assert all(p.grad is z for p, z in zip(model.parameters(), zeroed))
