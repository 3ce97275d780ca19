"""Adam, SGD and Adagrad on the production CPU path (torch's fused CPU optimizer kernels).

Tolerances. fp32 results are held to the ``*_ref`` oracles at ``rtol=1e-6`` with
``atol=1e-6`` (one ulp at the inputs' scale, which is about 1 here): torch's fused kernels
round a few operations differently from the oracles (Adam's first moment and SGD's
``g + wd * p`` / momentum update as one fused multiply-add, ``(lr * m) / d`` for
``lr * (m / d)``), an ulp or so where the oracle rounds twice, and a result that nearly
cancels (a momentum buffer) keeps that absolute error. Half results (half parameters,
the half copies of fp32 masters) are the rounding of such an fp32 value, so they may sit
one half ulp apart: ``rtol`` is the dtype's machine epsilon. Against torch.optim's
optimizers the tolerances are torch's own (``TOL``, torch's default ``assertEqual``
tolerances, which its fused-vs-foreach optimizer tests use). What is exact is tested
exactly: step counts, a skipped step (everything bitwise unchanged), the gradients
(never written), the number of torch ops per step (independent of the tensor count).
"""
import math

import pytest
import torch

from conftest import (TOL, CountOps, all_tensors, assert_bits_unchanged, assert_bitwise_unchanged,
                      assert_close_to_ref, snapshot, tiny_mlp, train_steps)
from conftest import clone_lists as clones
from conftest import scaled_grads as scaled
from tritamp.testing import force_cpu_path, plans_of
from tritamp.kernels.adagrad import adagrad_launch, adagrad_prepare, adagrad_step_ref
from tritamp.kernels.adam import adam_launch, adam_prepare, adam_step_ref
from tritamp.kernels.sgd import sgd_launch, sgd_prepare, sgd_step_ref
from tritamp.optimizers import FusedAdagrad, FusedAdam, FusedSGD

SHAPES = ((1,), (1000,), (3, 257), (0,))
TINY = ((1,), (33,), (0,))  # fp16 parameters: CPU fp16 arithmetic in the oracle is slow
# name: (parameter dtype, gradient dtype, copy dtype)
CASES = {
    "fp32": (torch.float32, torch.float32, None),
    "o2-bf16": (torch.float32, torch.bfloat16, torch.bfloat16),
    "o2-fp16": (torch.float32, torch.float16, torch.float16),
    "bf16": (torch.bfloat16, torch.bfloat16, None),
    "fp16": (torch.float16, torch.float16, None),
}
# (grad_scale, found_inf): no amp; a power-of-two scale (exact either way of unscaling);
# a scale of 3 (torch's kernel divides half gradients by it, the oracle multiplies by
# fp32(1/3): an ulp at most)
AMP = {"plain": (None, None), "scale1024": (1024.0, 0.0), "scale3": (3.0, 0.0)}
N_STEPS = 3


def make_lists(case, n_state, seed=0, shapes=None, steps=0.0):
    """params, grads per step (N_STEPS lists), ``n_state`` fp32 state lists, copies,
    steps; the copies hold the rounding of the masters (as amp's O2 model weights do)."""
    p_dtype, g_dtype, c_dtype = CASES[case]
    if shapes is None:
        shapes = TINY if torch.float16 in (p_dtype, g_dtype) else SHAPES
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(p_dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(g_dtype) for s in shapes]
             for _ in range(N_STEPS)]
    state = [[(torch.rand(s, generator=gen) * 0.1) for s in shapes] for _ in range(n_state)]
    copies = None if c_dtype is None else [p.to(c_dtype) for p in params]
    counts = [torch.full((), steps) for _ in shapes]
    return params, grads, state, copies, counts


def amp_args(amp):
    scale, found = AMP[amp]
    return (None if scale is None else torch.tensor(scale),
            None if found is None else torch.tensor([found]))


# --------------------------------------------------------------------------------------
# Adam
# --------------------------------------------------------------------------------------

ADAM_KW = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def adam_run(lists, grads, cpu, **kw):
    params, m, v, steps, copies = lists
    if cpu:
        with force_cpu_path():
            prepared = adam_prepare(params, grads, m, v, steps, copies)
        assert not prepared.triton
        adam_launch(prepared, **kw)
    else:
        adam_step_ref(params, grads, m, v, steps, copies, **kw)


