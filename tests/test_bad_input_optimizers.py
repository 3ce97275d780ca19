"""Bad input to tritamp's fused optimizers: a clear error (torch.optim's message where
torch has one) and nothing changed; and the unusual input that must work: a learning rate
given only per parameter group, hyperparameters given as tensors, zero-size and frozen
parameters, fp32/fp16/bf16 parameters mixed in one group.

Mixed dtypes are held to the ``*_ref`` oracles with conftest's ``assert_close_to_ref``
(fp32 within 1e-6, a half value within one ulp of its dtype: one rounding of such an
fp32 value); LAMB and NovoGrad take their per-tensor norms from torch in the oracle, a
few fp32 ulps from the kernel's, so their fp32 rows get ``rtol=1e-5``.
"""
import copy

import pytest
import torch

from conftest import assert_bits_equal, assert_close_to_ref
from tritamp.testing import force_cpu_path, generation_of
from tritamp.kernels.adagrad import adagrad_step_ref
from tritamp.kernels.adam import adam_step_ref
from tritamp.kernels.lamb import lamb_step_ref
from tritamp.kernels.novograd import novograd_step_ref
from tritamp.kernels.sgd import sgd_step_ref
from tritamp.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

ALL = {"adam": FusedAdam, "sgd": FusedSGD, "adagrad": FusedAdagrad, "novograd": FusedNovoGrad,
       "lamb": FusedLAMB}
# the keyword arguments each needs beside the parameters (FusedSGD has no default lr)
KW = {"adam": {}, "sgd": dict(lr=0.1), "adagrad": {}, "novograd": {}, "lamb": {}}
# the torch.optim class whose checks and messages each one follows
TORCH = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad,
         "novograd": torch.optim.Adam, "lamb": torch.optim.Adam}


def params(*shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def grads_for(ps, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in ps]


def set_grads(ps, gs):
    for p, g in zip(ps, gs):
        p.grad = None if g is None else g.clone()


def message(fn):
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value)


def snapshot(opt):
    """Everything a refusal must leave as it was: parameters, state, groups."""
    ps = [p for g in opt.param_groups for p in g["params"]]
    state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
             for i, p in enumerate(ps) if p in opt.state}
    groups = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in g.items() if k != "params"}
              for g in opt.param_groups]
    return [p.detach().clone() for p in ps], state, groups, [list(g["params"]) for g in
                                                             opt.param_groups]


def assert_unchanged(before, opt):
    after = snapshot(opt)
    for i, (a, b) in enumerate(zip(before[0], after[0])):
        assert_bits_equal(a, b, f"param {i}")
    assert len(before[0]) == len(after[0])
    assert before[1].keys() == after[1].keys()
    for i in before[1]:
        assert before[1][i].keys() == after[1][i].keys(), i
        for k, v in before[1][i].items():
            w = after[1][i][k]
            if torch.is_tensor(v):
                assert_bits_equal(v, w, f"state[{i}][{k!r}]")
            else:
                assert v == w
    assert len(before[2]) == len(after[2])
    for g, h in zip(before[2], after[2]):
        assert g.keys() == h.keys()
        for k in g:
            assert (torch.equal(g[k], h[k]) if torch.is_tensor(g[k]) else g[k] == h[k]), k
    assert all(len(a) == len(b) and all(x is y for x, y in zip(a, b))
               for a, b in zip(before[3], after[3]))


def trained(name, n=2):
    ps = params((3, 4), (5,))
    opt = ALL[name](ps, **KW[name])
    for k in range(n):
        set_grads(ps, grads_for(ps, k))
        opt.step()
    return ps, opt


# =====================================================================================
# learning rate and other hyperparameters, tensors included
# =====================================================================================

@pytest.mark.parametrize("name", list(ALL))
@pytest.mark.parametrize("lr", [torch.tensor(-1.0), -1.0, torch.tensor(float("nan")),
                                torch.tensor([-1.0])],
                         ids=["tensor", "float", "tensor-nan", "tensor-1d"])
def test_negative_learning_rate_is_refused_with_torchs_message(name, lr):
    ours = message(lambda: ALL[name](params(3), lr=lr))
    if not (name == "sgd" and lr.isnan().any() if torch.is_tensor(lr) else False):
        # torch.optim.SGD lets a NaN lr through (it checks lr < 0); the others refuse it
        assert ours == message(lambda: torch.optim.Adam(params(3), lr=lr))
    assert ours[0] is ValueError and "Invalid learning rate: " in ours[1]


@pytest.mark.parametrize("name", list(ALL))
def test_learning_rate_tensor_of_several_elements_is_refused(name):
    kind, text = message(lambda: ALL[name](params(3), lr=torch.tensor([0.1, 0.2])))
    assert kind is ValueError and text.startswith("Tensor lr must be 1-element")


@pytest.mark.parametrize("name", list(ALL))
def test_learning_rate_of_a_wrong_type_is_a_type_error(name):
    kind, text = message(lambda: ALL[name](params(3), lr="0.1"))
    assert kind is TypeError and "lr" in text and "'0.1'" in text


