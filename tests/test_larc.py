"""tritamp.parallel.LARC against Apex's LARC algorithm, written out in float64 per
parameter, around torch's SGD and tritamp's FusedSGD; the wrapper's proxying contract."""
import copy
import pickle

import pytest
import torch

from conftest import TOL
from tritamp.optimizers import FusedSGD
from tritamp.parallel import LARC

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (7,), (2, 2, 3), (4,)]
    ps = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(DEVICE)) for s in shapes]
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(DEVICE)
    with torch.no_grad():
        ps[3].zero_()              # ||p|| = 0: LARC leaves its gradient alone
    ps[1].grad.zero_()             # ||g|| = 0: likewise
    return ps


def _apex_step(params, grads, lr, weight_decay, trust, clip, eps):
    """Apex's LARC.step followed by plain SGD, in float64, one parameter at a time."""
    out = []
    for p, g in zip(params, grads):
        p, g = p.double(), g.double()
        pn, gn = p.norm().item(), g.norm().item()
        if pn != 0 and gn != 0:
            adaptive = trust * pn / (gn + pn * weight_decay + eps)
            if clip:
                adaptive = min(adaptive / lr, 1.0)
            g = (g + weight_decay * p) * adaptive
        out.append(p - lr * g)
    return out


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("inner", ["sgd", "fused_sgd"])
def test_step_matches_apex_larc(clip, weight_decay, inner):
    params = _params()
    before = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    lr = 0.5
    make = torch.optim.SGD if inner == "sgd" else FusedSGD
    opt = LARC(make(params, lr=lr, weight_decay=weight_decay), trust_coefficient=0.02,
               clip=clip)
    opt.step()
    expect = _apex_step(before, grads, lr, weight_decay, 0.02, clip, 1e-8)
    for p, e in zip(params, expect):
        torch.testing.assert_close(p.detach(), e.float(), **TOL[torch.float32])
    assert opt.param_groups[0]["weight_decay"] == weight_decay  # handed back after the step
    # zero weights: the plain gradient step (no rate, no decay); zero gradient: no decay
    torch.testing.assert_close(params[3].detach(), -lr * grads[3], **TOL[torch.float32])
    assert torch.equal(params[1].detach(), before[1])


def test_clip_caps_the_rate_at_the_optimizers_lr():
    """With a tiny lr the local rate exceeds it: clip=True then uses lr itself."""
    params = _params(1)
    before = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    LARC(torch.optim.SGD(params, lr=1e-4), clip=True).step()
    for p, b, g in zip(params, before, grads):
        torch.testing.assert_close(p.detach(), b - 1e-4 * g, **TOL[torch.float32])


def test_parameters_without_gradients_and_several_groups():
    a, b = _params(2)[:2]
    c = torch.nn.Parameter(torch.ones(3, device=DEVICE))
    b.grad = None
    opt = LARC(torch.optim.SGD([{"params": [a, b]}, {"params": [c], "lr": 0.1}], lr=0.3,
                               momentum=0.9))
    a0, b0 = a.detach().clone(), b.detach().clone()
    c.grad = torch.full((3,), 2.0, device=DEVICE)
    opt.step()
    assert torch.equal(b.detach(), b0)
    assert not torch.equal(a.detach(), a0)
    # c: ||p|| = sqrt(3), ||g|| = 2 sqrt(3): local lr = 0.02 / 2 = 0.01 < 0.1, so the step
    # is 0.01 * g
    torch.testing.assert_close(c.detach(), torch.full((3,), 1.0 - 0.01 * 2.0, device=DEVICE),
                               **TOL[torch.float32])


