"""Promises of convert_to_amp, the compiled step, the step contract and clip_grad_norm_
that the other test files leave unchecked: torch mode's scale has no ceiling (as
GradScaler) and its criterion runs under the configured half dtype; naive mode refuses an
infinite clip_grad_norm; a driver's write_grads reaches the step; a LastStep recorded
without a flag answers "not skipped"; a compiled step refuses O2 model gradients changed
in its region, takes a gradient replaced by a view of itself, and runs its closure with
autograd on; clip_grad_norm_ takes a single tensor, returns torch's zero for no gradients
and raises on a non-finite norm when asked, as torch's; a refused clip_grad_norm of
naive mode leaves the gradients and the scaler. CPU only, tiny tensors."""
import pytest
import torch
import torch.nn as nn

from conftest import TOL
from tritamp import amp, convert_to_amp
from tritamp.contract import LastStep, StepHandoff, StepState
from tritamp.optimizers import FusedSGD, clip_grad_norm_
from tritamp.testing import amp_state, reset_amp


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3))


def _fresh():
    model = _net()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_torch_mode_scale_has_no_ceiling_as_grad_scaler():
    convert_to_amp(*_fresh(), mode="torch", half_dtype=torch.bfloat16)
    assert amp_state().loss_scalers[0].max_loss_scale == float("inf")


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_torch_mode_criterion_runs_under_the_configured_half_dtype(half):
    _, _, crit = convert_to_amp(*_fresh(), lambda a, b: a @ b.t(), mode="torch",
                                half_dtype=half)
    assert crit.dtype is half
    assert crit(torch.ones(2, 4), torch.ones(2, 4)).dtype is half


@pytest.mark.parametrize("clip", [float("inf"), -float("inf"), -0.5])
def test_naive_mode_refuses_a_clip_grad_norm_that_is_not_finite_or_negative(clip):
    with pytest.raises(ValueError, match="clip_grad_norm must be a finite number >= 0"):
        convert_to_amp(*_fresh(), mode="naive", clip_grad_norm=clip)
    assert amp_state().opt_properties is None  # refused before amp.initialize


def test_a_driver_handoff_keeps_write_grads_for_the_step():
    h = StepHandoff()
    scale, found = torch.full((), 4.0), torch.zeros(())
    h.hand(StepState.SCALED, grad_scale=scale, found_inf=found, write_grads=True)
    assert h.take(object()) == (StepState.SCALED, scale, found, True)
    h.stepped()
    h.reset()
    h.hand(StepState.SCALED, grad_scale=scale, found_inf=found)
    assert h.take(object())[3] is False


class _Slots:
    """A driver's reusable overflow slots (tritamp.amp's scaler), as LastStep sees them."""

    def __init__(self, flag):
        self.flag, self.records = flag, set()

    def track(self, record):
        self.records.add(record)
        return "token"

    def untrack(self, record):
        self.records.discard(record)

    def flag_of(self, token):
        assert token == "token"
        return self.flag


def test_a_last_step_recorded_without_a_flag_was_not_skipped_whatever_the_owner():
    owner = _Slots(torch.ones(()))
    record = LastStep()
    record.record(owner.flag, owner)
    assert record.skipped() and owner.records == {record}
    record.record(None, owner)  # nothing was checked: the step ran
    assert record.flag() is None and not record.skipped()
    assert owner.records == set()


def test_clip_grad_norm_raises_on_a_nonfinite_norm_when_asked_as_torch_does():
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("inf"), 2.0])
    before = p.grad.clone()
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    assert torch.equal(p.grad, before)


def test_clip_grad_norm_of_parameters_without_gradients_is_a_zero_tensor_as_torch():
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]
    got = clip_grad_norm_(params, 1.0)
    want = torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert isinstance(got, torch.Tensor) and torch.equal(got, want)


