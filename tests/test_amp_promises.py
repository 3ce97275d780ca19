"""Promises of tritamp.amp that the docs and docstrings make in so many words: the floor
warning's 10 steps, LossScaler's own defaults, checkpoints without tritamp's optional
keys, Apex's writable scaler attributes, static scales other than 1.0, failed blocks and
exits that leave nothing behind, the master gradients of O2, and the casts of
initialize.

Steps run at O0 with a dynamic scale (fp32 on a CPU) unless the opt level matters; O1
and O2 use bf16, so that a clean step really is clean on a CPU.
"""
import logging
import re
import warnings

import pytest
import torch
from torch import nn

from conftest import amp_step
from tritamp import amp
from tritamp.testing import amp_state, reset_amp

INF = float("inf")


def _sum(out, _y):
    return out.sum()


def _linear(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(3, 1)


def _o0_dynamic(**kwargs):
    """A Linear(3, 1) and its SGD at O0 with a dynamic scale (fp32 math)."""
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs.setdefault("verbosity", 0)
    return amp.initialize(model, opt, opt_level="O0", loss_scale="dynamic", **kwargs)


def _step(model, opt, factor=1.0):
    """One step; ``factor=INF`` makes every gradient non-finite. Returns the floor
    warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp_step(model, opt, torch.ones(2, 3), loss_fn=_sum, factor=factor)
    return [w for w in caught if issubclass(w.category, RuntimeWarning)
            and "stayed at its floor" in str(w.message)]


def _warned_at(model, opt, factors):
    """The indices of the steps (one per factor) that raised the floor warning."""
    return [i for i, f in enumerate(factors) if _step(model, opt, f)]


def _scaler0():
    return amp.state_dict()["loss_scaler0"]


# -- the floor warning ------------------------------------------------------------------------

def test_the_floor_warning_comes_at_the_tenth_overflowing_step_at_the_floor_and_only_once():
    """docs/amp.md: the scaler warns after 10 consecutive overflowing steps at its floor:
    not at the 9th, once at the 10th, not again while the streak goes on."""
    model, opt = _o0_dynamic(init_scale=1.0, min_loss_scale=1.0)
    assert _warned_at(model, opt, [INF] * 14) == [9]


def test_the_floor_warning_comes_again_after_a_clean_step_ends_the_streak():
    """A run that recovers for one step and then overflows at the floor again gets the
    warning a second time, at the 10th step of the new streak."""
    model, opt = _o0_dynamic(init_scale=1.0, min_loss_scale=1.0, max_loss_scale=1.0)
    factors = [INF] * 10 + [1.0] + [INF] * 10
    assert _warned_at(model, opt, factors) == [9, 20]


# -- LossScaler's defaults --------------------------------------------------------------------

def test_loss_scaler_defaults_are_apexs():
    """tritamp.amp.LossScaler("dynamic") with no other argument: Apex's init_scale 2**16,
    scale_factor 2 (backoff 1/2), scale_window 2000, max_loss_scale 2**24, a floor of 1.0
    and no hysteresis."""
    s = amp.LossScaler("dynamic")
    assert (s.loss_scale(), s.growth_factor, s.backoff_factor, s.growth_interval,
            s.max_loss_scale, s.min_loss_scale, s.hysteresis) == \
        (65536.0, 2.0, 0.5, 2000, 16777216.0, 1.0, 1)


# -- checkpoints without tritamp's optional keys ----------------------------------------------

def test_an_apex_checkpoint_restores_the_full_hysteresis():
    """Loading Apex's {loss_scale, unskipped} into a hysteresis=2 scaler that has used one
    of its tolerated overflows restores a fresh scaler's hysteresis: the first overflow
    after the load keeps the scale, the second backs it off."""
    model, opt = _o0_dynamic(init_scale=1024.0, hysteresis=2)
    _step(model, opt, INF)
    assert (_scaler0()["loss_scale"], _scaler0()["hysteresis"]) == (1024.0, 1)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 0}})
    assert _scaler0()["hysteresis"] == 2
    _step(model, opt, INF)
    assert _scaler0()["loss_scale"] == 1024.0
    _step(model, opt, INF)
    assert _scaler0()["loss_scale"] == 512.0


def test_an_apex_checkpoint_starts_a_new_floor_streak():
    """A checkpoint without 'floor_streak' loads with no streak: after 5 overflowing steps
    at the floor and the load, the warning comes at the 10th overflowing step after the
    load, not the 5th."""
    model, opt = _o0_dynamic(init_scale=1.0, min_loss_scale=1.0)
    assert _warned_at(model, opt, [INF] * 5) == []
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})
    assert _scaler0()["floor_streak"] == 0
    assert _warned_at(model, opt, [INF] * 10) == [9]


def test_a_checkpoint_with_a_long_floor_streak_but_no_floor_warned_key_counts_as_warned():
    """A streak of 12 without 'floor_warned' was already warned about: the load sets the
    flag, and the next overflowing step at the floor does not warn again."""
    model, opt = _o0_dynamic(init_scale=1.0, min_loss_scale=1.0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0,
                                          "floor_streak": 12}})
    assert _scaler0()["floor_warned"] is True
    assert _warned_at(model, opt, [INF, INF]) == []
    assert _scaler0()["floor_streak"] == 14


def test_a_resumed_run_does_not_report_the_checkpoints_skips_on_its_first_clean_step(caplog):
    """A run resumed from a checkpoint of a run that skipped 3 steps logs nothing about
    skipped steps on a clean step: the skips were the first run's, already reported."""
    caplog.set_level(logging.WARNING, logger="tritamp.amp")
    model, opt = _o0_dynamic(init_scale=1024.0, verbosity=1)
    for _ in range(3):
        _step(model, opt, INF)
    saved = amp.state_dict()
    assert saved["loss_scaler0"]["skipped"] == 3
    assert sum("Gradient overflow" in r.getMessage() for r in caplog.records) >= 1
    reset_amp()
    model, opt = _o0_dynamic(init_scale=1024.0, verbosity=1)
    amp.load_state_dict(saved)
    caplog.clear()
    _step(model, opt)
    assert amp.last_step_skipped(opt) is False
    assert [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()] == []


# -- Apex's writable attributes ---------------------------------------------------------------

def test_setting_loss_scale_brings_a_dynamic_scale_within_its_floor_and_ceiling():
    """amp._amp_state.loss_scalers[0]._loss_scale = x (NVIDIA's BERT scripts) brings a
    dynamic scale within [min_loss_scale, max_loss_scale], as a loaded state_dict's."""
    _o0_dynamic(min_loss_scale=4.0, max_loss_scale=2.**20)
    scaler = amp._amp_state.loss_scalers[0]
    scaler._loss_scale = 2.**30
    assert scaler.loss_scale() == 2.**20
    scaler._loss_scale = 0.5
    assert scaler.loss_scale() == 4.0
    scaler._loss_scale = 256.0
    assert scaler.loss_scale() == 256.0


def test_ceiling_and_floor_may_be_set_equal_as_the_constructor_allows():
    """_max_loss_scale may be set to the floor, and _min_loss_scale to the ceiling (a
    fixed dynamic scale), as LossScaler(min_loss_scale=m, max_loss_scale=m) is accepted."""
    _o0_dynamic(init_scale=8.0, min_loss_scale=8.0)
    scaler = amp._amp_state.loss_scalers[0]
    scaler._max_loss_scale = 8.0
    assert scaler.max_loss_scale == 8.0
    reset_amp()
    _o0_dynamic(init_scale=8.0, max_loss_scale=8.0)
    scaler = amp._amp_state.loss_scalers[0]
    scaler._min_loss_scale = 8.0
    assert scaler.min_loss_scale == 8.0


def test_replacing_a_static_scale_of_one_makes_scale_loss_scale_by_the_new_value():
    """At O0 (a static 1.0) _loss_scale = 128 is applied, not only reported: scale_loss
    yields the loss times 128, and the gradients come out unscaled."""
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O0", verbosity=0)
    amp._amp_state.loss_scalers[0]._loss_scale = 128.0
    loss = model(torch.ones(2, 3)).sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert float(scaled.detach() / loss.detach()) == 128.0
        scaled.backward()
    assert torch.equal(model.weight.grad, torch.full((1, 3), 2.0))
    assert torch.equal(model.bias.grad, torch.full((1,), 2.0))


def test_a_static_scale_below_one_scales_the_loss_and_unscales_the_gradients():
    """loss_scale=0.5 is a valid static scale: the loss is multiplied by 0.5 and the
    gradients are divided by it again (only exactly 1.0 leaves the loss alone)."""
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O0", loss_scale=0.5, verbosity=0)
    loss = model(torch.ones(2, 3)).sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert float(scaled.detach() / loss.detach()) == 0.5
        scaled.backward()
    assert torch.equal(model.weight.grad, torch.full((1, 3), 2.0))


# -- failed blocks and exits leave nothing behind ---------------------------------------------

def _bf16_o1(model, momentum=0.0):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    return amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16,
                          loss_scale="dynamic", verbosity=0)


