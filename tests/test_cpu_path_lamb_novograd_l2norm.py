"""LAMB, NovoGrad, the multi-tensor l2-norm and scale/axpby on the production CPU path
(torch's foreach and fused CPU ops), held to their ``*_ref`` oracles.

Tolerances. l2-norm: the per-tensor sums are fp64 sums of fp32 norms of pieces (or
exact fp64 sums) where the oracle sums each tensor in fp32: norms agree to
``rtol=1e-6`` (long fp32 tensors: see test_l2norm_long_tensors for the measured
bounds). scale/axpby do the oracle's arithmetic and are held to it bit for bit. LAMB
and NovoGrad fp32 results are held to the oracles at ``rtol=1e-6`` with ``atol=1e-6``
(about one fp32 ulp at the data's scale, which is 1 here): LAMB's moments and update
direction come from torch's fused Adam CPU kernel (its own order: ``sqrt(v) /
sqrt(bc2)``, ``lr / bc1`` as one factor, a fused multiply-add for the first moment),
torch's vectorised ``add(alpha=)`` / ``addcmul`` may fuse a multiply and an add into one
rounding where the oracle rounds twice, and NovoGrad folds its per-tensor factors into
one multiplier (``(lr / (bc1 * d)) * m`` for ``lr * ((m / bc1) / d)``); so results
differ in the last bit or two, and a value that nearly cancels (a first moment) keeps
that absolute error. Half results (half parameters, half copies of fp32 masters) are
the rounding of such an fp32 value and may sit one half ulp apart: ``rtol`` is the
dtype's machine epsilon. The optimizers on the CPU path against the (interpreted)
kernels: the same tolerances (both hold to the same oracles). What is exact is tested
exactly: step counts, a skipped step (everything bitwise unchanged), the user's
gradients (never written), no host read, and the number of torch ops per step
(independent of the tensor count).
"""
import math

import pytest
import torch

from conftest import (CountOps, all_tensors, assert_bits_equal, assert_bits_unchanged,
                      assert_close_to_ref, snapshot, tiny_mlp, train_steps)
from conftest import clone_lists as clones
from conftest import scaled_grads as scaled
from tritamp.testing import force_cpu_path, plans_of
from tritamp.kernels.axpby import (multi_tensor_axpby, multi_tensor_axpby_launch,
                                   multi_tensor_axpby_prepare, multi_tensor_axpby_ref,
                                   multi_tensor_scale, multi_tensor_scale_launch,
                                   multi_tensor_scale_prepare, multi_tensor_scale_ref)
from tritamp.kernels.l2norm import (multi_tensor_l2norm, multi_tensor_l2norm_launch,
                                    multi_tensor_l2norm_prepare, multi_tensor_l2norm_ref)
from tritamp.kernels.lamb import lamb_launch, lamb_prepare, lamb_step_ref
from tritamp.kernels.novograd import (novograd_launch, novograd_prepare, novograd_step,
                                      novograd_step_ref)
from tritamp.optimizers import FusedLAMB, FusedNovoGrad

SHAPES = ((1,), (1000,), (3, 257), (0,))
TINY = ((1,), (33,), (0,))  # fp16: CPU fp16 arithmetic in the oracles is slow
# name: (parameter dtype, gradient dtype, copy dtype)
CASES = {
    "fp32": (torch.float32, torch.float32, None),
    "o2-bf16": (torch.float32, torch.bfloat16, torch.bfloat16),
    "o2-fp16": (torch.float32, torch.float16, torch.float16),
    "bf16": (torch.bfloat16, torch.bfloat16, None),
    "fp16": (torch.float16, torch.float16, None),
}
# grad_scale: none; a power of two (unscaling is exact); 3 (1/3 rounds)
SCALES = {"plain": None, "scale1024": 1024.0, "scale3": 3.0}
N_STEPS = 3


