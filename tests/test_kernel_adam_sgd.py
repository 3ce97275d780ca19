"""adam_step / sgd_step: the Triton kernels against adam_step_ref / sgd_step_ref.

Kernel and reference run the same fp32 operations in the same order, so on the
interpreter they agree bit for bit: parameters, optimizer state, step counts and the half
copies of fp32 masters. torch's CPU fp32 ``sqrt`` (MKL's VML on x86 wheels) is not
correctly rounded (about 0.7% of inputs come out one ulp off); the reference takes its
square roots through fp64, correctly rounded like the kernel's ``tl.sqrt_rn``.

Cases: fp32 parameters; fp32 masters with fp16/bf16 gradients and half copies (amp O2);
half parameters updated directly. Without a GPU the kernels run in
Triton's interpreter (tests/conftest.py): ~30 us per 4096-element program, so tensors stay
small and examples few.
"""
import importlib
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritamp.kernels.adam import adam_step, adam_step_ref
from tritamp.kernels.sgd import sgd_step, sgd_step_ref

# The modules themselves, for swapping their kernels with a launch counter.
adam_mod = importlib.import_module("tritamp.kernels.adam")
sgd_mod = importlib.import_module("tritamp.kernels.sgd")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# On the GPU Triton may contract a * b + c into an FMA; the interpreter never does.
EXACT = DEVICE.type == "cpu"
BLOCK = 4096 if DEVICE.type == "cpu" else 2048

# Odd sizes: one element, a partial program, two programs (4097), a 2-D tensor.
SIZES = (1, 257, 4097, (3, 257))
# (parameter dtype, gradient dtype, copy dtype or None)
CASES = {
    "fp32": (torch.float32, torch.float32, None),
    "master-fp16": (torch.float32, torch.float16, torch.float16),
    "master-bf16": (torch.float32, torch.bfloat16, torch.bfloat16),
    "half-fp16": (torch.float16, torch.float16, None),
    "half-bf16": (torch.bfloat16, torch.bfloat16, None),
}
SCALES = (None, 1024.0, 3.0, 2.0 ** -3)

HYPOTHESIS = dict(deadline=None, max_examples=20,
                  suppress_health_check=[HealthCheck.function_scoped_fixture,
                                         HealthCheck.too_slow])


def scalar(value, shape=()):
    return torch.full(shape, value, dtype=torch.float32, device=DEVICE)


def assert_same(actual, expected, what):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, what
    if EXACT:
        if not torch.equal(actual, expected):
            bad = (actual != expected).reshape(-1).nonzero()
            i = int(bad[0])
            raise AssertionError(
                f"{what}: {bad.numel()} of {actual.numel()} elements differ; first at {i}: "
                f"{actual.reshape(-1)[i].item()!r} != {expected.reshape(-1)[i].item()!r}")
    else:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=1e-7, msg=what)


def clones(tensors):
    return None if tensors is None else [t.clone() for t in tensors]


def make_grads(gen, sizes, dtype, scale, inf_at=None):
    grads = []
    for i, s in enumerate(sizes):
        g = torch.randn(s, generator=gen) * (scale or 1.0)
        if inf_at == i:
            g.view(-1)[-1] = math.inf
        grads.append(g.to(dtype).to(DEVICE))
    return grads


@st.composite
def kernel_setup(draw):
    sizes = draw(st.lists(st.sampled_from(SIZES), min_size=1, max_size=3))
    case = draw(st.sampled_from(sorted(CASES)))
    return dict(sizes=sizes, case=case,
                seed=draw(st.integers(0, 2 ** 31 - 1)),
                n_steps=draw(st.integers(1, 3)),
                scale=draw(st.sampled_from(SCALES)),
                found_inf=draw(st.sampled_from((None, 0.0, 1.0))),
                scalar_shape=draw(st.sampled_from(((), (1,)))),
                lr_tensor=draw(st.booleans()))


def amp_args(setup):
    shape = setup["scalar_shape"]
    grad_scale = None if setup["scale"] is None else scalar(setup["scale"], shape)
    found_inf = None if setup["found_inf"] is None else scalar(setup["found_inf"], shape)
    return grad_scale, found_inf