@pytest.fixture
def compiled_cpu(monkeypatch):
    # the compiled step on the production CPU path, as in test_compile.py
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _o2_linear():
    torch.manual_seed(0)
    model = nn.Linear(6, 5)
    opt = FusedSGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    with amp.scale_loss(model(torch.randn(4, 6)).float().square().sum(), opt) as scaled:
        scaled.backward()
    return model, opt


def test_o2_model_gradients_clipped_in_the_compiled_region_of_the_step_are_refused(compiled_cpu):
    # at O2 the step reads the half model parameters' gradients: a clip of them in the
    # step's region reaches .grad only after the op ran, so the op refuses
    model, opt = _o2_linear()

    def train_step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        opt.step()
    masters = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="changed earlier in the same compiled region"):
        torch.compile(train_step, fullgraph=True, backend="aot_eager")()
    assert all(torch.equal(a, p) for a, p in
               zip(masters, [p for g in opt.param_groups for p in g["params"]]))
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))


def test_a_compiled_step_under_amp_takes_a_gradient_replaced_by_a_view_of_itself(compiled_cpu):
    # the same memory as .grad: nothing the region wrote is lost, so the step runs
    results = []
    for compile_it in (False, True):
        torch._dynamo.reset()
        reset_amp()
        model, opt = _o2_linear()

        def train_step():
            model.weight.grad = model.weight.grad.view_as(model.weight.grad)
            opt.step()
        (torch.compile(train_step, fullgraph=True, backend="aot_eager") if compile_it
         else train_step)()
        results.append([p.detach().clone() for g in opt.param_groups for p in g["params"]])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_compiled_step_runs_its_closure_with_autograd_on_as_the_eager_step(compiled_cpu):
    results = []
    for compile_it in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        opt = FusedSGD(model.parameters(), lr=0.1)
        x = torch.ones(2, 3)

        def closure():
            opt.zero_grad()
            loss = model(x).square().sum()
            loss.backward()
            return loss
        step = torch.compile(opt.step, backend="eager") if compile_it else opt.step
        with torch.no_grad():  # (the step's own no_grad, as a caller may hold it)
            loss = step(closure)
        results.append((float(loss.detach()), [p.detach().clone() for p in model.parameters()]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def test_clip_grad_norm_of_a_single_tensor_clips_it_as_torch():
    ours, ref = nn.Parameter(torch.ones(2, 3)), nn.Parameter(torch.ones(2, 3))
    ours.grad = torch.arange(6.0).reshape(2, 3)
    ref.grad = ours.grad.clone()
    total = clip_grad_norm_(ours, 0.5)
    want = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    torch.testing.assert_close(total, want, **TOL[torch.float32])
    torch.testing.assert_close(ours.grad, ref.grad, **TOL[torch.float32])
    assert float(ours.grad.norm()) < 0.51


def _naive_accumulation(refused_call):
    reset_amp()
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    model, opt, crit = convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      nn.MSELoss(), mode="naive", clip_grad_norm=1.0,
                                      half_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    micro = [(torch.randn(2, 4, generator=g), torch.randn(2, 3, generator=g)) for _ in range(2)]
    opt.zero_grad()
    opt.backward(crit(model(micro[0][0]).float(), micro[0][1]))
    if refused_call:
        before = amp.state_dict()
        with pytest.raises(RuntimeError, match=r"clip_grad_norm=1\.0 in the amp config"):
            opt.clip_grad_norm(model, 0.5)
        assert amp.state_dict() == before  # the scaler did not move
    opt.backward(crit(model(micro[1][0]).float(), micro[1][1]))
    opt.step()
    return [m.detach().clone() for m in amp.master_params(opt.optim)]


def test_a_refused_clip_grad_norm_in_naive_mode_leaves_the_step_as_it_was():
    """A caller that catches the refusal and goes on accumulating gets the same step as
    one that never made the call (the refusal used to run the pending unscale first)."""
    plain, refused = _naive_accumulation(False), _naive_accumulation(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, refused))
