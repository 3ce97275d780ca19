"""Bad input and checkpoints on the loss-scaler side of tritamp.amp and fp16_utils.

- every scaler argument is checked before anything is built, through amp.initialize,
  FP16_Optimizer, the legacy scalers and convert_to_amp, and a refusal changes nothing;
- amp.load_state_dict matches entries by key, checks all of them before loading any, and
  restores the skipped-step count and the floor streak (the floor warning comes at the
  same step in a resumed run as in an uninterrupted one);
- a skipped first step leaves no state behind in torch's optimizers;
- an overflow skips every optimizer passed to the scale_loss that saw it;
- scale_loss before initialize, and a bad loss_id, change nothing.

Steps run at O0 with a dynamic scale (fp32 on a CPU) unless the opt level matters.
"""
import copy
import itertools
import logging
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from conftest import assert_bits_equal
from tritamp import amp, convert_to_amp
from tritamp.testing import amp_state
from tritamp.amp.scaler import FLOOR_WARN_STEPS, LossScaler
from tritamp.fp16_utils import FP16_Optimizer
from tritamp.fp16_utils.loss_scaler import DynamicLossScaler
from tritamp.fp16_utils.loss_scaler import LossScaler as LegacyLossScaler
from tritamp.optimizers import FusedSGD

INF, NAN = float("inf"), float("nan")


def tiny(seed=0, n_in=3, n_out=2):
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out)


def snapshot(model, opt):
    """Bits of every parameter and optimizer state tensor, the optimizer's param_groups
    (by identity) and whether amp touched it."""
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    tensors += [t.clone() for st in opt.state.values() for t in st.values()
                if isinstance(t, torch.Tensor)]
    groups = [[id(p) for p in g["params"]] for g in opt.param_groups]
    return (tensors, groups, "_amp_stash" in vars(opt), type(opt).step is vars(opt).get("step", type(opt).step),
            [p.dtype for p in model.parameters()])


def assert_unchanged(before, after):
    (t0, g0, s0, st0, d0), (t1, g1, s1, st1, d1) = before, after
    assert len(t0) == len(t1)
    for a, b in zip(t0, t1):
        assert_bits_equal(a, b)
    assert (g0, s0, st0, d0) == (g1, s1, st1, d1)


def amp_globals():
    return (amp_state().opt_properties, list(amp_state().loss_scalers), amp_state().verbosity)


def scaler_bits():
    return [s._state.clone() for s in amp_state().loss_scalers], amp.state_dict()


def assert_scalers_unchanged(before):
    states, sd = before
    now_states, now_sd = scaler_bits()
    assert len(states) == len(now_states)
    for a, b in zip(states, now_states):
        assert_bits_equal(a, b)
    assert sd == now_sd


# --------------------------------------------------------------------------------------
# 1. the scaler's arguments
# --------------------------------------------------------------------------------------

BAD_VALUES = [  # (LossScaler keyword, value, error, what the message names)
    ("init_scale", 0.0, ValueError, "init_scale"),
    ("init_scale", -4.0, ValueError, "init_scale"),
    ("init_scale", NAN, ValueError, "init_scale"),
    ("init_scale", INF, ValueError, "init_scale"),
    ("init_scale", True, TypeError, "init_scale"),
    ("init_scale", "65536", TypeError, "init_scale"),
    ("init_scale", None, TypeError, "init_scale"),
    ("init_scale", 0.5, ValueError, "init_scale"),          # below the default floor of 1.0
    ("scale_factor", 1.0, ValueError, "growth_factor"),
    ("scale_factor", 0.5, ValueError, "growth_factor"),
    ("scale_factor", NAN, ValueError, "growth_factor"),
    ("scale_factor", INF, ValueError, "growth_factor"),
    ("scale_factor", True, TypeError, "growth_factor"),
    ("backoff_factor", 0.0, ValueError, "backoff_factor"),
    ("backoff_factor", 1.0, ValueError, "backoff_factor"),
    ("backoff_factor", NAN, ValueError, "backoff_factor"),
    ("backoff_factor", -0.5, ValueError, "backoff_factor"),
    ("backoff_factor", False, TypeError, "backoff_factor"),
    ("scale_window", 0, ValueError, "growth_interval"),
    ("scale_window", -5, ValueError, "growth_interval"),
    ("scale_window", 2 ** 24, ValueError, "growth_interval"),
    ("scale_window", True, TypeError, "growth_interval"),
    ("scale_window", 2000.0, TypeError, "growth_interval"),
    ("hysteresis", 0, ValueError, "hysteresis"),
    ("hysteresis", True, TypeError, "hysteresis"),
    ("hysteresis", 2.0, TypeError, "hysteresis"),
    ("min_loss_scale", 0.0, ValueError, "min_loss_scale"),
    ("min_loss_scale", -1.0, ValueError, "min_loss_scale"),
    ("min_loss_scale", NAN, ValueError, "min_loss_scale"),
    ("min_loss_scale", INF, ValueError, "min_loss_scale"),
    ("min_loss_scale", True, TypeError, "min_loss_scale"),
    ("max_loss_scale", 0.0, ValueError, "max_loss_scale"),
    ("max_loss_scale", NAN, ValueError, "max_loss_scale"),
    ("max_loss_scale", 0.5, ValueError, "max_loss_scale"),  # below the default floor
    ("max_loss_scale", "big", TypeError, "max_loss_scale"),
]
# amp.initialize's names for LossScaler's
INIT_NAME = {"scale_factor": "growth_factor", "scale_window": "growth_interval"}


