"""The training step's host reads: none with a fused optimizer, one without.

A TorchFunctionMode sees every host read of a tensor value (.item(), bool(), float(),
.tolist(), .cpu()); on a GPU each is a host-device sync. The scaler's own logging reads
a host-side snapshot, which is not a tensor op and not a sync.
"""
import contextlib

import pytest
import torch
import torch.nn as nn

from conftest import amp_step
from tritamp import amp
from tritamp.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
              torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__,
              torch.Tensor.cpu, torch.Tensor.numpy}


class HostReads(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 3))


def _step(model, opt, x, y):
    amp_step(model, opt, x, y, loss_fn=nn.functional.cross_entropy)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
], ids=["sgd-fused", "adam-fused"])
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fused_optimizer_step_reads_nothing_from_the_device(opt_level, make_opt, half):
    model = _model()
    model, opt = amp.initialize(model, make_opt(model.parameters()), opt_level=opt_level,
                                half_dtype=half, loss_scale="dynamic", verbosity=0)
    x, y = torch.randn(2, 3, 6, 6), torch.tensor([0, 2])
    _step(model, opt, x, y)  # first step: plans built, masters' gradient buffers allocated
    reads = HostReads()
    with reads:
        _step(model, opt, x, y)
        _step(model, opt, x, y)
    assert reads.calls == []


def test_plain_optimizer_step_makes_one_read_to_decide_the_skip():
    model = _model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                opt_level="O2", verbosity=0)
    x, y = torch.randn(2, 3, 6, 6), torch.tensor([0, 2])
    _step(model, opt, x, y)
    reads = HostReads()
    with reads:
        _step(model, opt, x, y)
    assert reads.calls == ["__bool__"]


def test_a_planted_item_is_seen():
    # The counter is not blind: a .item() in the step shows up.
    model = _model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, fused=True),
                                opt_level="O1", verbosity=0)
    x, y = torch.randn(2, 3, 6, 6), torch.tensor([0, 2])
    reads = HostReads()
    with reads:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.item()
    assert reads.calls == ["item"]


UNSCALING = [  # (opt level, optimizer): amp's exit unscales into destinations
    ("O2", lambda p: torch.optim.SGD(p, lr=0.1, fused=True)),       # half grads -> masters
    ("O2", lambda p: torch.optim.Adam(p, lr=1e-3)),
    ("O1", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),     # in place
]


