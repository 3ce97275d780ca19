"""amp policy layer: what ``initialize`` does to models and optimizers, its errors, and
O1's casting (autocast, ``register_*_function``, the decorators, ``disable_casts``).

Training, checkpoints and gradient handling are in ``test_amp_levels.py``; the loss
scaler (overflow, logging, golden trajectory) in ``test_amp_scaler.py``.
"""
import collections
import types

import pytest
import torch
from torch import nn

from conftest import amp_step, mse
from tritamp import amp
from tritamp.testing import amp_state, master_of

LEVELS = ["O0", "O1", "O2", "O3"]
HALVES = [torch.float16, torch.bfloat16]


def conv_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(64, 2))


def conv_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 3, 6, 6, generator=g), torch.randn(2, 2, generator=g)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def mlp_batch(n=4):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def is_bn(name):
    return name.startswith("1.")  # the BatchNorm2d of conv_net


def expected_dtype(level, half, name, keep_bn=None):
    if level in ("O0", "O1"):
        return torch.float32
    if keep_bn is None:
        keep_bn = level == "O2"
    return torch.float32 if (keep_bn and is_bn(name)) else half


def assert_untouched(model, opt, model_params):
    """A refused initialize leaves the model fp32 and the optimizer as it was."""
    for p in model.parameters():
        assert p.dtype == torch.float32
    for b in model.buffers():
        assert b.dtype in (torch.float32, torch.int64)
    assert not hasattr(opt, "_amp_stash")
    assert "step" not in vars(opt)  # step() not patched
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model_params]
    assert amp.state_dict() == {}


# --------------------------------------------------------------------------------------
# dtypes after initialize
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("level,keep_bn", [("O0", None), ("O1", None), ("O2", None),
                                           ("O3", None), ("O3", True)])
def test_param_and_buffer_dtypes(level, keep_bn, half):
    model = conv_net()
    model, opt = amp.initialize(model, sgd(model), opt_level=level, half_dtype=half,
                                keep_batchnorm_fp32=keep_bn, verbosity=0)
    for name, p in model.named_parameters():
        assert p.dtype == expected_dtype(level, half, name, keep_bn), name
    for name, b in model.named_buffers():
        if name.endswith("num_batches_tracked"):
            assert b.dtype == torch.int64
        else:
            assert b.dtype == expected_dtype(level, half, name, keep_bn), name
    out = model(conv_batch()[0])  # the mixed BatchNorm / half conv forward runs
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("level", LEVELS)
def test_master_params(level, half):
    model = conv_net()
    originals = [p.detach().clone() for p in model.parameters()]
    model, opt = amp.initialize(model, sgd(model), opt_level=level, half_dtype=half,
                                verbosity=0)
    masters = list(amp.master_params(opt))
    params = list(model.parameters())
    assert len(masters) == len(params)
    if level == "O2":
        for p, m, o in zip(params, masters, originals):
            assert m.dtype == torch.float32
            if p.dtype == half:
                assert m is not p
                assert torch.equal(m, o)  # the fp32 values the model came with
                assert torch.equal(m.to(half), p)
            else:  # BatchNorm: already fp32, updated directly
                assert m is p
    else:
        assert [id(m) for m in masters] == [id(p) for p in params]


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("level", LEVELS)
def test_output_dtype_is_fp32_by_default(level, half):
    model = conv_net()
    model, _ = amp.initialize(model, sgd(model), opt_level=level, half_dtype=half,
                              verbosity=0)
    x, _ = conv_batch()
    out = model(x)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("level", LEVELS)
def test_cast_model_outputs(level):
    model = conv_net()
    model, _ = amp.initialize(model, sgd(model), opt_level=level,
                              cast_model_outputs=torch.float16, verbosity=0)
    assert model(conv_batch()[0]).dtype == torch.float16