def test_a_clean_step_after_a_refused_exit_is_not_skipped():
    """An overflowing step, then a scale_loss whose exit refuses a sparse gradient (no
    scale update), then a clean step: the clean step is taken and the scale is not
    backed off again."""
    model, opt = _bf16_o1(_linear())
    x = torch.ones(2, 3)
    opt.zero_grad()
    with amp.scale_loss(model(x).sum() * INF, opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp.last_step_skipped(opt) is True
    scale = _scaler0()["loss_scale"]
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="sparse"):
        with amp.scale_loss(model(x).sum(), opt) as scaled:
            scaled.backward()
            model.weight.grad = model.weight.grad.to_sparse()
    opt.zero_grad()
    before = model.weight.detach().clone()
    with amp.scale_loss(model(x).sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp.last_step_skipped(opt) is False
    assert not torch.equal(before, model.weight.detach())
    assert _scaler0()["loss_scale"] == scale


@pytest.mark.parametrize("delay_unscale", [False, True])
def test_a_block_that_raises_keeps_the_overflow_flag_zero_grad_carried(delay_unscale):
    """After an overflow and zero_grad(set_to_none=False) the next step() is skipped
    (Apex's behaviour); a scale_loss whose block raises in between changes nothing: the
    step is still skipped, and momentum does not move the weights on the zeros."""
    model, opt = _bf16_o1(_linear(), momentum=0.9)
    x = torch.ones(1, 3)
    with amp.scale_loss(model(x).sum(), opt) as scaled:   # a clean step: momentum exists
        scaled.backward()
    opt.step()
    with amp.scale_loss(model(x).sum() * INF, opt) as scaled:
        scaled.backward()
    opt.zero_grad(set_to_none=False)
    with pytest.raises(RuntimeError, match="the block failed"):
        with amp.scale_loss(model(x).sum(), opt, delay_unscale=delay_unscale):
            raise RuntimeError("the block failed")
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert amp.last_step_skipped(opt) is True
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))


