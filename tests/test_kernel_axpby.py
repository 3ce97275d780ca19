"""multi_tensor_scale / multi_tensor_axpby: the Triton kernel against the torch references.

Both are fp32 arithmetic and one rounding to the destination dtype, so kernel and
reference agree bit for bit (NaN payloads aside) under the interpreter; on the GPU
Triton may contract ``a * x + b * y`` into an FMA, so axpby is compared with a tolerance
there. The overflow flag follows Apex: set to 1 when a checked input is non-finite,
never cleared, outputs written anyway.
"""
import importlib
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritamp.kernels.axpby import (multi_tensor_axpby, multi_tensor_axpby_ref,
                                   multi_tensor_scale, multi_tensor_scale_ref)

ax_mod = importlib.import_module("tritamp.kernels.axpby")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EXACT_FMA_FREE = DEVICE.type == "cpu"  # the interpreter never contracts into an FMA
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
SHAPES = ((1,), (7,), (257,), (3, 257), (4097,))  # the last spans two 4096-programs
SPECIALS = ("inf", "-inf", "nan", "-0.0", "max", "subnormal")
HYPOTHESIS = dict(deadline=None, max_examples=25,
                  suppress_health_check=[HealthCheck.too_slow])


def special_value(kind, dtype):
    fi = torch.finfo(dtype)
    return {"inf": math.inf, "-inf": -math.inf, "nan": math.nan, "-0.0": -0.0,
            "max": fi.max, "subnormal": fi.tiny / 2}[kind]


def assert_bitwise(actual, expected, what="tensor"):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    a, e = actual.reshape(-1).cpu(), expected.reshape(-1).cpu()
    an, en = torch.isnan(a), torch.isnan(e)
    bits = _BITS[a.dtype]
    bad = (an != en) | (~an & (a.view(bits) != e.view(bits)))
    assert not bad.any(), f"{what}: {int(bad.sum())} of {a.numel()} elements differ"


def assert_outputs(actual, expected, exact):
    for i, (a, e) in enumerate(zip(actual, expected)):
        if exact:
            assert_bitwise(a, e, f"output {i}")
        else:
            torch.testing.assert_close(a, e, equal_nan=True, rtol=2 * torch.finfo(a.dtype).eps,
                                       atol=0)


