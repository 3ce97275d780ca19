"""The loss scaler as amp drives it: skipped steps are bitwise no-ops, the scale backs
off and grows as torch.amp.GradScaler's does, Apex's log line, hysteresis, and the
warning when the scale is stuck at its floor."""
import logging
import warnings

import pytest
import torch
from torch import nn

from conftest import TOL
from tritamp import amp

INF = float("inf")
NAN = float("nan")
APEX_MESSAGE = "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0"
# What follows Apex's words on a skip: the gradients that held inf/NaN (mlp() below), most
# first; with an inf loss, every value of every gradient.
EVERY_GRADIENT = ("; non-finite gradients on rank 0: 0.weight (128 values), 2.weight "
                  "(64 values), 0.bias (16 values), 2.bias (4 values)")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def mlp_batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def mse(out, y):
    return ((out.float() - y) ** 2).mean()


def make_opt(kind, model):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)


def step(model, opt, x, y, factor=1.0):
    opt.zero_grad()
    with amp.scale_loss(mse(model(x), y) * factor, opt) as scaled:
        scaled.backward()
    opt.step()


def loss_scale(i=0):
    return amp.state_dict()["loss_scaler%d" % i]["loss_scale"]


def snapshot(model, opt):
    """Everything a skipped step must leave alone, bit for bit."""
    params = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    state = {}
    for i, m in enumerate(amp.master_params(opt)):
        state[i] = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in opt.state.get(m, {}).items()}
    return params, masters, state


def assert_same(a, b):
    (pa, ma, sa), (pb, mb, sb) = a, b
    for x, y in zip(pa + ma, pb + mb):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for k in sa[i]:
            if isinstance(sa[i][k], torch.Tensor):
                assert torch.equal(sa[i][k], sb[i][k]), (i, k)
            else:
                assert sa[i][k] == sb[i][k], (i, k)


def amp_records(caplog):
    return [r for r in caplog.records if r.name == "tritamp.amp" and r.levelno == logging.WARNING]


