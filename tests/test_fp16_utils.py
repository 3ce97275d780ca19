"""tritamp.fp16_utils: FP16_Optimizer against amp O2, skips, accumulation, closures,
checkpoints and host reads; the manual helpers against torch; the legacy scalers
against Apex's update rule."""
import copy
import io
import logging

import pytest
import torch
import torch.nn as nn

from conftest import TOL
from tritamp import amp
from tritamp.fp16_utils import (BN_convert_float, DynamicLossScaler, FP16_Optimizer, FP16Model,
                                LossScaler, clip_grad_norm, convert_network,
                                master_params_to_model_params,
                                model_grads_to_master_grads, network_to_half, prep_param_lists,
                                to_python_float, tofp16)
from tritamp.optimizers import FusedAdam, FusedSGD

HALF = [torch.bfloat16, torch.float16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
HALF_IDS = ["bf16", "fp16"]

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "fused-sgd": lambda p: FusedSGD(p, lr=0.1, momentum=0.9),
    "fused-adam": lambda p: FusedAdam(p, lr=1e-2),
}


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _batches(n_steps, n=8, device="cpu"):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(n, 6, generator=g).to(device), torch.randn(n, 3, generator=g).to(device))
            for _ in range(n_steps)]


def _fp16_setup(half, make_opt, device="cpu", **kwargs):
    model = FP16Model(_net().to(device), dtype=half)
    kwargs.setdefault("verbose", False)
    return model, FP16_Optimizer(make_opt(model.parameters()), **kwargs)


def _masters(fp16_opt):
    return [p for g in fp16_opt.param_groups for p in g["params"]]


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts host reads of tensor values (each a device sync on a GPU)."""
    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
             torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


# -- FP16_Optimizer matches amp O2 --------------------------------------------------------------

@pytest.fixture
def torch_ref_path(monkeypatch):
    """CPU kernels take their torch reference path (the dispatch rule without the
    interpreter): for policy tests whose kernels are tested elsewhere, at a fraction of
    the interpreter's cost per launch."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


MATCH_CASES = [  # (half dtype, optimizer, kernels in the interpreter or their torch refs)
    (torch.float16, "sgd", "kernels"), (torch.bfloat16, "fused-adam", "kernels"),
    (torch.bfloat16, "sgd", "refs"), (torch.float16, "adam", "refs"),
    (torch.bfloat16, "adam", "refs"), (torch.float16, "fused-sgd", "refs"),
    (torch.bfloat16, "fused-sgd", "refs"), (torch.float16, "fused-adam", "refs"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half,opt_name,path", MATCH_CASES,
                         ids=[f"{str(h)[6:]}-{o}-{k}" for h, o, k in MATCH_CASES])
def test_fp16_optimizer_matches_amp_O2_step_for_step(half, opt_name, path, device, monkeypatch):
    """Same model, data and dynamic scale: masters, half weights, optimizer state and
    scale are bit for bit amp O2's, through an overflowing (skipped) step."""
    if path == "refs":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    if device == "cuda" and path == "refs":
        pytest.skip("on a GPU every case runs the compiled kernels; the kernel cases cover it")
    make_opt = OPTIMIZERS[opt_name]
    ref = _net().to(device)
    # FP16_Optimizer's masters come from the half weights FP16Model made; amp O2's come
    # from the fp32 weights the model had. Start both from values the half dtype holds.
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, nn.Linear):
                for p in m.parameters():
                    p.copy_(p.to(half).float())
    ref_opt = make_opt(ref.parameters())
    ref, ref_opt = amp.initialize(ref, ref_opt, opt_level="O2", half_dtype=half,
                                  loss_scale="dynamic", verbosity=0)
    model, opt = _fp16_setup(half, make_opt, device, dynamic_loss_scale=True)
    for step, (x, y) in enumerate(_batches(3, device=device)):
        blowup = float("inf") if step == 1 else 1.0
        loss = nn.functional.mse_loss(ref(x), y) * blowup
        ref_opt.zero_grad()
        with amp.scale_loss(loss, ref_opt) as scaled:
            scaled.backward()
        ref_opt.step()

        loss = nn.functional.mse_loss(model(x).float(), y) * blowup
        opt.zero_grad()
        opt.backward(loss)
        assert opt.overflow == (step == 1)
        opt.step()

        for a, b in zip(amp.master_params(ref_opt), _masters(opt)):
            assert a.dtype == b.dtype == torch.float32
            assert torch.equal(a, b)
        for a, b in zip(ref.parameters(), model.parameters()):
            assert a.dtype == b.dtype
            assert torch.equal(a, b)
        assert opt.loss_scale == amp.state_dict()["loss_scaler0"]["loss_scale"]
    assert opt.loss_scale == 2.**15
    for a, b in zip(amp.master_params(ref_opt), _masters(opt)):
        for key, value in ref_opt.state[a].items():
            assert torch.equal(value, opt.state[b][key]), key


def test_fp16_optimizer_infers_the_half_dtype_of_each_parameter():
    lin16, lin_bf16, lin32 = nn.Linear(3, 3).half(), nn.Linear(3, 3).bfloat16(), nn.Linear(3, 3)
    params = list(lin16.parameters()) + list(lin_bf16.parameters()) + list(lin32.parameters())
    opt = FP16_Optimizer(torch.optim.SGD(params, lr=0.1), verbose=False)
    assert [p.dtype for p in opt.all_fp16_params] == [torch.float16] * 2 + [torch.bfloat16] * 2
    assert all(m.dtype == torch.float32 for m in opt.all_fp32_from_fp16_params)
    assert opt.all_fp32_from_fp32_params == list(lin32.parameters())
    for half, master in zip(opt.all_fp16_params, opt.all_fp32_from_fp16_params):
        assert torch.equal(master, half.float())


# -- skips, scaling, accumulation ----------------------------------------------------------------

def test_a_static_scale_is_not_checked_and_never_skips():
    """Apex's static LossScaler never reports an overflow: the step is taken."""
    model, opt = _fp16_setup(torch.float16, OPTIMIZERS["adam"], static_loss_scale=128.0)
    (x, y), = _batches(1)
    opt.backward(nn.functional.mse_loss(model(x).float(), y) * float("nan"))
    assert not opt.overflow
    opt.step()
    assert not all(torch.isfinite(m).all() for m in _masters(opt))
    assert opt.loss_scale == 128.0


