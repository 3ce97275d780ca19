"""LAMB, NovoGrad and the multi-tensor l2-norm on the multi-tensor engine (interpreter).

What the engine promises each of these multi-stage sweeps: validation before anything
is written (state of another shape with the same numel, non-dense parameters), gradients
in another layout read through a dense copy, the vectorised (aligned) and masked
(unaligned) paths agreeing bit for bit, a prepared sweep relaunched without uploading or
validating anything, step counts advanced inside the kernels, and a fixed number of
launches per dtype group.
"""
import math

import pytest
import torch
from conftest import all_tensors, assert_bitwise_unchanged, snapshot, unaligned_copy

from tritamp.testing import Sweep, recording_uploads
import tritamp.kernels.l2norm as l2norm_mod
import tritamp.kernels.lamb as lamb_mod
import tritamp.kernels.novograd as novograd_mod
from tritamp.kernels import registry, use_triton
from tritamp.kernels.l2norm import (multi_tensor_l2norm, multi_tensor_l2norm_launch,
                                    multi_tensor_l2norm_prepare)
from tritamp.kernels.lamb import lamb_step
from tritamp.kernels.novograd import novograd_step

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if not use_triton(torch.empty(0, device=DEVICE)):
    pytest.skip("the engine's Triton path needs CUDA or TRITON_INTERPRET=1",
                allow_module_level=True)

LAMB_KW = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, max_grad_norm=1.0)
NOVOGRAD_KW = dict(lr=1e-2, beta1=0.95, beta2=0.98, eps=1e-8, weight_decay=0.01)
# launcher, oracle and prepare / launch pair: the op registry's
REGISTERED = {"lamb": registry.op("lamb_step"), "novograd": registry.op("novograd_step")}
OPS = {
    "lamb": (REGISTERED["lamb"].launcher, REGISTERED["lamb"].ref, LAMB_KW, False),
    "novograd": (REGISTERED["novograd"].launcher, REGISTERED["novograd"].ref, NOVOGRAD_KW,
                 True),
}


def _state(which, params):
    """(exp_avgs, exp_avg_sqs, steps): NovoGrad's second moment is one value per tensor."""
    per_tensor_v = OPS[which][3]
    m = [torch.full_like(p, 0.1, dtype=torch.float32) for p in params]
    v = [torch.full((), 0.2, device=DEVICE) if per_tensor_v
         else torch.full_like(p, 0.2, dtype=torch.float32) for p in params]
    steps = [torch.full((), 2.0, device=DEVICE) for _ in params]
    return m, v, steps


def _run(which, params, grads, m, v, steps, copies=None, fn=None, **extra):
    step_fn, _, kw, _ = OPS[which]
    kw = dict(kw, **extra)
    if which == "lamb" and "global_grad_norm" not in kw:
        kw["global_grad_norm"] = multi_tensor_l2norm(grads)[0]
    (fn or step_fn)(params, grads, m, v, steps, copies, **kw)


def _randn(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)










# --------------------------------------------------------------------------------------
# Validation: refused before anything is written
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("which,bad", [("lamb", "exp_avgs"), ("lamb", "exp_avg_sqs"),
                                       ("novograd", "exp_avgs")])
def test_state_of_another_shape_same_numel_is_refused_and_nothing_is_written(which, bad):
    params = [_randn((5,), seed=1), _randn((6, 10), seed=2)]
    grads = [_randn(p.shape, seed=3 + i) for i, p in enumerate(params)]
    m, v, steps = _state(which, params)
    copies = [p.half() for p in params]
    state = {"exp_avgs": m, "exp_avg_sqs": v}[bad]
    state[1] = torch.zeros(10, 6, device=DEVICE)  # same numel, another shape
    tensors = all_tensors(params, grads, m, v, steps, copies)
    before = snapshot(tensors)
    with pytest.raises(ValueError, match=rf"{bad}\[1\] has shape \(10, 6\) but params\[1\] "
                                         r"has shape \(6, 10\)"):
        _run(which, params, grads, m, v, steps, copies)
    assert_bitwise_unchanged(before, tensors)


