"""amp at every opt level: training, checkpoint resume, several losses, gradient
accumulation (delay_unscale), clipping through master_params, and the fused-optimizer
path (no host read, checked against torch.amp.GradScaler + torch.autocast)."""
import copy

import pytest
import torch
from torch import nn

from conftest import TOL, amp_step, mse
from tritamp import amp

LEVELS = ["O0", "O1", "O2", "O3"]
INF = float("inf")


def conv_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(64, 2))


def conv_batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 3, 6, 6, generator=g), torch.randn(2, 2, generator=g))
            for _ in range(n)]


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def mlp_batches(n, rows=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g))
            for _ in range(n)]


def make_opt(kind, model, lr=None):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr or 0.05, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=lr or 1e-2, fused=True)


def clones(tensors):
    return [t.detach().clone() for t in tensors]


# --------------------------------------------------------------------------------------
# training at every level
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["sgd", "adam_fused"])
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("level", LEVELS)
def test_loss_goes_down(level, half, kind):
    model = conv_net()
    model, opt = amp.initialize(model, make_opt(kind, model), opt_level=level,
                                half_dtype=half, verbosity=0)
    (x, y), = conv_batches(1)
    losses = [amp_step(model, opt, x, y).item() for _ in range(5)]
    with torch.no_grad():
        final = mse(model(x), y).item()
    assert all(l == l for l in losses)
    assert final < 0.8 * losses[0], losses + [final]
    for p in model.parameters():
        assert torch.isfinite(p).all()


# --------------------------------------------------------------------------------------
# checkpoint resume
# --------------------------------------------------------------------------------------

def _masters(opt):
    return [m.detach() for m in amp.master_params(opt)]


@pytest.mark.parametrize("kind", ["sgd", "adam_fused"])
@pytest.mark.parametrize("level,half", [("O0", torch.float16), ("O1", torch.float16),
                                        ("O2", torch.float16), ("O3", torch.float16),
                                        ("O2", torch.bfloat16)],
                         ids=["O0", "O1", "O2", "O3", "O2-bf16"])
def test_checkpoint_resume_is_bitwise(level, half, kind):
    n_steps, save_at = 6, 3
    batches = conv_batches(n_steps)
    # an overflow before the checkpoint where something checks the gradients (a dynamic
    # scale: fp16 at O1/O2; bf16 defaults to a static 1.0, never checked, as in Apex)
    checked = level in ("O1", "O2") and half == torch.float16
    factors = [1.0, INF if checked else 1.0, 1.0, 1.0, 1.0, 1.0]

    def build():
        model = conv_net()
        opt = make_opt(kind, model)
        if level == "O3" and kind == "adam_fused":
            # pure fp16 Adam state: eps=1e-8 is below fp16's smallest subnormal and the
            # run turns to NaN whatever the library does
            opt.param_groups[0]["eps"] = 1e-3
        return amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0)

    model, opt = build()
    for i, (x, y) in enumerate(batches):
        if i == save_at:
            saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
                     copy.deepcopy(amp.state_dict()))
        amp_step(model, opt, x, y, factor=factors[i])
    if checked and half == torch.float16:
        assert saved[2]["loss_scaler0"]["loss_scale"] < 65536.0
    want_params = clones(model.parameters())
    want_buffers = clones(model.buffers())
    want_masters = clones(_masters(opt))
    want_amp = amp.state_dict()

    model, opt = build()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    amp.load_state_dict(saved[2])
    for i in range(save_at, n_steps):
        amp_step(model, opt, *batches[i], factor=factors[i])

    for want, got in zip(want_params, model.parameters()):
        assert got.dtype == want.dtype and torch.equal(want, got)
    for want, got in zip(want_buffers, model.buffers()):
        assert torch.equal(want, got)
    for want, got in zip(want_masters, _masters(opt)):
        assert got.dtype == want.dtype and torch.equal(want, got)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == \
        want_amp["loss_scaler0"]["loss_scale"]
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == \
        want_amp["loss_scaler0"]["unskipped"]