@pytest.mark.parametrize("amp", AMP)
@pytest.mark.parametrize("lr_tensor", [False, True], ids=["lr", "lr_tensor"])
@pytest.mark.parametrize("bias_correction", [True, False], ids=["bc", "no_bc"])
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("case", CASES)
def test_adam_cpu_path_matches_ref(case, adam_w_mode, bias_correction, lr_tensor, amp):
    params, grads, (m, v), copies, steps = make_lists(case, 2)
    ours = [params, m, v, steps, copies]
    ref = clones(ours)
    grad_scale, found_inf = amp_args(amp)
    lr = torch.tensor(1e-2) if lr_tensor else 1e-2
    for k in range(N_STEPS):
        g = scaled(grads[k], AMP[amp][0])
        before = snapshot(g)
        kw = dict(ADAM_KW, lr=lr, adam_w_mode=adam_w_mode, bias_correction=bias_correction,
                  grad_scale=grad_scale, found_inf=found_inf)
        adam_run(ours, g, True, **kw)
        adam_run(ref, g, False, **kw)
        assert_bitwise_unchanged(before, g)  # the user's gradients are never written
    for name, a, b in zip(("params", "exp_avgs", "exp_avg_sqs", "steps", "copies"), ours, ref):
        assert_close_to_ref(a, b, name)
    assert all(s.item() == N_STEPS for s in ours[3])  # empty tensors count theirs too


# --------------------------------------------------------------------------------------
# SGD
# --------------------------------------------------------------------------------------

SGD_VARIANTS = {
    "plain": dict(momentum=0.0),
    "plain_wd_after": dict(momentum=0.0, wd_after_momentum=True),
    "momentum_dampening": dict(momentum=0.9, dampening=0.1),
    "nesterov": dict(momentum=0.9, nesterov=True),
    "wd_after_momentum": dict(momentum=0.9, dampening=0.1, wd_after_momentum=True),
    "nesterov_wd_after": dict(momentum=0.9, nesterov=True, wd_after_momentum=True),
}


def sgd_run(lists, grads, cpu, **kw):
    params, bufs, steps, copies = lists
    if cpu:
        with force_cpu_path():
            prepared = sgd_prepare(params, grads, bufs, copies, steps)
        assert not prepared.triton
        sgd_launch(prepared, **kw)
    else:
        sgd_step_ref(params, grads, bufs, copies, steps=steps, **kw)


@pytest.mark.parametrize("amp", AMP)
@pytest.mark.parametrize("variant", SGD_VARIANTS)
@pytest.mark.parametrize("case", CASES)
def test_sgd_cpu_path_matches_ref(case, variant, amp):
    params, grads, (bufs,), copies, steps = make_lists(case, 1)
    for b in bufs:  # step counts 0: fresh buffers, zeros as the optimizers create them
        b.zero_()
    ours = [params, bufs, steps, copies]
    ref = clones(ours)
    grad_scale, found_inf = amp_args(amp)
    for k in range(N_STEPS):
        g = scaled(grads[k], AMP[amp][0])
        before = snapshot(g)
        kw = dict(SGD_VARIANTS[variant], lr=torch.tensor(0.1) if k == 1 else 0.1,
                  weight_decay=0.01, grad_scale=grad_scale, found_inf=found_inf)
        sgd_run(ours, g, True, **kw)
        sgd_run(ref, g, False, **kw)
        assert_bitwise_unchanged(before, g)
    for name, a, b in zip(("params", "momentum_buffers", "steps", "copies"), ours, ref):
        assert_close_to_ref(a, b, name)
    assert all(s.item() == N_STEPS for s in ours[2])


@pytest.mark.parametrize("counts", [(0.0, 0.0, 0.0, 0.0), (2.0, 2.0, 2.0, 2.0),
                                    (0.0, 3.0, 1.0, 0.0), None],
                         ids=["all_first", "none_first", "mixed", "no_counts"])
@pytest.mark.parametrize("first_run", [False, True], ids=["", "first_run"])
def test_sgd_first_step_per_tensor_as_the_kernel(counts, first_run):
    """A buffer starts from the gradient at ``first_run`` or where its count is 0 (the
    buffers hold other values here, so a wrong choice shows)."""
    params, grads, (bufs,), _, _ = make_lists("fp32", 1, seed=3)
    steps = None if counts is None else [torch.tensor([c]) for c in counts]
    ours = [params, bufs, steps, None]
    ref = clones(ours)
    kw = dict(lr=0.1, momentum=0.9, dampening=0.25, weight_decay=0.01, first_run=first_run)
    sgd_run(ours, grads[0], True, **kw)
    sgd_run(ref, grads[0], False, **kw)
    for name, a, b in zip(("params", "momentum_buffers"), ours, ref):
        assert_close_to_ref(a, b, name)
    if counts is not None:
        assert [s.item() for s in ours[2]] == [c + 1 for c in counts]


