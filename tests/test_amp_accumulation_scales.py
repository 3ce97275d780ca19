"""amp's gradient accumulation across a change of scale: gradients accumulated with
``delay_unscale=True`` keep the scale they were made with when the scale changes in the
middle of the accumulation (``amp.load_state_dict``, Apex's ``_loss_scale`` setter, a
later backward under another ``loss_id``), so the step after it matches torch's fp32
training on the same micro-batches."""
import pytest
import torch

from tritamp import amp


def _accumulate(opt_level, change, micro_batches=3):
    """Three micro-batches into one step, the first two with delay_unscale=True and the
    scale changed by ``change`` after the first; returns (amp's updated fp32 weight,
    torch's)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, num_losses=2, verbosity=0,
                                init_scale=1024.)
    amp.load_state_dict({"loss_scaler1": {"loss_scale": 8.0, "unskipped": 0}})
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    loss_id = 0
    for k in range(micro_batches):
        if k == 1:
            loss_id = change()
        with amp.scale_loss(model(x).float().mean(), opt, loss_id=loss_id,
                            delay_unscale=k < micro_batches - 1) as scaled:
            scaled.backward()
    opt.step()
    ref_opt.zero_grad()
    (ref(x).mean() * micro_batches).backward()
    ref_opt.step()
    return opt.param_groups[0]["params"][0], ref.weight


def _load_smaller_scale():
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}})
    return 0


def _set_apex_loss_scale():
    amp._amp_state.loss_scalers[0]._loss_scale = 4.0
    return 0


def _switch_to_loss_id_1():
    return 1


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("change", [_load_smaller_scale, _set_apex_loss_scale,
                                    _switch_to_loss_id_1],
                         ids=["load_state_dict", "_loss_scale setter", "other loss_id"])
def test_delay_unscale_gradients_keep_their_scale_when_it_changes_mid_accumulation(
        opt_level, change):
    ours, ref = _accumulate(opt_level, change)
    # fp16 forward/backward at O1/O2: the half dtype's tolerance, loosened for the sum
    # of three micro-batches
    torch.testing.assert_close(ours.float(), ref, rtol=1e-2, atol=1e-3)


def test_delay_unscale_gradients_keep_their_scale_when_another_optimizer_backs_it_off():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(a.state_dict())
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    [a, b], [opt_a, opt_b] = amp.initialize([a, b], [opt_a, opt_b], opt_level="O2",
                                            verbosity=0, init_scale=1024.)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with amp.scale_loss(a(x).float().mean(), opt_a, delay_unscale=True) as scaled:
        scaled.backward()
    # b's overflow halves the scale that a's accumulated gradients carry
    with amp.scale_loss(b(x).float().mean() * float("inf"), opt_b) as scaled:
        scaled.backward()
    opt_b.step()
    with amp.scale_loss(a(x).float().mean(), opt_a) as scaled:
        scaled.backward()
    opt_a.step()
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 512.0
    ref_opt.zero_grad()
    (ref(x).mean() * 2).backward()
    ref_opt.step()
    torch.testing.assert_close(opt_a.param_groups[0]["params"][0], ref.weight,
                               rtol=1e-2, atol=1e-3)
