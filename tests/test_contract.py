"""The step contract (tritamp.contract): the handoff object on its own, and both drivers
(tritamp.amp, torch.amp.GradScaler) going through it to tritamp's fused optimizers."""
import pytest
import torch

from tritamp.contract import MasterPairs, StepHandoff, StepState, handoff_of


def test_a_new_handoff_is_ready_and_empty():
    h = StepHandoff()
    assert h.state is StepState.READY
    assert (h.grad_scale, h.found_inf, h.write_grads, len(h.masters)) == (None, None, False, 0)
    assert h.skipped is None


def test_hand_checks_what_each_state_needs():
    h = StepHandoff()
    with pytest.raises(TypeError, match="SCALED needs grad_scale"):
        h.hand(StepState.SCALED)
    with pytest.raises(ValueError, match="UNSCALED gradients carry no scale"):
        h.hand(StepState.UNSCALED, grad_scale=torch.ones(()))
    with pytest.raises(ValueError, match="hands StepState.SCALED or StepState.UNSCALED"):
        h.hand(StepState.STEPPED)
    with pytest.raises(TypeError, match="found_inf must be a device tensor"):
        h.hand(StepState.UNSCALED, found_inf=1.0)
    assert h.state is StepState.READY  # every refusal left it as it was


def test_a_driver_handoff_is_taken_as_handed_and_reported_back():
    h = StepHandoff()
    scale, found = torch.full((), 8.0), torch.zeros(())
    h.hand(StepState.SCALED, grad_scale=scale, found_inf=found)

    class Opt:  # torch's attributes, if present, do not override a driver's handoff
        grad_scale = torch.full((), 2.0)
        found_inf = None
    state, gs, fi, wg = h.take(Opt())
    assert state is StepState.SCALED and gs is scale and fi is found and wg is False
    assert h.skipped is None  # not yet stepped
    h.stepped()
    assert h.state is StepState.STEPPED and h.skipped is found
    h.reset()
    assert h.state is StepState.READY and h.found_inf is None and h.grad_scale is None


def test_torchs_protocol_is_turned_into_a_handoff():
    h = StepHandoff()

    class Opt:
        pass
    opt = Opt()
    assert h.take(opt) == (StepState.READY, None, None, False)
    opt.grad_scale, opt.found_inf = torch.full((), 4.0), torch.zeros(())
    state, gs, fi, wg = h.take(opt)
    assert state is StepState.SCALED and gs is opt.grad_scale and fi is opt.found_inf
    assert wg is True  # torch's fused optimizers leave .grad unscaled
    h.stepped()
    opt.grad_scale = None  # GradScaler after the user's own unscale_()
    state, gs, fi, wg = h.take(opt)
    assert (state, gs, wg) == (StepState.UNSCALED, None, False) and fi is opt.found_inf
    h.stepped()
    del opt.grad_scale, opt.found_inf
    assert h.take(opt) == (StepState.READY, None, None, False)


def test_master_pairs():
    pairs = MasterPairs()
    model = torch.zeros(3, dtype=torch.float16)
    master = model.float()
    v = pairs.version
    pairs.add(master, model)
    assert pairs.version == v + 1 and len(pairs) == 1
    assert pairs.model_of(master) is model
    assert pairs.model_of(master.clone()) is None and pairs.model_of(model) is None
    assert list(pairs) == [(master, model)]
    with pytest.raises(TypeError, match="master must be float32"):
        pairs.add(model, model)
    with pytest.raises(ValueError, match=r"shape \(2,\) cannot feed a model parameter of shape"):
        pairs.add(torch.zeros(2), model)
    with pytest.raises(TypeError, match="two tensors"):
        pairs.add(master, None)
    assert len(pairs) == 1