# --------------------------------------------------------------------------------------
# several losses
# --------------------------------------------------------------------------------------

def test_each_loss_has_its_own_scaler():
    model = mlp()
    model, opt = amp.initialize(model, make_opt("sgd", model), opt_level="O2", num_losses=2,
                                verbosity=0)
    (x, y), (x2, y2) = mlp_batches(2)

    def two_losses(factor1):
        opt.zero_grad()
        loss0 = mse(model(x), y)
        with amp.scale_loss(loss0, opt, loss_id=0) as scaled:
            scaled.backward()
        loss1 = mse(model(x2), y2) * factor1
        with amp.scale_loss(loss1, opt, loss_id=1) as scaled:
            scaled.backward()
        opt.step()

    before = clones(model.parameters())
    two_losses(INF)
    state = amp.state_dict()
    assert state["loss_scaler0"]["loss_scale"] == 65536.0
    assert state["loss_scaler1"]["loss_scale"] == 32768.0
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))

    loss = mse(model(x2), y2)
    with amp.scale_loss(loss, opt, loss_id=1) as scaled:
        assert torch.equal(scaled, loss.float() * 32768.0)
    with amp.scale_loss(loss, opt, loss_id=0) as scaled:
        assert torch.equal(scaled, loss.float() * 65536.0)

    before = clones(model.parameters())
    two_losses(1.0)
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    state = amp.state_dict()
    assert state["loss_scaler0"]["loss_scale"] == 65536.0
    assert state["loss_scaler1"]["loss_scale"] == 32768.0


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.a(x), self.b(x)


def _two_heads_separate_vs_summed(num_losses, fused):
    """Each head's gradient comes from its own scale_loss block before one step; the
    result must equal one scale_loss over the summed loss."""
    (x, y), = mlp_batches(1)
    results = []
    for separate in (True, False):
        model = TwoHeads()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, fused=fused)
        model, opt = amp.initialize(model, opt, opt_level="O1", num_losses=num_losses,
                                    verbosity=0)
        out_a, out_b = model(x)
        if separate:
            with amp.scale_loss(mse(out_a, y), opt, loss_id=0) as scaled:
                scaled.backward()
            with amp.scale_loss(mse(out_b, y), opt, loss_id=num_losses - 1) as scaled:
                scaled.backward()
        else:
            with amp.scale_loss(mse(out_a, y) + mse(out_b, y), opt) as scaled:
                scaled.backward()
        opt.step()
        results.append(clones(model.parameters()))
    for sep, summed in zip(*results):
        torch.testing.assert_close(sep, summed, **TOL[torch.float32])


@pytest.mark.parametrize("num_losses", [1, 2])
def test_two_losses_on_separate_heads(num_losses):
    _two_heads_separate_vs_summed(num_losses, fused=False)



@pytest.mark.parametrize("num_losses", [1, 2])
def test_two_losses_on_separate_heads_with_a_fused_step(num_losses):
    _two_heads_separate_vs_summed(num_losses, fused=True)