@pytest.fixture(autouse=True)
def _one_thread():
    """torch's foreach ops on one thread: a fixed summation order in the norms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------
# multi_tensor_l2norm
# --------------------------------------------------------------------------------------

L2_SHAPES = ((1,), (1000,), (3, 257), (0,), (70000,))


def _tensors(shapes, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * scale).to(dtype) for s in shapes]


@pytest.mark.parametrize("scale", [None, 1024.0, 3.0], ids=["plain", "scale1024", "scale3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_l2norm_cpu_path_matches_ref(cpu_path, dtype, scale):
    ts = _tensors(L2_SHAPES if dtype != torch.float16 else TINY, dtype,
                  scale=1.0 if scale is None else scale)
    s = None if scale is None else torch.tensor(scale)
    prepared = multi_tensor_l2norm_prepare(ts)
    assert not prepared.triton
    total, per = multi_tensor_l2norm_launch(prepared, per_tensor=True, scale=s)
    r_total, r_per = multi_tensor_l2norm_ref(ts, per_tensor=True, scale=s)
    assert total.dtype == torch.float32 and total.shape == ()
    assert per.dtype == torch.float32 and per.shape == (len(ts),)
    torch.testing.assert_close(total, r_total, rtol=1e-6, atol=0)
    torch.testing.assert_close(per, r_per, rtol=1e-6, atol=0)
    alone, none = multi_tensor_l2norm_launch(prepared, scale=s)
    assert none is None and torch.equal(alone, total)


def test_l2norm_mixed_dtypes_keep_the_callers_order(cpu_path):
    dtypes = (torch.float16, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16)
    shapes = ((5,), (4099,), (300,), (1,), (0,))
    ts = [_tensors([s], d, seed=i)[0] for i, (s, d) in enumerate(zip(shapes, dtypes))]
    total, per = multi_tensor_l2norm(ts, per_tensor=True)
    r_total, r_per = multi_tensor_l2norm_ref(ts, per_tensor=True)
    torch.testing.assert_close(per, r_per, rtol=1e-6, atol=0)
    torch.testing.assert_close(total, r_total, rtol=1e-6, atol=0)


def test_l2norm_long_tensors(cpu_path):
    """torch's fp32 CPU norm sums a tensor in one vector register: 1e-4 off at 4M
    elements. The CPU path norms long fp32 tensors in pieces added in fp64: within 1e-6
    of the exact norm on full-precision values; on half values held in fp32 that kernel's
    rounding is biased (a few 1e-6, measured): 1e-5 there. Half tensors are normed in
    fp64 pieces: exact to fp32 rounding."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4 << 20, generator=gen) * 3 + 0.5
    halfish = x[: 1 << 20].bfloat16()
    cases = [(x, 1e-6), (halfish.float(), 1e-5), (halfish, 2e-7),
             (x[: 1 << 20].half(), 2e-7)]
    for t, tol in cases:
        exact = float(t.double().square().sum().sqrt())
        total, per = multi_tensor_l2norm([t], per_tensor=True)
        assert abs(float(per[0]) / exact - 1) < tol, (t.dtype, float(per[0]) / exact - 1)
        assert abs(float(total) / exact - 1) < tol


def test_l2norm_views_and_channels_last(cpu_path):
    base = torch.randn(6, 40, generator=torch.Generator().manual_seed(2))
    cl = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    views = [base[:, ::3], base.t(), cl, base[1:4, 2:30]]
    total, per = multi_tensor_l2norm(views, per_tensor=True)
    r_total, r_per = multi_tensor_l2norm_ref([v.contiguous() for v in views], per_tensor=True)
    torch.testing.assert_close(per, r_per, rtol=1e-6, atol=0)
    torch.testing.assert_close(total, r_total, rtol=1e-6, atol=0)


def test_l2norm_empty_list(cpu_path):
    flag = torch.zeros(1)
    total, per = multi_tensor_l2norm([], per_tensor=True, found_inf=flag)
    assert float(total) == 0.0 and per.shape == (0,) and float(flag) == 0.0


