"""tritamp.optimizers.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_."""
import pytest
import torch
import torch.nn as nn

from tritamp import amp
from tritamp.optimizers import FusedSGD, clip_grad_norm_


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in (1, 257, 3000)]
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g) * 3).to(dtype)
    return ps


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_torch(max_norm, dtype):
    ours, theirs = _params(dtype), _params(dtype)
    n1 = clip_grad_norm_(ours, max_norm)
    n2 = torch.nn.utils.clip_grad_norm_(theirs, max_norm, foreach=False)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(n1, n2.float(), **tol)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad.float(), b.grad.float(), **tol)
    if max_norm > 1e3:  # nothing to clip: the gradients are untouched bitwise
        for a, b in zip(ours, _params(dtype)):
            assert torch.equal(a.grad, b.grad)


def test_other_norms_go_to_torch():
    ours, theirs = _params(), _params()
    n1 = clip_grad_norm_(ours, 1.0, norm_type=float("inf"))
    n2 = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type=float("inf"))
    assert torch.equal(n1, n2)


def test_clipping_master_params_at_o2_reads_nothing_back():
    from test_hot_path import HostReads
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model, opt = amp.initialize(model, FusedSGD(model.parameters(), lr=0.1, momentum=0.9),
                                opt_level="O2", verbosity=0)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    reads = HostReads()
    with reads:
        with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        norm = clip_grad_norm_(amp.master_params(opt), 0.01)
        opt.step()
    assert reads.calls == []
    assert norm > 0.01  # it did clip
