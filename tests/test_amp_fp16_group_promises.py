"""Promises of amp's accumulation chains and param groups and of FP16_Optimizer's groups:
delay_unscale accumulations that follow a skipped one or change scale twice step like
torch; half parameters without an fp32 master (frozen, or batchnorm kept fp32) may sit in
two optimizers; an O1 param group the optimizer refused leaves nothing behind, so the
corrected group trains as a constructor's; FP16_Optimizer's ``add_param_group``
refuses what it cannot train by name with nothing changed and takes a bare tensor, and
its masterless-rounding refusal sees through LARC. An amp O2 group refused midway
(a non-float parameter after a half one) or by torch (a parameter already in a group)
leaves the stash and the caller's dict as they were, so the corrected dict trains.

Tiny fp16/bf16 models on the CPU."""
import pytest
import torch
from torch import nn

from tritamp import amp
from tritamp.fp16_utils import FP16_Optimizer
from tritamp.optimizers import FusedAdam
from tritamp.parallel import LARC
from tritamp.testing import master_of, reset_amp

X = torch.tensor([[0.5, -1.0, 2.0, 0.25], [1.5, 0.25, -0.75, 1.0], [-0.5, 2.0, 1.0, -1.5]])


def _models():
    torch.manual_seed(0)
    model, ref = nn.Linear(4, 2), nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    return model, ref


def _torch_step(ref, n):
    """torch's fp32 SGD step over ``n`` micro-batches of X summed."""
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (ref(X).mean() * n).backward()
    opt.step()
    return ref.weight


def _backward(model, opt, loss_id=0, delay=False, factor=1.0):
    with amp.scale_loss(model(X).float().mean() * factor, opt, loss_id=loss_id,
                        delay_unscale=delay) as scaled:
        scaled.backward()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_accumulation_after_a_skipped_accumulation_steps_like_torch(opt_level):
    # (the skipped step's chain left behind: the next chain's first gradients were
    # rescaled by the backoff, 512/1024, as if they carried the old scale)
    model, ref = _models()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0,
                                init_scale=1024.)
    _backward(model, opt, delay=True)
    _backward(model, opt, factor=float("inf"))
    opt.step()  # skipped: the scale backs off to 512
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 512.0
    opt.zero_grad()
    _backward(model, opt, delay=True)
    _backward(model, opt)
    opt.step()
    torch.testing.assert_close(opt.param_groups[0]["params"][0].float(), _torch_step(ref, 2),
                               rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_accumulation_moved_to_another_loss_id_whose_scale_then_changes_steps_like_torch(
        opt_level):
    # (after the move the gradients carry loss_id 1's scale: its later change must reach
    # them too)
    model, ref = _models()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, num_losses=2, verbosity=0,
                                init_scale=1024.)
    _backward(model, opt, loss_id=0, delay=True)
    _backward(model, opt, loss_id=1, delay=True)  # brought to loss_id 1's scale, 1024
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 0},
                         "loss_scaler1": {"loss_scale": 4.0, "unskipped": 0}})
    _backward(model, opt, loss_id=1)
    opt.step()
    torch.testing.assert_close(opt.param_groups[0]["params"][0].float(), _torch_step(ref, 3),
                               rtol=1e-2, atol=1e-3)


def test_a_frozen_half_parameter_in_two_optimizers_is_accepted_with_masters():
    # (it gets no fp32 master: neither optimizer writes it)
    model = nn.Linear(4, 2)
    model.bias.requires_grad_(False)
    first = torch.optim.SGD([model.weight, model.bias], lr=0.1)
    second = torch.optim.SGD([model.bias], lr=0.1)
    model, (first, second) = amp.initialize(model, [first, second], opt_level="O2",
                                            verbosity=0)
    assert first.param_groups[0]["params"][1] is model.bias
    assert second.param_groups[0]["params"][0] is model.bias


def test_a_batchnorm_parameter_kept_fp32_in_two_optimizers_is_accepted_with_masters():
    # (O2 keeps batchnorm fp32, without masters: both optimizers apply their updates, as
    # torch's do)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    bn = model[1]
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    second = torch.optim.SGD(bn.parameters(), lr=0.1)
    model, (first, second) = amp.initialize(model, [first, second], opt_level="O2",
                                            verbosity=0)
    assert bn.weight.dtype == torch.float32
    assert [p is q for p, q in zip(second.param_groups[0]["params"], bn.parameters())] == \
        [True, True]


