"""convert_to_amp: ColossalAI's three modes mapped onto tritamp's policy and scaler.

"torch" mode is checked step for step against torch.autocast + torch.amp.GradScaler
(what ColossalAI's TorchAMP ran); "naive" against its scaler's hysteresis rule and its
in-step clipping; "apex" against amp.initialize's options; and the calling conventions
ColossalAI used (AMP_TYPE enum, amp_config dict, fp16=dict(mode=...))."""
import enum

import pytest
import torch
import torch.nn as nn

import tritamp
from tritamp import amp, convert_to_amp
from tritamp.testing import amp_state
from tritamp.convert import AmpOptimizer, AutocastLoss


class AMP_TYPE(enum.Enum):  # ColossalAI's enum, as a config file would import it
    APEX = "apex"
    TORCH = "torch"
    NAIVE = "naive"


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _batches(n_steps, n=8):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)) for _ in range(n_steps)]


def _train(model, opt, crit, batches, blowups=None):
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = crit(model(x), y) * (blowups[i] if blowups else 1.0)
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_convert_to_amp_is_exported():
    assert "convert_to_amp" in tritamp.__all__
    assert tritamp.convert_to_amp is convert_to_amp


def _grad_scaler_run(cfg, batches, blowups, momentum=0.0):
    """The reference: torch.autocast (bf16) and torch.amp.GradScaler(**cfg) over SGD.
    Returns the model, the scale and the weights after each step."""
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=momentum)
    scaler = torch.amp.GradScaler("cpu", **cfg)
    scales, weights = [], []
    for batch, blowup in zip(batches, blowups):
        ref_opt.zero_grad()
        # a step's batch, or a list of micro-batches (each blowup then a list too)
        micro = batch if isinstance(batch, list) else [batch]
        for (x, y), blow in zip(micro, blowup if isinstance(batch, list) else [blowup]):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(ref(x), y) * blow
            scaler.scale(loss).backward()
        scaler.step(ref_opt)
        scaler.update()
        scales.append(scaler.get_scale())
        weights.append([p.detach().clone() for p in ref.parameters()])
    return ref, scales, weights


def test_torch_mode_matches_autocast_and_grad_scaler_step_for_step():
    """ColossalAI's TorchAMP: forward and loss under autocast, torch.amp.GradScaler with
    the config's settings. tritamp's O1 and device-side scaler give the same weights and
    scale at every step, through a skipped step."""
    cfg = dict(init_scale=2.**10, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)
    blowups = [1.0, float("inf"), 1.0, 1.0, 1.0]
    batches = _batches(len(blowups))

    ref, ref_scales, ref_weights = _grad_scaler_run(cfg, batches, blowups, momentum=0.9)

    model = _net()
    model, opt, crit = convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      nn.MSELoss(), mode="torch", half_dtype=torch.bfloat16, **cfg)
    assert isinstance(opt, AmpOptimizer) and isinstance(crit, AutocastLoss)
    assert amp_state().opt_properties.opt_level == "O1"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for step, ((x, y), blowup) in enumerate(zip(batches, blowups)):
        _train(model, opt, crit, [(x, y)], [blowup])
        assert opt.loss_scale == ref_scales[step], step
        for a, b in zip(model.parameters(), ref_weights[step]):
            assert torch.equal(a, b), step
    assert ref_scales == [2.**10, 2.**8, 2.**8, 2.**10, 2.**10]  # the config was honoured


