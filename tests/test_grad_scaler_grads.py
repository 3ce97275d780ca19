"""What ``.grad`` holds after a step of a tritamp fused optimizer.

Driven by ``torch.amp.GradScaler`` (which hands an optimizer that declares
``_step_supports_amp_scaling`` its ``grad_scale`` and ``found_inf``), the step leaves the
unscaled gradient in ``.grad``, as torch's fused Adam/AdamW/SGD/Adagrad do, and on a
skipped step leaves ``.grad`` as it was, as torch does. Under ``tritamp.amp`` nothing is
written: the gradients stay as amp left them. Both CPU-side paths (the interpreted
kernels and the production CPU path) through conftest's ``path`` fixture.

The loss scales are powers of two, so ``grad / scale`` is exact: compared bit for bit.
"""
import pytest
import torch

from conftest import assert_bits_equal, assert_bits_unchanged, tiny_mlp
from tritamp import amp
from tritamp.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

SHAPES = ((1,), (257,), (3, 7))
SCALE = 2.0 ** 10

# name -> (tritamp optimizer, its kwargs, torch's fused optimizer and kwargs or None)
CASES = {
    "adamw": (FusedAdam, dict(lr=1e-2, weight_decay=0.01),
              (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.01, eps=1e-8))),
    "adam-l2": (FusedAdam, dict(lr=1e-2, weight_decay=0.1, adam_w_mode=False),
                (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, eps=1e-8))),
    "sgd": (FusedSGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01),
            (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01))),
    "sgd-plain": (FusedSGD, dict(lr=0.1), (torch.optim.SGD, dict(lr=0.1))),
    "adagrad": (FusedAdagrad, dict(lr=1e-2, weight_decay=0.01),
                (torch.optim.Adagrad, dict(lr=1e-2, weight_decay=0.01))),
    "lamb": (FusedLAMB, dict(lr=1e-2), None),
    "lamb-l2-noavg": (FusedLAMB, dict(lr=1e-2, adam_w_mode=False, grad_averaging=False), None),
    "novograd": (FusedNovoGrad, dict(lr=1e-2, weight_decay=0.01), None),
    "novograd-reg": (FusedNovoGrad, dict(lr=1e-2, reg_inside_moment=True), None),
}


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _weights(step):
    """Per step, what d loss / d p is; step 1 overflows in the second tensor."""
    gen = torch.Generator().manual_seed(100 + step)
    ws = [torch.randn(s, generator=gen) for s in SHAPES]
    if step == 1:
        ws[1][5] = float("inf")
    return ws


def _backward(params, scaler, step):
    loss = sum((p.float() * w).sum() for p, w in zip(params, _weights(step)))
    scaler.scale(loss).backward()


def _scaler():
    return torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)


def _unscaled(grads, scale):
    return [(g.float() / scale).to(g.dtype) for g in grads]


@pytest.mark.parametrize("name", sorted(CASES))
def test_grad_scaler_step_leaves_unscaled_grads_and_matches_torch(path, name):
    cls, kw, torch_case = CASES[name]
    ours = _params()
    opt = cls(ours, **kw)
    scaler = _scaler()
    if torch_case is not None:
        theirs = _params()
        topt = torch_case[0](theirs, fused=True, **torch_case[1])
        tscaler = _scaler()
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        _backward(ours, scaler, step)
        scale = scaler.get_scale()
        before = [p.grad.clone() for p in ours]
        weights = [p.detach().clone() for p in ours]
        scaler.step(opt)
        scaler.update()
        grads = [p.grad for p in ours]
        if step == 1:  # skipped: torch leaves the gradients (and everything else) alone
            assert_bits_unchanged(before, grads)
            assert_bits_unchanged(weights, [p.detach() for p in ours])
        else:
            assert_bits_unchanged(_unscaled(before, scale), grads)
        if torch_case is not None:
            topt.zero_grad(set_to_none=True)
            _backward(theirs, tscaler, step)
            tscaler.step(topt)
            tscaler.update()
            for a, b in zip(ours, theirs):
                assert_bits_equal(a.grad, b.grad, f"{name} step {step}: .grad")
                torch.testing.assert_close(a.detach(), b.detach())
    assert scaler.get_scale() == SCALE / 2  # the overflow was seen


@pytest.mark.parametrize("name", ["lamb", "lamb-l2-noavg", "novograd", "novograd-reg"])
def test_grad_scaler_steps_like_unscaled_gradients(path, name):
    # No torch twin: the same optimizer stepped on the unscaled gradients, no scaler.
    cls, kw, _ = CASES[name]
    ours, plain = _params(), _params()
    opt, popt = cls(ours, **kw), cls(plain, **kw)
    scaler = _scaler()
    for step in (0, 2, 3):
        opt.zero_grad(set_to_none=True)
        _backward(ours, scaler, step)
        scaler.step(opt)
        scaler.update()
        for p, w in zip(plain, _weights(step)):
            p.grad = w.clone()
        popt.step()
        for a, b in zip(ours, plain):
            assert_bits_equal(a.grad, b.grad)
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedSGD])
def test_half_gradients_are_unscaled_in_their_dtype(path, cls, dtype):
    # Half parameters with fp32 masters (master_weights=True where the optimizer has it):
    # .grad holds the unscaled value rounded once to the gradient's dtype, as torch's
    # fused kernels store it.
    kw = dict(lr=0.1, momentum=0.9) if cls is FusedSGD else dict(lr=1e-2, master_weights=True)
    params = _params(dtype)
    opt = cls(params, **kw)
    scaler = _scaler()
    _backward(params, scaler, 0)
    before = [p.grad.clone() for p in params]
    scaler.step(opt)
    assert_bits_unchanged(_unscaled(before, SCALE), [p.grad for p in params])


