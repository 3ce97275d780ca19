"""FusedMixedPrecisionLamb: Apex's signature, fp32 state and fp32 masters for half
parameters, the learning rate and step count as device tensors, grad_scale/found_inf,
checkpoints. Both CPU-side paths (interpreted kernels, production CPU path) through
conftest's ``path`` fixture.

The optimizer is FusedLAMB's machinery with masters: stepped on half parameters it
must update its fp32 masters exactly as FusedLAMB updates fp32 copies of them given the
same (widened) gradients, and both stay within a few fp32 ulps of the ``lamb_step_ref``
oracle.
"""
import copy
import inspect

import pytest
import torch

from conftest import assert_bits_equal, assert_bits_unchanged
from tritamp.kernels.lamb import lamb_step_ref
from tritamp.optimizers import FusedLAMB, FusedMixedPrecisionLamb

# One group mixing bf16, fp16 and fp32 parameters; (4099,) spans two interpreted programs.
SPECS = (((257,), torch.bfloat16), ((3, 7), torch.float16), ((1,), torch.float32),
         ((4099,), torch.bfloat16))
HYPER = dict(betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0)
# fp32 oracle vs the kernels and torch's fused CPU ops over three steps: the CPU path
# rounds the moments and u with fused multiply-adds (see kernels/lamb.py).
ORACLE_TOL = dict(rtol=1e-5, atol=1e-6)


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dt)) for s, dt in SPECS]


def _grads(step):
    # Sizes vary: the global norm clips on some steps, not on others.
    gen = torch.Generator().manual_seed(50 + step)
    mult = (0.01, 2.0, 0.05)[step % 3]
    return [(torch.randn(s, generator=gen) * mult).to(dt) for s, dt in SPECS]


def _set(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.to(p.dtype).clone()


def _master(opt, p):
    return opt.state[p]["master_param"] if p.dtype != torch.float32 else p.detach()


def test_signature_and_defaults_are_apexs():
    sig = inspect.signature(FusedMixedPrecisionLamb.__init__)
    assert [(n, q.default) for n, q in list(sig.parameters.items())[1:]] == [
        ("params", inspect.Parameter.empty), ("lr", 1e-3), ("step", 0),
        ("bias_correction", True), ("betas", (0.9, 0.999)), ("eps", 1e-6),
        ("weight_decay", 0.01), ("amsgrad", False), ("adam_w_mode", True),
        ("grad_averaging", True), ("max_grad_norm", 1.0), ("use_nvlamb", False),
        ("reduced_precision_dtype", None),
        # tritamp's, after Apex's: bf16 parameters without masters (docs/bf16-weights.md)
        ("stochastic_rounding", False), ("kahan_summation", False), ("seed", None)]
    assert FusedMixedPrecisionLamb._step_supports_amp_scaling


def test_amsgrad_is_refused():
    params = _params()
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError,
                       match=r"^FusedMixedPrecisionLamb does not support the AMSGrad variant\.$"):
        FusedMixedPrecisionLamb(params, amsgrad=True)
    assert_bits_unchanged(before, [p.detach() for p in params])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(step=-1), ValueError, r"Invalid step value: -1"),
    (dict(step=1.5), TypeError, r"step must be an integer .* got float 1\.5"),
    (dict(step=torch.tensor([2.0])), TypeError, r"one-element integer tensor, got a float32"),
    (dict(reduced_precision_dtype="bf16"), TypeError,
     r"reduced_precision_dtype must be torch\.float16, torch\.bfloat16 or None, got str"),
    (dict(reduced_precision_dtype=torch.float32), ValueError,
     r"reduced_precision_dtype must be .* got torch\.float32"),
    (dict(lr=-1e-3), ValueError, r"Invalid learning rate: -0\.001"),
])
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        FusedMixedPrecisionLamb(_params(), **kwargs)