@st.composite
def tensor_list(draw, n, shapes, plant=True):
    dtypes = draw(st.lists(st.sampled_from(DTYPES), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    plants = draw(st.lists(st.tuples(st.integers(0, n - 1), st.floats(0, 1, exclude_max=True),
                                     st.sampled_from(SPECIALS)), max_size=3)) if plant else []
    gen = torch.Generator().manual_seed(seed)
    ts = [torch.randn(s, generator=gen).to(dt) for s, dt in zip(shapes, dtypes)]
    for i, where, kind in plants:
        flat = ts[i].view(-1)
        flat[int(where * flat.numel())] = special_value(kind, flat.dtype)
    return [t.to(DEVICE) for t in ts]


@st.composite
def shapes_list(draw):
    n = draw(st.integers(1, 4))
    return draw(st.lists(st.sampled_from(SHAPES), min_size=n, max_size=n))


def flag(dtype):
    return torch.zeros(1, dtype=dtype, device=DEVICE)


def nonfinite(ts):
    return any(not bool(torch.isfinite(t).all()) for t in ts)


def coef(draw_value, as_tensor):
    return torch.tensor(draw_value, device=DEVICE) if as_tensor else draw_value


@settings(**HYPOTHESIS)
@given(data=st.data(), scale=st.sampled_from((1.0, 0.5, 3.0, 2.0 ** -16, 65536.0, 1e-3)),
       as_tensor=st.booleans(), flag_dtype=st.sampled_from((torch.int32, torch.float32)))
def test_scale_matches_reference(data, scale, as_tensor, flag_dtype):
    shapes = data.draw(shapes_list())
    srcs = data.draw(tensor_list(len(shapes), shapes))
    out_dtypes = data.draw(st.lists(st.sampled_from(DTYPES), min_size=len(shapes),
                                    max_size=len(shapes)))
    dsts = [torch.full_like(s, 7.0, dtype=d) for s, d in zip(srcs, out_dtypes)]
    dsts_ref = [d.clone() for d in dsts]
    f, f_ref = flag(flag_dtype), flag(flag_dtype)
    s = coef(scale, as_tensor)
    multi_tensor_scale(srcs, dsts, s, f)
    multi_tensor_scale_ref(srcs, dsts_ref, s, f_ref)
    assert_outputs(dsts, dsts_ref, exact=True)  # one multiply: no FMA to contract
    assert f.item() == f_ref.item() == (1 if nonfinite(srcs) else 0)


@settings(**HYPOTHESIS)
@given(data=st.data(), a=st.sampled_from((1.0, -1.0, 0.5, 3.0, 1e-3)),
       b=st.sampled_from((1.0, 0.0, -2.0, 0.1)), arg=st.sampled_from((-1, 0, 1)),
       as_tensor=st.booleans(), flag_dtype=st.sampled_from((torch.int32, torch.float32)))
def test_axpby_matches_reference(data, a, b, arg, as_tensor, flag_dtype):
    shapes = data.draw(shapes_list())
    xs = data.draw(tensor_list(len(shapes), shapes))
    ys = data.draw(tensor_list(len(shapes), shapes))
    out_dtypes = data.draw(st.lists(st.sampled_from(DTYPES), min_size=len(shapes),
                                    max_size=len(shapes)))
    outs = [torch.empty_like(x, dtype=d) for x, d in zip(xs, out_dtypes)]
    outs_ref = [o.clone() for o in outs]
    f, f_ref = flag(flag_dtype), flag(flag_dtype)
    ca, cb = coef(a, as_tensor), coef(b, as_tensor)
    multi_tensor_axpby(xs, ys, outs, ca, cb, f, arg)
    multi_tensor_axpby_ref(xs, ys, outs_ref, ca, cb, f_ref, arg)
    assert_outputs(outs, outs_ref, exact=EXACT_FMA_FREE)
    checked = {-1: xs + ys, 0: xs, 1: ys}[arg]
    assert f.item() == f_ref.item() == (1 if nonfinite(checked) else 0)


@pytest.mark.parametrize("arg", [-1, 0, 1])
def test_axpby_flag_follows_arg_to_check(arg):
    x = torch.ones(300, device=DEVICE)
    y = torch.ones(300, device=DEVICE, dtype=torch.float16)
    y[123] = math.inf
    out = torch.empty(300, device=DEVICE)
    f = flag(torch.int32)
    multi_tensor_axpby([x], [y], [out], 2.0, 1.0, f, arg)
    assert f.item() == (0 if arg == 0 else 1)
    assert out[123].item() == math.inf and out[0].item() == 3.0  # written anyway (Apex)


def test_flag_is_never_cleared_and_the_scaled_overflow_is_not_flagged():
    f = torch.ones(1, dtype=torch.int32, device=DEVICE)
    src = torch.full((10,), 60000.0, device=DEVICE)
    dst = torch.empty(10, device=DEVICE, dtype=torch.float16)
    multi_tensor_scale([src], [dst], 4.0, f)
    assert f.item() == 1  # stays set
    f.zero_()
    multi_tensor_scale([src], [dst], 4.0, f)
    assert f.item() == 0 and torch.isinf(dst).all()  # Apex checks the inputs only


@pytest.mark.skipif(DEVICE.type == "cpu" and not ax_mod.use_triton(torch.zeros(1)),
                    reason="no GPU and no interpreter: the torch reference runs")
def test_one_launch_per_dtype_group(count_launches):
    counter = count_launches(ax_mod, "_axpby_sweep_kernel")
    srcs = [torch.randn(n, device=DEVICE) for n in (5, 4097, 1, 33)] + \
        [torch.randn(9, device=DEVICE, dtype=torch.float16)]
    srcs.append(torch.empty(0, device=DEVICE))  # empty tensors are skipped
    dsts = [torch.empty_like(s, dtype=torch.float16) for s in srcs]
    multi_tensor_scale(srcs, dsts, 0.5, flag(torch.int32))
    assert len(counter.grids) == 2
    assert sorted(g[0] for g in counter.grids) == [1, 5]  # 1 + 2 + 1 + 1 programs; 1


def test_empty_list_and_validation():
    f = flag(torch.int32)
    multi_tensor_scale([], [], 2.0, f)
    x = torch.ones(4, device=DEVICE)
    with pytest.raises(ValueError, match="lengths"):
        multi_tensor_axpby([x], [x, x], [x], 1.0, 1.0, f)
    with pytest.raises(ValueError, match="shape"):
        multi_tensor_scale([x], [torch.ones(5, device=DEVICE)], 2.0, f)
    with pytest.raises(ValueError, match="arg_to_check"):
        multi_tensor_axpby([x], [x], [x], 1.0, 1.0, f, arg_to_check=2)
    with pytest.raises(ValueError, match="one-element"):
        multi_tensor_scale([x], [x], torch.ones(2, device=DEVICE), f)
    with pytest.raises(ValueError, match="contiguous"):
        m = torch.ones(4, 6, device=DEVICE)[:, ::2]
        multi_tensor_scale([m], [torch.empty_like(m)], 2.0, f)


def test_in_place_scale_and_no_flag():
    x = torch.arange(5000, dtype=torch.float32, device=DEVICE)
    expected = x * 0.25
    multi_tensor_scale([x], [x], torch.tensor(0.25, device=DEVICE), None)
    assert torch.equal(x, expected)
