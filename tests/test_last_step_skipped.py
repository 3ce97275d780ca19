"""amp.last_step_skipped and torch's LR schedulers around skipped steps."""
import warnings

import pytest
import torch

from tritamp import amp
from tritamp.optimizers import FusedAdam, FusedSGD


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _amp_step(model, opt, overflow):
    loss = model(torch.randn(4, 8)).float().pow(2).sum()
    if overflow:
        loss = loss * float("inf")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


@pytest.mark.parametrize("make_opt,level", [
    (lambda p: FusedAdam(p, lr=1e-2), "O2"),
    (lambda p: FusedSGD(p, lr=1e-2, momentum=0.9), "O1"),
    (lambda p: torch.optim.SGD(p, lr=1e-2), "O2"),        # one host read decides the skip
    (lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True), "O1"),  # torch's protocol
], ids=["FusedAdam-O2", "FusedSGD-O1", "torch-SGD-O2", "torch-fused-AdamW-O1"])
def test_amp_reports_which_steps_were_skipped(make_opt, level):
    model = _model()
    opt = make_opt(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    assert not amp.last_step_skipped(opt)  # no step yet
    seen = []
    for overflow in (True, False, True, True, False):
        _amp_step(model, opt, overflow)
        seen.append((amp.last_step_skipped(opt), amp.last_step_skipped()))
        opt.zero_grad()
    assert seen == [(True, True), (False, False), (True, True), (True, True), (False, False)]


def test_the_answer_survives_the_scalers_next_check():
    """The flag of the last step is one of the scaler's two slots until the next backward's
    check reuses them: the record keeps its own copy, so between the next scale_loss exit
    and the next step the answer is still about the last step."""
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    for overflow, clean_next in ((True, True), (False, False)):
        _amp_step(model, opt, overflow)
        opt.zero_grad()
        for _ in range(2):  # two more checks: both slots reused
            loss = model(torch.randn(4, 8)).float().pow(2).sum()
            if not clean_next:
                loss = loss * float("inf")
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            assert amp.last_step_skipped(opt) is overflow
            opt.zero_grad()


def test_a_static_scale_never_skips():
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                loss_scale=1.0, verbosity=0)
    _amp_step(model, opt, overflow=False)
    assert amp.last_step_skipped(opt) is False and amp.last_step_skipped() is False


def test_a_fused_optimizer_driven_by_torchs_grad_scaler():
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    seen = []
    for overflow in (True, False, True):
        loss = model(torch.randn(4, 8)).pow(2).sum()
        if overflow:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        seen.append(amp.last_step_skipped(opt))
        opt.zero_grad()
    assert seen == [True, False, True]
    opt.step()  # a plain step (no scaler) checks nothing: not skipped
    assert amp.last_step_skipped(opt) is False


def test_refusals():
    with pytest.raises(TypeError, match="SGD keeps no record of its steps"):
        amp.last_step_skipped(torch.optim.SGD(_model().parameters(), lr=1.0))
    with pytest.raises(RuntimeError, match="pass the optimizer"):
        amp.last_step_skipped()


@pytest.mark.parametrize("order", ["scheduler-first", "initialize-first"])
@pytest.mark.parametrize("make_opt", [lambda p: FusedAdam(p, lr=1e-2),
                                      lambda p: torch.optim.SGD(p, lr=1e-2)],
                         ids=["FusedAdam", "torch-SGD"])
def test_a_skipped_first_step_does_not_make_torchs_scheduler_warn(order, make_opt):
    model = _model()
    opt = make_opt(model.parameters())
    if order == "scheduler-first":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    if order == "initialize-first":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for overflow in (True, False):
            _amp_step(model, opt, overflow)
            sched.step()
            opt.zero_grad()
    assert [str(w.message) for w in caught if "lr_scheduler" in str(w.message)
            or "optimizer.step()" in str(w.message)] == []
    assert amp.last_step_skipped(opt) is False
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)