@pytest.mark.parametrize("kind", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_l2norm_non_finite_sets_the_flag_as_the_ref(cpu_path, dtype, kind):
    ts = _tensors(((257,), (999,), (3,)), dtype, seed=3)
    ts[1][500] = float(kind)
    flag, ref_flag = torch.zeros(1), torch.zeros(1)
    total, per = multi_tensor_l2norm(ts, per_tensor=True, found_inf=flag)
    r_total, r_per = multi_tensor_l2norm_ref(ts, per_tensor=True, found_inf=ref_flag)
    assert float(flag) == float(ref_flag) == 1.0
    torch.testing.assert_close(per, r_per, rtol=1e-6, atol=0, equal_nan=True)
    torch.testing.assert_close(total, r_total, rtol=1e-6, atol=0, equal_nan=True)


def test_l2norm_flag_overflow_and_scale_as_the_ref(cpu_path):
    """The oracle's flag is the total's: finite elements whose fp32 squares overflow set
    it; unscaled first, scaled fp32 gradients do not; half maxima never overflow; an int
    flag is set to 1 and never cleared (Apex's contract)."""
    cases = [
        ([torch.full((4,), 3e19)], None),                 # squares overflow fp32
        ([torch.full((4,), 3e19)], 1e10),                 # unscaled first: finite
        ([torch.full((4,), 3e18), torch.full((9,), 3e18)], None),  # the sum overflows
        ([torch.full((5000,), 65504.0, dtype=torch.float16)], None),
        ([torch.full((3,), 1e30), torch.tensor([1.0])], 1e-10),    # unscaling overflows
    ]
    for ts, scale in cases:
        s = None if scale is None else torch.tensor(scale)
        flag, ref_flag = torch.zeros(()), torch.zeros(())
        total, per = multi_tensor_l2norm(ts, per_tensor=True, scale=s, found_inf=flag)
        r_total, r_per = multi_tensor_l2norm_ref(ts, per_tensor=True, scale=s,
                                                 found_inf=ref_flag)
        assert float(flag) == float(ref_flag), (ts, scale)
        torch.testing.assert_close(total, r_total, rtol=1e-6, atol=0)
        torch.testing.assert_close(per, r_per, rtol=1e-6, atol=0)
    noop = torch.zeros(1, dtype=torch.int32)
    multi_tensor_l2norm([torch.tensor([1.0, math.nan])], found_inf=noop)
    assert int(noop) == 1 and noop.dtype == torch.int32
    multi_tensor_l2norm([torch.ones(3)], found_inf=noop)
    assert int(noop) == 1


# --------------------------------------------------------------------------------------
# multi_tensor_scale / multi_tensor_axpby: bitwise the oracle
# --------------------------------------------------------------------------------------

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _inputs(dtype, seed, bad=None):
    ts = _tensors(SHAPES, dtype, seed=seed, scale=100.0)
    if bad is not None:
        ts[1][7] = bad
    return ts


@pytest.mark.parametrize("bad", [None, math.inf, math.nan, 3e38], ids=["finite", "inf", "nan",
                                                                      "big"])
@pytest.mark.parametrize("dst", DTYPES)
@pytest.mark.parametrize("src", DTYPES)
def test_scale_cpu_path_is_the_ref_bitwise(cpu_path, src, dst, bad):
    """``3e38`` is finite in fp32 and bf16 (inf in fp16): times 3 it overflows, which
    only the input check must not flag."""
    xs = _inputs(src, 0, bad)
    for scale in (3.0, torch.tensor(1 / 3)):
        for flag_dtype in (torch.int32, torch.float32):
            outs, refs = ([torch.full(x.shape, 7.0, dtype=dst) for x in xs] for _ in range(2))
            flag, ref_flag = torch.zeros(1, dtype=flag_dtype), torch.zeros(1, dtype=flag_dtype)
            multi_tensor_scale(xs, outs, scale, flag)
            multi_tensor_scale_ref(xs, refs, scale, ref_flag)
            for o, r in zip(outs, refs):
                assert_bits_equal(o, r)
            assert_bits_equal(flag, ref_flag)


@pytest.mark.parametrize("arg", [-1, 0, 1])
@pytest.mark.parametrize("dtypes", [(torch.float32,) * 3, (torch.bfloat16,) * 3,
                                    (torch.float16, torch.float32, torch.bfloat16),
                                    (torch.float32, torch.bfloat16, torch.float16)],
                         ids=["fp32", "bf16", "mixed1", "mixed2"])
def test_axpby_cpu_path_is_the_ref_bitwise(cpu_path, dtypes, arg):
    dx, dy, do = dtypes
    for bad_x, bad_y in ((None, None), (math.inf, None), (None, math.nan), (3e38, 3e38)):
        xs, ys = _inputs(dx, 1, bad_x), _inputs(dy, 2, bad_y)
        for a, b in ((0.5, -2.0), (torch.tensor(1 / 3), torch.tensor(3.0))):
            outs, refs = ([torch.zeros(x.shape, dtype=do) for x in xs] for _ in range(2))
            flag, ref_flag = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
            multi_tensor_axpby(xs, ys, outs, a, b, flag, arg)
            multi_tensor_axpby_ref(xs, ys, refs, a, b, ref_flag, arg)
            for o, r in zip(outs, refs):
                assert_bits_equal(o, r)
            assert_bits_equal(flag, ref_flag)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_and_axpby_in_place(cpu_path, dtype):
    """dst is src (clip_grad_norm_'s use), out is x, out is y: the oracle's results."""
    xs, ys = _inputs(dtype, 3), _inputs(dtype, 4)
    ours, ref = snapshot(xs), snapshot(xs)
    multi_tensor_scale(ours, ours, torch.tensor(0.3), None)
    multi_tensor_scale_ref(ref, ref, torch.tensor(0.3), None)
    for o, r in zip(ours, ref):
        assert_bits_equal(o, r)
    for out_is in ("x", "y"):
        x1, y1, x2, y2 = snapshot(xs), snapshot(ys), snapshot(xs), snapshot(ys)
        expected = [torch.empty_like(x) for x in xs]
        multi_tensor_axpby_ref(x2, y2, expected, 0.7, 1.3, None)
        multi_tensor_axpby(x1, y1, x1 if out_is == "x" else y1, 0.7, 1.3, None)
        for o, r in zip(x1 if out_is == "x" else y1, expected):
            assert_bits_equal(o, r)


def test_scale_strided_output_and_flag_never_cleared(cpu_path):
    base = torch.zeros(8, 10)
    view = base[:, ::2]  # written through a dense stand-in, copied back
    x = torch.randn(8, 5)
    noop = torch.ones(1, dtype=torch.int32)
    multi_tensor_scale([x], [view], 2.0, noop)
    assert torch.equal(view, x * 2.0) and torch.equal(base[:, 1::2], torch.zeros(8, 5))
    assert int(noop) == 1  # finite inputs leave a set flag set


# --------------------------------------------------------------------------------------
# LAMB and NovoGrad against their oracles
# --------------------------------------------------------------------------------------

def make_lists(case, seed=0, shapes=None, steps=0.0):
    """params, grads per step (N_STEPS lists), fp32 state (m, v), copies (the masters'
    rounding, as amp's O2 model weights; one row without a copy), step counts."""
    p_dtype, g_dtype, c_dtype = CASES[case]
    if shapes is None:
        shapes = TINY if torch.float16 in (p_dtype, g_dtype) else SHAPES
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(p_dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(g_dtype) for s in shapes]
             for _ in range(N_STEPS)]
    ms = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
    vs = [torch.rand(s, generator=gen) * 0.1 for s in shapes]
    copies = None
    if c_dtype is not None:
        copies = [p.to(c_dtype) for p in params]
        copies[0] = None
    counts = [torch.full((), steps) for _ in shapes]
    return params, grads, ms, vs, copies, counts


