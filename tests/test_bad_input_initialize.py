"""amp.initialize on bad input: every refusal raises before anything changes (models,
optimizers and amp's global state compared bit for bit), wrong types name the argument,
and O2's master weights are the fp32 values the model came with.

Models are tiny and mostly fp32: refused calls never compute, accepted ones step once
or twice.
"""
import math

import pytest
import torch
from torch import nn

from tritamp import amp
from tritamp.testing import master_of
from tritamp.testing import amp_state
from tritamp.optimizers import FusedAdam, FusedSGD
from tritamp.parallel import LARC

LEVELS = ["O0", "O1", "O2", "O3"]
HALVES = [torch.float16, torch.bfloat16]


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)


def mse(out, y):
    return ((out.float() - y) ** 2).mean()


def trained_sgd(model, extra=()):
    """An SGD with momentum that has stepped once in fp32: state and .grad are set."""
    opt = torch.optim.SGD(list(model.parameters()) + list(extra), lr=0.1, momentum=0.9)
    x, y = batch()
    mse(model(x), y).backward()
    opt.step()
    return opt


# --------------------------------------------------------------------------------------
# snapshots: everything initialize could change, as plain values (bits as bytes)
# --------------------------------------------------------------------------------------

def _bits(t):
    t = t.detach()
    raw = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return (str(t.dtype), tuple(t.shape), t.stride(), str(t.device), raw)


def _tensor_attrs(t):
    return sorted((k, id(v)) for k, v in vars(t).items())


def _module_snapshot(module):
    hooks = sorted((k, len(v)) for k, v in vars(module).items()
                   if k.endswith("hooks") and isinstance(v, dict))
    own = sorted((k, id(v)) for k, v in vars(module).items()
                 if k not in ("_parameters", "_buffers", "_modules") and not isinstance(v, dict))
    return (type(module).__name__, module.training, hooks, own)


def model_snapshot(model):
    params = [(name, id(p), _bits(p), p.requires_grad,
               None if p.grad is None else _bits(p.grad), _tensor_attrs(p))
              for name, p in model.named_parameters()]
    buffers = [(name, id(b), _bits(b)) for name, b in model.named_buffers()]
    return params, buffers, [_module_snapshot(m) for m in model.modules()]


def optimizer_snapshot(opt):
    groups = [([(id(p), _bits(p), _tensor_attrs(p)) for p in g["params"]],
               sorted((k, repr(v)) for k, v in g.items() if k != "params"), id(g))
              for g in opt.param_groups]
    state = sorted((id(p), sorted((k, _bits(v) if isinstance(v, torch.Tensor) else repr(v))
                                  for k, v in s.items()))
                   for p, s in opt.state.items())
    attrs = sorted((k, id(v)) for k, v in vars(opt).items())  # step, zero_grad, _amp_stash
    return groups, state, attrs, id(opt.param_groups), id(opt.state)


def global_snapshot():
    props = amp_state().opt_properties
    return (amp_state().verbosity, id(props),
            None if props is None else dict(props.options),
            id(amp_state().loss_scalers), [id(s) for s in amp_state().loss_scalers],
            [s.state_dict() for s in amp_state().loss_scalers])


def snapshot(models, optimizers):
    return ([model_snapshot(m) for m in models], [optimizer_snapshot(o) for o in optimizers],
            global_snapshot())


@pytest.fixture
def earlier_initialize():
    """A successful initialize on other objects, so a refused call that replaced the
    global state (properties, scalers, verbosity) would show."""
    model = net()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1",
                   num_losses=2, verbosity=1)
    assert amp_state().verbosity == 1 and len(amp_state().loss_scalers) == 2


def assert_refused(models, optimizers, exc, match, **kwargs):
    """initialize(models, optimizers, **kwargs) raises exc and changes nothing."""
    model_list = models if isinstance(models, list) else [models]
    opt_list = [] if optimizers is None else (
        optimizers if isinstance(optimizers, list) else [optimizers])
    watched_models = [m for m in model_list if isinstance(m, nn.Module)]
    watched_opts = [o for o in opt_list if isinstance(o, torch.optim.Optimizer)]
    before = snapshot(watched_models, watched_opts)
    kwargs.setdefault("verbosity", 0)  # differs from the state's 1
    with pytest.raises(exc, match=match) as info:
        amp.initialize(models, optimizers, **kwargs)
    assert snapshot(watched_models, watched_opts) == before
    return info.value