def _value_text(value):
    return "nan" if isinstance(value, float) and math.isnan(value) else repr(value)


@pytest.mark.parametrize("key,value,error,name", BAD_VALUES,
                         ids=[f"{k}={v!r}" for k, v, _, _ in BAD_VALUES])
def test_loss_scaler_refuses_a_bad_argument_by_name_value_and_fix(key, value, error, name):
    with pytest.raises(error, match=name) as err:
        LossScaler("dynamic", **{key: value})
    msg = str(err.value)
    assert _value_text(value) in msg
    assert "pass" in msg  # the fix


@pytest.mark.parametrize("value,error", [(NAN, ValueError), (0.0, ValueError),
                                         (-1.0, ValueError), (INF, ValueError),
                                         ("128", ValueError), (True, TypeError),
                                         (None, TypeError)])
def test_a_static_scale_is_checked(value, error):
    with pytest.raises(error, match="loss_scale"):
        LossScaler(value)


def test_scaler_clamps_and_accepts_what_is_in_range():
    assert LossScaler(init_scale=2.**20, max_loss_scale=2.**17).loss_scale() == 2.**17
    assert LossScaler(init_scale=0.25, min_loss_scale=0.25).loss_scale() == 0.25
    assert LossScaler(init_scale=np.float32(8.0), max_loss_scale=None).loss_scale() == 8.0
    assert LossScaler(init_scale=torch.tensor(16.0), max_loss_scale=INF).loss_scale() == 16.0
    with pytest.raises(ValueError, match=r"max_loss_scale \(2\.0\) must be >= min_loss_scale"):
        LossScaler(min_loss_scale=4.0, max_loss_scale=2.0)


AMP_BAD = [("init_scale", NAN), ("init_scale", INF), ("init_scale", 0.0), ("init_scale", -2.0),
           ("growth_factor", True), ("growth_interval", True), ("hysteresis", NAN),
           ("backoff_factor", NAN), ("min_loss_scale", NAN), ("max_loss_scale", NAN)]


@pytest.mark.parametrize("initialized_before", [False, True], ids=["fresh", "initialized"])
@pytest.mark.parametrize("key,value", AMP_BAD, ids=[f"{k}={v!r}" for k, v in AMP_BAD])
def test_initialize_refuses_a_bad_scaler_argument_and_changes_nothing(key, value,
                                                                      initialized_before):
    if initialized_before:
        other = tiny(1)
        amp.initialize(other, torch.optim.SGD(other.parameters(), lr=0.1), opt_level="O1",
                       verbosity=1)
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before, globals_before = snapshot(model, opt), amp_globals()
    with pytest.raises((ValueError, TypeError), match=key) as err:
        amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0,
                       **{key: value})
    assert _value_text(value) in str(err.value)
    assert_unchanged(before, snapshot(model, opt))
    now = amp_globals()
    assert now[0] is globals_before[0]
    assert [id(s) for s in now[1]] == [id(s) for s in globals_before[1]]
    assert now[2] == globals_before[2]


