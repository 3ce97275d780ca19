"""The skip warning names the gradients that overflowed; nonfinite_gradients on demand."""
import contextlib
import logging

import pytest
import torch

from tritamp import amp
from tritamp.amp import overflow
from tritamp.optimizers import FusedAdam
from tritamp.testing import force_cpu_path


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _poison(values):
    def hook(g):
        g = g.clone()
        g.view(-1)[:len(values)] = torch.tensor(values, dtype=g.dtype)
        return g
    return hook


def _step(model, opt):
    loss = model(torch.randn(4, 8)).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()


def _warnings(caplog):
    out = [r.getMessage() for r in caplog.records if r.name == "tritamp.amp"
           and r.getMessage().startswith("Gradient overflow")]
    caplog.clear()
    return out


@pytest.fixture
def no_rate_limit(monkeypatch):
    monkeypatch.setattr(overflow, "DETAIL_INTERVAL_S", 0.0)


@pytest.mark.parametrize("path", ["kernel", "cpu"])
@pytest.mark.parametrize("make_opt,level", [
    (lambda p: FusedAdam(p, lr=1e-3), "O2"),
    (lambda p: torch.optim.SGD(p, lr=0.1), "O1"),
], ids=["FusedAdam-O2", "torch-SGD-O1"])
def test_the_skip_warning_names_what_overflowed(caplog, no_rate_limit, make_opt, level, path):
    caplog.set_level(logging.WARNING, logger="tritamp.amp")
    model = _model()
    opt = make_opt(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=1)
    hooks = [model[2].weight.register_hook(_poison([float("nan")] * 3)),
             model[0].bias.register_hook(_poison([float("inf")]))]
    with force_cpu_path() if path == "cpu" else contextlib.nullcontext():
        _step(model, opt)
        assert _warnings(caplog) == [
            "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0; "
            "non-finite gradients on rank 0: 2.weight (3 values), 0.bias (1 value)"]
        hooks.pop().remove()
        _step(model, opt)  # counts since the last list only: 2.weight's three again
        assert _warnings(caplog) == [
            "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 16384.0; "
            "non-finite gradients on rank 0: 2.weight (3 values)"]
        hooks.pop().remove()
        _step(model, opt)  # clean: no warning, nothing counted
        assert _warnings(caplog) == []


def test_names_are_rate_limited_and_clean_steps_read_nothing(caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="tritamp.amp")
    takes = []
    take = overflow.Ledger.take
    monkeypatch.setattr(overflow.Ledger, "take", lambda self: takes.append(1) or take(self))
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=1)
    for _ in range(3):
        _step(model, opt)  # clean steps: the counts are never read
    assert takes == [] and _warnings(caplog) == []
    hook = model[2].bias.register_hook(_poison([float("inf")] * 2))
    _step(model, opt)
    _step(model, opt)  # within DETAIL_INTERVAL_S of the first list: no names
    hook.remove()
    first, second = _warnings(caplog)
    assert first.endswith("non-finite gradients on rank 0: 2.bias (2 values)")
    assert second.endswith("reducing loss scale to 16384.0")
    assert len(takes) == 1
    monkeypatch.setattr(overflow, "DETAIL_INTERVAL_S", 0.0)
    hook = model[2].bias.register_hook(_poison([float("inf")]))
    _step(model, opt)  # the counts the unlisted skip left (2) and this one's (1)
    hook.remove()
    assert _warnings(caplog)[0].endswith("non-finite gradients on rank 0: 2.bias (3 values)")


def test_the_counts_follow_gradients_to_new_addresses_without_preparing_again(
        caplog, no_rate_limit, monkeypatch):
    """At the default verbosity every step's exit runs the count (it returns at once on a
    clean step). Gradients that land at new addresses every step (on a GPU they do; here
    the old ones are kept alive) rebind the kept count instead of preparing it again:
    nothing validated, no table built or uploaded. An overflow after several moves is
    still counted against the right parameters."""
    from tritamp.testing import recording_uploads
    caplog.set_level(logging.WARNING, logger="tritamp.amp")
    prepares = []
    real = overflow.count_nonfinite_prepare
    monkeypatch.setattr(overflow, "count_nonfinite_prepare",
                        lambda *a, **k: prepares.append(1) or real(*a, **k))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=1)
    alive = []
    for i in range(4):
        with recording_uploads() as uploads:
            with amp.scale_loss(model(torch.randn(4, 8)).float().sum(), opt) as scaled:
                scaled.backward()
            opt.step()
        alive.append([p.grad for p in model.parameters()])  # the next ones land elsewhere
        opt.zero_grad(set_to_none=True)
        if i:
            assert uploads == [], i
    assert prepares == [1] and _warnings(caplog) == []
    hook = model[2].weight.register_hook(_poison([float("nan")] * 3))
    _step(model, opt)
    hook.remove()
    assert prepares == [1]
    assert _warnings(caplog) == [
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0; "
        "non-finite gradients on rank 0: 2.weight (3 values)"]


def test_verbosity_0_counts_nothing():
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    model[2].weight.register_hook(_poison([float("nan")]))
    _step(model, opt)
    assert amp.last_step_skipped(opt)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 32768.0
    from tritamp.testing import stash_of
    assert stash_of(opt)._ledger is None


