"""CUDA checks for the fused optimizers: compiled kernels against torch, a capturable
step replayed from a CUDA graph, and the O2 step without host syncs.

Skipped (with a reason) where no CUDA device is present; CI has none.
"""
import pytest
import torch
import torch.nn as nn

from conftest import run_without_sync
from tritamp import amp
from tritamp.optimizers import FusedAdam, FusedSGD

pytestmark = pytest.mark.gpu


def _params(seed=0):
    torch.manual_seed(seed)
    return [torch.randn(n, device="cuda", requires_grad=True) for n in (1, 257, 70_001, 4096)]


def _grads(params, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(p.shape, device="cuda", generator=g) for p in params]


@pytest.mark.parametrize("make", [
    (lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.01),
     lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, fused=True)),
    (lambda p: FusedSGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4,
                               fused=True)),
], ids=["adam", "sgd"])
def test_compiled_step_matches_torch_fused(make):
    ours, theirs = _params(), _params()
    o1, o2 = make[0](ours), make[1](theirs)
    for step in range(5):
        for ps in (ours, theirs):
            for p, g in zip(ps, _grads(ps, step)):
                p.grad = g
        o1.step()
        o2.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_capturable_adam_step_replays_from_a_cuda_graph():
    params = _params()
    opt = FusedAdam(params, lr=1e-3, capturable=True)
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g.clone()
    opt.step()  # state allocated before capture
    reference = [p.detach().clone() for p in params]
    ref_opt_params = [p.detach().clone().requires_grad_() for p in params]
    ref_opt = FusedAdam(ref_opt_params, lr=1e-3, capturable=True)
    ref_opt.load_state_dict(opt.state_dict())
    for p, r in zip(ref_opt_params, reference):
        p.data.copy_(r)
        p.grad = None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        opt.step()
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(1, 4):
        grads = _grads(params, step)
        for p, g in zip(params, grads):
            p.grad.copy_(g)
        graph.replay()
        for p, g in zip(ref_opt_params, grads):
            p.grad = g.clone()
        ref_opt.step()
    torch.cuda.synchronize()
    for a, b in zip(params, ref_opt_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("make", [lambda p: FusedAdam(p, lr=1e-3),
                                  lambda p: FusedSGD(p, lr=0.1, momentum=0.9)],
                         ids=["adam", "sgd"])
def test_o2_step_with_a_fused_optimizer_makes_no_host_sync(make):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 10)).cuda()
    model, opt = amp.initialize(model, make(model.parameters()), opt_level="O2", verbosity=0)
    x = torch.randn(4, 3, 8, 8, device="cuda")
    y = torch.randint(0, 10, (4,), device="cuda")

    def step():
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    run_without_sync(step)
    # The fp32 masters of the half parameters have no gradient (the step read the half
    # model's); BatchNorm's parameters, kept fp32 at O2 with no master, keep theirs
    # (docs/grads-after-step.md).
    model_ids = {id(p) for p in model.parameters()}
    updated = list(amp.master_params(opt))
    masters = [p for p in updated if id(p) not in model_ids]
    plain = [p for p in updated if id(p) in model_ids]
    assert len(masters) == 4 and len(plain) == 2
    assert all(m.grad is None for m in masters)
    assert all(p.dtype == torch.float32 and p.grad is not None for p in plain)