@pytest.mark.parametrize("dynamic", [True], ids=["dynamic"])
def test_a_skipped_step_changes_nothing_and_is_reported(dynamic, caplog):
    model, opt = _fp16_setup(torch.float16, OPTIMIZERS["adam"], dynamic_loss_scale=dynamic,
                             static_loss_scale=128.0)
    (x, y), = _batches(1)
    opt.backward(nn.functional.mse_loss(model(x).float(), y))
    opt.step()  # Adam state exists
    before = dict(masters=[m.clone() for m in _masters(opt)],
                  model=[p.clone() for p in model.parameters()],
                  state=copy.deepcopy(opt.optimizer.state_dict()["state"]))
    opt.zero_grad()
    with caplog.at_level(logging.WARNING, logger="tritamp.fp16_utils"):
        opt.backward(nn.functional.mse_loss(model(x).float(), y) * float("nan"))
        assert opt.overflow
        assert to_python_float(opt.clip_master_grads(1.0)) == -1.0
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before["masters"], _masters(opt)))
    assert all(torch.equal(a, b) for a, b in zip(before["model"], model.parameters()))
    after = opt.optimizer.state_dict()["state"]
    for k, st in before["state"].items():
        for name, value in st.items():
            assert torch.equal(value, after[k][name]), name
    if dynamic:
        assert opt.loss_scale == 2.**15
        assert "OVERFLOW! Skipping step. Attempted loss scale: 65536.0, reducing to 32768.0" \
            in caplog.text
    else:
        assert opt.loss_scale == 128.0
        assert "OVERFLOW! Skipping step. Attempted loss scale: 128.0, keeping it" in caplog.text
    assert "Gradient overflow" not in caplog.text  # amp's own message is not doubled


@pytest.mark.parametrize("half", HALF, ids=HALF_IDS)
def test_master_gradients_are_the_unscaled_half_gradients(half):
    """A power-of-two scale is exact: the masters' gradients equal the half gradients of
    the unscaled loss, bit for bit."""
    model, opt = _fp16_setup(half, OPTIMIZERS["sgd"], static_loss_scale=1024.0)
    (x, y), = _batches(1)
    model.zero_grad()
    nn.functional.mse_loss(model(x).float(), y).backward()
    expected = [p.grad.float().clone() for p in model.parameters()]
    opt.zero_grad()
    opt.backward(nn.functional.mse_loss(model(x).float(), y))
    grads = opt.inspect_master_grad_data()
    assert len(grads) == 1
    for g, e in zip(grads[0], expected):
        assert g.dtype == torch.float32
        assert torch.equal(g, e)


def test_update_master_grads_false_accumulates_scaled_gradients_then_unscales_once():
    model, opt = _fp16_setup(torch.float16, OPTIMIZERS["sgd"], static_loss_scale=256.0)
    (x1, y1), (x2, y2) = _batches(2)
    # Apex's semantics by hand: scaled half gradients add up, then divide once.
    model.zero_grad()
    for x, y in ((x1, y1), (x2, y2)):
        (nn.functional.mse_loss(model(x).float(), y) * 256.0).backward()
    expected = [p.grad.float() / 256.0 for p in model.parameters()]

    opt.zero_grad()
    opt.backward(nn.functional.mse_loss(model(x1).float(), y1), update_master_grads=False)
    opt.backward(nn.functional.mse_loss(model(x2).float(), y2), update_master_grads=False)
    with pytest.raises(RuntimeError, match="update_master_grads"):
        opt.step()
    opt.update_master_grads()
    opt.update_master_grads()  # nothing new: must not add the same gradients twice
    for m, e in zip(_masters(opt), expected):
        assert torch.equal(m.grad, e)


def test_two_backwards_each_updating_add_up():
    model, opt = _fp16_setup(torch.bfloat16, OPTIMIZERS["sgd"], dynamic_loss_scale=True)
    (x1, y1), (x2, y2) = _batches(2)
    opt.zero_grad()
    opt.backward(nn.functional.mse_loss(model(x1).float(), y1))
    first = [m.grad.clone() for m in _masters(opt)]
    opt.backward(nn.functional.mse_loss(model(x2).float(), y2))
    both = [m.grad.clone() for m in _masters(opt)]
    model.zero_grad()
    nn.functional.mse_loss(model(x2).float(), y2).backward()
    for g, g1, p in zip(both, first, model.parameters()):
        assert torch.equal(g, g1 + p.grad.float())


def test_closure_repeats_an_overflowing_evaluation_at_a_lower_scale():
    """The closure's first evaluations overflow fp16 at a huge scale; the step then
    uses the first finite gradients, which a power-of-two scale leaves exact."""
    (x, y), = _batches(1)
    results = []
    for init_scale in (2.**24, 1.0):
        model, opt = _fp16_setup(torch.float16, lambda p: torch.optim.SGD(p, lr=0.1),
                                 dynamic_loss_scale=True,
                                 dynamic_loss_args=dict(init_scale=init_scale))
        calls = []

        def closure():
            calls.append(1)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x).float(), y)
            opt.backward(loss)
            return loss

        loss = opt.step(closure)
        assert torch.isfinite(loss)
        results.append(([m.clone() for m in _masters(opt)], len(calls), opt.loss_scale))
    (masters_big, calls_big, scale_big), (masters_one, calls_one, _) = results
    assert calls_one == 1 and calls_big > 1
    assert scale_big == 2.**24 / 2 ** (calls_big - 1)
    for a, b in zip(masters_big, masters_one):
        assert torch.equal(a, b)


def test_closure_that_always_overflows_at_the_scale_floor_raises():
    model, opt = _fp16_setup(torch.float16, OPTIMIZERS["sgd"], dynamic_loss_scale=True,
                             dynamic_loss_args={"init_scale": 1.0})
    (x, y), = _batches(1)

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y) * float("inf")
        opt.backward(loss)
        return loss

    with pytest.raises(RuntimeError, match="cannot go lower"):
        opt.step(closure)