# --------------------------------------------------------------------------------------
# refusals at every opt level: arguments
# --------------------------------------------------------------------------------------

ALL = LEVELS
NOT_O1 = ["O0", "O2", "O3"]

BAD_ARGUMENTS = [
    (ALL, dict(verbosity="loud"), TypeError, r"verbosity must be an int.*'loud'.*str"),
    (ALL, dict(verbosity=None), TypeError, r"verbosity must be an int"),
    (ALL, dict(num_losses=0), ValueError, r"num_losses must be an int >= 1, got 0"),
    (ALL, dict(num_losses="2"), TypeError, r"num_losses must be an int >= 1.*'2'.*str"),
    (ALL, dict(num_losses=2.0), TypeError, r"num_losses .*float"),
    (ALL, dict(num_losses=True), TypeError, r"num_losses .*bool"),
    (ALL, dict(half_dtype="bf16"), ValueError, r"pass half_dtype=torch\.bfloat16"),
    (ALL, dict(half_dtype="fp16"), ValueError, r"pass half_dtype=torch\.float16"),
    (ALL, dict(half_dtype=torch.float32), ValueError,
     r"half_dtype must be torch\.float16 or torch\.bfloat16, got torch\.float32"),
    (ALL, dict(half_dtype=16), TypeError, r"half_dtype must be .* got 16 of type int"),
    (ALL, dict(patch_torch_functions="Yes"), ValueError, r"patch_torch_functions=.Yes."),
    (NOT_O1, dict(keep_batchnorm_fp32="yes"), ValueError, r"keep_batchnorm_fp32='yes'"),
    (NOT_O1, dict(keep_batchnorm_fp32="true"), ValueError, r"Did you mean 'True'\?"),
    (NOT_O1, dict(keep_batchnorm_fp32=1), TypeError,
     r"keep_batchnorm_fp32=1 of type int; pass keep_batchnorm_fp32=True"),
    (NOT_O1, dict(master_weights="maybe"), ValueError, r"master_weights='maybe'"),
    (NOT_O1, dict(master_weights=[True]), TypeError, r"master_weights=\[True\] of type list"),
    (["O1"], dict(master_weights=True), RuntimeError, r"master_weights with O1"),
    (["O1"], dict(keep_batchnorm_fp32="True"), RuntimeError, r"keep_batchnorm_fp32 should be None"),
    (ALL, dict(loss_scale="dynamc"), ValueError, r"Did you mean 'dynamic'\?"),
    (ALL, dict(loss_scale="-2"), ValueError, r"finite number > 0, got '-2'"),
    (ALL, dict(loss_scale=0.0), ValueError, r"finite number > 0"),
    (ALL, dict(loss_scale=math.inf), ValueError, r"finite number > 0"),
    (ALL, dict(loss_scale=True), TypeError, r"loss_scale=.dynamic."),
    (ALL, dict(loss_scale=[128.0]), TypeError, r"loss_scale must be .* of type list"),
    (NOT_O1, dict(cast_model_type="torch.float16"), ValueError,
     r"pass cast_model_type=torch\.float16 \(a torch\.dtype"),
    (NOT_O1, dict(cast_model_type=torch.int32), ValueError, r"cast_model_type .* torch\.int32"),
    (NOT_O1, dict(cast_model_type=16), TypeError, r"cast_model_type .* of type int"),
    (["O1"], dict(cast_model_type=torch.float16), RuntimeError, r"O1 inserts casts"),
    (ALL, dict(cast_model_outputs="half"), ValueError, r"pass cast_model_outputs=torch\.float16"),
    (ALL, dict(cast_model_outputs=torch.int64), ValueError, r"cast_model_outputs .*int64"),
    (ALL, dict(cast_model_outputs=32), TypeError, r"cast_model_outputs .* of type int"),
    (ALL, dict(growth_interval=0), ValueError, r"growth_interval"),
    (ALL, dict(hysteresis=0), ValueError, r"hysteresis"),
    (ALL, dict(growth_factor=1.0), ValueError, r"growth_factor"),
    (ALL, dict(backoff_factor=1.5), ValueError, r"backoff_factor"),
    (ALL, dict(min_loss_scale=0.0), ValueError, r"min_loss_scale must be"),
    (ALL, dict(min_loss_scale=4.0, max_loss_scale=2.0), ValueError, r"max_loss_scale"),
    (ALL, dict(overflow_process_group=object()), RuntimeError, r"not initialized"),
]