@pytest.mark.parametrize("name", ["adamw", "sgd", "adagrad", "lamb", "novograd"])
def test_gradient_laid_out_unlike_its_parameter_is_written_back(path, name):
    # A transposed gradient is swept through a dense copy: the unscaled values reach it.
    cls, kw, _ = CASES[name]
    p = torch.nn.Parameter(torch.randn(3, 7))
    q = torch.nn.Parameter(torch.randn(5))
    opt = cls([p, q], **kw)
    p.grad = (torch.randn(7, 3) * SCALE).t()
    q.grad = torch.randn(5) * SCALE
    before = [p.grad.clone(), q.grad.clone()]
    opt.grad_scale = torch.tensor(SCALE)
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    assert p.grad.stride() == (1, 3)
    assert_bits_unchanged(_unscaled(before, SCALE), [p.grad, q.grad])


@pytest.mark.parametrize("name", ["adamw", "lamb", "novograd"])
def test_gradient_that_cannot_be_written_back_is_refused_before_any_change(path, name):
    # An expanded gradient (every element at one address) cannot hold unscaled values:
    # refused before any group steps, everything bitwise as it was.
    cls, kw, _ = CASES[name]
    a = torch.nn.Parameter(torch.randn(4))
    b = torch.nn.Parameter(torch.randn(5))
    opt = cls([{"params": [a]}, {"params": [b]}], **kw)
    a.grad = torch.randn(4) * SCALE
    b.grad = torch.full((1,), SCALE).expand(5)
    opt.grad_scale = torch.tensor(SCALE)
    opt.found_inf = torch.tensor(0.0)
    before = [a.detach().clone(), b.detach().clone(), a.grad.clone(), b.grad.clone()]
    with pytest.raises(ValueError, match=r"grads\[0\] of shape \(5,\) has strides \(0,\).*"
                                         r"p\.grad = p\.grad\.contiguous\(\)"):
        opt.step()
    assert_bits_unchanged(before, [a.detach(), b.detach(), a.grad, b.grad])
    assert dict(opt.state) == {}  # no state made for either group
    b.grad = b.grad.contiguous()  # fixed as the message says: the step goes through
    opt.step()
    assert_bits_unchanged(_unscaled(before[2:], SCALE), [a.grad, b.grad])
    assert set(opt.state) == {a, b}


def _amp_grads(opt_level, opt_cls, kw):
    model = tiny_mlp()
    opt = opt_cls(model.parameters(), **kw)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, loss_scale="dynamic",
                                half_dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(3))
    with amp.scale_loss(model(x).float().square().mean(), opt) as loss:
        loss.backward()
    return model, opt


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_tritamp_amp_step_writes_no_gradient(path, opt_level, name):
    # Under tritamp's amp the fused step reads the scaled gradients and writes none.
    cls, kw, _ = CASES[name]
    model, opt = _amp_grads(opt_level, cls, kw)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    before = [g.clone() for g in grads]
    versions = [g._version for g in grads]
    weights = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert [g._version for g in grads] == versions
    assert_bits_unchanged(before, grads)
    assert any(not torch.equal(w, p) for w, p in zip(weights, model.parameters()))


def _launcher_call(name, params, grads, **amp_kw):
    from tritamp.kernels.adagrad import adagrad_step
    from tritamp.kernels.adam import adam_step
    from tritamp.kernels.lamb import lamb_step
    from tritamp.kernels.novograd import novograd_step
    from tritamp.kernels.sgd import sgd_step
    zeros = [torch.zeros_like(p) for p in params]
    steps = [torch.zeros(()) for _ in params]
    if name.startswith("adam"):
        # "adam-degenerate": beta1 = 1 without bias correction, which the CPU path hands
        # to the oracle (torch's fused kernel cannot express it)
        degenerate = name == "adam-degenerate"
        adam_step(params, grads, zeros, [torch.zeros_like(p) for p in params], steps,
                  lr=1e-2, beta1=1.0 if degenerate else 0.9, beta2=0.999, eps=1e-8,
                  weight_decay=0.0, bias_correction=not degenerate, **amp_kw)
    elif name == "sgd":
        sgd_step(params, grads, zeros, lr=0.1, momentum=0.9, steps=steps, **amp_kw)
    elif name == "adagrad":
        adagrad_step(params, grads, zeros, lr=1e-2, eps=1e-10, **amp_kw)
    elif name == "lamb":
        lamb_step(params, grads, zeros, [torch.zeros_like(p) for p in params], steps, lr=1e-2,
                  beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, **amp_kw)
    else:
        novograd_step(params, grads, zeros, [torch.zeros(()) for _ in params], steps, lr=1e-2,
                      beta1=0.95, beta2=0.98, eps=1e-8, weight_decay=0.0, **amp_kw)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("name", ["adam", "adam-degenerate", "sgd", "adagrad", "lamb",
                                  "novograd"])
def test_launchers_write_unscaled_grads_when_asked(path, name, skip):
    gen = torch.Generator().manual_seed(4)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [torch.randn(s, generator=gen) * SCALE for s in SHAPES]
    before = [g.clone() for g in grads]
    _launcher_call(name, params, grads, grad_scale=torch.tensor(SCALE),
                   found_inf=torch.tensor(1.0 if skip else 0.0), write_grads=True)
    assert_bits_unchanged(before if skip else _unscaled(before, SCALE), grads)
    _launcher_call(name, params, grads, grad_scale=torch.tensor(SCALE),
                   found_inf=torch.tensor(0.0))  # not asked: read only
    assert_bits_unchanged(before if skip else _unscaled(before, SCALE), grads)