def test_clip_master_grads_clips_the_unscaled_master_gradients():
    model, opt = _fp16_setup(torch.bfloat16, OPTIMIZERS["fused-sgd"], dynamic_loss_scale=True)
    (x, y), = _batches(1)
    opt.backward(nn.functional.mse_loss(model(x).float(), y) * 100.0)
    # backward() unscaled the half gradients (left scaled by 2**16, exact) into the
    # masters' fp32 gradients, as Apex's update_master_grads did, with a fused optimizer
    # too (a loop may clip them itself); the fp32 parameters (BatchNorm's) are their own
    # masters, unscaled in place
    for m, p in zip(_masters(opt), model.parameters()):
        if p.dtype == torch.float32:
            assert m is p
        else:
            torch.testing.assert_close(m.grad, p.grad.float() / 2.**16, rtol=0, atol=0)
    unscaled = [m.grad.clone() for m in _masters(opt)]
    ref_norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in unscaled]))
    norm = opt.clip_master_grads(0.5)
    assert float(ref_norm) > 0.5
    torch.testing.assert_close(norm, ref_norm, **TOL[torch.float32])
    coef = 0.5 / (ref_norm + 1e-6)
    for m, g in zip(_masters(opt), unscaled):
        torch.testing.assert_close(m.grad, g * coef, **TOL[torch.float32])


# -- checkpoints -----------------------------------------------------------------------------

@pytest.mark.parametrize("opt_name", ["adam", "fused-sgd"])
def test_state_dict_round_trip_resumes_bit_for_bit(opt_name):
    make_opt = OPTIMIZERS[opt_name]
    batches = _batches(4)
    model, opt = _fp16_setup(torch.float16, make_opt, dynamic_loss_scale=True,
                             dynamic_loss_args=dict(init_scale=2.**10, scale_window=3))

    def train(model, opt, data):
        for x, y in data:
            opt.zero_grad()
            opt.backward(nn.functional.mse_loss(model(x).float(), y))
            opt.step()

    train(model, opt, batches[:2])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    sd = ckpt["optimizer"]
    assert set(sd) == {"loss_scaler", "dynamic_loss_scale", "overflow",
                       "first_closure_call_this_step", "optimizer_state_dict", "fp32_from_fp16"}
    assert sd["loss_scaler"]["loss_scale"] == 2.**10 and sd["loss_scaler"]["unskipped"] == 2
    assert all(m.dtype == torch.float32 for m in sd["fp32_from_fp16"][0])

    model2, opt2 = _fp16_setup(torch.float16, make_opt, dynamic_loss_scale=True,
                               dynamic_loss_args=dict(init_scale=1.0, scale_window=3))
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(sd)
    assert opt2.loss_scale == 2.**10
    for a, b in zip(_masters(opt), _masters(opt2)):
        assert torch.equal(a, b)  # the fp32 masters themselves, not the rounded half weights
    train(model, opt, batches[2:])
    train(model2, opt2, batches[2:])
    assert opt.loss_scale == opt2.loss_scale == 2.**11  # the growth counter came along
    for a, b in zip(_masters(opt), _masters(opt2)):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_loading_a_static_checkpoint_into_a_dynamic_optimizer_takes_its_mode():
    model, opt = _fp16_setup(torch.float16, OPTIMIZERS["sgd"], static_loss_scale=64.0)
    sd = opt.state_dict()
    model2, opt2 = _fp16_setup(torch.float16, OPTIMIZERS["sgd"], dynamic_loss_scale=True)
    opt2.load_state_dict(sd)
    assert opt2.dynamic_loss_scale is False and not opt2.loss_scaler.dynamic
    assert opt2.loss_scale == 64.0
    opt2.loss_scale = 32.0
    assert opt2.loss_scale == 32.0


def test_an_apex_checkpoint_with_a_pickled_scaler_object_loads():
    class ApexAmpLossScaler:  # the attributes Apex's pickled amp LossScaler carries
        _loss_scale, _unskipped = 512.0, 3

        def loss_scale(self):
            return self._loss_scale

    model, opt = _fp16_setup(torch.float16, OPTIMIZERS["sgd"], dynamic_loss_scale=True)
    sd = dict(opt.state_dict(), loss_scaler=ApexAmpLossScaler())
    opt.load_state_dict(sd)
    assert opt.loss_scale == 512.0
    assert opt.loss_scaler.state_dict()["unskipped"] == 3


# -- host reads ----------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make_opt,reads", [
    (lambda p: FusedSGD(p, lr=0.1, momentum=0.9), []),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True), []),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), ["__bool__"]),
], ids=["tritamp-fused", "torch-fused", "plain"])
def test_step_reads_the_device_only_for_optimizers_that_cannot_skip_there(make_opt, reads,
                                                                         device):
    model, opt = _fp16_setup(torch.float16, make_opt, device, dynamic_loss_scale=True)
    (x, y), = _batches(1, device=device)

    def step():
        opt.zero_grad(set_grads_to_None=True)
        opt.backward(nn.functional.mse_loss(model(x).float(), y))
        opt.step()

    step()
    counter = HostReads()
    with counter:
        step()
    assert counter.calls == reads


# -- refusals -------------------------------------------------------------------------------

def test_refusals_name_the_fix():
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        FP16_Optimizer(torch.optim.SGD(nn.Linear(2, 2).double().parameters(), lr=0.1))
    with pytest.raises(TypeError, match="scale_window"):
        FP16_Optimizer(torch.optim.SGD(nn.Linear(2, 2).half().parameters(), lr=0.1),
                       dynamic_loss_scale=True, dynamic_loss_args=dict(window=10))
    with pytest.raises(ValueError, match="growth_factor"):
        FP16_Optimizer(torch.optim.SGD(nn.Linear(2, 2).half().parameters(), lr=0.1),
                       dynamic_loss_scale=True, dynamic_loss_args=dict(scale_factor=1.0))
    lin = nn.Linear(2, 2)
    _, used = amp.initialize(lin, torch.optim.SGD(lin.parameters(), lr=0.1), opt_level="O2",
                             verbosity=0)
    with pytest.raises(RuntimeError, match="already managed"):
        FP16_Optimizer(used)
    _, opt = _fp16_setup(torch.float16, OPTIMIZERS["sgd"])
    with pytest.raises(RuntimeError, match="state_dict"):
        copy.deepcopy(opt)
    with pytest.raises(ValueError, match="master lists"):
        opt.load_state_dict(dict(opt.state_dict(), fp32_from_fp16=[[]]))


# -- the manual helpers ------------------------------------------------------------------------