def test_wrapper_proxies_the_optimizer(monkeypatch):
    params = _params(3)
    inner = torch.optim.SGD(params[:2], lr=0.1, momentum=0.9)
    opt = LARC(inner, trust_coefficient=0.01, clip=False, eps=1e-6)
    assert opt.optim is inner
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    assert opt.defaults is inner.defaults
    assert repr(opt) == repr(inner)
    opt.add_param_group({"params": params[2:]})
    assert len(inner.param_groups) == 2
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"] == inner.state_dict()["param_groups"]
    assert len(sd["state"]) == 4  # momentum buffers: every parameter had a gradient
    others = _params(4)
    fresh = LARC(torch.optim.SGD(others[:2], lr=0.1, momentum=0.9))
    fresh.add_param_group({"params": others[2:]})
    fresh.load_state_dict(sd)
    assert fresh.state_dict()["state"].keys() == sd["state"].keys()
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    groups = [dict(g) for g in opt.param_groups]
    opt.param_groups = groups
    assert inner.param_groups is groups
    restored = pickle.loads(pickle.dumps(opt))
    assert isinstance(restored, LARC) and restored.optim.defaults["lr"] == 0.1


def test_step_makes_no_host_sync(monkeypatch):
    params = _params(5)
    opt = LARC(torch.optim.SGD(params, lr=0.1, weight_decay=1e-4))

    def refuse(*args, **kwargs):
        raise AssertionError("LARC.step read a device value on the host")

    monkeypatch.setattr(torch.Tensor, "item", refuse)
    monkeypatch.setattr(torch.Tensor, "__bool__", refuse)
    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    opt.step()


def test_closure_is_passed_on():
    params = _params(6)
    opt = LARC(torch.optim.SGD(params, lr=0.1))
    assert opt.step(lambda: torch.tensor(3.0)).item() == 3.0


