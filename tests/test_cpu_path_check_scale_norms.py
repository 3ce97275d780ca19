"""The production CPU path of check_unscale, scale_update, the fused norms and SyncBatchNorm
against their ``*_ref`` oracles.

Tolerances, and why:
- check_unscale: bit for bit (NaN payloads aside). Both sides multiply the fp32 value
  by the same fp32 ``1/scale`` (taken in fp64), add in fp32 and round once to the
  destination; found_inf judges the sources (and, in a sweep that adds, the addends).
- scale_update: bit for bit, the whole state vector after every step (same fp64 products
  rounded once to fp32, same counters).
- layer_norm: RMSNorm forward and backward, LayerNorm forward into another dtype and the
  LayerNorm backward from the input are bit for bit (the same torch kernels and the same
  arithmetic). A LayerNorm forward that keeps a half input's dtype runs torch's
  mixed-dtype kernel (fp32 arithmetic, its own reduction order): at most one unit in the
  last place of the half output, statistics within 4 fp32 ulps. The memory-efficient
  LayerNorm backward runs torch's fp32 kernel on ``xhat`` (another order of the same
  fp32 sums): 1e-5 of the largest gradient magnitude in fp32, one half ulp in half.
- syncbn: forward, ReLU mask and both backward launchers bit for bit (the reference's
  arithmetic step for step); the statistics are the same sums taken in two passes
  instead of a Welford loop: 1e-6 relative to the row's scale.
"""
import importlib
import itertools
import math

import pytest
import torch

from conftest import snapshot as clones
from torch.utils._python_dispatch import TorchDispatchMode

from tritamp.kernels import (FLOOR_STREAK, FOUND_INF, FOUND_INF_NEXT, HYSTERESIS, SCALE, SKIPPED,
                             STATE_SIZE, UNSKIPPED, USED_SCALE, check_unscale, check_unscale_ref,
                             other_found_slot, scale_update, scale_update_ref)

cu_mod = importlib.import_module("tritamp.kernels.check_unscale")
su_mod = importlib.import_module("tritamp.kernels.scale_update")
ln_mod = importlib.import_module("tritamp.kernels.layer_norm")
bn_mod = importlib.import_module("tritamp.kernels.syncbn")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
SHAPES = ((1,), (1000,), (0,), (3, 257), (17,))
SCALES = (2.0 ** 16, 3.0, 0.1, 1e-3)