def novograd_lists(case, seed=0, shapes=None, steps=0.0):
    params, grads, ms, _, copies, counts = make_lists(case, seed, shapes, steps)
    gen = torch.Generator().manual_seed(seed + 100)
    vs = [torch.rand((), generator=gen) * 10 for _ in params]  # one fp32 value per tensor
    return params, grads, ms, vs, copies, counts


LAMB_VARIANTS = {
    "default": dict(),
    "l2_no_bc_no_avg": dict(adam_w_mode=False, bias_correction=False, grad_averaging=False),
    "l2_no_bc": dict(adam_w_mode=False, bias_correction=False),
    "no_decay": dict(weight_decay=0.0),
    "nvlamb_no_decay": dict(weight_decay=0.0, use_nvlamb=True),
    "no_clip_lr_tensor": dict(clip=False, lr_tensor=True),
}


def _lamb_kw(variant, lr=1e-2):
    kw = dict(lr=lr, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, max_grad_norm=1.0)
    kw.update(variant)
    clip = kw.pop("clip", True)
    if kw.pop("lr_tensor", False):
        kw["lr"] = torch.tensor(lr)
    return kw, clip


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("variant", LAMB_VARIANTS)
@pytest.mark.parametrize("case", CASES)
def test_lamb_cpu_path_matches_ref(case, variant, scale):
    """N_STEPS steps (steps counted from 0 and from 7), global-norm clipping over the
    scaled gradients as FusedLAMB does it; the gradients are never written."""
    kw, clip = _lamb_kw(LAMB_VARIANTS[variant])
    for start in (0.0, 7.0):
        params, grads, ms, vs, copies, counts = make_lists(case, seed=1, steps=start)
        ours = [params, ms, vs, copies, counts]
        ref = clones(ours)
        s = None if SCALES[scale] is None else torch.tensor(SCALES[scale])
        for step_grads in grads:
            g = scaled(step_grads, SCALES[scale])
            before = snapshot(g)
            norm = multi_tensor_l2norm_ref(g, scale=s)[0] if clip else None
            with force_cpu_path():
                prepared = lamb_prepare(ours[0], g, ours[1], ours[2], ours[4], ours[3])
                assert not prepared.triton
                lamb_launch(prepared, **kw, global_grad_norm=norm, grad_scale=s,
                            found_inf=torch.zeros(1) if s is not None else None)
            lamb_step_ref(ref[0], g, ref[1], ref[2], ref[4], ref[3], **kw,
                          global_grad_norm=norm, grad_scale=s)
            assert_bits_unchanged(before, g)
        for name, a, b in zip(("params", "exp_avgs", "exp_avg_sqs", "copies", "steps"),
                              ours, ref):
            if a is not None:
                assert_close_to_ref(a, b, name)
        assert [float(c) for c in ours[4]] == [start + N_STEPS] * len(params)


