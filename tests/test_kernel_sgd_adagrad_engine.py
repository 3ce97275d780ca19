"""SGD and Adagrad on the multi-tensor engine (interpreter).

What the engine promises these sweeps: validation before anything is written (state of
another shape with the same numel, half state, non-dense parameters), gradients in
another layout read through a dense copy, the vectorised (aligned) and masked
(unaligned) paths agreeing bit for bit, a prepared sweep relaunched as often as wanted,
step counts advanced inside the kernel (SGD's first momentum run decided by them on the
device), rows without a copy in their own group.
"""
import contextlib
import importlib
from unittest import mock

import pytest
import torch
from conftest import all_tensors, assert_bitwise_unchanged, snapshot, unaligned_copy

from tritamp.kernels import registry, use_triton
from tritamp.kernels.sgd import sgd_step

sgd_mod = importlib.import_module("tritamp.kernels.sgd")
adagrad_mod = importlib.import_module("tritamp.kernels.adagrad")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if not use_triton(torch.empty(0, device=DEVICE)):
    pytest.skip("the engine's Triton path needs CUDA or TRITON_INTERPRET=1",
                allow_module_level=True)
# On the GPU Triton may contract a * b + c into an FMA; the interpreter never does.
EXACT = DEVICE.type == "cpu"

SGD_KW = dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)
ADAGRAD_KW = dict(lr=0.1, eps=1e-10, weight_decay=0.01)
# launcher, oracle, prepare / launch pair: the op registry's
OPS = {"sgd": registry.op("sgd_step"), "adagrad": registry.op("adagrad_step")}
KW = {"sgd": SGD_KW, "adagrad": ADAGRAD_KW}
STATE_NAME = {"sgd": "momentum_buffers", "adagrad": "sums"}


def _randn(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


def _state(params, value=0.5):
    return [torch.full_like(p, value, dtype=torch.float32) for p in params]


def _steps(params, value=2.0):
    return [torch.full((), value, device=DEVICE) for _ in params]


def _run(which, params, grads, state, copies=None, steps=None, **extra):
    OPS[which].launcher(params, grads, state, copies, steps=steps, **dict(KW[which], **extra))


def _run_ref(which, params, grads, state, copies=None, steps=None, **extra):
    OPS[which].ref(params, grads, state, copies, steps=steps, **dict(KW[which], **extra))


def _prepare(which, params, grads, state, copies=None, steps=None):
    return OPS[which].prepare(params, grads, state, copies, steps)


def _launch(which, prepared, **extra):
    OPS[which].launch(prepared, **dict(KW[which], **extra))








def _assert_same(actual, expected, what):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if EXACT:
        assert torch.equal(actual, expected), what
    else:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=1e-7, msg=what)




# --------------------------------------------------------------------------------------
# Validation: refused before anything is written
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", OPS)
def test_state_of_another_shape_same_numel_is_refused_and_nothing_is_written(which):
    params = [_randn((5,), seed=1), _randn((6, 10), seed=2)]
    grads = [_randn(p.shape, seed=3 + i) for i, p in enumerate(params)]
    state, steps = _state(params), _steps(params)
    copies = [p.half() for p in params]
    state[1] = torch.zeros(10, 6, device=DEVICE)  # same numel, another shape
    tensors = all_tensors(params, grads, state, steps, copies)
    before = snapshot(tensors)
    name = STATE_NAME[which]
    with pytest.raises(ValueError, match=rf"{name}\[1\] has shape \(10, 6\) but params\[1\] "
                                         r"has shape \(6, 10\)"):
        _run(which, params, grads, state, copies, steps)
    assert_bitwise_unchanged(before, tensors)


@pytest.mark.parametrize("which", OPS)
def test_half_state_is_refused_with_a_type_error_and_nothing_is_written(which):
    params = [_randn((5,), seed=1), _randn((7,), seed=2)]
    grads = [_randn(p.shape, seed=3 + i) for i, p in enumerate(params)]
    state, steps = _state(params), _steps(params)
    state[1] = state[1].half()
    tensors = all_tensors(params, grads, state, steps)
    before = snapshot(tensors)
    name = STATE_NAME[which]
    with pytest.raises(TypeError, match=rf"{name}\[1\] is float16, expected float32"):
        _run(which, params, grads, state, steps=steps)
    assert_bitwise_unchanged(before, tensors)


@pytest.mark.parametrize("which", OPS)
def test_non_dense_parameter_is_refused_and_nothing_is_written(which):
    base = _randn((8, 8), seed=4)
    params = [_randn((5,), seed=1), base[:, ::2]]  # a strided view: every other column
    grads = [_randn(p.shape, seed=5 + i) for i, p in enumerate(params)]
    state = _state([p.contiguous() for p in params])
    steps = _steps(params)
    tensors = all_tensors([base, params[0]], grads, state, steps)
    before = snapshot(tensors)
    with pytest.raises(ValueError, match=r"params\[1\] of shape \(8, 4\) has strides \(8, 2\)"):
        _run(which, params, grads, state, steps=steps)
    assert_bitwise_unchanged(before, tensors)