def test_abandoned_backward_before_a_fused_step():
    """Backward, then zero_grad() without step() (e.g. a batch thrown away), then a
    normal iteration: the same update as the normal iteration alone (as in Apex)."""
    (x, y), = mlp_batches(1)
    results = []
    for abandon in (True, False):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, fused=True)
        model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
        if abandon:
            with amp.scale_loss(mse(model(x), y), opt) as scaled:
                scaled.backward()
            opt.zero_grad()
        amp_step(model, opt, x, y, zero_grad=False)
        results.append(clones(model.parameters()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **TOL[torch.float32])


# --------------------------------------------------------------------------------------
# gradient accumulation with delay_unscale
# --------------------------------------------------------------------------------------

def _grads(opt):
    return [m.grad.detach().clone() for m in amp.master_params(opt)]


@pytest.mark.parametrize("level,half,kind", [("O1", torch.float16, "sgd"),
                                             ("O1", torch.float16, "adam_fused"),
                                             ("O2", torch.float16, "sgd"),
                                             ("O2", torch.bfloat16, "sgd")],
                         ids=["O1", "O1-adam_fused", "O2", "O2-bf16"])
def test_delay_unscale_accumulation(level, half, kind):
    (x, y), = mlp_batches(1, rows=8)

    def master_grads(accumulate):
        model = mlp()  # no BatchNorm: half batches must add up to the whole batch
        model, opt = amp.initialize(model, make_opt(kind, model), opt_level=level,
                                    half_dtype=half, verbosity=0)

        def part_loss(rows):
            return ((model(x[rows]).float() - y[rows]) ** 2).sum() / y.numel()

        if accumulate:
            with amp.scale_loss(part_loss(slice(0, 4)), opt, delay_unscale=True) as scaled:
                scaled.backward()
            with amp.scale_loss(part_loss(slice(4, 8)), opt) as scaled:
                scaled.backward()
        else:
            with amp.scale_loss(part_loss(slice(0, 8)), opt) as scaled:
                scaled.backward()
        grads = _grads(opt)
        opt.step()
        return grads

    accumulated, whole = master_grads(True), master_grads(False)
    for a, w in zip(accumulated, whole):
        assert a.dtype == torch.float32
        # each half-precision gradient is rounded once per backward: TOL of the half
        # dtype, relative to the size of the gradient
        tol = TOL[half]
        torch.testing.assert_close(a, w, rtol=tol["rtol"],
                                   atol=tol["atol"] + tol["rtol"] * w.abs().max().item())


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_step_after_only_a_delayed_backward_raises(level):
    model = mlp()
    model, opt = amp.initialize(model, make_opt("sgd", model), opt_level=level, verbosity=0)
    (x, y), = mlp_batches(1)
    before = clones(model.parameters())
    with amp.scale_loss(mse(model(x), y), opt, delay_unscale=True) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match="delay_unscale"):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


# --------------------------------------------------------------------------------------
# gradient clipping through master_params
# --------------------------------------------------------------------------------------

def _fp32_reference_norm(model, x, y):
    """Gradient norm of an fp32 copy of ``model`` (same weights) on the same batch."""
    ref = mlp()
    ref.load_state_dict(model.state_dict())  # fp32 state dict at every level
    mse(ref(x), y).backward()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))


@pytest.mark.parametrize("level,kind", [("O2", "sgd"), ("O1", "adam_fused")])
def test_clip_master_params_sees_unscaled_gradients(level, kind):
    model = mlp()
    model, opt = amp.initialize(model, make_opt(kind, model), opt_level=level, verbosity=0)
    (x, y), = mlp_batches(1)
    ref_norm = _fp32_reference_norm(model, x, y)
    seen = {}
    opt.register_step_pre_hook(
        lambda o, args, kwargs: seen.update(grad_scale=getattr(o, "grad_scale", None)))

    opt.zero_grad()
    with amp.scale_loss(mse(model(x), y), opt) as scaled:
        scaled.backward()
    if level == "O1":
        # the parameters are their own masters: unscaled in place at the exit, as in Apex
        # (a fused step left them scaled once: a clipped norm was 65536x too large)
        grad_norm = torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in model.parameters()]))
        torch.testing.assert_close(grad_norm, ref_norm, **TOL[torch.float16])
    max_norm = 0.5 * ref_norm.item()
    total = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), max_norm)
    # the forward ran in fp16: TOL of fp16 against the fp32 reference
    torch.testing.assert_close(total, ref_norm, **TOL[torch.float16])
    after = torch.linalg.vector_norm(
        torch.stack([m.grad.norm() for m in amp.master_params(opt)]))
    torch.testing.assert_close(after, torch.tensor(max_norm), **TOL[torch.float32])

    before = clones(model.parameters())
    opt.step()
    assert seen["grad_scale"] is None  # already unscaled: the fused step must not divide again
    for b, p in zip(before, model.parameters()):
        assert torch.isfinite(p).all() and not torch.equal(b, p)