NOVOGRAD_VARIANTS = {
    "default": dict(),
    "reg_inside_wd": dict(reg_inside_moment=True, weight_decay=0.01),
    "max_norm_init_zero": dict(norm_type=0, init_zero=True, weight_decay=0.01),
    "no_bc_no_avg_lr_tensor": dict(bias_correction=False, grad_averaging=False,
                                   weight_decay=0.01, lr_tensor=True),
    "reg_inside_max_no_bc": dict(reg_inside_moment=True, norm_type=0, bias_correction=False),
}


def _novograd_kw(variant, lr=1e-2):
    kw = dict(lr=lr, beta1=0.95, beta2=0.98, eps=1e-8, weight_decay=0.0)
    kw.update(variant)
    if kw.pop("lr_tensor", False):
        kw["lr"] = torch.tensor(lr)
    return kw


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("variant", NOVOGRAD_VARIANTS)
@pytest.mark.parametrize("case", CASES)
def test_novograd_cpu_path_matches_ref(case, variant, scale):
    """N_STEPS steps from step 0 (the first step initialises v) and from 7."""
    kw = _novograd_kw(NOVOGRAD_VARIANTS[variant])
    for start in (0.0, 7.0):
        params, grads, ms, vs, copies, counts = novograd_lists(case, seed=2, steps=start)
        ours = [params, ms, vs, copies, counts]
        ref = clones(ours)
        s = None if SCALES[scale] is None else torch.tensor(SCALES[scale])
        for step_grads in grads:
            g = scaled(step_grads, SCALES[scale])
            before = snapshot(g)
            with force_cpu_path():
                prepared = novograd_prepare(ours[0], g, ours[1], ours[2], ours[4], ours[3])
                assert not prepared.triton
                novograd_launch(prepared, **kw, grad_scale=s,
                                found_inf=torch.zeros(()) if s is not None else None)
            novograd_step_ref(ref[0], g, ref[1], ref[2], ref[4], ref[3], **kw, grad_scale=s)
            assert_bits_unchanged(before, g)
        for name, a, b in zip(("params", "exp_avgs", "exp_avg_sqs", "copies", "steps"),
                              ours, ref):
            if a is not None:
                assert_close_to_ref(a, b, name)
        assert [float(c) for c in ours[4]] == [start + N_STEPS] * len(params)