# -- scale_loss -------------------------------------------------------------------------------

def test_scale_loss_yields_an_fp32_loss_at_a_static_scale_of_one():
    """At O3 (static 1.0, no masters) a bf16 loss comes out of scale_loss as fp32, the
    same value, as Apex's loss.float()."""
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O3", half_dtype=torch.bfloat16,
                                verbosity=0)
    loss = model(torch.ones(2, 3)).sum().to(torch.bfloat16)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.dtype == torch.float32
        assert float(scaled.detach()) == float(loss.detach())
        scaled.backward()


def test_scale_loss_takes_a_tuple_of_optimizers():
    """scale_loss(loss, (opt1, opt2)) works as with a list: both optimizers step on
    their unscaled gradients."""
    models = [_linear(0), _linear(1)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    models, opts = amp.initialize(models, opts, opt_level="O1", half_dtype=torch.bfloat16,
                                  loss_scale="dynamic", verbosity=0)
    before = [m.weight.detach().clone() for m in models]
    x = torch.ones(1, 3)
    with amp.scale_loss((models[0](x) + models[1](x)).sum(), tuple(opts)) as scaled:
        scaled.backward()
    for o in opts:
        o.step()
    for b, m in zip(before, models):
        torch.testing.assert_close(m.weight.detach(), b - 0.1, rtol=0, atol=1e-6)


# -- O2's master gradients --------------------------------------------------------------------

def test_master_params_read_after_the_backward_keeps_the_fused_step_on_half_gradients():
    """Clipping over amp.master_params(opt) after scale_loss (the documented way) with a
    tritamp fused optimizer at O2 does not switch later exits to fp32 master gradients:
    after the next scale_loss the masters still have no .grad."""
    from tritamp.optimizers import FusedSGD
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = FusedSGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    x = torch.ones(3, 4)
    for it in range(2):
        opt.zero_grad()
        with amp.scale_loss(model(x).float().sum(), opt) as scaled:
            scaled.backward()
        assert [p.grad for p in opt.param_groups[0]["params"]] == [None, None], it
        torch.nn.utils.clip_grad_norm_(list(amp.master_params(opt)), 1.0)
        opt.step()


def test_o2_masters_gradients_are_spent_by_the_step():
    """At O2 the step leaves the masters without gradients (Apex set them to None), so a
    second step without zero_grad steps on the second backward's gradient alone."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                verbosity=0)
    masters = opt.param_groups[0]["params"]
    x = torch.ones(2, 3)
    opt.zero_grad()
    for _ in range(2):
        before = masters[0].detach().clone()
        with amp.scale_loss(model(x).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        assert all(m.grad is None for m in masters)
        # d(sum of outputs)/d(weight) = 2 per entry: one step moves it by -0.2
        torch.testing.assert_close(masters[0].detach() - before, torch.full((1, 3), -0.2),
                                   rtol=0, atol=1e-6)


def test_add_param_group_refuses_a_set_of_parameters():
    """amp keeps torch's refusal of a set (unordered: the checkpoint's parameter order
    would change between runs), and the optimizer keeps its groups."""
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    with pytest.raises(TypeError, match="ordered collections"):
        opt.add_param_group({"params": {nn.Parameter(torch.zeros(2))}})
    assert len(opt.param_groups) == 1


# -- initialize -------------------------------------------------------------------------------

def test_a_disabled_initialize_leaves_no_loss_scalers_of_an_earlier_call():
    """initialize(enabled=False) after an enabled call leaves amp without loss scalers:
    amp.state_dict() is empty."""
    model = _linear()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1",
                   verbosity=0)
    assert list(amp.state_dict()) == ["loss_scaler0"]
    other = _linear(1)
    amp.initialize(other, torch.optim.SGD(other.parameters(), lr=0.1), enabled=False)
    assert dict(amp.state_dict()) == {}
    assert amp_state().loss_scalers == []


def test_o2_keeps_only_affine_batchnorm_in_fp32():
    """keep_batchnorm_fp32 (O2's default) keeps an affine BatchNorm fp32; a BatchNorm
    with affine=False is cast with the rest of the model, as Apex's convert_network."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert model[0].weight.dtype == torch.float16
    assert model[1].running_mean.dtype == torch.float16
    assert model[1].running_var.dtype == torch.float16
    assert model[2].weight.dtype == torch.float32
    assert model[2].running_mean.dtype == torch.float32


def test_o2_casts_a_gradient_that_exists_before_initialize():
    """A parameter with a gradient before initialize has it cast with the parameter at
    O2 (fp16 parameter, fp16 gradient), as Apex's convert_module."""
    model = _linear()
    model(torch.ones(1, 3)).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert model.weight.dtype == torch.float16
    assert model.weight.grad.dtype == torch.float16
    assert model.bias.grad.dtype == torch.float16
    assert torch.equal(model.weight.grad, torch.ones(1, 3, dtype=torch.float16))


def test_a_float64_parameter_is_refused_by_name():
    """initialize refuses a model parameter that is not fp32, float64 included (only a
    float64 buffer is accepted), naming it."""
    model = _linear().double()
    with pytest.raises(RuntimeError, match="Found param weight with type torch.float64"):
        amp.initialize(model, opt_level="O1", verbosity=0)
    assert amp_state().opt_properties is None


# -- the skip warning -------------------------------------------------------------------------

@pytest.mark.parametrize("layers", [5, 4])
def test_the_skip_warning_names_eight_gradients_and_counts_the_rest(caplog, layers):
    """With 10 gradients overflowing, the skip warning names 8 of them and ends with
    ', and 2 more'; with exactly 8 it names them all and counts no more."""
    caplog.set_level(logging.WARNING, logger="tritamp.amp")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(layers)])  # 2 parameters each
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=1)
    with amp.scale_loss(model(torch.ones(1, 2)).float().sum() * INF, opt) as scaled:
        scaled.backward()
    opt.step()
    skips = [r.getMessage() for r in caplog.records if r.name == "tritamp.amp"
             and r.getMessage().startswith("Gradient overflow")]
    assert len(skips) == 1
    names = skips[0].split("non-finite gradients on rank 0: ")[1]
    assert len(re.findall(r"\(\d+ values?\)", names)) == 8
    if layers == 5:
        assert names.endswith(", and 2 more")
    else:
        assert "more" not in names
