"""bf16 weights without fp32 masters: stochastic rounding and Kahan-compensated summation
in every fused optimizer (docs/bf16-weights.md).

The kernels (Triton's interpreter) are held bitwise to their ``*_ref`` oracles, the CPU
path to the same oracles; a skipped step leaves every bit as it was; a run resumed from
a checkpoint is bitwise equal to an uninterrupted one on both paths; stochastic rounding
is unbiased; the flags are checked before anything changes."""
import copy
import math

import pytest
import torch
from torch import nn

import tritamp.optimizers as O
from tritamp import amp
from tritamp.kernels import adagrad, adam, lamb, novograd, rounding, sgd
from conftest import CountOps, assert_bits_equal, clone_lists
from tritamp.testing import force_cpu_path

ALL = ("FusedAdam", "FusedSGD", "FusedAdagrad", "FusedLAMB", "FusedNovoGrad",
       "FusedMixedPrecisionLamb")
MODES = ({"stochastic_rounding": True, "seed": 3}, {"kahan_summation": True})
MODE_IDS = ("stochastic", "kahan")


# --- the rounding itself ---------------------------------------------------------------------
def test_hash_matches_between_python_ints_and_tensors():
    xs = [0, 1, 2, 12345, 2 ** 31, 2 ** 32 - 1]
    assert rounding.mix32(torch.tensor(xs)).tolist() == [rounding.mix32(x) for x in xs]
    # distinct parameters and seeds get distinct keys
    keys = {rounding.param_key(seed, i) for seed in (0, 1, 2 ** 40) for i in range(100)}
    assert len(keys) == 300


@pytest.mark.parametrize("value", [1.0 + 2 ** -10, -3.3e-3, 0.7071, 1e-30, 6.1e4])
def test_stochastic_rounding_is_unbiased(value):
    n = 200_000
    x = torch.full((n,), value, dtype=torch.float32)
    tkeys = rounding.tensor_key(torch.tensor([rounding.param_key(7, 0)]), torch.tensor([1.0]))
    bits = rounding.element_bits(tkeys.expand(n), torch.arange(n))
    out = rounding.stochastic_round_(x.clone(), bits).to(torch.bfloat16).double()
    lo = torch.tensor(value).to(torch.bfloat16)
    lo = lo.double().item()
    # the two neighbours of the value, and its position between them
    lo_b = torch.tensor([value], dtype=torch.float32).view(torch.int32) & -65536
    lo = lo_b.view(torch.float32).double().item()
    hi_b = lo_b + 65536
    hi = hi_b.view(torch.float32).double().item()
    assert set(out.unique().tolist()) <= {lo, hi}
    f = (value - lo) / (hi - lo)
    sigma = abs(hi - lo) * math.sqrt(f * (1 - f) / n)
    assert abs(out.mean().item() - value) < 5 * sigma + 1e-12 * abs(value)
    # it is not round-to-nearest: both neighbours occur in proportion
    assert abs((out == hi).double().mean().item() - f) < 5 * math.sqrt(f * (1 - f) / n)


def test_a_stochastically_rounded_step_is_unbiased(path):
    """One FusedSGD step on 65536 bf16 weights of 1.0 whose update (-1e-4) is far below
    half a bf16 ulp: round to nearest would leave every weight at 1.0; stochastic rounding
    moves the mean by the update, within 5 standard deviations."""
    n = 65536
    p = nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    p.grad = torch.full((n,), 1e-3, dtype=torch.bfloat16)
    O.FusedSGD([p], lr=0.1, stochastic_rounding=True, seed=11).step()
    want = 1.0 - 0.1 * torch.tensor(1e-3, dtype=torch.bfloat16).double().item()
    lo, hi = 1.0 - 2 ** -8, 1.0
    out = p.detach().double()
    assert set(out.unique().tolist()) == {lo, hi}
    f = (want - lo) / (hi - lo)
    sigma = (hi - lo) * math.sqrt(f * (1 - f) / n)
    assert abs(out.mean().item() - want) < 5 * sigma
    assert 5 * sigma < 0.2 * (1.0 - want)  # the bound is far tighter than the update