def test_network_to_half_and_FP16Model_keep_batchnorm_fp32():
    net = network_to_half(_net(), dtype=torch.bfloat16)
    assert isinstance(net[0], tofp16)
    dtypes = [(type(m).__name__, p.dtype) for m in net.modules() for p in m.parameters(recurse=False)]
    assert dtypes == [("Linear", torch.bfloat16)] * 2 + [("BatchNorm1d", torch.float32)] * 2 + \
        [("Linear", torch.bfloat16)] * 2
    assert net(torch.randn(4, 6)).dtype == torch.bfloat16

    emb = FP16Model(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2)), dtype=torch.float16)
    out = emb(torch.tensor([[1, 2], [3, 4]]))  # integer inputs pass through uncast
    assert out.dtype == torch.float16 and out.shape == (2, 2, 2)

    bn = BN_convert_float(nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm2d(3, affine=False)).half())
    assert bn[0].weight.dtype == torch.float32
    assert bn[1].running_mean.dtype == torch.float16  # not affine: left as it was


@pytest.mark.parametrize("flat_master", [False, True], ids=["lists", "flat"])
@pytest.mark.parametrize("half", HALF, ids=HALF_IDS)
def test_prep_param_lists_and_the_copies(half, flat_master):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 3 * 3, 5))
    model = model.to(half)
    model[0].weight.data = model[0].weight.data.to(memory_format=torch.channels_last)
    model[2].bias.requires_grad_(False)
    model_params, masters = prep_param_lists(model, flat_master=flat_master)
    assert len(model_params) == 3
    if flat_master:
        assert len(masters) == 1 and masters[0].numel() == sum(p.numel() for p in model_params)
        assert torch.equal(masters[0].grad, torch.zeros_like(masters[0]))
        views = torch.split(masters[0].detach(), [p.numel() for p in model_params])
        assert all(torch.equal(v, p.detach().float().reshape(-1)) for v, p in zip(views, model_params))
    else:
        assert all(m.dtype == torch.float32 and m.requires_grad for m in masters)
        assert all(torch.equal(m, p.float()) for m, p in zip(masters, model_params))
        assert all(m.data_ptr() != p.data_ptr() for m, p in zip(masters, model_params))

    model(torch.randn(2, 3, 5, 5, dtype=half)).sum().backward()
    model_params[1].grad = None  # a parameter that received no gradient
    model_grads_to_master_grads(model_params, masters, flat_master=flat_master)
    if flat_master:
        pieces = torch.split(masters[0].grad, [p.numel() for p in model_params])
        for piece, p in zip(pieces, model_params):
            expected = torch.zeros(p.numel()) if p.grad is None else p.grad.float().reshape(-1)
            assert torch.equal(piece, expected)
    else:
        assert masters[1].grad is None
        for m, p in zip(masters, model_params):
            if p.grad is not None:
                assert torch.equal(m.grad, p.grad.float())

    with torch.no_grad():
        for m in masters:
            m.add_(torch.linspace(-1e-2, 1e-2, m.numel()).reshape(m.shape))
    master_params_to_model_params(model_params, masters, flat_master=flat_master)
    values = torch.split(masters[0].detach(), [p.numel() for p in model_params]) if flat_master \
        else [m.detach() for m in masters]
    for v, p in zip(values, model_params):
        assert p.dtype == half
        assert torch.equal(p.detach().float().reshape(-1), v.reshape(-1).to(half).float())


def test_prep_param_lists_flat_refuses_mixed_dtypes():
    model = nn.Sequential(nn.Linear(2, 2).half(), nn.Linear(2, 2))
    with pytest.raises(TypeError, match="flat_master=False"):
        prep_param_lists(model, flat_master=True)
    with pytest.raises(ValueError, match="prep_param_lists"):
        master_params_to_model_params(list(model.parameters()), [torch.zeros(1)])


def test_to_python_float_and_clip_grad_norm():
    assert to_python_float(torch.tensor(2.5)) == 2.5
    assert to_python_float([3.0]) == 3.0
    torch.manual_seed(1)
    a = [torch.randn(7, requires_grad=True), torch.randn(3, 5, requires_grad=True)]
    b = [t.detach().clone().requires_grad_() for t in a]
    for t, u in zip(a, b):
        t.grad = torch.randn_like(t) * 3
        u.grad = t.grad.clone()
    norm = clip_grad_norm(a, 1.0)
    ref = torch.nn.utils.clip_grad_norm_(b, 1.0)
    torch.testing.assert_close(norm, ref, **TOL[torch.float32])
    for t, u in zip(a, b):
        torch.testing.assert_close(t.grad, u.grad, **TOL[torch.float32])


# -- legacy scalers ----------------------------------------------------------------------------

def _apex_legacy_dynamic(overflows, init_scale, factor, window):
    """Apex's fp16_utils.DynamicLossScaler.update_scale, the reference trajectory."""
    scale, cur_iter, last_overflow = init_scale, 0, -1
    out = []
    for overflow in overflows:
        if overflow:
            scale = max(scale / factor, 1)
            last_overflow = cur_iter
        elif (cur_iter - last_overflow) % window == 0:
            scale *= factor
        cur_iter += 1
        out.append(scale)
    return out


def test_dynamic_loss_scaler_follows_apex_legacy_rule():
    overflows = [False] * 3 + [True] + [False] * 7 + [True] * 12 + [False] * 5
    expected = _apex_legacy_dynamic(overflows, 2.**8, 2., 3)
    scaler = DynamicLossScaler(init_scale=2.**8, scale_factor=2., scale_window=3)
    got = []
    for i, overflow in enumerate(overflows):
        # half the updates pass the flag as a device tensor, as a sync-free script would
        scaler.update_scale(torch.tensor(float(overflow)) if i % 2 else overflow)
        got.append(scaler.loss_scale)
    assert got == expected
    assert scaler.cur_iter == len(overflows)