def _half_sgd():
    model = tiny().half()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("kwargs,error,name", [
    (dict(static_loss_scale=NAN), ValueError, "static_loss_scale"),
    (dict(static_loss_scale=0.0), ValueError, "static_loss_scale"),
    (dict(static_loss_scale=-8.0), ValueError, "static_loss_scale"),
    (dict(static_loss_scale=INF), ValueError, "static_loss_scale"),
    (dict(static_loss_scale="dynamic"), TypeError, "static_loss_scale"),
    (dict(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": NAN}), ValueError,
     r"dynamic_loss_args\['init_scale'\]"),
    (dict(dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 0}), ValueError,
     r"dynamic_loss_args\['init_scale'\]"),
    (dict(dynamic_loss_scale=True, dynamic_loss_args={"scale_window": True}), TypeError,
     r"dynamic_loss_args\['scale_window'\]"),
    (dict(dynamic_loss_scale=True, dynamic_loss_args={"min_loss_scale": -1.0}), ValueError,
     r"dynamic_loss_args\['min_loss_scale'\]"),
], ids=lambda v: None)
def test_fp16_optimizer_refuses_a_bad_scale_and_leaves_the_optimizer_alone(kwargs, error, name):
    model, opt = _half_sgd()
    before = snapshot(model, opt)
    with pytest.raises(error, match=name):
        FP16_Optimizer(opt, verbose=False, **kwargs)
    assert_unchanged(before, snapshot(model, opt))
    assert all(p.dtype == torch.float16 for g in opt.param_groups for p in g["params"])


def test_legacy_scalers_check_their_scale_under_their_names():
    for value in (NAN, 0, -1.0, INF):
        with pytest.raises(ValueError, match="scale"):
            LegacyLossScaler(value)
        with pytest.raises(ValueError, match="init_scale"):
            DynamicLossScaler(init_scale=value)
    with pytest.raises(TypeError, match="scale"):
        LegacyLossScaler("dynamic")  # a static scaler: not a dynamic one by accident
    with pytest.raises(ValueError, match=r"init_scale \(0\.5\) is below the floor \(1\.0\)"):
        DynamicLossScaler(init_scale=0.5)
    with pytest.raises(TypeError, match="scale_window"):
        DynamicLossScaler(scale_window=True)
    assert DynamicLossScaler(init_scale=2**32).loss_scale == 2.**32  # Apex's default, no ceiling


@pytest.mark.parametrize("config,error,name", [
    (dict(mode="naive", initial_scale=NAN), ValueError, "initial_scale"),
    (dict(mode="naive", initial_scale=0), ValueError, "initial_scale"),
    (dict(mode="naive", initial_scale="1e4"), TypeError, "initial_scale"),
    (dict(mode="naive", init_scale=-1.0), ValueError, "init_scale"),
    (dict(mode="naive", initial_scale=NAN, dynamic_grad_scale=False), ValueError, "initial_scale"),
    (dict(mode="naive", min_scale=0.0), ValueError, "min_scale"),
    (dict(mode="naive", max_scale=NAN), ValueError, "max_scale"),
    (dict(mode="naive", hysteresis=-1), ValueError, "hysteresis"),
    (dict(mode="naive", hysteresis=2.5), TypeError, "hysteresis"),
    (dict(mode="naive", dynamic_grad_scale="yes"), TypeError, "dynamic_grad_scale"),
    (dict(mode="naive", clip_grad_norm=NAN), ValueError, "clip_grad_norm"),
    (dict(mode="apex", init_scale=NAN), ValueError, "init_scale"),
    (dict(mode="torch", init_scale=INF), ValueError, "init_scale"),
    (dict(mode="torch", growth_interval=True), TypeError, "growth_interval"),
], ids=lambda v: None)
def test_convert_to_amp_refuses_a_bad_scale_and_changes_nothing(config, error, name):
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before, globals_before = snapshot(model, opt), amp_globals()
    with pytest.raises(error, match=name):
        convert_to_amp(model, opt, nn.MSELoss(), amp_config=config)
    assert_unchanged(before, snapshot(model, opt))
    assert amp_globals()[0] is globals_before[0]


def test_convert_to_amp_naive_keeps_colossalai_hysteresis_zero():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    convert_to_amp(model, opt, mode="naive", hysteresis=0, half_dtype=torch.bfloat16)
    assert amp_state().loss_scalers[0].hysteresis == 1


# --------------------------------------------------------------------------------------
# 5. amp.load_state_dict
# --------------------------------------------------------------------------------------

def _init(num_losses=2, **kw):
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, opt, opt_level="O0", loss_scale="dynamic", verbosity=1,
                          num_losses=num_losses, **kw)


def _entry(loss_scale, unskipped=0, **extra):
    return dict(loss_scale=loss_scale, unskipped=unskipped, **extra)