BAD_TENSOR_HYPER = {
    "adam-beta2": ("adam", dict(betas=(torch.tensor(0.9), torch.tensor(1.5)))),
    "adam-beta1-neg": ("adam", dict(betas=(torch.tensor(-0.1), torch.tensor(0.9)))),
    "adam-eps": ("adam", dict(eps=torch.tensor(-1.0))),
    "adam-wd": ("adam", dict(weight_decay=torch.tensor(-1.0))),
    "sgd-momentum": ("sgd", dict(lr=0.1, momentum=torch.tensor(-1.0))),
    "sgd-wd": ("sgd", dict(lr=0.1, weight_decay=torch.tensor(-1.0))),
    "adagrad-eps": ("adagrad", dict(eps=torch.tensor(-1.0))),
    "adagrad-wd": ("adagrad", dict(weight_decay=torch.tensor(-1.0))),
}


@pytest.mark.parametrize("case", list(BAD_TENSOR_HYPER))
def test_hyperparameters_given_as_tensors_are_checked_like_torch(case):
    name, kw = BAD_TENSOR_HYPER[case]
    ours = message(lambda: ALL[name](params(3), **kw))
    theirs = message(lambda: TORCH[name](params(3), **kw))
    assert ours == theirs
    assert ours[0] is ValueError


@pytest.mark.parametrize("name", ["adam", "novograd", "lamb"])
@pytest.mark.parametrize("path", ["kernel", "cpu"])
def test_tensor_betas_eps_weight_decay_step_like_their_float_values(name, path):
    t = dict(betas=(torch.tensor(0.8), torch.tensor(0.95)), eps=torch.tensor(1e-6),
             weight_decay=torch.tensor(0.05))
    f = dict(betas=(float(t["betas"][0]), float(t["betas"][1])), eps=float(t["eps"]),
             weight_decay=float(t["weight_decay"]))
    a, b = params((3, 4), (5,)), params((3, 4), (5,))
    with force_cpu_path() if path == "cpu" else _null():
        oa, ob = ALL[name](a, lr=0.01, **t), ALL[name](b, lr=0.01, **f)
        # read once, at construction: the groups hold floats, the kernels launch arguments
        assert oa.param_groups[0]["betas"] == f["betas"]
        assert type(oa.param_groups[0]["eps"]) is float
        for k in range(3):
            set_grads(a, grads_for(a, k))
            set_grads(b, grads_for(b, k))
            oa.step()
            ob.step()
    for x, y in zip(a, b):
        assert_bits_equal(x.detach(), y.detach())


def test_sgd_tensor_momentum_steps_like_its_float_value():
    a, b = params((3, 4), (5,)), params((3, 4), (5,))
    oa = FusedSGD(a, lr=torch.tensor(0.1), momentum=torch.tensor(0.9),
                  dampening=torch.tensor(0.1), weight_decay=torch.tensor(0.01))
    ob = FusedSGD(b, lr=torch.tensor(0.1), momentum=float(torch.tensor(0.9)),
                  dampening=float(torch.tensor(0.1)), weight_decay=float(torch.tensor(0.01)))
    for k in range(3):
        set_grads(a, grads_for(a, k))
        set_grads(b, grads_for(b, k))
        oa.step()
        ob.step()
    for x, y in zip(a, b):
        assert_bits_equal(x.detach(), y.detach())


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("name", list(ALL))
def test_bad_value_in_a_parameter_group_is_refused_naming_the_group(name):
    kind, text = message(lambda: ALL[name]([{"params": params(3)},
                                            {"params": params(2), "lr": -0.5}], **KW[name]))
    assert kind is ValueError
    assert text == "Invalid learning rate: -0.5 (parameter group 1)"


@pytest.mark.parametrize("name", list(ALL))
def test_refused_add_param_group_changes_nothing(name):
    ps, opt = trained(name)
    before = snapshot(opt)
    gen = generation_of(opt)
    extra = {"params": params(4), "lr": torch.tensor(-1.0)}
    with pytest.raises(ValueError, match=r"Invalid learning rate: -1\.0 \(parameter group 1\)"):
        opt.add_param_group(extra)
    assert_unchanged(before, opt)
    assert generation_of(opt) == gen
    # and the optimizer still steps as before
    set_grads(ps, grads_for(ps, 9))
    opt.step()


# =====================================================================================
# a learning rate given only per parameter group
# =====================================================================================

@pytest.mark.parametrize("name", list(ALL))
def test_learning_rate_given_only_per_group(name):
    kw = {k: v for k, v in KW[name].items() if k != "lr"}
    a, b = params((3, 4), (5,)), params((3, 4), (5,))
    oa = ALL[name]([{"params": a[:1], "lr": 0.05}, {"params": a[1:], "lr": 0.01}], **kw)
    ob = ALL[name]([{"params": b[:1]}, {"params": b[1:], "lr": 0.01}], lr=0.05, **kw)
    assert [g["lr"] for g in oa.param_groups] == [0.05, 0.01]
    for k in range(3):
        set_grads(a, grads_for(a, k))
        set_grads(b, grads_for(b, k))
        oa.step()
        ob.step()
    for x, y in zip(a, b):
        assert_bits_equal(x.detach(), y.detach())