class _ApexLegacyDynamic:
    """Apex's fp16_utils.DynamicLossScaler: plain attributes its update_scale reads."""

    def __init__(self, init_scale, scale_factor, scale_window):
        self.cur_scale, self.scale_factor, self.scale_window = init_scale, scale_factor, scale_window
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update_scale(self, overflow):
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def test_dynamic_loss_scaler_follows_its_attributes_as_apex_legacy_does():
    """A script may set scale_factor, scale_window, cur_scale, cur_iter and
    last_overflow_iter between updates (a restored checkpoint, a schedule): the next
    update_scale follows them, as Apex's, which read them every call (they were stored
    and ignored)."""
    overflows = [False] * 4 + [True] + [False] * 9 + [True, True] + [False] * 8
    changes = {2: dict(scale_factor=4.0), 6: dict(scale_window=2),
               9: dict(cur_scale=2.0 ** 12), 12: dict(cur_iter=40, last_overflow_iter=37),
               18: dict(scale_window=5, scale_factor=2.0)}
    ours = DynamicLossScaler(init_scale=2.**8, scale_factor=2., scale_window=3)
    ref = _ApexLegacyDynamic(2.**8, 2., 3)
    for i, overflow in enumerate(overflows):
        for name, value in changes.get(i, {}).items():
            setattr(ours, name, value)
            setattr(ref, name, value)
        ours.update_scale(overflow)
        ref.update_scale(overflow)
        assert (ours.loss_scale, ours.cur_scale, ours.cur_iter, ours.last_overflow_iter) == \
            (ref.cur_scale, ref.cur_scale, ref.cur_iter, ref.last_overflow_iter), i
        assert (ours.scale_factor, ours.scale_window) == (ref.scale_factor, ref.scale_window)
    static = LossScaler(4.0)
    static.cur_scale = 8.0
    assert static.loss_scale == 8.0
    for name, bad in (("scale_factor", 1.0), ("scale_window", 0), ("cur_iter", -1),
                      ("last_overflow_iter", 1.5), ("cur_scale", 0.0)):
        with pytest.raises(ValueError, match=name.replace("cur_scale", "loss_scale")):
            setattr(ours, name, bad)


def test_legacy_scalers_check_and_scale():
    p = torch.zeros(3, requires_grad=True)
    for scaler in (LossScaler(4.0), DynamicLossScaler(init_scale=8.0)):
        p.grad = None
        loss = (p.half() * torch.tensor([1.0, 2.0, 3.0]).half()).sum()
        scaler.backward(loss)
        assert torch.equal(p.grad, torch.tensor([1.0, 2.0, 3.0]) * scaler.loss_scale)
        assert scaler.has_overflow([p]) is False
        p.grad[1] = float("inf")
        assert scaler.has_overflow([p]) is True
        assert DynamicLossScaler._has_inf_or_nan(torch.tensor([0.0, float("nan")]))
    static = LossScaler(4.0)
    static.update_scale(True)
    assert static.loss_scale == 4.0


@pytest.mark.parametrize("cpu_path", [False, True], ids=["triton", "cpu-path"])
def test_per_step_helpers_keep_their_sweeps_when_the_gradients_move(cpu_path):
    """A manual loop calls model_grads_to_master_grads, master_params_to_model_params and
    has_overflow every step, on new gradient tensors each time: the kept sweeps take
    them (no launch table built or uploaded after the first step), the copies are the
    exact casts, an inf is still seen after the moves, and no gradient is kept alive."""
    import contextlib
    import gc
    import weakref

    from tritamp.testing import force_cpu_path, recording_uploads

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(torch.bfloat16)
    model_params, masters = prep_param_lists(model)
    scaler = DynamicLossScaler(init_scale=8.0)
    alive, uploads = [], []
    with force_cpu_path() if cpu_path else contextlib.nullcontext():
        for step in range(5):
            for p in model_params:
                p.grad = torch.randn(p.shape).to(torch.bfloat16)
            if step == 4:
                model_params[1].grad[3] = float("inf")
            with recording_uploads() as up:
                overflow = scaler.has_overflow(model_params)
                model_grads_to_master_grads(model_params, masters)
                master_params_to_model_params(model_params, masters)
            uploads.append(len(up))
            assert overflow is (step == 4), step
            for p, m in zip(model_params, masters):
                assert torch.equal(m.grad, p.grad.float()), step
                assert torch.equal(p.data, m.data.to(torch.bfloat16)), step
            alive.append([p.grad for p in model_params])
        probe = weakref.ref(alive[-1][0])
    if not cpu_path:
        assert uploads[2:] == [0, 0, 0], uploads
    for p, m in zip(model_params, masters):
        p.grad = m.grad = None
    del alive
    gc.collect()
    assert probe() is None


@pytest.mark.parametrize("cpu_path", [False, True], ids=["triton", "cpu-path"])
def test_a_kept_sweep_never_takes_tensors_on_another_device(cpu_path):
    """After a copy between CPU tensors, the same layout with a master on another device
    is refused by name, as the one-shot copy refuses it, and nothing is written (a kept
    sweep's rebind does not look at devices: on a GPU it wrote host addresses from the
    kernel)."""
    import contextlib

    from tritamp.testing import force_cpu_path
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)).to(torch.bfloat16)
    model_params, masters = prep_param_lists(model)
    with force_cpu_path() if cpu_path else contextlib.nullcontext():
        for p in model_params:
            p.grad = torch.randn(p.shape).to(torch.bfloat16)
        model_grads_to_master_grads(model_params, masters)
        for p in model_params:
            p.grad = torch.randn(p.shape).to(torch.bfloat16)
        masters[1] = nn.Parameter(torch.empty(masters[1].shape, device="meta"))
        before = masters[0].grad.clone()
        with pytest.raises(ValueError, match=r"model_params\[1\].grad is on cpu but "
                                             r"master_params\[1\] is on meta"):
            model_grads_to_master_grads(model_params, masters)
        assert torch.equal(masters[0].grad, before)
        # the copy back into the model checks every pair's device before any copy
        weights = [p.detach().clone() for p in model_params]
        with pytest.raises(ValueError, match=r"master_params\[1\] is torch.float32 of shape "
                                             r"\(16,\) on meta, but model_params\[1\] has "
                                             r"shape \(16,\) on cpu"):
            master_params_to_model_params(model_params, masters)
        assert all(torch.equal(p, w) for p, w in zip(model_params, weights))


