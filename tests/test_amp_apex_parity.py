"""amp's frontend where Apex's behaviour is observable: disable_casts around an O1
forward, step()'s arguments, zero_grad() with master weights, scale_loss's static
shortcut, load_state_dict's warnings, the registries' keyword, FP16_Optimizer refused.
Each case states Apex's behaviour (apex/amp at the commit before amp was removed)."""
import logging

import pytest
import torch
import torch.nn as nn

from conftest import assert_bits_equal
from tritamp import amp
from tritamp.fp16_utils import FP16_Optimizer
from tritamp.testing import reset_amp

APEX_CLOSURE = "Currently, Amp does not support closure use with optimizers."


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)


# -- disable_casts: Apex's handle turned every cast off, an O1 model's forward included ----

class _Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        y = self.lin(x)
        self.seen.append((y.dtype, _doubled(y).dtype))
        return y


@amp.half_function
def _doubled(t):
    return t * 2


def test_disable_casts_around_an_O1_forward_runs_it_in_fp32():
    model = amp.initialize(_Probe(), opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(2, 4)
    model(x)
    with amp.disable_casts():
        model(x)
    with pytest.raises(ZeroDivisionError):
        with amp.disable_casts():
            1 / 0
    model(x)  # on again after the block, also after one that raised
    assert model.seen == [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                          (torch.bfloat16, torch.bfloat16)]


# -- step(): Apex patched only the master-weights step; elsewhere arguments go through ----

def _lbfgs_run(level, **kw):
    model = _net()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    if level is not None:
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)
    x, y = _batch()

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)
        if level is None:
            loss.backward()
        else:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        return loss

    for _ in range(2):
        opt.step(closure)
    return [p.detach().float() for p in model.parameters()]


def test_a_closure_goes_to_the_optimizer_without_master_weights():
    # O0: the scale is a static 1.0 and nothing is cast: torch's LBFGS bit for bit
    for a, b in zip(_lbfgs_run("O0"), _lbfgs_run(None)):
        assert_bits_equal(a, b, "O0 LBFGS")
    # O1 with a dynamic scale: the closure's own scale_loss checks and unscales
    ours = _lbfgs_run("O1", half_dtype=torch.bfloat16, loss_scale="dynamic")
    for a, b in zip(ours, _lbfgs_run(None)):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)
        assert torch.isfinite(a).all()


def test_a_closure_with_an_overflow_pending_is_refused_and_nothing_moves():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    x, y = _batch()
    before = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y) * float("inf"), opt) as s:
        s.backward()
    with pytest.raises(RuntimeError, match=APEX_CLOSURE):
        opt.step(lambda: None)
    for a, b in zip(before, model.parameters()):
        assert_bits_equal(a, b.detach(), "weights after the refused step")
    # without an overflow the closure is taken
    opt.zero_grad()
    with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as s:
        s.backward()
    calls = []
    opt.step(lambda: calls.append(1))
    assert calls == [1]
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_closure_with_master_weights_is_refused():
    model = _net()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    with pytest.raises(RuntimeError, match=APEX_CLOSURE):
        opt.step(lambda: None)


class _ScaledSGD(torch.optim.SGD):
    def step(self, closure=None, lr_scale=1.0):
        for g in self.param_groups:
            g["lr"] *= lr_scale
        return super().step(closure)


@pytest.mark.parametrize("level,kw", [("O0", {}),
                                      ("O1", dict(half_dtype=torch.bfloat16,
                                                  loss_scale="dynamic"))])
def test_an_optimizers_own_step_keywords_go_through(level, kw):
    model = _net()
    model, opt = amp.initialize(model, _ScaledSGD(model.parameters(), lr=0.1),
                                opt_level=level, verbosity=0, **kw)
    x, y = _batch()
    with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as s:
        s.backward()
    opt.step(lr_scale=0.5)
    assert opt.param_groups[0]["lr"] == 0.05


# -- zero_grad() with master weights: Apex zeroed the model's gradients in place -----------