ARG_CASES = [pytest.param(level, kwargs, exc, match, id=f"{level}-{kwargs}")
             for levels, kwargs, exc, match in BAD_ARGUMENTS for level in levels]


@pytest.mark.parametrize("level,kwargs,exc,match", ARG_CASES)
def test_bad_argument_refused_and_nothing_changes(earlier_initialize, level, kwargs, exc, match):
    model = net()
    opt = trained_sgd(model)
    assert_refused(model, opt, exc, match, opt_level=level, **kwargs)
    # the refused objects can still be initialised
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    assert hasattr(opt, "_amp_stash")


@pytest.mark.parametrize("opt_level,hint", [(None, ""), (["O2"], ""), (2, "opt_level='O2'"),
                                            (2.0, ""), ({"O1": 1}, ""), (b"O1", "")],
                         ids=["None", "list", "int", "float", "dict", "bytes"])
def test_opt_level_of_a_wrong_type_is_a_type_error(earlier_initialize, opt_level, hint):
    model = net()
    err = assert_refused(model, trained_sgd(model), TypeError,
                         r"Unexpected optimization level .* of type .*opt_level must be one of "
                         r"the strings 'O0', 'O1', 'O2', 'O3'", opt_level=opt_level)
    assert type(opt_level).__name__ in str(err)
    assert hint in str(err)


@pytest.mark.parametrize("opt_level,match", [("O4", r"Unexpected optimization level O4"),
                                             ("01", r"Did you mean O1\?"),
                                             ("o2", r"Did you mean O2\?")])
def test_opt_level_string_keeps_apexs_runtime_error(earlier_initialize, opt_level, match):
    model = net()
    assert_refused(model, trained_sgd(model), RuntimeError, match, opt_level=opt_level)


def test_disabled_checks_its_arguments_too(earlier_initialize):
    model = net()
    assert_refused(model, trained_sgd(model), TypeError, r"verbosity", enabled=False,
                   verbosity="loud")


@pytest.mark.parametrize("level", LEVELS)
def test_argparse_strings_still_accepted(level):
    model = net()
    extra = {} if level == "O1" else dict(keep_batchnorm_fp32="False", master_weights="True")
    model, opt = amp.initialize(model, trained_sgd(model), opt_level=level, loss_scale="128.0",
                                patch_torch_functions="True" if level == "O1" else "False",
                                verbosity=False, num_losses=2, **extra)
    props = amp_state().opt_properties
    assert props.loss_scale == 128.0
    assert props.patch_torch_functions is (level == "O1")
    if level != "O1":
        assert props.keep_batchnorm_fp32 is False and props.master_weights is True
    assert len(amp_state().loss_scalers) == 2 and amp_state().verbosity is False


# --------------------------------------------------------------------------------------
# refusals at every opt level: models and optimizers
# --------------------------------------------------------------------------------------

def _int_param_in_optimizer():
    model = net()
    opt = trained_sgd(model, extra=[torch.zeros(3, dtype=torch.long)])
    return model, opt, TypeError, (r"floating point tensors; received torch\.int64 at "
                                   r"optimizers\[0\]\.param_groups\[0\]\['params'\]\[6\] "
                                   r"\(shape \(3,\)\)\. Leave integer tensors out")


def _int_param_in_a_later_group():
    model = net()
    opt = trained_sgd(model)
    opt.add_param_group({"params": [torch.ones(2, dtype=torch.int32)], "lr": 0.01})
    return model, opt, TypeError, r"received torch\.int32 at optimizers\[0\]\.param_groups\[1\]"


def _int_parameter_of_the_model():
    model = net()
    model.register_parameter("counts", nn.Parameter(torch.arange(3), requires_grad=False))
    return model, trained_sgd(model), TypeError, r"received torch\.int64"