def test_fused_sgd_per_group_lr_follows_torch_sgd():
    a, b = params((3, 4), (5,)), params((3, 4), (5,))
    groups = lambda ps: [{"params": ps[:1], "lr": 0.1}, {"params": ps[1:], "lr": 0.02}]
    oa = FusedSGD(groups(a), momentum=0.9)
    ob = torch.optim.SGD(groups(b), momentum=0.9)
    for k in range(3):
        set_grads(a, grads_for(a, k))
        set_grads(b, grads_for(b, k))
        oa.step()
        ob.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_group_without_any_learning_rate_gets_torchs_error():
    kind, text = message(lambda: FusedSGD([{"params": params(3), "lr": 0.1},
                                           {"params": params(2)}]))
    # torch's own wording for the same mistake (an optimizer whose lr is required, as
    # FusedSGD's is in Apex), then where and how to fix it
    from torch.optim.optimizer import required

    class Required(torch.optim.Optimizer):
        def __init__(self, ps):
            super().__init__(ps, dict(lr=required))

    theirs = message(lambda: Required([{"params": params(2)}]))
    assert kind is theirs[0] is ValueError
    assert text.startswith(theirs[1])
    assert "(parameter group 1)" in text and "FusedSGD(params, lr=...)" in text


def test_fused_sgd_without_lr_anywhere_is_refused():
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        FusedSGD(params(3))


# =====================================================================================
# float64 (and other dtypes the sweeps do not update)
# =====================================================================================

ALTERNATIVE = {"adam": "torch.optim.AdamW", "sgd": "torch.optim.SGD",
               "adagrad": "torch.optim.Adagrad", "novograd": "model.float()",
               "lamb": "model.float()"}


@pytest.mark.parametrize("name", list(ALL))
def test_float64_parameters_are_refused_naming_dtype_and_alternative(name):
    ps = params(3) + params((2, 2), dtype=torch.float64)
    kind, text = message(lambda: ALL[name](ps, **KW[name]))
    assert kind is TypeError
    assert "parameter 1 of parameter group 0 is float64 with shape (2, 2)" in text
    assert ALTERNATIVE[name] in text and "float32" in text


@pytest.mark.parametrize("name", list(ALL))
def test_float64_group_added_later_is_refused_and_changes_nothing(name):
    ps, opt = trained(name)
    before = snapshot(opt)
    with pytest.raises(TypeError, match="parameter 0 of parameter group 1 is float64"):
        opt.add_param_group({"params": params(3, dtype=torch.float64)})
    assert_unchanged(before, opt)


@pytest.mark.parametrize("name", list(ALL))
def test_frozen_float64_parameter_is_left_alone(name):
    # torch's and Apex's optimizers only look at parameters that have a gradient
    frozen = torch.randn(3, dtype=torch.float64)
    ps = params(3)
    opt = ALL[name](ps + [frozen], **KW[name])
    set_grads(ps, grads_for(ps, 0))
    keep = frozen.clone()
    opt.step()
    assert torch.equal(frozen, keep) and frozen not in opt.state


@pytest.mark.parametrize("path", ["kernel", "cpu"])
@pytest.mark.parametrize("name", list(ALL))
def test_parameter_turned_float64_after_construction_is_refused_at_step(name, path):
    with force_cpu_path() if path == "cpu" else _null():
        _turned_float64_is_refused(name)


def _turned_float64_is_refused(name):
    ps, opt = trained(name)
    before = snapshot(opt)
    with torch.no_grad():
        extra = torch.randn(2).requires_grad_()
    opt.add_param_group({"params": [extra]})
    extra.data = extra.data.double()
    extra.grad = torch.ones(2, dtype=torch.float64)
    set_grads(ps, grads_for(ps, 5))
    with pytest.raises(TypeError, match=r"float64.*convert it \(\.float\(\)\), or use torch\.optim.s optimizer"):
        opt.step()
    assert extra not in opt.state  # no state was left behind for the refused parameter
    for i, p in enumerate(ps):
        assert_bits_equal(before[0][i], p.detach(), f"param {i}")


# =====================================================================================
# a parameter listed twice in one group (torch.optim warns; a fused sweep would race)
# =====================================================================================

DUPLICATE = (r"parameter group {g} lists the same parameter twice \(positions 0 and 2, "
             r"shape \(3, 4\)\); one step would update it twice, and on a GPU two "
             r"programs of its multi-tensor kernel would race on it: list each parameter once")


@pytest.mark.parametrize("name", list(ALL))
def test_a_parameter_listed_twice_is_refused_at_construction(name):
    ps = params((3, 4), (5,))
    with pytest.raises(ValueError, match=f"{ALL[name].__name__}: " + DUPLICATE.format(g=0)):
        ALL[name]([ps[0], ps[1], ps[0]], **KW[name])


def test_a_non_tensor_listed_twice_gets_torchs_error():
    with pytest.raises(TypeError, match="optimizer can only optimize Tensors, but one of "
                                        "the params is int"):
        FusedAdam([1, 1])


@pytest.mark.parametrize("name", list(ALL))
def test_a_group_listing_a_parameter_twice_is_refused_and_changes_nothing(name):
    ps, opt = trained(name)
    before = snapshot(opt)
    extra = params((3, 4), (2,), seed=3)
    with pytest.raises(ValueError, match=DUPLICATE.format(g=1)):
        opt.add_param_group({"params": [extra[0], extra[1], extra[0]]})
    assert_unchanged(before, opt)