@pytest.mark.parametrize("clip", [True, False])
def test_a_closure_step_is_the_step_after_calling_the_closure(clip):
    """step(closure): the closure's gradients are rewritten (weight decay inside the
    adaptive rate), exactly as closure() then step() (handing the closure to the wrapped
    optimizer let it recompute the gradients after the rewrite: plain SGD, no decay)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    twin = copy.deepcopy(model)
    x, y = torch.randn(8, 6), torch.randn(8, 1)

    def make(m):
        return LARC(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2),
                    clip=clip)

    def closure_of(m, opt):
        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            return loss
        return closure

    opt, ref = make(model), make(twin)
    for _ in range(3):
        loss = opt.step(closure_of(model, opt))
        ref_loss = closure_of(twin, ref)()
        ref.step()
        assert torch.equal(loss, ref_loss)
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)
    assert all(g["weight_decay"] == 1e-2 for g in opt.param_groups)  # restored


def test_bad_arguments():
    params = _params(7)
    with pytest.raises(TypeError, match="wraps an optimizer"):
        LARC(params)
    with pytest.raises(ValueError, match="trust_coefficient"):
        LARC(torch.optim.SGD(params, lr=0.1), trust_coefficient=0.0)
    with pytest.raises(ValueError, match="already wrapped"):
        LARC(LARC(torch.optim.SGD(params, lr=0.1)))


@pytest.mark.parametrize("kw,kind,match", [
    (dict(trust_coefficient=float("nan")), ValueError, r"trust_coefficient must be a finite "
                                                       r"number > 0, got nan"),
    (dict(trust_coefficient=float("inf")), ValueError, r"trust_coefficient .* got inf"),
    (dict(eps=float("nan")), ValueError, r"eps must be a finite number >= 0, got nan"),
    (dict(eps=-1e-8), ValueError, r"eps must be a finite number >= 0"),
    (dict(trust_coefficient="0.02"), TypeError, r"trust_coefficient must be a number > 0, "
                                                r"got str '0.02'"),
])
def test_arguments_that_are_not_finite_numbers_are_refused_by_name(kw, kind, match):
    # (NaN passed both range checks, and one step made every weight NaN)
    with pytest.raises(kind, match=match):
        LARC(torch.optim.SGD(_params(7), lr=0.1), **kw)


def test_a_refused_later_group_leaves_every_gradient_as_it_was():
    # every group's rewrite is validated before any is applied: a sparse gradient in the
    # second group left the first group's gradients rewritten (a retry applied LARC twice)
    dense = torch.nn.Parameter(torch.randn(4))
    emb = torch.nn.Embedding(5, 3, sparse=True)
    opt = LARC(torch.optim.SGD([{"params": [dense]}, {"params": emb.parameters()}], lr=0.1,
                               weight_decay=0.1))
    dense.grad = torch.randn(4)
    emb(torch.tensor([1, 2])).sum().backward()
    before = dense.grad.clone()
    with pytest.raises(RuntimeError, match=r"param_groups\[1\] gradient 0 is a sparse"):
        opt.step()
    assert torch.equal(dense.grad, before)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.1]


# --------------------------------------------------------------------------------------
# The kept sweeps: norms and rewrite prepared once, rebound to each step's gradients
# --------------------------------------------------------------------------------------

def _model_params(dtypes, seed=0, shapes=((1,), (257,), (3, 1000), (64,))):
    g = torch.Generator().manual_seed(seed)
    ps = []
    for i, s in enumerate(shapes):
        dt = dtypes[i % len(dtypes)]
        ps.append(torch.nn.Parameter(torch.randn(s, generator=g).to(dt)))
    with torch.no_grad():
        ps[-1].zero_()                     # ||p|| = 0: left alone
    return ps


def _grads(ps, step, zero_row=1):
    g = torch.Generator().manual_seed(100 + step)
    out = [(torch.randn(p.shape, generator=g) * 0.1).to(p.dtype) for p in ps]
    out[zero_row].zero_()                  # ||g|| = 0: left alone
    return out


def _each_larc(opt):
    """The same LARC, every list through the per-parameter rewrite (the path of lists the
    sweep does not take), as the yardstick: fp32 operations in the same order."""
    def plan(index, group, weight_decay, moved):
        ps = [p for p in group["params"] if p.grad is not None]
        return [lambda: opt._adapt_each(ps, group, weight_decay)] if ps else []
    opt._plan = plan
    return opt


@pytest.mark.parametrize("cpu_path", [False, True], ids=["triton", "cpu-path"])
@pytest.mark.parametrize("clip", [True, False])
def test_kept_sweeps_follow_new_gradients_bitwise_and_hold_none(cpu_path, clip):
    """Stepped with new gradient tensors every step (other addresses), LARC keeps its
    norm and rewrite sweeps and rebinds them: no launch table uploaded after the first
    step, every step's rewritten gradients and parameters bitwise those of the
    per-parameter rewrite, no gradient kept alive between steps. A gradient laid out
    unlike its parameter (a transposed copy), a misaligned one and a weight decay that
    changes to 0 are each handled (prepared again) and as exact."""
    import contextlib
    import gc
    import weakref

    from tritamp.testing import force_cpu_path, recording_uploads

    ours = _model_params([torch.float32])
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = LARC(torch.optim.SGD(ours, lr=0.5, weight_decay=0.01), clip=clip)
    ref = _each_larc(LARC(torch.optim.SGD(theirs, lr=0.5, weight_decay=0.01), clip=clip))
    uploads, alive = [], []
    kinds = [None, None, None, None, "transposed", None, "misaligned", None, "no decay", None]
    with force_cpu_path() if cpu_path else contextlib.nullcontext():
        for i, kind in enumerate(kinds):
            if kind == "no decay":
                for o in (opt, ref):
                    o.param_groups[0]["weight_decay"] = 0.0
            grads, want = _grads(ours, i), _grads(theirs, i)
            if kind == "transposed":
                grads[2] = grads[2].t().contiguous().t()   # same values, other strides
            if kind == "misaligned":
                buf = torch.empty(grads[1].numel() + 1)
                grads[1] = buf[1:].copy_(grads[1])
            for p, gr in zip(ours, grads):
                p.grad = gr
            for p, gr in zip(theirs, want):
                p.grad = gr
            with recording_uploads() as up:
                opt.step()
            ref.step()
            uploads.append(len(up))
            for a, b in zip(grads, want):
                assert torch.equal(a, b), (i, kind)
            for a, b in zip(ours, theirs):
                assert torch.equal(a, b), (i, kind)
            alive.append(grads)  # (kept alive: the next step's land elsewhere)
            opt.zero_grad()
            ref.zero_grad()
        probe = weakref.ref(alive[-1][2])
    if not cpu_path:
        assert uploads[0] > 0 and uploads[1:4] == [0, 0, 0], uploads
        assert uploads[4] > 0, uploads   # a new layout: prepared again
    else:
        assert uploads == [0] * len(kinds), uploads  # the CPU path has no launch tables
    del alive, grads
    gc.collect()
    assert probe() is None


@pytest.mark.parametrize("cpu_path", [False, True], ids=["triton", "cpu-path"])
def test_half_and_mixed_dtype_groups_round_once(cpu_path):
    """fp32, bf16 and fp16 parameters in one group: one rewrite per dtype group, each
    gradient computed in fp32 and rounded once to its dtype (the oracle of the rescale
    sweep, given the factors LARC's own per-parameter rule computes)."""
    import contextlib

    from tritamp.kernels.larc import larc_rescale_ref
    from tritamp.kernels.l2norm import multi_tensor_l2norm_ref
    from tritamp.testing import force_cpu_path

    ps = _model_params([torch.float32, torch.bfloat16, torch.float16], seed=3)
    grads = _grads(ps, 0)
    want = [g.clone() for g in grads]
    for p, g in zip(ps, grads):
        p.grad = g
    lr, wd, trust, eps = 0.1, 0.01, 0.02, 1e-8
    opt = LARC(torch.optim.SGD(ps, lr=lr, weight_decay=wd), trust_coefficient=trust)
    opt.optim.step = lambda *a: None   # the rewrite alone
    with force_cpu_path() if cpu_path else contextlib.nullcontext():
        opt.step()
    _, pn = multi_tensor_l2norm_ref([p.detach() for p in ps], per_tensor=True)
    _, gn = multi_tensor_l2norm_ref(want, per_tensor=True)
    factor = torch.clamp(trust * pn / (gn + pn * wd + eps) / lr, max=1.0)
    keep = (pn != 0) & (gn != 0)
    larc_rescale_ref([p.detach() for p in ps], want, torch.where(keep, factor, 1.0),
                     keep * wd)
    for i, (a, b) in enumerate(zip(grads, want)):
        assert a.dtype == ps[i].dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"gradient {i}")
    assert torch.equal(grads[-1], _grads(ps, 0)[-1])   # ||p|| = 0: untouched