def test_nonfinite_gradients_names_by_group_and_index_without_amp():
    model = _model()
    opt = FusedAdam([{"params": model[0].parameters()}, {"params": model[2].parameters()}],
                    lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    model[2].weight.register_hook(_poison([float("inf"), float("nan")]))
    scaler.scale(model(torch.randn(4, 8)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert amp.last_step_skipped(opt)
    assert amp.nonfinite_gradients(opt) == [("param_groups[1][0] (shape [2, 8])", 2)]


def test_nonfinite_gradients_under_amp_uses_module_paths():
    a, b = _model(), _model()
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
    [a, b], opt = amp.initialize([a, b], opt, opt_level="O2", half_dtype=torch.bfloat16,
                                 loss_scale="dynamic", verbosity=0)
    b[0].weight.register_hook(_poison([float("nan")] * 4))
    loss = (a(torch.randn(4, 8)) + b(torch.randn(4, 8))).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert amp.nonfinite_gradients(opt) == [("model1.0.weight", 4)]


@pytest.mark.parametrize("path", ["kernel", "cpu"])
def test_count_nonfinite_lands_counts_at_their_index(path):
    from tritamp.kernels.overflow import count_nonfinite, count_nonfinite_ref
    srcs = [torch.full((1000,), float("nan")), torch.tensor([1.0, float("inf"), 2.0])]
    got, want = (torch.full((5,), 7, dtype=torch.int32) for _ in range(2))
    found = torch.ones(())
    with force_cpu_path() if path == "cpu" else contextlib.nullcontext():
        count_nonfinite(srcs, got, found, index=[4, 0])
    count_nonfinite_ref(srcs, want, found, index=[4, 0])
    assert want.tolist() == [8, 7, 7, 7, 1007]
    assert torch.equal(got, want)


def test_counts_survive_a_change_of_which_gradients_are_present(caplog, monkeypatch):
    """A skip counted while one set of gradients was present is still listed after the
    set changed (the counts are kept per parameter, not per set)."""
    caplog.set_level(logging.WARNING, logger="tritamp.amp")
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=1)
    model[2].bias.register_hook(_poison([float("inf")]))
    _step(model, opt)                       # listed: 2.bias (1 value)
    _step(model, opt)                       # rate-limited: counted, not listed
    model[0].weight.requires_grad_(False)   # another set of gradients from now on
    monkeypatch.setattr(overflow, "DETAIL_INTERVAL_S", 0.0)
    _step(model, opt)
    messages = _warnings(caplog)
    assert messages[0].endswith("non-finite gradients on rank 0: 2.bias (1 value)")
    assert messages[2].endswith("non-finite gradients on rank 0: 2.bias (2 values)")


@pytest.mark.parametrize("path", ["kernel", "cpu"])
@pytest.mark.parametrize("make_opt,level", [
    (lambda p: FusedAdam(p, lr=1e-3), "O2"),
    (lambda p: torch.optim.SGD(p, lr=0.1), "O1"),
], ids=["FusedAdam-O2", "torch-SGD-O1"])
def test_an_overflow_in_the_leading_parameters_alone_is_counted_and_skipped(
        caplog, no_rate_limit, make_opt, level, path):
    """A backward that reaches only the first parameters of an optimizer (a second model
    or head without a gradient) and overflows: the counts land at those positions of the
    optimizer's longer count tensor. The exit raised instead (the count refused a
    positions list equal to 0..k-1 with a longer count tensor), before the scale's update:
    every later overflowing step raised again at the same scale."""
    caplog.set_level(logging.WARNING, logger="tritamp.amp")
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    opt = make_opt(list(first.parameters()) + list(second.parameters()))
    [first, second], opt = amp.initialize([first, second], opt, opt_level=level,
                                          half_dtype=torch.bfloat16, loss_scale="dynamic",
                                          verbosity=1)
    weights = [p.detach().clone() for p in list(first.parameters()) + list(second.parameters())]
    with force_cpu_path() if path == "cpu" else contextlib.nullcontext():
        for _ in range(2):
            loss = first(torch.randn(2, 4)).float().sum() * float("inf")
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
    assert amp.last_step_skipped(opt)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0 ** 14
    now = list(first.parameters()) + list(second.parameters())
    assert all(torch.equal(w, p) for w, p in zip(weights, now))
    messages = _warnings(caplog)
    assert len(messages) == 2
    assert "model0.weight" in messages[0] and "model1." not in messages[0]


def test_each_scalers_report_names_what_its_own_loss_overflowed(caplog, no_rate_limit):
    """Two losses before each step (num_losses=2): step 1's loss 0 overflows in the first
    model, step 2's loss 1 in the second. The clean loss 1 of step 1 counted the
    gradients loss 0 had overflowed (the step's combined flag) into scaler 1, whose report
    at step 2 named the first model's weight too."""
    caplog.set_level(logging.WARNING, logger="tritamp.amp")
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(list(first.parameters()) + list(second.parameters()), lr=0.1)
    [first, second], opt = amp.initialize([first, second], opt, opt_level="O1",
                                          half_dtype=torch.bfloat16, num_losses=2,
                                          loss_scale="dynamic", verbosity=1)
    x = torch.randn(2, 4)

    def both():
        return first(x).float().mean() + second(x).float().mean()

    for poisoned, bad_loss in ((first.weight, 0), (second.weight, 1)):
        for loss_id in (0, 1):
            hook = (poisoned.register_hook(lambda g: g * float("inf"))
                    if loss_id == bad_loss else None)
            with amp.scale_loss(both(), opt, loss_id=loss_id) as scaled:
                scaled.backward()
            if hook is not None:
                hook.remove()
        opt.step()
        assert amp.last_step_skipped(opt)
        opt.zero_grad()
    messages = _warnings(caplog)
    assert len(messages) == 2
    assert "loss scaler 0" in messages[0]
    assert messages[0].endswith("non-finite gradients on rank 0: model0.weight (12 values)")
    assert "loss scaler 1" in messages[1]
    assert messages[1].endswith("non-finite gradients on rank 0: model1.weight (12 values)")