def _o2_run(zero_grad):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                verbosity=0)
    assert model[1].weight.dtype == torch.float32  # fp32 parameters beside the half ones
    x, y = _batch()
    grads = []
    for _ in range(3):
        zero_grad(opt)
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as s:
            s.backward()
        opt.step()
    return grads, [p.detach().clone() for p in amp.master_params(opt)], opt, model


def test_o2_zero_grad_zeroes_the_models_gradients_in_place():
    grads, weights, opt, model = _o2_run(lambda o: o.zero_grad())
    assert all(g is None for g in grads[0])
    for later in grads[1:]:  # zeros, not None, after a step
        assert all(g is not None and not g.any() for g in later)
    model_ids = {id(p) for p in model.parameters()}
    opt.zero_grad()
    masters = [m for m in amp.master_params(opt) if id(m) not in model_ids]
    assert masters and all(m.grad is None for m in masters)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    _, expected, _, _ = _o2_run(lambda o: o.zero_grad(set_to_none=True))
    for a, b in zip(weights, expected):
        assert_bits_equal(a, b, "masters after zero_grad() vs zero_grad(set_to_none=True)")


def test_o1_zero_grad_keeps_torchs_default():
    model = _net()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    x, y = _batch()
    with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as s:
        s.backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


# -- scale_loss's static shortcut looks at no optimizer, as Apex's returned first ----------

@pytest.mark.parametrize("level", ["O0", "O3"])
def test_static_one_without_masters_takes_any_optimizer(level):
    model = amp.initialize(_net(), opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built after initialize
    x, y = _batch()
    for optimizers in (opt, None, [opt]):
        loss = nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)
        with amp.scale_loss(loss, optimizers) as scaled:
            assert torch.equal(scaled, loss.float())
            scaled.backward()
    opt.step()


def test_a_dynamic_scale_still_refuses_an_unprocessed_optimizer():
    model = amp.initialize(_net(), opt_level="O1", half_dtype=torch.bfloat16,
                           loss_scale="dynamic", verbosity=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch()
    with pytest.raises(RuntimeError, match="did not go through amp.initialize"):
        with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt):
            pass


# -- load_state_dict: Apex printed its count warnings whatever the verbosity --------------

def test_load_state_dict_count_warnings_are_warnings_at_verbosity_0(caplog):
    caplog.set_level(logging.WARNING, logger="tritamp.amp")
    model = _net()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                opt_level="O1", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", num_losses=2, verbosity=0)
    state = amp.state_dict()
    state["loss_scaler2"] = dict(state["loss_scaler0"])
    amp.load_state_dict(state)
    got = [r.getMessage() for r in caplog.records
           if r.name == "tritamp.amp" and r.levelno == logging.WARNING]
    assert got == ["Warning: state_dict contains 3 entries, while 2 loss_scalers are used",
                   "Skipping loss_scaler[2], since num_losses was set to 2"]


# -- the registries take Apex's parameter names; FP16_Optimizer is not an amp optimizer ----

def test_register_functions_take_apex_keywords():
    class Namespace:
        @staticmethod
        def f(t):
            return t + 1
    for register in (amp.register_half_function, amp.register_float_function,
                     amp.register_promote_function):
        register(module=Namespace, name="f")
    with pytest.raises(ValueError, match="No function named g"):
        amp.register_float_function(module=Namespace, name="g")


@pytest.mark.parametrize("as_list", [False, True])
def test_fp16_optimizer_is_refused_with_apexs_error(as_list):
    model = _net()
    fp16 = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    with pytest.raises(RuntimeError, match="An incoming optimizer is an instance of "
                       "tritamp.fp16_utils.FP16_Optimizer"):
        amp.initialize(model, [fp16] if as_list else fp16, opt_level="O1", verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())


# -- training-loop patterns (an audit of amp against Apex's logic) -----------------------

class _TwoBranch(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x, use_b):
        return self.a(x) + (self.b(x) if use_b else 0)