def test_entries_are_matched_by_key_not_by_order():
    _init()
    amp.load_state_dict({"loss_scaler1": _entry(8.0, 1), "loss_scaler0": _entry(4.0, 3)})
    sd = amp.state_dict()
    assert (sd["loss_scaler0"]["loss_scale"], sd["loss_scaler0"]["unskipped"]) == (4.0, 3)
    assert (sd["loss_scaler1"]["loss_scale"], sd["loss_scaler1"]["unskipped"]) == (8.0, 1)


BAD_ENTRIES = [  # (entry, error, what the message says)
    (_entry(NAN), ValueError, "'loss_scale' must be a finite number > 0, got nan"),
    (_entry(0.0), ValueError, "'loss_scale' must be a finite number > 0, got 0.0"),
    (_entry(-2.0), ValueError, "'loss_scale' must be a finite number > 0"),
    (_entry(INF), ValueError, "'loss_scale' must be a finite number > 0, got inf"),
    (_entry("1024"), TypeError, "'loss_scale' must be a number"),
    (_entry(True), TypeError, "'loss_scale' must be a number"),
    (_entry(8.0, -1), ValueError, "'unskipped' must be an int >= 0, got -1"),
    (_entry(8.0, 1.5), TypeError, "'unskipped' must be an int"),
    (_entry(8.0, True), TypeError, "'unskipped' must be an int"),
    (_entry(8.0, hysteresis=-1), ValueError, "'hysteresis' must be an int >= 0"),
    (_entry(8.0, skipped=-3), ValueError, "'skipped' must be an int >= 0"),
    (_entry(8.0, floor_streak=2.0), TypeError, "'floor_streak' must be an int"),
    (_entry(8.0, floor_warned="no"), TypeError, "'floor_warned' must be a bool"),
    (_entry(8.0, dynamic=1), TypeError, "'dynamic' must be a bool"),
    (_entry(8.0, scale=2.0), RuntimeError, 'Unexpected key\\(s\\): "scale"'),
    ({"loss_scale": 8.0}, RuntimeError, 'Missing key\\(s\\): "unskipped"'),
    ([8.0, 0], TypeError, "must be a dict"),
]


@pytest.mark.parametrize("entry,error,msg", BAD_ENTRIES, ids=lambda v: None)
def test_a_bad_entry_is_refused_before_any_scaler_changes(entry, error, msg):
    _init()
    before = scaler_bits()
    # the good entry comes first: loading entry by entry would have changed scaler 0
    with pytest.raises(error, match=msg) as err:
        amp.load_state_dict({"loss_scaler0": _entry(2.0, 7, skipped=3),
                             "loss_scaler1": entry})
    assert "loss_scaler1" in str(err.value)
    assert_scalers_unchanged(before)


@pytest.mark.parametrize("state_dict,error,msg", [
    ({"loss_scalerX": _entry(2.0)}, RuntimeError, 'Unexpected key\\(s\\) in state_dict: "loss_scalerX"'),
    ({"loss_scaler01": _entry(2.0)}, RuntimeError, "Unexpected key"),
    ({"optimizer": {}}, RuntimeError, "Unexpected key"),
    ([("loss_scaler0", _entry(2.0))], TypeError, "amp.load_state_dict expects"),
], ids=["not-a-number", "leading-zero", "other-key", "not-a-dict"])
def test_a_bad_state_dict_is_refused_whole(state_dict, error, msg):
    _init()
    before = scaler_bits()
    if isinstance(state_dict, dict):
        state_dict = {"loss_scaler0": _entry(2.0), **state_dict}
    with pytest.raises(error, match=msg):
        amp.load_state_dict(state_dict)
    assert_scalers_unchanged(before)


def test_extra_and_missing_entries_as_in_apex(caplog):
    _init(num_losses=2)
    caplog.set_level(logging.INFO, logger="tritamp.amp")
    before1 = amp.state_dict()["loss_scaler1"]
    # no loss_scaler1: it keeps its state; loss_scaler3 does not exist: skipped, by key
    amp.load_state_dict({"loss_scaler3": _entry(NAN), "loss_scaler0": _entry(16.0, 2)})
    sd = amp.state_dict()
    assert sd["loss_scaler0"]["loss_scale"] == 16.0 and sd["loss_scaler1"] == before1
    text = [r.getMessage() for r in caplog.records]
    assert "Skipping loss_scaler[3], since num_losses was set to 2" in text
    caplog.clear()
    amp.load_state_dict({"loss_scaler1": _entry(32.0)})
    assert amp.state_dict()["loss_scaler1"]["loss_scale"] == 32.0
    assert "Warning: state_dict contains 1 entries, while 2 loss_scalers are used" in \
        [r.getMessage() for r in caplog.records]