def assert_bitwise(actual, expected, what="tensor"):
    """Equal bit for bit, except that any NaN equals any NaN."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a, e = actual.reshape(-1), expected.reshape(-1)
    a_nan, e_nan = torch.isnan(a), torch.isnan(e)
    bits = _BITS[a.dtype]
    bad = (a_nan != e_nan) | (~a_nan & (a.view(bits) != e.view(bits)))
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{what}: element {i}: {a[i].item()!r} != {e[i].item()!r} "
                             f"({int(bad.sum())} elements differ)")


def assert_same_list(actual, expected, what):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_bitwise(a, e, f"{what}[{i}]")


def found(v=0.0):
    return torch.full((), v, dtype=torch.float32)


def scale_t(v):
    return torch.tensor(v, dtype=torch.float32)


# ------------------------------------------------------------------------- check_unscale

def make_srcs(dtype, special=None, where=None, seed=0, magnitude=100.0):
    """Tensors of SHAPES (one empty) in ``dtype``; ``special`` planted in the first, the
    middle or the last tensor."""
    gen = torch.Generator().manual_seed(seed)
    ts = [(torch.randn(s, generator=gen) * magnitude).to(dtype) for s in SHAPES]
    if special is not None:
        i = {"first": 0, "middle": 3, "last": len(ts) - 1}[where]
        flat = ts[i].view(-1)
        flat[(7 * flat.numel()) // 11] = special
    return ts


SPECIALS = [(None, None)] + [(v, w) for v in (math.inf, -math.inf, math.nan)
                             for w in ("first", "middle", "last")]
SPECIAL_IDS = ["finite"] + [f"{v}-{w}" for v in ("inf", "-inf", "nan")
                            for w in ("first", "middle", "last")]


def run_both(srcs, scale, f0=0.0, dsts=None, adds=None, write=True, check=True):
    """The CPU path on one copy of everything and the oracle on another: returns
    ((srcs, dsts, adds, found) CPU, same oracle)."""
    out = []
    for fn in (check_unscale, check_unscale_ref):
        s = clones(srcs)
        d = None if dsts is None else clones(dsts)
        a = None if adds is None else clones(adds)
        f = found(f0) if check else None
        fn(s, None if scale is None else scale_t(scale), f, dsts=d, adds=a, write=write)
        out.append((s, d, a, f))
    return out


def assert_runs_equal(cpu, ref, what):
    for name, a, e in zip(("srcs", "dsts", "adds"), cpu[:3], ref[:3]):
        if e is not None:
            assert_same_list(a, e, f"{what} {name}")
    if ref[3] is not None:
        assert cpu[3].item() == ref[3].item(), f"{what}: found_inf {cpu[3]} != {ref[3]}"


@pytest.mark.parametrize("special,where", SPECIALS, ids=SPECIAL_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_check_only(cpu_path, dtype, special, where):
    srcs = make_srcs(dtype, special, where)
    before = clones(srcs)
    cpu, ref = run_both(srcs, None, write=False)
    assert_runs_equal(cpu, ref, "check only")
    assert cpu[3].item() == (0.0 if special is None else 1.0)
    # the sources keep their values (a NaN stays a NaN)
    assert_same_list(cpu[0], before, "sources after a check")
    # a flag already set stays set
    cpu, ref = run_both(srcs, None, f0=1.0, write=False)
    assert cpu[3].item() == ref[3].item() == 1.0


@pytest.mark.parametrize("special,where", SPECIALS, ids=SPECIAL_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_unscale_in_place(cpu_path, dtype, scale, special, where):
    srcs = make_srcs(dtype, special, where)
    cpu, ref = run_both(srcs, scale)
    assert_runs_equal(cpu, ref, "in place")
    assert cpu[3].item() == (0.0 if special is None else 1.0)
    # without found_inf: the same values, nothing checked
    cpu, ref = run_both(srcs, scale, check=False)
    assert_runs_equal(cpu, ref, "in place, no found_inf")


@pytest.mark.parametrize("special,where", SPECIALS, ids=SPECIAL_IDS)
@pytest.mark.parametrize("src_dtype,dst_dtype", [
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
    (torch.bfloat16, torch.float16), (torch.float32, torch.float32)])
def test_unscale_into_destinations(cpu_path, src_dtype, dst_dtype, special, where):
    srcs = make_srcs(src_dtype, special, where, magnitude=3e4)
    dsts = [torch.full(s.shape, 7.0, dtype=dst_dtype) for s in srcs]
    for scale in (2.0 ** 10, 0.1):
        cpu, ref = run_both(srcs, scale, dsts=dsts)
        assert_runs_equal(cpu, ref, f"{src_dtype} -> {dst_dtype}")
        assert_same_list(cpu[0], srcs, "sources")


def test_finite_sources_that_overflow_the_destination_are_not_an_overflow(cpu_path):
    """found_inf judges the sources: fp32 values beyond fp16's range become inf in an
    fp16 destination (and when unscaled by 1e-3 in place) without setting the flag."""
    srcs = [torch.tensor([1e5, -7e4, 1.0]), torch.tensor([60000.0, 2.0])]
    dsts = [torch.empty(3, dtype=torch.float16), torch.empty(2, dtype=torch.float16)]
    for scale in (1.0, 1e-3, None):
        cpu, ref = run_both(srcs, scale, dsts=dsts)
        assert_runs_equal(cpu, ref, f"fp32 -> fp16, scale {scale}")
        assert cpu[3].item() == 0.0
        assert torch.isinf(cpu[1][0][0])
    half = [torch.tensor([60000.0, 1.0], dtype=torch.float16)]
    cpu, ref = run_both(half, 1e-3)
    assert_runs_equal(cpu, ref, "fp16 in place / 1e-3")
    assert cpu[3].item() == 0.0 and torch.isinf(cpu[0][0][0])


@pytest.mark.parametrize("special,where", SPECIALS, ids=SPECIAL_IDS)
@pytest.mark.parametrize("src_dtype,dst_dtype,add_dtype", [
    (torch.float16, torch.float32, torch.float32), (torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.float32, torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16, torch.float32)])
def test_unscale_with_addends(cpu_path, src_dtype, dst_dtype, add_dtype, special, where):
    """A second backward: dst = src * inv + add; the addend's own specials count too
    (what the step reads is the sum)."""
    srcs = make_srcs(src_dtype, special, where, seed=1)
    dsts = [torch.full(s.shape, 3.0, dtype=dst_dtype) for s in srcs]
    for add_special in (math.inf, None):
        adds = make_srcs(add_dtype, add_special, "middle", seed=2)
        for scale in (2.0 ** 8, 3.0, None):
            cpu, ref = run_both(srcs, scale, dsts=dsts, adds=adds)
            assert_runs_equal(cpu, ref, f"adds {src_dtype} {dst_dtype} {add_dtype} {scale}")
            assert cpu[3].item() == (0.0 if special is None and add_special is None
                                     else 1.0)
            assert_same_list(cpu[2], adds, "addends")


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("special,where", SPECIALS[:4], ids=SPECIAL_IDS[:4])
def test_accumulate_into_the_destination(cpu_path, src_dtype, special, where):
    """amp's second loss: half (or fp32) gradients unscaled and added into the masters'
    fp32 gradients, the addend being the destination itself; and a gradient unscaled in
    place with its stash added."""
    srcs = make_srcs(src_dtype, special, where, seed=3)
    for scale in (2.0 ** 12, 0.3):
        masters = make_srcs(torch.float32, seed=4)
        cpu_m, ref_m = clones(masters), clones(masters)
        f_cpu, f_ref = found(), found()
        check_unscale(clones(srcs), scale_t(scale), f_cpu, dsts=cpu_m, adds=cpu_m)
        check_unscale_ref(clones(srcs), scale_t(scale), f_ref, dsts=ref_m, adds=ref_m)
        assert_same_list(cpu_m, ref_m, "masters += src / scale")
        assert f_cpu.item() == f_ref.item()
        stash = make_srcs(src_dtype, seed=5)
        g_cpu, g_ref = clones(srcs), clones(srcs)
        check_unscale(g_cpu, scale_t(scale), f_cpu, dsts=g_cpu, adds=clones(stash))
        check_unscale_ref(g_ref, scale_t(scale), f_ref, dsts=g_ref, adds=clones(stash))
        assert_same_list(g_cpu, g_ref, "g = g / scale + stash")


@pytest.mark.parametrize("src_dtype,dst_dtype", [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
    (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
def test_pure_copy(cpu_path, src_dtype, dst_dtype):
    """scale=None: the master -> model weight copy (a cast, one rounding), with and
    without a check."""
    srcs = make_srcs(src_dtype, seed=6, magnitude=1e3)
    srcs[1][3] = 1e-40 if src_dtype == torch.float32 else srcs[1][3]  # subnormal in fp32
    dsts = [torch.empty(s.shape, dtype=dst_dtype) for s in srcs]
    for check in (False, True):
        cpu, ref = run_both(srcs, None, dsts=dsts, check=check)
        assert_runs_equal(cpu, ref, f"copy {src_dtype} -> {dst_dtype}")
        assert_same_list(cpu[0], srcs, "sources")


def test_mixed_dtype_groups_in_one_call(cpu_path):
    gen = torch.Generator().manual_seed(7)
    srcs = [(torch.randn(s, generator=gen) * 50).to(d)
            for s, d in zip(((5,), (0,), (3, 4), (257,), (2, 2)),
                            (torch.float16, torch.float32, torch.bfloat16, torch.float32,
                             torch.float16))]
    srcs[2][1, 1] = math.nan
    dsts = [torch.empty(s.shape, dtype=d) for s, d in
            zip(srcs, (torch.float32, torch.float32, torch.float32, torch.bfloat16,
                       torch.float16))]
    cpu, ref = run_both(srcs, 1024.0, dsts=dsts)
    assert_runs_equal(cpu, ref, "mixed groups")
    assert cpu[3].item() == 1.0


def test_odd_layouts(cpu_path):
    """A transposed gradient into a contiguous master gradient, a contiguous gradient into
    a channels-last master gradient (with a contiguous addend), a column-major gradient
    unscaled in place, an expanded gradient checked, a strided view unscaled in place:
    every one equals the oracle, and untouched memory stays untouched."""
    gen = torch.Generator().manual_seed(8)
    g_t = (torch.randn(40, 7, generator=gen) * 300).half().t()          # transposed
    g_t[3, 5] = math.inf
    out = torch.zeros(7, 40)
    g_c = (torch.randn(2, 3, 5, 5, generator=gen) * 300).bfloat16()
    out_cl = torch.zeros(2, 3, 5, 5).to(memory_format=torch.channels_last)
    add_c = torch.randn(2, 3, 5, 5, generator=gen)
    cpu, ref = run_both([g_t, g_c], 64.0, dsts=[out, out_cl], adds=[torch.zeros(7, 40), add_c])
    assert_runs_equal(cpu, ref, "transposed / channels-last")
    assert cpu[1][1].is_contiguous(memory_format=torch.channels_last)
    assert cpu[3].item() == 1.0

    cm = (torch.randn(9, 50, generator=gen) * 100).t().contiguous().t()
    cpu, ref = run_both([cm], 8.0)
    assert_runs_equal(cpu, ref, "column-major in place")
    assert cpu[0][0].stride() == (1, 9)

    row = torch.randn(1, 30, generator=gen)
    row[0, 4] = -math.inf
    row_before = row.clone()
    expanded = row.expand(6, 30)
    f = found()
    check_unscale([expanded], None, f, write=False)
    assert f.item() == 1.0
    assert_bitwise(row, row_before, "expanded source after a check")

    buf = torch.randn(6, 40, generator=gen) * 64
    expected = buf.clone()
    check_unscale([buf[:, 1::3]], scale_t(4.0), found())
    check_unscale_ref([expected[:, 1::3]], scale_t(4.0), found())
    assert_bitwise(buf, expected, "strided view in place")

    with pytest.raises(ValueError, match="overlaps itself"):
        check_unscale([expanded], scale_t(2.0), found())


def test_empty_lists_and_empty_tensors(cpu_path):
    f = found()
    check_unscale([], scale_t(2.0), f)
    check_unscale([torch.empty(0), torch.empty(0, 3, dtype=torch.bfloat16)], scale_t(2.0), f)
    check_unscale([torch.empty(0)], None, f, write=False)
    assert f.item() == 0.0


def test_a_kept_sweep_reads_current_values(cpu_path):
    """A prepared sweep launched again sees the tensors' new values (and keeps its
    per-group plan)."""
    src = [torch.randn(100).half(), torch.randn(7).half()]
    dst = [torch.empty(100), torch.empty(7)]
    add = [torch.randn(100).half(), torch.randn(7).half()]
    prepared = cu_mod.check_unscale_prepare(src, dsts=dst, adds=add)
    assert not prepared.triton
    for step in range(3):
        src[0].normal_()
        add[1].normal_()
        f = found()
        cu_mod.check_unscale_launch(prepared, scale_t(2.0 ** step), f)
        expected = [torch.empty(100), torch.empty(7)]
        check_unscale_ref(src, scale_t(2.0 ** step), found(), dsts=expected, adds=add)
        assert_same_list(dst, expected, f"step {step}")
    assert len(prepared.cpu_plans) == 1


def test_the_cpu_path_does_not_call_the_reference(cpu_path, monkeypatch):
    monkeypatch.setattr(cu_mod, "check_unscale_ref",
                        lambda *a, **k: pytest.fail("the reference ran"))
    x = [torch.tensor([2.0, -6.0])]
    check_unscale(x, scale_t(2.0), found())
    assert_bitwise(x[0], torch.tensor([1.0, -3.0]))


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _ops_per_launch(n, **case):
    gen = torch.Generator().manual_seed(n)
    srcs = [torch.randn(50, generator=gen).to(case["src"]) for _ in range(n)]
    dsts = None if case.get("dst") is None else [torch.empty(50, dtype=case["dst"])
                                                 for _ in range(n)]
    adds = None if case.get("add") is None else [torch.randn(50).to(case["add"])
                                                 for _ in range(n)]
    prepared = cu_mod.check_unscale_prepare(srcs, dsts=dsts, adds=adds,
                                            write=case.get("write", True))
    scale, f = scale_t(4.0), found()
    cu_mod.check_unscale_launch(prepared, scale, f)  # the plan is made here
    with _CountOps() as mode:
        cu_mod.check_unscale_launch(prepared, scale, f)
    return mode.ops


@pytest.mark.parametrize("case", [
    dict(src=torch.float32, write=False), dict(src=torch.bfloat16),
    dict(src=torch.float16, dst=torch.float32), dict(src=torch.float32, dst=torch.bfloat16),
    dict(src=torch.bfloat16, dst=torch.float32, add=torch.bfloat16)],
    ids=["check", "in_place_bf16", "fp16_to_fp32", "fp32_to_bf16", "adds"])
def test_op_count_does_not_grow_with_the_tensor_count(cpu_path, case):
    """One sweep is a fixed number of torch ops (multi-tensor ops over the whole group),
    whatever the number of tensors; none reads a value back to the host."""
    few, many = _ops_per_launch(3, **case), _ops_per_launch(30, **case)
    assert few == many
    assert len(few) <= 8
    assert torch.ops.aten._local_scalar_dense.default not in few


# -------------------------------------------------------------------------- scale_update

def new_state(scale, hysteresis=1):
    s = torch.zeros(STATE_SIZE)
    s[SCALE] = scale
    s[HYSTERESIS] = hysteresis
    return s


def scripted(seq, start, **kw):
    """Run the overflow script ``seq`` (values written into the overflow slot: 0.0, 1.0,
    NaN, ...) through the CPU path and the oracle, alternating slots as the scaler does;
    the two states must agree bit for bit after every step. Returns the states."""
    hyst = kw.get("hysteresis", 1)
    cpu, ref = new_state(start, hyst), new_state(start, hyst)
    slot = FOUND_INF
    states = []
    for i, v in enumerate(seq):
        cpu[slot] = v
        ref[slot] = v
        scale_update(cpu, found_slot=slot, **kw)
        scale_update_ref(ref, found_slot=slot, **kw)
        assert torch.equal(cpu.view(torch.int32), ref.view(torch.int32)), \
            f"step {i}: {cpu.tolist()} != {ref.tolist()}"
        states.append(cpu.clone())
        slot = other_found_slot(slot)
    return states


def _pattern(n, every, seed):
    gen = torch.Generator().manual_seed(seed)
    r = torch.rand(n, generator=gen)
    return [1.0 if (i % every == every - 1 or r[i] < 0.05) else 0.0 for i in range(n)]


def test_scale_update_long_run_crosses_growth_intervals(cpu_path):
    seq = [0.0] * 25 + [1.0] + [0.0] * 40 + [math.nan] + [0.0] * 30
    states = scripted(seq, 1024.0, growth_interval=7, max_scale=2.0 ** 14)
    assert states[-1][SCALE].item() == 2.0 ** 14      # grew to the cap
    assert states[-1][SKIPPED].item() == 2.0


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_scale_update_hysteresis(cpu_path, hysteresis):
    seq = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0] + _pattern(150, 9, hysteresis)
    states = scripted(seq, 2.0 ** 16, growth_interval=4, hysteresis=hysteresis)
    assert states[0][HYSTERESIS].item() == hysteresis - 1


def test_scale_update_hits_the_floor_and_counts_the_streak(cpu_path):
    seq = [1.0] * 30 + [0.0] * 5 + [1.0] * 3
    states = scripted(seq, 2.0 ** 10, growth_interval=100, min_scale=1.0)
    assert states[29][SCALE].item() == 1.0
    # the 10th halving lands on the floor: it and the 20 overflows after it count
    assert states[29][FLOOR_STREAK].item() == 21.0
    assert states[-1][FLOOR_STREAK].item() == 3.0


@pytest.mark.parametrize("growth,backoff", [(2.0, 0.5), (1.5, 0.7), (1.1, 0.9), (3.0, 1 / 3)])
def test_scale_update_inexact_factors_and_clamps(cpu_path, growth, backoff):
    seq = _pattern(200, 5, 11)
    scripted(seq, 3.0e4, growth_factor=growth, backoff_factor=backoff, growth_interval=2,
             min_scale=0.75, max_scale=5.0e4, hysteresis=2)


def test_scale_update_growth_that_overflows_keeps_the_scale(cpu_path):
    states = scripted([0.0] * 6, 3.0e38, growth_interval=2)
    assert states[-1][SCALE].item() == pytest.approx(3.0e38)


def test_scale_update_static(cpu_path):
    states = scripted(_pattern(60, 4, 3), 128.0, dynamic=False)
    assert all(s[SCALE].item() == 128.0 for s in states)


def test_scale_update_zeroes_the_other_slot_and_reads_no_host_value(cpu_path):
    state = new_state(1024.0)
    state[FOUND_INF_NEXT] = 1.0
    with _CountOps() as mode:
        scale_update(state, found_slot=FOUND_INF)
    assert state[FOUND_INF_NEXT].item() == 0.0 and state[USED_SCALE].item() == 1024.0
    assert state[UNSKIPPED].item() == 1.0
    assert torch.ops.aten._local_scalar_dense.default not in mode.ops


def test_scale_update_does_not_call_the_reference(cpu_path, monkeypatch):
    monkeypatch.setattr(su_mod, "scale_update_ref", lambda *a, **k: pytest.fail("the reference"))
    state = new_state(8.0)
    state[FOUND_INF] = 1.0
    scale_update(state, 2.0, 0.5, 5, 1)
    assert (state[SCALE].item(), state[USED_SCALE].item(), state[SKIPPED].item()) == \
        (4.0, 8.0, 1.0)


# ---------------------------------------------------------------------------- layer_norm

def _ulp(t):
    """One unit in the last place of each element of ``t`` (fp32/fp16/bf16), as fp32."""
    fi = torch.finfo(t.dtype)
    a = t.float().abs().clamp(min=fi.tiny)
    return torch.exp2(torch.floor(torch.log2(a))) * fi.eps


NORM_CASES = list(itertools.product(
    (False, True),                                  # rms
    DTYPES,                                         # input dtype
    (None, torch.float32, torch.bfloat16),          # output dtype (None: the input's)
    ("same", torch.float32, None)))                 # parameters: input's dtype, fp32, none


def _norm_inputs(rms, xd, pd, seed=0, m=13, n=129):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, n, generator=gen) * 3 + 1.5).to(xd)
    pdt = xd if pd == "same" else pd
    w = None if pd is None else (torch.rand(n, generator=gen) + 0.5).to(pdt)
    b = None if pd is None or rms else torch.randn(n, generator=gen).to(pdt)
    return x, w, b


@pytest.mark.parametrize("rms,xd,od,pd", NORM_CASES)
def test_norm_forward(cpu_path, rms, xd, od, pd):
    x, w, b = _norm_inputs(rms, xd, pd)
    y, mean, rstd = ln_mod.layer_norm_fwd(x.view(13, 3, 43), 129, w, b, 1e-5, rms, od)
    yr, mr, rr = ln_mod.layer_norm_fwd_ref(x.view(13, 3, 43), 129, w, b, 1e-5, rms, od)
    assert y.shape == yr.shape == (13, 3, 43) and y.dtype == yr.dtype
    assert rstd.dtype == torch.float32 and rstd.shape == rr.shape == (13,)
    assert (mean is None) == (mr is None) == rms
    if rms or (od or xd) != xd or xd == torch.float32:
        # torch's RMS kernel / the same fp32 LayerNorm kernel and one cast: bit for bit
        assert_bitwise(y, yr, "output")
        assert_bitwise(rstd, rr, "rstd")
        if not rms:
            assert_bitwise(mean, mr, "mean")
        return
    # torch's mixed-dtype kernel on the half input: one ulp of the output, 4 fp32 ulps
    # of the statistics
    assert ((y.float() - yr.float()).abs() <= _ulp(yr)).all()
    torch.testing.assert_close(mean, mr, rtol=4 * 2 ** -23, atol=4 * 2 ** -23 * 3)
    torch.testing.assert_close(rstd, rr, rtol=4 * 2 ** -23, atol=0)


@pytest.mark.parametrize("rms,xd,od,pd", NORM_CASES)
@pytest.mark.parametrize("from_output", [False, True])
def test_norm_backward(cpu_path, rms, xd, od, pd, from_output):
    x, w, b = _norm_inputs(rms, xd, pd, seed=1)
    yr, mr, rr = ln_mod.layer_norm_fwd_ref(x, 129, w, b, 1e-5, rms, od)
    dy = torch.randn(yr.shape, generator=torch.Generator().manual_seed(2)).to(yr.dtype)
    saved = yr if from_output else x
    mean = None if rms or from_output else mr
    got = ln_mod.layer_norm_bwd(dy, saved, 129, w, b, mean, rr, rms, from_output, xd)
    want = ln_mod.layer_norm_bwd_ref(dy, saved, 129, w, b, mean, rr, rms, from_output, xd)
    for name, g, e in zip(("dx", "dweight", "dbias"), got, want):
        assert (g is None) == (e is None), name
        if e is None:
            continue
        assert g.dtype == e.dtype and g.shape == e.shape, name
        if rms or not from_output:
            assert_bitwise(g, e, name)  # the reference's kernel or arithmetic
            continue
        # torch's fp32 kernel on xhat: the same sums in another order
        tol = 1e-5 * e.float().abs().max().item()
        err = (g.float() - e.float()).abs()
        if e.dtype != torch.float32:
            err = (err - _ulp(e)).clamp(min=0)
        assert err.max().item() <= tol, (name, err.max().item(), tol)


def test_norm_empty_rows(cpu_path):
    x = torch.empty(0, 8)
    w, b = torch.ones(8), torch.zeros(8)
    y, mean, rstd = ln_mod.layer_norm_fwd(x, 8, w, b)
    assert y.shape == (0, 8) and mean.shape == rstd.shape == (0,)
    dx, dw, db = ln_mod.layer_norm_bwd(torch.empty(0, 8), x, 8, w, b, mean, rstd)
    assert dx.shape == (0, 8)
    assert torch.equal(dw, torch.zeros(8)) and torch.equal(db, torch.zeros(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_fused_layer_norm_module_matches_torch(cpu_path, dtype, memory_efficient):
    from tritamp.normalization import FusedLayerNorm
    torch.manual_seed(0)
    ours, theirs = FusedLayerNorm(64, memory_efficient=memory_efficient), torch.nn.LayerNorm(64)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        ours.bias.normal_()
        theirs.load_state_dict(ours.state_dict())
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = torch.randn(6, 5, 64, dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(6, 5, 64, dtype=dtype)
    ya, yb = ours(xa), theirs(xb)
    ya.backward(dy)
    yb.backward(dy)
    # torch's CPU LayerNorm runs the same kernels on fp32 (bf16: its mixed backward sums
    # the parameter gradients less precisely than the fp32 kernel tritamp runs)
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 and not memory_efficient else \
        dict(rtol=1.6e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ya, yb, **tol)
    torch.testing.assert_close(xa.grad, xb.grad, **tol)
    torch.testing.assert_close(ours.weight.grad.float(), theirs.weight.grad.float(),
                               rtol=tol["rtol"], atol=tol["atol"] * 8)
    torch.testing.assert_close(ours.bias.grad.float(), theirs.bias.grad.float(),
                               rtol=tol["rtol"], atol=tol["atol"] * 8)


# -------------------------------------------------------------------------------- syncbn

SYNCBN_CASES = list(itertools.product(
    DTYPES,                                  # input dtype
    (torch.float32, torch.bfloat16),         # parameter dtype
    (False, True),                           # channels last ([M, C]) / first ([N, C, B])
    (False, True),                           # fused relu
    (False, True)))                          # residual z


def _bn_inputs(dt, pd, cl, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (37, 6) if cl else (3, 6, 41)
    x = (torch.randn(shape, generator=gen) * 2 + 5).to(dt)
    dy = torch.randn(shape, generator=gen).to(dt)
    z = torch.randn(shape, generator=gen).to(dt)
    w = (torch.rand(6, generator=gen) + 0.5).to(pd)
    b = torch.randn(6, generator=gen).to(pd)
    return x, dy, z, w, b


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("cl", [False, True])
def test_syncbn_stats(cpu_path, dt, cl):
    x, *_ = _bn_inputs(dt, torch.float32, cl)
    x = x * 100  # |mean| >> std: two passes keep the digits
    rows, shift = bn_mod.syncbn_stats(x)
    ref, ref_shift = bn_mod.syncbn_stats_ref(x)
    assert shift is None and ref_shift is None and rows.shape == ref.shape == (1, 13)
    c = 6
    torch.testing.assert_close(rows[0, :c], ref[0, :c], rtol=1e-6, atol=0)
    torch.testing.assert_close(rows[0, c:2 * c], ref[0, c:2 * c], rtol=1e-5, atol=0)
    assert rows[0, 2 * c].item() == ref[0, 2 * c].item()
    # the statistics against fp64
    xd = x.double()
    dims = (0,) if cl else (0, 2)
    torch.testing.assert_close(rows[0, :c].double(), xd.mean(dims), rtol=1e-6, atol=0)
    n = x.numel() // c
    torch.testing.assert_close(rows[0, c:2 * c].double(), xd.var(dims, correction=0) * n,
                               rtol=2e-6, atol=0)
    empty, _ = bn_mod.syncbn_stats(x[:0])
    assert torch.equal(empty, torch.zeros(1, 13))


@pytest.mark.parametrize("dt,pd,cl,relu,has_z", SYNCBN_CASES)
def test_syncbn_forward_and_backward_bitwise(cpu_path, dt, pd, cl, relu, has_z):
    x, dy, z, w, b = _bn_inputs(dt, pd, cl, seed=1)
    z = z if has_z else None
    rows, _ = bn_mod.syncbn_stats_ref(x)
    mean, invstd, count = bn_mod.syncbn_finalize_ref(rows, 1e-5)
    if relu:
        x.view(-1)[5] = math.nan  # a NaN output: masked as torch.where(y > 0, dy, 0) does
    y = bn_mod.syncbn_forward(x, mean, invstd, w, b, z, relu)
    assert_bitwise(y, bn_mod.syncbn_forward_ref(x, mean, invstd, w, b, z, relu), "forward")
    out = torch.empty_like(x)
    assert bn_mod.syncbn_forward(x, mean, invstd, w, b, z, relu, out=out) is out
    assert_bitwise(out, y, "forward into out")
    for weight, bias in ((w, b), (w, None), (None, None)):
        got = bn_mod.syncbn_backward_reduce(dy, x, mean, invstd, weight, bias, z, relu)
        want = bn_mod.syncbn_backward_reduce_ref(dy, x, mean, invstd, weight, bias, z, relu)
        for name, g, e in zip(("sums", "grad_weight", "grad_bias"), got, want):
            assert (g is None) == (e is None)
            if e is not None:
                assert_bitwise(g, e, name)
        sums = got[0]
        for s, cnt in ((sums, count), (None, None)):
            gi = bn_mod.syncbn_backward_input(dy, x, mean, invstd, weight, s, cnt, bias, z, relu,
                                              need_dz=has_z)
            wi = bn_mod.syncbn_backward_input_ref(dy, x, mean, invstd, weight, s, cnt, bias, z,
                                                  relu, need_dz=has_z)
            for name, g, e in zip(("dx", "dz"), gi, wi):
                assert (g is None) == (e is None)
                if e is not None:
                    assert_bitwise(g, e, f"{name} (sums={s is not None})")


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_syncbatchnorm_module_matches_batchnorm(cpu_path, dt, channels_last):
    """The layer on the CPU path (no process group: a BatchNorm) against torch's
    BatchNorm2d: torch's CPU kernels take the same sums in another order."""
    from tritamp.parallel import SyncBatchNorm
    torch.manual_seed(0)
    ours, theirs = SyncBatchNorm(5), torch.nn.BatchNorm2d(5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        ours.bias.normal_()
        theirs.load_state_dict(ours.state_dict())
    ours, theirs = ours.to(dt), theirs.to(dt)
    x = torch.randn(4, 5, 6, 7).to(dt)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    dy = torch.randn_like(x)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    ya.backward(dy)
    yb.backward(dy)
    tol = dict(rtol=1e-5, atol=1e-5) if dt == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(ya, yb, **tol)
    torch.testing.assert_close(xa.grad, xb.grad, **tol)
    torch.testing.assert_close(ours.running_mean, theirs.running_mean, **tol)
    torch.testing.assert_close(ours.running_var, theirs.running_var, **tol)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=tol["rtol"],
                               atol=tol["atol"] * 10)
    torch.testing.assert_close(ours.bias.grad, theirs.bias.grad, rtol=tol["rtol"],
                               atol=tol["atol"] * 10)