def test_sgd_without_dampening_takes_mixed_first_steps_in_one_call():
    """Without dampening a buffer at step count 0 (zeros, as created) needs no first-step
    flag: mixed counts give the kernel's per-tensor rule with no count read."""
    params, grads, (bufs,), _, _ = make_lists("fp32", 1, seed=4)
    counts = (0.0, 3.0, 1.0, 0.0)
    for b, c in zip(bufs, counts):
        if c == 0.0:
            b.zero_()
    steps = [torch.tensor([c]) for c in counts]
    ours = [params, bufs, steps, None]
    ref = clones(ours)
    kw = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True)
    with CountOps() as ops:
        sgd_run(ours, grads[0], True, **kw)
    sgd_run(ref, grads[0], False, **kw)
    for name, a, b in zip(("params", "momentum_buffers"), ours, ref):
        assert_close_to_ref(a, b, name)
    assert ops.host_reads == 0


def test_fused_sgd_zeroes_unused_buffers_on_load():
    """A loaded buffer at step count 0 is unused (the first step sets it): held at zeros."""
    from tritamp.optimizers import FusedSGD
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedSGD([p], lr=0.1, momentum=0.9)
    sd = {"state": {0: {"momentum_buffer": torch.full((3,), 5.0), "step": torch.tensor(0.0)}},
          "param_groups": opt.state_dict()["param_groups"]}
    opt.load_state_dict(sd)
    assert torch.equal(opt.state[p]["momentum_buffer"], torch.zeros(3))
    sd["state"][0]["step"] = torch.tensor(2.0)
    opt.load_state_dict(sd)
    assert torch.equal(opt.state[p]["momentum_buffer"], torch.full((3,), 5.0))


def test_sgd_skipped_first_step_leaves_the_buffer_unused():
    """As in torch, whose buffer is created at the first step taken: a skipped first step
    changes nothing, and the next step starts the buffer from its gradient."""
    params, grads, (bufs,), _, steps = make_lists("fp32", 1, seed=4)
    ours = [params, bufs, steps, None]
    ref = clones(ours)
    kw = dict(lr=0.1, momentum=0.9, dampening=0.25)
    start = snapshot(all_tensors(*ours))
    sgd_run(ours, grads[0], True, found_inf=torch.tensor(1.0), **kw)
    assert_bitwise_unchanged(start, all_tensors(*ours))
    sgd_run(ours, grads[1], True, found_inf=torch.tensor(0.0), **kw)
    sgd_run(ref, grads[1], False, **kw)
    for name, a, b in zip(("params", "momentum_buffers", "steps"), ours, ref):
        assert_close_to_ref(a, b, name)


# --------------------------------------------------------------------------------------
# Adagrad
# --------------------------------------------------------------------------------------

def adagrad_run(lists, grads, cpu, **kw):
    params, sums, steps, copies = lists
    if cpu:
        with force_cpu_path():
            prepared = adagrad_prepare(params, grads, sums, copies, steps)
        assert not prepared.triton
        adagrad_launch(prepared, **kw)
    else:
        adagrad_step_ref(params, grads, sums, copies, steps=steps, **kw)


@pytest.mark.parametrize("amp", AMP)
@pytest.mark.parametrize("with_steps", [True, False], ids=["steps", "no_steps"])
@pytest.mark.parametrize("adagrad_w_mode", [False, True], ids=["l2", "w_mode"])
@pytest.mark.parametrize("case", CASES)
def test_adagrad_cpu_path_matches_ref(case, adagrad_w_mode, with_steps, amp):
    params, grads, (sums,), copies, steps = make_lists(case, 1)
    ours = [params, sums, steps if with_steps else None, copies]
    ref = clones(ours)
    grad_scale, found_inf = amp_args(amp)
    for k in range(N_STEPS):
        g = scaled(grads[k], AMP[amp][0])
        before = snapshot(g)
        kw = dict(lr=torch.tensor(0.05) if k == 2 else 0.05, eps=1e-10, weight_decay=0.01,
                  adagrad_w_mode=adagrad_w_mode, grad_scale=grad_scale, found_inf=found_inf)
        adagrad_run(ours, g, True, **kw)
        adagrad_run(ref, g, False, **kw)
        assert_bitwise_unchanged(before, g)
    for name, a, b in zip(("params", "sums", "steps", "copies"), ours, ref):
        assert_close_to_ref(a, b, name)
    if with_steps:
        assert all(s.item() == N_STEPS for s in ours[2])


# --------------------------------------------------------------------------------------
# every op: a skipped step, op counts
# --------------------------------------------------------------------------------------