def test_stochastic_rounding_keeps_exact_and_non_finite_values():
    x = torch.tensor([1.0, -2.5, 0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.0e38])
    exact = x[:6].clone()
    bits = torch.full((8,), 65535)
    out = rounding.stochastic_round_(x.clone(), bits)
    assert torch.equal(out[:6].view(torch.int32), exact.view(torch.int32))
    assert torch.isnan(out[6])
    assert out.to(torch.bfloat16)[7] == torch.tensor(3.0e38).to(torch.bfloat16) or \
        torch.isinf(out[7])


def test_kahan_split_is_a_fixed_point():
    """p + c read back splits into the same (p, c): a step that changes nothing stores
    the same bits."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g) * torch.logspace(-20, 20, 100_000)
    p = x.to(torch.bfloat16)
    c = rounding.kahan_remainder_(x - p.float()).to(torch.bfloat16)
    again = p.float() + c.float()
    p2 = again.to(torch.bfloat16)
    c2 = rounding.kahan_remainder_(again - p2.float()).to(torch.bfloat16)
    assert_bits_equal(p2, p)
    assert_bits_equal(c2, c)
    # and the pair carries far more than bf16's 8 bits
    rel = ((again.double() - x.double()).abs() / x.double().abs()).max().item()
    assert rel < 2 ** -15


# --- the launchers against their oracles --------------------------------------------------------
SHAPES = ((1000,), (3, 257), (7,))


def _lists(kind, which, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES]
    gs = [(torch.randn(s, generator=g) * 1024).to(torch.bfloat16) for s in SHAPES]
    steps = [torch.tensor(float(2 * i)) for i in range(len(SHAPES))]
    comps = keys = None
    if kind == "kahan":
        comps = [torch.zeros(s, dtype=torch.bfloat16) for s in SHAPES]
    else:
        keys = [torch.tensor(rounding.param_key(1234, i)) for i in range(len(SHAPES))]
    m = [torch.randn(s, generator=g) * 0.1 for s in SHAPES]
    v = [torch.rand(s, generator=g) * 0.01 for s in SHAPES]
    if which == "adam":
        return (ps, gs, m, v, steps, None, comps, keys), {}, dict(
            lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    if which == "lamb":
        return (ps, gs, m, v, steps, None, comps, keys), {}, dict(
            lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)
    if which == "novograd":
        vs = [torch.rand((), generator=g) * 10 for _ in SHAPES]
        return (ps, gs, m, vs, steps, None, comps, keys), {}, dict(
            lr=1e-2, beta1=0.95, beta2=0.98, eps=1e-8, weight_decay=0.01)
    if which == "sgd":
        return (ps, gs, m, None), dict(steps=steps, comps=comps, keys=keys), dict(
            lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)
    return (ps, gs, v, None), dict(steps=steps, comps=comps, keys=keys), dict(
        lr=0.1, eps=1e-10, weight_decay=0.01)


LAUNCHERS = {"adam": (adam.adam_step, adam.adam_step_ref),
             "sgd": (sgd.sgd_step, sgd.sgd_step_ref),
             "adagrad": (adagrad.adagrad_step, adagrad.adagrad_step_ref),
             "lamb": (lamb.lamb_step, lamb.lamb_step_ref),
             "novograd": (novograd.novograd_step, novograd.novograd_step_ref)}


def _run(fn, args, lists_kw, kw, skip_last):
    args = clone_lists(args)
    lists_kw = dict(zip(lists_kw, clone_lists(lists_kw.values())))
    scale = torch.tensor(1024.0)
    for i in range(3):
        found = torch.tensor(1.0 if (skip_last and i == 2) else 0.0)
        if i == 2:
            before = [t.clone() for t in _written(args, lists_kw)]
        fn(*args, **lists_kw, **kw, grad_scale=scale, found_inf=found)
    return _written(args, lists_kw), before


def _written(args, lists_kw):
    comps = args[6] if len(args) > 6 else lists_kw.get("comps")
    return list(args[0]) + list(comps or [])


def _assert_within_an_ulp(ours, want, n):
    """One bf16 ulp for parameters; p + c (compensated) within 2**-15 relative, the pair
    carrying about 16 bits. Where an update cancels a value, fp32 operations ordered
    otherwise differ by ulps of the operands: 2**-20 of the tensor's largest value."""
    for a, b in zip(ours[:n], want[:n]):
        a, b = a.float(), b.float()
        assert ((a - b).abs() <= b.abs() * 2 ** -7 + b.abs().max() * 2 ** -20).all()
    if len(ours) > n:  # compensated values: p + c
        for pa, ca, pb, cb in zip(ours[:n], ours[n:], want[:n], want[n:]):
            x = pb.float() + cb.float()
            torch.testing.assert_close(pa.float() + ca.float(), x, rtol=2 ** -15,
                                       atol=x.abs().max().item() * 2 ** -20)