def test_handoff_of():
    from tritamp.optimizers import FusedAdam
    opt = FusedAdam([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert isinstance(handoff_of(opt), StepHandoff)
    assert handoff_of(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)) is None


# -- both drivers through the contract ------------------------------------------------------

def _recording(cls):
    """``cls`` whose group launches record what the step handoff said at that moment."""
    class Recording(cls):
        def _launch(self, group, prepared, grad_scale, found_inf, **kw):
            h = self.step_handoff
            self.seen.append((h.state, h.grad_scale, h.found_inf, h.write_grads,
                              grad_scale, found_inf))
            return super()._launch(group, prepared, grad_scale, found_inf, **kw)
    return Recording


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_amp_hands_each_step_over_and_takes_it_back(level, cpu_path):
    from tritamp import amp
    from tritamp.optimizers import FusedSGD
    from tritamp.testing import amp_state, master_of, stash_of
    model = _net()
    opt = _recording(FusedSGD)(model.parameters(), lr=0.1, momentum=0.9)
    opt.seen = []
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    pairs = opt.step_handoff.masters
    if level == "O2":  # every half model parameter's master is registered, nothing else
        halves = [p for p in model.parameters() if p.dtype == torch.bfloat16]
        assert len(pairs) == len(halves) == 4
        for p in halves:
            assert pairs.model_of(master_of(p)) is p
        assert list(pairs) == list(zip(stash_of(opt).masters, stash_of(opt).model_params))
    else:
        assert len(pairs) == 0
    scaler = amp_state().loss_scalers[0]
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    for step in range(2):
        opt.zero_grad()
        with amp.scale_loss(torch.nn.functional.mse_loss(model(x).float(), y), opt) as s:
            s.backward()
        assert opt.step_handoff.state is StepState.READY  # handed only for the step
        opt.step()
        state, h_scale, h_found, write, scale, found = opt.seen[-1]
        assert write is False and h_scale is scale and h_found is found
        assert found is not None and float(found) == 0.0  # this backward's overflow flag
        if level == "O2":
            # left scaled for the step to unscale as it reads them, with the scale they
            # carry; .grad is not written back under amp
            assert state is StepState.SCALED
            assert float(scale) == scaler.loss_scale() == 2.0**16
        else:
            # the parameters are their own masters: unscaled at scale_loss's exit (Apex)
            assert state is StepState.UNSCALED and scale is None
        assert opt.step_handoff.state is StepState.READY  # the driver took it back
        assert opt.step_handoff.found_inf is None and opt.step_handoff.grad_scale is None


def test_amp_hands_unscaled_gradients_after_master_params(cpu_path):
    """amp.master_params (clipping) unscales the pending gradients: the step is handed
    UNSCALED with the overflow flag."""
    from tritamp import amp
    from tritamp.optimizers import FusedAdam
    model = _net()
    opt = _recording(FusedAdam)(model.parameters(), lr=1e-3)
    opt.seen = []
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    with amp.scale_loss(torch.nn.functional.mse_loss(model(x).float(), y), opt) as s:
        s.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0)
    opt.step()
    state, h_scale, h_found, write, scale, found = opt.seen[-1]
    assert (state, h_scale, scale, write) == (StepState.UNSCALED, None, None, False)
    assert h_found is found and found is not None
    assert opt.step_handoff.state is StepState.READY


def test_a_refused_step_under_amp_leaves_the_handoff_ready(cpu_path):
    from tritamp import amp
    from tritamp.optimizers import FusedSGD
    class Failing(FusedSGD):
        def _launch(self, *args, **kwargs):
            assert self.step_handoff.state is StepState.SCALED
            raise RuntimeError("launch failed")

    model = _net()
    opt = Failing(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    with amp.scale_loss(torch.nn.functional.mse_loss(model(x), y), opt) as s:
        s.backward()
    with pytest.raises(RuntimeError, match="launch failed"):
        opt.step()
    assert opt.step_handoff.state is StepState.READY
    assert opt.step_handoff.grad_scale is None and opt.step_handoff.found_inf is None


def test_torchs_grad_scaler_drives_the_same_handoff(cpu_path):
    from tritamp.optimizers import FusedAdam
    model = _net()
    opt = _recording(FusedAdam)(model.parameters(), lr=1e-3)
    opt.seen = []
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    state, h_scale, h_found, write, scale, found = opt.seen[-1]
    # torch's protocol, taken by the optimizer: scaled, flag, .grad written unscaled
    assert state is StepState.SCALED and write is True
    assert h_scale is scale and float(scale) == 8.0 and h_found is found
    assert opt.step_handoff.state is StepState.STEPPED
    assert opt.step_handoff.skipped is found


def test_amp_recognises_an_optimizer_wrapper_by_its_shape():
    """amp does not import tritamp.parallel: LARC, or any wrapper of the same shape (an
    optimizer as .optim, its param_groups, step and zero_grad forwarded), is accepted."""
    from tritamp import amp

    class Wrapper:
        def __init__(self, optim):
            self.optim = optim

        @property
        def param_groups(self):
            return self.optim.param_groups

        @property
        def state(self):
            return self.optim.state

        def step(self, closure=None):
            return self.optim.step()

        def zero_grad(self, set_to_none=True):
            self.optim.zero_grad(set_to_none=set_to_none)

        def state_dict(self):
            return self.optim.state_dict()

        def load_state_dict(self, sd):
            self.optim.load_state_dict(sd)

        def add_param_group(self, group):
            self.optim.add_param_group(group)

    model = _net()
    wrapped = Wrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    model, opt = amp.initialize(model, wrapped, opt_level="O1", verbosity=0)
    assert opt is wrapped

    class NotAWrapper:  # .optim but no forwarded param_groups
        optim = torch.optim.SGD(_net().parameters(), lr=0.1)

        def step(self):
            pass

        def zero_grad(self):
            pass
    with pytest.raises(TypeError, match="optimizers must be either a single optimizer"):
        amp.initialize(_net(), NotAWrapper(), opt_level="O1", verbosity=0)