def test_novograd_empty_tensor_keeps_its_moment(cpu_path):
    """The oracle skips an empty tensor's moment (its step still counts)."""
    params, grads, ms, vs, copies, counts = novograd_lists("fp32", seed=3)
    assert params[3].numel() == 0
    v_empty = vs[3].clone()
    novograd_step(params, grads[0], ms, vs, counts, lr=1e-2, beta1=0.9, beta2=0.9, eps=1e-8,
                  weight_decay=0.0)
    assert torch.equal(vs[3], v_empty) and float(counts[3]) == 1.0


def _launch(op, lists, grads, grad_scale, found_inf, variant):
    params, ms, vs, copies, counts = lists
    if op == "lamb":
        kw, clip = _lamb_kw(variant)
        norm = multi_tensor_l2norm_ref(grads, scale=grad_scale)[0] if clip else None
        lamb_launch(lamb_prepare(params, grads, ms, vs, counts, copies), **kw,
                    global_grad_norm=norm, grad_scale=grad_scale, found_inf=found_inf)
    else:
        novograd_launch(novograd_prepare(params, grads, ms, vs, counts, copies),
                        **_novograd_kw(variant), grad_scale=grad_scale, found_inf=found_inf)


OPS = {"lamb": (make_lists, LAMB_VARIANTS), "novograd": (novograd_lists, NOVOGRAD_VARIANTS)}


@pytest.mark.parametrize("found", [1.0, 2.0, math.nan], ids=["one", "two", "nan"])
@pytest.mark.parametrize("case", ["fp32", "o2-bf16", "bf16", "fp16"])
@pytest.mark.parametrize("op", OPS)
def test_skipped_step_changes_nothing_bitwise(cpu_path, op, case, found):
    """Any non-zero found_inf leaves parameters, state, step counts, copies (one of them
    unlike its master's rounding) and gradients bit for bit as they were, with inf and
    NaN gradients, in every variant."""
    make, variants = OPS[op]
    lists = list(make(case, seed=4, steps=2.0))
    g = lists.pop(1)[0]
    if lists[3] is not None:
        lists[3][1].add_(1.0)
    g[0][0] = math.inf
    if g[1].numel() > 3:
        g[1][3] = math.nan
    everything = all_tensors(lists[0], g, *lists[1:])
    for variant in variants.values():
        for grad_scale in (None, torch.tensor(1024.0)):
            start = snapshot(everything)
            _launch(op, lists, g, grad_scale, torch.tensor([found]), variant)
            assert_bits_unchanged(start, everything)


@pytest.mark.parametrize("op", OPS)
def test_clear_found_inf_is_the_unflagged_step(cpu_path, op):
    """found_inf = 0 runs the step (through the gated path) as without a flag."""
    make, variants = OPS[op]
    for variant in variants.values():
        a = list(make("o2-bf16", seed=5))
        grads = a.pop(1)[0]
        b = clones(a)
        _launch(op, a, grads, torch.tensor(8.0), torch.zeros(()), variant)
        _launch(op, b, grads, torch.tensor(8.0), None, variant)
        for x, y in zip(all_tensors(*a), all_tensors(*b)):
            assert_close_to_ref([x], [y], op)


@pytest.mark.parametrize("op", ["lamb", "novograd", "l2norm", "scale", "axpby"])
def test_a_step_reads_nothing_on_the_host(cpu_path, op):
    from test_hot_path import HostReads
    make, variants = OPS["lamb" if op in ("l2norm", "scale", "axpby") else op]
    lists = list(make("o2-bf16", seed=6))
    grads = lists.pop(1)[0]
    reads = HostReads()
    with reads:
        if op in OPS:
            for variant in variants.values():
                _launch(op, lists, grads, torch.tensor(8.0), torch.zeros(1), variant)
        elif op == "l2norm":
            multi_tensor_l2norm(grads, per_tensor=True, scale=torch.tensor(8.0),
                                found_inf=torch.zeros(1))
        elif op == "scale":
            multi_tensor_scale(grads, lists[1], torch.tensor(0.5),
                               torch.zeros(1, dtype=torch.int32))
        else:
            multi_tensor_axpby(grads, lists[1], lists[2], 0.5, torch.tensor(2.0),
                               torch.zeros(1, dtype=torch.int32))
    assert reads.calls == []