def _two_layers(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Linear(4, 3).to(dtype), nn.Linear(3, 1).to(dtype)


def _amp_train(model, opt, steps=2):
    for _ in range(steps):
        opt.zero_grad()
        with amp.scale_loss(model(X).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_o1_group_refused_by_the_optimizer_then_added_corrected_trains_like_one_given_first():
    # (O1: every parameter is its own master; left in amp's list by the refusal, the
    # group's parameters were listed twice once the corrected group was added)
    def run(add_later):
        first, second = _two_layers()
        model = nn.Sequential(first, second)
        groups = [{"params": list(first.parameters())}]
        if not add_later:
            groups.append({"params": list(second.parameters())})
        model, opt = amp.initialize(model, FusedAdam(groups, lr=0.01), verbosity=0,
                                    opt_level="O1", half_dtype=torch.bfloat16,
                                    loss_scale=8.0)
        if add_later:
            group = {"params": list(second.parameters()), "lr": -1.0}
            with pytest.raises(ValueError, match="learning rate"):
                opt.add_param_group(group)
            group["lr"] = 0.01
            opt.add_param_group(group)
        return _amp_train(model, opt)

    want = run(add_later=False)
    reset_amp()
    got = run(add_later=True)
    for i, (w, g) in enumerate(zip(want, got)):
        assert torch.equal(w.view(torch.uint8), g.view(torch.uint8)), f"parameter {i}"


def _fp16_optimizer():
    first, second = _two_layers(torch.bfloat16)
    opt = FP16_Optimizer(FusedAdam(first.parameters(), lr=0.01), static_loss_scale=8.0,
                         verbose=False)
    return first, second, opt


def _fp16_state(opt):
    stash = opt._stash
    return (len(opt.param_groups), len(stash.masters), len(stash.model_params),
            len(stash.plain_params), [len(g) for g in opt.fp16_groups])


@pytest.mark.parametrize("bad, match", [
    (lambda: nn.Parameter(torch.ones(2, dtype=torch.float64)),
     r"Wrapped parameters must be either float16, bfloat16 or float32 tensors\. Received "
     r"torch\.float64 with \(2,\) \(the new param group's params\[1\]\)"),
    (lambda: torch.zeros(2, dtype=torch.int64),
     r"FP16_Optimizer\.add_param_group: the new param group's params\[1\] is torch\.int64; "
     r"parameters must be float16, bfloat16 or float32 tensors")],
    ids=["float64", "int64"])
def test_fp16_optimizer_add_param_group_refuses_a_bad_parameter_by_name_with_nothing_changed(
        bad, match):
    first, second, opt = _fp16_optimizer()
    before = _fp16_state(opt)
    with pytest.raises(TypeError, match=match):
        opt.add_param_group({"params": [second.weight, bad()]})
    assert _fp16_state(opt) == before
    assert master_of(second.weight) is None
    opt.add_param_group({"params": [second.weight]})  # the corrected group is taken
    assert [len(g) for g in opt.fp16_groups] == [2, 1]


def test_fp16_optimizer_add_param_group_takes_a_bare_tensor_as_one_parameter():
    first, second, opt = _fp16_optimizer()
    opt.add_param_group({"params": second.weight})
    assert [len(g) for g in opt.fp16_groups] == [2, 1]
    assert opt.fp16_groups[1][0] is second.weight
    assert opt.param_groups[1]["params"][0].shape == second.weight.shape


@pytest.mark.parametrize("flag", ["stochastic_rounding", "kahan_summation"])
def test_fp16_optimizer_refuses_a_masterless_rounding_optimizer_wrapped_in_larc(flag):
    model = nn.Linear(4, 3).bfloat16()
    inner = FusedAdam(model.parameters(), lr=0.01, **{flag: True})
    with pytest.raises(ValueError, match=f"FusedAdam has {flag}=True"):
        FP16_Optimizer(LARC(inner), verbose=False)
    assert not hasattr(inner, "_amp_stash")


def test_o2_group_refused_midway_by_a_non_float_parameter_leaves_no_master():
    # (adopt_group's own refusal came before the rollback: an orphan master stayed, and
    # the corrected group was refused as held by an optimizer amp already manages)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                verbosity=0)
    index = nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False)
    group = {"params": [model[1].weight, index]}
    with pytest.raises(TypeError, match="floating point tensors"):
        opt.add_param_group(group)
    assert group["params"][0] is model[1].weight and master_of(model[1].weight) is None
    opt.add_param_group({"params": [model[1].weight]})
    assert master_of(model[1].weight) is not None


def test_o2_group_torch_refuses_leaves_the_callers_dict_holding_the_model_parameters():
    # (torch rebinds param_group["params"] to its own list before refusing: the dict kept
    # amp's fp32 masters, and the corrected dict added them as plain tensors the model
    # never reads: the layer never trained)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    first, bn, second = model
    opt = torch.optim.SGD(list(first.parameters()) + list(bn.parameters()), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                verbosity=0)
    group = {"params": list(second.parameters()) + [bn.weight]}
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group(group)
    assert all(p is q for p, q in zip(group["params"], second.parameters()))
    group["params"] = group["params"][:2]
    opt.add_param_group(group)
    before = second.weight.detach().clone()
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for _ in range(2):
        opt.zero_grad()
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    assert not torch.equal(before, second.weight.detach())