@pytest.mark.parametrize("flat_master", [False, True], ids=["per-param", "flat"])
def test_model_grads_to_master_grads_refuses_before_writing(flat_master):
    """A sparse model gradient, one of another shape, and a master gradient that cannot
    take the copy are each refused by name before any master gradient is made or
    written: the masters' gradients are as they were (None, or their old values)."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(torch.bfloat16)
    model_params, masters = prep_param_lists(model, flat_master=flat_master)
    model(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()

    def snapshot():
        return [None if m.grad is None else m.grad.clone() for m in masters]

    def same(before):
        return all((b is None and m.grad is None) or
                   (b is not None and m.grad is not None and torch.equal(b, m.grad))
                   for b, m in zip(before, masters))

    good = [p.grad for p in model_params]
    cases = [(2, good[2].to_sparse(), "model_params\\[2\\].grad is a sparse tensor")]
    for first in (True, False):      # masters without gradients, then with old ones
        if not first:
            model_grads_to_master_grads(model_params, masters, flat_master=flat_master)
        for i, bad, message in cases:
            before = snapshot()
            model_params[i].grad = bad
            with pytest.raises(ValueError, match=message):
                model_grads_to_master_grads(model_params, masters, flat_master=flat_master)
            model_params[i].grad = good[i]
            assert same(before), (i, first)
        if not flat_master:          # masters out of order: a weight's master is a bias
            before = snapshot()
            swapped = [masters[0], masters[1], masters[3], masters[2]]
            with pytest.raises(ValueError, match="model_params\\[2\\].grad has shape \\(2, 3\\) "
                                                 "but master_params\\[2\\] has shape \\(2,\\)"):
                model_grads_to_master_grads(model_params, swapped)
            assert same(before), first
    if not flat_master:
        before = snapshot()
        masters[1].grad = torch.zeros(3).to_sparse()
        with pytest.raises(ValueError, match="master_params\\[1\\].grad is a sparse tensor of "
                                             "shape \\(3,\\)"):
            model_grads_to_master_grads(model_params, masters)
        assert masters[1].grad.is_sparse
        assert all(torch.equal(before[i], masters[i].grad) for i in (0, 2, 3))


def test_float64_pairs_are_copied_by_torch():
    """A float64 model parameter or master (a dtype the copy sweep does not take) is
    copied with torch's copy, the others with the sweep: every copy exact."""
    model_params = [nn.Parameter(torch.randn(3, dtype=torch.float64)),
                    nn.Parameter(torch.randn(4).to(torch.bfloat16))]
    masters = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    for p in model_params:
        p.grad = torch.randn(p.shape).to(p.dtype)
    model_grads_to_master_grads(model_params, masters)
    for p, m in zip(model_params, masters):
        assert torch.equal(m.grad, p.grad.to(m.dtype))
    master_params_to_model_params(model_params, masters)
    for p, m in zip(model_params, masters):
        assert torch.equal(p.detach(), m.detach().to(p.dtype))


class _TwoBranches(nn.Module):
    """``a`` always used; ``b`` only when asked (a half branch and an fp32 scale)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(4, 2)
        self.s = nn.Parameter(torch.ones(2))

    def forward(self, x, use_b):
        y = self.a(x)
        return y + self.b(x) * self.s.to(y.dtype) if use_b else y


def test_zero_grad_keeps_an_unused_parameters_zero_gradient_as_apex():
    """zero_grad() (set_grads_to_None=False, Apex's default) zeroes the gradients in place
    and Apex's update_master_grads copies those zeros to the masters: a branch the next
    backward does not reach still steps with a zero gradient (momentum, weight decay).
    (It was frozen: the zeros were dropped and its masters got no gradient.)"""
    uses = [True, False, False]
    x = torch.ones(3, 4)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)

    ref = _TwoBranches()
    ref_opt = sgd(ref.parameters())
    model = _TwoBranches()
    model.a.to(torch.bfloat16)
    model.b.to(torch.bfloat16)
    opt = FP16_Optimizer(sgd(model.parameters()), verbose=False)
    for step, use_b in enumerate(uses):
        ref_opt.zero_grad(set_to_none=False)
        ref(x, use_b).sum().backward()
        ref_opt.step()
        opt.zero_grad()
        opt.backward(model(x.bfloat16(), use_b).float().sum())
        if not use_b:  # the unused branch's masters (and the fp32 scale) get zeros
            for half, master in zip(opt.all_fp16_params, opt.all_fp32_from_fp16_params):
                if half is model.b.weight or half is model.b.bias:
                    assert master.grad is not None and not master.grad.any(), step
            assert model.s.grad is not None and not model.s.grad.any(), step
        opt.step()
    masters = {id(h): m for h, m in zip(opt.all_fp16_params, opt.all_fp32_from_fp16_params)}
    # (step 0's gradients went through a bf16 forward: bf16's tolerance)
    for ours, theirs in ((masters[id(model.b.weight)], ref.b.weight),
                         (masters[id(model.b.bias)], ref.b.bias), (model.s, ref.s)):
        torch.testing.assert_close(ours, theirs, **TOL[torch.bfloat16])


def test_zero_grad_zeroes_gradients_that_are_views_of_one_buffer():
    """Gradients that are views of one flat buffer (DDP's gradient_as_bucket_view) are
    zeroed in place, as torch's Optimizer.zero_grad zeroes them: detaching a view in
    place raises, so only a gradient with a graph is detached. The views stay views of
    the buffer."""
    model = FP16Model(_net(), dtype=torch.bfloat16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    x, y = _batches(1)[0]
    opt.backward(nn.functional.mse_loss(model(x).float(), y))
    opt.step()
    params = list(model.parameters())  # (bf16, and batch norm's fp32: one bucket each)
    buckets = {dt: torch.ones(sum(p.numel() for p in params if p.dtype is dt), dtype=dt)
               for dt in {p.dtype for p in params}}
    assert len(buckets) == 2
    views, at = [], dict.fromkeys(buckets, 0)
    for p in params:
        p.grad = buckets[p.dtype][at[p.dtype]:at[p.dtype] + p.numel()].view_as(p)
        views.append(p.grad)
        at[p.dtype] += p.numel()
    opt.zero_grad()
    assert not any(b.any() for b in buckets.values())
    assert all(p.grad is v and p.grad._base is buckets[p.dtype] for p, v in zip(params, views))
    assert all(not m.grad.any() for m in _masters(opt) if m.grad is not None)


def test_fp16_optimizer_wraps_larc_as_apex_documents():
    """Apex's LARC docstring: ``optim = LARC(optim); optim = FP16_Optimizer(optim)``. The
    bf16 model's masters follow an fp32 LARC(SGD) on the same data (bf16's tolerance),
    and an overflow skips the step, LARC's rewrite included (it was refused: not a
    torch.optim.Optimizer)."""
    from tritamp.parallel import LARC
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))

    def build(dtype):
        torch.manual_seed(3)
        model = nn.Linear(8, 4).to(dtype)
        return model, LARC(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9,
                                           weight_decay=1e-2))

    ref, ref_opt = build(torch.float32)
    model, larc = build(torch.bfloat16)
    opt = FP16_Optimizer(larc, dynamic_loss_scale=True, verbose=False)
    for factor in (1.0, float("inf"), 1.0, 1.0):
        before = [m.detach().clone() for m in _masters(opt)]
        opt.zero_grad()
        opt.backward(model(x.bfloat16()).float().pow(2).mean() * factor)
        opt.step()
        if factor != 1.0:
            assert opt.overflow
            assert all(torch.equal(b, m) for b, m in zip(before, _masters(opt)))
            continue
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
    for m, r in zip(_masters(opt), ref.parameters()):
        torch.testing.assert_close(m, r, **TOL[torch.bfloat16])
    assert all(g["weight_decay"] == 1e-2 for g in opt.param_groups)


def test_convert_network_keeps_a_shared_buffer_shared():
    """A buffer two modules share (a table, running statistics) is cast in place, as
    Apex's ``buf.data = ...`` did: still one tensor afterwards (it became two)."""
    shared = torch.arange(4.0)
    a, b = nn.Module(), nn.Module()
    a.register_buffer("table", shared)
    b.register_buffer("table", shared)
    net = nn.Sequential(a, b)
    convert_network(net, torch.bfloat16)
    assert a.table is b.table is shared and shared.dtype == torch.bfloat16
    a.table.add_(1)
    assert torch.equal(b.table, torch.arange(1.0, 5.0, dtype=torch.bfloat16))


