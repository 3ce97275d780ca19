"""On the Triton path (here in Triton's interpreter), gradients that are new tensors
every step (FSDP2's reduce-scatter gives them; so does an allocator that hands out other
blocks) go through the kept sweep: their addresses are written into its device tables
instead of the sweep being prepared again. Steps match sweeps prepared anew each step;
the kept sweep holds no gradient between steps; addresses that break the alignment the
kernels were specialised for make it prepare again."""
import contextlib
import gc
import weakref

import pytest
import torch
import torch.nn as nn

from tritamp import amp
from tritamp.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from tritamp.testing import plans_of, reset_amp, stash_of

OPTIMIZERS = {
    "adam": lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1),
    "sgd": lambda p: FusedSGD(p, lr=1e-2, momentum=0.9),
    "adagrad": lambda p: FusedAdagrad(p, lr=1e-2),
    "novograd": lambda p: FusedNovoGrad(p, lr=1e-2),
    # LAMB's global norm keeps a sweep over the gradients too: both are rebound
    "lamb": lambda p: FusedLAMB(p, lr=1e-2),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _backward(model, step):
    torch.manual_seed(100 + step)
    model(torch.randn(5, 8)).square().mean().backward()


def _misaligned(t):
    """A copy of ``t`` at an address 4 bytes past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 4, dtype=t.dtype)
    start = next(i for i in range(4) if (buf[i:].data_ptr() % 16) == 4)
    out = buf[start:start + t.numel()].view_as(t)
    out.copy_(t)
    return out


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_new_gradient_tensors_rebind_the_kept_sweep_and_match_fresh_sweeps(name):
    a, b = _model(), _model()
    opt_a, opt_b = OPTIMIZERS[name](a.parameters()), OPTIMIZERS[name](b.parameters())
    alive = []  # every step's gradients stay alive: each step's land at new addresses
    norms = set()  # LAMB's global norm: its kept sweep, rebound with the step's
    for step in range(3):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad(set_to_none=True)
            _backward(model, step)
            alive.append([p.grad for p in model.parameters()])
        opt_b._plans.clear()  # b prepares its sweep anew every step
        opt_b.__dict__.pop("_norm_plan", None)
        opt_a.step()
        opt_b.step()
        if name == "lamb":
            norms.add(id(opt_a._norm_plan[1]))
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    (cache,) = plans_of(opt_a).values()
    assert cache.prepared.triton is True
    assert cache.builds == 1
    assert len(norms) == (1 if name == "lamb" else 0)


@pytest.mark.parametrize("name", ["adam", "lamb", "lamb-unclipped"])
def test_the_rebound_sweep_holds_no_gradient_between_steps(name):
    model = _model()
    opt = (FusedLAMB(model.parameters(), lr=1e-2, max_grad_norm=0.0)
           if name == "lamb-unclipped" else OPTIMIZERS[name](model.parameters()))
    _backward(model, 0)
    opt.step()
    keep = model[0].weight.grad
    opt.zero_grad(set_to_none=True)
    _backward(model, 1)  # new addresses: the kept sweep is rebound
    opt.step()
    assert plans_of(opt)[0].builds == 1
    grad = weakref.ref(model[0].weight.grad)
    opt.zero_grad(set_to_none=True)
    del keep
    gc.collect()
    assert grad() is None


def test_a_misaligned_gradient_prepares_the_sweep_again():
    a, b = _model(), _model()
    opt_a = FusedAdam(a.parameters(), lr=1e-2)
    opt_b = FusedAdam(b.parameters(), lr=1e-2)
    for step in range(2):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad(set_to_none=True)
            _backward(model, step)
        if step == 1:
            a[0].weight.grad = _misaligned(a[0].weight.grad)
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    cache = plans_of(opt_a)[0]
    assert cache.builds == 2  # aligned first (16-byte loads), then the misaligned one
    assert cache.prepared.groups[0].constexprs["VEC"] == 1


@pytest.mark.parametrize("level,sweep", [("O1", "unscale_own"), ("O2", "check")])
def test_amp_check_is_rebound_on_the_triton_path_and_still_catches_an_overflow(level, sweep):
    # O1: the in-place unscale of the parameters' own gradients; O2: the read-only check
    # of the half gradients the step unscales
    reset_amp()
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    alive = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        with amp.scale_loss(model(torch.randn(5, 8)).square().mean(), opt) as scaled:
            scaled.backward()
        alive.append([p.grad for p in model.parameters()])
        opt.step()
    check = stash_of(opt)._sweeps[sweep]
    assert check.builds == 1 and check.prepared.triton is True
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad(set_to_none=True)
    with amp.scale_loss(model(torch.randn(5, 8)).square().mean(), opt) as scaled:
        scaled.backward()
        model[2].bias.grad[1] = float("nan")  # in this step's new gradient tensor
    alive.append([p.grad for p in model.parameters()])
    opt.step()
    assert check.builds == 1
    assert amp.last_step_skipped(opt)
    assert all(torch.equal(x, p) for x, p in zip(before, model.parameters()))
    reset_amp()


def test_amp_unscale_into_masters_is_rebound_and_a_misaligned_gradient_prepares_it_again():
    """O2 with torch's optimizer: amp's exit unscales the half gradients into the fp32
    masters' gradient buffers (a sweep that writes). New gradient tensors rebind it; a
    gradient off the 16-byte alignment its kernels were specialised for makes it prepare
    again, changing nothing before; the training is bitwise that of a model whose
    gradients all stay aligned."""
    def run(misalign):
        reset_amp()
        torch.manual_seed(0)  # every numel a multiple of 8: 16-byte vectors for bf16 rows
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                    loss_scale="dynamic", verbosity=0)
        builds, vec = [], []
        for step in range(4):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            with amp.scale_loss(model(torch.randn(5, 8)).float().square().mean(),
                                opt) as scaled:
                scaled.backward()
                if misalign and step == 2:
                    model[0].weight.grad = _misaligned(model[0].weight.grad)
            opt.step()
            unscale = stash_of(opt)._sweeps["unscale"]
            builds.append(unscale.builds)
            vec.append(unscale.prepared.prepared.groups[0].constexprs["VEC"])
        assert unscale.prepared.triton is True
        out = [p.detach().clone() for p in model.parameters()]
        reset_amp()
        return out, builds, vec

    aligned, aligned_builds, aligned_vec = run(False)
    moved, moved_builds, moved_vec = run(True)
    assert aligned_builds == [1, 1, 1, 1] and min(aligned_vec) > 1
    assert moved_builds == [1, 1, 2, 2] and moved_vec[2] == 1
    for a, b in zip(aligned, moved):
        assert torch.equal(a, b)


def _protos(sweep_cache):
    prepared = sweep_cache.prepared
    prepared = getattr(prepared, "prepared", prepared)  # (amp's wraps the engine's)
    return [t for g in prepared.groups for t in g.protos]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_rebound_sweep_passes_no_pointer_into_an_earlier_steps_gradients(level):
    """Every tensor a kept sweep hands its kernel (each typed column's proto: only its
    dtype and alignment matter) must own its memory or be this step's. A proto borrowed
    from the first step's gradients (an absent column's stand-in was the first column's
    tensor, and no rebind replaced it) pointed, once those gradients were freed and
    ``torch.cuda.empty_cache()`` handed their blocks back, at memory the device no
    longer had: Triton's launcher refused the step ("Pointer argument (at 5) cannot be
    accessed from Triton"), seen on an H100 with O1 in fp16."""
    reset_amp()
    model = _model()
    opt = (torch.optim.SGD(model.parameters(), lr=1e-2) if level == "O2"
           else FusedAdam(model.parameters(), lr=1e-2))
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    alive, earlier = [], set()
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        with amp.scale_loss(model(torch.randn(5, 8)).float().square().mean(), opt) as scaled:
            scaled.backward()
        grads = [p.grad for p in model.parameters()]
        current = {g.untyped_storage().data_ptr() for g in grads}
        alive.append(grads)  # (kept alive: each step's gradients land at new addresses)
        opt.step()
        sweeps = stash_of(opt)._sweeps
        assert sweeps and all(c.builds == 1 for c in sweeps.values()), \
            {k: c.builds for k, c in sweeps.items()}
        for purpose, cache in sweeps.items():
            for t in _protos(cache):
                at = t.untyped_storage().data_ptr()
                assert at not in earlier or at in current, (step, purpose, t.shape)
        earlier |= current
    reset_amp()