def test_torch_mode_takes_a_lower_floor_and_follows_grad_scaler_below_one():
    """GradScaler's scale has no floor; torch mode's is 1.0 unless min_loss_scale says
    otherwise, which torch mode refused as an unknown key."""
    cfg = dict(init_scale=2.0, backoff_factor=0.25, growth_interval=100)
    blowups = [float("inf"), float("inf"), 1.0]
    batches = _batches(len(blowups))
    ref, ref_scales, _ = _grad_scaler_run(cfg, batches, blowups)
    model = _net()
    model, opt, crit = convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      nn.MSELoss(), mode="torch", half_dtype=torch.bfloat16,
                                      min_loss_scale=2.**-24, **cfg)
    scales = []
    for (x, y), blowup in zip(batches, blowups):
        _train(model, opt, crit, [(x, y)], [blowup])
        scales.append(opt.loss_scale)
    assert scales == ref_scales == [0.5, 0.125, 0.125]
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_torch_mode_disabled_changes_nothing():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.MSELoss()
    m, o, c = convert_to_amp(model, opt, crit, mode="torch", enabled=False)
    assert m is model and o.optim is opt and c is crit
    (x, y), = _batches(1)
    loss = c(m(x), y)
    assert loss.dtype == torch.float32
    o.backward(loss)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_naive_mode_is_O2_with_a_half_batchnorm_fp32_masters_and_hysteresis():
    model = _net()
    model, opt, crit = convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      nn.MSELoss(), mode="naive", initial_scale=2.**8)
    assert isinstance(crit, nn.MSELoss)
    assert all(p.dtype == torch.float16 for p in model.parameters())  # model.half(), as ColossalAI
    assert all(m.dtype == torch.float32 for m in amp.master_params(opt.optim))
    scaler = amp_state().loss_scalers[0]
    assert (scaler.hysteresis, scaler.growth_interval, scaler.growth_factor,
            scaler.backoff_factor) == (2, 1000, 2.0, 0.5)
    assert scaler.max_loss_scale == float("inf")
    assert amp_state().verbosity == 0  # ColossalAI's naive optimizer logs only when verbose

    batches = _batches(4)
    blowups = [1.0, float("inf"), float("inf"), 1.0]
    scales = []
    for (x, y), blowup in zip(batches, blowups):
        before = [m.detach().clone() for m in amp.master_params(opt.optim)]
        _train(model, opt, crit, [(x, y)], [blowup])
        after = list(amp.master_params(opt.optim))
        assert all(torch.equal(a, b) for a, b in zip(before, after)) == (blowup != 1.0)
        scales.append(opt.loss_scale)
    # the first overflow is tolerated, the second backs off (ColossalAI's DynamicGradScaler)
    assert scales == [2.**8, 2.**8, 2.**7, 2.**7]


def test_naive_mode_static_scale_and_batchnorm_override():
    model = _net()
    model, opt, _ = convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1), None,
                                   mode="naive", dynamic_grad_scale=False, initial_scale=32.0,
                                   keep_batchnorm_fp32=True, half_dtype=torch.bfloat16)
    assert opt.loss_scale == 32.0
    assert [p.dtype for p in model[1].parameters()] == [torch.float32] * 2
    assert model[0].weight.dtype == torch.bfloat16


def test_naive_mode_with_a_constant_scale_still_skips_an_overflowing_step():
    """dynamic_grad_scale=False is ColossalAI's ConstantGradScaler: the scale stays, and
    the naive optimizer still checks every step. It became a static loss_scale, which amp
    does not check: the overflow's inf/NaN went into the weights and the moments."""
    batches = _batches(4)
    blowups = [1.0, float("inf"), 1.0, float("inf")]
    model = _net()
    model, opt, _ = convert_to_amp(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                                   None, mode="naive", dynamic_grad_scale=False,
                                   initial_scale=32.0, half_dtype=torch.bfloat16)
    crit = nn.MSELoss()
    for (x, y), blowup in zip(batches, blowups):
        before = [p.detach().clone() for p in model.parameters()]
        state = {k: v.clone() for s in opt.state.values() for k, v in s.items()
                 if torch.is_tensor(v)}
        _train(model, opt, crit, [(x, y)], [blowup])
        now = list(model.parameters())
        assert all(torch.isfinite(p).all() for p in now)
        if blowup != 1.0:
            assert amp.last_step_skipped(opt.optim)
            assert all(torch.equal(a, b) for a, b in zip(before, now))
            assert all(torch.equal(v, {k: w for s in opt.state.values()
                                       for k, w in s.items()}[k]) for k, v in state.items())
        assert opt.loss_scale == 32.0