def _overflowed(make_opt=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)):
    """An FP16_Optimizer whose last backward overflowed (bf16 model, dynamic scale)."""
    model, opt = _fp16_setup(torch.bfloat16, make_opt, dynamic_loss_scale=True)
    (x, y), = _batches(1)
    opt.zero_grad()
    opt.backward(nn.functional.mse_loss(model(x.bfloat16()).float(), y) * float("inf"))
    return model, opt, x, y


def test_step_with_a_closure_after_an_overflowing_backward_is_skipped_as_apex():
    # Apex's step returned on self.overflow before the closure; the closure ran and the
    # step was taken.
    model, opt, x, y = _overflowed()
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.bfloat16()).float(), y)
        opt.backward(loss)
        return loss

    assert opt.step(closure) is None
    assert calls == []
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b.detach())


@pytest.mark.parametrize("value", [True, False])
def test_setting_overflow_decides_the_next_step_as_apex(value):
    # Apex's step read the attribute: True skipped the step (it ran), False let it run.
    model, opt = _fp16_setup(torch.bfloat16, lambda p: torch.optim.SGD(p, lr=0.1),
                             dynamic_loss_scale=True)
    (x, y), = _batches(1)
    opt.zero_grad()
    opt.backward(nn.functional.mse_loss(model(x.bfloat16()).float(), y))
    before = [p.detach().clone() for p in model.parameters()]
    opt.overflow = value
    assert opt.overflow is value
    opt.step()
    moved = not all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    assert moved is not value


@pytest.mark.parametrize("make_opt", [lambda p: FusedSGD(p, lr=0.5, momentum=0.9),
                                      lambda p: FusedAdam(p, lr=0.1)],
                         ids=["FusedSGD", "FusedAdam"])
def test_master_gradients_exist_after_backward_for_a_loop_that_clips_them(make_opt):
    """As Apex's update_master_grads, backward() leaves the fp32 masters' gradients
    (unscaled) whatever the wrapped optimizer: clipping over fp32_from_fp16_groups
    (Megatron's loop) is clip_master_grads. With a fused optimizer they were None there
    (left to the step to unscale) and the loop clipped nothing."""
    def run(clip):
        torch.manual_seed(0)
        model = nn.Linear(4, 3).to(torch.bfloat16)
        opt = FP16_Optimizer(make_opt(model.parameters()), static_loss_scale=128.0,
                             verbose=False)
        x = torch.randn(5, 4, dtype=torch.bfloat16)
        for _ in range(2):
            opt.zero_grad()
            opt.backward(model(x).float().pow(2).sum())
            masters = [p for g in opt.fp32_from_fp16_groups for p in g]
            assert all(p.grad is not None for p in masters)
            if clip == "loop":
                torch.nn.utils.clip_grad_norm_(masters, 0.01)
            elif clip == "method":
                opt.clip_master_grads(0.01)
            opt.step()
        return [p.detach().clone() for p in model.parameters()]
    looped, method, unclipped = run("loop"), run("method"), run(None)
    assert all(torch.equal(a, b) for a, b in zip(looped, method))
    assert any(not torch.equal(a, b) for a, b in zip(looped, unclipped))


# -- the fp32 parameters (BatchNorm under FP16Model) through skips, zero_grad and failures --
def _bn_setup(make_opt=OPTIMIZERS["sgd"]):
    model, opt = _fp16_setup(torch.bfloat16, make_opt, dynamic_loss_scale=True)
    return model, opt, _batches(1)[0]


def _loss(model, x, y, factor=1.0):
    return nn.functional.mse_loss(model(x).float(), y) * factor


def _state_of(model, opt):
    """Every parameter, master, gradient and optimizer state tensor (clones)."""
    inner = opt.optimizer
    return ([p.detach().clone() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            [p.detach().clone() for p in _masters(opt)],
            [{k: v.clone() for k, v in inner.state[p].items() if torch.is_tensor(v)}
             for p in _masters(opt) if p in inner.state])


def _assert_same(a, b):
    for x, y in zip(a[:3], b[:3]):
        assert len(x) == len(y)
        for s, t in zip(x, y):
            assert (s is None and t is None) or torch.equal(s, t)
    assert len(a[3]) == len(b[3])
    for s, t in zip(a[3], b[3]):
        assert s.keys() == t.keys() and all(torch.equal(s[k], t[k]) for k in s)


def test_an_inf_kept_in_an_fp32_gradient_after_a_skip_skips_the_next_step(path):
    # No zero_grad after the skipped step: the next backward adds to the inf (as torch
    # accumulates); Apex's update_master_grads checked the whole sum, and so does this.
    model, opt, (x, y) = _bn_setup()
    bn = model.network[1].weight
    opt.backward(_loss(model, x, y) + bn[0] * float("inf"))
    assert opt.overflow
    before = _state_of(model, opt)
    opt.step()
    opt.backward(_loss(model, x, y))
    assert opt.overflow  # the kept inf is part of what the step would read
    opt.step()
    after = _state_of(model, opt)
    for s, t in zip(before[0], after[0]):
        assert torch.equal(s, t)
    opt.zero_grad()
    opt.backward(_loss(model, x, y))
    assert not opt.overflow
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_zero_grad_drops_the_gradients_an_unfinished_accumulation_stashed(path):
    model, opt, (x, y) = _bn_setup()
    opt.backward(_loss(model, x, y))
    opt.backward(_loss(model, x, y, 100.0), update_master_grads=False)
    opt.zero_grad()
    opt.backward(_loss(model, x, y, 2.0))
    twin, twin_opt, _ = _bn_setup()
    twin_opt.zero_grad()
    twin_opt.backward(_loss(twin, x, y, 2.0))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)  # the fp32 ones: 2.0's alone, nothing stale


