"""multi_tensor_l2norm: the Triton kernel against multi_tensor_l2norm_ref and against
torch's own norms (``torch.linalg.vector_norm``, ``torch._foreach_norm``), and Apex's
overflow-flag contract.

Sums of squares are accumulated in fp32 in a different order from torch's, so norms
agree to a few fp32 ulps, not bit for bit; repeated calls agree bit for bit. Without a
GPU the kernel runs in Triton's interpreter (tests/conftest.py): ~30 us per program
of 4096 elements, so tensors stay small.
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritamp.kernels import use_triton
from tritamp.kernels.l2norm import (multi_tensor_l2norm, multi_tensor_l2norm_ref,
                                    reduce_segments, segment_table)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Odd sizes; (4097,) and (2, 4099) span two and three programs under the interpreter.
SHAPES = ((1,), (2,), (7,), (257,), (1000,), (3, 257), (4097,), (2, 4099))
# fp32 sums in another order: a few ulps of fp32 whatever the input dtype.
NORM_TOL = dict(rtol=2e-6, atol=1e-6)
HYPOTHESIS = dict(deadline=None, max_examples=15,
                  suppress_health_check=[HealthCheck.function_scoped_fixture,
                                         HealthCheck.too_slow])


def _tensors(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).to(DEVICE) for s in shapes]


def _torch_norms(tensors, inv=None):
    """Per-tensor and total norms from torch, in fp32 (fp64 for the total's sum)."""
    xs = [t.float() if inv is None else t.float() * inv for t in tensors]
    per = torch.stack([torch.linalg.vector_norm(x) for x in xs])
    total = torch.linalg.vector_norm(torch.cat([x.reshape(-1) for x in xs]).double()).float()
    return total, per


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_and_ref(dtype):
    ts = _tensors(SHAPES, dtype)
    total, per = multi_tensor_l2norm(ts, per_tensor=True)
    assert total.dtype == torch.float32 and total.shape == ()
    assert per.dtype == torch.float32 and per.shape == (len(ts),)
    t_total, t_per = _torch_norms(ts)
    torch.testing.assert_close(total, t_total, **NORM_TOL)
    torch.testing.assert_close(per, t_per, **NORM_TOL)
    foreach = torch.stack(torch._foreach_norm([t.float() for t in ts]))
    torch.testing.assert_close(per, foreach, **NORM_TOL)
    r_total, r_per = multi_tensor_l2norm_ref(ts, per_tensor=True)
    torch.testing.assert_close(total, r_total, **NORM_TOL)
    torch.testing.assert_close(per, r_per, **NORM_TOL)


def test_total_only_returns_none_and_agrees():
    ts = _tensors(SHAPES[:5], torch.float32)
    total, per = multi_tensor_l2norm(ts)
    assert per is None
    torch.testing.assert_close(total, multi_tensor_l2norm(ts, per_tensor=True)[0], rtol=0, atol=0)


def test_mixed_dtypes_keep_the_callers_order():
    dtypes = (torch.float16, torch.float32, torch.bfloat16, torch.float32, torch.float16)
    shapes = ((5,), (4099,), (300,), (1,), (4097,))
    ts = [_tensors([s], d, seed=i)[0] for i, (s, d) in enumerate(zip(shapes, dtypes))]
    total, per = multi_tensor_l2norm(ts, per_tensor=True)
    t_total, t_per = _torch_norms(ts)
    torch.testing.assert_close(per, t_per, **NORM_TOL)
    torch.testing.assert_close(total, t_total, **NORM_TOL)


def test_empty_list_and_empty_tensors():
    total, per = multi_tensor_l2norm([], per_tensor=True)
    assert float(total) == 0.0 and per.numel() == 0
    ts = [torch.empty(0, device=DEVICE), torch.full((3,), 2.0, device=DEVICE),
          torch.empty(0, 4, device=DEVICE)]
    total, per = multi_tensor_l2norm(ts, per_tensor=True)
    root12 = torch.tensor(12.0).sqrt().item()  # in fp32
    assert per.tolist() == [0.0, root12, 0.0]
    assert float(total) == root12
    only_empty = multi_tensor_l2norm([torch.empty(0, device=DEVICE)], per_tensor=True)
    assert float(only_empty[0]) == 0.0 and only_empty[1].tolist() == [0.0]


def test_non_contiguous_inputs():
    base = _tensors([(33, 65)], torch.float32)[0]
    views = [base.t(), base[:, ::2], base[1:, 3:]]
    _, per = multi_tensor_l2norm(views, per_tensor=True)
    torch.testing.assert_close(per, _torch_norms(views)[1], **NORM_TOL)


@pytest.mark.parametrize("scale", [2.0 ** 16, 3.0, 2.0 ** -10])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_gives_the_norm_of_unscaled_values(dtype, scale):
    ts = _tensors(((7,), (4099,), (3, 257)), dtype, seed=1)
    s = torch.tensor(scale, device=DEVICE)
    inv = torch.tensor(1.0 / scale, dtype=torch.float64).float().to(DEVICE)
    total, per = multi_tensor_l2norm(ts, per_tensor=True, scale=s)
    t_total, t_per = _torch_norms(ts, inv)
    torch.testing.assert_close(per, t_per, **NORM_TOL)
    torch.testing.assert_close(total, t_total, **NORM_TOL)
    r_total, r_per = multi_tensor_l2norm_ref(ts, per_tensor=True, scale=s)
    torch.testing.assert_close(per, r_per, **NORM_TOL)


def test_scale_keeps_large_fp32_values_from_overflowing():
    # 1e20**2 overflows fp32; unscaled by 2**40 first, it does not.
    x = torch.full((10,), 1e20, device=DEVICE)
    flag = torch.zeros(1, device=DEVICE)
    total, _ = multi_tensor_l2norm([x], scale=torch.tensor(2.0 ** 40, device=DEVICE),
                                   found_inf=flag)
    expected = math.sqrt(10) * (1e20 / 2.0 ** 40)
    assert math.isclose(float(total), expected, rel_tol=1e-6)
    assert float(flag) == 0.0


@pytest.mark.parametrize("kind", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_sets_the_flag(dtype, kind):
    ts = _tensors(((257,), (4099,), (3,)), dtype, seed=2)
    ts[1][4098] = float(kind)  # in the second program of the second tensor
    flag = torch.zeros(1, device=DEVICE)
    total, per = multi_tensor_l2norm(ts, per_tensor=True, found_inf=flag)
    assert float(flag) == 1.0
    if kind == "nan":
        assert math.isnan(float(total)) and math.isnan(float(per[1]))
    else:
        assert float(total) == math.inf and float(per[1]) == math.inf
    # the other tensors' norms are untouched by the bad one
    torch.testing.assert_close(per[[0, 2]], _torch_norms([ts[0], ts[2]])[1], **NORM_TOL)
    ref_flag = torch.zeros(1, device=DEVICE)
    multi_tensor_l2norm_ref(ts, found_inf=ref_flag)
    assert float(ref_flag) == 1.0


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy
def test_flag_contract_int_noop_buffer_never_cleared_and_overflow():
    finite = _tensors(((100,),), torch.float32)
    noop = torch.zeros(1, dtype=torch.int32, device=DEVICE)  # Apex's _dummy_overflow_buf
    multi_tensor_l2norm(finite, found_inf=noop)
    assert int(noop) == 0
    multi_tensor_l2norm([torch.tensor([1.0, math.nan], device=DEVICE)], found_inf=noop)
    assert int(noop) == 1 and noop.dtype == torch.int32
    multi_tensor_l2norm(finite, found_inf=noop)
    assert int(noop) == 1  # set, never cleared (Apex's contract)
    # every element finite, but the sum of squares overflows fp32: the result is not
    flag = torch.zeros((), device=DEVICE)
    total, _ = multi_tensor_l2norm([torch.full((4,), 3e19, device=DEVICE)], found_inf=flag)
    assert float(total) == math.inf and float(flag) == 1.0
    # half maxima do not overflow an fp32 sum of squares
    flag.zero_()
    big = torch.full((5000,), torch.finfo(torch.float16).max, dtype=torch.float16, device=DEVICE)
    total, _ = multi_tensor_l2norm([big], found_inf=flag)
    assert float(flag) == 0.0
    assert math.isclose(float(total), 65504.0 * math.sqrt(5000), rel_tol=1e-6)


def test_repeated_calls_agree_bit_for_bit():
    ts = _tensors(SHAPES, torch.bfloat16, seed=3)
    a = multi_tensor_l2norm(ts, per_tensor=True)
    b = multi_tensor_l2norm(ts, per_tensor=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_reduce_segments_over_long_runs():
    # Runs longer than the segment stage's 1024-wide loop, and empty runs.
    counts = [0, 1, 1024, 1025, 3000, 0, 7]
    g = torch.Generator().manual_seed(4)
    partials = torch.rand((2, sum(counts)), generator=g).to(DEVICE)
    if not use_triton(partials):
        pytest.skip("a launcher-level helper: needs CUDA or TRITON_INTERPRET=1")
    table = segment_table(counts, DEVICE)
    sums = reduce_segments(partials, table, len(counts), sqrt=False)
    norms = reduce_segments(partials, table, len(counts), sqrt=True)
    expected = torch.stack([torch.stack([c.sum() for c in row.split(counts)])
                            for row in partials.double()]).float()
    torch.testing.assert_close(sums, expected, rtol=2e-6, atol=0)
    torch.testing.assert_close(norms, expected.sqrt(), rtol=2e-6, atol=0)


def test_mixed_devices_are_refused():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device beside the CPU")
    with pytest.raises(ValueError, match="once per device"):
        multi_tensor_l2norm([torch.ones(3, device="cuda"), torch.ones(3)])


_special = st.sampled_from([math.inf, -math.inf, math.nan, -0.0, 0.0, 1e-8, 65504.0])


@settings(**HYPOTHESIS)
@given(dtype=st.sampled_from(DTYPES),
       sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=4),
       special=st.lists(st.tuples(st.integers(0, 10 ** 6), _special), max_size=3),
       seed=st.integers(0, 2 ** 16))
def test_hypothesis_against_torch(dtype, sizes, special, seed):
    ts = _tensors([(n,) for n in sizes], dtype, seed=seed)
    for pos, value in special:
        t = ts[pos % len(ts)]
        if t.numel():
            t[pos % t.numel()] = value
    flag = torch.zeros(1, device=DEVICE)
    total, per = multi_tensor_l2norm(ts, per_tensor=True, found_inf=flag)
    t_total, t_per = _torch_norms(ts)
    torch.testing.assert_close(per, t_per, equal_nan=True, **NORM_TOL)
    torch.testing.assert_close(total, t_total, equal_nan=True, **NORM_TOL)
    assert float(flag) == float(not math.isfinite(float(t_total)))