def test_float64_and_strided_parameters_take_the_per_parameter_rewrite():
    """Lists the rescale sweep does not take (float64 parameters; a parameter that is a
    strided view) are rewritten per parameter, with the same rule."""
    g = torch.Generator().manual_seed(4)
    base = torch.randn(6, 8, generator=g)
    ps = [torch.nn.Parameter(torch.randn(5, generator=g, dtype=torch.float64)),
          torch.nn.Parameter(base.t())]                # a transposed view: dense, swept
    strided = torch.nn.Parameter(torch.randn(4, 6, generator=g)[:, ::2])  # not dense
    for group_params in (ps[:1], [strided]):
        for p in group_params:
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1
        before = [p.detach().clone() for p in group_params]
        grads = [p.grad.clone() for p in group_params]
        opt = LARC(torch.optim.SGD(group_params, lr=0.5, weight_decay=0.05))
        opt.step()
        expect = _apex_step(before, grads, 0.5, 0.05, 0.02, True, 1e-8)
        for p, e in zip(group_params, expect):
            # (the norms are fp32 sums, whatever the dtype)
            torch.testing.assert_close(p.detach(), e.to(p.dtype), **TOL[torch.float32])
        # (decided once per layout: no sweep kept for it)
        assert all(e[1] is None for k in opt._kept.values() for e in k.entries.values())