@pytest.mark.parametrize("which", sorted(LAUNCHERS))
@pytest.mark.parametrize("kind", ("stochastic", "kahan"))
@pytest.mark.parametrize("skip_last", (False, True), ids=("taken", "skipped"))
def test_launchers_store_what_their_oracles_store(which, kind, skip_last):
    """Three steps (the last one skipped or not): the kernels' bf16 parameters and
    compensations are bitwise the oracle's; the CPU path's are the oracle's within one
    bf16 ulp (torch's fused CPU kernels order fp32 operations differently); a skipped
    step changes no bit on any path."""
    fn, ref = LAUNCHERS[which]
    args, lists_kw, kw = _lists(kind, which)
    ours, before = _run(fn, args, lists_kw, kw, skip_last)
    want, want_before = _run(ref, args, lists_kw, kw, skip_last)
    n = len(SHAPES)
    if which in ("lamb", "novograd"):
        # their oracles take norms with torch's reductions, whose fp32 sums may differ
        # from the kernels' in the last bits: held to one bf16 ulp, p + c to 2**-15 (the pair carries about 16 bits)
        _assert_within_an_ulp(ours, want, n)
    else:
        for a, b in zip(ours, want):
            assert_bits_equal(a, b)
    with force_cpu_path():
        cpu, cpu_before = _run(fn, args, lists_kw, kw, skip_last)
    _assert_within_an_ulp(cpu, want, n)
    if skip_last:
        for now, then in ((ours, before), (want, want_before), (cpu, cpu_before)):
            for a, b in zip(now, then):
                assert_bits_equal(a, b)


def test_cpu_path_draws_the_oracles_bits():
    """Where the fp32 update is exact on both sides (SGD, lr 1, bf16 weights in [0.5, 1.5)
    and bf16 gradients below 2**-9: p - g needs no rounding), the CPU path's rounded
    weights are bitwise the oracle's: its int32 hash is the oracle's int64 one, element
    by element, also for a channels-last tensor and over several steps."""
    g = torch.Generator().manual_seed(3)
    shapes = ((4, 8, 3, 3), (1000,), (3, 257))
    params = [(torch.rand(s, generator=g) + 0.5).to(torch.bfloat16) for s in shapes]
    params[0] = params[0].contiguous(memory_format=torch.channels_last)
    keys = [torch.tensor(rounding.param_key(99, i)) for i in range(len(shapes))]
    steps = [torch.tensor(float(i)) for i in range(len(shapes))]
    runs = []
    for cpu in (False, True):
        ps, st = [p.clone(memory_format=torch.preserve_format) for p in params], \
            [s.clone() for s in steps]
        for k in range(3):
            grads = [(torch.rand(p.shape, generator=torch.Generator().manual_seed(k)) * 2 ** -9)
                     .to(torch.bfloat16).contiguous(memory_format=torch.preserve_format)
                     for p in ps]
            grads[0] = grads[0].contiguous(memory_format=torch.channels_last)
            if cpu:
                with force_cpu_path():
                    sgd.sgd_step(ps, grads, lr=1.0, steps=st, keys=keys)
            else:
                sgd.sgd_step_ref(ps, grads, lr=1.0, steps=st, keys=keys)
        runs.append(ps)
    for a, b in zip(*runs):
        assert_bits_equal(a, b)
    assert not torch.equal(runs[1][1], params[1])  # the updates were not all lost