@pytest.mark.parametrize("path", ["kernel", "cpu"])
@pytest.mark.parametrize("name", list(ALL))
def test_a_parameter_appended_twice_in_place_is_refused_at_step(name, path):
    with force_cpu_path() if path == "cpu" else _null():
        ps, opt = trained(name)
        opt.param_groups[0]["params"].append(ps[0])  # the list changed behind its back
        set_grads(ps, grads_for(ps, 5))
        before = snapshot(opt)
        with pytest.raises(ValueError, match=r"positions 0 and 2, shape \(3, 4\)"):
            opt.step()
        assert_unchanged(before, opt)


# =====================================================================================
# zero-size and frozen parameters; fp32/fp16/bf16 parameters in one group
# =====================================================================================

@pytest.mark.parametrize("path", ["kernel", "cpu"])
@pytest.mark.parametrize("name", list(ALL))
def test_zero_size_and_frozen_parameters(name, path):
    live = params((3, 4), (5,), seed=1)
    empty = torch.zeros(0, 3, requires_grad=True)
    frozen = torch.randn(4, requires_grad=False)
    no_grad = torch.randn(2, requires_grad=True)
    ref_live = [p.detach().clone().requires_grad_() for p in live]
    keep_frozen, keep_no_grad = frozen.clone(), no_grad.clone()
    with force_cpu_path() if path == "cpu" else _null():
        opt = ALL[name]([empty, live[0], frozen, no_grad, live[1]], **KW[name])
        ref = ALL[name](ref_live, **KW[name])
        for k in range(3):
            set_grads(live, grads_for(live, k))
            set_grads(ref_live, grads_for(ref_live, k))
            empty.grad = torch.zeros(0, 3)
            opt.step()
            ref.step()
    # the parameters with gradients step exactly as without the others
    for x, y in zip(live, ref_live):
        assert_bits_equal(x.detach(), y.detach())
    assert torch.equal(frozen, keep_frozen) and frozen not in opt.state
    assert torch.equal(no_grad.detach(), keep_no_grad) and no_grad not in opt.state
    assert empty.shape == (0, 3)
    # and the state dict of such an optimizer loads and keeps stepping
    twin = ALL[name]([empty, live[0].detach().clone().requires_grad_(), frozen, no_grad,
                      live[1].detach().clone().requires_grad_()], **KW[name])
    twin.load_state_dict(opt.state_dict())
    for st in twin.state.values():
        for k, v in st.items():
            assert v.dtype == torch.float32, k


def _ref_step(name, ps, gs, st):
    if name == "adam":
        adam_step_ref(ps, gs, st["exp_avg"], st["exp_avg_sq"], st["step"], lr=1e-2,
                      beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    elif name == "sgd":
        sgd_step_ref(ps, gs, st["momentum_buffer"], lr=0.1, momentum=0.9, steps=st["step"])
    elif name == "adagrad":
        adagrad_step_ref(ps, gs, st["sum"], lr=1e-2, eps=1e-10, steps=st["step"])
    elif name == "novograd":
        novograd_step_ref(ps, gs, st["exp_avg"], st["exp_avg_sq"], st["step"], lr=1e-2,
                          beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    else:
        lamb_step_ref(ps, gs, st["exp_avg"], st["exp_avg_sq"], st["step"], lr=1e-2, beta1=0.9,
                      beta2=0.999, eps=1e-6, weight_decay=0.01)


MIXED_KW = {"adam": dict(lr=1e-2, weight_decay=0.01), "sgd": dict(lr=0.1, momentum=0.9),
            "adagrad": dict(lr=1e-2), "novograd": dict(lr=1e-2, weight_decay=0.01),
            "lamb": dict(lr=1e-2, weight_decay=0.01, max_grad_norm=0)}
STATE_KEYS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",),
              "adagrad": ("sum",), "novograd": ("exp_avg",), "lamb": ("exp_avg", "exp_avg_sq")}


@pytest.mark.parametrize("path", ["kernel", "cpu"])
@pytest.mark.parametrize("name", list(ALL))
def test_fp32_fp16_bf16_parameters_in_one_group_match_the_oracle(name, path):
    ps = (params((3, 5), seed=2) + params((7,), dtype=torch.float16, seed=3)
          + params((4, 2), dtype=torch.bfloat16, seed=4) + params((6,), seed=5))
    ref_ps = [p.detach().clone() for p in ps]
    ref_state = {k: [torch.zeros(p.shape) for p in ps] for k in STATE_KEYS[name]}
    ref_state["step"] = [torch.zeros(()) for _ in ps]
    if name == "novograd":
        ref_state["exp_avg_sq"] = [torch.zeros(()) for _ in ps]
    with force_cpu_path() if path == "cpu" else _null():
        opt = ALL[name](ps, **MIXED_KW[name])
        for k in range(3):
            gs = grads_for(ps, 10 + k)
            set_grads(ps, gs)
            opt.step()
            _ref_step(name, ref_ps, [g.clone() for g in gs], ref_state)
    rows = [[p.detach()] for p in ps]
    for i, (p, r) in enumerate(zip(ps, ref_ps)):
        assert p.dtype == r.dtype
        if name in ("novograd", "lamb") and p.dtype == torch.float32:
            torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
        else:
            assert_close_to_ref(rows[i], [r], f"{name} param {i} ({p.dtype})")
        assert opt.state[p]["step"].item() == ref_state["step"][i].item() == 3
        for key in STATE_KEYS[name]:
            assert opt.state[p][key].dtype == torch.float32


# -- state and groups changed between steps behind the optimizer's back ---------------------------
def _run_with(make, steps=4, between=None):
    """``steps`` steps of a fresh optimizer over two parameters with fixed gradients;
    ``between(opt, params)`` runs before the third step. Returns (params, state)."""
    torch.manual_seed(0)
    params = [torch.randn(8, requires_grad=True), torch.randn(3, 2, requires_grad=True)]
    opt = make(params)
    for k in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.full(p.shape, 0.1 * (k + 1) * (i + 1))
        if k == 2 and between is not None:
            between(opt, params)
            _ = [torch.randn(16) for _ in range(64)]  # (reuse what a swap freed)
        opt.step()
    return [p.detach().clone() for p in params], opt.state


MAKERS = {"adam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
          "sgd": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9),
          "adagrad": lambda ps: FusedAdagrad(ps, lr=0.1),
          "lamb": lambda ps: FusedLAMB(ps, lr=1e-2),
          "novograd": lambda ps: FusedNovoGrad(ps, lr=1e-2)}


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_state_storage_swapped_in_place_is_followed(name, path):
    # An offloading helper's `v.data = v.data.to(device)` on every state tensor: the
    # kept sweep read and wrote the old storage (freed; on the Triton path garbage, NaN or
    # a corrupted heap; on the CPU path step counts that stopped advancing).
    def offload_and_back(opt, params):
        for st in opt.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    v.data = v.data.to("cpu", copy=True)

    ref, ref_state = _run_with(MAKERS[name])
    got, state = _run_with(MAKERS[name], between=offload_and_back)
    for a, b in zip(got, ref):
        assert_bits_equal(a, b, f"{name} parameters after a state swap")
    for (p, st), (_, ref_st) in zip(state.items(), ref_state.items()):
        for key, v in st.items():
            if torch.is_tensor(v):
                assert_bits_equal(v, ref_st[key], f"{name} state {key!r}")