def test_novograd_second_moment_of_several_elements_is_refused():
    params = [_randn((5,), seed=1), _randn((7,), seed=2)]
    grads = [_randn(p.shape, seed=3) for p in params]
    m, v, steps = _state("novograd", params)
    v[1] = torch.zeros(7, device=DEVICE)
    tensors = all_tensors(params, grads, m, v, steps)
    before = snapshot(tensors)
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[1\] has shape \(7,\), expected a "
                                         "one-element tensor"):
        _run("novograd", params, grads, m, v, steps)
    assert_bitwise_unchanged(before, tensors)


@pytest.mark.parametrize("which", list(OPS))
def test_non_dense_parameter_is_refused_and_nothing_is_written(which):
    base = _randn((8, 8), seed=4)
    params = [_randn((5,), seed=1), base[:, ::2]]  # a strided view: every other column
    grads = [_randn(p.shape, seed=5 + i) for i, p in enumerate(params)]
    m, v, steps = _state(which, [p.contiguous() for p in params])
    tensors = all_tensors([base, params[0]], grads, m, v, steps)
    before = snapshot(tensors)
    with pytest.raises(ValueError, match=r"params\[1\] of shape \(8, 4\) has strides \(8, 2\)"):
        _run(which, params, grads, m, v, steps)
    assert_bitwise_unchanged(before, tensors)


def test_bad_norm_type_is_refused_before_anything_is_written():
    params = [_randn((5,), seed=1)]
    grads = [_randn((5,), seed=2)]
    m, v, steps = _state("novograd", params)
    tensors = all_tensors(params, m, v, steps)
    before = snapshot(tensors)
    with pytest.raises(ValueError, match="norm_type must be 2"):
        novograd_step(params, grads, m, v, steps, norm_type=1, **NOVOGRAD_KW)
    assert_bitwise_unchanged(before, tensors)


# --------------------------------------------------------------------------------------
# Layouts and alignment
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", list(OPS))
def test_column_major_gradient_matches_contiguous(which):
    shape = (6, 10)
    results = []
    for layout in ("contiguous", "column_major"):
        params = [_randn(shape, seed=1), _randn((7,), seed=2)]
        m, v, steps = _state(which, params)
        for k in range(2):
            grads = [_randn(shape, seed=10 + k), _randn((7,), seed=20 + k)]
            if layout == "column_major":
                grads[0] = grads[0].t().contiguous().t()
                assert grads[0].stride() == (1, 6)
            before = grads[0].clone()
            _run(which, params, grads, m, v, steps)
            assert torch.equal(grads[0], before)  # the gradient is read, never written
            if layout == "column_major":
                assert grads[0].stride() == (1, 6)
        results.append(all_tensors(params, m, v, steps))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_l2norm_column_major_and_strided_views_match_contiguous():
    x = _randn((33, 65), seed=3)
    views = [x.t(), x.t().contiguous().t(), x[:, ::2], x[1:, 3:]]
    total, per = multi_tensor_l2norm(views, per_tensor=True)
    c_total, c_per = multi_tensor_l2norm([t.contiguous() for t in views], per_tensor=True)
    torch.testing.assert_close(per, c_per, rtol=0, atol=1e-6)
    torch.testing.assert_close(total, c_total, rtol=0, atol=1e-6)


# Every numel a multiple of 8 (the vector width of fp16); 4104 spans two programs of the
# interpreter's 4096.
ALIGNED_SHAPES = ((8,), (4104,), (3, 16))