def test_lr_and_step_are_per_group_device_tensors():
    a, b = _params()[:2]
    lr = torch.tensor(0.01)
    opt = FusedMixedPrecisionLamb([{"params": [a]}, {"params": [b], "step": 7}], lr=lr, step=3)
    g0, g1 = opt.param_groups
    for g in (g0, g1):
        assert g["lr"].dtype == torch.float32 and g["lr"].device == a.device
        assert g["step"].dtype == torch.int32 and g["step"].shape == (1,)
    assert g0["lr"] is not g1["lr"] and g0["lr"] is not lr
    assert g0["step"].tolist() == [3] and g1["step"].tolist() == [7]
    with pytest.raises(ValueError, match=r"Invalid step value: -2 \(parameter group 2\)"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "step": -2})
    assert len(opt.param_groups) == 2


def test_steps_like_fused_lamb_on_fp32_copies(path):
    ours = _params()
    copies = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt = FusedMixedPrecisionLamb(ours, lr=1e-2, **HYPER)
    ref = FusedLAMB(copies, lr=1e-2, **HYPER)
    for step in range(3):
        grads = _grads(step)
        _set(ours, grads)
        _set(copies, [g.float() for g in grads])
        opt.step()
        ref.step()
        for p, c in zip(ours, copies):
            master = _master(opt, p)
            assert master.dtype == torch.float32
            torch.testing.assert_close(master, c.detach(), rtol=1e-6, atol=1e-7)
            assert_bits_equal(p.detach(), master.to(p.dtype))  # the copy of its master
            for key in ("exp_avg", "exp_avg_sq"):
                assert opt.state[p][key].dtype == torch.float32
                # On the CPU path the global norm of the fp32 copies' gradients may be a
                # few fp32 ulps off the half gradients' (computed apart, in fp64): the
                # clip factor moves the moments by as much, more where m nearly cancels.
                scale = ref.state[c][key].abs().max()
                torch.testing.assert_close(opt.state[p][key], ref.state[c][key],
                                           rtol=1e-5, atol=1e-6 * scale)
    assert opt.param_groups[0]["step"].tolist() == [3]
    assert [float(opt.state[p]["step"]) for p in ours] == [3.0] * len(ours)


def test_matches_the_oracle_from_a_given_step_with_a_device_lr(path):
    # step=5: bias correction starts at t=6; the lr is read on the device each step.
    ours = _params()
    opt = FusedMixedPrecisionLamb(ours, lr=2e-2, step=5, **HYPER)
    xs = [p.detach().float() for p in ours]
    ms = [torch.zeros_like(x) for x in xs]
    vs = [torch.zeros_like(x) for x in xs]
    counts = [torch.tensor(5.0) for _ in xs]
    for step in range(3):
        lr = 2e-2 if step < 2 else 5e-3
        if step == 2:
            opt.param_groups[0]["lr"].fill_(lr)  # in place, as a scheduler may
        grads = _grads(step)
        _set(ours, grads)
        opt.step()
        g32 = [g.float() for g in grads]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in g32)).float()
        lamb_step_ref(xs, g32, ms, vs, counts, lr=lr, beta1=0.9, beta2=0.999, eps=1e-6,
                      weight_decay=0.01, global_grad_norm=norm, max_grad_norm=1.0)
        for p, x in zip(ours, xs):
            torch.testing.assert_close(_master(opt, p), x, **ORACLE_TOL)
    assert opt.param_groups[0]["step"].tolist() == [8]


def _scaled_step(opt, params, scaler, grads):
    loss = sum((p.float() * g.float()).sum() for p, g in zip(params, grads))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def test_grad_scaler_drives_it_and_a_skipped_step_changes_nothing(path):
    ours, plain = _params(), _params()
    opt = FusedMixedPrecisionLamb(ours, lr=1e-2, **HYPER)
    popt = FusedMixedPrecisionLamb(plain, lr=1e-2, **HYPER)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=1000)
    for step in range(2):
        grads = _grads(step)
        opt.zero_grad()
        _scaled_step(opt, ours, scaler, grads)
        _set(plain, grads)
        popt.step()
    bad = _grads(2)
    bad[0][3] = float("inf")
    opt.zero_grad()
    weights = [p.detach().clone() for p in ours]
    state = copy.deepcopy(opt.state_dict())
    _scaled_step(opt, ours, scaler, bad)
    assert scaler.get_scale() == 2.0 ** 11
    assert_bits_unchanged(weights, [p.detach() for p in ours])
    after = opt.state_dict()
    assert after["param_groups"][0]["step"].tolist() == [2]
    for key, st in state["state"].items():
        assert_bits_unchanged(list(st.values()), list(after["state"][key].values()))
    for a, b in zip(ours, plain):
        assert_bits_equal(a.detach(), b.detach())
        assert_bits_equal(_master(opt, a), _master(popt, b))