@pytest.mark.parametrize("cpu_path", [False, True], ids=["triton", "cpu-path"])
@pytest.mark.parametrize("level,make", UNSCALING, ids=["O2-sgd-fused", "O2-adam", "O1-sgd"])
def test_steady_unscale_rebinds_its_sweep_bitwise(level, make, cpu_path, monkeypatch):
    """Each step's gradients are new tensors, at new addresses on a CPU (and, measured,
    on a GPU too). amp's kept unscale sweep takes them (and the destinations) instead of
    being prepared again: no validation, no table built or uploaded in the steady state,
    and the training is bitwise that of a sweep prepared afresh every step (an overflow
    step included)."""
    import tritamp.kernels as K
    from tritamp.testing import force_cpu_path, recording_uploads, stash_of

    def train(fresh_every_step):
        torch.manual_seed(0)
        model = _model()
        model, opt = amp.initialize(model, make(model.parameters()), opt_level=level,
                                    half_dtype=torch.bfloat16, loss_scale="dynamic",
                                    verbosity=0)
        x, y = torch.randn(2, 3, 6, 6), torch.tensor([0, 2])
        prepares, uploads = [], []
        real = K.check_unscale_prepare
        monkeypatch.setattr(K, "check_unscale_prepare",
                            lambda *a, **k: prepares.append(1) or real(*a, **k))
        for i, factor in enumerate([None, None, None, float("inf"), None, None]):
            if fresh_every_step:
                stash_of(opt)._sweeps.clear()
            if i == 2:
                prepares.clear()
            with recording_uploads() as up:
                amp_step(model, opt, x, y, loss_fn=nn.functional.cross_entropy,
                         factor=factor)
            if i >= 2:
                uploads += up
        monkeypatch.setattr(K, "check_unscale_prepare", real)
        return [p.detach().clone() for p in model.parameters()], len(prepares), uploads

    with force_cpu_path() if cpu_path else contextlib.nullcontext():
        kept, prepared, uploads = train(False)
        fresh, prepared_fresh, _ = train(True)
    assert prepared == 0 and uploads == []
    assert prepared_fresh >= 4  # (the reference did prepare every step)
    for a, b in zip(kept, fresh):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_steady_state_builds_no_new_launch_plan(monkeypatch):
    """In the steady state no table is uploaded: the gradients' addresses change from
    step to step (CUDA's caching allocator did not hand the same blocks back on torch
    2.11), and the kept sweeps take the new addresses instead of being prepared again."""
    from tritamp.testing import recording_uploads
    model = _model().cuda()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, fused=True),
                                opt_level="O2", verbosity=0)
    x, y = torch.randn(2, 3, 6, 6, device="cuda"), torch.tensor([0, 2], device="cuda")
    _step(model, opt, x, y)
    _step(model, opt, x, y)
    with recording_uploads() as uploads:
        for _ in range(3):
            _step(model, opt, x, y)
    assert uploads == []


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fused_norm_and_fused_adam_step_reads_nothing(opt_level):
    """A transformer-style step through FusedLayerNorm / FusedRMSNorm and FusedAdam."""
    from tritamp.normalization import FusedLayerNorm, FusedRMSNorm
    from tritamp.optimizers import FusedAdam
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), FusedLayerNorm(16), nn.GELU(), FusedRMSNorm(16),
                          nn.Linear(16, 3))
    model, opt = amp.initialize(model, FusedAdam(model.parameters(), lr=1e-3),
                                opt_level=opt_level, half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    x, y = torch.randn(4, 8), torch.tensor([0, 2, 1, 1])
    _step(model, opt, x, y)
    calls = []
    # The custom ops' implementations run below the dispatcher, where a TorchFunctionMode
    # no longer sees them: count host reads at the Tensor methods themselves.
    with pytest.MonkeyPatch.context() as mp:
        for method in HOST_READS:
            def counted(*args, _m=method, **kwargs):
                calls.append(_m.__name__)
                return _m(*args, **kwargs)
            mp.setattr(torch.Tensor, method.__name__, counted)
        _step(model, opt, x, y)
        _step(model, opt, x, y)
    assert calls == []


STEADY_OPTIMIZERS = {
    "FusedAdam": lambda p: FusedAdam(p, lr=1e-3),
    "FusedSGD": lambda p: FusedSGD(p, lr=0.1, momentum=0.9),
    "FusedLAMB": lambda p: FusedLAMB(p, lr=1e-3),
    "FusedNovoGrad": lambda p: FusedNovoGrad(p, lr=1e-3),
    "FusedAdagrad": lambda p: FusedAdagrad(p, lr=0.1),
    "torch-SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "torch-AdamW-fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    "torch-Adam": lambda p: torch.optim.Adam(p, lr=1e-3),
}


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("name", STEADY_OPTIMIZERS)
def test_the_steady_state_uploads_no_table_when_the_gradients_move(name, opt_level):
    """Every optimizer at O1 and O2, with the default verbosity (the skip warning's
    counts on) and a dynamic scale: once the first steps have prepared every sweep
    (amp's check or unscale, the overflow count, the optimizer's, LAMB's global norm),
    a step whose gradients are new tensors at new addresses (a GPU's allocator hands
    them other blocks; the old ones are kept alive here) prepares nothing again: no
    launch table is built or uploaded. The overflow count and LAMB's norm were prepared
    anew every such step before."""
    from tritamp.testing import recording_uploads, reset_amp
    reset_amp()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    model, opt = amp.initialize(model, STEADY_OPTIMIZERS[name](model.parameters()),
                                opt_level=opt_level, half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=1)
    alive, uploads = [], []
    for step in range(4):
        with recording_uploads() as up:
            with amp.scale_loss(model(torch.randn(4, 8)).float().square().mean(),
                                opt) as scaled:
                scaled.backward()
            opt.step()
        alive.append([p.grad for p in model.parameters()])
        opt.zero_grad(set_to_none=True)
        uploads.append(len(up))
    reset_amp()
    assert uploads[0] > 0 and uploads[2:] == [0, 0], uploads


@pytest.mark.parametrize("cpu_path", [False, True], ids=["triton", "cpu-path"])
@pytest.mark.parametrize("pattern", ["two-losses", "accumulate"])
@pytest.mark.parametrize("level,make", [
    ("O2", lambda p: FusedAdam(p, lr=1e-2)),
    ("O1", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
], ids=["O2-FusedAdam", "O1-torch-SGD"])
def test_a_second_backward_into_the_step_rebinds_its_sweep_bitwise(level, make, pattern,
                                                                 cpu_path):
    """Two backwards into one step (two losses, or accumulation without delay_unscale):
    the second exit unscales and adds the first's gradients (a sweep with addends). With
    new gradient tensors every step its kept sweep is rebound (sources, destinations and
    addends) instead of prepared again, and the training is bitwise that of a sweep
    prepared afresh every step, an overflow in the second loss and a gradient moved off
    its 16-byte alignment (prepared again) included."""
    from tritamp.testing import force_cpu_path, recording_uploads, reset_amp, stash_of

    def misaligned(t):
        buf = torch.empty(t.numel() + 8, dtype=t.dtype)
        start = next(i for i in range(8) if (buf[i:].data_ptr() % 16) != 0)
        out = buf[start:start + t.numel()].view_as(t)
        return out.copy_(t)

    def train(fresh_every_step):
        reset_amp()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        model, opt = amp.initialize(model, make(model.parameters()), opt_level=level,
                                    half_dtype=torch.bfloat16, loss_scale="dynamic",
                                    num_losses=2, verbosity=0)
        alive, uploads = [], []
        for step in range(6):
            if fresh_every_step:
                stash_of(opt)._sweeps.clear()
            opt.zero_grad(set_to_none=True)
            with recording_uploads() as up:
                for k in range(2):
                    torch.manual_seed(10 * step + k)
                    loss = model(torch.randn(4, 8)).float().square().mean()
                    if step == 3 and k == 1:
                        loss = loss * float("inf")  # the second loss overflows
                    with amp.scale_loss(loss, opt,
                                        loss_id=k if pattern == "two-losses" else 0) as s:
                        s.backward()
                        if step == 4 and k == 1:
                            p = model[0].weight
                            p.grad = misaligned(p.grad)
                opt.step()
            alive.append([p.grad for p in model.parameters()])
            uploads.append(len(up))
        out = [p.detach().clone() for p in model.parameters()]
        reset_amp()
        return out, uploads

    with force_cpu_path() if cpu_path else contextlib.nullcontext():
        kept, uploads = train(False)
        fresh, _ = train(True)
    if not cpu_path:  # prepared again only where the misaligned gradient came in
        assert uploads[0] > 0 and uploads[2:4] == [0, 0], uploads
        assert uploads[4] > 0 and uploads[5] == 0, uploads
    for a, b in zip(kept, fresh):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cpu_path", [False, True], ids=["triton", "cpu-path"])
def test_the_rebound_add_sweep_keeps_no_gradient_after_the_step(cpu_path):
    """The sweep that adds the first backward's gradients, once rebound, holds none of
    them after the step: ``zero_grad(set_to_none=True)`` frees them (the production CPU
    path kept the addends in its lists until the next step's rebind)."""
    import gc
    import weakref

    from tritamp.testing import force_cpu_path, reset_amp, stash_of
    reset_amp()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                opt_level="O1", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", num_losses=2, verbosity=0)
    alive_after = []
    with force_cpu_path() if cpu_path else contextlib.nullcontext():
        for step in range(4):
            opt.zero_grad(set_to_none=True)
            for k in range(2):
                loss = model(torch.randn(4, 8)).float().square().mean()
                with amp.scale_loss(loss, opt, loss_id=k) as scaled:
                    scaled.backward()
                if k == 0:
                    firsts = [weakref.ref(p.grad) for p in model.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
            gc.collect()
            alive_after.append(sum(r() is not None for r in firsts))
    builds = stash_of(opt)._sweeps["accumulate"].builds
    reset_amp()
    assert builds == 1 and alive_after == [0, 0, 0, 0], (builds, alive_after)
