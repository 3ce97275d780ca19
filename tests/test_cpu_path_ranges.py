"""A big group's CPU step in ranges: when a fused optimizer's CPU step goes through fp32
scratch (half parameters, half gradients or moments, gradients unscaled into scratch),
a group of more than ``CHUNK_ELEMENTS`` elements runs one range of whole tensors after
another, the ranges sharing one scratch buffer (docs/cpu-path.md). Every tensor sees the
same operations as in one call, so the result is bitwise the one-range result; the tests
here force small ranges on small models (``cpu_step_ranges``) and hold them to that."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import assert_bits_equal
from tritamp import amp
from tritamp.optimizers import FusedAdagrad, FusedAdam, FusedSGD
from tritamp.testing import cpu_step_ranges, force_cpu_path

RANGE = 600  # elements per range in the ranged runs: several ranges per group


class CountFused(TorchDispatchMode):
    """Counts torch's fused optimizer ops (one per range)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__.startswith("_fused_")
        return func(*args, **(kwargs or {}))


def _params(dtype):
    """Tensors of several sizes and layouts, each bigger or smaller than a range: a
    channels-last conv weight and a transposed matrix (dense, not contiguous) among them."""
    gen = torch.Generator().manual_seed(0)
    conv = torch.randn(8, 4, 3, 3, generator=gen).to(memory_format=torch.channels_last)
    shapes = [(700,), (5,), (300,), (200,), (17, 13), (1000,), (0,), (3,)]
    ps = [torch.randn(s, generator=gen) for s in shapes]
    ps.insert(2, conv)
    ps.insert(5, torch.randn(40, 30, generator=gen).t())
    return [torch.nn.Parameter(p.to(dtype)) for p in ps]


def _grads(params, step, dtype=None):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.empty_like(p, dtype=dtype or p.dtype).copy_(
        torch.randn(p.shape, generator=gen)) for p in params]


OPTIMIZERS = {
    "adamw-bf16": (FusedAdam, dict(lr=1e-2, weight_decay=0.01), torch.bfloat16),
    "adam-bf16-moments": (FusedAdam, dict(lr=1e-2, adam_w_mode=False, weight_decay=0.01,
                                          state_dtype=torch.bfloat16), torch.float32),
    "sgd-bf16": (FusedSGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-3), torch.bfloat16),
    "sgd-bf16-dampening": (FusedSGD, dict(lr=1e-2, momentum=0.9, dampening=0.1),
                           torch.bfloat16),
    "sgd-wd-after-momentum": (FusedSGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-2,
                                             wd_after_momentum=True), torch.bfloat16),
    "adagrad-bf16": (FusedAdagrad, dict(lr=1e-2, weight_decay=1e-2), torch.bfloat16),
}


def _run(name, ranged, steps=3, extra=None):
    cls, kw, dtype = OPTIMIZERS[name]
    params = _params(dtype)
    if extra is not None:
        params.append(extra)
    opt = cls(params, **kw)
    counter = CountFused()
    with force_cpu_path(), cpu_step_ranges(RANGE if ranged else 1 << 30):
        for step in range(steps):
            for p, g in zip(params, _grads(params, step)):
                p.grad = g
            with counter:
                opt.step()
    state = [t for p in params for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
    return [p.detach() for p in params], state, counter.count


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_ranges_are_bitwise_one_call(name):
    p1, s1, calls1 = _run(name, ranged=False)
    p2, s2, calls2 = _run(name, ranged=True)
    assert calls2 > calls1  # the ranged run did run in ranges
    for a, b in zip(p1 + s1, p2 + s2):
        assert_bits_equal(a, b, name)
        assert a.stride() == b.stride()


def test_a_gradient_that_is_not_dense_is_swept_in_ranges_through_its_copy():
    # a strided gradient is swept through a dense copy (the engine's staging): the
    # ranges hold that copy, and the result is still bitwise the one-call result
    cls, kw, dtype = OPTIMIZERS["adamw-bf16"]
    out = []
    for ranged in (False, True):
        params = _params(dtype)
        opt = cls(params, **kw)
        with force_cpu_path(), cpu_step_ranges(RANGE if ranged else 1 << 30):
            for step in range(2):
                grads = _grads(params, step)
                wide = torch.zeros(2 * 700, dtype=dtype)
                wide[::2] = grads[0]
                grads[0] = wide[::2]
                assert not grads[0].is_contiguous()
                for p, g in zip(params, grads):
                    p.grad = g
                opt.step()
        out.append([p.detach() for p in params]
                   + [t for p in params for t in opt.state[p].values()])
    for a, b in zip(*out):
        assert_bits_equal(a, b)


def test_fp32_groups_without_scratch_stay_one_call():
    cls, kw, _ = OPTIMIZERS["adamw-bf16"]
    params = _params(torch.float32)
    opt = cls(params, **kw)
    counter = CountFused()
    with force_cpu_path(), cpu_step_ranges(RANGE):
        for p, g in zip(params, _grads(params, 0)):
            p.grad = g
        with counter:
            opt.step()
    assert counter.count == 1


def _amp_run(level, ranged, overflow_at=None, steps=3, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(),
                                torch.nn.Linear(40, 30), torch.nn.ReLU(),
                                torch.nn.Linear(30, 5))
    opt = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(1))
    counter = CountFused()
    snaps = []
    with force_cpu_path(), cpu_step_ranges(RANGE if ranged else 1 << 30):
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)
        for step in range(steps):
            loss = model(x).float().pow(2).mean()
            if step == overflow_at:
                loss = loss * float("inf")
            opt.zero_grad()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            with counter:
                opt.step()
            snaps.append([t.detach().clone() for t in model.parameters()]
                         + [t.detach().clone() for st in opt.state.values()
                            for t in st.values() if isinstance(t, torch.Tensor)])
    return snaps, counter.count


@pytest.mark.parametrize("level,kw,overflow_at", [
    ("O2", dict(half_dtype=torch.bfloat16), None),         # fp32 masters, bf16 gradients
    ("O2", dict(loss_scale="dynamic"), 1),                 # fp16: scaled, one step skipped
], ids=["o2-bf16", "o2-fp16-skip"])
def test_amp_ranges_are_bitwise_one_call(level, kw, overflow_at):
    from tritamp.testing import reset_amp
    one, calls1 = _amp_run(level, False, overflow_at, **kw)
    reset_amp()
    ranged, calls2 = _amp_run(level, True, overflow_at, **kw)
    assert calls2 > calls1
    for a_step, b_step in zip(one, ranged):
        for a, b in zip(a_step, b_step):
            assert_bits_equal(a, b, level)
    if overflow_at is not None:  # the skipped step changed nothing, in ranges too
        for a, b in zip(ranged[overflow_at - 1], ranged[overflow_at]):
            assert_bits_equal(a, b, "skipped step")


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "600"])
def test_cpu_step_ranges_refuses_a_bad_size(bad):
    with pytest.raises(ValueError, match="elements must be a positive int"):
        with cpu_step_ranges(bad):
            pass