def test_kahan_summation_tracks_torch_adamw_in_fp32(path):
    """FusedAdam (AdamW) on bf16 weights with Kahan summation against torch.optim.AdamW on
    fp32 copies, 20 steps of the same (bf16) gradients: weight + compensation stays
    within 2**-11 of torch's fp32 weights (relative, floor 1e-3), where round-to-nearest
    bf16 drifts by percents."""
    torch.manual_seed(0)
    w = torch.randn(64, 33).to(torch.bfloat16)
    p, q, r = (nn.Parameter(w.clone()), nn.Parameter(w.float()), nn.Parameter(w.clone()))
    ours = O.FusedAdam([p], lr=1e-3, weight_decay=0.01, kahan_summation=True)
    nearest = O.FusedAdam([r], lr=1e-3, weight_decay=0.01)
    theirs = torch.optim.AdamW([q], lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        g = torch.randn(64, 33, generator=gen).to(torch.bfloat16)
        p.grad, r.grad, q.grad = g.clone(), g.clone(), g.float()
        for opt in (ours, nearest, theirs):
            opt.step()

    def rel(x):
        return ((x - q.detach()).abs() / q.detach().abs().clamp_min(1e-3)).max().item()

    assert rel(p.detach().float() + ours.state[p]["kahan_comp"].float()) < 2 ** -11
    assert rel(r.detach().float()) > 2 ** -6


def test_adam_moments_in_bf16_match_the_oracle():
    """state_dtype=torch.bfloat16: the moments are read widened, updated in fp32 and
    stored rounded to nearest, bitwise as the oracle does; the CPU path within a bf16
    ulp."""
    args, _, kw = _lists("stochastic", "adam")
    args = list(args)
    args[2] = [m.to(torch.bfloat16) for m in args[2]]
    args[3] = [v.to(torch.bfloat16) for v in args[3]]
    runs = {}
    for name, fn in (("kernel", adam.adam_step), ("ref", adam.adam_step_ref)):
        a = clone_lists(args)
        fn(*a, **kw)
        runs[name] = a
    for i in (0, 2, 3):
        for x, y in zip(runs["kernel"][i], runs["ref"][i]):
            assert x.dtype == torch.bfloat16
            assert_bits_equal(x, y)
    a = clone_lists(args)
    with force_cpu_path():
        adam.adam_step(*a, **kw)
    for i in (2, 3):
        for x, y in zip(a[i], runs["ref"][i]):
            x, y = x.float(), y.float()
            assert ((x - y).abs() <= y.abs() * 2 ** -7 + 1e-30).all()


# --- the optimizers -----------------------------------------------------------------------------
class _Net(nn.Module):
    """bf16 Linear layers around an fp32 BatchNorm (what amp's O2 keeps fp32)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32).to(torch.bfloat16)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 4).to(torch.bfloat16)

    def forward(self, x):
        h = self.bn(self.fc1(x.to(torch.bfloat16)).float())
        return self.fc2(torch.relu(h).to(torch.bfloat16)).float()


def _make(name, params, **kw):
    cls = getattr(O, name)
    if name == "FusedSGD":
        return cls(params, lr=0.1, momentum=0.9, **kw)
    return cls(params, lr=1e-2, **kw)


def _train(name, steps, kw, resume_at=None, overflow_at=None):
    torch.manual_seed(0)
    net = _Net()
    opt = _make(name, net.parameters(), **kw)
    g = torch.Generator().manual_seed(1)
    for s in range(steps):
        if s == resume_at:
            saved = copy.deepcopy(opt.state_dict())
            weights = copy.deepcopy(net.state_dict())
            torch.manual_seed(99)  # the resumed optimizer draws another seed: the loaded wins
            net = _Net()
            net.load_state_dict(weights)
            opt = _make(name, net.parameters(), **{k: v for k, v in kw.items() if k != "seed"})
            opt.load_state_dict(saved)
        x = torch.randn(8, 16, generator=g)
        loss = net(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net, opt


def test_sgd_without_momentum_resumes_its_stochastic_rounding_bitwise(path):
    """Without momentum FusedSGD's state is the step count alone (the rounding bits are
    drawn from it): its own checkpoint loads (it was refused as lacking a momentum
    buffer) and the resumed run is the uninterrupted one, bit for bit."""
    def run(resume_at=None):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(6, 5).to(torch.bfloat16))
        opt = O.FusedSGD([p], lr=0.1, stochastic_rounding=True, seed=3)
        g = torch.Generator().manual_seed(1)
        for s in range(4):
            if s == resume_at:
                saved = copy.deepcopy(opt.state_dict())
                assert set(saved["state"][0]) == {"step"}
                p = nn.Parameter(p.detach().clone())
                opt = O.FusedSGD([p], lr=0.1, stochastic_rounding=True, seed=3)
                opt.load_state_dict(saved)
            p.grad = torch.randn(6, 5, generator=g).to(torch.bfloat16)
            opt.step()
        return p
    assert_bits_equal(run().detach(), run(resume_at=2).detach(), "resumed")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("kw", MODES, ids=MODE_IDS)
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(path, name, kw):
    a, opt_a = _train(name, 5, kw)
    b, opt_b = _train(name, 5, kw, resume_at=3)
    for (n, x), y in zip(a.named_parameters(), b.parameters()):
        assert x.dtype == y.dtype
        assert_bits_equal(x.detach(), y.detach(), n)
    # the rounding did something: a round-to-nearest run ends elsewhere
    c, _ = _train(name, 5, {})
    assert any(not torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))
    # state: the seed in the groups, compensations in bf16 for bf16 parameters only
    sd = opt_b.state_dict()
    if "seed" in kw:
        assert all(group["seed"] == kw["seed"] for group in sd["param_groups"])
    for p in b.parameters():
        st = opt_b.state[p]
        if "kahan_summation" in kw and p.dtype == torch.bfloat16:
            assert st["kahan_comp"].dtype == torch.bfloat16
        else:
            assert "kahan_comp" not in st


@pytest.mark.parametrize("kw", MODES, ids=MODE_IDS)
def test_fp32_parameters_update_as_without_the_flag(path, kw):
    """One step (the same gradients on both sides): the fp32 BatchNorm parameters of an
    optimizer with the flag update bitwise as without it."""
    a, _ = _train("FusedAdam", 1, kw)
    b, _ = _train("FusedAdam", 1, {})
    for x, y in ((a.bn.weight, b.bn.weight), (a.bn.bias, b.bn.bias)):
        assert x.dtype == torch.float32
        assert torch.equal(x, y)


def test_default_seed_comes_from_torch_generator():
    p = [nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]
    torch.manual_seed(5)
    a = O.FusedAdam(p, stochastic_rounding=True).param_groups[0]["seed"]
    torch.manual_seed(5)
    b = O.FusedAdam(p, stochastic_rounding=True).param_groups[0]["seed"]
    assert a == b and isinstance(a, int)
    # no flag: no seed, and torch's generator is not touched
    torch.manual_seed(5)
    O.FusedAdam(p)
    assert "seed" not in O.FusedAdam(p).param_groups[0]
    after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(1), after)


# --- refusals -----------------------------------------------------------------------------------
def _bf16_params():
    return [nn.Parameter(torch.randn(4, 4).to(torch.bfloat16))]


@pytest.mark.parametrize("name", ALL)
def test_both_flags_are_refused(name):
    with pytest.raises(ValueError, match="mutually exclusive"):
        _make(name, _bf16_params(), stochastic_rounding=True, kahan_summation=True)


@pytest.mark.parametrize("name", ("FusedAdam", "FusedAdagrad", "FusedLAMB", "FusedNovoGrad"))
@pytest.mark.parametrize("flag", ("stochastic_rounding", "kahan_summation"))
def test_a_flag_with_master_weights_is_refused(name, flag):
    with pytest.raises(ValueError, match=f"{flag}=True is for bf16 parameters without fp32 "
                                         "master weights"):
        _make(name, _bf16_params(), master_weights=True, **{flag: True})


def test_mixed_precision_lamb_with_bf16_masters_is_refused():
    with pytest.raises(ValueError, match="reduced_precision_dtype=torch.bfloat16"):
        O.FusedMixedPrecisionLamb(_bf16_params(), reduced_precision_dtype=torch.bfloat16,
                                  kahan_summation=True)
    # the default keeps masters for fp16 parameters only
    opt = O.FusedMixedPrecisionLamb(_bf16_params(), kahan_summation=True)
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.ones_like(p)
    opt.step()
    assert "master_param" not in opt.state[p] and "kahan_comp" in opt.state[p]


def test_bad_seed_and_state_dtype_are_refused():
    with pytest.raises(TypeError, match="seed must be an int"):
        O.FusedAdam(_bf16_params(), stochastic_rounding=True, seed=1.5)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
        O.FusedAdam(_bf16_params(), stochastic_rounding=True, seed=-1)
    with pytest.raises(ValueError, match="seed=3 is the seed of stochastic rounding"):
        O.FusedAdam(_bf16_params(), seed=3)
    with pytest.raises(ValueError, match="state_dtype must be torch.float32 or torch.bfloat16"):
        O.FusedAdam(_bf16_params(), state_dtype=torch.float16)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("kw", MODES, ids=MODE_IDS)
def test_no_bf16_parameter_at_the_first_step_is_refused_and_changes_nothing(path, name, kw):
    p = nn.Parameter(torch.randn(8, 8))
    p.grad = torch.randn(8, 8)
    opt = _make(name, [p], **kw)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="acts on bf16 parameters, but this optimizer has none"):
        opt.step()
    assert torch.equal(p, before)
    assert len(opt.state) == 0


def test_amp_with_master_weights_is_refused_before_anything_changes():
    net = nn.Linear(4, 4)
    w = net.weight.detach().clone()
    opt = O.FusedAdam(net.parameters(), kahan_summation=True)
    with pytest.raises(ValueError, match="pass master_weights=False"):
        amp.initialize(net, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    assert net.weight.dtype == torch.float32 and torch.equal(net.weight, w)


@pytest.mark.parametrize("kw", MODES, ids=MODE_IDS)
def test_amp_o2_bf16_without_masters(path, kw):
    """O2 with half_dtype=bf16 and master_weights=False trains the bf16 weights with the
    optimizer's rounding: no fp32 master anywhere, and it differs from round to nearest."""
    finals = []
    for flags in (kw, {}):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
        opt = O.FusedAdam(net.parameters(), lr=1e-3, **flags)
        net, opt = amp.initialize(net, opt, opt_level="O2", half_dtype=torch.bfloat16,
                                  master_weights=False, verbosity=0)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            loss = net(torch.randn(8, 16, generator=g)).float().pow(2).mean()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
        assert net[0].weight.dtype == torch.bfloat16
        assert all("master_param" not in st for st in opt.state.values())
        finals.append(net[0].weight.detach().clone())
        if "kahan_summation" in flags:
            assert opt.state[net[0].weight]["kahan_comp"].dtype == torch.bfloat16
    assert not torch.equal(finals[0], finals[1])