@pytest.mark.parametrize("mode", ["torch", "naive"])
def test_accumulated_backward_passes_move_the_scale_once_per_step(mode):
    """Two backward passes per step (ColossalAI's gradient accumulation): GradScaler and
    ColossalAI's naive optimizer check, unscale and move the scale at the step. The scale
    moved at every backward: growth counted micro-batches (torch: 4096, 16384, ...
    against GradScaler's 2048, 4096, ...), and a step of two overflowing micro-batches
    counted two overflows against hysteresis (naive: 128 where ColossalAI keeps 256)."""
    g = torch.Generator().manual_seed(5)
    micro = [[(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g))
              for _ in range(2)] for _ in range(4)]
    blowups = [[1.0, 1.0], [1.0, float("inf")], [float("inf"), float("inf")], [1.0, 1.0]]
    if mode == "torch":
        cfg = dict(init_scale=2.**10, growth_interval=1)
        _, want_scales, want_weights = _grad_scaler_run(cfg, micro, blowups)
        kwargs = dict(mode="torch", half_dtype=torch.bfloat16, **cfg)
    else:
        # ColossalAI's DynamicGradScaler, counted once per step: hysteresis 2 backs off
        # at the second overflowing step, growth after 1000 clean ones
        want_scales = [256.0, 256.0, 128.0, 128.0]
        want_weights = None
        kwargs = dict(mode="naive", initial_scale=256.0, hysteresis=2,
                      half_dtype=torch.bfloat16)
    model = _net()
    model, opt, crit = convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      nn.MSELoss(), **kwargs)
    for step, (batches, blows) in enumerate(zip(micro, blowups)):
        opt.zero_grad()
        for (x, y), blow in zip(batches, blows):
            opt.backward(crit(model(x), y) * blow)
        opt.step()
        assert opt.loss_scale == want_scales[step], (step, opt.loss_scale)
        if want_weights is not None:
            for a, b in zip(model.parameters(), want_weights[step]):
                assert torch.equal(a, b), step


def test_naive_mode_clips_the_master_gradients_inside_step():
    """clip_grad_norm in the config clips during step(), exactly as clipping by hand."""
    batches = _batches(2)
    results = []
    for configured in (True, False):
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        extra = dict(clip_grad_norm=0.05) if configured else {}
        model, opt, crit = convert_to_amp(model, opt, nn.MSELoss(), mode="naive",
                                          half_dtype=torch.bfloat16, **extra)
        for x, y in batches:
            opt.zero_grad()
            opt.backward(crit(model(x), y))
            if configured:
                assert opt.clip_grad_norm(model, 0.05) is None  # the same value: step clips
                with pytest.raises(RuntimeError, match="clips gradients during step"):
                    opt.clip_grad_norm(model, 1.0)
            else:
                norm = opt.clip_grad_norm(model, 0.05)
                assert float(norm) > 0.05  # the clip did something
            opt.step()
        results.append([m.detach().clone() for m in amp.master_params(opt.optim)])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_apex_mode_passes_amp_initialize_options_through():
    model = _net()
    m, o, c = convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss())
    assert amp_state().opt_properties.opt_level == "O1"  # apex.amp.initialize's default
    assert all(p.dtype == torch.float32 for p in m.parameters())

    model = _net()
    m, o, c = convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(),
                             mode="apex", opt_level="O2", half_dtype=torch.bfloat16,
                             loss_scale=128.0, verbosity=0)
    props = amp_state().opt_properties
    assert props.opt_level == "O2" and props.master_weights and props.keep_batchnorm_fp32
    assert m[0].weight.dtype == torch.bfloat16 and m[1].weight.dtype == torch.float32
    assert o.loss_scale == 128.0
    losses = _train(m, o, c, _batches(1) * 4)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("mode", ["apex", "torch", "naive"])