def _aligned_case(which, unaligned, master):
    """One step of ``which`` on fp32 masters with fp16 gradients and copies (``master``)
    or on fp32 parameters, with every tensor either 16-byte aligned or one element off."""
    params = [_randn(s, seed=i) for i, s in enumerate(ALIGNED_SHAPES)]
    gdt = torch.float16 if master else torch.float32
    grads = [_randn(s, gdt, seed=10 + i) for i, s in enumerate(ALIGNED_SHAPES)]
    copies = [p.to(gdt) for p in params] if master else None
    m, v, steps = _state(which, params)
    if unaligned:
        params, grads, m = ([unaligned_copy(t) for t in lst] for lst in (params, grads, m))
        if not OPS[which][3]:
            v = [unaligned_copy(t) for t in v]
        copies = [unaligned_copy(t) for t in copies] if copies else None
    prepared = REGISTERED[which].prepare(params, grads, m, v, steps, copies)
    vec = {g.constexprs["VEC"] for g in prepared.prepared.groups}
    assert vec == ({1} if unaligned else {8 if master else 4})
    scale = torch.tensor(1024.0, device=DEVICE)
    kw = dict(OPS[which][2], grad_scale=scale, found_inf=torch.zeros((), device=DEVICE))
    if which == "lamb":
        kw["global_grad_norm"] = multi_tensor_l2norm(grads, scale=scale)[0]
    REGISTERED[which].launch(prepared, **kw)
    return all_tensors(params, m, v, steps, copies)