@pytest.mark.parametrize("make", ["sgd", "fused_sgd", "fused_adam"])
def test_o2_parameter_the_backward_misses_after_zero_grad_is_left_alone(make, path):
    # Apex set every half gradient to None before the backward (prepare_backward_with_
    # master_weights): the zeros zero_grad() left moved an unused branch through momentum
    # or Adam's moments (by 0.14 / 0.07).
    from tritamp.optimizers import FusedAdam, FusedSGD
    net = _TwoBranch()
    opt = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
           "fused_sgd": lambda p: FusedSGD(p, lr=0.1, momentum=0.9),
           "fused_adam": lambda p: FusedAdam(p, lr=0.1)}[make](net.parameters())
    net, opt = amp.initialize(net, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(8, 4)
    for step in range(2):
        with amp.scale_loss(net(x, step == 0).square().mean(), opt) as s:
            s.backward()
        if step == 1:
            assert net.b.weight.grad is None
            before = [t.detach().clone() for t in (net.b.weight, net.b.bias)]
        opt.step()
        opt.zero_grad()
    for b, t in zip(before, (net.b.weight, net.b.bias)):
        assert_bits_equal(b, t.detach(), "the branch the backward did not reach")


@pytest.mark.parametrize("loss_scale", ["dynamic", 128.0])
def test_load_state_dict_between_scale_loss_and_step_keeps_the_gradients_scale(loss_scale,
                                                                             path):
    # At O2 with a fused optimizer the gradients wait, scaled, for the step, which read
    # their scale from a slot the load overwrote (a 64x too large update).
    from tritamp.optimizers import FusedSGD

    def run(load):
        reset_amp()
        torch.manual_seed(0)
        m = nn.Linear(4, 2)
        m, opt = amp.initialize(m, FusedSGD(m.parameters(), lr=0.1), opt_level="O2",
                                half_dtype=torch.bfloat16, loss_scale=loss_scale,
                                verbosity=0)
        x = torch.randn(8, 4)
        for i in range(2):  # (a load between micro-batches, and one before the step)
            with amp.scale_loss(m(x + i).square().mean(), opt) as s:
                s.backward()
            if load:
                amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0 * (i + 1),
                                                      "unskipped": 0}})
        opt.step()
        return [p.detach().clone() for p in amp.master_params(opt)]

    for a, b in zip(run(False), run(True)):
        assert_bits_equal(a, b, "the masters after the step")


def _o1_sgd_with_momentum():
    """(model, optimizer, x, y): O1 bf16 with a dynamic scale, torch's SGD with momentum."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    return (model, opt, *_batch())


def test_a_closure_whose_own_backward_overflows_is_refused_and_nothing_moves(path):
    # torch's closure pattern with scale_loss inside: the step applied the inf gradients
    # (Apex too, then refused the next step); refused when the closure returns now, the
    # step counted as skipped, and a retry starts clean.
    model, opt, x, y = _o1_sgd_with_momentum()
    factor = [float("inf")]

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y) * factor[0]
        with amp.scale_loss(loss, opt) as s:
            s.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=APEX_CLOSURE):
        opt.step(closure)
    assert amp.last_step_skipped(opt)
    for a, b in zip(before, model.parameters()):
        assert_bits_equal(a, b.detach(), "weights after the refused step")
    factor[0] = 1.0
    opt.step(closure)
    assert not amp.last_step_skipped(opt)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_o1_zero_grad_after_an_overflow_keeps_the_step_skipped(path):
    # Apex patched only the master-weights zero_grad: its skip survived a zero_grad at O1.
    # The step ran on the zeros (momentum moved the weights); a new backward still decides.
    model, opt, x, y = _o1_sgd_with_momentum()
    for factor in (1.0, float("inf")):
        with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y) * factor, opt) as s:
            s.backward()
        if factor != 1.0:
            opt.zero_grad()
            before = [p.detach().clone() for p in model.parameters()]
        opt.step()
    assert amp.last_step_skipped(opt)
    for a, b in zip(before, model.parameters()):
        assert_bits_equal(a, b.detach(), "weights after the skipped step")
    # overflow, zero_grad, then a clean backward: that backward's step runs
    with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y) * float("inf"), opt) as s:
        s.backward()
    opt.zero_grad()
    with amp.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as s:
        s.backward()
    opt.step()
    assert not amp.last_step_skipped(opt)