def test_sgd_step_count_of_another_shape_is_refused():
    params = [_randn((5,), seed=1), _randn((7,), seed=2)]
    grads = [_randn(p.shape, seed=3) for p in params]
    bufs, steps = _state(params), _steps(params)
    steps[0] = torch.zeros(2, device=DEVICE)
    tensors = all_tensors(params, bufs, steps)
    before = snapshot(tensors)
    with pytest.raises(ValueError, match=r"steps\[0\] has shape \(2,\), expected a one-element"):
        _run("sgd", params, grads, bufs, steps=steps)
    assert_bitwise_unchanged(before, tensors)


def test_sgd_momentum_without_a_buffer_is_refused_and_nothing_is_written():
    params = [_randn((5,), seed=1), _randn((7,), seed=2)]
    grads = [_randn(p.shape, seed=3) for p in params]
    bufs, steps = _state(params), _steps(params)
    bufs[1] = None
    tensors = all_tensors(params, bufs, steps)
    before = snapshot(tensors)
    with pytest.raises(ValueError, match=r"momentum_buffers\[1\] is None"):
        _run("sgd", params, grads, bufs, steps=steps)
    assert_bitwise_unchanged(before, tensors)
    # without momentum the buffers are not needed
    _run("sgd", params, grads, bufs, steps=steps, momentum=0.0)
    assert [s.item() for s in steps] == [3.0, 3.0]


# --------------------------------------------------------------------------------------
# Layouts and alignment
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", OPS)
def test_column_major_gradient_matches_contiguous(which):
    shape = (6, 10)
    results = []
    for layout in ("contiguous", "column_major"):
        params = [_randn(shape, seed=1), _randn((7,), seed=2)]
        state, steps = _state(params), _steps(params, 0.0)
        for k in range(2):
            grads = [_randn(shape, seed=10 + k), _randn((7,), seed=20 + k)]
            if layout == "column_major":
                grads[0] = grads[0].t().contiguous().t()
                assert grads[0].stride() == (1, 6)
            before = grads[0].clone()
            _run(which, params, grads, state, steps=steps)
            assert torch.equal(grads[0], before)  # the gradient is read, never written
            if layout == "column_major":
                assert grads[0].stride() == (1, 6)
        results.append(all_tensors(params, state, steps))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# Every numel a multiple of 8 (the vector width of fp16); 4104 spans two programs of the
# interpreter's 4096.
ALIGNED_SHAPES = ((8,), (4104,), (3, 16))


def _aligned_case(which, unaligned, master, relaunch=1):
    """``relaunch`` steps of ``which`` on fp32 masters with fp16 gradients and copies
    (``master``) or on fp32 parameters, with every tensor either 16-byte aligned or one
    element off; the first step starts the momentum buffers (step count 0)."""
    params = [_randn(s, seed=i) for i, s in enumerate(ALIGNED_SHAPES)]
    gdt = torch.float16 if master else torch.float32
    grads = [_randn(s, gdt, seed=10 + i) for i, s in enumerate(ALIGNED_SHAPES)]
    copies = [p.to(gdt) for p in params] if master else None
    state, steps = _state(params), _steps(params, 0.0)
    if unaligned:
        params, grads, state = ([unaligned_copy(t) for t in lst] for lst in (params, grads, state))
        copies = [unaligned_copy(t) for t in copies] if copies else None
    prepared = _prepare(which, params, grads, state, copies, steps)
    vec = {g.constexprs["VEC"] for g in prepared.groups}
    assert vec == ({1} if unaligned else {8 if master else 4})
    kw = dict(grad_scale=torch.tensor(1024.0, device=DEVICE),
              found_inf=torch.zeros((), device=DEVICE))
    for k in range(relaunch):
        for i, g in enumerate(grads):  # each step's gradient, in place (a kept plan)
            g.copy_(_randn(g.shape, seed=100 * k + i) * 1024.0)
        _launch(which, prepared, **kw)
    return [t.contiguous() for t in all_tensors(params, state, copies, steps)]


@pytest.mark.parametrize("master", [False, True], ids=["fp32", "master-fp16"])
@pytest.mark.parametrize("which", OPS)
def test_aligned_and_unaligned_paths_agree_bitwise(which, master):
    aligned = _aligned_case(which, unaligned=False, master=master, relaunch=2)
    unaligned = _aligned_case(which, unaligned=True, master=master, relaunch=2)
    assert len(aligned) == len(unaligned)
    for i, (a, b) in enumerate(zip(aligned, unaligned)):
        assert torch.equal(a, b), f"tensor {i} differs between VEC > 1 and VEC = 1"
    assert [s.item() for s in aligned[-len(ALIGNED_SHAPES):]] == [2.0] * len(ALIGNED_SHAPES)