def lr_arg(lr, as_tensor):
    return scalar(lr) if as_tensor else lr


# ------------------------------------------------------------------------------- Adam

def adam_tensors(setup):
    gen = torch.Generator().manual_seed(setup["seed"])
    p_dtype, g_dtype, c_dtype = CASES[setup["case"]]
    sizes = setup["sizes"]
    params = [torch.randn(s, generator=gen).to(p_dtype).to(DEVICE) for s in sizes]
    exp_avgs = [(0.1 * torch.randn(s, generator=gen)).to(DEVICE) for s in sizes]
    exp_avg_sqs = [(0.01 * torch.rand(s, generator=gen)).to(DEVICE) for s in sizes]
    # a different step count per tensor: bias correction is per tensor
    steps = [scalar(float(i * 2)) for i in range(len(sizes))]
    copies = None if c_dtype is None else [p.to(c_dtype) for p in params]
    return params, exp_avgs, exp_avg_sqs, steps, copies, gen


# beta1 = 0: the kernel takes log2(0) = -inf (numpy warns under the interpreter), and
# exp2(t * -inf) = 0 gives the right bias correction of 1.
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
@settings(**HYPOTHESIS)
@given(setup=kernel_setup(),
       adam_w_mode=st.booleans(), bias_correction=st.booleans(),
       lr=st.sampled_from((1e-3, 0.1)), betas=st.sampled_from(((0.9, 0.999), (0.5, 0.95),
                                                               (0.0, 0.9))),
       eps=st.sampled_from((1e-8, 1e-3)), weight_decay=st.sampled_from((0.0, 0.01, 0.3)))
def test_adam_kernel_matches_ref(setup, adam_w_mode, bias_correction, lr, betas, eps,
                                 weight_decay):
    params, m, v, steps, copies, gen = adam_tensors(setup)
    start = [clones(x) for x in (params, m, v, steps, copies)]
    ours = [clones(x) for x in (params, m, v, steps, copies)]
    ref = [clones(x) for x in (params, m, v, steps, copies)]
    grad_scale, found_inf = amp_args(setup)
    g_dtype = CASES[setup["case"]][1]
    kw = dict(lr=lr_arg(lr, setup["lr_tensor"]), beta1=betas[0], beta2=betas[1], eps=eps,
              weight_decay=weight_decay, adam_w_mode=adam_w_mode,
              bias_correction=bias_correction, grad_scale=grad_scale, found_inf=found_inf)
    for k in range(setup["n_steps"]):
        # a skipped step in real life holds an inf somewhere
        inf_at = 0 if setup["found_inf"] == 1.0 and k == 0 else None
        grads = make_grads(gen, setup["sizes"], g_dtype, setup["scale"], inf_at)
        adam_step(ours[0], grads, ours[1], ours[2], ours[3], ours[4], **kw)
        adam_step_ref(ref[0], grads, ref[1], ref[2], ref[3], ref[4], **kw)

    names = ("param", "exp_avg", "exp_avg_sq", "step", "copy")
    for name, a, r in zip(names, ours, ref):
        for i, (x, y) in enumerate(zip(a or [], r or [])):
            assert_same(x, y, f"{name} {i}")
    if setup["found_inf"] == 1.0:
        for name, a, s in zip(names, ours, start):
            for i, (x, y) in enumerate(zip(a or [], s or [])):
                assert torch.equal(x, y), f"{name} {i} changed on a skipped step"
    else:
        expected_steps = [s + setup["n_steps"] for s in start[3]]
        for i, (x, y) in enumerate(zip(ours[3], expected_steps)):
            assert torch.equal(x, y), f"step {i}: {x.item()} != {y.item()}"
        for i, p in enumerate(ours[0]):
            if p.dtype == torch.float32:  # a half parameter may round back to itself
                assert not torch.equal(p, start[0][i]), f"param {i} did not move"
    if ours[4] is not None:  # the half copy is the rounded fp32 master
        for i, (p, c) in enumerate(zip(ours[0], ours[4])):
            assert torch.equal(c, p.to(c.dtype)), f"copy {i} != master.to({c.dtype})"


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam"])
def test_adam_kernel_every_case_deterministic(case, adam_w_mode):
    """Deterministic companion of the hypothesis test: every case, grad scale and lr tensor."""
    setup = dict(sizes=list(SIZES), case=case, seed=7, n_steps=2, scale=3.0, found_inf=0.0,
                 scalar_shape=(), lr_tensor=True)
    params, m, v, steps, copies, gen = adam_tensors(setup)
    ours = [clones(x) for x in (params, m, v, steps, copies)]
    ref = [clones(x) for x in (params, m, v, steps, copies)]
    grad_scale, found_inf = amp_args(setup)
    kw = dict(lr=scalar(1e-2), beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
              adam_w_mode=adam_w_mode, grad_scale=grad_scale, found_inf=found_inf)
    for _ in range(2):
        grads = make_grads(gen, SIZES, CASES[case][1], 3.0)
        adam_step(ours[0], grads, ours[1], ours[2], ours[3], ours[4], **kw)
        adam_step_ref(ref[0], grads, ref[1], ref[2], ref[3], ref[4], **kw)
    for name, a, r in zip(("param", "exp_avg", "exp_avg_sq", "step", "copy"), ours, ref):
        for i, (x, y) in enumerate(zip(a or [], r or [])):
            assert_same(x, y, f"{name} {i}")