def _o1_optimizer(kind, model):
    from tritamp.optimizers import FusedAdam
    if kind == "tritamp_fused_adam":
        return FusedAdam(model.parameters(), lr=1e-2)
    return make_opt(kind, model)


@pytest.mark.parametrize("loss_scale", ["dynamic", 128.0])
@pytest.mark.parametrize("kind", ["tritamp_fused_adam", "adam_fused", "sgd"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_o1_grads_are_unscaled_when_scale_loss_exits_and_clipping_them_works(
        kind, loss_scale, set_to_none):
    """Apex's O1: the parameters are their own masters, and scale_loss's exit unscales
    their gradients in place, so a script that clips (or reads) ``model.parameters()``
    sees the true gradients, whichever optimizer steps (one that takes the scale itself
    included). Held to torch.autocast + the same loss scale, unscaled by hand, clipped
    and stepped the same way."""
    model = mlp()
    model, opt = amp.initialize(model, _o1_optimizer(kind, model), opt_level="O1",
                                loss_scale=loss_scale, verbosity=0)
    ref = mlp()
    ref_opt = _o1_optimizer(kind, ref)
    for step, (x, y) in enumerate(mlp_batches(3)):
        scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
        opt.zero_grad(set_to_none=set_to_none)
        with amp.scale_loss(mse(model(x), y), opt) as scaled:
            scaled.backward()
        ref_opt.zero_grad(set_to_none=set_to_none)
        with torch.autocast("cpu", dtype=torch.float16):
            out = ref(x)
        (mse(out, y) * scale).backward()
        for r in ref.parameters():
            r.grad.div_(scale)  # a power of two: exact
        for p, r in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, r.grad), (step, kind)
        max_norm = 0.5 * torch.nn.utils.get_total_norm(
            [r.grad for r in ref.parameters()]).item()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        assert torch.equal(total, ref_total)
        opt.step()
        ref_opt.step()
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, r, **TOL[torch.float32])
        # .grad after the step: what the clip left (the step writes no gradient)
        for p, r in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, r.grad)


@pytest.mark.parametrize("change", ["dtype", "size"])
def test_o1_unscale_in_place_follows_a_gradient_of_another_dtype_or_size_at_the_same_address(
        path, change):
    """The in-place unscale's kept sweep is keyed by the gradients' addresses and layout:
    a parameter recast through .data (another dtype, or fewer elements) whose new gradient
    lands at the old one's address gets a sweep of its own, which writes that gradient
    and nothing past it (the kept one wrote with the old dtype and size)."""
    p = nn.Parameter(torch.randn(64))
    model, opt = amp.initialize(nn.Linear(1, 1), torch.optim.SGD([p], lr=0.0),
                                opt_level="O1", loss_scale=128.0, verbosity=0)
    buf = torch.zeros(64 * 4, dtype=torch.uint8)
    with amp.scale_loss(p.float().sum(), opt):
        p.grad = buf.view(torch.float32).fill_(128.0)
    assert torch.equal(p.grad, torch.ones(64))
    opt.step()
    opt.zero_grad(set_to_none=True)
    if change == "dtype":
        p.data, dtype, n = p.data.half(), torch.float16, 64
    else:
        p.data, dtype, n = p.data[:32].clone(), torch.float32, 32
    buf.zero_()
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    grad = buf[:nbytes].view(dtype).fill_(128.0)
    buf[nbytes:].view(torch.float32).fill_(7.0)
    with amp.scale_loss(p.float().sum(), opt):
        p.grad = grad
    assert torch.equal(p.grad, torch.ones(n, dtype=dtype))
    assert (buf[nbytes:].view(torch.float32) == 7.0).all()  # nothing written past it


# --------------------------------------------------------------------------------------
# the fused path: no host read, same result as torch.amp.GradScaler + torch.autocast
# --------------------------------------------------------------------------------------

class HostRead(AssertionError):
    pass