@pytest.mark.parametrize("master", [True, False], ids=["fp32-master-fp16-grads", "fp32"])
@pytest.mark.parametrize("which", list(OPS))
def test_aligned_and_unaligned_groups_agree_bit_for_bit(which, master):
    aligned = _aligned_case(which, False, master)
    unaligned = _aligned_case(which, True, master)
    for a, b in zip(aligned, unaligned):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_l2norm_aligned_and_unaligned_agree_bit_for_bit(dtype):
    xs = [_randn(s, dtype, seed=i) for i, s in enumerate(ALIGNED_SHAPES)]
    odd = [unaligned_copy(x) for x in xs]
    pa, pu = multi_tensor_l2norm_prepare(xs), multi_tensor_l2norm_prepare(odd)
    assert {g.constexprs["VEC"] for g in pa.prepared.groups} == {16 // xs[0].element_size()}
    assert {g.constexprs["VEC"] for g in pu.prepared.groups} == {1}
    scale = torch.tensor(8.0, device=DEVICE)
    a = multi_tensor_l2norm_launch(pa, per_tensor=True, scale=scale)
    b = multi_tensor_l2norm_launch(pu, per_tensor=True, scale=scale)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# --------------------------------------------------------------------------------------
# Prepared once, launched many times: nothing uploaded, nothing validated, steps in-kernel
# --------------------------------------------------------------------------------------
def _forbid(what):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{what} called on a prepared launch")
    return refuse


@pytest.fixture
def steady(monkeypatch):
    """Inside ``with steady():`` no table upload, no validation and no host-side step
    advance may happen."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        with monkeypatch.context() as mp, recording_uploads() as uploads:
            for mod in (l2norm_mod, novograd_mod):
                if hasattr(mod, "_upload"):
                    mp.setattr(mod, "_upload", _forbid(f"{mod.__name__}._upload"))
            mp.setattr(Sweep, "prepare", _forbid("Sweep.prepare"))
            for mod in (lamb_mod, novograd_mod):
                mp.setattr(mod, "advance_steps", _forbid(f"{mod.__name__}.advance_steps"))
            yield
        assert uploads == [], "the engine uploaded a launch table"
    return ctx


@pytest.mark.parametrize("which", list(OPS))
def test_prepared_launch_uploads_nothing_and_matches_fresh_steps(which, steady):
    shapes = ((5,), (4099,), (3, 7))
    runs = []
    for mode in ("fresh", "prepared"):
        params = [_randn(s, seed=i) for i, s in enumerate(shapes)]
        grads = [_randn(s, torch.float16, seed=10 + i) for i, s in enumerate(shapes)]
        copies = [p.half() for p in params]
        m, v, steps = _state(which, params)
        scale = torch.tensor(4.0, device=DEVICE)
        found = torch.zeros((), device=DEVICE)
        kw = dict(OPS[which][2], grad_scale=scale, found_inf=found)
        if which == "lamb":
            kw["global_grad_norm"] = multi_tensor_l2norm(grads, scale=scale)[0]
        if mode == "fresh":
            for _ in range(3):
                _run(which, params, grads, m, v, steps, copies, **kw)
        else:
            prepare, launch = REGISTERED[which].prepare, REGISTERED[which].launch
            prepared = prepare(params, grads, m, v, steps, copies)
            launch(prepared, **kw)  # the first launch may upload betas (cached per value)
            with steady():
                for _ in range(2):
                    launch(prepared, **kw)
        assert all(float(s) == 5.0 for s in steps)
        runs.append(all_tensors(params, m, v, steps, copies))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_l2norm_prepared_launch_uploads_nothing_and_sees_new_values(steady):
    xs = [_randn(s, seed=i) for i, s in enumerate(((5,), (4099,), (3, 7)))]
    prepared = multi_tensor_l2norm_prepare(xs)
    flag = torch.zeros(1, device=DEVICE)
    with steady():
        first = multi_tensor_l2norm_launch(prepared, per_tensor=True, found_inf=flag)
        xs[1].mul_(2.0)
        second = multi_tensor_l2norm_launch(prepared, per_tensor=True, found_inf=flag)
    assert float(flag) == 0.0
    assert torch.equal(second[1][1], 2.0 * first[1][1])
    assert torch.equal(second[1][[0, 2]], first[1][[0, 2]])
    torch.testing.assert_close(second[0], torch.linalg.vector_norm(
        torch.cat([x.reshape(-1) for x in xs])), rtol=2e-6, atol=0)


@pytest.mark.parametrize("which", list(OPS))
def test_skipped_step_through_a_prepared_sweep_leaves_no_trace(which):
    params = [_randn((5,), seed=1), _randn((4099,), seed=2)]
    grads = [_randn(p.shape, seed=3) for p in params]
    m, v, steps = _state(which, params)
    tensors = all_tensors(params, grads, m, v, steps)
    before = snapshot(tensors)
    prepare, launch = REGISTERED[which].prepare, REGISTERED[which].launch
    kw = dict(OPS[which][2], found_inf=torch.ones((), device=DEVICE))
    if which == "lamb":
        kw["global_grad_norm"] = multi_tensor_l2norm(grads)[0]
    launch(prepare(params, grads, m, v, steps), **kw)
    assert_bitwise_unchanged(before, tensors)


@pytest.mark.parametrize("which", list(OPS))
def test_empty_tensors_count_their_step_like_the_reference(which):
    outs = []
    for fn in (OPS[which][0], OPS[which][1]):
        params = [torch.zeros(0, device=DEVICE), _randn((7,), seed=1)]
        grads = [torch.zeros(0, device=DEVICE), _randn((7,), seed=2)]
        m, v, steps = _state(which, params)
        _run(which, params, grads, m, v, steps, fn=fn)
        assert [float(s) for s in steps] == [3.0, 3.0]
        outs.append(all_tensors(params, m, v))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    params = [torch.zeros(0, device=DEVICE)]
    m, v, steps = _state(which, params)
    _run(which, params, [torch.zeros(0, device=DEVICE)], m, v, steps)  # only empty tensors
    assert float(steps[0]) == 3.0


@pytest.mark.parametrize("which", list(OPS))
def test_copies_may_be_none_per_row(which):
    shapes = ((5,), (300,), (3, 7))
    outs = []
    for fn in (OPS[which][0], OPS[which][1]):
        params = [_randn(s, seed=i) for i, s in enumerate(shapes)]
        grads = [_randn(s, seed=10 + i) for i, s in enumerate(shapes)]
        copies = [params[0].half(), None, params[2].bfloat16()]
        m, v, steps = _state(which, params)
        _run(which, params, grads, m, v, steps, copies, fn=fn)
        assert torch.equal(copies[0], params[0].half())
        assert torch.equal(copies[2], params[2].bfloat16())
        outs.append(all_tensors(params, m, v, steps, copies))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------
# Launches per step
# --------------------------------------------------------------------------------------
def _two_groups():
    shapes = ((5,), (4099,), (3, 7), (11,))
    params = [_randn(s, seed=i) for i, s in enumerate(shapes)]
    gdts = (torch.float16, torch.bfloat16, torch.float16, torch.bfloat16)
    grads = [_randn(s, d, seed=10 + i) for i, (s, d) in enumerate(zip(shapes, gdts))]
    return params, grads


@pytest.mark.parametrize("weight_decay", [0.01, 0.0], ids=["trust-ratio", "no-ratio"])
def test_lamb_launches_two_per_group_and_one_segment(count_launches, weight_decay):
    moments = count_launches(lamb_mod, "_lamb_moments_kernel")
    apply = count_launches(lamb_mod, "_lamb_apply_kernel")
    segment = count_launches(l2norm_mod, "_l2norm_segment_kernel")
    params, grads = _two_groups()
    m, v, steps = _state("lamb", params)
    norm = multi_tensor_l2norm(grads)[0]
    segment.grids.clear()
    lamb_step(params, grads, m, v, steps, **dict(LAMB_KW, weight_decay=weight_decay,
                                                 global_grad_norm=norm))
    assert len(moments.grids) == 2 and len(apply.grids) == 2
    assert sorted(moments.grids) == sorted(apply.grids)
    assert len(segment.grids) == (1 if weight_decay else 0)
    assert all(float(s) == 3.0 for s in steps)


def test_novograd_launches_two_per_group_and_one_blend(count_launches):
    norm = count_launches(novograd_mod, "_novograd_norm_kernel")
    blend = count_launches(novograd_mod, "_novograd_blend_kernel")
    step = count_launches(novograd_mod, "_novograd_step_kernel")
    params, grads = _two_groups()
    m, v, steps = _state("novograd", params)
    novograd_step(params, grads, m, v, steps, **NOVOGRAD_KW)
    assert len(norm.grids) == 2 and len(step.grids) == 2 and blend.grids == [(4,)]
    assert all(float(s) == 3.0 for s in steps)


def test_l2norm_launches_one_per_group_and_one_segment(count_launches):
    partial = count_launches(l2norm_mod, "_l2norm_partial_kernel")
    segment = count_launches(l2norm_mod, "_l2norm_segment_kernel")
    dtypes = (torch.float16, torch.float32, torch.bfloat16, torch.float32, torch.float16)
    xs = [_randn((5 + 900 * i,), d, seed=i) for i, d in enumerate(dtypes)]
    total, per = multi_tensor_l2norm(xs, per_tensor=True)
    assert len(partial.grids) == 3 and segment.grids == [(len(xs) + 1, 1)]
    multi_tensor_l2norm(xs)
    assert segment.grids[-1] == (1, 1)
    torch.testing.assert_close(per, torch.stack([torch.linalg.vector_norm(x.float())
                                                 for x in xs]), rtol=2e-6, atol=1e-6)


# --------------------------------------------------------------------------------------
# norm_reduce: per-tensor norms reduced across processes (DTensor shards)
# --------------------------------------------------------------------------------------
def _sharded_case(which, norm_reduce, max_norm=False):
    """One step over an empty, an fp32 and a bf16 tensor (two dtype groups), through
    lamb_launch / novograd_launch with ``norm_reduce``."""
    params = [torch.zeros(0, device=DEVICE), _randn((300,), seed=1),
              _randn((5, 7), torch.bfloat16, seed=2)]
    grads = [torch.zeros(0, device=DEVICE), _randn((300,), seed=3),
             _randn((5, 7), torch.bfloat16, seed=4)]
    m, v, steps = _state(which, params)
    if which == "novograd":
        # A tensor with no element has a zero moment from its first step on (its norm is
        # 0): sharded, an empty local shard takes the reduced norm into its moment (so
        # every process holds the whole tensor's), which for a tensor empty everywhere
        # keeps that 0, as the unsharded step keeps it.
        v[0].zero_()
    if which == "lamb":
        lamb_mod.lamb_launch(lamb_mod.lamb_prepare(params, grads, m, v, steps),
                             global_grad_norm=multi_tensor_l2norm(grads)[0],
                             norm_reduce=norm_reduce, **LAMB_KW)
    else:
        novograd_mod.novograd_launch(novograd_mod.novograd_prepare(params, grads, m, v, steps),
                                     norm_type=0 if max_norm else 2, norm_reduce=norm_reduce,
                                     **NOVOGRAD_KW)
    return all_tensors(params, m, v, steps)


CASES_SHARDED = [("lamb", False), ("novograd", False), ("novograd", True)]


@pytest.mark.parametrize("which,max_norm", CASES_SHARDED,
                         ids=["lamb", "novograd", "novograd-max"])
def test_a_one_process_norm_reduce_changes_no_bit(which, max_norm, path):
    # The sharded stages (LAMB's norms scattered by row and square-rooted after the
    # reduce; NovoGrad's blend in two launches around it) give the unsharded step's bits
    # when the reduce changes nothing; the unsharded step is held to the oracle above.
    calls = []

    def identity(t, op):
        calls.append((tuple(t.shape), op))

    ours = _sharded_case(which, identity, max_norm)
    plain = _sharded_case(which, None, max_norm)
    for a, b in zip(ours, plain):
        assert torch.equal(a, b)
    op = "max" if max_norm else "sum"
    if path == "kernel":  # one reduce, one entry per row (the empty tensor's is 0)
        assert calls == [((2, 3) if which == "lamb" else (3,), op)]
    else:  # one reduce per dtype group, one entry per row of the group
        assert sorted(calls) == sorted([((2, 2) if which == "lamb" else (2,), op),
                                        ((2, 1) if which == "lamb" else (1,), op)])


@pytest.mark.parametrize("max_norm", [False, True], ids=["l2", "max"])
def test_an_empty_local_shard_takes_the_reduced_norm_into_its_moment(max_norm, path):
    # Row 0 is empty here; the other processes' shards of it give a norm of 3: its moment
    # is the whole tensor's, as on those processes (it used to keep its old value, so
    # the processes disagreed and a distributed checkpoint saved one rank's copy).
    def others(t, op):
        t[0] = 9.0 if op == "sum" else 3.0

    v_empty = _sharded_case("novograd", others, max_norm)[6]  # 3 params, 3 m, then v[0]
    beta2 = NOVOGRAD_KW["beta2"]
    expected = beta2 * 0.0 + (1 - beta2) * 3.0 if max_norm else math.sqrt((1 - beta2) * 9.0)
    assert v_empty.shape == () and v_empty.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("which,max_norm", CASES_SHARDED,
                         ids=["lamb", "novograd", "novograd-max"])
def test_the_reduced_norms_are_the_ones_used(which, max_norm, path):
    # A reduce that scales the norms (as other processes' shards would) changes the step
    # (LAMB's only ||p||: its trust ratio ||p|| / ||u|| would not see both scaled).
    def scale(t, op):
        (t[0] if which == "lamb" else t).mul_(4.0)

    ours = _sharded_case(which, scale, max_norm)
    plain = _sharded_case(which, None, max_norm)
    assert any(not torch.equal(a, b) for a, b in zip(ours, plain))