def test_an_apex_checkpoint_loads_with_fresh_optional_state():
    _init(num_losses=1, hysteresis=3)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7}})
    sd = amp.state_dict()["loss_scaler0"]
    assert sd == dict(loss_scale=1024.0, unskipped=7, hysteresis=3, dynamic=True, skipped=0,
                      floor_streak=0, floor_warned=False)


def test_a_dynamic_scale_outside_the_clamps_is_brought_inside():
    _init(num_losses=1, min_loss_scale=2.0, max_loss_scale=2.**10)
    amp.load_state_dict({"loss_scaler0": _entry(2.**20)})
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.**10
    amp.load_state_dict({"loss_scaler0": _entry(0.5)})
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0


def test_fp16_optimizer_refuses_a_bad_scaler_state_before_loading_anything():
    model, opt = _half_sgd()
    opt = FP16_Optimizer(opt, dynamic_loss_scale=True, verbose=False)
    sd = opt.state_dict()
    model2, opt2 = _half_sgd()
    opt2 = FP16_Optimizer(opt2, static_loss_scale=4.0, verbose=False)
    with torch.no_grad():
        for m in opt2.fp32_from_fp16_groups[0]:
            m.add_(1.0)
    masters = [m.detach().clone() for m in opt2.fp32_from_fp16_groups[0]]
    bad = dict(sd, loss_scaler=dict(sd["loss_scaler"], loss_scale=NAN))
    with pytest.raises(ValueError, match=r"state_dict\['loss_scaler'\]: 'loss_scale'"):
        opt2.load_state_dict(bad)
    assert opt2.dynamic_loss_scale is False and opt2.loss_scale == 4.0
    for a, b in zip(masters, opt2.fp32_from_fp16_groups[0]):
        assert_bits_equal(a, b.detach())


def test_convert_to_amp_optimizer_refuses_a_bad_amp_entry_before_loading_its_own_state():
    model = tiny()
    model, opt, _ = convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                          momentum=0.9),
                                   mode="apex", opt_level="O0", loss_scale="dynamic",
                                   verbosity=0)
    x = torch.randn(4, 3)

    def step():
        opt.zero_grad()
        opt.backward(model(x).sum())
        opt.step()

    step()
    saved = copy.deepcopy(opt.state_dict())
    step()
    before, scalers = snapshot(model, opt.optim), scaler_bits()
    saved["amp"]["loss_scaler0"]["unskipped"] = -1
    with pytest.raises(ValueError, match="'unskipped' must be an int >= 0, got -1"):
        opt.load_state_dict(saved)
    assert_unchanged(before, snapshot(model, opt.optim))  # step 2's momentum, not step 1's
    assert_scalers_unchanged(scalers)


# -- the floor streak survives a checkpoint -------------------------------------------------

def _floor_run(steps, save_at=None, resume=None):
    """Overflowing steps at O0 from a scale of 4 with a floor of 1; returns the steps at
    which the floor warning came, amp's state dict at ``save_at`` and at the end."""
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O0", loss_scale="dynamic",
                                init_scale=4.0, min_loss_scale=1.0, verbosity=0)
    first = 0
    if resume is not None:
        amp.load_state_dict(copy.deepcopy(resume))
        first = save_at
    x = torch.randn(4, 3)
    warned, saved = [], None
    for i in range(first, steps):
        if i == save_at and resume is None:
            saved = copy.deepcopy(amp.state_dict())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with amp.scale_loss(model(x).float().sum() * INF, opt) as scaled:
                scaled.backward()
            opt.step()
        if any(issubclass(w.category, RuntimeWarning) and "floor" in str(w.message)
               for w in caught):
            warned.append(i)
    return warned, saved, amp.state_dict()


@pytest.mark.parametrize("save_at", [3, FLOOR_WARN_STEPS - 1, FLOOR_WARN_STEPS + 2])
def test_a_resumed_run_warns_about_the_floor_at_the_same_step(save_at):
    steps = FLOOR_WARN_STEPS + 6
    want, saved, want_end = _floor_run(steps, save_at=save_at)
    assert len(want) == 1  # one warning, once the streak reaches FLOOR_WARN_STEPS
    assert saved["loss_scaler0"]["floor_streak"] == save_at - 1  # at the floor from step 1
    amp_state().opt_properties = None
    got, _, got_end = _floor_run(steps, save_at=save_at, resume=saved)
    # before the save the warning belongs to the first run; after it, to both
    assert got == [i for i in want if i >= save_at]
    assert got_end == want_end