@pytest.mark.parametrize("closure", [False, True])
def test_a_step_after_an_overflow_and_zero_grad_changes_nothing(closure, path):
    # Apex's step returned early while the overflow flag stood (zero_grad left it).
    model, opt, (x, y) = _bn_setup()
    opt.zero_grad()
    opt.backward(_loss(model, x, y))
    opt.step()  # momentum buffers now hold something
    opt.backward(_loss(model, x, y) * float("inf"))
    opt.zero_grad()
    assert opt.overflow
    before = _state_of(model, opt)

    def again():
        opt.backward(_loss(model, x, y) * float("inf"))

    assert opt.step(again if closure else None) is None
    _assert_same(before, _state_of(model, opt))


def test_a_step_without_a_backward_since_steps_nothing_fp32_parameters_included(path):
    model, opt, (x, y) = _bn_setup()
    opt.zero_grad()
    opt.backward(_loss(model, x, y))
    opt.step()
    before = _state_of(model, opt)
    opt.step()  # a second step after one backward
    _assert_same(before, _state_of(model, opt))
    opt.zero_grad()
    before = _state_of(model, opt)
    opt.step()  # zero_grad(); step()
    _assert_same(before, _state_of(model, opt))
    opt.backward(_loss(model, x, y))
    opt.step()  # and a backward makes the next step a step
    assert not all(torch.equal(p, q) for p, q in zip(before[0], model.parameters()))


@pytest.mark.parametrize("update", [True, False])
def test_a_backward_that_raises_changes_nothing(update, path):
    model, opt, (x, y) = _bn_setup()
    opt.backward(_loss(model, x, y))
    before = _state_of(model, opt)
    with pytest.raises(RuntimeError, match="does not require grad"):
        opt.backward(torch.tensor(1.0), update_master_grads=update)
    _assert_same(before, _state_of(model, opt))
    opt.step()  # the first backward's step, as if the failed call never happened
    twin, twin_opt, _ = _bn_setup()
    twin_opt.backward(_loss(twin, x, y))
    twin_opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_master_params_to_model_params_refuses_a_mismatched_master_before_any_copy():
    # Pairs of different layouts go through torch's copy, which broadcast a master of
    # another shape (a (4,) master filled a (3, 4) parameter) and ran before the sweep
    # checked the other pairs (pair 0 written, then pair 1 refused)
    a, b = torch.zeros(3, 4), torch.zeros(3)
    for masters, bad in (([torch.ones(4), torch.ones(3)], r"master_params\[0\] is "
                          r"torch.float32 of shape \(4,\) on cpu, but model_params\[0\] has "
                          r"shape \(3, 4\)"),
                         ([torch.ones(4, 3).t() * 5, torch.ones(3, 1)], r"master_params\[1\] "
                          r"is torch.float32 of shape \(3, 1\)"),
                         ([None, torch.ones(3)], r"master_params\[0\] is NoneType")):
        with pytest.raises(ValueError, match=r"master_params_to_model_params: " + bad):
            master_params_to_model_params([a, b], masters)
        assert not a.any() and not b.any(), "written before the refusal"
    with pytest.raises(ValueError, match=r"the flat master has shape \(3, 5\), expected one "
                                         r"dimension"):
        master_params_to_model_params([a, b], [torch.ones(3, 5)], flat_master=True)
    master_params_to_model_params([a, b], [torch.ones(4, 3).t() * 5, torch.ones(3)])
    assert torch.equal(a, torch.full((3, 4), 5.0)) and torch.equal(b, torch.ones(3))


def test_load_state_dict_checks_its_flags_and_keys_before_anything_loads():
    # overflow was read last, through bool(), after the optimizer state, the scaler and
    # the masters had been replaced; a missing entry was a bare KeyError
    model = nn.Linear(3, 2).to(torch.bfloat16)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         dynamic_loss_scale=True, verbose=False)
    opt.backward(model(torch.ones(4, 3, dtype=torch.bfloat16)).float().sum())
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    with torch.no_grad():  # (the masters now differ from the checkpoint's)
        for m in opt.all_fp32_from_fp16_params:
            m.add_(1.0)
    masters = [m.clone() for m in opt.all_fp32_from_fp16_params]
    state = copy.deepcopy(opt.optimizer.state_dict()["state"])
    for key, bad, err, match in (
            ("overflow", torch.tensor([True, False]), TypeError, r"state_dict\['overflow'\] is "
             r"Tensor .*, expected True or False. Nothing was loaded"),
            ("overflow", "yes", TypeError, r"state_dict\['overflow'\] is str 'yes'"),
            ("dynamic_loss_scale", 2, TypeError, r"state_dict\['dynamic_loss_scale'\] is int 2"),
            ("loss_scaler", None, ValueError, r"the state dict has no 'loss_scaler' entry")):
        broken = copy.deepcopy(saved)
        if bad is None:
            del broken[key]
        else:
            broken[key] = bad
        with pytest.raises(err, match=r"FP16_Optimizer.load_state_dict: " + match):
            opt.load_state_dict(broken)
        assert all(torch.equal(a, b) for a, b in zip(masters, opt.all_fp32_from_fp16_params))
        assert all(torch.equal(state[k]["momentum_buffer"], v["momentum_buffer"])
                   for k, v in opt.optimizer.state_dict()["state"].items())
    broken = copy.deepcopy(saved)
    broken["overflow"] = torch.tensor(True)  # (one value: taken as the flag)
    opt.load_state_dict(broken)
    assert opt.overflow