def _second_optimizer_bad():
    model = net()
    first = trained_sgd(model)
    second = torch.optim.SGD([torch.zeros(2, dtype=torch.uint8)], lr=0.1)
    return model, [first, second], TypeError, r"received torch\.uint8 at optimizers\[1\]"


def _second_model_half():
    good = net()
    bad = nn.Linear(2, 2).half()
    opt = torch.optim.SGD(list(good.parameters()) + list(bad.parameters()), lr=0.1)
    return [good, bad], opt, RuntimeError, (r"Found param weight \(in models\[1\]\) with type "
                                            r"torch\.float16, expected torch\.float32")


def _mixed_dtypes():
    model = net()
    opt = trained_sgd(model)
    model[0].weight.data = model[0].weight.data.half()
    model[2].bias.data = model[2].bias.data.bfloat16()
    return model, opt, RuntimeError, (
        r"Found param 0\.weight with type torch\.float16, expected torch\.float32\.(.|\n)*"
        r"call model\.float\(\) before amp\.initialize(.|\n)*Also not torch\.float32: "
        r"2\.bias \(torch\.bfloat16\)")


def _half_buffer():
    model = net()
    opt = trained_sgd(model)
    model[1].running_mean.data = model[1].running_mean.half()
    return model, opt, RuntimeError, r"Found buffer 1\.running_mean"


def _data_parallel():
    model = net()
    return nn.DataParallel(model), trained_sgd(model), RuntimeError, r"AFTER"


def _not_a_module():
    model = net()
    return [model, "model"], trained_sgd(model), TypeError, r"models\[1\] is a str"


def _models_tuple():
    model = net()
    return (model,), trained_sgd(model), TypeError, r"got a tuple"


def _not_an_optimizer():
    model = net()
    return model, [trained_sgd(model), {"lr": 0.1}], TypeError, r"optimizers\[1\] is a dict"


def _same_optimizer_twice():
    model = net()
    opt = trained_sgd(model)
    return model, [opt, opt], RuntimeError, r"optimizers\[0\] and optimizers\[1\] are the same"


def _same_model_twice():
    model = net()
    return [model, model], trained_sgd(model), RuntimeError, r"same model appears more than once"


def _optimizer_and_its_larc():
    model = net()
    opt = trained_sgd(model)
    return model, [opt, LARC(opt)], RuntimeError, r"are the same optimizer"


OBJECT_CASES = [_int_param_in_optimizer, _int_param_in_a_later_group,
                _int_parameter_of_the_model, _second_optimizer_bad, _second_model_half,
                _mixed_dtypes, _half_buffer, _data_parallel, _not_a_module, _models_tuple,
                _not_an_optimizer, _same_optimizer_twice, _same_model_twice,
                _optimizer_and_its_larc]


@pytest.mark.parametrize("case", OBJECT_CASES, ids=[c.__name__[1:] for c in OBJECT_CASES])
@pytest.mark.parametrize("level", LEVELS)
def test_bad_model_or_optimizer_refused_and_nothing_changes(earlier_initialize, level, case):
    models, optimizers, exc, match = case()
    assert_refused(models, optimizers, exc, match, opt_level=level)


def _float64_param_outside_the_model():
    model = net()
    return model, trained_sgd(model, extra=[nn.Parameter(torch.ones(2, dtype=torch.float64))]), \
        {}, r"torch\.float32 or a half dtype .*master_weights=True; received torch\.float64 at " \
            r"optimizers\[0\]\.param_groups\[0\]\['params'\]\[6\]\. .*master_weights=False"


def _cast_to_float64():
    model = net()
    return model, trained_sgd(model), dict(cast_model_type=torch.float64), \
        r"received torch\.float64 .*\(a torch\.float32 model parameter cast to " \
        r"cast_model_type=torch\.float64\)"


@pytest.mark.parametrize("case", [_float64_param_outside_the_model, _cast_to_float64],
                         ids=["float64_param_outside_the_model", "cast_to_float64"])
@pytest.mark.parametrize("level,extra", [("O2", {}), ("O3", dict(master_weights=True))])
def test_fp32_masters_of_float64_refused(earlier_initialize, level, extra, case):
    """Apex raised this TypeError at the first step; here before anything changes."""
    model, opt, kwargs, match = case()
    assert_refused(model, opt, TypeError, match, opt_level=level, **extra, **kwargs)