def _op_lists(op, n_tensors):
    shapes = [(1 + 37 * i % 500,) for i in range(n_tensors)]
    make = OPS["lamb" if op not in OPS else op][0]
    lists = list(make("o2-bf16", seed=7, shapes=shapes))
    return lists, lists.pop(1)[0]


@pytest.mark.parametrize("op", ["lamb", "novograd", "l2norm", "scale", "axpby"])
def test_op_count_does_not_grow_with_the_tensor_count(cpu_path, op):
    """No per-tensor work on a step's path: the number of torch ops of a second launch
    of a prepared sweep is the same for 3 and for 30 tensors."""
    counts = []
    for n in (3, 30):
        lists, grads = _op_lists(op, n)
        params, ms, vs, copies, steps = lists
        if op == "lamb":
            prepared = lamb_prepare(params, grads, ms, vs, steps, copies)
            kw, _ = _lamb_kw({})
            norm = multi_tensor_l2norm(grads)[0]

            def run():
                lamb_launch(prepared, **kw, global_grad_norm=norm, grad_scale=torch.tensor(8.0),
                            found_inf=torch.zeros(1))
        elif op == "novograd":
            prepared = novograd_prepare(params, grads, ms, vs, steps, copies)

            def run():
                novograd_launch(prepared, **_novograd_kw({}), grad_scale=torch.tensor(8.0),
                                found_inf=torch.zeros(1))
        elif op == "l2norm":
            prepared = multi_tensor_l2norm_prepare(grads + params)

            def run():
                multi_tensor_l2norm_launch(prepared, per_tensor=True, scale=torch.tensor(2.0),
                                           found_inf=torch.zeros(1))
        elif op == "scale":
            prepared = multi_tensor_scale_prepare(grads, ms)

            def run():
                multi_tensor_scale_launch(prepared, 0.5, torch.zeros(1, dtype=torch.int32))
        else:
            prepared = multi_tensor_axpby_prepare(grads, ms, vs)

            def run():
                multi_tensor_axpby_launch(prepared, 0.5, 2.0, torch.zeros(1, dtype=torch.int32))
        run()
        with CountOps() as ops:
            run()
        counts.append(ops.count)
    assert counts[0] == counts[1]


# --------------------------------------------------------------------------------------
# FusedLAMB / FusedNovoGrad: the CPU path against the kernel path
# --------------------------------------------------------------------------------------

OPTIMIZERS = {
    "lamb": lambda p, **kw: FusedLAMB(p, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, **kw),
    "lamb_l2_nvlamb": lambda p, **kw: FusedLAMB(p, lr=1e-2, weight_decay=0.0, use_nvlamb=True,
                                                adam_w_mode=False, **kw),
    "novograd": lambda p, **kw: FusedNovoGrad(p, lr=1e-2, weight_decay=0.01, **kw),
    "novograd_max_reg": lambda p, **kw: FusedNovoGrad(p, lr=1e-2, norm_type=0,
                                                      reg_inside_moment=True, init_zero=True,
                                                      weight_decay=0.01, **kw),
}


def _plans_on_cpu_path(opt):
    plans = [c.prepared for c in plans_of(opt).values() if c.prepared is not None]
    return all(not p.triton for p in plans)


def _optimizer_cases():
    return [pytest.param(name, id=name) for name in OPTIMIZERS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16_master"])
@pytest.mark.parametrize("name", _optimizer_cases())
def test_optimizer_cpu_path_matches_kernel_path(name, dtype):
    kw = {} if dtype == torch.float32 else dict(master_weights=True)
    a, b = tiny_mlp(dtype), tiny_mlp(dtype)
    opt_a, opt_b = OPTIMIZERS[name](a.parameters(), **kw), OPTIMIZERS[name](b.parameters(), **kw)
    train_steps(a, opt_a, cpu=True)
    train_steps(b, opt_b, cpu=False)
    assert _plans_on_cpu_path(opt_a) and not _plans_on_cpu_path(opt_b)
    assert_close_to_ref(list(a.parameters()), list(b.parameters()), "params")
    for pa, pb in zip(a.parameters(), b.parameters()):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert_close_to_ref([sa[key]], [sb[key]], key)
