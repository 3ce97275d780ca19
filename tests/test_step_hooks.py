"""torch's optimizer step hooks on tritamp's fused optimizers: the same hooks, in torch's
order, and the profiler's ``Optimizer.step#<class>.step`` range while a profiler records,
but no ``record_function`` range entered on a step that nobody profiles."""
import pytest
import torch
from torch.autograd.profiler import record_function
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from tritamp.optimizers import (FusedAdagrad, FusedAdam, FusedLAMB, FusedMixedPrecisionLamb,
                                FusedNovoGrad, FusedSGD)

OPTIMIZERS = [
    (FusedSGD, dict(lr=0.1, momentum=0.9)),
    (FusedAdam, dict(lr=0.1)),
    (FusedAdagrad, dict(lr=0.1)),
    (FusedLAMB, dict(lr=0.1)),
    (FusedNovoGrad, dict(lr=0.1)),
    (FusedMixedPrecisionLamb, dict(lr=0.1)),
]
IDS = [cls.__name__ for cls, _ in OPTIMIZERS]


def _stepped(cls, kw):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8))
    p.grad = torch.randn(8)
    return p, cls([p], **kw)


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=IDS)
def test_hooks_run_once_in_torch_order(cls, kw, cpu_path):
    # A FusedLAMB made first: FusedMixedPrecisionLamb's step builds on FusedLAMB's, whose
    # class step is then hooked too; its hooks must still run once a step.
    FusedLAMB([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    p, opt = _stepped(cls, kw)
    calls = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global pre", o))),
        opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o))),
        opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o))),
        register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global post", o))),
    ]
    try:
        before = p.detach().clone()
        opt.step()
    finally:
        for h in handles:
            h.remove()
    assert calls == [("global pre", opt), ("pre", opt), ("post", opt), ("global post", opt)]
    assert not torch.equal(p.detach(), before)  # the step itself ran
    calls.clear()
    opt.step()
    assert calls == []  # removed hooks are gone


def test_pre_hook_replaces_arguments(cpu_path):
    p, opt = _stepped(FusedSGD, dict(lr=0.1))
    seen = []

    def closure():
        seen.append(True)
        return torch.tensor(3.0)

    opt.register_step_pre_hook(lambda o, args, kwargs: ((o,), {"closure": closure}))
    assert opt.step().item() == 3.0
    assert seen == [True]


def test_pre_hook_bad_return_refused_before_the_step(cpu_path):
    p, opt = _stepped(FusedSGD, dict(lr=0.1))
    before = p.detach().clone()
    opt.register_step_pre_hook(lambda o, a, k: "not a pair")
    with pytest.raises(RuntimeError, match="must return None or a tuple of"):
        opt.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=IDS)
def test_record_function_only_while_profiling(cls, kw, cpu_path, monkeypatch):
    p, opt = _stepped(cls, kw)
    entered = []
    enter = record_function.__enter__

    def counting_enter(self):
        entered.append(self.name)
        return enter(self)

    monkeypatch.setattr(record_function, "__enter__", counting_enter)
    opt.step()
    assert entered == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    assert f"Optimizer.step#{cls.__name__}.step" in entered
    names = {e.name for e in prof.events()}
    assert f"Optimizer.step#{cls.__name__}.step" in names


def test_lr_scheduler_sees_the_step(cpu_path):
    import warnings
    p, opt = _stepped(FusedSGD, dict(lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()"
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


@pytest.mark.parametrize("enabled", [True, False])
def test_step_runs_without_autograd_and_restores_grad_mode(enabled, cpu_path):
    p, opt = _stepped(FusedSGD, dict(lr=0.1, momentum=0.9))
    seen = []
    opt.register_step_post_hook(lambda o, a, k: seen.append(torch.is_grad_enabled()))

    def closure():
        seen.append(torch.is_grad_enabled())  # a closure runs with autograd on, as in torch
        return torch.zeros(())

    with torch.set_grad_enabled(enabled):
        opt.step(closure)
        assert torch.is_grad_enabled() is enabled
        assert p.grad_fn is None and p.is_leaf
        # a refused step (a sparse gradient) leaves the mode as it was too
        p.grad = torch.randn(8).to_sparse()
        with pytest.raises(RuntimeError, match="sparse"):
            opt.step()
        assert torch.is_grad_enabled() is enabled
    assert seen == [True, enabled]
