"""tritamp.optimizers.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_."""
import pytest
import torch
import torch.nn as nn

from tritamp import amp
from tritamp.optimizers import FusedSGD, clip_grad_norm_


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in (1, 257, 3000)]
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g) * 3).to(dtype)
    return ps


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_torch(max_norm, dtype):
    ours, theirs = _params(dtype), _params(dtype)
    n1 = clip_grad_norm_(ours, max_norm)
    n2 = torch.nn.utils.clip_grad_norm_(theirs, max_norm, foreach=False)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(n1, n2.float(), **tol)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad.float(), b.grad.float(), **tol)
    if max_norm > 1e3:  # nothing to clip: the gradients are untouched bitwise
        for a, b in zip(ours, _params(dtype)):
            assert torch.equal(a.grad, b.grad)


def test_other_norms_go_to_torch():
    ours, theirs = _params(), _params()
    n1 = clip_grad_norm_(ours, 1.0, norm_type=float("inf"))
    n2 = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type=float("inf"))
    assert torch.equal(n1, n2)


@pytest.mark.parametrize("kwargs", [dict(), dict(norm_type=float("inf")), dict(norm_type=1.0),
                                    dict(error_if_nonfinite=True), dict(foreach=False),
                                    dict(norm_type=1.0, foreach=True)],
                         ids=["l2", "inf", "l1", "error_if_nonfinite", "foreach-off", "l1-foreach"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_generator_of_parameters_is_clipped_on_every_path(kwargs, dtype):
    """amp.master_params(...) and model.parameters() are generators: read once, whether the
    kernels clip or torch's implementation does (which once got the spent generator and
    clipped nothing, returning 0). ``foreach`` is torch's argument too."""
    ours, theirs = _params(), _params()
    for ps in (ours, theirs):
        for p in ps:
            p.data, p.grad = p.data.to(dtype), p.grad.to(dtype)
    n1 = clip_grad_norm_((p for p in ours), 1.0, **kwargs)
    n2 = torch.nn.utils.clip_grad_norm_(theirs, 1.0, **kwargs)
    torch.testing.assert_close(n1, n2.to(n1.dtype), rtol=1e-5, atol=1e-6)
    assert n1 > 1.0  # (there was something to clip)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_clipping_master_params_at_o2_reads_nothing_back():
    from test_hot_path import HostReads
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model, opt = amp.initialize(model, FusedSGD(model.parameters(), lr=0.1, momentum=0.9),
                                opt_level="O2", verbosity=0)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    reads = HostReads()
    with reads:
        with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        norm = clip_grad_norm_(amp.master_params(opt), 0.01)
        opt.step()
    assert reads.calls == []
    assert norm > 0.01  # it did clip


def _old_clip(grads, max_norm):
    """The computation of clip_grad_norm_ from the one-shot kernels (each prepared anew)."""
    from tritamp.kernels import multi_tensor_l2norm, multi_tensor_scale
    total, _ = multi_tensor_l2norm(grads)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    multi_tensor_scale(grads, grads, coef, None)
    return total


@pytest.mark.parametrize("cpu_path", [False, True], ids=["triton", "cpu-path"])
def test_kept_sweeps_follow_new_gradients_bitwise_and_hold_none(cpu_path):
    """Called every step on new gradient tensors (other addresses), clip_grad_norm_ keeps
    its two sweeps and rebinds them: no launch table built or uploaded after the first
    call, every call bitwise what sweeps prepared anew give, no gradient kept alive
    between calls. A non-dense gradient, a misaligned one and a list of another layout
    are each handled (prepared again) and as exact."""
    import contextlib
    import gc
    import weakref

    from tritamp.testing import force_cpu_path, recording_uploads

    def grads_for(step, kind=None):
        g = torch.Generator().manual_seed(step)
        out = [torch.randn(n, generator=g) * 3 for n in (1, 257, 3000)]
        if kind == "strided":
            out[1] = torch.randn(2 * 257, generator=g)[::2]
        if kind == "misaligned":
            buf = torch.empty(3001)
            out[2] = buf[1:].copy_(out[2])
        if kind == "other":
            out = out[:2]
        return out

    def step(i, kind):
        ours, ref = grads_for(i, kind), grads_for(i, kind)
        params = [nn.Parameter(torch.zeros_like(g)) for g in ours]
        for p, g in zip(params, ours):
            p.grad = g
        with recording_uploads() as up:
            total = clip_grad_norm_(params, 0.5)
        want = _old_clip(ref, 0.5)
        assert torch.equal(total, want), i
        assert all(torch.equal(a, b) for a, b in zip(ours, ref)), i
        return ours, len(up)

    alive, uploads = [], []
    with force_cpu_path() if cpu_path else contextlib.nullcontext():
        for i, kind in enumerate([None, None, None, None, "strided", None, "misaligned",
                                  None, "other", None]):
            grads, n = step(i, kind)
            alive.append(grads)  # (kept alive: the next step's land elsewhere)
            uploads.append(n)
        probe = weakref.ref(alive[-1][2])
    if not cpu_path:  # (the first call may find sweeps another test left: any count)
        assert uploads[1:4] == [0, 0, 0] and uploads[4] > 0, uploads
    del alive, grads
    gc.collect()
    assert probe() is None


def test_float64_gradients_are_clipped_as_torch_clips_them():
    g = torch.Generator().manual_seed(3)
    ours = [nn.Parameter(torch.randn(n, generator=g, dtype=torch.float64)) for n in (3, 40)]
    ours.append(nn.Parameter(torch.randn(5, generator=g)))
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    for p, q in zip(ours, theirs):
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype) * 3
        q.grad = p.grad.clone()
    total = clip_grad_norm_(ours, 0.5)
    want = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    torch.testing.assert_close(total, want, rtol=0, atol=0)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_an_empty_generator_warns_and_max_norm_is_read_as_torch_reads_it():
    with pytest.warns(UserWarning, match="`parameters` is an empty generator"):
        clip_grad_norm_((p for p in []), 1.0)
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    q = nn.Parameter(torch.zeros(2))
    q.grad = p.grad.clone()
    ours = clip_grad_norm_([p], "1.0")  # torch's float(max_norm)
    theirs = torch.nn.utils.clip_grad_norm_([q], "1.0")
    assert torch.equal(ours, theirs) and torch.equal(p.grad, q.grad)
    with pytest.raises(TypeError, match="float\\(\\) argument must be"):
        clip_grad_norm_([p], None)


def test_a_max_norm_tensor_must_be_one_real_element_on_the_gradients_device(path):
    # (refused before, but in the words of the scale sweep it feeds: "scale is on meta")
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 10.0)
    for bad in (torch.tensor(1.0, device="meta"), torch.tensor([1.0, 1.0]),
                torch.tensor(1 + 0j)):
        with pytest.raises(ValueError, match=r"clip_grad_norm_: max_norm is a .* tensor of "
                                             r"shape .*; give a number, or one real element "
                                             r"on the gradients' device \(cpu\)"):
            clip_grad_norm_([p], bad)
        assert torch.equal(p.grad, torch.full((3,), 10.0))
    clip_grad_norm_([p], torch.tensor(1.0))
    torch.testing.assert_close(p.grad.norm(), torch.tensor(1.0))