# --------------------------------------------------------------------------------------
# 7. a skipped first step leaves no state in torch's optimizers
# --------------------------------------------------------------------------------------

TORCH_OPTS = {
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "sgd-fused-dampening": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.5,
                                                     nesterov=False, fused=True),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=0.1, fused=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=0.1, fused=True, amsgrad=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "tritamp-fused-sgd": lambda p: FusedSGD(p, lr=0.1, momentum=0.9),
}


def _run_torch_opt(make_opt, level, overflow_first):
    model = tiny(n_in=4, n_out=3)
    opt = make_opt(model.parameters())
    # the run that overflows starts at twice the scale: its clean steps use the same one
    model, opt = amp.initialize(model, opt, opt_level=level, loss_scale="dynamic",
                                half_dtype=torch.bfloat16, verbosity=0,
                                init_scale=16.0 if overflow_first else 8.0)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 4, generator=g) for _ in range(2)]
    flags = ([True] if overflow_first else []) + [False, False]
    for i, bad in enumerate(flags):
        x = batches[0] if bad else batches[i - (1 if overflow_first else 0)]
        opt.zero_grad()
        loss = model(x).float().square().sum()
        hook = model.weight.register_hook(lambda grad: grad * INF) if bad else None
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        hook is not None and hook.remove()
        opt.step()
        if bad and not isinstance(opt, FusedSGD) and type(opt) not in (torch.optim.Adam,
                                                                          torch.optim.AdamW):
            assert len(opt.state) == 0, "the skipped step left state behind"
    sd = opt.state_dict()
    state = [v for i in sorted(sd["state"]) for k, v in sorted(sd["state"][i].items())]
    return [p.detach().clone() for p in model.parameters()] + \
        [m.detach().clone() for m in amp.master_params(opt)], state


@pytest.mark.parametrize("level", ["O0", "O2"])
@pytest.mark.parametrize("name", list(TORCH_OPTS))
def test_a_skipped_first_step_is_as_if_it_never_happened(name, level):
    got, got_state = _run_torch_opt(TORCH_OPTS[name], level, overflow_first=True)
    amp_state().opt_properties = None
    want, want_state = _run_torch_opt(TORCH_OPTS[name], level, overflow_first=False)
    for a, b in zip(want, got):
        assert torch.isfinite(a).all()
        assert_bits_equal(a, b)
    assert len(want_state) == len(got_state)
    for a, b in zip(want_state, got_state):
        if isinstance(a, torch.Tensor):
            assert_bits_equal(a, b)
        else:
            assert a == b


class HostReads(torch.overrides.TorchFunctionMode):
    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
             torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.cpu}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name,first_reads", [
    ("sgd-fused", ["__bool__"]), ("adam-fused", []), ("tritamp-fused-sgd", [])])
def test_only_a_step_that_creates_torch_state_reads_the_flag(name, first_reads):
    model = tiny()
    model, opt = amp.initialize(model, TORCH_OPTS[name](model.parameters()), opt_level="O0",
                                loss_scale="dynamic", verbosity=0)
    x = torch.randn(4, 3)
    reads = []
    for _ in range(3):
        opt.zero_grad()
        with amp.scale_loss(model(x).float().sum(), opt) as scaled:
            scaled.backward()
        counter = HostReads()
        with counter:
            opt.step()
        reads.append(counter.calls)
    assert reads == [first_reads, [], []]


# --------------------------------------------------------------------------------------
# 11. an overflow skips every optimizer of the scale_loss
# --------------------------------------------------------------------------------------

KINDS = {
    "tritamp-fused": lambda p: FusedSGD(p, lr=0.1, momentum=0.9),
    "torch-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "torch": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
}
SCENARIOS = ["one-loss", "two-backwards-one-scaler", "two-scalers"]


def _two_opts(kind, num_losses):
    a, b = tiny(0), tiny(1)
    oa, ob = KINDS[kind](a.parameters()), KINDS[kind](b.parameters())
    [a, b], [oa, ob] = amp.initialize([a, b], [oa, ob], opt_level="O0", loss_scale="dynamic",
                                      init_scale=16.0, num_losses=num_losses, verbosity=0)
    return a, b, oa, ob