@pytest.mark.parametrize("name,key,value", [
    ("adam", "betas", (torch.tensor(0.8), torch.tensor(0.99))),
    ("adam", "weight_decay", torch.tensor(0.05)),
    ("sgd", "dampening", torch.tensor(0.1)),
    ("lamb", "betas", (torch.tensor(0.8), torch.tensor(0.99))),
    ("novograd", "betas", (torch.tensor(0.8), torch.tensor(0.99)))])
def test_tensor_hyperparameters_set_after_construction_step_as_floats(name, key, value, path):
    # They reached the Triton launches as pointers and failed there, after the groups
    # before them had stepped.
    def set_on_second_group(value):
        def between(opt, params):
            opt.param_groups[1][key] = value
        return between

    def make(ps):
        opt = MAKERS[name]([ps[0]])
        opt.add_param_group({"params": [ps[1]]})
        return opt

    as_float = type(value)(float(v) for v in value) if isinstance(value, tuple) else float(value)
    ref, _ = _run_with(make, between=set_on_second_group(as_float))
    got, _ = _run_with(make, between=set_on_second_group(value))
    for a, b in zip(got, ref):
        assert_bits_equal(a, b, f"{name} with {key} set as tensors")


def test_a_parameter_added_in_place_to_a_second_group_is_refused_unchanged(path):
    a, b, c = (torch.randn(n, requires_grad=True) for n in (4, 5, 3))
    opt = FusedAdam([{"params": [a]}, {"params": [b, c]}], lr=0.1)
    for p in (a, b, c):
        p.grad = torch.ones_like(p)
    opt.step()
    opt.param_groups[1]["params"].append(a)
    before = [t.detach().clone() for t in (a, b, c)]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in (a, b, c)]
    with pytest.raises(ValueError, match=r"some parameters appear in more than one parameter "
                                         r"group \(a tensor of shape \(4,\) is in groups 0 and 1\)"):
        opt.step()
    for x, y in zip(before, (a, b, c)):
        assert_bits_equal(x, y.detach(), "parameters after the refused step")
    for st, p in zip(states, (a, b, c)):
        for k, v in st.items():
            assert_bits_equal(v, opt.state[p][k], f"state {k!r} after the refused step")


