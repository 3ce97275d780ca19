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

from tritamp.kernels import use_triton
from tritamp.kernels.axpby import (multi_tensor_axpby, multi_tensor_axpby_launch,
                                   multi_tensor_axpby_prepare, multi_tensor_axpby_ref,
                                   multi_tensor_scale, multi_tensor_scale_launch,
                                   multi_tensor_scale_prepare, multi_tensor_scale_ref)

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


@pytest.mark.skipif(DEVICE.type == "cpu" and not use_triton(torch.zeros(1)),
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
    with pytest.raises(ValueError, match=r"dsts\[0\] of shape \(4, 6\) has strides \(1, 0\)"):
        multi_tensor_scale([torch.ones(4, 6, device=DEVICE)],
                           [torch.zeros(4, 1, device=DEVICE).expand(4, 6)], 2.0, f)
    assert f.item() == 0


def test_in_place_scale_and_no_flag():
    x = torch.arange(5000, dtype=torch.float32, device=DEVICE)
    expected = x * 0.25
    multi_tensor_scale([x], [x], torch.tensor(0.25, device=DEVICE), None)
    assert torch.equal(x, expected)


# ------------------------------------------------------------------------------ layouts

def test_inputs_in_other_layouts_are_read_through_dense_copies():
    """Column-major, expanded and strided-view inputs against a contiguous output (and a
    channels-last output against contiguous inputs) give the contiguous results."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 10, generator=gen).to(DEVICE)
    y = torch.randn(6, 10, generator=gen).to(DEVICE)
    x_cm = x.t().contiguous().t()                     # column-major, same values
    y_exp = y[:1].expand(6, 10)                       # expanded: every row is y[0]
    x_view = torch.zeros(6, 20, device=DEVICE)[:, ::2]
    x_view.copy_(x)                                   # a strided view, same values
    expected = [torch.empty(6, 10, device=DEVICE).half() for _ in range(3)]
    multi_tensor_axpby_ref([x, x, x], [y, y_exp.contiguous(), y], expected, 0.5, -2.0, None)
    outs = [torch.empty(6, 10, device=DEVICE).half() for _ in range(3)]
    f = flag(torch.int32)
    multi_tensor_axpby([x_cm, x, x_view], [y, y_exp, y], outs, 0.5, -2.0, f)
    assert_outputs(outs, expected, exact=EXACT_FMA_FREE)
    assert f.item() == 0

    img = torch.randn(2, 3, 4, 5, generator=gen).to(DEVICE)
    out_cl = torch.empty(2, 3, 4, 5, device=DEVICE).to(memory_format=torch.channels_last)
    multi_tensor_scale([img], [out_cl], 0.25, None)
    assert out_cl.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out_cl, img * 0.25)


def test_output_that_is_a_strided_view_is_written_back_and_nothing_else():
    buf = torch.arange(48, dtype=torch.float32, device=DEVICE).reshape(4, 12)
    before = buf.clone()
    view = buf[:, 1::2]                               # not dense, does not overlap
    multi_tensor_scale([view], [view], 2.0, None)     # in place
    expected = before.clone()
    expected[:, 1::2] *= 2.0
    assert torch.equal(buf, expected)


def test_overlapping_output_is_refused_before_anything_is_written():
    x = torch.ones(4, 6, device=DEVICE)
    x[0, 0] = math.inf
    x_before = x.clone()
    good_out = torch.full((3,), 5.0, device=DEVICE)
    overlap = torch.zeros(4, 1, device=DEVICE)
    f = flag(torch.int32)
    with pytest.raises(ValueError, match=r"multi_tensor_scale: dsts\[1\] of shape \(4, 6\) has "
                       r"strides \(1, 0\).*contiguous\(\)"):
        multi_tensor_scale([torch.ones(3, device=DEVICE), x], [good_out, overlap.expand(4, 6)],
                           2.0, f)
    assert f.item() == 0 and torch.equal(good_out, torch.full((3,), 5.0, device=DEVICE))
    assert torch.equal(overlap, torch.zeros(4, 1, device=DEVICE))
    assert_bitwise(x, x_before, "source after a refused call")


def test_wrong_shape_partner_is_refused_and_nothing_changes():
    xs = [torch.randn(5, device=DEVICE), torch.randn(3, 4, device=DEVICE)]
    xs[0][0] = math.inf
    ys = [torch.randn(5, device=DEVICE), torch.randn(12, device=DEVICE)]
    outs = [torch.zeros(5, device=DEVICE), torch.zeros(3, 4, device=DEVICE)]
    before = [t.clone() for t in xs + ys + outs]
    f = flag(torch.float32)
    with pytest.raises(ValueError, match=r"xs\[1\] has shape \(3, 4\) but ys\[1\] has shape "
                       r"\(12,\)"):
        multi_tensor_axpby(xs, ys, outs, 1.0, 1.0, f)
    for t, b in zip(xs + ys + outs, before):
        assert_bitwise(t, b, "tensor after a refused call")
    assert f.item() == 0


def test_prepared_sweep_is_reused_and_sees_new_values():
    """A prepared sweep launched again reads the inputs' current values, also through
    the dense copy of an input in another layout (refreshed at every launch)."""
    x = torch.randn(8, 6, device=DEVICE).t()          # column-major against out
    y = torch.randn(6, 8, device=DEVICE)
    out = torch.empty(6, 8, device=DEVICE)
    prepared = multi_tensor_axpby_prepare([x], [y], [out])
    meta = [g.meta for g in prepared.prepared.groups]
    multi_tensor_axpby_launch(prepared, 2.0, 1.0)
    assert torch.equal(out, 2.0 * x + y)
    x.mul_(-3.0)
    y.add_(1.0)
    multi_tensor_axpby_launch(prepared, 2.0, 1.0)
    assert torch.equal(out, 2.0 * x + y)
    assert [g.meta for g in prepared.prepared.groups] == meta
    p2 = multi_tensor_scale_prepare([y], [out])
    multi_tensor_scale_launch(p2, torch.tensor(0.5, device=DEVICE), None)
    assert torch.equal(out, y * 0.5)


@pytest.mark.skipif(DEVICE.type == "cpu" and not use_triton(torch.zeros(1)),
                    reason="no GPU and no interpreter: the torch reference runs")
@pytest.mark.parametrize("dtype", DTYPES)
def test_aligned_and_unaligned_groups_agree(dtype):
    """The same values through the vectorised path (every address 16-byte aligned, every
    numel a multiple of the vector width) and through the masked path (one byte-offset
    view per tensor): bit for bit the same results and flag."""
    gen = torch.Generator().manual_seed(7)
    numels = (16, 4096, 64, 4104)
    xs = [torch.randn(n, generator=gen).to(dtype).to(DEVICE) for n in numels]
    ys = [torch.randn(n, generator=gen).to(DEVICE) for n in numels]
    xs[2][5] = math.nan
    # The same values one element into a larger buffer: misaligned addresses.
    shifted = []
    for t in xs + ys:
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=DEVICE)
        buf[1:].copy_(t)
        shifted.append(buf[1:])
    xs_u, ys_u = shifted[:len(xs)], shifted[len(xs):]
    outs_a = [torch.empty(n, dtype=dtype, device=DEVICE) for n in numels]
    outs_u = [torch.empty(n, dtype=dtype, device=DEVICE) for n in numels]
    pa = multi_tensor_axpby_prepare(xs, ys, outs_a)
    pu = multi_tensor_axpby_prepare(xs_u, ys_u, outs_u)
    vec = 16 // min(torch.empty(0, dtype=dtype).element_size(), 4)  # narrowest dtype
    assert [g.constexprs["VEC"] for g in pa.prepared.groups] == [vec]
    assert [g.constexprs["VEC"] for g in pu.prepared.groups] == [1]
    fa, fu = flag(torch.int32), flag(torch.int32)
    multi_tensor_axpby_launch(pa, 0.5, 3.0, fa)
    multi_tensor_axpby_launch(pu, 0.5, 3.0, fu)
    for i, (a, u) in enumerate(zip(outs_a, outs_u)):
        assert_bitwise(a, u, f"output {i}, aligned vs unaligned")
    assert fa.item() == fu.item() == 1
    expected = [torch.empty_like(o) for o in outs_a]
    multi_tensor_axpby_ref(xs, ys, expected, 0.5, 3.0, None)
    assert_outputs(outs_a, expected, exact=EXACT_FMA_FREE)