@pytest.mark.skipif(not EXACT, reason="bitwise comparison on the interpreter only")
def test_adam_ref_sqrt_is_correctly_rounded_like_the_kernel():
    # p = 0, lr = 1, eps = 0: the new p is -m / sqrt(v), so every sqrt that rounds
    # differently shows (~0.7% of 4096 elements)
    gen = torch.Generator().manual_seed(0)
    n = 4096
    m, v = 0.1 * torch.randn(n, generator=gen), 0.01 * torch.rand(n, generator=gen)
    g = torch.randn(n, generator=gen)
    ours = [torch.zeros(n), m.clone(), v.clone(), scalar(0.0)]
    ref = [torch.zeros(n), m.clone(), v.clone(), scalar(0.0)]
    kw = dict(lr=1.0, beta1=0.9, beta2=0.999, eps=0.0, weight_decay=0.0, bias_correction=False)
    adam_step([ours[0]], [g], [ours[1]], [ours[2]], [ours[3]], **kw)
    adam_step_ref([ref[0]], [g], [ref[1]], [ref[2]], [ref[3]], **kw)
    assert torch.equal(ours[2], ref[2])  # v agrees; only the sqrt of it differs
    assert_same(ours[0], ref[0], "param")


def test_adam_kernel_matches_torch_adamw_one_step():
    """The reference is torch's algorithm: one step of torch.optim.AdamW is within an ulp."""
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(1000, generator=gen)
    g = torch.randn(1000, generator=gen)
    theirs = p.clone().requires_grad_()
    theirs.grad = g.clone()
    torch.optim.AdamW([theirs], lr=1e-2, weight_decay=0.1).step()
    ours, m, v, s = p.clone(), torch.zeros(1000), torch.zeros(1000), scalar(0.0)
    adam_step([ours], [g], [m], [v], [s], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.1)
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-7)
    assert s.item() == 1.0


# -------------------------------------------------------------------------------- SGD

def sgd_tensors(setup, momentum):
    gen = torch.Generator().manual_seed(setup["seed"])
    p_dtype, _, c_dtype = CASES[setup["case"]]
    sizes = setup["sizes"]
    params = [torch.randn(s, generator=gen).to(p_dtype).to(DEVICE) for s in sizes]
    bufs = None if momentum == 0 else [torch.randn(s, generator=gen).to(DEVICE) for s in sizes]
    copies = None if c_dtype is None else [p.to(c_dtype) for p in params]
    return params, bufs, copies, gen


@settings(**HYPOTHESIS)
@given(setup=kernel_setup(), momentum=st.sampled_from((0.0, 0.9)),
       dampening=st.sampled_from((0.0, 0.1)), nesterov=st.booleans(),
       wd_after_momentum=st.booleans(), first_run=st.booleans(),
       lr=st.sampled_from((1e-2, 0.3)), weight_decay=st.sampled_from((0.0, 1e-2)))