class _ModelOutput(collections.OrderedDict):
    """A mapping with attribute access, as model-output classes are."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class _MappingNet(nn.Module):
    def __init__(self, out_cls):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.out_cls = out_cls

    def forward(self, x):
        y = self.lin(x)
        return self.out_cls(logits=y, logprob=y.double().log_softmax(-1),
                            index=y.argmax(-1))


@pytest.mark.parametrize("level", LEVELS)
def test_mapping_outputs_keep_their_class_and_float64(level):
    """O1 widens the half outputs autocast made and leaves the others (a float64 output
    stays float64, as Apex's O1 left every output); O0/O2/O3 cast the model and every
    floating output (Apex's caster, its O0 casting to fp32); a mapping comes back as its
    own class either way."""
    model = _MappingNet(_ModelOutput)
    model, _ = amp.initialize(model, sgd(model), opt_level=level,
                              half_dtype=torch.bfloat16, verbosity=0)
    out = model(torch.randn(2, 4))
    assert type(out) is _ModelOutput
    assert out.logits.dtype == torch.float32 and out.index.dtype == torch.int64
    expected = torch.float64 if level == "O1" else torch.float32
    assert out.logprob.dtype == expected


def test_o1_cast_model_outputs_casts_every_floating_output():
    model = _MappingNet(collections.defaultdict)
    model.out_cls = lambda **kw: collections.defaultdict(list, kw)
    model, _ = amp.initialize(model, sgd(model), opt_level="O1", half_dtype=torch.bfloat16,
                              cast_model_outputs=torch.bfloat16, verbosity=0)
    out = model(torch.randn(2, 4))
    assert type(out) is collections.defaultdict and out.default_factory is list
    assert out["logits"].dtype == out["logprob"].dtype == torch.bfloat16
    assert out["index"].dtype == torch.int64


class _KeptOutputNet(nn.Module):
    """Returns a mapping with nothing half in it, and keeps it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.kept = None

    def forward(self, x):
        y = self.lin(x)
        self.kept = _ModelOutput(index=y.argmax(-1), logprob=y.double())
        return self.kept


def test_o1_output_with_nothing_to_cast_is_the_same_object():
    model = _KeptOutputNet()
    model, _ = amp.initialize(model, sgd(model), opt_level="O1", half_dtype=torch.bfloat16,
                              verbosity=0)
    out = model(torch.randn(2, 4))
    assert out is model.kept and out.logprob.dtype == torch.float64


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_state_dict_is_fp32_and_holds_the_masters(level, half):
    model = conv_net()
    model, opt = amp.initialize(model, sgd(model), opt_level=level, half_dtype=half,
                                verbosity=0)
    x, y = conv_batch()
    for _ in range(2):
        amp_step(model, opt, x, y)
    sd = model.state_dict()
    for key, value in sd.items():
        if value.is_floating_point():
            assert value.dtype == torch.float32, key
    if level == "O2":
        named = dict(model.named_parameters())
        finer = 0
        for key, p in named.items():
            if p.dtype == half:
                master = master_of(p)
                assert torch.equal(sd[key], master), key
                finer += not torch.equal(sd[key], p.float())
        # the checkpoint keeps the fp32 bits, not the rounded half copy
        assert finer > 0
    else:
        for key, p in model.named_parameters():
            assert torch.equal(sd[key], p.float()), key


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_submodule_state_dict_is_fp32(level):
    model = conv_net()
    model, opt = amp.initialize(model, sgd(model), opt_level=level, verbosity=0)
    for key, value in model[0].state_dict().items():
        assert value.dtype == torch.float32, key


def test_submodule_load_state_dict_reaches_the_masters():
    model = mlp()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=1e-6),
                                opt_level="O2", verbosity=0)
    loaded = {"weight": torch.full((16, 8), 0.5), "bias": torch.full((16,), 0.25)}
    model[0].load_state_dict(loaded)
    x, y = mlp_batch()
    amp_step(model, opt, x, y, zero_grad=False)
    # lr=1e-6: the loaded values move by far less than the fp16 spacing at 0.5
    assert torch.equal(model[0].weight, loaded["weight"].half())
    assert torch.equal(model[0].bias, loaded["bias"].half())


# --------------------------------------------------------------------------------------
# amp.state_dict / amp.load_state_dict
# --------------------------------------------------------------------------------------

def test_amp_load_state_dict_before_initialize():
    with pytest.raises(RuntimeError, match="before amp.initialize"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 5}})