def test_float64_param_outside_the_model_accepted_without_masters():
    model = net()
    extra = nn.Parameter(torch.ones(2, dtype=torch.float64))
    model, opt = amp.initialize(model, trained_sgd(model, extra=[extra]), opt_level="O3",
                                verbosity=0)
    assert opt.param_groups[0]["params"][-1] is extra and extra.dtype == torch.float64


@pytest.mark.parametrize("level,kwargs", [
    ("O1", dict(loss_scale="dynamic")), ("O1", dict(loss_scale=128.0)),
    ("O3", dict(loss_scale="dynamic")),
    ("O2", dict(master_weights=False, half_dtype=torch.bfloat16, loss_scale=128.0))])
def test_float64_param_refused_where_gradients_are_unscaled(earlier_initialize, level, kwargs):
    """Its gradient would be unscaled and checked in float32: refused before anything
    changes (it raised from inside scale_loss, after the backward)."""
    model = net()
    opt = trained_sgd(model, extra=[nn.Parameter(torch.ones(2, dtype=torch.float64))])
    assert_refused(model, opt, TypeError,
                   r"torch\.float32 or a half dtype .*with loss_scale=.*; received "
                   r"torch\.float64 at optimizers\[0\]\.param_groups\[0\]\['params'\]\[6\]\. "
                   r".*convert it to float32", opt_level=level, **kwargs)


@pytest.mark.parametrize("level,kwargs,match", [
    ("O2", dict(half_dtype=torch.bfloat16), r"master_weights=True"),
    ("O1", dict(loss_scale="dynamic"), r"loss_scale='dynamic'")])
def test_add_param_group_refuses_float64_after_initialize(level, kwargs, match):
    """At O2 the group got a (less precise) fp32 master; at O1 with a dynamic scale the
    next scale_loss raised after its backward. Refused before the group is added."""
    model = net()
    model, opt = amp.initialize(model, trained_sgd(model), opt_level=level, verbosity=0,
                                **kwargs)
    groups, params = list(opt.param_groups), list(amp.master_params(opt))
    extra = nn.Parameter(torch.ones(3, dtype=torch.float64))
    with pytest.raises(TypeError, match=match + r".*received torch\.float64 at the new "
                       r"param_groups\[1\]\['params'\]\[0\]"):
        opt.add_param_group({"params": [extra]})
    assert opt.param_groups == groups and list(amp.master_params(opt)) == params
    assert master_of(extra) is None
    frozen = nn.Parameter(torch.ones(3, dtype=torch.float64), requires_grad=False)
    opt.add_param_group({"params": [frozen]})  # nothing trains it: accepted as before
    assert opt.param_groups[-1]["params"] == [frozen]


@pytest.mark.parametrize("level,kwargs", [("O2", {}), ("O2", dict(half_dtype=torch.bfloat16)),
                                          ("O3", dict(master_weights=True))])
def test_a_half_parameter_in_two_optimizers_with_masters_is_refused(earlier_initialize, level,
                                                                    kwargs):
    """Each optimizer kept its own fp32 master of it, and the last to step overwrote the
    other's update (torch.optim applies both): refused, nothing changed."""
    model = nn.Linear(4, 2)
    first = torch.optim.SGD([model.weight], lr=0.1)
    second = torch.optim.SGD([model.bias, model.weight], lr=0.1)
    assert_refused(model, [first, second], ValueError,
                   r"amp with master weights: the parameter of shape \(2, 4\) \(torch\."
                   r"b?float16, with an fp32 master\) at optimizers\[1\]\.param_groups\[0\]"
                   r"\['params'\]\[1\] is also at optimizers\[0\]\.param_groups\[0\]"
                   r"\['params'\]\[0\]\. .*Give each half parameter to one optimizer",
                   opt_level=level, **kwargs)