def test_sgd_kernel_matches_ref(setup, momentum, dampening, nesterov, wd_after_momentum,
                                first_run, lr, weight_decay):
    params, bufs, copies, gen = sgd_tensors(setup, momentum)
    start = [clones(x) for x in (params, bufs, copies)]
    ours = [clones(x) for x in (params, bufs, copies)]
    ref = [clones(x) for x in (params, bufs, copies)]
    grad_scale, found_inf = amp_args(setup)
    g_dtype = CASES[setup["case"]][1]
    kw = dict(lr=lr_arg(lr, setup["lr_tensor"]), momentum=momentum, dampening=dampening,
              weight_decay=weight_decay, nesterov=nesterov,
              wd_after_momentum=wd_after_momentum, grad_scale=grad_scale, found_inf=found_inf)
    for k in range(setup["n_steps"]):
        inf_at = 0 if setup["found_inf"] == 1.0 and k == 0 else None
        grads = make_grads(gen, setup["sizes"], g_dtype, setup["scale"], inf_at)
        first = first_run and k == 0
        sgd_step(ours[0], grads, ours[1], ours[2], first_run=first, **kw)
        sgd_step_ref(ref[0], grads, ref[1], ref[2], first_run=first, **kw)

    for name, a, r in zip(("param", "momentum_buffer", "copy"), ours, ref):
        for i, (x, y) in enumerate(zip(a or [], r or [])):
            assert_same(x, y, f"{name} {i}")
    if setup["found_inf"] == 1.0:
        for name, a, s in zip(("param", "momentum_buffer", "copy"), ours, start):
            for i, (x, y) in enumerate(zip(a or [], s or [])):
                assert torch.equal(x, y), f"{name} {i} changed on a skipped step"
    if ours[2] is not None:
        for i, (p, c) in enumerate(zip(ours[0], ours[2])):
            assert torch.equal(c, p.to(c.dtype)), f"copy {i} != master.to({c.dtype})"


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("variant", [
    dict(momentum=0.0),
    dict(momentum=0.9, first_run=True),
    dict(momentum=0.9, dampening=0.2, weight_decay=1e-2),
    dict(momentum=0.9, nesterov=True, weight_decay=1e-2),
    dict(momentum=0.9, weight_decay=1e-2, wd_after_momentum=True),
], ids=["plain", "first_run", "dampening", "nesterov", "wd_after_momentum"])
def test_sgd_kernel_every_case_deterministic(case, variant):
    setup = dict(sizes=list(SIZES), case=case, seed=11, n_steps=2, scale=1024.0, found_inf=0.0,
                 scalar_shape=(1,), lr_tensor=False)
    params, bufs, copies, gen = sgd_tensors(setup, variant["momentum"])
    ours = [clones(x) for x in (params, bufs, copies)]
    ref = [clones(x) for x in (params, bufs, copies)]
    grad_scale, found_inf = amp_args(setup)
    grads = make_grads(gen, SIZES, CASES[case][1], 1024.0)
    sgd_step(ours[0], grads, ours[1], ours[2], lr=0.1, grad_scale=grad_scale,
             found_inf=found_inf, **variant)
    sgd_step_ref(ref[0], grads, ref[1], ref[2], lr=0.1, grad_scale=grad_scale,
                 found_inf=found_inf, **variant)
    for name, a, r in zip(("param", "momentum_buffer", "copy"), ours, ref):
        for i, (x, y) in enumerate(zip(a or [], r or [])):
            assert_same(x, y, f"{name} {i}")


@pytest.mark.parametrize("kw", [dict(momentum=0.9, first_run=True),
                                dict(momentum=0.9, dampening=0.3, weight_decay=0.1),
                                dict(momentum=0.9, nesterov=True, weight_decay=0.1)],
                         ids=["first_run", "dampening", "nesterov"])