def test_lr_set_to_none_is_refused_by_name():
    p = torch.randn(4, requires_grad=True)
    opt = FusedAdam([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.param_groups[0]["lr"] = None
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['lr'\] is None"):
        opt.step()
    assert not opt.state[p]


# -- a kept plan meets tensors changed at the same address ------------------------------------
@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("grad_too", [True, False], ids=["grad-narrowed", "grad-kept"])
def test_parameter_narrowed_through_data_at_its_address_is_refused_unchanged(name, grad_too,
                                                                           path):
    # p.data = p.data[:2] keeps the address and strides: the kept plan swept the old 24
    # elements (the rows no longer in p written; on the CPU path with the gradient kept,
    # a (2, 6) parameter stepped against a (4, 6) gradient).
    base = torch.randn(4, 6)
    p = torch.nn.Parameter(base.clone())
    opt = MAKERS[name]([p])
    for _ in range(2):
        p.grad = torch.full((4, 6), 0.1)
        opt.step()
    storage = p.detach().clone()
    p.data = p.data[:2]
    if grad_too:
        p.grad.data = p.grad.data[:2]
    state = {k: v.clone() for k, v in opt.state[p].items()}
    with pytest.raises(ValueError, match=r"shape \(2, 6\)"):
        opt.step()
    assert_bits_equal(storage, torch.as_strided(p.detach(), (4, 6), (6, 1)),
                      "the parameter's storage, rows outside it included")
    for k, v in state.items():
        assert_bits_equal(v, opt.state[p][k], f"state {k!r} after the refused step")


def test_gradient_of_another_dtype_at_the_old_gradients_address(path):
    # With grad_dtype lifted, a bf16 gradient put where last step's fp16 one lay (a
    # gradient pool, or the allocator's reuse) has the same address and strides: the kept
    # plan read its bits as fp16.
    p = torch.nn.Parameter(torch.zeros(8, 8))
    p.grad_dtype = None
    opt = FusedSGD([p], lr=1.0)
    pool = torch.empty(8 * 8 * 2, dtype=torch.uint8)
    for dtype in (torch.float16, torch.bfloat16):
        g = pool.view(dtype).view(8, 8)
        g.fill_(0.5)
        p.grad = g
        opt.step()
    assert torch.equal(p.detach(), torch.full((8, 8), -1.0))


@pytest.mark.parametrize("opt_name", ["adam", "lamb"])
def test_master_replaced_in_the_state_is_the_one_stepped(opt_name, path):
    # state[p]["master_param"] = t: the step kept updating the old master and writing p
    # from it; the new one stayed untouched (and was what state_dict saved).
    p = torch.nn.Parameter(torch.full((4, 4), 1.0, dtype=torch.bfloat16))
    make = {"adam": lambda: FusedAdam([p], lr=1.0, master_weights=True),
            "lamb": lambda: FusedLAMB([p], lr=1.0, master_weights=True)}[opt_name]
    opt = make()
    p.grad = torch.ones(4, 4, dtype=torch.bfloat16)
    opt.step()
    new = torch.full((4, 4), 100.0)
    opt.state[p]["master_param"] = new
    p.grad = torch.ones(4, 4, dtype=torch.bfloat16)
    opt.step()
    assert opt.state[p]["master_param"] is new
    assert (new < 100.0).all()  # stepped
    assert torch.equal(p.detach(), new.to(torch.bfloat16))
    # a master of another shape is refused by name, nothing written
    opt.state[p]["master_param"] = torch.zeros(3)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        opt.step()
    assert_bits_equal(before, p.detach(), "the parameter after the refused step")


# -- tensors a step writes that share memory ----------------------------------------------
SHARE = r"share memory; one step would update the shared elements twice"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_overlapping_parameter_views_are_refused_unchanged(name, dtype, path):
    # Two views of one tensor, base[:6] and base[2:]: on the CPU path a half parameter's
    # fp32 copy written back last won (the shared elements got one update of two); on a
    # GPU two programs would race on them.
    base = torch.randn(8).to(dtype)
    a, b = torch.nn.Parameter(base[:6]), torch.nn.Parameter(base[2:])
    opt = MAKERS[name]([a, b])
    a.grad, b.grad = torch.ones(6, dtype=dtype), torch.ones(6, dtype=dtype)
    keep = base.clone()
    with pytest.raises(ValueError, match=r"parameter 0 \(shape \(6,\)\) and parameter 1 "
                                         r"\(shape \(6,\)\) " + SHARE):
        opt.step()
    assert_bits_equal(keep, base, "the parameters' memory after the refused step")


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_parameter_views_are_judged_by_the_elements_they_share(name, path):
    # base[0::2] holds elements 0, 2, 4, 6: it shares 4 and 6 with base[4:] (refused as
    # sharing memory, though its first and last bytes lie before base[4:]'s last) and
    # nothing with base[1::2] (refused only as not dense, which every sweep refuses)
    base = torch.arange(8.0)
    keep = base.clone()
    for other, match in ((base[4:], r"parameter 0 \(shape \(4,\)\) and parameter 1 "
                                    r"\(shape \(4,\)\) " + SHARE),
                         (base[1::2], r"params\[0\] of shape \(4,\) has strides \(2,\): "
                                      r"not dense")):
        a, b = torch.nn.Parameter(base[0::2]), torch.nn.Parameter(other)
        opt = MAKERS[name]([a, b])
        a.grad, b.grad = torch.ones(4), torch.ones(4)
        with pytest.raises(ValueError, match=match):
            opt.step()
        assert_bits_equal(keep, base, "the parameters' memory after the refused step")


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_adjacent_views_of_one_buffer_step_as_separate_tensors(name, path):
    # views that tile one flat buffer without overlapping (a flattened-parameter layout)
    flat = torch.randn(14)
    views = [torch.nn.Parameter(flat[:8].view(2, 4)), torch.nn.Parameter(flat[8:])]
    alone = [torch.nn.Parameter(v.detach().clone()) for v in views]
    opts = MAKERS[name](views), MAKERS[name](alone)
    for _ in range(2):
        for ps, opt in zip((views, alone), opts):
            for p in ps:
                p.grad = torch.full(p.shape, 0.5)
            opt.step()
    for v, p in zip(views, alone):
        assert_bits_equal(p.detach(), v.detach(), f"{name}: a view of the flat buffer")


def test_one_state_tensor_under_two_keys_is_refused_unchanged(path):
    p = torch.nn.Parameter(torch.randn(4))
    opt = FusedAdam([p], lr=0.1)
    p.grad = torch.ones(4)
    opt.step()
    opt.state[p]["exp_avg_sq"] = opt.state[p]["exp_avg"]
    before = p.detach().clone(), opt.state[p]["exp_avg"].clone()
    with pytest.raises(ValueError, match=r"state\['exp_avg'\] of parameter 0 \(shape \(4,\)\) "
                                         r"and state\['exp_avg_sq'\] of parameter 0 "
                                         r"\(shape \(4,\)\) " + SHARE):
        opt.step()
    assert_bits_equal(before[0], p.detach(), "the parameter after the refused step")
    assert_bits_equal(before[1], opt.state[p]["exp_avg"], "the moment after the refused step")


# -- a group's list or a parameter's dtype changed behind a kept plan's back --------------------
def _torch_twin(name, ps):
    return {"adam": lambda: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
            "sgd": lambda: torch.optim.SGD(ps, lr=0.1, momentum=0.9)}[name]()


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_a_parameter_swapped_into_a_groups_list_in_place_is_the_one_stepped(name, path):
    # params[1] = c (same length): the kept links went on stepping b (on its last
    # gradient) and never c
    def run(make):
        a, b, c = (torch.nn.Parameter(torch.full((3,), v)) for v in (1.0, 2.0, 3.0))
        opt = make([a, b])
        for k in range(3):
            if k == 1:
                opt.param_groups[0]["params"][1] = c
                b.grad = None
            for p in opt.param_groups[0]["params"]:
                p.grad = torch.full((3,), 0.5 * (k + 1))
            opt.step()
        return [t.detach() for t in (a, b, c)]

    got = run(MAKERS[name])
    want = run(lambda ps: _torch_twin(name, ps))
    for g, w, what in zip(got, want, ("a", "b (removed)", "c (swapped in)")):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7, msg=what)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_a_parameter_swapped_for_a_duplicate_in_place_is_refused(name, path):
    ps, opt = trained(name)
    opt.param_groups[0]["params"][1] = ps[0]
    ps[0].grad = torch.ones_like(ps[0])
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"lists the same parameter twice \(positions 0 and 1"):
        opt.step()
    assert_unchanged(before, opt)


