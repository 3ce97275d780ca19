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