def test_an_optimizer_that_sits_out_updates_keeps_its_answer():
    """opt_b's last step (skipped) is two and three updates old when asked: the scaler's
    device state holds a step's flag for one update more; after that the record has its
    own copy."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
    opt_a = FusedAdam(a.parameters(), lr=1e-2)
    opt_b = FusedSGD(b.parameters(), lr=1e-2)
    [a, b], [opt_a, opt_b] = amp.initialize([a, b], [opt_a, opt_b], opt_level="O2",
                                            half_dtype=torch.bfloat16, loss_scale="dynamic",
                                            verbosity=0)
    loss = b(a(torch.randn(4, 8))).float().sum() * float("inf")
    with amp.scale_loss(loss, [opt_a, opt_b]) as scaled:
        scaled.backward()
    opt_a.step()
    opt_b.step()
    opt_a.zero_grad()
    opt_b.zero_grad()
    for _ in range(3):  # updates opt_b sits out
        loss = a(torch.randn(4, 8)).float().pow(2).sum()
        with amp.scale_loss(loss, opt_a) as scaled:
            scaled.backward()
        opt_a.step()
        opt_a.zero_grad()
        assert amp.last_step_skipped(opt_b) and not amp.last_step_skipped(opt_a)
        assert amp.last_step_skipped()  # any optimizer's last step


def _bn_net(level, momentum=0.0):
    """A Linear-BatchNorm-Linear net (fp32 BatchNorm parameters at O2) with torch's SGD
    through amp (bf16, dynamic scale), and a batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    return model, opt, torch.randn(8, 3)


def _assert_grads_kept_and_training_goes_on(model, opt, x, grads):
    """The gradients are ``grads`` (a failed backward left them), and a clean backward
    and step then go through."""
    for g, p in zip(grads, model.parameters()):
        assert (g is None and p.grad is None) or torch.equal(g, p.grad)
    with amp.scale_loss(model(x).float().square().mean(), opt) as loss:
        loss.backward()
    opt.step()
    assert not amp.last_step_skipped(opt)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_inf_kept_from_a_skipped_step_skips_the_next_step_too(level):
    # No zero_grad after an overflowing step: the next backward adds its clean gradients
    # to the inf/NaN ones. The sweep that adds them checks what the step will read: the
    # step is skipped again (it wrote inf/NaN into the weights when only the new
    # gradients were checked), and a zero_grad lets the training go on.
    model, opt, x = _bn_net(level)

    def step(factor=1.0):
        with amp.scale_loss(model(x).float().square().mean() * factor, opt) as loss:
            loss.backward()
        opt.step()
        return amp.last_step_skipped(opt)

    assert step(float("inf"))
    before = [p.detach().clone() for p in model.parameters()]
    assert step()  # the kept inf is part of the sum
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    opt.zero_grad()
    assert not step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_overflow_then_zero_grad_skips_the_step_at_O2_too():
    # Apex's skip lasted until the next step, zero_grad or not. At O2 the fp32 parameters
    # (BatchNorm) keep zeroed gradients: a step taken on them moved those parameters
    # through momentum.
    model, opt, x = _bn_net("O2", momentum=0.9)
    for factor in (1.0, float("inf")):
        if factor != 1.0:
            opt.zero_grad()
        with amp.scale_loss(model(x).float().square().mean() * factor, opt) as loss:
            loss.backward()
        if factor == 1.0:
            opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert amp.last_step_skipped(opt)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    with amp.scale_loss(model(x).float().square().mean(), opt) as loss:
        loss.backward()  # the next backward drops the flag
    opt.step()
    assert not amp.last_step_skipped(opt)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_backward_that_raises_inside_scale_loss_leaves_the_gradients(level):
    model, opt, x = _bn_net(level)
    with amp.scale_loss(model(x).float().square().mean(), opt) as loss:
        loss.backward()  # gradients kept (no step yet): accumulating
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="does not require grad"):
        with amp.scale_loss(torch.tensor(1.0), opt) as loss:
            loss.backward()
    _assert_grads_kept_and_training_goes_on(model, opt, x, grads)


@pytest.mark.parametrize("touched", [False, True], ids=["zeros", "written-since"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_backward_that_raises_half_way_leaves_zeroed_or_written_gradients(touched, level):
    # zero_grad(set_to_none=False) leaves zeros the next backward accumulates into; a
    # backward that raises after reaching the last layer wrote into some of them: they
    # are zeros again. Written since by a backward outside scale_loss, they are what
    # that backward left.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    x = torch.randn(8, 3)
    with amp.scale_loss(model(x).float().square().mean(), opt) as loss:
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    if touched:
        model(x).float().square().mean().backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]

    def fail(_):
        raise RuntimeError("a hook failed half way")

    # the hook on the hidden activation raises after the last layer's gradients were
    # accumulated, before the first layer's
    def on_hidden(module, inputs, out):
        out.register_hook(fail)  # (returns None: the output stays as it is)

    handle = model[1].register_forward_hook(on_hidden)
    with pytest.raises(RuntimeError, match="half way"):
        with amp.scale_loss(model(x).float().square().mean(), opt) as loss:
            loss.backward()
    handle.remove()
    _assert_grads_kept_and_training_goes_on(model, opt, x, grads)