def test_norm_and_syncbn_cpu_paths_do_not_call_the_references(cpu_path, monkeypatch):
    for mod, names in ((ln_mod, ("layer_norm_fwd_ref", "layer_norm_bwd_ref")),
                       (bn_mod, ("syncbn_stats_ref", "syncbn_forward_ref",
                                 "syncbn_backward_reduce_ref", "syncbn_backward_input_ref"))):
        for name in names:
            monkeypatch.setattr(mod, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} ran"))
    x = torch.randn(4, 16)
    w, b = torch.rand(16) + 0.5, torch.randn(16)
    for rms in (False, True):
        y, mean, rstd = ln_mod.layer_norm_fwd(x, 16, w, None if rms else b, rms=rms)
        ln_mod.layer_norm_bwd(torch.randn(4, 16), x, 16, w, None if rms else b, mean, rstd, rms)
    xb = torch.randn(3, 4, 5)
    rows, shift = bn_mod.syncbn_stats(xb)
    mean, invstd, count = bn_mod.syncbn_finalize(rows, 1e-5, shift=shift)
    bn_mod.syncbn_forward(xb, mean, invstd, relu=True, z=xb)
    sums, _, _ = bn_mod.syncbn_backward_reduce(xb, xb, mean, invstd, relu=True, z=xb)
    bn_mod.syncbn_backward_input(xb, xb, mean, invstd, None, sums, count, relu=True, z=xb)