def test_loaded_state_keeps_its_dtypes():
    """A state dict round trip keeps bf16 compensations and bf16 moments bf16 (and a
    checkpoint with fp32 moments loads into bf16 ones)."""
    net = _Net()
    opt = O.FusedAdam(net.parameters(), kahan_summation=True, state_dtype=torch.bfloat16)
    net(torch.randn(4, 16)).sum().backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    fresh = O.FusedAdam(net.parameters(), kahan_summation=True, state_dtype=torch.bfloat16)
    fresh.load_state_dict(sd)
    st = fresh.state[net.fc1.weight]
    assert st["kahan_comp"].dtype == torch.bfloat16
    assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.bfloat16
    assert torch.equal(st["kahan_comp"], opt.state[net.fc1.weight]["kahan_comp"])
    fp32 = O.FusedAdam(net.parameters())
    fp32.load_state_dict(sd)
    assert fp32.state[net.fc1.weight]["exp_avg"].dtype == torch.float32
    bf16 = O.FusedAdam(net.parameters(), state_dtype=torch.bfloat16)
    bf16.load_state_dict(fp32.state_dict())
    assert bf16.state[net.fc1.weight]["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize("kw", MODES + ({},), ids=MODE_IDS + ("nearest",))
def test_adam_with_bf16_moments_resumes_bitwise(path, kw):
    kw = dict(kw, state_dtype=torch.bfloat16)
    a, opt = _train("FusedAdam", 5, kw)
    b, _ = _train("FusedAdam", 5, kw, resume_at=2)
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.equal(x, y)
    assert opt.state[a.fc1.weight]["exp_avg"].dtype == torch.bfloat16


_STEADY = """
import sys, torch
import tritamp.optimizers as O
from tritamp.kernels.recorder import record_launches
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu",
              "numpy")
flag = sys.argv[1]
torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(32, 16).to(torch.bfloat16))
b = torch.nn.Parameter(torch.randn(32))   # an fp32 parameter beside it: its own group
opt = O.FusedAdam([w, b], lr=1e-3, **{flag: True})
with record_launches() as rec:
    for _ in range(2):
        w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
        opt.step()
    calls = []
    for name in HOST_READS:
        method = getattr(torch.Tensor, name)
        def counted(*args, _m=method, **kwargs):
            calls.append(_m.__name__)
            return _m(*args, **kwargs)
        setattr(torch.Tensor, name, counted)
    rec.launches.clear()
    for _ in range(2):
        opt.step()
print(calls, [launch.name for launch in rec.launches])
"""


@pytest.mark.parametrize("flag", ("stochastic_rounding", "kahan_summation"))
def test_steady_steps_on_the_gpu_code_path_read_nothing(flag):
    """Down the GPU code path (launches recorded, not run; compiled-mode kernels, so in a
    child process without the interpreter): once the plans, keys and compensations are
    built, a step reads no tensor value on the host and launches one kernel per dtype
    group (bf16 weights, fp32 parameters)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", _STEADY, flag], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[] " + str(["_adam_step_kernel"] * 4)


@pytest.mark.parametrize("kw", MODES, ids=MODE_IDS)
def test_steady_steps_on_the_cpu_path_read_nothing(cpu_path, kw):
    """The production CPU path, once its plans and working buffers are built: no tensor
    value read on the host (a CPU tensor read is no sync, but the rule is the same)."""
    torch.manual_seed(0)
    net = _Net()
    opt = O.FusedAdam(net.parameters(), lr=1e-3, **kw)
    x = torch.randn(8, 16)

    def step():
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()

    step()
    with CountOps() as ops:
        step()
        step()
    assert ops.host_reads == 0


def test_bad_rounding_lists_are_refused_before_anything_is_written(path):
    """At the launchers: a row with both a compensation and a key, a key or compensation
    for a parameter that is not bf16, a key without a step count, a compensation of
    another dtype: each refused with its fix, every tensor left as it was."""
    args, _, kw = _lists("kahan", "adam")
    params, grads, m, v, steps = args[:5]
    keys = [torch.tensor(rounding.param_key(1, i)) for i in range(len(SHAPES))]
    comps = args[6]
    before = [t.clone() for t in params + m + v + steps + comps]

    def unchanged():
        for a, b in zip(before, params + m + v + steps + comps):
            assert_bits_equal(a, b)

    with pytest.raises(ValueError, match=r"comps\[0\] and keys\[0\] are both given"):
        adam.adam_step(params, grads, m, v, steps, None, comps, keys, **kw)
    unchanged()
    fp32 = [p.float() for p in params]
    with pytest.raises(TypeError, match=r"keys\[0\] is given for params\[0\], which is "
                                        r"torch.float32.*pass None for it"):
        adam.adam_step(fp32, grads, m, v, steps, None, None, keys, **kw)
    with pytest.raises(TypeError, match=r"comps\[1\] is float32, expected bfloat16; "
                                        r"convert it with .to\(torch.bfloat16\)"):
        adam.adam_step(params, grads, m, v, steps, None,
                       [comps[0], comps[1].float(), comps[2]], None, **kw)
    unchanged()
    sgd_params = [p.clone() for p in params]
    with pytest.raises(ValueError, match=r"keys\[0\] needs steps\[0\]"):
        sgd.sgd_step(sgd_params, grads, lr=0.1, keys=keys)
    for a, b in zip(params, sgd_params):
        assert_bits_equal(a, b)


# --- checkpoints across the modes: masters <-> Kahan compensation --------------------------------
def _trained_bf16(**kw):
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(torch.bfloat16)
    opt = O.FusedAdam(model.parameters(), lr=1e-2, **kw)
    for s in range(3):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(s)).bfloat16()
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()
    return model, opt


def _zero_lr_step(model, opt):
    """A step with lr=0 (weight decay 0): the weights keep their values; the state the
    optimizer builds from a loaded checkpoint is made. (The loaded groups carry the
    saved lr: set to 0 here.)"""
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.zero_grad()
    model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()


def _loaded_into(model, opt, **kw):
    """A copy of ``model`` with a FusedAdam(**kw) that loaded ``opt``'s state dict and took
    one step with lr=0."""
    model2 = copy.deepcopy(model)
    opt2 = O.FusedAdam(model2.parameters(), **kw)
    opt2.load_state_dict(opt.state_dict())
    _zero_lr_step(model2, opt2)
    return model2, opt2


def test_a_masters_checkpoint_loads_into_kahan_as_its_compensation(path):
    model, opt = _trained_bf16(master_weights=True)
    masters = [opt.state[p]["master_param"].clone() for p in model.parameters()]
    model2, opt2 = _loaded_into(model, opt, kahan_summation=True)
    for p, master in zip(model2.parameters(), masters):
        st = opt2.state[p]
        # the stale master is gone (it was kept, saved again, and a later load into a
        # masters optimizer wrote the weights back to it)
        assert "master_param" not in st
        comp = st["kahan_comp"].float()
        assert comp.any()
        # weight + compensation stands for the master, to the compensation's rounding
        err = (p.detach().float() + comp - master).abs()
        assert (err <= (master - p.detach().float()).abs() * 2 ** -8).all()
    assert all("master_param" not in st for st in opt2.state_dict()["state"].values())


def test_a_kahan_checkpoint_loads_into_masters_as_weight_plus_compensation(path):
    model, opt = _trained_bf16(kahan_summation=True)
    stood_for = [p.detach().float() + opt.state[p]["kahan_comp"].float()
                 for p in model.parameters()]
    model2, opt2 = _loaded_into(model, opt, master_weights=True)
    for p, value in zip(model2.parameters(), stood_for):
        st = opt2.state[p]
        assert "kahan_comp" not in st
        assert_bits_equal(st["master_param"], value, "master from weight + compensation")


def test_unused_rounding_state_is_dropped():
    # a Kahan checkpoint into a stochastic-rounding optimizer: the compensation is not
    # used there, so it is not kept (and not saved again for a later Kahan load)
    model, opt = _trained_bf16(kahan_summation=True)
    _, opt2 = _loaded_into(model, opt, stochastic_rounding=True, seed=1)
    assert all(set(st) == {"exp_avg", "exp_avg_sq", "step"} for st in opt2.state.values())


def test_seed_and_flags_are_checked_wherever_they_come_in():
    opt = O.FusedAdam(_bf16_params(), stochastic_rounding=True, seed=3)
    for bad, error in ((-1, ValueError), (1.7, TypeError), (2 ** 64, ValueError),
                       (True, TypeError), ("7", TypeError)):
        with pytest.raises(error, match="seed must be"):
            opt.add_param_group({"params": _bf16_params(), "seed": bad})
        sd = opt.state_dict()
        sd["param_groups"][0]["seed"] = bad
        with pytest.raises(error, match="seed must be"):
            opt.load_state_dict(sd)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["seed"] == 3
    for flag in ("stochastic_rounding", "kahan_summation"):
        for bad in ("no", 0.5, 2):
            with pytest.raises(TypeError, match=f"{flag} must be True or False"):
                O.FusedAdam(_bf16_params(), **{flag: bad})


def test_a_seed_changed_on_a_group_is_the_one_rounded_with(path):
    # The kept plan held the rounding keys made from the old seed while state_dict()
    # saved the new one: a resumed run diverged.
    def grad(k):
        return torch.randn(512, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)

    def make(seed):
        p = nn.Parameter(torch.randn(512, generator=torch.Generator().manual_seed(0))
                         .to(torch.bfloat16))
        return p, O.FusedAdam([p], lr=1e-3, stochastic_rounding=True, seed=seed)

    p, opt = make(7)
    p.grad = grad(0)
    opt.step()
    saved, weight = copy.deepcopy(opt.state_dict()), p.detach().clone()
    opt.param_groups[0]["seed"] = 12345
    p.grad = grad(1)
    opt.step()
    q, fresh = make(12345)
    with torch.no_grad():
        q.copy_(weight)
    saved["param_groups"][0]["seed"] = 12345
    fresh.load_state_dict(saved)
    q.grad = grad(1)
    fresh.step()
    assert_bits_equal(q.detach(), p.detach(), "a step after the group's seed changed")


def test_no_bf16_parameter_after_a_recast_is_refused(path):
    # the "no bf16 parameter" refusal was kept from the first step: model.float() after it
    # stepped on
    model = nn.Linear(8, 8).to(torch.bfloat16)
    opt = O.FusedAdam(model.parameters(), lr=1e-3, stochastic_rounding=True, seed=1)
    model(torch.randn(2, 8).bfloat16()).float().sum().backward()
    opt.step()
    model.float()
    opt.zero_grad()
    model(torch.randn(2, 8)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"acts on bf16 parameters, but this optimizer has none"):
        opt.step()
    for b, p in zip(before, model.parameters()):
        assert_bits_equal(b, p.detach(), "a parameter after the refused step")
