"""Promises of amp's set-up that earlier tests left unpinned: every opt level's property
table against Apex's (None, False and True told apart) and its bf16 variant; the
register_* functions and decorators with three arguments or an integer index among
them; O1's refusal of master_weights / keep_batchnorm_fp32 even when False (Apex's
rule); cast_model_outputs without a cast or patched functions; the default loss-scale
ceiling (Apex's 2**24); the overflow names (a half parameter only the optimizer holds,
nonfinite_gradients after a skipped O2 step); and
``tritamp.testing.stash_of`` on an optimizer amp never saw.

Everything runs on a CPU in fp32 or bf16 (autocast on the CPU); tensors are tiny.
"""
import logging

import pytest
import torch
from torch import nn

from conftest import amp_step
from tritamp import amp
from tritamp.testing import amp_state, stash_of

# Apex's O0-O3 (apex/amp/frontend.py): cast_model_type, patch_torch_functions,
# keep_batchnorm_fp32, master_weights, loss_scale
APEX_DEFAULTS = {
    "O0": (torch.float32, False, None, False, 1.0),
    "O1": (None, True, None, None, "dynamic"),
    "O2": (torch.float16, False, True, True, "dynamic"),
    "O3": (torch.float16, False, False, False, 1.0),
}
KEYS = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights",
        "loss_scale")


def _props(opt_level, **kwargs):
    amp.initialize(nn.Linear(2, 2), opt_level=opt_level, verbosity=0, **kwargs)
    return amp_state().opt_properties


@pytest.mark.parametrize("opt_level", sorted(APEX_DEFAULTS))
def test_each_opt_levels_properties_are_apexs_and_keep_their_identity(opt_level):
    props = _props(opt_level)
    got = tuple(getattr(props, k) for k in KEYS)
    assert got == APEX_DEFAULTS[opt_level]
    # None, False and True are distinct answers in Apex's table (None: "not applicable")
    for k, want, value in zip(KEYS, APEX_DEFAULTS[opt_level], got):
        if want is None or isinstance(want, bool):
            assert value is want, (k, value)
    assert props.enabled is True and props.opt_level == opt_level
    assert props.half_dtype is torch.float16


@pytest.mark.parametrize("opt_level", sorted(APEX_DEFAULTS))
def test_bf16_opt_levels_cast_to_bf16_and_scale_by_one(opt_level):
    props = _props(opt_level, half_dtype=torch.bfloat16)
    cast, patch, keep_bn, master, _ = APEX_DEFAULTS[opt_level]
    want_cast = torch.bfloat16 if cast is torch.float16 else cast
    assert (props.cast_model_type, props.patch_torch_functions, props.keep_batchnorm_fp32,
            props.master_weights, props.loss_scale) == (want_cast, patch, keep_bn, master, 1.0)
    assert props.half_dtype is torch.bfloat16


def test_promote_function_runs_in_the_widest_of_three_arguments_whatever_their_order():
    @amp.promote_function
    def add3(a, b, c):
        return a + b + c

    x = torch.ones(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for dtypes in [(torch.bfloat16, torch.float32, torch.bfloat16),
                       (torch.float32, torch.bfloat16, torch.bfloat16),
                       (torch.bfloat16, torch.bfloat16, torch.float32)]:
            assert add3(*(x.to(d) for d in dtypes)).dtype == torch.float32, dtypes


@pytest.mark.parametrize("register", ["half", "float", "promote"])
def test_registered_functions_leave_an_integer_index_argument_as_it_is(register):
    seen = {}

    def pick(t, index):
        seen["index"] = index.dtype
        return t.index_select(0, index)

    ns = type("NS", (), {})()
    ns.pick = pick
    getattr(amp, f"register_{register}_function")(ns, "pick")
    x = torch.arange(6.0).reshape(3, 2)
    index = torch.tensor([2, 0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ns.pick(x, index)
    assert seen["index"] == torch.int64
    assert torch.equal(out.float(), x[[2, 0]])


@pytest.mark.parametrize("kwargs,match", [
    (dict(master_weights=False), r"master_weights with O1"),
    (dict(master_weights="False"), r"master_weights with O1"),
    (dict(keep_batchnorm_fp32=False), r"keep_batchnorm_fp32 should be None"),
    (dict(keep_batchnorm_fp32="False"), r"keep_batchnorm_fp32 should be None"),
])
def test_o1_refuses_master_weights_or_keep_batchnorm_fp32_set_even_to_false(kwargs, match):
    # Apex refuses any value but None at O1, False included: O1 has no such option
    model = nn.Linear(2, 2)
    before = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match=match):
        amp.initialize(model, opt_level="O1", verbosity=0, **kwargs)
    assert amp_state().opt_properties is None and amp_state().loss_scalers == []
    assert torch.equal(model.weight, before) and model.forward.__func__ is nn.Linear.forward


def test_cast_model_outputs_applies_with_neither_a_cast_nor_patched_functions():
    # O1 with patch_torch_functions=False casts nothing itself, but the outputs still
    # leave the model in cast_model_outputs (Apex's last branch)
    torch.manual_seed(0)
    model = amp.initialize(nn.Linear(2, 2), opt_level="O1", patch_torch_functions=False,
                           cast_model_outputs=torch.bfloat16, verbosity=0)
    assert model.weight.dtype == torch.float32
    x = torch.ones(1, 2)
    out = model(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, nn.functional.linear(x, model.weight, model.bias).bfloat16())


def test_initializes_default_ceiling_is_apexs_two_to_the_24():
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp.initialize(model, opt, opt_level="O0", loss_scale="dynamic",
                                init_scale=2.**24, growth_interval=1, verbosity=0)
    for _ in range(2):  # clean steps: growth would double the scale but for the ceiling
        amp_step(model, opt, torch.ones(2, 2), loss_fn=lambda out, _y: out.sum())
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.**24


def test_nonfinite_gradients_after_a_skipped_o2_step_reads_the_half_gradients():
    # the skipped step spends the masters' gradients; the half model's are still there
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    model.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    amp_step(model, opt, torch.ones(1, 2), loss_fn=lambda out, _y: out.float().sum())
    assert amp.last_step_skipped(opt)
    assert amp.nonfinite_gradients(opt) == [("weight", 4)]
    opt.zero_grad()
    model(torch.ones(1, 2)).float().sum().backward()  # a plain backward, outside scale_loss
    assert amp.nonfinite_gradients(opt) == [("weight", 4)]


def test_the_skip_warning_names_a_half_parameter_outside_the_models_by_its_group(caplog):
    # a bf16 parameter handed to the optimizer only gets an fp32 master at O2; the
    # warning names it by its place in the optimizer, not as "a parameter"
    caplog.set_level(logging.WARNING, logger="tritamp.amp")
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    extra = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": [extra]}], lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                loss_scale="dynamic", verbosity=1)
    amp_step(model, opt, torch.ones(1, 2), factor=float("inf"),
             loss_fn=lambda out, _y: out.float().sum() + extra.float().sum())
    skips = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("Gradient overflow")]
    assert len(skips) == 1
    assert "param_groups[1][0] (shape [3]) (3 values)" in skips[0]
    assert "a parameter" not in skips[0]


def test_stash_of_is_none_for_an_optimizer_amp_never_saw():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert stash_of(opt) is None
    model, opt = amp.initialize(model, opt, opt_level="O0", verbosity=0)
    assert stash_of(opt) is not None