def test_every_mode_trains_and_checkpoints_its_scaler(mode):
    model = _net()
    model, opt, crit = convert_to_amp(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                                      nn.MSELoss(), mode=mode, half_dtype=torch.bfloat16,
                                      init_scale=2.**12, growth_interval=2)
    losses = _train(model, opt, crit, _batches(1) * 3)
    assert losses[-1] < losses[0]
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups", "amp"}
    # apex mode keeps amp's bf16 default (a static 1.0); the others scale dynamically and
    # grew once after two clean steps
    assert sd["amp"]["loss_scaler0"]["loss_scale"] == (1.0 if mode == "apex" else 2.**13)
    amp_state().loss_scalers[0].load_state_dict({"loss_scale": 4.0, "unskipped": 0})
    opt.load_state_dict(sd)
    assert opt.loss_scale == sd["amp"]["loss_scaler0"]["loss_scale"]


def test_colossalai_calling_conventions():
    # colossalai.legacy.initialize: mode popped from the fp16 config, the rest as amp_config
    model = _net()
    _, _, _ = convert_to_amp(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             criterion=nn.MSELoss(), mode=AMP_TYPE.NAIVE,
                             amp_config=dict(initial_scale=2.**5, verbose=True))
    assert amp_state().opt_properties.opt_level == "O2" and amp_state().verbosity == 1
    assert float(amp_state().loss_scalers[0].scale) == 2.**5
    # a config file's fp16 dict, mode included, passed as it is
    fp16 = dict(mode=AMP_TYPE.TORCH, init_scale=2.**7, growth_factor=2.0, backoff_factor=0.5,
                growth_interval=100, hysteresis=2)
    model = _net()
    _, opt, crit = convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  nn.MSELoss(), **fp16)
    assert isinstance(crit, AutocastLoss) and opt.loss_scale == 2.**7
    assert amp_state().loss_scalers[0].hysteresis == 2
    model = _net()
    convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   amp_config=dict(mode="naive"), mode=AMP_TYPE.NAIVE)
    assert amp_state().opt_properties.opt_level == "O2"


def test_refusals_name_the_fix():
    def fresh():
        model = _net()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    with pytest.raises(TypeError, match="initial_scale"):
        convert_to_amp(*fresh(), mode="naive", min_loss_scale=1.0)
    with pytest.raises(TypeError, match="opt_level"):
        convert_to_amp(*fresh(), mode="torch", opt_level="O2")
    with pytest.raises(ValueError, match="mode must be one of"):
        convert_to_amp(*fresh(), mode="bf16")
    with pytest.raises(ValueError, match="pass one of them"):
        convert_to_amp(*fresh(), mode="torch", amp_config=dict(mode="naive"))
    with pytest.raises(TypeError, match="not both"):
        convert_to_amp(*fresh(), mode="naive", initial_scale=2., init_scale=4.)
    model, opt = fresh()
    with pytest.raises(TypeError, match="amp.initialize directly"):
        convert_to_amp(model, [opt], mode="apex")
    # a truthy string is not a switch
    with pytest.raises(TypeError, match="enabled must be True or False, got str 'False'"):
        convert_to_amp(*fresh(), mode="torch", enabled="False")
    with pytest.raises(TypeError, match="verbose must be True or False, got str 'no'"):
        convert_to_amp(*fresh(), mode="naive", verbose="no")
    for bad in (["mode", "naive"], "naive"):
        with pytest.raises(TypeError, match="amp_config must be a dict"):
            convert_to_amp(*fresh(), amp_config=bad)
    model, opt = fresh()
    model, converted, _ = convert_to_amp(model, opt, mode="torch")
    with pytest.raises(TypeError, match="already returned"):
        convert_to_amp(model, converted, mode="torch")