def test_lamb_norm_sweep_is_prepared_again_from_kept_and_new_plans_alike():
    """LAMB over two groups: group 0's gradient moves off its alignment (its plan is
    prepared again), group 1's stays (its kept plan is a cache hit and holds no gradient
    between steps). The global norm's sweep is then prepared over both groups' current
    gradients, and training stays bitwise that of sweeps prepared anew every step."""
    def run(fresh):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        opt = FusedLAMB([{"params": model[0].parameters()},
                         {"params": model[2].parameters(), "lr": 5e-3}], lr=1e-2)
        norms = []
        for step in range(4):
            opt.zero_grad(set_to_none=False)  # the same gradient tensors: cache hits
            _backward(model, step)
            if step == 2:
                model[0].weight.grad = _misaligned(model[0].weight.grad)
            if fresh:
                opt._plans.clear()
                opt.__dict__.pop("_norm_plan", None)
            opt.step()
            norms.append(id(opt._norm_plan[1]))
        return [p.detach().clone() for p in model.parameters()], norms, opt

    kept, norms, opt = run(False)
    fresh, _, _ = run(True)
    for a, b in zip(kept, fresh):
        assert torch.equal(a, b)
    assert norms[0] == norms[1] != norms[2] == norms[3]  # prepared again once, at step 2
    assert [c.builds for c in plans_of(opt).values()] == [2, 1]


