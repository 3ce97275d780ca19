"""Kept plans are rebuilt whenever what they hold no longer matches the step: the
scale the gradients carry, a gradient landing where another parameter's was, optimizer
state replaced or reset, a parameter's storage moved (interpreter or reference path)."""
import torch
import torch.nn as nn

from tritamp import amp
from tritamp.optimizers import FusedAdam, FusedSGD
from tritamp.testing import stash_of


def _update_after_a_backoff(delay_overflow_check):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model, opt = amp.initialize(model, FusedSGD(model.parameters(), lr=1.0), opt_level="O2",
                                verbosity=0)
    x = torch.randn(8, 4) * 0.01
    with amp.scale_loss(model(x.half()).float().mean() * float("inf"), opt) as scaled:
        scaled.backward()  # overflow: the scale backs off
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in amp.master_params(opt)]
    with amp.scale_loss(model(x.half()).float().mean(), opt,
                        delay_overflow_check=delay_overflow_check) as scaled:
        scaled.backward()
    opt.step()
    return [b - p.detach() for b, p in zip(before, amp.master_params(opt))]


def test_delay_overflow_check_unscales_by_the_scale_the_gradients_carry():
    plain = _update_after_a_backoff(False)
    from tritamp.testing import amp_state
    amp_state().loss_scalers = []
    delayed = _update_after_a_backoff(True)
    for a, b in zip(plain, delayed):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(16))
        self.b = nn.Parameter(torch.zeros(8))

    def forward(self, x, head):
        return (self.a * x).sum() if head == "a" else (self.b * x).sum()


def test_another_parameters_gradient_at_a_freed_address_is_checked_in_full():
    # The allocator may hand a freed gradient's block to another parameter's gradient
    # (same address, same strides): simulated with one shared block.
    model = _TwoHeads()
    model, opt = amp.initialize(model, FusedSGD(model.parameters(), lr=1e-3), opt_level="O2",
                                verbosity=0)
    block = torch.zeros(64, dtype=torch.uint8)

    def land(p):
        g = block[: p.grad.numel() * 2].view(torch.float16)
        g.copy_(p.grad)
        p.grad = g

    with amp.scale_loss(model(torch.full((8,), 1e-6).half(), "b"), opt) as scaled:
        scaled.backward()
        land(model.b)
    opt.step()
    opt.zero_grad()
    x = torch.cat([torch.full((8,), 1e-6), torch.full((8,), 1e4)]).half()  # inf in 8..15
    before = model.a.detach().clone()
    with amp.scale_loss(model(x, "a"), opt) as scaled:
        scaled.backward()
        land(model.a)
    assert stash_of(opt).found_inf.item() == 1.0
    opt.step()
    assert torch.equal(model.a.detach(), before)  # skipped, nothing applied


def test_resetting_optimizer_state_is_seen_by_the_kept_plan():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(64))
    q = nn.Parameter(p.detach().clone())
    o1, o2 = FusedAdam([p], lr=0.1), FusedAdam([q], lr=0.1)
    p.grad = torch.zeros(64)  # kept across steps
    for _ in range(3):
        p.grad.copy_(torch.randn(64) * 10)
        o1.step()
    o1.state.clear()
    with torch.no_grad():
        q.copy_(p)
    g = torch.randn(64)
    p.grad.copy_(g)
    o1.step()
    q.grad = g.clone()
    o2.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
    assert o1.state[p]["step"].item() == 1.0


def test_replacing_one_state_tensor_is_seen_by_the_kept_plan():
    p = nn.Parameter(torch.randn(32))
    opt = FusedAdam([p], lr=0.1)
    p.grad = torch.randn(32)
    opt.step()
    new = torch.zeros(32)
    opt.state[p]["exp_avg"] = new
    opt.step()
    assert new.abs().sum() > 0  # the step updated the tensor now in the state


def test_a_parameter_whose_storage_moved_gets_its_copy_written():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(64).half())
    opt = FusedAdam([p], lr=0.1, master_weights=True)
    p.grad = torch.zeros(64, dtype=torch.half)
    p.grad.copy_(torch.randn(64))
    opt.step()
    p.data = p.data.clone()  # as load_state_dict(assign=True) or .to(memory_format=...)
    p.grad.copy_(torch.randn(64))
    opt.step()
    assert torch.equal(p.detach(), opt.state[p]["master_param"].half())


def test_state_dict_holds_plain_dicts():
    p = nn.Parameter(torch.randn(4))
    opt = FusedAdam([p], lr=0.1)
    p.grad = torch.randn(4)
    opt.step()
    sd = opt.state_dict()
    assert type(sd["state"][0]) is dict