def test_a_stepped_larc_pickles_and_copies_without_its_sweeps():
    import copy

    ps = _model_params([torch.float32], seed=5)
    opt = LARC(torch.optim.SGD(ps, lr=0.1, weight_decay=1e-4))
    for p, g in zip(ps, _grads(ps, 0)):
        p.grad = g
    opt.step()
    assert opt._kept
    for other in (pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt)):
        assert other._kept == {}
        qs = other.optim.param_groups[0]["params"]
        for q, g in zip(qs, _grads(qs, 1)):
            q.grad = g
        other.step()   # its sweeps are made again, over its own tensors
        assert other._kept


@pytest.mark.parametrize("cpu_path", [False, True], ids=["triton", "cpu-path"])
def test_a_kept_rescale_reads_the_vectors_values_at_every_launch(cpu_path):
    """The rescale sweep reads ``factor`` and ``decay`` where they are: values written
    into the same vectors after it was prepared are the ones the next launch uses (the
    CPU path must not move them into a buffer of its own), with mixed dtype groups."""
    import contextlib

    from tritamp.kernels.larc import (larc_rescale_launch, larc_rescale_prepare,
                                      larc_rescale_ref)
    from tritamp.testing import force_cpu_path

    g = torch.Generator().manual_seed(9)
    dts = [torch.float32, torch.bfloat16, torch.float32, torch.float16]
    ps = [torch.randn(n, generator=g).to(dt) for n, dt in zip((3, 40, 1, 17), dts)]
    grads = [torch.randn(p.shape, generator=g).to(p.dtype) for p in ps]
    want = [t.clone() for t in grads]
    factor, decay = torch.ones(4), torch.zeros(4)
    with force_cpu_path() if cpu_path else contextlib.nullcontext():
        prepared = larc_rescale_prepare(ps, grads, factor, decay)
        for k in range(3):
            f, d = torch.rand(4, generator=g) * 2, torch.rand(4, generator=g) * 0.1
            torch.mul(f, 1.0, out=factor)
            torch.mul(d, 1.0, out=decay)
            larc_rescale_launch(prepared)
            larc_rescale_ref(ps, want, f, d)
            for i, (a, b) in enumerate(zip(grads, want)):
                assert torch.equal(a, b), (k, i)
    assert factor.untyped_storage().data_ptr() == factor[3].untyped_storage().data_ptr()