@pytest.mark.parametrize("start,after", [(torch.float32, torch.float16),
                                         (torch.float16, torch.float32)])
def test_master_weights_follow_a_parameter_recast_through_data(start, after, path):
    # model.half() / model.float() after a step assign param.data: the kept links kept the
    # old decision (an fp16 parameter stepped without a master; an fp32 one from an orphaned
    # master, copied into it)
    def grad(k, dtype):
        return torch.randn(64, generator=torch.Generator().manual_seed(k)).to(dtype)

    model = torch.nn.Linear(64, 1, bias=False).to(start)
    opt = FusedAdam([model.weight], lr=1e-3, master_weights=True)
    model.weight.grad = grad(0, start).view(1, 64)
    opt.step()
    saved, weight = copy.deepcopy(opt.state_dict()), model.weight.detach().clone()
    model.to(after)
    twin = torch.nn.Linear(64, 1, bias=False).to(start)
    with torch.no_grad():
        twin.weight.copy_(weight)
    twin.to(after)
    fresh = FusedAdam([twin.weight], lr=1e-3, master_weights=True)
    fresh.load_state_dict(saved)
    for k in range(1, 4):
        for m, o in ((model, opt), (twin, fresh)):
            m.weight.grad = grad(k, after).view(1, 64)
            o.step()
    assert_bits_equal(twin.weight.detach(), model.weight.detach(), "the recast parameter")
    assert ("master_param" in opt.state[model.weight]) == (after == torch.float16)