def test_a_half_parameter_of_another_optimizer_is_refused_by_add_param_group():
    model = nn.Linear(4, 2)
    first = torch.optim.SGD([model.weight], lr=0.1)
    second = torch.optim.SGD([model.bias], lr=0.1)
    model, (first, second) = amp.initialize(model, [first, second], opt_level="O2",
                                            verbosity=0)
    groups = list(second.param_groups)
    with pytest.raises(ValueError, match=r"at the new param_groups\[1\]\['params'\]\[0\] "
                                         r"is also at an optimizer amp already manages"):
        second.add_param_group({"params": [model.weight]})
    assert second.param_groups == groups
    # without masters both optimizers update it, as torch's do: accepted
    model = nn.Linear(4, 2)
    first = torch.optim.SGD([model.weight], lr=0.1)
    second = torch.optim.SGD([model.bias, model.weight], lr=0.1)
    amp.initialize(model, [first, second], opt_level="O3", verbosity=0)


# --------------------------------------------------------------------------------------
# initialize twice
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("wrap", [False, True], ids=["optimizer", "larc"])
def test_same_optimizer_twice_changes_nothing(level, wrap):
    model = net()
    model, opt = amp.initialize(model, trained_sgd(model), opt_level=level, verbosity=1)
    fresh = net()
    again = LARC(opt) if wrap else opt
    before = snapshot([fresh, model], [opt])
    with pytest.raises(RuntimeError, match=r"A given optimizer should only be passed through "
                                           r"amp.initialize once; optimizers\[0\] already was"):
        amp.initialize(fresh, again, opt_level=level, verbosity=0)
    assert snapshot([fresh, model], [opt]) == before


def test_same_model_twice_changes_nothing():
    model = amp.initialize(net(), opt_level="O2", verbosity=1)
    fresh = net()
    opt = trained_sgd(fresh)
    before = snapshot([model, fresh], [opt])
    with pytest.raises(RuntimeError, match=r"already been through amp.initialize"):
        amp.initialize([fresh, model], opt, opt_level="O2", verbosity=0)
    assert snapshot([model, fresh], [opt]) == before