@pytest.mark.parametrize("which", OPS)
def test_odd_numel_puts_its_group_on_the_masked_path(which):
    params = [_randn((16,), seed=1), _randn((7,), seed=2)]
    grads = [_randn(p.shape, seed=3) for p in params]
    prepared = _prepare(which, params, grads, _state(params))
    assert [g.constexprs["VEC"] for g in prepared.groups] == [1]
    prepared = _prepare(which, params[:1], grads[:1], _state(params[:1]))
    assert [g.constexprs["VEC"] for g in prepared.groups] == [4]


# --------------------------------------------------------------------------------------
# Step counts inside the kernel, prepared relaunches, copies per row
# --------------------------------------------------------------------------------------
@contextlib.contextmanager
def no_host_step_advance():
    """Inside the block the launchers may not advance a step count from the host (the
    references, run outside it, do)."""
    def refuse(*args, **kwargs):
        raise AssertionError("advance_steps called on the Triton path")
    with mock.patch.object(sgd_mod, "advance_steps", refuse), \
            mock.patch.object(adagrad_mod, "advance_steps", refuse):
        yield


@pytest.mark.parametrize("found", [0.0, 1.0], ids=["taken", "skipped"])
@pytest.mark.parametrize("which", OPS)
def test_steps_advance_in_kernel_once_per_tensor(which, found, count_launches):
    kernel = "_sgd_step_kernel" if which == "sgd" else "_adagrad_step_kernel"
    counter = count_launches(sgd_mod if which == "sgd" else adagrad_mod, kernel)
    shapes = ((5,), (4097,), (9000,), (3, 7))  # 1, 2, 3 and 1 interpreter programs
    params = [_randn(s, seed=i) for i, s in enumerate(shapes)]
    params[3] = params[3].half()
    grads = [_randn(p.shape, p.dtype, seed=10 + i) for i, p in enumerate(params)]
    state = _state(params)
    steps = [torch.full((), float(i), device=DEVICE) for i in range(len(params))]
    ref = [[t.clone() for t in lst] for lst in (params, state, steps)]
    found_inf = torch.full((), found, device=DEVICE)
    with no_host_step_advance():
        for _ in range(3):
            _run(which, params, grads, state, steps=steps, found_inf=found_inf)
    for _ in range(3):
        _run_ref(which, ref[0], grads, ref[1], steps=ref[2], found_inf=found_inf)
    assert len(counter.grids) == 3 * 2  # fp32 and fp16 groups, three steps
    expected = [float(i) + (3 if found == 0.0 else 0) for i in range(len(params))]
    assert [s.item() for s in steps] == expected
    for name, ours, theirs in zip(("param", "state", "step"), (params, state, steps), ref):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_same(a, b, f"{name} {i}")


def test_sgd_step_count_zero_starts_the_buffer_from_the_gradient():
    # the buffers hold garbage: a step count of 0 must ignore it, also across programs
    params = [_randn((4097,), seed=1), _randn((5,), seed=2)]
    grads = [_randn(p.shape, seed=3 + i) for i, p in enumerate(params)]
    bufs = [torch.full_like(p, float("nan")) for p in params]
    steps = [torch.zeros((), device=DEVICE), torch.ones((), device=DEVICE)]
    bufs[1].fill_(0.25)
    p0 = [p.clone() for p in params]
    kw = dict(lr=0.1, momentum=0.9, dampening=0.5)
    skipped = torch.ones((), device=DEVICE)
    sgd_step(params, grads, bufs, steps=steps, found_inf=skipped, **kw)  # a skipped first step
    assert torch.isnan(bufs[0]).all() and [s.item() for s in steps] == [0.0, 1.0]
    assert all(torch.equal(a, b) for a, b in zip(params, p0))
    sgd_step(params, grads, bufs, steps=steps, **kw)
    assert torch.equal(bufs[0], grads[0])  # started from the gradient, undamped
    _assert_same(bufs[1], 0.25 * torch.tensor(0.9) + torch.tensor(0.5) * grads[1].cpu(), "buf 1")
    assert [s.item() for s in steps] == [1.0, 2.0]
    torch.testing.assert_close(params[0], p0[0] - 0.1 * grads[0], rtol=0, atol=1e-7)


def test_sgd_first_run_still_overrides_the_step_counts():
    params = [_randn((33,), seed=1)]
    grads = [_randn((33,), seed=2)]
    bufs = [torch.full((33,), float("nan"), device=DEVICE)]
    steps = [torch.full((), 5.0, device=DEVICE)]
    sgd_step(params, grads, bufs, steps=steps, lr=0.1, momentum=0.9, first_run=True)
    assert torch.equal(bufs[0], grads[0])
    assert steps[0].item() == 6.0


