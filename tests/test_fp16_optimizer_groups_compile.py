"""FP16_Optimizer as Apex scripts drive it: a param
group added after construction (to the wrapper or to the wrapped optimizer) trains like
one given to the constructor (fp32 masters, unscaled gradients), a refused group leaves
the wrapper as it was, and ``torch.compile(optimizer.step)`` of the wrapper still skips
an overflowing step. Also amp O2's ``add_param_group``: a group the optimizer refuses
leaves no masters behind, so the corrected group can be added.

bf16 models (fp16 math on a CPU is slow): the scale and the skip are the same.
"""
import pytest
import torch
from torch import nn

from tritamp import amp
from tritamp.fp16_utils import FP16_Optimizer
from tritamp.optimizers import FusedAdam
from tritamp.testing import reset_amp, stash_of

X = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]], dtype=torch.bfloat16)

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "fused_adam": lambda params: FusedAdam(params, lr=0.01),
}


def _two_layers():
    torch.manual_seed(0)
    return nn.Linear(3, 2).to(torch.bfloat16), nn.Linear(2, 1).to(torch.bfloat16)


def _train(first, second, opt, steps=2):
    for _ in range(steps):
        opt.zero_grad()
        opt.backward(second(first(X)).float().pow(2).mean())
        opt.step()


@pytest.mark.parametrize("added_to", ["wrapper", "wrapped_optimizer"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_param_group_added_after_construction_trains_like_a_constructor_group(name, added_to):
    make = OPTIMIZERS[name]
    first, second = _two_layers()
    ref = FP16_Optimizer(make([{"params": list(first.parameters())},
                               {"params": list(second.parameters())}]),
                         static_loss_scale=128.0, verbose=False)
    _train(first, second, ref)
    want = [p.detach().clone() for p in list(first.parameters()) + list(second.parameters())]

    first, second = _two_layers()
    opt = FP16_Optimizer(make(list(first.parameters())), static_loss_scale=128.0,
                         verbose=False)
    target = opt if added_to == "wrapper" else opt.optimizer
    target.add_param_group({"params": list(second.parameters())})
    # the new group's half parameters got fp32 masters, as the constructor's did
    assert [p.dtype for g in opt.param_groups for p in g["params"]] == [torch.float32] * 4
    assert [len(g) for g in opt.fp16_groups] == [2, 2]
    _train(first, second, opt)
    got = [p.detach() for p in list(first.parameters()) + list(second.parameters())]
    for i, (w, g) in enumerate(zip(want, got)):
        # (stepped with gradients still carrying the scale, the added layer moved 128x)
        assert torch.equal(w.view(torch.uint8), g.view(torch.uint8)), f"parameter {i}"


def test_refused_added_param_group_leaves_the_wrapper_unchanged():
    first, second = _two_layers()
    opt = FP16_Optimizer(FusedAdam(first.parameters(), lr=0.01), static_loss_scale=8.0,
                         verbose=False)
    with pytest.raises(ValueError, match="learning rate"):
        opt.add_param_group({"params": list(second.parameters()), "lr": -1.0})
    with pytest.raises(ValueError, match="already in"):
        opt.add_param_group({"params": [first.weight]})
    assert len(opt.param_groups) == 1
    assert len(opt._stash.masters) == len(opt._stash.model_params) == 2
    assert [len(g) for g in opt.fp16_groups] == [2]


def test_compiled_fp16_optimizer_step_skips_an_overflowing_step():
    first, second = _two_layers()
    opt = FP16_Optimizer(FusedAdam(list(first.parameters()) + list(second.parameters()),
                                   lr=0.01),
                         dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 8.0},
                         verbose=False)
    step = torch.compile(opt.step, backend="eager")
    _train(first, second, opt, steps=1)
    params = list(first.parameters()) + list(second.parameters())
    masters = opt.all_fp32_from_fp16_params
    before = [t.detach().clone() for t in params + masters]
    opt.zero_grad()
    opt.backward(second(first(X)).float().sum() * float("inf"))
    step()
    for i, (b, t) in enumerate(zip(before, params + masters)):
        assert torch.equal(b.view(torch.uint8), t.detach().view(torch.uint8)), f"tensor {i}"
    assert opt.loss_scale == 4.0
    # ... and the next, clean step runs (compiled too)
    opt.zero_grad()
    opt.backward(second(first(X)).float().pow(2).mean())
    step()
    assert not torch.equal(before[0], params[0].detach())
    assert all(torch.isfinite(t).all() for t in params + masters)


def test_amp_o2_param_group_refused_by_the_optimizer_can_be_added_corrected():
    def run(add_later):
        first, second = _two_layers()
        model = nn.Sequential(first, second).float()
        groups = [{"params": list(first.parameters())}]
        if not add_later:
            groups.append({"params": list(second.parameters())})
        model, opt = amp.initialize(model, FusedAdam(groups, lr=0.01), opt_level="O2",
                                    half_dtype=torch.bfloat16, loss_scale=8.0, verbosity=0)
        if add_later:
            with pytest.raises(ValueError, match="learning rate"):
                opt.add_param_group({"params": list(second.parameters()), "lr": -1.0})
            assert len(stash_of(opt).masters) == 2
            opt.add_param_group({"params": list(second.parameters())})
        for _ in range(2):
            opt.zero_grad()
            with amp.scale_loss(model(X).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    want = run(add_later=False)
    reset_amp()
    got = run(add_later=True)
    for i, (w, g) in enumerate(zip(want, got)):
        assert torch.equal(w.view(torch.uint8), g.view(torch.uint8)), f"parameter {i}"