@pytest.mark.parametrize("mode,add_dtype", [
    ("add", torch.float32), ("add", torch.bfloat16), ("in_place", torch.float32),
    ("in_place", torch.bfloat16),
    ("add_is_dst", torch.float32)])  # (an fp32 master gradient, its own addend)
@pytest.mark.parametrize("bad", [math.inf, math.nan, None])
@pytest.mark.parametrize("check_adds", [True, False])
def test_a_non_finite_addend_is_found_like_a_non_finite_source(mode, add_dtype, bad,
                                                               check_adds, path):
    # An inf/NaN left in an earlier gradient (a stash added back, a master gradient from
    # an earlier loss) is part of what the step will read: the sweep that adds it flags
    # it, as it flags its sources (the sources here are finite); unless the caller says
    # an earlier check already judged the addends (check_adds=False).
    gen = torch.Generator().manual_seed(5)
    srcs = [torch.randn(n, generator=gen).bfloat16() for n in (33, 1000, 5)]
    adds = [torch.randn(s.shape, generator=gen).to(add_dtype) for s in srcs]
    if bad is not None:
        adds[1][7] = bad
    if mode == "add":
        dsts = [torch.zeros(s.shape) for s in srcs]
    elif mode == "add_is_dst":
        dsts = adds
    else:
        srcs = [s.to(add_dtype) for s in srcs]
        dsts = None
    ref_srcs, ref_adds = clones(srcs), clones(adds)
    ref_dsts = None if dsts is None else (ref_adds if mode == "add_is_dst" else clones(dsts))
    scale = torch.tensor(4.0)
    found, found_ref = torch.zeros(()), torch.zeros(())
    check_unscale(srcs, scale, found, dsts=dsts, adds=adds, check_adds=check_adds)
    check_unscale_ref(ref_srcs, scale, found_ref, dsts=ref_dsts, adds=ref_adds,
                      check_adds=check_adds)
    assert found.item() == found_ref.item() == (0.0 if bad is None or not check_adds else 1.0)
    for a, r in zip(srcs if dsts is None else dsts, ref_srcs if dsts is None else ref_dsts):
        assert_bitwise(a, r, "result")
    if mode == "add":
        for a, r in zip(adds, ref_adds):
            assert_bitwise(a, r, "addend (read only)")