def test_reduced_precision_dtype_picks_the_parameters_with_masters(path):
    params = _params()
    opt = FusedMixedPrecisionLamb(params, lr=1e-2, reduced_precision_dtype=torch.bfloat16)
    before = [p.detach().clone() for p in params]
    _set(params, _grads(0))
    opt.step()
    assert ["master_param" in opt.state[p] for p in params] == [True, False, False, True]
    assert all(not torch.equal(b, p) for b, p in zip(before, params))


def test_state_dict_round_trip_resumes_bitwise(path):
    ours = _params()
    opt = FusedMixedPrecisionLamb(ours, lr=1e-2, **HYPER)
    for step in range(2):
        _set(ours, _grads(step))
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    kept = copy.deepcopy(saved)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    ropt = FusedMixedPrecisionLamb(resumed, lr=0.5, step=9)
    ropt.load_state_dict(saved)
    assert ropt.param_groups[0]["step"].tolist() == [2]
    assert ropt.param_groups[0]["lr"].dtype == torch.float32
    for o, p in ((opt, ours), (ropt, resumed)):
        _set(p, _grads(2))
        o.step()
    for a, b in zip(ours, resumed):
        assert_bits_equal(a.detach(), b.detach())
        for key, value in opt.state[a].items():
            assert_bits_equal(value, ropt.state[b][key], key)
    assert ropt.param_groups[0]["step"].tolist() == [3]
    # the loaded optimizer holds copies: the state dict it was given is unchanged
    assert saved["param_groups"][0]["step"].tolist() == [2]
    for key, st in kept["state"].items():
        assert_bits_unchanged(list(st.values()), list(saved["state"][key].values()))


def test_loads_apexs_checkpoint_layout(path):
    # Apex keeps the step count in the group only, and no masters in the state.
    params = _params()
    gen = torch.Generator().manual_seed(9)
    apex = {"state": {i: {"exp_avg": torch.randn(s, generator=gen) * 1e-3,
                          "exp_avg_sq": torch.rand(s, generator=gen) * 1e-6}
                      for i, (s, _) in enumerate(SPECS)},
            "param_groups": [dict(lr=torch.tensor(1e-2), step=torch.tensor([4], dtype=torch.int32),
                                  bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                                  weight_decay=0.01, grad_averaging=True, max_grad_norm=1.0,
                                  params=list(range(len(SPECS))))]}
    opt = FusedMixedPrecisionLamb(params)
    opt.load_state_dict(apex)
    assert [float(opt.state[p]["step"]) for p in params] == [4.0] * len(params)
    # The same state continued by FusedLAMB on fp32 copies, counts at 4.
    copies = [torch.nn.Parameter(p.detach().float()) for p in params]
    ref = FusedLAMB(copies, lr=1e-2, **HYPER)
    ref.load_state_dict({"state": {i: dict(st, step=torch.tensor(4.0))
                                   for i, st in apex["state"].items()},
                         "param_groups": [dict(apex["param_groups"][0], lr=1e-2)]})
    grads = _grads(1)
    _set(params, grads)
    _set(copies, [g.float() for g in grads])
    opt.step()
    ref.step()
    assert opt.param_groups[0]["step"].tolist() == [5]
    for p, c in zip(params, copies):
        torch.testing.assert_close(_master(opt, p), c.detach(), rtol=1e-6, atol=1e-7)