def _forbid_host_reads(monkeypatch):
    def host_read(*args, **kwargs):
        raise HostRead("optimizer.step() read a tensor value on the host (a device sync)")
    for name in ("__bool__", "__float__", "__int__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, host_read)


def test_fused_adam_o1_matches_gradscaler_without_host_reads(monkeypatch):
    factors = [1.0, 1.0, INF, 1.0, 1.0]
    batches = mlp_batches(len(factors))

    model = mlp()
    model, opt = amp.initialize(model, make_opt("adam_fused", model), opt_level="O1",
                                verbosity=0)
    seen = {}
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.update(
        grad_scale=getattr(o, "grad_scale", None), found_inf=getattr(o, "found_inf", None)))

    ref = mlp()
    ref_opt = make_opt("adam_fused", ref)
    scaler = torch.amp.GradScaler("cpu")

    for (x, y), factor in zip(batches, factors):
        scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
        assert scale == scaler.get_scale()

        opt.zero_grad()
        with amp.scale_loss(mse(model(x), y) * factor, opt) as scaled:
            scaled.backward()

        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = ref(x)
        scaler.scale(mse(out, y) * factor).backward()

        # unscaled at scale_loss's exit, as Apex did: exactly the gradients GradScaler's
        # backward made, divided by the scale (a power of two: exact in fp32)
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, r.grad / scale, rtol=0, atol=0,
                                       equal_nan=True)

        with monkeypatch.context() as mp:
            _forbid_host_reads(mp)
            opt.step()
        assert seen["grad_scale"] is None  # nothing left to unscale
        assert float(seen["found_inf"]) == (1.0 if factor == INF else 0.0)

        scaler.step(ref_opt)
        scaler.update()

    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == scaler.get_scale() == 32768.0
    # fp32 parameters, the same fp16 forward: TOL of fp32 (in practice bitwise)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, **TOL[torch.float32])
    for key in ("step", "exp_avg", "exp_avg_sq"):
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[r][key],
                                       **TOL[torch.float32])


def test_the_host_read_probe_catches_the_synchronising_path(monkeypatch):
    """Without _step_supports_amp_scaling the skip is decided on the host (as in Apex):
    the probe used above must notice it."""
    model = mlp()
    model, opt = amp.initialize(model, make_opt("sgd", model), opt_level="O1", verbosity=0)
    (x, y), = mlp_batches(1)
    with amp.scale_loss(mse(model(x), y), opt) as scaled:
        scaled.backward()
    with monkeypatch.context() as mp:
        _forbid_host_reads(mp)
        with pytest.raises(HostRead):
            opt.step()


class _RotaryLike(nn.Module):
    """A Linear and a float64 buffer (rotary frequencies kept in float64); records the
    dtypes its forward sees."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)
        self.register_buffer("freqs", torch.linspace(0.0, 1.0, 4, dtype=torch.float64))
        self.seen = None

    def forward(self, x):
        y = self.lin(x)
        self.seen = (y.dtype, self.freqs.dtype)
        return y + self.freqs.to(y.dtype)


@pytest.mark.parametrize("level,inner,freqs", [("O1", torch.bfloat16, torch.float64),
                                               ("O2", torch.bfloat16, torch.bfloat16)])
def test_a_float64_buffer_is_accepted_as_apex_does(level, inner, freqs):
    """Apex refuses only half parameters and buffers: a float64 buffer stays as it is at
    O1 and is cast with the model at O2; the model trains."""
    model = _RotaryLike()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                verbosity=0)
    (x, y), = mlp_batches(1)
    amp_step(model, opt, x, y)
    assert model.seen == (inner, freqs)


def test_o1_with_a_float32_cast_still_runs_the_forward_in_half():
    """O1 with cast_model_type=torch.float32 (an override Apex accepts): the model is cast
    to fp32 and its forward still runs under the half casts, as Apex still patches
    torch's functions."""
    model = _RotaryLike()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", cast_model_type=torch.float32,
                                half_dtype=torch.bfloat16, verbosity=0)
    out = model(torch.randn(2, 8))
    assert model.seen[0] == torch.bfloat16 and out.dtype == torch.float32