@pytest.mark.parametrize("cpu_path", [False, True], ids=["triton", "cpu-path"])
def test_a_strided_gradient_takes_the_per_parameter_rewrite(cpu_path):
    """A gradient that is a strided view (not dense) cannot be rewritten by the sweep: the
    list is rewritten per parameter, with the same results as the sweep gives a dense
    copy of it."""
    import contextlib

    from tritamp.testing import force_cpu_path

    g = torch.Generator().manual_seed(11)
    ours = [torch.nn.Parameter(torch.randn(4, 6, generator=g)), torch.nn.Parameter(
        torch.randn(5, generator=g))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    grads = [torch.randn(4, 12, generator=g)[:, ::2], torch.randn(5, generator=g)]
    want = [gr.clone() for gr in grads]   # dense copies: the sweep takes them
    for p, gr in zip(ours, grads):
        p.grad = gr
    for p, gr in zip(theirs, want):
        p.grad = gr
    with force_cpu_path() if cpu_path else contextlib.nullcontext():
        LARC(torch.optim.SGD(ours, lr=0.5, weight_decay=0.01)).step()
        LARC(torch.optim.SGD(theirs, lr=0.5, weight_decay=0.01)).step()
    for a, b in zip(ours + grads, theirs + want):
        assert torch.equal(a, b)


def test_a_removed_group_keeps_nothing_alive():
    import gc
    import weakref

    ps = _model_params([torch.float32], seed=12)
    extra = torch.nn.Parameter(torch.randn(33))
    opt = LARC(torch.optim.SGD(ps, lr=0.1, weight_decay=1e-4))
    opt.add_param_group(dict(params=[extra]))
    for step in range(2):
        for p, gr in zip(ps + [extra], _grads(ps + [extra], step)):
            p.grad = gr
        opt.step()
    assert {index for index, _ in opt._kept} == {0, 1}
    probe = weakref.ref(extra)
    del opt.param_groups[1]
    del extra
    for p, gr in zip(ps, _grads(ps, 3)):
        p.grad = gr
    opt.step()
    gc.collect()
    assert probe() is None
    assert {index for index, _ in opt._kept} == {0}


def test_cpu_path_half_groups_run_in_ranges_bitwise():
    """A big half group goes through fp32 scratch one range of whole tensors at a time,
    so the scratch kept with the sweep is one range's: bitwise the oracle, decay and
    factor per row."""
    from tritamp.kernels.larc import larc_rescale_launch, larc_rescale_prepare, larc_rescale_ref
    from tritamp.testing import cpu_step_ranges, force_cpu_path, scratch_bytes

    g = torch.Generator().manual_seed(13)
    sizes = (700, 3, 900, 800, 1)
    ps = [torch.randn(n, generator=g).to(torch.bfloat16) for n in sizes]
    grads = [torch.randn(n, generator=g).to(torch.bfloat16) for n in sizes]
    want = [t.clone() for t in grads]
    factor, decay = torch.rand(5, generator=g) * 2, torch.rand(5, generator=g) * 0.1
    with force_cpu_path(), cpu_step_ranges(1000):
        prepared = larc_rescale_prepare(ps, grads, factor, decay)
        larc_rescale_launch(prepared)
    larc_rescale_ref(ps, want, factor, decay)
    for i, (a, b) in enumerate(zip(grads, want)):
        assert torch.equal(a, b), i
    # fp32 copies of the gradients and the parameters, one range's worth (<= 1000
    # elements each; the whole group would be 2404)
    assert 0 < scratch_bytes(prepared) <= 2 * 4 * 1000


def test_larc_rescale_refuses_bad_input_by_name_before_writing():
    from tritamp.kernels.larc import larc_rescale

    ps = [torch.randn(3), torch.randn(5)]
    grads = [torch.randn(3), torch.randn(5)]
    before = [t.clone() for t in grads]
    f = torch.ones(2)
    cases = [
        ((ps, grads, f.double()), ValueError, "factor is a float64 tensor of shape \\(2,\\)"),
        ((ps, grads, torch.ones(3)), ValueError, "factor is a float32 tensor of shape \\(3,\\)"),
        ((ps, grads, torch.ones(1, 2)), ValueError, "expected a float32 vector of 2 values"),
        ((ps, grads, f, torch.zeros(2, device="meta")), ValueError, "decay .* on meta"),
        ((ps, grads, f.to_sparse()), TypeError, "factor is a torch.sparse_coo tensor"),
        ((ps, grads, [1.0, 1.0]), TypeError, "factor is a list"),
        ((ps, grads[:1], f), ValueError, "grads has 1 tensors but params has 2"),
        (([1.0, ps[1]], grads, f), TypeError, "params\\[0\\] is a float"),
        ((ps, [grads[0], grads[1].to_sparse()], f), RuntimeError, "grads\\[1\\] \\(for params"),
        ((ps, [grads[0], grads[1].double()], f), TypeError, "grads\\[1\\] is float64"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            larc_rescale(*args)
        assert all(torch.equal(a, b) for a, b in zip(grads, before)), message


@pytest.mark.parametrize("cpu_path", [False, True], ids=["triton", "cpu-path"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_larc_rescale_against_torchs_foreach_ops(dtype, cpu_path):
    """The same rewrite with torch's ops (g += decay * p, g *= factor, one 0-d factor and
    decay per tensor): fp32 bit for bit; bf16 bit for bit the fp32 formula rounded once,
    and within the roundings of torch's bf16 ops (torch rounds after each op, the sweep
    once)."""
    import contextlib

    from tritamp.kernels.larc import larc_rescale
    from tritamp.testing import force_cpu_path

    g = torch.Generator().manual_seed(21)
    shapes = [(1,), (1000,), (3, 257)]
    ps = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    grads = [(torch.randn(s, generator=g) * 0.01).to(dtype) for s in shapes]
    theirs = [t.clone() for t in grads]
    factor, decay = torch.rand(3, generator=g) * 2, torch.rand(3, generator=g) * 1e-2
    with force_cpu_path() if cpu_path else contextlib.nullcontext():
        larc_rescale(ps, grads, factor, decay)
    if dtype == torch.float32:
        torch._foreach_add_(theirs, torch._foreach_mul(ps, list(decay.unbind(0))))
        torch._foreach_mul_(theirs, list(factor.unbind(0)))
        for a, b in zip(grads, theirs):
            assert torch.equal(a, b)
    else:
        want = [((t.float() + d * p.float()) * f).to(dtype)
                for t, p, d, f in zip(theirs, ps, decay, factor)]
        for a, b in zip(grads, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        # torch's bf16 ops round d * p and the sum too: about one bf16 ulp of the terms
        # (~1e-2 here) apart where they cancel
        torch_ops = [((t + d * p) * f) for t, p, d, f in zip(theirs, ps, decay, factor)]
        for a, b in zip(grads, torch_ops):
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=3e-4)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_larc_built_around_an_amp_optimizer_rewrites_the_masters_gradients(level):
    """LARC(optimizer) after amp.initialize (O2, FusedSGD): the fused step reads the half
    gradients scaled, so the masters had none when LARC looked and nothing was rewritten
    (the step ran without LARC). LARC now asks for the masters' gradients: the same
    weights as LARC passed to initialize."""
    from tritamp import amp
    from tritamp.testing import reset_amp as reset

    def run(order):
        reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        if order == "before":
            opt = LARC(opt)
        model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                    loss_scale=128.0, verbosity=0)
        if order == "after":
            opt = LARC(opt)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(6, 4, generator=g)
            opt.zero_grad()
            inner = opt.optim if order == "after" else opt
            with amp.scale_loss(model(x).float().pow(2).sum(), inner) as scaled:
                scaled.backward()
            opt.step()
        reset()
        return [p.detach().float().clone() for p in model.parameters()]
    before, after, plain = run("before"), run("after"), run(None)
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert any(not torch.equal(a, b) for a, b in zip(after, plain))


@pytest.mark.parametrize("key", ["lr", "weight_decay"])
def test_a_bad_tensor_rate_in_a_later_group_leaves_every_gradient_as_it_was(key, path):
    # lr was read inside each group's rewrite, after the earlier groups' gradients had
    # been rewritten (a meta or two-element one was then refused by torch mid-step)
    for bad in (torch.tensor(0.1, device="meta"), torch.tensor([0.1, 0.1])):
        torch.manual_seed(0)
        p0, p1 = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
        p0.grad, p1.grad = torch.randn(3), torch.randn(2)
        before = [t.clone() for t in (p0, p1, p0.grad, p1.grad)]
        opt = LARC(torch.optim.SGD([{"params": [p0]}, {"params": [p1], key: bad}], lr=0.1))
        with pytest.raises(ValueError, match=rf"LARC: param_groups\[1\]\['{key}'\] is a tensor "
                                             rf"of shape \({'2,' if bad.numel() == 2 else ''}\)"):
            opt.step()
        assert all(torch.equal(b, t) for b, t in zip(before, (p0, p1, p0.grad, p1.grad)))