@pytest.mark.parametrize("cpu_path", [False, True], ids=["triton", "cpu-path"])
def test_lamb_norm_over_a_non_dense_gradient_reads_this_steps_gradients(cpu_path):
    """A non-dense gradient makes the global norm's sweep read it through a copy, so the
    sweep cannot be rebound; when another group's plan takes new gradients, the norm is
    prepared again over this step's (the CPU path's kept norm read the last step's), and
    training (clipping active) is bitwise that of sweeps prepared anew every step."""
    from tritamp.testing import force_cpu_path

    def run(fresh):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        opt = FusedLAMB([{"params": [model[0].weight]},
                         {"params": [model[0].bias, *model[2].parameters()]}], lr=1e-2)
        strided = torch.zeros(16, 16)[:, ::2]  # a non-dense gradient, the same every step
        alive = []
        for step in range(4):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            (1000 * model(torch.randn(4, 8)).square().mean()).backward()  # clipped
            strided.copy_(model[0].weight.grad)
            model[0].weight.grad = strided
            alive.append([p.grad for p in model.parameters()])
            if fresh:
                opt._plans.clear()
                opt.__dict__.pop("_norm_plan", None)
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    with force_cpu_path() if cpu_path else contextlib.nullcontext():
        kept, fresh = run(False), run(True)
    for a, b in zip(kept, fresh):
        assert torch.equal(a, b)


def test_a_refused_lamb_step_keeps_no_gradient_of_a_group_it_rebound():
    """Group 0's plan is rebound to this step's gradients, then group 1's sparse gradient
    refuses the step: nothing of the step stays referenced (on the Triton path the LAMB
    plan keeps only the addresses of what it was rebound to)."""
    model = _model()
    opt = FusedLAMB([{"params": model[0].parameters()},
                     {"params": model[2].parameters()}], lr=1e-2)
    alive = []
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        _backward(model, step)
        alive.append([p.grad for p in model.parameters()])
        opt.step()
    opt.zero_grad(set_to_none=True)
    _backward(model, 2)
    grad = weakref.ref(model[0].weight.grad)
    model[2].bias.grad = model[2].bias.grad.to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert plans_of(opt)[0].builds == 1  # (group 0 was rebound before the refusal)
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert grad() is None


def test_a_kept_sweep_takes_no_tensor_on_another_device():
    """A rebind writes addresses into the sweep's device tables, read by its device's
    kernel: tensors on another device (a model moved after its sweeps were kept; here
    the meta device, on the interpreter's CPU path) are refused, nothing is changed, and
    the caller prepares again, which validates them by name."""
    from tritamp.kernels.check_unscale import check_unscale_launch, check_unscale_prepare

    grads = [torch.randn(n) for n in (3, 40)]
    grads[1][5] = float("inf")
    prepared = check_unscale_prepare(grads, write=False)
    assert prepared.triton
    elsewhere = [torch.empty(n, device="meta") for n in (3, 40)]
    mixed = [torch.randn(3), elsewhere[1]]
    for other in (elsewhere, mixed):
        assert not prepared.rebind_sources(other)
    found = torch.zeros(1)
    check_unscale_launch(prepared, scale=None, found_inf=found)   # still the CPU tensors
    assert found.item() == 1.0
    with pytest.raises(ValueError, match=r"srcs\[1\] \(shape \(40,\)\) is on the meta device"):
        check_unscale_prepare(mixed, write=False)


@pytest.mark.gpu
def test_a_kept_cuda_sweep_takes_no_tensor_on_the_host_or_another_gpu():
    from tritamp.kernels.check_unscale import check_unscale_prepare

    grads = [torch.randn(n, device="cuda") for n in (3, 40)]
    prepared = check_unscale_prepare(grads, write=False)
    assert not prepared.rebind_sources([torch.randn(3), torch.randn(40)])
    assert not prepared.rebind_sources([grads[0].clone(), torch.randn(40)])
    if torch.cuda.device_count() > 1:
        assert not prepared.rebind_sources([g.to("cuda:1") for g in grads])
    assert prepared.rebind_sources([g.clone() for g in grads])