def _op_lists(op, case, n_tensors=None, seed=0):
    shapes = None if n_tensors is None else [(5 + i % 4, 3) for i in range(n_tensors)]
    n_state = 2 if op == "adam" else 1
    params, grads, state, copies, steps = make_lists(case, n_state, seed=seed, shapes=shapes,
                                                     steps=1.0)
    return params, grads, state, copies, steps


def _prepare(op, params, grads, state, copies, steps):
    with force_cpu_path():
        if op == "adam":
            return adam_prepare(params, grads, state[0], state[1], steps, copies)
        if op == "sgd":
            return sgd_prepare(params, grads, state[0], copies, steps)
        return adagrad_prepare(params, grads, state[0], copies, steps)


def _launch(op, prepared, grad_scale, found_inf, **extra):
    amp = dict(grad_scale=grad_scale, found_inf=found_inf)
    if op == "adam":
        adam_launch(prepared, lr=1e-2, **ADAM_KW, **amp, **extra)
    elif op == "sgd":
        sgd_launch(prepared, lr=0.1, momentum=0.9, weight_decay=0.01, **amp, **extra)
    else:
        adagrad_launch(prepared, lr=0.1, eps=1e-10, weight_decay=0.01, **amp, **extra)


OP_EXTRAS = {
    "adam": [dict(), dict(adam_w_mode=False, bias_correction=False)],
    "sgd": [dict(), dict(wd_after_momentum=True, nesterov=True)],
    "adagrad": [dict(), dict(adagrad_w_mode=True)],
}


@pytest.mark.parametrize("found", [1.0, 2.0, math.nan], ids=["one", "two", "nan"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("op", ["adam", "sgd", "adagrad"])
def test_skipped_step_changes_nothing_bitwise(op, case, found):
    """Any non-zero found_inf (torch's fused kernels themselves skip only on 1.0) leaves
    parameters, state, step counts, copies (they hold the masters' rounding, as amp's O2
    model weights do) and gradients bit for bit as they were, even with non-finite
    gradients."""
    params, grads, state, copies, steps = _op_lists(op, case)
    g = grads[0]
    g[0][0] = math.inf
    if g[1].numel():
        g[1][3] = math.nan
    for extra in OP_EXTRAS[op]:
        for grad_scale in (None, torch.tensor(1024.0)):
            everything = all_tensors(params, g, *state, copies, steps)
            start = snapshot(everything)
            _launch(op, _prepare(op, params, g, state, copies, steps), grad_scale,
                    torch.tensor([found]), **extra)
            assert_bits_unchanged(start, everything)


@pytest.mark.parametrize("case", ["fp32", "o2-bf16", "bf16"])
@pytest.mark.parametrize("op", ["adam", "sgd", "adagrad"])
def test_op_count_does_not_grow_with_the_tensor_count(op, case):
    """No per-tensor work on a step's path: the number of torch ops a (second) launch of a
    prepared sweep runs is the same for 3 and for 30 tensors."""
    counts = []
    for n in (3, 30):
        params, grads, state, copies, steps = _op_lists(op, case, n_tensors=n)
        prepared = _prepare(op, params, grads[0], state, copies, steps)
        per_variant = []
        for extra in OP_EXTRAS[op]:
            _launch(op, prepared, torch.tensor(1024.0), torch.tensor(0.0), **extra)
            with CountOps() as ops:
                _launch(op, prepared, torch.tensor(1024.0), torch.tensor(0.0), **extra)
            per_variant.append(ops.count)
        counts.append(per_variant)
    assert counts[0] == counts[1]


# --------------------------------------------------------------------------------------
# the optimizers on the CPU path
# --------------------------------------------------------------------------------------

OPTIMIZERS = {
    "adamw": lambda p, **kw: FusedAdam(p, lr=1e-2, weight_decay=0.01, **kw),
    "adam_l2_no_bc": lambda p, **kw: FusedAdam(p, lr=1e-2, weight_decay=0.01,
                                               adam_w_mode=False, bias_correction=False, **kw),
    "sgd_nesterov": lambda p, **kw: FusedSGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                             weight_decay=0.01),
    "sgd_wd_after": lambda p, **kw: FusedSGD(p, lr=0.05, momentum=0.9, dampening=0.1,
                                             weight_decay=0.01, wd_after_momentum=True),
    "adagrad": lambda p, **kw: FusedAdagrad(p, lr=0.05, weight_decay=0.01, **kw),
    "adagrad_w": lambda p, **kw: FusedAdagrad(p, lr=0.05, weight_decay=0.01,
                                              adagrad_w_mode=True, **kw),
}


def _plans_on_cpu_path(opt):
    return all(c.prepared is None or not c.prepared.triton for c in plans_of(opt).values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16_master"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_cpu_path_matches_kernel_path(name, dtype):
    """The same optimizer, a few steps through the production CPU path and through the
    (interpreted) Triton kernels; bf16 parameters keep fp32 masters (SGD: fp32 state)."""
    kw = {} if dtype == torch.float32 or name.startswith("sgd") else dict(master_weights=True)
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


TORCH_TWINS = {
    "adamw": (lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.01),
              lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01)),
    "adam_l2": (lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.01, adam_w_mode=False),
                lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01)),
    "sgd_dampening": (lambda p: FusedSGD(p, lr=0.05, momentum=0.9, dampening=0.1,
                                         weight_decay=0.01),
                      lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1,
                                                weight_decay=0.01)),
    "sgd_nesterov": (lambda p: FusedSGD(p, lr=0.05, momentum=0.9, nesterov=True),
                     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True)),
    "sgd_plain": (lambda p: FusedSGD(p, lr=0.05, weight_decay=0.01),
                  lambda p: torch.optim.SGD(p, lr=0.05, weight_decay=0.01)),
    "adagrad": (lambda p: FusedAdagrad(p, lr=0.05, weight_decay=0.01),
                lambda p: torch.optim.Adagrad(p, lr=0.05, weight_decay=0.01)),
}