def test_initialize_again_on_fresh_objects_replaces_the_global_state():
    first = net()
    first, first_opt = amp.initialize(first, trained_sgd(first), opt_level="O2",
                                      num_losses=2, verbosity=1)
    old_props, old_scalers = amp_state().opt_properties, list(amp_state().loss_scalers)
    model = net()
    model, opt = amp.initialize(model, trained_sgd(model), opt_level="O1", loss_scale=8.0,
                                verbosity=0)
    assert amp_state().verbosity == 0
    assert amp_state().opt_properties is not old_props
    assert amp_state().opt_properties.opt_level == "O1"
    assert len(amp_state().loss_scalers) == 1 and amp_state().loss_scalers[0] not in old_scalers
    saved = amp.state_dict()
    assert list(saved) == ["loss_scaler0"]
    assert (saved["loss_scaler0"]["loss_scale"], saved["loss_scaler0"]["unskipped"]) == (8.0, 0)
    x, y = batch()
    before = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss(mse(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


# --------------------------------------------------------------------------------------
# unusual parameters that are accepted
# --------------------------------------------------------------------------------------

class Odd(nn.Module):
    """A trained layer, a frozen one, one never used (no gradient) and a zero-size one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trained = nn.Linear(4, 2)
        self.frozen = nn.Linear(4, 2)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(4, 2)
        self.empty = nn.Parameter(torch.empty(0))

    def forward(self, x):
        return self.trained(x) + self.frozen(x) + self.empty.sum()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused_sgd"])
def test_frozen_unused_and_zero_size_parameters(level, fused):
    model = Odd()
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = (FusedSGD if fused else torch.optim.SGD)(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=level, init_scale=2.**8, verbosity=0)
    half = level in ("O2", "O3")
    masters = list(amp.master_params(opt))
    assert len(masters) == 7
    if level == "O2":
        with_master = {n for n, p in model.named_parameters() if master_of(p) is not None}
        assert with_master == {"trained.weight", "trained.bias", "unused.weight",
                               "unused.bias", "empty"}  # frozen ones train nowhere
        assert master_of(model.empty).shape == (0,)
    x, y = batch()
    for _ in range(2):
        with amp.scale_loss(mse(model(x), y[:, :2]), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    params = dict(model.named_parameters())
    for name in ("frozen.weight", "frozen.bias", "unused.weight", "unused.bias"):
        expected = originals[name].half() if half else originals[name]
        assert _bits(params[name]) == _bits(expected), name
    assert not torch.equal(params["trained.weight"].float(), originals["trained.weight"])
    assert params["empty"].shape == (0,)
    state = model.state_dict()
    assert state["empty"].shape == (0,) and state["empty"].dtype == torch.float32
    if level == "O2":  # the unused layer's masters are still the values it came with
        assert _bits(state["unused.weight"]) == _bits(originals["unused.weight"])


@pytest.mark.parametrize("level", LEVELS)
def test_optimizer_param_outside_the_models_accepted(level):
    """Apex accepts a parameter the models do not hold: it is not cast and trains as is."""
    model = net()
    scale = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD(list(model.parameters()) + [scale], lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, init_scale=2.**8, verbosity=0)
    assert scale.dtype == torch.float32 and opt.param_groups[0]["params"][-1] is scale
    x, y = batch()
    with amp.scale_loss(mse(model(x) * scale, y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not torch.equal(scale.detach(), torch.ones(2)) and torch.isfinite(scale).all()


# --------------------------------------------------------------------------------------
# O2: master weights are the fp32 values the model came with
# --------------------------------------------------------------------------------------

def _fp32_checkpoint():
    """fp32 values that fp16 and bf16 cannot hold: the masters must keep every bit."""
    g = torch.Generator().manual_seed(3)
    state = {k: (torch.randn(v.shape, generator=g) / 3 if v.is_floating_point() else v)
             for k, v in net().state_dict().items()}
    for k in ("0.weight", "2.weight"):
        for half in HALVES:
            assert (state[k].to(half).float() != state[k]).all(), k
    return state


def _larc_sgd(params, lr):
    return LARC(torch.optim.SGD(params, lr=lr))


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, FusedSGD, FusedAdam, _larc_sgd],
                         ids=["sgd", "fused_sgd", "fused_adam", "larc"])
def test_o2_masters_are_the_fp32_values(half, opt_cls):
    checkpoint = _fp32_checkpoint()
    model = net()
    model.load_state_dict(checkpoint)
    model, opt = amp.initialize(model, opt_cls(model.parameters(), lr=0.1), opt_level="O2",
                                half_dtype=half, verbosity=0)
    params = dict(model.named_parameters())
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        p = params[name]
        assert p.dtype == half
        assert _bits(master_of(p)) == _bits(checkpoint[name]), name
        assert _bits(p) == _bits(checkpoint[name].to(half)), name  # the master, rounded
    masters = list(amp.master_params(opt))
    assert _bits(masters[0]) == _bits(checkpoint["0.weight"])
    state = model.state_dict()
    for name, value in checkpoint.items():
        assert _bits(state[name]) == _bits(value), name


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
def test_o2_first_step_trains_from_the_fp32_values(half):
    checkpoint = _fp32_checkpoint()
    model = net()
    model.load_state_dict(checkpoint)
    lr = 0.1
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=lr),
                                opt_level="O2", half_dtype=half, verbosity=0)
    x, y = batch()
    with amp.scale_loss(mse(model(x), y), opt) as scaled:
        scaled.backward()
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    assert scale == (2.0 ** 16 if half == torch.float16 else 1.0)
    opt.step()
    params = dict(model.named_parameters())
    state = model.state_dict()
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        p = params[name]
        grad = p.grad.float() * (1.0 / scale)  # the scaled half gradient, unscaled exactly
        assert grad.abs().sum() > 0, name
        expected = checkpoint[name].clone().add_(grad, alpha=-lr)
        assert _bits(master_of(p)) == _bits(expected), name
        assert _bits(p) == _bits(expected.to(half)), name
        assert _bits(state[name]) == _bits(expected), name


def test_o2_state_dict_and_optimizer_state_before_initialize():
    """Momentum from fp32 steps before initialize moves to the masters; the masters are
    the fp32 values after those steps."""
    model = net()
    opt = trained_sgd(model)
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    momentum = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    for name, p in model.named_parameters():
        master = master_of(p) if master_of(p) is not None else p
        assert _bits(master) == _bits(fp32[name]), name
        assert _bits(opt.state[master]["momentum_buffer"]) == _bits(momentum[name]), name