def test_sgd_kernel_matches_torch_sgd(kw):
    """Two steps of the kernel against torch.optim.SGD (first_run = no buffer yet)."""
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(1000, generator=gen)
    grads = [torch.randn(1000, generator=gen) for _ in range(2)]
    kw = dict(kw)
    first_run = kw.pop("first_run", False)
    theirs = p.clone().requires_grad_()
    opt = torch.optim.SGD([theirs], lr=0.1, **kw)
    ours, buf = p.clone(), torch.zeros(1000)
    if not first_run:  # start both from the same buffer
        theirs.grad = grads[0].clone()
        opt.step()
        buf = opt.state[theirs]["momentum_buffer"].clone()
        ours = theirs.detach().clone()
    theirs.grad = grads[1].clone()
    opt.step()
    sgd_step([ours], [grads[1]], [buf], lr=0.1, first_run=first_run, **kw)
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(buf, opt.state[theirs]["momentum_buffer"], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ launches per group

@pytest.fixture
def adam_launches(count_launches):
    return count_launches(adam_mod, "_adam_step_kernel")


@pytest.fixture
def sgd_launches(count_launches):
    return count_launches(sgd_mod, "_sgd_step_kernel")


def n_blocks(sizes):
    return sum(-(-math.prod(s if isinstance(s, tuple) else (s,)) // BLOCK) for s in sizes)


def mixed_lists(sizes, dtypes, copy_dtypes=None):
    """params (fp32 when copies are wanted), grads in ``dtypes``, fp32 state, copies."""
    gen = torch.Generator().manual_seed(0)
    if copy_dtypes is None:
        params = [torch.randn(s, generator=gen).to(d).to(DEVICE) for s, d in zip(sizes, dtypes)]
        copies = None
    else:
        params = [torch.randn(s, generator=gen).to(DEVICE) for s in sizes]
        copies = [p.to(d) for p, d in zip(params, copy_dtypes)]
    grads = [torch.randn(s, generator=gen).to(d).to(DEVICE) for s, d in zip(sizes, dtypes)]
    return params, grads, copies


def test_adam_one_launch_per_dtype_group(adam_launches):
    sizes = [1 + (i * 397) % 3000 for i in range(12)] + [4097]
    dtypes = [(torch.float32, torch.float16, torch.bfloat16)[i % 3] for i in range(len(sizes))]
    params, grads, _ = mixed_lists(sizes, dtypes)
    zeros = lambda: [torch.zeros(p.shape, device=DEVICE) for p in params]  # noqa: E731
    m, v, steps = zeros(), zeros(), [scalar(0.0) for _ in params]
    ref = [clones(x) for x in (params, m, v, steps)]
    adam_step(params, grads, m, v, steps, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.0)
    assert len(adam_launches.grids) == 3, adam_launches.grids
    expected = sorted(n_blocks([s for s, d in zip(sizes, dtypes) if d == dt])
                      for dt in (torch.float32, torch.float16, torch.bfloat16))
    assert sorted(g[0] for g in adam_launches.grids) == expected
    adam_step_ref(ref[0], grads, ref[1], ref[2], ref[3], lr=1e-2, beta1=0.9, beta2=0.999,
                  eps=1e-8, weight_decay=0.0)
    for a, r in zip(params + m + v + steps, sum(ref, [])):
        assert_same(a, r, "tensor")


def test_adam_masters_with_copies_one_launch_per_copy_dtype(adam_launches):
    sizes = [5, 300, 4097, 77]
    halves = [torch.float16, torch.bfloat16, torch.float16, torch.bfloat16]
    params, grads, copies = mixed_lists(sizes, halves, copy_dtypes=halves)
    m = [torch.zeros(p.shape, device=DEVICE) for p in params]
    v = [torch.zeros(p.shape, device=DEVICE) for p in params]
    steps = [scalar(0.0) for _ in params]
    adam_step(params, grads, m, v, steps, copies, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.0, grad_scale=scalar(8.0), found_inf=scalar(0.0))
    assert len(adam_launches.grids) == 2, adam_launches.grids
    for p, c in zip(params, copies):
        assert torch.equal(c, p.to(c.dtype))


def test_adam_empty_tensors_and_lists_launch_nothing(adam_launches):
    p = torch.zeros(0, device=DEVICE)
    s = scalar(0.0)
    adam_step([p], [p.clone()], [p.clone()], [p.clone()], [s], lr=1e-3, beta1=0.9, beta2=0.999,
              eps=1e-8, weight_decay=0.0)
    adam_step([], [], [], [], [], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    assert adam_launches.grids == []
    assert s.item() == 1.0  # an empty tensor still counts its step, as torch does


def test_sgd_one_launch_per_dtype_group(sgd_launches):
    sizes = [1 + (i * 397) % 3000 for i in range(12)] + [4097]
    dtypes = [(torch.float32, torch.float16, torch.bfloat16)[i % 3] for i in range(len(sizes))]
    params, grads, _ = mixed_lists(sizes, dtypes)
    bufs = [torch.zeros(p.shape, device=DEVICE) for p in params]
    ref = clones(params), clones(bufs)
    sgd_step(params, grads, bufs, lr=0.1, momentum=0.9, first_run=True)
    assert len(sgd_launches.grids) == 3, sgd_launches.grids
    expected = sorted(n_blocks([s for s, d in zip(sizes, dtypes) if d == dt])
                      for dt in (torch.float32, torch.float16, torch.bfloat16))
    assert sorted(g[0] for g in sgd_launches.grids) == expected
    sgd_step_ref(ref[0], grads, ref[1], lr=0.1, momentum=0.9, first_run=True)
    for a, r in zip(params + bufs, ref[0] + ref[1]):
        assert_same(a, r, "tensor")


def test_sgd_masters_with_copies_one_launch(sgd_launches):
    sizes = [5, 300, 4097]
    halves = [torch.float16] * 3
    params, grads, copies = mixed_lists(sizes, halves, copy_dtypes=halves)
    sgd_step(params, grads, None, copies, lr=0.1)
    assert sgd_launches.grids == [(n_blocks(sizes),)]
    for p, c in zip(params, copies):
        assert torch.equal(c, p.to(c.dtype))


# ----------------------------------------------------------------------- bad inputs

def _adam_lists(n=2):
    ps = [torch.zeros(3, device=DEVICE) for _ in range(n)]
    return dict(params=ps, grads=clones(ps), exp_avgs=clones(ps), exp_avg_sqs=clones(ps),
                steps=[scalar(0.0) for _ in range(n)])


ADAM_HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


@pytest.mark.parametrize("field", ["grads", "exp_avgs", "exp_avg_sqs", "steps", "copies"])
def test_adam_mismatched_lengths_raise(field):
    args = _adam_lists()
    args["copies"] = clones(args["params"])
    args[field] = args[field][:1]
    with pytest.raises(ValueError, match=field):
        adam_step(**args, **ADAM_HP)


@pytest.mark.parametrize("field", ["exp_avgs", "exp_avg_sqs"])
def test_adam_half_state_raises(field):
    args = _adam_lists()
    args[field] = [t.half() for t in args[field]]
    with pytest.raises(TypeError, match=rf"{field}\[0\] is float16, expected float32"):
        adam_step(**args, **ADAM_HP)


def test_sgd_bad_inputs_raise():
    ps = [torch.zeros(3, device=DEVICE) for _ in range(2)]
    with pytest.raises(ValueError, match="grads has 1 tensors but params has 2"):
        sgd_step(ps, ps[:1], lr=0.1)
    with pytest.raises(ValueError, match="momentum_buffers has 1 tensors but params has 2"):
        sgd_step(ps, clones(ps), clones(ps)[:1], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="copies has 1 tensors but params has 2"):
        sgd_step(ps, clones(ps), None, clones(ps)[:1], lr=0.1)
    with pytest.raises(ValueError, match="momentum_buffers"):
        sgd_step(ps, clones(ps), None, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"momentum_buffers\[1\] is None"):
        sgd_step(ps, clones(ps), [torch.zeros(3, device=DEVICE), None], lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match=r"momentum_buffers\[0\] is float16, expected float32"):
        sgd_step(ps, clones(ps), [p.half() for p in ps], lr=0.1, momentum=0.9)