def test_amp_load_apex_format_checkpoint():
    model = mlp()
    model, opt = amp.initialize(model, sgd(model), opt_level="O1", num_losses=2, verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 5},
                         "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0}})
    state = amp.state_dict()
    assert list(state) == ["loss_scaler0", "loss_scaler1"]
    assert state["loss_scaler0"]["loss_scale"] == 1024.0
    assert state["loss_scaler0"]["unskipped"] == 5
    assert state["loss_scaler1"]["loss_scale"] == 8.0
    x, y = mlp_batch()
    loss = mse(model(x), y)
    with amp.scale_loss(loss, opt, loss_id=1) as scaled:
        assert torch.equal(scaled, loss.float() * 8.0)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        amp.load_state_dict({"bogus": {}})


# --------------------------------------------------------------------------------------
# return shapes, enabled=False, re-initialising
# --------------------------------------------------------------------------------------

def test_return_shape_follows_input_shape():
    m1, m2 = mlp(), mlp()
    o1, o2 = sgd(m1), sgd(m2)
    models, opts = amp.initialize([m1, m2], [o1, o2], opt_level="O2", verbosity=0)
    assert isinstance(models, list) and isinstance(opts, list)
    assert models == [m1, m2] and opts == [o1, o2]

    m3 = mlp()
    o3 = sgd(m3)
    out = amp.initialize(m3, o3, opt_level="O1", verbosity=0)
    assert isinstance(out, tuple) and out[0] is m3 and out[1] is o3

    m4 = mlp()
    assert amp.initialize(m4, opt_level="O1", verbosity=0) is m4


def test_two_models_two_optimizers_train():
    m1, m2 = mlp(), mlp()
    (m1, m2), (o1, o2) = amp.initialize([m1, m2], [sgd(m1), sgd(m2)], opt_level="O2",
                                        verbosity=0)
    x, y = mlp_batch()
    before = [p.detach().clone() for p in list(m1.parameters()) + list(m2.parameters())]
    loss = mse(m1(x), y) + mse(m2(x), y)
    with amp.scale_loss(loss, [o1, o2]) as scaled:
        scaled.backward()
    o1.step()
    o2.step()
    after = list(m1.parameters()) + list(m2.parameters())
    assert all(not torch.equal(b, a) for b, a in zip(before, after))


def test_enabled_false_changes_nothing():
    model = mlp()
    opt = sgd(model)
    m, o = amp.initialize(model, opt, opt_level="O2", enabled=False)
    assert m is model and o is opt
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not hasattr(opt, "_amp_stash")
    x, y = mlp_batch()
    loss = mse(m(x), y)
    with amp.scale_loss(loss, o) as scaled:
        assert scaled is loss
        scaled.backward()
    o.step()


def test_reinitialize_fresh_objects_resets_scalers():
    model = mlp()
    model, opt = amp.initialize(model, sgd(model), opt_level="O2", verbosity=0)
    x, y = mlp_batch()
    amp_step(model, opt, x, y, factor=float("inf"), zero_grad=False)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 32768.0

    model2 = mlp()
    model2, opt2 = amp.initialize(model2, sgd(model2), opt_level="O2", verbosity=0)
    state = amp.state_dict()["loss_scaler0"]
    assert state["loss_scale"] == 65536.0 and state["unskipped"] == 0
    before = [p.detach().clone() for p in model2.parameters()]
    amp_step(model2, opt2, x, y, zero_grad=False)
    assert all(not torch.equal(b, p) for b, p in zip(before, model2.parameters()))
    assert all(torch.isfinite(p).all() for p in model2.parameters())


# --------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------