@pytest.mark.parametrize("name", TORCH_TWINS)
def test_optimizer_cpu_path_matches_torch_optim(name, cpu_path):
    """fp32, a few steps against torch.optim's class, at torch's own tolerances."""
    ours_make, torch_make = TORCH_TWINS[name]
    a, b = tiny_mlp(), tiny_mlp()
    opt_a, opt_b = ours_make(a.parameters()), torch_make(b.parameters())
    train_steps(a, opt_a, cpu=True, steps=4)
    train_steps(b, opt_b, cpu=False, steps=4)
    assert _plans_on_cpu_path(opt_a)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, **TOL[torch.float32])


@pytest.mark.parametrize("name", ["adamw", "sgd_dampening", "adagrad"])
def test_gradscaler_with_an_overflow_drives_the_cpu_path_like_torch(name, cpu_path):
    """torch.amp.GradScaler hands the step grad_scale and found_inf; step 2 overflows:
    the same trajectory as torch's optimizer, and the overflow step does not count."""
    ours_make, torch_make = TORCH_TWINS[name]
    a, b = tiny_mlp(), tiny_mlp()
    opt_a, opt_b = ours_make(a.parameters()), torch_make(b.parameters())
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2)]
    gen = torch.Generator().manual_seed(7)
    for factor in (1.0, math.inf, 1.0, 1.0):
        x = torch.randn(4, 7, generator=gen)
        for model, opt, scaler in ((a, opt_a, scalers[0]), (b, opt_b, scalers[1])):
            opt.zero_grad()
            scaler.scale(model(x).square().mean() * factor).backward()
            scaler.step(opt)
            scaler.update()
    assert _plans_on_cpu_path(opt_a)
    assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0 ** 9
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, **TOL[torch.float32])
        if "step" in opt_a.state[pa] and name != "sgd_dampening":
            assert opt_a.state[pa]["step"].item() == 3


@pytest.mark.parametrize("name", ["adamw", "sgd_nesterov", "adagrad"])
def test_amp_o2_on_the_cpu_path_matches_the_kernel_path(name):
    """tritamp.amp at O2 (fp32 masters, the half model's gradients read directly, the half
    model written in the same step) with an overflow in step 2, through both paths."""
    from tritamp import amp
    results = []
    for cpu in (True, False):
        model = tiny_mlp()
        opt = OPTIMIZERS[name](model.parameters())
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        gen = torch.Generator().manual_seed(9)
        for factor in (1.0, math.inf, 1.0):
            x = torch.randn(4, 7, generator=gen)
            opt.zero_grad()
            with amp.scale_loss(model(x).float().square().mean() * factor, opt) as loss:
                loss.backward()
            if cpu:
                with force_cpu_path():
                    opt.step()
            else:
                opt.step()
        assert _plans_on_cpu_path(opt) == cpu
        masters = list(amp.master_params(opt))
        halves = list(model.parameters())
        for m, h in zip(masters, halves):
            assert m.dtype == torch.float32 and h.dtype == torch.float16
            assert torch.equal(h.detach(), m.detach().half())
        results.append(masters)
    assert_close_to_ref(*results, "masters")