@pytest.mark.parametrize("which", OPS)
def test_prepared_sweep_relaunched_equals_fresh_steps(which):
    shapes = ((8,), (4097,), (3, 5))
    params = [_randn(s, seed=i) for i, s in enumerate(shapes)]
    ours = [[t.clone() for t in params], _state(params), _steps(params, 0.0)]
    fresh = [[t.clone() for t in params], _state(params), _steps(params, 0.0)]
    grads = [torch.empty(s, device=DEVICE) for s in shapes]
    prepared = _prepare(which, ours[0], grads, ours[1], None, ours[2])
    for k in range(3):
        for i, g in enumerate(grads):
            g.copy_(_randn(g.shape, seed=10 * k + i))
        _launch(which, prepared)
        _run(which, fresh[0], grads, fresh[1], steps=fresh[2])
    for a, b in zip(all_tensors(*ours), all_tensors(*fresh)):
        assert torch.equal(a, b)
    assert [s.item() for s in ours[2]] == [3.0] * 3


@pytest.mark.parametrize("which", OPS)
def test_copies_with_none_rows_go_in_their_own_group(which, count_launches):
    kernel = "_sgd_step_kernel" if which == "sgd" else "_adagrad_step_kernel"
    counter = count_launches(sgd_mod if which == "sgd" else adagrad_mod, kernel)
    shapes = ((8,), (13,), (4097,), (2, 3))
    params = [_randn(s, seed=i) for i, s in enumerate(shapes)]
    grads = [_randn(s, torch.bfloat16, seed=10 + i) for i, s in enumerate(shapes)]
    copies = [params[0].bfloat16(), None, params[2].bfloat16(), None]
    ours = [[t.clone() for t in params], _state(params), [c if c is None else c.clone()
                                                           for c in copies], _steps(params)]
    ref = [[t.clone() for t in params], _state(params), [c if c is None else c.clone()
                                                          for c in copies], _steps(params)]
    prepared = _prepare(which, ours[0], grads, ours[1], ours[2], ours[3])
    assert sorted(g.constexprs["HAS_COPIES"] for g in prepared.groups) == [False, True]
    scale = torch.tensor(8.0, device=DEVICE)
    _run(which, ours[0], grads, ours[1], ours[2], ours[3], grad_scale=scale)
    _run_ref(which, ref[0], grads, ref[1], ref[2], ref[3], grad_scale=scale)
    assert len(counter.grids) == 2
    for name, a_list, e_list in zip(("param", "state", "copy", "step"), ours, ref):
        for i, (a, e) in enumerate(zip(a_list, e_list)):
            if a is None:
                assert e is None
                continue
            _assert_same(a, e, f"{name} {i}")
    for p, c in zip(ours[0], ours[2]):
        if c is not None:
            assert torch.equal(c, p.to(c.dtype))


@pytest.mark.parametrize("which", OPS)
def test_empty_tensor_still_counts_its_step(which, count_launches):
    kernel = "_sgd_step_kernel" if which == "sgd" else "_adagrad_step_kernel"
    counter = count_launches(sgd_mod if which == "sgd" else adagrad_mod, kernel)
    params = [torch.zeros(0, device=DEVICE), _randn((5,), seed=1)]
    grads = [p.clone() for p in params]
    state, steps = _state(params), _steps(params, 0.0)
    _run(which, params, grads, state, steps=steps)
    assert len(counter.grids) == 1
    assert [s.item() for s in steps] == [1.0, 1.0]
    _run(which, params, grads, state, steps=steps, found_inf=torch.ones((), device=DEVICE))
    assert [s.item() for s in steps] == [1.0, 1.0]
    _run(which, params[:1], grads[:1], state[:1], steps=steps[:1])
    assert counter.grids == [(1,), (1,)]  # nothing to sweep: no launch
    assert steps[0].item() == 2.0


@pytest.mark.parametrize("which", OPS)
def test_lr_as_one_element_tensor(which):
    params = [_randn((37,), seed=1)]
    grads = [_randn((37,), seed=2)]
    ours = [[params[0].clone()], _state(params), _steps(params, 0.0)]
    ref = [[params[0].clone()], _state(params), _steps(params, 0.0)]
    lr = torch.full((1,), 0.05, device=DEVICE)
    _run(which, ours[0], grads, ours[1], steps=ours[2], lr=lr)
    _run_ref(which, ref[0], grads, ref[1], steps=ref[2], lr=lr)
    for a, b in zip(all_tensors(*ours), all_tensors(*ref)):
        _assert_same(a, b, "tensor")