# --------------------------------------------------------------------------------------
# a skipped step changes nothing
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("poison", ["inf_loss", "nan_grad_hook"])
@pytest.mark.parametrize("kind", ["sgd", "adam_fused"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_overflow_skips_the_step_bitwise(level, kind, poison, caplog):
    caplog.set_level(logging.WARNING, logger="tritamp.amp")
    model = mlp()
    model, opt = amp.initialize(model, make_opt(kind, model), opt_level=level, verbosity=1)
    batches = mlp_batches(3)
    step(model, opt, *batches[0])  # a clean step first: momentum / Adam state exist
    assert loss_scale() == 65536.0
    assert not amp_records(caplog)

    before = snapshot(model, opt)
    if kind == "adam_fused":
        assert all(s["step"].item() == 1.0 for s in before[2].values())
    else:
        assert all("momentum_buffer" in s for s in before[2].values())
    if poison == "inf_loss":
        step(model, opt, *batches[1], factor=INF)
    else:
        weight = model[0].weight
        handle = weight.register_hook(lambda g: g.index_fill(0, torch.tensor([1]), NAN))
        step(model, opt, *batches[1])
        handle.remove()
    assert_same(before, snapshot(model, opt))
    assert loss_scale() == 32768.0
    names = EVERY_GRADIENT if poison == "inf_loss" else \
        "; non-finite gradients on rank 0: 0.weight (8 values)"  # the row the hook filled
    assert [r.getMessage() for r in amp_records(caplog)] == [APEX_MESSAGE + names]

    step(model, opt, *batches[2])  # a clean step updates again
    after = snapshot(model, opt)
    for b, a in zip(before[0] + before[1], after[0] + after[1]):
        assert torch.isfinite(a).all() and not torch.equal(b, a)
    assert loss_scale() == 32768.0
    assert len(amp_records(caplog)) == 1


def test_verbosity_zero_silences_the_overflow_message(caplog):
    caplog.set_level(logging.INFO, logger="tritamp.amp")
    model = mlp()
    model, opt = amp.initialize(model, make_opt("sgd", model), opt_level="O2", verbosity=0)
    (x, y), = mlp_batches(1)
    step(model, opt, x, y, factor=INF)
    assert loss_scale() == 32768.0
    # neither Apex's option printout (INFO) nor the overflow line (WARNING)
    assert [r.getMessage() for r in caplog.records
            if r.name.startswith("tritamp") and r.levelno >= logging.INFO] == []


def test_overflow_message_per_loss_id(caplog):
    caplog.set_level(logging.WARNING, logger="tritamp.amp")
    model = mlp()
    model, opt = amp.initialize(model, make_opt("sgd", model), opt_level="O1", num_losses=2)
    (x, y), = mlp_batches(1)
    with amp.scale_loss(mse(model(x), y) * INF, opt, loss_id=1) as scaled:
        scaled.backward()
    opt.step()
    # (a unit the ReLU cut for every sample keeps finite gradients: 0 * x)
    assert [r.getMessage() for r in amp_records(caplog)] == \
        [APEX_MESSAGE.replace("scaler 0", "scaler 1") + "; non-finite gradients on rank 0: "
         "0.weight (120 values), 2.weight (64 values), 0.bias (15 values), 2.bias (4 values)"]


# --------------------------------------------------------------------------------------
# golden trajectory against torch.amp.GradScaler
# --------------------------------------------------------------------------------------

SCRIPT = [0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0]  # 1: inf in the gradients


def test_scale_trajectory_matches_gradscaler():
    batches = mlp_batches(len(SCRIPT))

    model = mlp()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                opt_level="O1", growth_interval=3, min_loss_scale=2. ** -20,
                                verbosity=0)
    ref = mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)

    ours, theirs = [], []
    for (x, y), bad in zip(batches, SCRIPT):
        factor = INF if bad else 1.0
        before = [p.detach().clone() for p in model.parameters()]
        step(model, opt, x, y, factor)
        skipped = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        ours.append((loss_scale(), skipped))

        before = [p.detach().clone() for p in ref.parameters()]
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = ref(x)
        scaler.scale(mse(out, y) * factor).backward()
        scaler.step(ref_opt)
        scaler.update()
        skipped = all(torch.equal(b, p) for b, p in zip(before, ref.parameters()))
        theirs.append((scaler.get_scale(), skipped))

    assert ours == theirs
    assert [s for _, s in ours] == [bool(b) for b in SCRIPT]
    assert len({scale for scale, _ in ours}) >= 3  # it both backed off and grew
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, **TOL[torch.float32])


# --------------------------------------------------------------------------------------
# hysteresis and the floor
# --------------------------------------------------------------------------------------

def test_hysteresis_two(caplog):
    caplog.set_level(logging.WARNING, logger="tritamp.amp")
    model = mlp()
    model, opt = amp.initialize(model, make_opt("sgd", model), opt_level="O2", hysteresis=2)
    batches = mlp_batches(3)
    step(model, opt, *batches[0])

    before = snapshot(model, opt)
    step(model, opt, *batches[1], factor=INF)
    assert_same(before, snapshot(model, opt))  # skipped ...
    assert loss_scale() == 65536.0             # ... but the scale is kept
    step(model, opt, *batches[2], factor=INF)
    assert_same(before, snapshot(model, opt))
    assert loss_scale() == 32768.0
    messages = [r.getMessage() for r in amp_records(caplog)]
    assert len(messages) == 2
    # Apex's text even where the scale is held (log parsers match it), the reason after it
    assert messages[0].startswith("Gradient overflow.  Skipping step, loss scaler 0 reducing "
                                  "loss scale to 65536.0 (held: at its floor, or hysteresis);")
    assert messages[1] == APEX_MESSAGE


