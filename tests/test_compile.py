"""torch.compile: the fused optimizers' step compiles with fullgraph=True to one custom op
(``tritamp::optimizer_step``), plain and under amp, once, and never again while an LR
scheduler changes the learning rate (a plain float) every step; the compiled steps are
the eager steps bit for bit, overflow skips included; Inductor keeps the op; and a model
compiled after ``amp.initialize`` trains at O1, O2 and O3 in fp16 and bf16 like the eager
one. The production CPU path runs (TRITON_INTERPRET=0); the op runs the same step code
on the Triton path (tests/test_triton_rebind.py and the optimizer tests cover that)."""
import unittest.mock
import warnings

import pytest
import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounter

from tritamp import amp, compiled
from tritamp.optimizers import (FusedAdagrad, FusedAdam, FusedLAMB, FusedMixedPrecisionLamb,
                                FusedNovoGrad, FusedSGD)
from tritamp.testing import reset_amp

OPTIMIZERS = {
    "adam": lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1),
    "adam_l2": lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1, adam_w_mode=False),
    "sgd": lambda p: FusedSGD(p, lr=1e-2, momentum=0.9),
    "lamb": lambda p: FusedLAMB(p, lr=1e-2),
    "mixed_precision_lamb": lambda p: FusedMixedPrecisionLamb(p, lr=1e-2),
    "adagrad": lambda p: FusedAdagrad(p, lr=1e-2),
    "novograd": lambda p: FusedNovoGrad(p, lr=1e-2),
    "torch_sgd_under_amp": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
}
STEPS = 20
OVERFLOW_AT = 7  # amp runs: this step's loss is inf, the step is skipped


@pytest.fixture(autouse=True)
def _production_cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch._dynamo.reset()
    reset_amp()
    yield
    torch._dynamo.reset()
    reset_amp()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(name, level, compile_step, backend=None):
    """20 steps, the learning rate changed by a scheduler after every one; returns the
    parameters, the loss scale and the number of compiled frames."""
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    if level is not None:
        model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                    loss_scale="dynamic", verbosity=0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))
    counter = CompileCounter()
    step = (torch.compile(opt.step, fullgraph=True, backend=backend or counter)
            if compile_step else opt.step)
    for i in range(STEPS):
        torch.manual_seed(100 + i)
        loss = model(torch.randn(4, 8)).float().square().mean()
        opt.zero_grad()
        if level is None:
            loss.backward()
        else:
            with amp.scale_loss(loss * (float("inf") if i == OVERFLOW_AT else 1.0),
                                opt) as scaled:
                scaled.backward()
        step()
        sched.step()
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"] if level is not None else None
    return [p.detach().clone() for p in model.parameters()], scale, counter.frame_count


CASES = [(name, None) for name in OPTIMIZERS if name != "torch_sgd_under_amp"] + \
        [(name, "O2") for name in OPTIMIZERS] + [("adam", "O1")]


@pytest.mark.parametrize("name,level", CASES, ids=[f"{n}-{lv or 'plain'}" for n, lv in CASES])
def test_a_fullgraph_compiled_step_compiles_once_and_matches_eager(name, level):
    with warnings.catch_warnings():
        # no graph break (fullgraph), and no scheduler warning: the compiled step counts
        # as optimizer.step() for torch's LR schedulers
        warnings.simplefilter("error")
        ours, scale, frames = _train(name, level, compile_step=True)
    eager, eager_scale, _ = _train(name, level, compile_step=False)
    assert frames == 1  # compiled once, then reused while the learning rate changed
    for a, b in zip(ours, eager):
        assert torch.equal(a, b)
    assert scale == eager_scale
    if level is not None:
        assert scale == 2.0 ** 15  # the overflow at OVERFLOW_AT was seen and skipped


def test_the_compiled_graph_is_one_call_of_the_op():
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    _train("adam", "O2", compile_step=True, backend=backend)
    (gm,) = graphs
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls == [torch.ops.tritamp.optimizer_step.default]


def test_inductor_keeps_the_op_and_matches_eager():
    ours, scale, _ = _train("adam", "O2", compile_step=True, backend="inductor")
    eager, eager_scale, _ = _train("adam", "O2", compile_step=False)
    for a, b in zip(ours, eager):
        assert torch.equal(a, b)
    assert scale == eager_scale == 2.0 ** 15


def test_the_eager_step_never_enters_the_op():
    with unittest.mock.patch.object(compiled, "optimizer_step",
                                    side_effect=AssertionError("eager step entered the op")):
        _train("adam", "O2", compile_step=False)
        _train("sgd", None, compile_step=False)


def test_an_optimizer_that_was_unpickled_or_copied_compiles_its_own_step():
    import copy
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    twin = copy.deepcopy(opt)
    assert twin._tritamp_step_handle != opt._tritamp_step_handle
    model(torch.randn(4, 8)).sum().backward()
    torch.compile(opt.step, fullgraph=True, backend=CompileCounter())()
    assert len(opt.state) == 2 * 2 and len(twin.state) == 0