def _backward(scenario, a, b, opts, x, poison_b):
    """The step's backward(s); with poison_b, b's weight gradient (owned by opt b only)
    holds inf in the last one."""
    hook = b.weight.register_hook(lambda g: g * INF) if poison_b else None
    try:
        if scenario == "one-loss":
            with amp.scale_loss(a(x).sum() + b(x).sum(), opts) as s:
                s.backward()
        else:
            loss_id = 1 if scenario == "two-scalers" else 0
            hook.remove() if hook is not None else None
            with amp.scale_loss(a(x).sum() + b(x).sum(), opts, loss_id=0) as s:
                s.backward()  # clean
            hook = b.weight.register_hook(lambda g: g * INF) if poison_b else None
            with amp.scale_loss(b(x).sum(), opts, loss_id=loss_id) as s:
                s.backward()  # the overflow, in b only
    finally:
        if hook is not None:
            hook.remove()


def _state_of(model, opt):
    return [p.detach().clone() for p in model.parameters()] + \
        [t.clone() for st in opt.state.values() for t in st.values()
         if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("order", [0, 1], ids=["a-first", "b-first"])
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_an_overflow_in_one_optimizer_skips_every_optimizer_of_the_scale_loss(kind, scenario,
                                                                              order):
    a, b, oa, ob = _two_opts(kind, 2 if scenario == "two-scalers" else 1)
    opts = [oa, ob] if order == 0 else [ob, oa]
    x = torch.randn(4, 3)
    for o in (oa, ob):  # a clean step first: momentum buffers exist
        o.zero_grad()
    _backward(scenario, a, b, opts, x, poison_b=False)
    oa.step()
    ob.step()
    before_a, before_b = _state_of(a, oa), _state_of(b, ob)
    for o in (oa, ob):
        o.zero_grad()
    _backward(scenario, a, b, opts, x, poison_b=True)
    oa.step()
    ob.step()
    for want, got in ((before_a, _state_of(a, oa)), (before_b, _state_of(b, ob))):
        assert len(want) == len(got)
        for w, g in zip(want, got):
            assert_bits_equal(w, g)
    # and the step after is a normal one for both
    for o in (oa, ob):
        o.zero_grad()
    _backward(scenario, a, b, opts, x, poison_b=False)
    oa.step()
    ob.step()
    assert not torch.equal(before_a[0], a.weight.detach())
    assert not torch.equal(before_b[0], b.weight.detach())


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_optimizer_outside_the_overflowing_scale_loss_still_steps(kind):
    a, b, oa, ob = _two_opts(kind, 2)
    x = torch.randn(4, 3)
    before_a, before_b = _state_of(a, oa), _state_of(b, ob)
    with amp.scale_loss(a(x).sum(), oa, loss_id=0) as s:
        s.backward()
    hook = b.weight.register_hook(lambda g: g * INF)
    with amp.scale_loss(b(x).sum(), ob, loss_id=1) as s:
        s.backward()
    hook.remove()
    oa.step()
    ob.step()
    assert not torch.equal(before_a[0], a.weight.detach())
    for w, g in zip(before_b, _state_of(b, ob)):
        assert_bits_equal(w, g)


# --------------------------------------------------------------------------------------
# scale_loss misuse
# --------------------------------------------------------------------------------------

def test_scale_loss_before_initialize_says_so_and_changes_nothing():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = snapshot(model, opt)
    loss = model(torch.randn(2, 3)).sum()
    ran = []
    with pytest.raises(RuntimeError, match=r"amp.initialize\(model, optimizer, "
                       r"opt_level=\.\.\.\) must be called before `with amp.scale_loss`"):
        with amp.scale_loss(loss, opt) as scaled:
            ran.append(scaled)
    assert ran == []
    assert all(p.grad is None for p in model.parameters())
    assert_unchanged(before, snapshot(model, opt))
    assert amp_state().opt_properties is None and amp_state().loss_scalers == []


@pytest.mark.parametrize("loss_id,error", [(True, TypeError), (0.0, TypeError), ("0", TypeError),
                                           (2, ValueError), (-1, ValueError)])
def test_scale_loss_refuses_a_bad_loss_id_and_changes_nothing(loss_id, error):
    model, opt = _init(num_losses=2)
    before, scalers = snapshot(model, opt), scaler_bits()
    loss = model(torch.randn(2, 3)).sum()
    with pytest.raises(error, match="loss_id"):
        with amp.scale_loss(loss, opt, loss_id=loss_id):
            pass
    assert all(p.grad is None for p in model.parameters())
    assert_unchanged(before, snapshot(model, opt))
    assert_scalers_unchanged(scalers)


class _SparseNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(5, 3, sparse=True)
        self.lin = nn.Linear(3, 2)

    def forward(self, idx):
        return self.lin(self.emb(idx))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_sparse_gradient_of_a_torch_optimizer_is_refused_before_anything_changes(level):
    model = _SparseNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    idx = torch.tensor([1, 3])
    model.emb.weight.requires_grad_(False)
    with amp.scale_loss(model(idx).float().sum(), opt) as scaled:  # a dense step first
        scaled.backward()
    opt.step()
    model.emb.weight.requires_grad_(True)
    opt.zero_grad()
    before, scalers = snapshot(model, opt), scaler_bits()
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    with pytest.raises(RuntimeError, match="amp does not support sparse gradients"):
        with amp.scale_loss(model(idx).float().sum(), opt) as scaled:
            scaled.backward()
    assert_unchanged(before, snapshot(model, opt))
    assert_scalers_unchanged(scalers)
    for a, m in zip(masters, amp.master_params(opt)):
        assert_bits_equal(a, m.detach())
        if level == "O2":  # the fp32 masters: no gradient buffer handed out
            assert m.grad is None


def test_every_order_of_three_optimizers_skips_together():
    # itertools over the orders of three fused optimizers, one loss
    for perm in itertools.permutations(range(3)):
        amp_state().opt_properties = None
        models = [tiny(i) for i in range(3)]
        opts = [FusedSGD(m.parameters(), lr=0.1) for m in models]
        models, opts = amp.initialize(models, opts, opt_level="O0", loss_scale="dynamic",
                                      init_scale=16.0, verbosity=0)
        x = torch.randn(2, 3)
        before = [m.weight.detach().clone() for m in models]
        with amp.scale_loss(sum(m(x).sum() for m in models[:2]), [opts[i] for i in perm]) as s:
            s.backward()
        with amp.scale_loss(models[2](x).sum() * INF, [opts[i] for i in perm]) as s:
            s.backward()
        for o in opts:
            o.step()
        for b, m in zip(before, models):
            assert torch.equal(b, m.weight.detach()), perm


# -- a loss on a device the scaler cannot follow it to -------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_loss_on_the_meta_device_is_refused_and_the_scaler_stays_usable(level):
    # The scaler's state followed the loss to its device before anything was checked: a
    # meta loss left it on the meta device, and every later scale_loss, step and
    # amp.state_dict() raised.
    model, opt = amp.initialize(tiny(), torch.optim.SGD(tiny().parameters(), lr=0.1),
                                opt_level=level, half_dtype=torch.bfloat16, loss_scale="dynamic",
                                verbosity=0)
    before = amp.state_dict()
    with pytest.raises(ValueError, match=r"scale_loss: the loss is on the meta device, which "
                                         r"holds no data"):
        with amp.scale_loss(torch.ones((), device="meta", requires_grad=True), opt) as s:
            s.backward()
    assert amp.state_dict() == before
    with amp.scale_loss(model(torch.ones(4, 3)).float().sum(), opt) as s:
        s.backward()
    opt.step()  # (usable: on the CPU again)


def test_fp16_optimizer_and_the_legacy_scalers_refuse_a_meta_loss_or_flag_unchanged():
    model = nn.Linear(3, 2).to(torch.bfloat16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                         verbose=False)
    with pytest.raises(ValueError, match=r"FP16_Optimizer.backward: the loss is on the meta"):
        opt.backward(torch.ones((), device="meta", requires_grad=True))
    opt.backward(model(torch.ones(4, 3, dtype=torch.bfloat16)).float().sum())
    opt.step()
    for scaler in (DynamicLossScaler(), LegacyLossScaler(4.0)):
        scale = scaler.loss_scale
        with pytest.raises(ValueError, match=r"LossScaler.backward: the loss is on the meta"):
            scaler.backward(torch.ones((), device="meta", requires_grad=True))
        if isinstance(scaler, DynamicLossScaler):  # (a static scaler's update does nothing)
            with pytest.raises(ValueError, match=r"update_scale: overflow is on the meta"):
                scaler.update_scale(torch.ones((), device="meta"))
        assert scaler.loss_scale == scale


def test_the_scaler_follows_a_loss_only_to_a_device_its_parameters_are_on():
    # (a CPU machine has one real device: the scaler's state is put on the meta device to
    # stand for the other one, where a model was moved after set-up)
    scaler = LossScaler("dynamic")
    params = [nn.Parameter(torch.ones(2, device="meta"))]
    scaler._state = scaler._state.to("meta")
    with pytest.raises(ValueError, match=r"who: the loss is on cpu but the parameters are on "
                                         r"meta; compute the loss on their device"):
        scaler.follow_loss(torch.ones(()), params, "who")
    assert scaler._state.device.type == "meta"