BAD_OPTIONS = [
    (dict(opt_level="01"), RuntimeError, r"Did you mean O1\?"),
    (dict(opt_level="O5"), RuntimeError, r"Unexpected optimization level O5"),
    (dict(opt_level="O1", master_weights=True), RuntimeError, r"master_weights"),
    (dict(opt_level="O1", keep_batchnorm_fp32=True), RuntimeError, r"keep_batchnorm_fp32"),
    (dict(opt_level="O2", patch_torch_functions=True), RuntimeError, r"patch_torch_functions"),
    (dict(opt_level="O2", loss_scale="abc"), ValueError, r"loss_scale"),
    (dict(opt_level="O2", loss_scale=0.0), ValueError, r"loss_scale"),
    (dict(opt_level="O2", half_dtype=torch.float32), ValueError, r"half_dtype"),
    (dict(opt_level="O2", keep_batchnorm_fp32="yes"), ValueError, r"keep_batchnorm_fp32"),
    (dict(opt_level="O2", num_losses=0), ValueError, r"num_losses"),
    (dict(opt_level="O2", growth_interval=0), ValueError, r"growth_interval"),
    (dict(opt_level="O2", cast_model_outputs="half"), ValueError, r"cast_model_outputs"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_OPTIONS,
                         ids=[str(k) for k, _, _ in BAD_OPTIONS])
def test_bad_options_raise_and_change_nothing(kwargs, exc, match):
    model = conv_net()
    params = list(model.parameters())
    opt = sgd(model)
    with pytest.raises(exc, match=match):
        amp.initialize(model, opt, verbosity=0, **kwargs)
    assert_untouched(model, opt, params)
    # the refused objects can still be initialised properly
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert model[0].weight.dtype == torch.float16
    assert hasattr(opt, "_amp_stash")


def test_parallel_wrapper_refused():
    model = conv_net()
    with pytest.raises(RuntimeError, match="AFTER"):
        amp.initialize(nn.DataParallel(model), opt_level="O2", verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_half_model_refused():
    model = conv_net().half()
    with pytest.raises(RuntimeError, match=r"\.half\(\)"):
        amp.initialize(model, opt_level="O2", verbosity=0)


def test_model_initialised_twice_refused():
    model = mlp()
    model = amp.initialize(model, opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="already been through amp.initialize"):
        amp.initialize(model, opt_level="O1", verbosity=0)


def test_same_optimizer_twice_refused():
    model = mlp()
    opt = sgd(model)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="only be passed through amp.initialize once"):
        amp.initialize(mlp(), opt, opt_level="O1", verbosity=0)


def test_duplicate_optimizer_in_list_refused_before_anything_changes():
    model = conv_net()
    params = list(model.parameters())
    opt = sgd(model)
    with pytest.raises(RuntimeError, match="only be passed through amp.initialize once"):
        amp.initialize(model, [opt, opt], opt_level="O2", verbosity=0)
    assert_untouched(model, opt, params)


def test_scale_loss_before_initialize():
    model = mlp()
    opt = sgd(model)
    loss = mse(model(mlp_batch()[0]), mlp_batch()[1])
    with pytest.raises(RuntimeError, match="amp.initialize"):
        with amp.scale_loss(loss, opt):
            pass


def test_scale_loss_loss_id_out_of_range():
    model = mlp()
    model, opt = amp.initialize(model, sgd(model), opt_level="O2", num_losses=2,
                                verbosity=0)
    x, y = mlp_batch()
    with pytest.raises(ValueError, match="num_losses"):
        with amp.scale_loss(mse(model(x), y), opt, loss_id=2):
            pass


def test_scale_loss_with_an_optimizer_not_initialised():
    model = mlp()
    model, opt = amp.initialize(model, sgd(model), opt_level="O2", verbosity=0)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = mlp_batch()
    with pytest.raises(RuntimeError, match="did not go through amp.initialize"):
        with amp.scale_loss(mse(model(x), y), other):
            pass


@pytest.mark.parametrize("second", [dict(opt_level="O3", half_dtype=torch.bfloat16),
                                    dict(opt_level="O2"), dict(enabled=False)],
                         ids=["O3-bf16", "O2-again", "disabled"])
def test_scale_loss_refuses_an_optimizer_of_an_earlier_initialize(second):
    """A second initialize replaces amp's properties and scalers: an O2 optimizer from the
    first call would have its masters silently left as they were (bf16 O3's exit does
    nothing), so scale_loss refuses it, naming the fix; nothing is touched."""
    model = mlp()
    model, opt = amp.initialize(model, sgd(model), opt_level="O2", verbosity=0)
    x, y = mlp_batch()
    amp_step(model, opt, x, y)
    model2 = mlp()
    model2, opt2 = amp.initialize(model2, sgd(model2), verbosity=0, **second)
    before = [p.detach().clone() for p in model.parameters()]
    masters = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    scalers = amp.state_dict()
    loss = mse(model(x), y)
    with pytest.raises(RuntimeError, match="the current amp.initialize did not prepare.*one "
                                           "amp.initialize call"):
        with amp.scale_loss(loss, opt):
            pass
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(torch.equal(b, p) for b, p in zip(
        masters, [p for g in opt.param_groups for p in g["params"]]))
    assert amp.state_dict() == scalers
    # the new call's optimizer trains
    before2 = [p.detach().clone() for p in model2.parameters()]
    amp_step(model2, opt2, x, y)
    assert all(not torch.equal(b, p) for b, p in zip(before2, model2.parameters()))


# --------------------------------------------------------------------------------------
# argparse strings
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("level,keep,bn_dtype", [("O2", "False", torch.float16),
                                                 ("O2", "True", torch.float32),
                                                 ("O3", "True", torch.float32),
                                                 ("O3", "False", torch.float16)])
def test_keep_batchnorm_fp32_strings(level, keep, bn_dtype):
    model = conv_net()
    model, _ = amp.initialize(model, sgd(model), opt_level=level, keep_batchnorm_fp32=keep,
                              verbosity=0)
    assert model[1].weight.dtype == bn_dtype
    assert model[1].running_var.dtype == bn_dtype
    assert model[0].weight.dtype == torch.float16
    assert amp_state().opt_properties.keep_batchnorm_fp32 is (keep == "True")


def test_loss_scale_string_static():
    model = mlp()
    model, opt = amp.initialize(model, sgd(model), opt_level="O2", loss_scale="128.0",
                                verbosity=0)
    state = amp.state_dict()["loss_scaler0"]
    assert state["loss_scale"] == 128.0
    x, y = mlp_batch()
    loss = mse(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        assert torch.equal(scaled, loss.float() * 128.0)
        scaled.backward()
    opt.step()
    # static, as in Apex: the gradients are not checked and the step is never skipped
    # (nothing could act on an overflow); the scale stays and the step counts as unskipped
    amp_step(model, opt, x, y, factor=float("inf"), zero_grad=False)
    assert not all(torch.isfinite(p).all() for p in model.parameters())
    state = amp.state_dict()["loss_scaler0"]
    assert state["loss_scale"] == 128.0 and state["unskipped"] == 2


def test_loss_scale_string_dynamic_at_o3():
    model = mlp()
    model, opt = amp.initialize(model, sgd(model), opt_level="O3", loss_scale="dynamic",
                                verbosity=0)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 65536.0
    x, y = mlp_batch()
    amp_step(model, opt, x, y, factor=float("inf"), zero_grad=False)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 32768.0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bf16_default_loss_scale_is_one():
    model = mlp()
    model, opt = amp.initialize(model, sgd(model), opt_level="O2", half_dtype=torch.bfloat16,
                                verbosity=0)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 1.0


# --------------------------------------------------------------------------------------
# O2/O3 forward: input and output casts
# --------------------------------------------------------------------------------------

class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = {}

    def forward(self, batch, extra=None):
        a, (b, (c,)), idx = batch["a"], batch["rest"], batch["idx"]
        self.seen = dict(a=a.dtype, b=b.dtype, c=c.dtype, idx=idx.dtype, extra=extra.dtype)
        return {"out": self.lin(a), "list": [b * 2, (c + extra,)], "idx": idx}


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_nested_inputs_and_outputs_cast(level, half):
    torch.manual_seed(0)
    model = amp.initialize(Nested(), opt_level=level, half_dtype=half, verbosity=0)
    batch = {"a": torch.randn(2, 4), "rest": [torch.randn(3), (torch.randn(3),)],
             "idx": torch.arange(3)}
    out = model(batch, extra=torch.randn(3))
    assert model.seen == dict(a=half, b=half, c=half, idx=torch.int64, extra=half)
    assert out["out"].dtype == torch.float32
    assert out["list"][0].dtype == torch.float32
    assert isinstance(out["list"][1], tuple) and out["list"][1][0].dtype == torch.float32
    assert out["idx"].dtype == torch.int64


# --------------------------------------------------------------------------------------
# add_param_group
# --------------------------------------------------------------------------------------

def test_add_param_group_after_initialize_gets_fp32_masters():
    model = mlp()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.05, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    new = list(model[2].parameters())
    assert all(p.dtype == torch.float16 for p in new)
    opt.add_param_group({"params": model[2].parameters(), "lr": 0.05})
    masters = opt.param_groups[1]["params"]
    assert len(masters) == 2
    for p, m in zip(new, masters):
        assert m.dtype == torch.float32 and m is not p
        assert torch.equal(m, p.float())
    assert [m.dtype for m in amp.master_params(opt)] == [torch.float32] * 4

    x, y = mlp_batch()
    before = [p.detach().clone() for p in new]
    losses = []
    for _ in range(3):
        losses.append(amp_step(model, opt, x, y).item())
    for b, p, m in zip(before, new, masters):
        assert not torch.equal(b, p)
        assert torch.equal(p, m.to(p.dtype))
    assert losses[-1] < losses[0]
    sd = model.state_dict()
    assert torch.equal(sd["2.weight"], masters[0])


# --------------------------------------------------------------------------------------
# O1: casts inside the forward
# --------------------------------------------------------------------------------------

@pytest.fixture
def restore_torch_sigmoid():
    original = torch.sigmoid
    yield
    torch.sigmoid = original


class Probe(nn.Module):
    """Records the dtypes its layers see and produce inside the forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.lin2 = nn.Linear(8, 4)
        self.seen = {}

    def forward(self, x):
        h = self.lin(x)
        s = torch.sigmoid(h)
        self.seen["sigmoid"] = s.dtype
        with amp.disable_casts():
            self.seen["autocast_in_disable"] = torch.is_autocast_enabled("cpu")
            z = self.lin2(s.float())
        self.seen["autocast_after_disable"] = torch.is_autocast_enabled("cpu")
        return z


def record_linear_output(model, name, store):
    def hook(module, inputs, output):
        store[name] = output.dtype
    return getattr(model, name).register_forward_hook(hook)


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
def test_o1_linear_runs_in_half_inside_forward(half):
    torch.manual_seed(0)
    model = Probe()
    seen = {}
    record_linear_output(model, "lin", seen)
    record_linear_output(model, "lin2", seen)
    model = amp.initialize(model, opt_level="O1", half_dtype=half, verbosity=0)
    out = model(torch.randn(2, 8))
    assert seen["lin"] == half
    assert model.seen["sigmoid"] == half  # not registered: autocast leaves it alone
    # disable_casts inside the forward: lin2 runs in fp32, autocast back on after
    assert seen["lin2"] == torch.float32
    assert model.seen["autocast_in_disable"] is False
    assert model.seen["autocast_after_disable"] is True
    assert out.dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
def test_register_float_function_sigmoid(half, restore_torch_sigmoid):
    amp.register_float_function(torch, "sigmoid")
    x = torch.randn(2, 8)
    # outside an autocast region the wrapper changes nothing
    assert torch.sigmoid(x.to(half)).dtype == half
    assert torch.equal(torch.sigmoid(x), torch.special.expit(x))
    torch.manual_seed(0)
    model = amp.initialize(Probe(), opt_level="O1", half_dtype=half, verbosity=0)
    model(x)
    assert model.seen["sigmoid"] == torch.float32


def test_register_functions_on_a_user_module():
    ns = types.SimpleNamespace(double=lambda t: t * 2, triple=lambda t: t * 3,
                               mm=lambda a, b: torch.mm(a, b))
    amp.register_half_function(ns, "double")
    amp.register_float_function(ns, "triple")
    amp.register_promote_function(ns, "mm")
    with pytest.raises(ValueError, match="No function named"):
        amp.register_half_function(ns, "missing")
    ns.eps = 1e-5  # (replaced by a wrapper that failed only when called)
    with pytest.raises(TypeError, match=r"\.eps is a float, not a function"):
        amp.register_float_function(ns, "eps")
    assert ns.eps == 1e-5
    x = torch.randn(3, 3)
    with torch.autocast("cpu", dtype=torch.float16):
        assert ns.double(x).dtype == torch.float16
        assert ns.triple(x.half()).dtype == torch.float32
        assert ns.mm(x.half(), x).dtype == torch.float32
        assert torch.mm(x.half(), x).dtype == torch.float16  # what autocast alone does
    assert ns.double(x).dtype == torch.float32
    assert ns.triple(x.half()).dtype == torch.float16
    # registering again does not stack wrappers
    amp.register_float_function(ns, "double")
    with torch.autocast("cpu", dtype=torch.float16):
        assert ns.double(x.half()).dtype == torch.float32


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
def test_decorators_inside_and_outside_autocast(half):
    @amp.half_function
    def to_half(t):
        return t * 2

    @amp.float_function
    def to_float(a, b):
        return torch.mm(a, b)  # autocast alone would run mm in the half dtype

    @amp.promote_function
    def widest(a, b):
        return torch.mm(a, b)

    x = torch.randn(3, 3)
    for region in ("autocast", "o1_forward"):
        results = {}

        def body():
            results["half"] = to_half(x).dtype
            results["float"] = to_float(x, x).dtype
            results["promote"] = widest(x.to(half), x).dtype
            results["promote_same"] = widest(x.to(half), x.to(half)).dtype

        if region == "autocast":
            with torch.autocast("cpu", dtype=half):
                body()
        else:
            class M(nn.Module):
                def forward(self, t):
                    body()
                    return t
            amp.initialize(M(), opt_level="O1", half_dtype=half, verbosity=0)(x)
        assert results == {"half": half, "float": torch.float32, "promote": torch.float32,
                           "promote_same": half}, region

    # identity outside autocast
    assert to_half(x).dtype == torch.float32
    assert torch.equal(to_half(x), x * 2)
    assert to_float(x.to(half), x.to(half)).dtype == half
    with pytest.raises(RuntimeError):
        torch.mm(x.to(half), x)
    with pytest.raises(RuntimeError):
        widest(x.to(half), x)


_Scaled = collections.namedtuple("_Scaled", "x scale")
_Pair = collections.namedtuple("_Pair", "a b")


def test_decorated_functions_take_named_tuples_and_mixed_containers():
    """A list or tuple is cast only when everything in it is a floating tensor (Apex's
    rule), named tuples rebuilt as such; anything else passes untouched. A named tuple or
    a PackedSequence (int64 batch sizes) raised inside the cast."""
    from torch.nn.utils.rnn import pack_padded_sequence

    @amp.half_function
    def seen(*args):
        return args

    x = torch.randn(3, 2, 4)
    packed = pack_padded_sequence(x, [3, 2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed, pair, ps = seen(_Scaled(x, 2), _Pair(x, x), packed)
    assert type(mixed) is _Scaled and mixed.x is x and mixed.scale == 2  # untouched
    assert type(pair) is _Pair and pair.a.dtype == pair.b.dtype == torch.bfloat16
    assert ps is packed


def test_registered_functions_leave_meta_tensors_alone():
    """Autocast has no state for the meta device: asking raised, for every call of a
    registered function on meta tensors (deferred initialisation), even outside O1."""
    ns = types.SimpleNamespace(double=lambda t: t * 2)
    amp.register_half_function(ns, "double")
    t = torch.empty(2, 3, device="meta")
    assert ns.double(t).device.type == "meta" and ns.double(t).dtype == torch.float32


def test_a_half_function_body_keeps_autocasts_lists():
    """Apex's half_function cast the arguments and left the body to O1's lists: an op
    autocast runs in fp32 (mse_loss on the CPU) and a float_function called inside stay
    fp32; the body ran with autocast off, all in the half dtype."""
    @amp.float_function
    def inner(t):
        return t.dtype

    @amp.half_function
    def body(a, b):
        return a.dtype, torch.nn.functional.mse_loss(a, b).dtype, inner(a), (a @ b).dtype

    x = torch.randn(3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert body(x, x) == (torch.bfloat16, torch.float32, torch.float32, torch.bfloat16)


class _ReportsCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: autocast's per-device decision without a GPU."""

    @property
    def device(self):
        return torch.device("cuda")


def test_the_casting_device_is_the_floating_arguments_not_the_first_tensors():
    """A CPU lengths / index tensor given first decided, and switched the cast off for
    the CUDA activations after it (Apex cast every floating CUDA argument)."""
    @amp.half_function
    def dtype_of_x(lengths, x):
        return x.dtype

    x = torch.randn(2, 2).as_subclass(_ReportsCuda)
    torch.set_autocast_enabled("cuda", True)
    try:
        assert dtype_of_x(torch.tensor([2, 1]), x) == torch.get_autocast_dtype("cuda")
    finally:
        torch.set_autocast_enabled("cuda", False)


def test_o1_forward_takes_its_autocast_device_from_a_floating_input():
    """model(cpu_lengths, cuda_x) entered autocast("cpu") and ran the CUDA forward in
    fp32. Here (no GPU) the region's device shows in torch's warning that CUDA autocast
    is unavailable, which only a "cuda" region gives."""
    class M(nn.Module):
        def forward(self, lengths, x):
            return x

    model = amp.initialize(M(), opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(2, 2).as_subclass(_ReportsCuda)
    with pytest.warns(UserWarning, match="CUDA is not available"):
        model(torch.tensor([2, 1]), x)


def test_top_level_exports_match_amp():
    import tritamp
    assert set(amp.__all__) <= set(tritamp.__all__)
    for name in amp.__all__:
        assert getattr(tritamp, name) is getattr(amp, name)


@pytest.mark.parametrize("level", ["O0", "O2", "O3"])
def test_disable_casts_at_other_levels(level):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x):
            with amp.disable_casts():
                return self.lin(x)

    torch.manual_seed(0)
    model = M()
    model, opt = amp.initialize(model, sgd(model), opt_level=level, verbosity=0)
    x, y = mlp_batch()
    out = model(x)
    assert out.dtype == torch.float32
    with amp.scale_loss(mse(out, y), opt) as scaled:
        scaled.backward()
    opt.step()


def test_disable_casts_before_initialize():
    lin = nn.Linear(8, 4)
    x = torch.randn(2, 8)
    with amp.disable_casts():
        assert lin(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(x).dtype == torch.bfloat16
        with amp.disable_casts():
            assert not torch.is_autocast_enabled("cpu")
            assert lin(x).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("fused", ["FusedSGD", "FusedAdam"])
def test_o2_a_list_of_masters_kept_from_set_up_clips_what_the_step_uses(fused):
    """At O2 a fused optimizer reads the scaled half gradients itself and the masters get
    no gradient unless amp.master_params runs after the backward: a list of them taken at
    set-up clipped nothing (norm 0) and the step used the unclipped gradients. Read
    before the first backward, master_params makes the exits unscale into the masters'
    gradients (Apex's behaviour)."""
    import tritamp.optimizers as O
    x = torch.randn(8, 4)

    def train(kept):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model, opt = amp.initialize(model, getattr(O, fused)(model.parameters(), lr=0.5),
                                    opt_level="O2", half_dtype=torch.bfloat16,
                                    loss_scale=128.0, verbosity=0)
        masters = list(amp.master_params(opt)) if kept else None
        norms = []
        for _ in range(3):
            opt.zero_grad()
            with amp.scale_loss(model(x).float().pow(2).sum(), opt) as scaled:
                scaled.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(
                masters if kept else amp.master_params(opt), 0.01))
            opt.step()
        return torch.stack(norms), [p.detach().clone() for p in opt.param_groups[0]["params"]]

    fresh_norms, fresh = train(kept=False)
    kept_norms, kept = train(kept=True)
    assert (fresh_norms > 0.01).all()
    assert torch.equal(kept_norms, fresh_norms)
    for a, b in zip(kept, fresh):
        assert torch.equal(a, b)