HALVES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _train_model(level, half, compile_model):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=HALVES[half],
                                verbosity=0)
    forward = torch.compile(model) if compile_model else model
    losses = []
    torch.manual_seed(100)
    x, y = torch.randn(16, 8), torch.randn(16, 4)  # one batch, fitted over the steps
    for _ in range(STEPS):
        loss = (forward(x).float() - y).square().mean()
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_model_compiled_after_initialize_trains_like_the_eager_one(level, half):
    # Inductor fuses the half-precision ops and keeps fp32 between them, where eager
    # rounds after every op: the runs agree to the half dtype's precision (one ulp at 1).
    losses, params = _train_model(level, half, compile_model=True)
    torch._dynamo.reset()
    reset_amp()
    eager_losses, eager_params = _train_model(level, half, compile_model=False)
    eps = torch.finfo(HALVES[half]).eps
    assert eager_losses[-1] < 0.8 * eager_losses[0]  # it trained
    torch.testing.assert_close(losses, eager_losses, rtol=eps, atol=eps)
    for a, b in zip(params, eager_params):
        torch.testing.assert_close(a, b, rtol=eps, atol=eps)


def test_the_op_refuses_a_handle_without_a_live_optimizer():
    token = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="no optimizer has handle 123456789"):
        torch.ops.tritamp.optimizer_step(123456789, token, [])
    assert int(token) == 0  # nothing was run


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_syncbatchnorm_compiles_from_a_cold_start_and_matches_eager(layout):
    """Dynamo traces SyncBatchnormFunction as one subgraph whose saved tensors may not be
    views: the first compiled training call raised InternalTorchDynamoError (a saved view
    of the input, and the CPU path's count, a view of an intermediate)."""
    from tritamp.parallel import SyncBatchNorm

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 6, 3), SyncBatchNorm(6), nn.ReLU())
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = torch.randn(2, 3, 7, 7).to(memory_format=fmt)
    outs = []
    for compile_it in (True, False):
        torch._dynamo.reset()
        model = make().to(memory_format=fmt)
        run = torch.compile(model, fullgraph=True, backend="aot_eager") if compile_it else model
        xi = x.clone().requires_grad_()
        y = run(xi)
        y.square().sum().backward()
        outs.append([y.detach(), xi.grad] + [p.grad for p in model.parameters()]
                    + [b.clone() for b in model[1].buffers()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _clip_then_step_run(opt_cls, compile_it, level=None, edit=None):
    torch.manual_seed(0)
    model = nn.Linear(6, 5)
    opt = opt_cls(model.parameters(), lr=0.1)
    if level is not None:
        model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                    loss_scale="dynamic", verbosity=0)

    def train_step():
        params = amp.master_params(opt) if level is not None else model.parameters()
        if edit is None:
            torch.nn.utils.clip_grad_norm_(params, 1e-3)
        else:
            edit(model)
        opt.step()
    fn = torch.compile(train_step, fullgraph=True, backend="aot_eager") if compile_it \
        else train_step
    loss = model(torch.randn(4, 6)).square().sum()
    if level is None:
        loss.backward()
    else:
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    return model, opt, fn


@pytest.mark.parametrize("opt_cls", [FusedSGD, FusedAdam])
def test_gradients_clipped_in_the_compiled_region_of_the_step_are_the_ones_stepped(opt_cls):
    """A compiled region hands its writes to .grad when it returns, after the step's op:
    the step read the unclipped gradients (a 6.4 update instead of 1e-4)."""
    results = []
    for compile_it in (False, True):
        torch._dynamo.reset()
        model, opt, fn = _clip_then_step_run(opt_cls, compile_it)
        fn()
        results.append([p.detach().clone() for p in model.parameters()]
                       + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _grad_to_none(model):
    model.bias.grad = None


def _scale_then_none(model):
    model.weight.grad.mul_(0.5)  # (a gradient the op could take, then one it cannot)
    model.bias.grad = None


def _clip_model(model):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)


@pytest.mark.parametrize("level,edit", [("O1", None), ("O1", _clip_model),
                                        (None, _grad_to_none), (None, _scale_then_none)],
                         ids=["amp-O1-master-params", "amp-O1-clip", "grad-set-to-none",
                              "scaled-then-none"])
def test_a_compiled_step_after_changes_it_cannot_see_refuses(level, edit):
    """Under amp the region defers amp's gradients' changes too (a clip of them); a
    gradient set to None reaches .grad only after the step: refused by the op, nothing
    stepped, nothing written. amp.master_params is never traced: with fullgraph=True
    Dynamo refuses the region before it runs."""
    from conftest import assert_bits_equal
    model, opt, fn = _clip_then_step_run(FusedSGD, True, level, edit)
    stepped = list(model.parameters()) + [p for g in opt.param_groups for p in g["params"]]
    before = [p.detach().clone() for p in stepped]
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    if level is not None and edit is None:
        refusal = pytest.raises(torch._dynamo.exc.Unsupported,
                                match=r"torch\.compiler\.disable")
    else:
        refusal = pytest.raises(RuntimeError, match=r"changed earlier in the same compiled "
                                                    r"region.*Nothing was stepped")
    with refusal:
        fn()
    for i, (a, b) in enumerate(zip(before, [p.detach() for p in stepped])):
        assert_bits_equal(a, b, f"tensor {i}")
    for g, p in zip(grads, model.parameters()):
        assert (g is None) == (p.grad is None) and (g is None or torch.equal(g, p.grad))
    assert all(not st for st in opt.state.values())
    assert torch.is_grad_enabled()


def test_a_group_added_after_compiling_is_stepped_and_an_edited_list_is_refused_once():
    """The compiled step reads the gradients of the parameters it was compiled for:
    add_param_group makes it compile anew; a list edited in place is refused once
    (nothing stepped), then compiled anew."""
    torch.manual_seed(0)
    a, b, c = (nn.Parameter(torch.randn(4)) for _ in range(3))
    opt = FusedSGD([a], lr=0.1)
    step = torch.compile(opt.step, fullgraph=True, backend="eager")
    for p in (a, b, c):
        p.grad = torch.ones(4)
    step()
    opt.add_param_group({"params": [b]})
    before = b.detach().clone()
    step()
    assert torch.equal(b.detach(), before - 0.1)
    opt.param_groups[1]["params"].append(c)  # edited in place: no add_param_group
    kept = [p.detach().clone() for p in (a, b, c)]
    with pytest.raises(RuntimeError, match="parameters changed after its step was compiled"):
        step()
    assert all(torch.equal(p.detach(), k) for p, k in zip((a, b, c), kept))
    step()
    assert all(torch.equal(p.detach(), k - 0.1) for p, k in zip((a, b, c), kept))


@pytest.mark.parametrize("opt_cls", [FusedSGD, FusedLAMB])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_refused_compiled_step_leaves_autograd_on(opt_cls, backend):
    """The step's graph turned autograd off around the op (the step's no_grad): a
    refusal raised between the two changes left it off for the caller (every later
    backward failed)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = opt_cls(model.parameters(), lr=0.1)

    def train_step():
        model.bias.grad = None
        opt.step()
    fn = torch.compile(train_step, fullgraph=True, backend=backend)
    model(torch.randn(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="changed earlier in the same compiled region"):
        fn()
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("name", ["sgd", "lamb"])
def test_step_hooks_run_once_per_compiled_step(name):
    # The traced step is one call of the op, whose eager step() runs the hooks: traced
    # through torch's hook wrapper too, they ran twice (a pre-hook that halves the
    # gradients halved them twice: the update was a quarter of the eager one).
    def run(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1, bias=False)
        opt = (FusedSGD if name == "sgd" else FusedLAMB)(model.parameters(), lr=1.0)
        counts = torch.zeros(2)

        def pre(o, args, kwargs):
            counts[0] += 1
            for group in o.param_groups:
                for p in group["params"]:
                    p.grad.mul_(0.5)

        def post(o, args, kwargs):
            counts[1] += 1

        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)
        step = torch.compile(opt.step, fullgraph=True, backend="eager") if compiled \
            else opt.step
        w0 = model.weight.detach().clone()
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
            step()
        return model.weight.detach() - w0, counts

    (eager_delta, eager_counts), (comp_delta, comp_counts) = run(False), run(True)
    assert eager_counts.tolist() == comp_counts.tolist() == [3.0, 3.0]
    assert torch.equal(eager_delta, comp_delta)



@pytest.mark.parametrize("level", ["O1", "O2"])
def test_clip_of_master_params_then_step_in_one_region_steps_as_eager(level):
    # amp.master_params runs eagerly where the region breaks (never traced): without
    # fullgraph the clip and the step in one compiled region step as the eager code, every
    # step (traced, its kept sweeps' addresses turned symbolic and Dynamo failed at the
    # first recompile, after part of the region had run)
    def run(compiled):
        torch._dynamo.reset()
        reset_amp()
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        opt = FusedAdam(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                    loss_scale="dynamic", verbosity=0)

        def clip_step():
            torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.1)
            opt.step()
        fn = torch.compile(clip_step, backend="eager") if compiled else clip_step
        for i in range(3):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
            opt.zero_grad()
            with amp.scale_loss(model(x).float().sum() * 10, opt) as scaled:
                scaled.backward()
            fn()
        return [p.detach().clone() for g in opt.param_groups for p in g["params"]]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)