def test_floor_warning_and_no_scale_below_the_floor():
    model = mlp()
    model, opt = amp.initialize(model, make_opt("sgd", model), opt_level="O1",
                                min_loss_scale=1.0, init_scale=4.0, verbosity=0)
    (x, y), = mlp_batches(1)
    before = [p.detach().clone() for p in model.parameters()]
    first_warning, scales = None, []
    for i in range(14):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(model, opt, x, y, factor=INF)
        floor = [w for w in caught if issubclass(w.category, RuntimeWarning)
                 and "floor" in str(w.message)]
        if floor and first_warning is None:
            first_warning = i
        scales.append(loss_scale())
    assert scales[:3] == [2.0, 1.0, 1.0]
    assert min(scales) == 1.0
    assert first_warning is not None and first_warning >= 9, first_warning
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_floor_warning_is_a_pytest_warning():
    model = mlp()
    model, opt = amp.initialize(model, make_opt("sgd", model), opt_level="O2",
                                min_loss_scale=1.0, init_scale=4.0, verbosity=0)
    (x, y), = mlp_batches(1)
    with pytest.warns(RuntimeWarning, match="floor"):
        for _ in range(14):
            step(model, opt, x, y, factor=NAN)
    assert loss_scale() == 1.0


# --------------------------------------------------------------------------------------
# growth and the clamps
# --------------------------------------------------------------------------------------

def test_growth_is_clamped_by_max_loss_scale():
    model = mlp()
    model, opt = amp.initialize(model, make_opt("sgd", model), opt_level="O2",
                                growth_interval=1, max_loss_scale=2. ** 17, verbosity=0)
    (x, y), = mlp_batches(1)
    scales = []
    for _ in range(3):
        step(model, opt, x, y, factor=1e-3)  # small gradients: no overflow at 2**17
        scales.append(loss_scale())
    assert scales == [2. ** 17] * 3


def test_init_scale_above_max_starts_at_max_and_backoff_stops_at_min():
    model = mlp()
    model, opt = amp.initialize(model, make_opt("sgd", model), opt_level="O1",
                                init_scale=2. ** 20, max_loss_scale=2. ** 17,
                                min_loss_scale=2. ** 16, verbosity=0)
    assert loss_scale() == 2. ** 17
    (x, y), = mlp_batches(1)
    scales = []
    for _ in range(3):
        step(model, opt, x, y, factor=INF)
        scales.append(loss_scale())
    assert scales == [2. ** 16] * 3


def test_growth_and_backoff_factors_are_honoured():
    model = mlp()
    model, opt = amp.initialize(model, make_opt("sgd", model), opt_level="O2",
                                init_scale=1024.0, growth_interval=2, growth_factor=4.0,
                                backoff_factor=0.25, verbosity=0)
    (x, y), = mlp_batches(1)
    scales = []
    for factor in (1e-3, 1e-3, INF, 1e-3):
        step(model, opt, x, y, factor=factor)
        scales.append(loss_scale())
    assert scales == [1024.0, 4096.0, 1024.0, 1024.0]


def test_apex_scripts_set_the_scale_through_amp_state():
    """NVIDIA's BERT scripts set ``amp._amp_state.loss_scalers[0]._loss_scale`` (and
    ``_max_loss_scale``) after initialize: the next scale_loss multiplies by it; a value
    that is no scale is refused by name and changes nothing."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    scaler._max_loss_scale = 2.**30
    scaler._loss_scale = 2.**20
    assert scaler._loss_scale == 2.**20 and scaler._max_loss_scale == 2.**30
    with pytest.raises(ValueError, match="_loss_scale must be a finite number > 0"):
        scaler._loss_scale = 0.0
    with pytest.raises(ValueError, match=r"_max_loss_scale must be >= the floor \(1.0\)"):
        scaler._max_loss_scale = 0.5
    assert scaler._loss_scale == 2.**20 and scaler._max_loss_scale == 2.**30
    x, y = mlp_batches(1)[0]
    loss = ((model(x) - y) ** 2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.item() == pytest.approx(loss.item() * 2.**20, rel=1e-6)
        scaled.backward()
    opt.step()
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] in (2.**20, 2.**19)