@pytest.mark.parametrize("make,key,mine", [
    (lambda ps, **kw: FusedAdam(ps, lr=0.1, **kw), "decoupled_weight_decay", True),
    (lambda ps, **kw: FusedAdam(ps, lr=0.1, adam_w_mode=False, **kw),
     "decoupled_weight_decay", False),
    (lambda ps, **kw: FusedAdagrad(ps, lr=0.1, **kw), "adagrad_w_mode", False),
], ids=["adam-w", "adam-l2", "adagrad-l2"])
def test_a_group_naming_the_other_weight_decay_rule_is_refused(make, key, mine):
    """torch.optim.Adam's per-group decoupled_weight_decay (FusedAdagrad's adagrad_w_mode):
    a group asking for the rule the optimizer does not apply was kept and ignored (the
    other rule stepped, 0.25 off after 3 steps), and state_dict() wrote the optimizer's
    rule over it. Refused at construction, in add_param_group and at a step; the same
    rule, or no weight decay, is accepted."""
    p, q = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    other = {key: not mine, "weight_decay": 0.5}
    with pytest.raises(ValueError, match=rf"says {key}={not mine} with weight_decay=0\.5.*"
                                         rf"applies {key}={mine}"):
        make([dict(params=[p], **other)])
    opt = make([p], weight_decay=0.5)
    with pytest.raises(ValueError, match=f"{key}={not mine}"):
        opt.add_param_group(dict(params=[q], **other))
    opt.add_param_group(dict(params=[q], **{key: mine}))           # the same rule
    make([dict(params=[torch.nn.Parameter(torch.ones(2))], **{key: not mine})])  # no decay
    p.grad, q.grad = torch.ones(4), torch.ones(4)
    opt.param_groups[1][key] = not mine
    before = [p.detach().clone(), q.detach().clone()]
    with pytest.raises(ValueError, match=r"param_groups\[1\]"):
        opt.step()
    assert torch.equal(before[0], p) and torch.equal(before[1], q) and len(opt.state) == 0


# -- a refusal names the parameter as the user knows it ---------------------------------------
def _refused_naming(opt, name, place):
    """The step's ValueError, which must lead with the parameter's ``place`` and leave the
    optimizer as it was; returns its text."""
    before = snapshot(opt)
    kind, text = message(opt.step)
    assert kind is ValueError
    assert text.startswith(f"{ALL[name].__name__}'s {place}: "), text
    assert_unchanged(before, opt)
    return text


@pytest.mark.parametrize("name", list(ALL))
def test_refused_gradient_is_named_by_group_and_position(name, path):
    # The step's sweep counts only the group's parameters with a gradient: its index alone
    # (grads[1] here) would point at another parameter. The refusal leads with the
    # parameter's place in its group.
    first = params((5,), seed=1)
    a, b, c = params((2,), (3,), (4,), seed=2)
    opt = ALL[name]([{"params": first}, {"params": [a, b, c]}], **KW[name])
    first[0].grad = torch.randn(5)
    b.grad = torch.randn(3)
    c.grad = torch.randn(4)
    c.data = torch.randn(6)  # new data of another shape; its old gradient stays
    text = _refused_naming(opt, name, "param_groups[1]['params'][2] (index 1 below)")
    assert "grads[1] has shape (4,) but params[1] has shape (6,)" in text
    assert "zero_grad(set_to_none=True)" in text
    c.grad = None  # as the message says: the step goes through
    opt.step()


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_gradient_that_cannot_be_written_back_is_named_by_group_and_position(name, path):
    # torch.amp.GradScaler's protocol (grad_scale / found_inf set on the optimizer): an
    # expanded gradient cannot take the unscaled values back; refused by its place.
    a, b, c = params((4,), (3,), (5,), seed=3)
    opt = ALL[name]([{"params": [a]}, {"params": [b, c]}], **KW[name])
    a.grad = torch.randn(4)
    c.grad = torch.full((1,), 4.0).expand(5)
    opt.grad_scale = torch.tensor(4.0)
    opt.found_inf = torch.tensor(0.0)
    text = _refused_naming(opt, name, "param_groups[1]['params'][1] (index 0 below)")
    assert "grads[0] of shape (5,) has strides (0,)" in text


@pytest.mark.parametrize("bad", [dict(nesterov=True, momentum=0.0),
                                 dict(nesterov=True, momentum=0.9, dampening=0.5)])
def test_fused_sgd_add_param_group_refuses_what_its_constructor_refuses(bad):
    opt = FusedSGD(params((3,)), lr=0.1)
    before = snapshot(opt)
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero "
                                         "dampening; got"):
        opt.add_param_group(dict(params=params((2,), seed=1), **bad))
    assert_unchanged(before, opt)


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB], ids=["adam", "lamb"])
def test_a_bad_amp_scale_is_refused_before_the_masters_follow_their_weights(cls, path):
    # The step's amp tensors were checked in each group's launch: after the fp32 masters
    # had taken the weights written since the last step (a refused step moved them), and
    # after FusedLAMB's norm over the groups had read the scale (its refusal then named
    # the norm's `scale`, not the step's `grad_scale`).
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = cls([p], lr=0.1, master_weights=True)
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    opt.step()
    master = opt.state[p]["master_param"]
    with torch.no_grad():
        p.fill_(5.0)  # a weight written between steps: the next step's master follows it
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    before = master.clone(), p.detach().clone()
    for bad, err, match in ((torch.tensor(2.0, device="meta"), ValueError,
                             r"grad_scale is on meta but the tensors are on cpu"),
                            (2.0, TypeError, r"grad_scale must be a one-element tensor")):
        opt.grad_scale, opt.found_inf = bad, torch.zeros(())
        with pytest.raises(err, match=match):
            opt.step()
        assert_bits_equal(before[0], master, "the master after the refused step")
        assert_bits_equal(before[1], p.detach(), "the parameter after the refused step")
