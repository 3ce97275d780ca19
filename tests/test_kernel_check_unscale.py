"""check_unscale: the Triton kernel against check_unscale_ref and against torch's own
``_amp_foreach_non_finite_check_and_unscale_`` on the same inputs.

Unscaling is one fp32 multiply by ``float(1 / double(scale))`` and one rounding to the
destination dtype, so kernel, reference and torch must agree bit for bit (NaN payloads
aside). Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py), which
costs ~30 us per program: tensors stay small and examples few.
"""
import importlib
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tritamp.kernels as K
from tritamp.kernels import check_unscale, check_unscale_ref

# The package re-exports the function under the module's name, so ``import
# tritamp.kernels.check_unscale as m`` would bind the function: fetch the module itself.
cu_mod = importlib.import_module("tritamp.kernels.check_unscale")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Triton may contract x * inv + add into an FMA on the GPU; the interpreter never does.
EXACT_FMA_FREE = DEVICE.type == "cpu"

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
# Odd shapes; under the interpreter one program covers 4096 elements.
SHAPES = ((1,), (2,), (7,), (257,), (1000,), (3, 257))
MULTI_BLOCK_SHAPES = ((4097,), (2, 4099))  # two and three programs of 4096
# Powers of two (exact unscale) and scales whose reciprocal rounds.
SCALES = (1.0, 2.0, 0.5, 2.0 ** 16, 2.0 ** -12, 2.0 ** 24, 3.0, 1e-3, 0.1, 12345.678)
SPECIAL_KINDS = ("inf", "-inf", "nan", "-0.0", "max", "-max", "tiny", "subnormal",
                 "-subnormal", "min_subnormal")

HYPOTHESIS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                         HealthCheck.too_slow])


def special_value(kind, dtype):
    fi = torch.finfo(dtype)
    min_sub = fi.tiny * fi.eps  # 2**-24, 2**-133, 2**-149
    return {"inf": math.inf, "-inf": -math.inf, "nan": math.nan, "-0.0": -0.0,
            "max": fi.max, "-max": -fi.max, "tiny": fi.tiny, "subnormal": fi.tiny / 2,
            "-subnormal": -3 * min_sub, "min_subnormal": min_sub}[kind]


def assert_bitwise(actual, expected, what="tensor"):
    """Equal bit for bit, except that any NaN equals any NaN (payloads may differ)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().reshape(-1).cpu()
    e = expected.detach().reshape(-1).cpu()
    a_nan, e_nan = torch.isnan(a), torch.isnan(e)
    bits = _BITS[a.dtype]
    bad = (a_nan != e_nan) | (~a_nan & (a.view(bits) != e.view(bits)))
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.numel()} elements differ; first at flat index {i}: "
            f"got {a[i].item()!r} (bits {a.view(bits)[i].item():#x}), expected {e[i].item()!r} "
            f"(bits {e.view(bits)[i].item():#x})")


def torch_unscale_(tensors, found_inf, inv_scale):
    """torch._amp_foreach_non_finite_check_and_unscale_ on ``tensors`` in place.

    torch's CUDA kernel has no bf16 path; there bf16 tensors go through an fp32 copy,
    which is the same arithmetic (fp32 multiply, one rounding)."""
    native = [t for t in tensors if t.device.type == "cpu" or t.dtype != torch.bfloat16]
    if native:
        torch._amp_foreach_non_finite_check_and_unscale_(native, found_inf, inv_scale)
    for t in tensors:
        if t.device.type != "cpu" and t.dtype == torch.bfloat16:
            up = t.float()
            torch._amp_foreach_non_finite_check_and_unscale_([up], found_inf, inv_scale)
            t.copy_(up)


def clones(tensors):
    return [t.clone() for t in tensors]


def any_nonfinite(tensors):
    return any(not bool(torch.isfinite(t).all()) for t in tensors)


def scale_tensor(scale):
    return torch.tensor(scale, dtype=torch.float32, device=DEVICE)


def inv_of(scale_t):
    return scale_t.double().reciprocal().float()


def found(value=0.0):
    return torch.full((), value, dtype=torch.float32, device=DEVICE)


@st.composite
def tensor_lists(draw, max_tensors=6, dtypes=DTYPES):
    """1..max_tensors tensors of odd shapes and mixed dtypes, random values with special
    values (inf, NaN, -0.0, subnormals, the dtype's max) planted at random places."""
    n = draw(st.integers(1, max_tensors))
    shapes = draw(st.lists(st.sampled_from(SHAPES), min_size=n, max_size=n))
    if draw(st.booleans()):
        shapes[draw(st.integers(0, n - 1))] = draw(st.sampled_from(MULTI_BLOCK_SHAPES))
    kinds = draw(st.lists(st.sampled_from(dtypes), min_size=n, max_size=n))
    magnitude = draw(st.sampled_from((1e-3, 1.0, 1e3)))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    plants = draw(st.lists(st.tuples(st.integers(0, n - 1),
                                     st.floats(0.0, 1.0, exclude_max=True),
                                     st.sampled_from(SPECIAL_KINDS)), max_size=8))
    gen = torch.Generator().manual_seed(seed)
    tensors = [(torch.randn(shape, generator=gen) * magnitude).to(dt)
               for shape, dt in zip(shapes, kinds)]
    for i, where, kind in plants:
        flat = tensors[i].view(-1)
        flat[int(where * flat.numel())] = special_value(kind, flat.dtype)
    return [t.to(DEVICE) for t in tensors]


@pytest.fixture
def launches(count_launches):
    return count_launches(cu_mod, "_check_unscale_sweep_kernel")


# --------------------------------------------------------------------------- in place

@settings(max_examples=40, **HYPOTHESIS)
@given(srcs=tensor_lists(), scale=st.sampled_from(SCALES), start=st.sampled_from((0.0, 1.0)))
def test_inplace_unscale_matches_ref_and_torch(srcs, scale, start):
    scale_t = scale_tensor(scale)
    ours, ref, theirs = clones(srcs), clones(srcs), clones(srcs)
    f_ours, f_ref, f_torch = found(start), found(start), found(start)

    check_unscale(ours, scale_t, f_ours)
    check_unscale_ref(ref, scale_t, f_ref)
    torch_unscale_(theirs, f_torch, inv_of(scale_t))

    for i, (a, r, t) in enumerate(zip(ours, ref, theirs)):
        assert_bitwise(a, r, f"tensor {i} ({a.dtype}) vs check_unscale_ref")
        assert_bitwise(a, t, f"tensor {i} ({a.dtype}) vs torch")
    expected = max(start, float(any_nonfinite(srcs)))
    assert f_ours.item() == f_ref.item() == f_torch.item() == expected
    assert scale_t.item() == torch.tensor(scale, dtype=torch.float32).item()  # scale untouched


@pytest.mark.parametrize("scale", [2.0 ** 16, 3.0, 1e-3])
def test_inplace_every_special_value_in_every_dtype(scale):
    """Deterministic companion of the hypothesis test: each special value of each dtype,
    in the first and the last of several 4096-element programs."""
    srcs = []
    for i, dt in enumerate(DTYPES):
        x = torch.randn(2 * 4096 + 3, generator=torch.Generator().manual_seed(i)).to(dt)
        for k, kind in enumerate(SPECIAL_KINDS):
            x[k] = special_value(kind, dt)
            x[-1 - k] = special_value(kind, dt)
        srcs.append(x.to(DEVICE))
    scale_t = scale_tensor(scale)
    ours, ref, theirs = clones(srcs), clones(srcs), clones(srcs)
    f_ours, f_ref, f_torch = found(), found(), found()
    check_unscale(ours, scale_t, f_ours)
    check_unscale_ref(ref, scale_t, f_ref)
    torch_unscale_(theirs, f_torch, inv_of(scale_t))
    for a, r, t in zip(ours, ref, theirs):
        assert_bitwise(a, r, f"{a.dtype} vs check_unscale_ref")
        assert_bitwise(a, t, f"{a.dtype} vs torch")
    assert f_ours.item() == f_ref.item() == f_torch.item() == 1.0


# ------------------------------------------------------- separate destinations, adds

def _assert_accumulated(actual, src, inv, add, what):
    """dst = src * inv + add: bitwise on the interpreter; on the GPU (FMA contraction)
    no more than twice torch's own error against fp64, plus one fp32 ulp."""
    prod = src.to(torch.float32, copy=True)  # .float() of fp32 would alias src
    torch._amp_foreach_non_finite_check_and_unscale_([prod], found(), inv)
    expected = (prod + add.float()).to(actual.dtype)
    if EXACT_FMA_FREE:
        assert_bitwise(actual, expected, what)
        return
    assert torch.equal(torch.isnan(actual), torch.isnan(expected)), what
    exact = src.double() * inv.double() + add.double()
    ok = torch.isfinite(exact) & torch.isfinite(expected)
    assert torch.equal(actual[~ok & ~torch.isnan(actual)], expected[~ok & ~torch.isnan(expected)]), what
    err = (actual[ok].double() - exact[ok]).abs().max() if ok.any() else 0.0
    ref_err = (expected[ok].double() - exact[ok]).abs().max() if ok.any() else 0.0
    ulp = torch.finfo(torch.float32).eps * (exact[ok].abs().max() if ok.any() else 0.0)
    assert err <= 2 * ref_err + ulp, f"{what}: error {err} vs torch's {ref_err}"


@settings(max_examples=30, **HYPOTHESIS)
@given(srcs=tensor_lists(max_tensors=4), scale=st.sampled_from(SCALES),
       dst_dtype=st.sampled_from((torch.float32, torch.float32, torch.float16, torch.bfloat16)),
       add_dtype=st.sampled_from(DTYPES),
       mode=st.sampled_from(("dst", "add", "add_is_dst")), seed=st.integers(0, 2 ** 31 - 1))
def test_unscale_into_destinations_and_accumulate(srcs, scale, dst_dtype, add_dtype, mode, seed):
    """Half gradients unscaled into fp32 master gradients; dst = src * inv + add."""
    gen = torch.Generator().manual_seed(seed)
    scale_t = scale_tensor(scale)
    inv = inv_of(scale_t)
    originals = clones(srcs)

    def fresh(dtype):
        return [torch.randn(s.shape, generator=gen).to(dtype).to(DEVICE) for s in srcs]

    dsts = fresh(dst_dtype)
    adds = None
    if mode == "add":
        adds = fresh(add_dtype)
    elif mode == "add_is_dst":
        adds = dsts  # accumulate into the destination itself
    addends = None if adds is None else clones(adds)

    dsts_ref = clones(dsts)
    adds_ref = None if adds is None else (dsts_ref if mode == "add_is_dst" else clones(adds))
    f_ours, f_ref, f_torch = found(), found(), found()

    check_unscale(srcs, scale_t, f_ours, dsts=dsts, adds=adds)
    check_unscale_ref(srcs, scale_t, f_ref, dsts=dsts_ref, adds=adds_ref)
    torch_unscale_(clones(srcs), f_torch, inv)

    for i, (s, o) in enumerate(zip(srcs, originals)):
        assert_bitwise(s, o, f"source {i} must stay untouched")
    for i, (d, r, s) in enumerate(zip(dsts, dsts_ref, srcs)):
        what = f"dst {i} ({s.dtype} -> {dst_dtype}, {mode})"
        if adds is None:
            prod = s.to(torch.float32, copy=True)  # .float() of fp32 would alias s
            torch._amp_foreach_non_finite_check_and_unscale_([prod], found(), inv)
            assert_bitwise(d, r, what + " vs ref")
            assert_bitwise(d, prod.to(dst_dtype), what + " vs torch")
        else:
            if EXACT_FMA_FREE:
                assert_bitwise(d, r, what + " vs ref")
            _assert_accumulated(d, s, inv, addends[i], what + " vs torch")
    if mode == "add":
        for i, (a, a0) in enumerate(zip(adds, addends)):
            assert_bitwise(a, a0, f"addend {i} must stay untouched")
    assert f_ours.item() == f_ref.item() == f_torch.item() == float(any_nonfinite(srcs))


@pytest.mark.parametrize("scale", [None, 3.0, 2.0 ** -8])
def test_accumulate_in_place(scale):
    """adds without dsts: src = src * inv + add (or src + add when scale is None)."""
    gen = torch.Generator().manual_seed(2)
    srcs = [(torch.randn(n, generator=gen) * 50).to(dt).to(DEVICE)
            for n, dt in ((257, torch.float16), (4097, torch.float32), (7, torch.bfloat16))]
    srcs[0][3] = -0.0
    srcs[1][4096] = torch.finfo(torch.float32).max
    adds = [torch.randn(s.shape, generator=gen).to(DEVICE) for s in srcs]
    adds[2] = adds[2].half()
    originals, adds_before = clones(srcs), clones(adds)
    inv = found(1.0) if scale is None else inv_of(scale_tensor(scale))
    scale_t = None if scale is None else scale_tensor(scale)
    ref = clones(srcs)
    f = found()
    check_unscale(srcs, scale_t, f, adds=adds)
    check_unscale_ref(ref, scale_t, found(), adds=adds)
    for i, (s, r, o, a) in enumerate(zip(srcs, ref, originals, adds)):
        if EXACT_FMA_FREE:
            assert_bitwise(s, r, f"tensor {i} vs ref")
        _assert_accumulated(s, o, inv, a, f"tensor {i} vs torch")
        assert_bitwise(a, adds_before[i], f"addend {i} must stay untouched")
    assert f.item() == 0.0


# ----------------------------------------------------------------------- check only

@settings(max_examples=25, **HYPOTHESIS)
@given(srcs=tensor_lists(), scale=st.one_of(st.none(), st.sampled_from(SCALES)),
       with_dsts=st.booleans())
def test_check_only_leaves_tensors_untouched(srcs, scale, with_dsts):
    originals = clones(srcs)
    dsts = [torch.full(s.shape, 7.0, device=DEVICE) for s in srcs] if with_dsts else None
    f_ours, f_torch = found(), found()
    check_unscale(srcs, None if scale is None else scale_tensor(scale), f_ours,
                  dsts=dsts, write=False)
    torch_unscale_(clones(srcs), f_torch, found(1.0))
    for i, (s, o) in enumerate(zip(srcs, originals)):
        assert_bitwise(s, o, f"source {i} with write=False")
    if dsts is not None:
        assert all(bool((d == 7.0).all()) for d in dsts), "write=False wrote a destination"
    assert f_ours.item() == f_torch.item() == float(any_nonfinite(srcs))


# --------------------------------------------------------------- scale=None: cast copy

def _random_bits(gen, n, dtype):
    bits = _BITS[dtype]
    width = torch.iinfo(bits).bits
    raw = torch.randint(-2 ** (width - 1), 2 ** (width - 1), (n,), generator=gen, dtype=torch.int64)
    return raw.to(bits).view(dtype)


def _as_int32(raw):
    """int64 holding unsigned 32-bit patterns -> the same bits as int32."""
    return torch.where(raw >= 2 ** 31, raw - 2 ** 32, raw).to(torch.int32)


def _halfway_fp32(gen, n, dst_dtype):
    """fp32 values exactly halfway between two neighbouring ``dst_dtype`` numbers."""
    if dst_dtype == torch.bfloat16:
        raw = torch.randint(0, 2 ** 32, (n,), generator=gen, dtype=torch.int64)
        return _as_int32((raw & ~0xFFFF) | 0x8000).view(torch.float32)
    # fp16: a normal fp16 number plus half of its ulp (bit 12 of the fp32 mantissa)
    h = _random_bits(gen, n, torch.float16).float()
    h = torch.where(torch.isfinite(h) & (h.abs() >= torch.finfo(torch.float16).tiny), h, 1.0)
    return (h.view(torch.int32) + 0x1000).view(torch.float32)


@settings(max_examples=30, **HYPOTHESIS)
@given(shape=st.sampled_from(SHAPES + MULTI_BLOCK_SHAPES),
       pair=st.sampled_from([(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                             (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                             (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                             (torch.float32, torch.float32), (torch.bfloat16, torch.float16)]),
       halfway=st.booleans(), check=st.booleans(), seed=st.integers(0, 2 ** 31 - 1))
def test_cast_copy_rounds_like_torch(shape, pair, halfway, check, seed):
    """scale=None is the master -> model copy: bit for bit torch's ``.to(dtype)``,
    round-to-nearest-even included (emulated for bf16 under the interpreter)."""
    src_dtype, dst_dtype = pair
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if halfway and src_dtype == torch.float32 and dst_dtype != torch.float32:
        x = _halfway_fp32(gen, n, dst_dtype)
    else:
        x = _random_bits(gen, n, src_dtype)  # every bit pattern: NaN, inf, subnormals
    x = x.reshape(shape).to(DEVICE)
    original = x.clone()
    dst = torch.zeros(shape, dtype=dst_dtype, device=DEVICE)
    dst_ref = dst.clone()
    f_ours, f_ref = (found(), found()) if check else (None, None)

    check_unscale([x], None, f_ours, dsts=[dst])
    check_unscale_ref([x], None, f_ref, dsts=[dst_ref])

    assert_bitwise(x, original, "source")
    assert_bitwise(dst, x.to(dst_dtype), f"{src_dtype} -> {dst_dtype} vs torch .to()")
    assert_bitwise(dst, dst_ref, f"{src_dtype} -> {dst_dtype} vs ref")
    if check:
        assert f_ours.item() == f_ref.item() == float(any_nonfinite([x]))


@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float16])
def test_cast_copy_ties_go_to_even(dst_dtype):
    """Hand-picked ties: the interpreter truncates fp32 -> bf16, torch rounds to even."""
    if dst_dtype == torch.bfloat16:
        # 1 + 2**-8 lies halfway between 1 and 1 + 2**-7 (even: down); 1 + 3 * 2**-8
        # between 1 + 2**-7 and 1 + 2**-6 (even: up); near max it rounds up to inf.
        values = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), -(1 + 3 * 2 ** -8),
                  0x7F7F8000, 0x00008000, 0x80018000]
        expected = [1.0, 1 + 2 ** -6, -1.0, -(1 + 2 ** -6), math.inf, 0.0, -2 * 2 ** -133]
    else:
        values = [1 + 2 ** -11, 1 + 3 * 2 ** -11, 65520.0, -65520.0, 2 ** -25, 3 * 2 ** -25]
        expected = [1.0, 1 + 2 ** -9, math.inf, -math.inf, 0.0, 2 ** -23]
    x = torch.tensor([v if isinstance(v, float) else 0.0 for v in values], dtype=torch.float32)
    for i, v in enumerate(values):  # ints are raw fp32 bit patterns
        if isinstance(v, int):
            x[i:i + 1] = _as_int32(torch.tensor([v])).view(torch.float32)
    x = x.to(DEVICE)
    dst = torch.empty(len(values), dtype=dst_dtype, device=DEVICE)
    check_unscale([x], None, None, dsts=[dst])
    assert_bitwise(dst, torch.tensor(expected, dtype=dst_dtype, device=DEVICE), "ties")
    assert_bitwise(dst, x.to(dst_dtype), "ties vs torch")


@pytest.mark.parametrize("role", ["src", "add"])
@pytest.mark.parametrize("scale", [None, 1.0, 2.0 ** -4])
def test_bf16_subnormals_widen_exactly(scale, role):
    """Every bf16 subnormal (both signs), as a source or as an addend, widened into fp32:
    exact. (Triton's interpreter's own bf16 -> fp32 conversion flushes or mangles them:
    2**-127 became 0.0 and -3 * 2**-133 became -2**-127 before the kernel worked around it.)"""
    patterns = torch.cat([torch.arange(1, 128), torch.arange(1, 128) - 2 ** 15])
    sub = patterns.to(torch.int16).view(torch.bfloat16).to(DEVICE)
    dst = torch.empty(sub.shape, device=DEVICE)
    scale_t = None if scale is None else scale_tensor(scale)
    inv = found(1.0) if scale is None else inv_of(scale_t)
    if role == "src":
        check_unscale([sub], scale_t, found(), dsts=[dst])
        expected = sub.float() * inv
    else:
        src = torch.linspace(-1, 1, sub.numel(), device=DEVICE)
        check_unscale([src], scale_t, found(), dsts=[dst], adds=[sub])
        expected = src * inv + sub.float()
    assert_bitwise(dst, expected, f"bf16 subnormal {role}s -> fp32")


# ------------------------------------------------------------------ found_inf semantics

@pytest.mark.parametrize("mode", ["inplace", "dsts", "check_only"])
def test_found_inf_is_only_ever_set(mode):
    srcs = [torch.randn(257, device=DEVICE).half(), torch.randn(3, 257, device=DEVICE)]
    kwargs = {"dsts": [torch.empty(s.shape, device=DEVICE) for s in srcs]} if mode == "dsts" else {}
    if mode == "check_only":
        kwargs["write"] = False
    for start in (1.0, 0.0):  # finite inputs: 1.0 stays 1.0, 0.0 stays 0.0
        f = found(start)
        check_unscale(clones(srcs), scale_tensor(4.0), f, **kwargs)
        assert f.item() == start
    srcs[1][2, 100] = math.nan
    f = found(0.0)
    check_unscale(clones(srcs), scale_tensor(4.0), f, **kwargs)
    assert f.item() == 1.0


def test_overflow_from_unscaling_is_not_an_overflow():
    """found_inf judges the inputs: finite values that overflow when unscaled (scale < 1)
    give inf outputs, as torch's op does, without setting found_inf."""
    x = torch.tensor([torch.finfo(torch.float16).max, 1.0], dtype=torch.float16, device=DEVICE)
    theirs, f_ours, f_torch = x.clone(), found(), found()
    check_unscale([x], scale_tensor(1e-3), f_ours)
    torch_unscale_([theirs], f_torch, inv_of(scale_tensor(1e-3)))
    assert_bitwise(x, theirs, "fp16 max / 1e-3")
    assert math.isinf(x[0].item()) and f_ours.item() == f_torch.item() == 0.0


# ------------------------------------------------------------------------ edge cases

def test_empty_list_is_a_noop(launches):
    f = found(0.0)
    check_unscale([], scale_tensor(2.0), f)
    check_unscale([], scale_tensor(2.0), f, dsts=[], adds=[])
    assert f.item() == 0.0 and launches.grids == []


def test_zero_numel_tensors_are_skipped(launches):
    empties = [torch.empty(0, dtype=torch.float16, device=DEVICE),
               torch.empty(0, 3, device=DEVICE)]
    f = found(0.0)
    check_unscale(empties, scale_tensor(2.0), f)
    assert f.item() == 0.0 and launches.grids == []

    x = torch.tensor([4.0, math.inf, -8.0], device=DEVICE)
    mixed = [empties[0], x, empties[1]]
    check_unscale(mixed, scale_tensor(2.0), f)
    assert f.item() == 1.0 and len(launches.grids) == 1
    assert_bitwise(x, torch.tensor([2.0, math.inf, -4.0], device=DEVICE), "mixed with empties")


def _bad_calls():
    a = torch.randn(5, device=DEVICE)
    b = torch.randn(3, 4, device=DEVICE)
    overlapping = torch.randn(4, 1, device=DEVICE).expand(4, 6)  # expanded: overlaps itself
    return [
        ("dsts has 1 tensors but srcs has 2", dict(srcs=[a, b], dsts=[a.clone()])),
        ("adds has 3 tensors but srcs has 2",
         dict(srcs=[a, b], adds=[a.clone(), b.clone(), b.clone()])),
        (r"srcs\[1\] has shape \(3, 4\) but dsts\[1\] has shape \(12,\)",
         dict(srcs=[a, b], dsts=[a.clone(), torch.zeros(12, device=DEVICE)])),
        (r"srcs\[0\] has shape \(5,\) but adds\[0\] has shape \(6,\)",
         dict(srcs=[a], adds=[torch.zeros(6, device=DEVICE)])),
        (r"srcs\[1\] of shape \(4, 6\) has strides \(1, 0\): it overlaps itself.*"
         r"\.contiguous\(\)", dict(srcs=[a, overlapping])),
        (r"dsts\[0\] of shape \(4, 6\) has strides \(1, 0\): it overlaps itself",
         dict(srcs=[torch.randn(4, 6, device=DEVICE)],
              dsts=[torch.zeros(4, 1, device=DEVICE).expand(4, 6)])),
        (r"srcs\[0\] is int32, expected float32, float16 or bfloat16",
         dict(srcs=[torch.ones(3, dtype=torch.int32, device=DEVICE)],
              dsts=[torch.zeros(3, device=DEVICE)])),
    ]


@pytest.mark.parametrize("case", range(7), ids=[
    "dsts_length", "adds_length", "dst_shape", "add_shape", "inplace_overlapping",
    "dst_overlapping", "src_dtype"])
def test_bad_arguments_raise_before_anything_runs(case, launches):
    """Refused before anything runs: every tensor (sources, destinations, addends) and
    found_inf bitwise as they were."""
    calls = _bad_calls()
    assert len(calls) == 7
    message, kwargs = calls[case]
    if kwargs["srcs"][0].is_floating_point():
        kwargs["srcs"][0].view(-1)[0] = math.inf  # would set found_inf if anything ran
    everything = [t for k in ("srcs", "dsts", "adds") for t in kwargs.get(k) or []]
    before = clones(everything)
    f = found(0.0)
    error = TypeError if case == 6 else ValueError
    with pytest.raises(error, match=message):
        check_unscale(scale=scale_tensor(2.0), found_inf=f, **kwargs)
    with pytest.raises(error, match=message):
        cu_mod.check_unscale_prepare(kwargs["srcs"], dsts=kwargs.get("dsts"),
                                     adds=kwargs.get("adds"))
    assert f.item() == 0.0 and launches.grids == []
    for t, o in zip(everything, before):
        if t.is_floating_point():
            assert_bitwise(t, o, "tensor after a refused call")
        else:
            assert torch.equal(t, o)


def test_wrong_shape_partner_leaves_every_tensor_and_found_inf_unchanged(launches):
    """A wrong-shape partner in the last row: nothing is written anywhere, not even in
    the rows before it (or found_inf, already set)."""
    gen = torch.Generator().manual_seed(4)
    srcs = [(torch.randn(257, generator=gen) * 100).half().to(DEVICE),
            torch.randn(3, 4, generator=gen).to(DEVICE),
            torch.randn(2, 5, generator=gen).t().to(DEVICE)]     # column-major
    srcs[0][7] = math.nan
    dsts = [torch.full((257,), 3.0, device=DEVICE), torch.full((3, 4), 3.0, device=DEVICE),
            torch.full((10,), 3.0, device=DEVICE)]                # should be (5, 2)
    adds = [torch.ones(257, device=DEVICE), torch.ones(3, 4, device=DEVICE).half(),
            torch.ones(5, 2, device=DEVICE)]
    everything = srcs + dsts + adds
    before = clones(everything)
    for start in (0.0, 0.5):
        f = found(start)
        with pytest.raises(ValueError, match=r"srcs\[2\] has shape \(5, 2\) but dsts\[2\]"):
            check_unscale(srcs, scale_tensor(4.0), f, dsts=dsts, adds=adds)
        with pytest.raises(ValueError, match=r"srcs\[2\] has shape \(5, 2\) but dsts\[2\]"):
            check_unscale(srcs, scale_tensor(4.0), f, dsts=dsts, write=False)
        assert_bitwise(f, found(start), "found_inf after a refused call")
    for i, (t, o) in enumerate(zip(everything, before)):
        assert_bitwise(t, o, f"tensor {i} after a refused call")
    assert launches.grids == []


# ------------------------------------------------------------------------- layouts

def _layout_variants(x):
    """``x`` (2-d) as contiguous, column-major and expanded (the values of x[0] in every
    row) tensors; the expected values of each as a contiguous tensor."""
    cm = x.t().contiguous().t()
    assert not cm.is_contiguous() and torch.equal(cm, x)
    expanded = x[:1].expand(x.shape)
    assert expanded.stride()[0] == 0
    return {"contiguous": (x, x), "column_major": (cm, x),
            "expanded": (expanded, expanded.contiguous())}


@pytest.mark.parametrize("layout", ["column_major", "expanded"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_in_other_layouts_check_and_unscale_like_contiguous(layout, dtype):
    """Column-major and expanded gradients: the check (write=False), the unscale into
    fp32 masters (with and without an addend) and the cast copy equal the contiguous
    case bit for bit; the gradients stay untouched."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 700, generator=gen) * 1000).to(dtype).to(DEVICE)
    for special in (False, True):
        if special:
            x[0, 3] = math.inf  # row 0: in every row of the expanded tensor too
        g, dense = _layout_variants(x)[layout]
        g_before = g.clone()
        scale_t = scale_tensor(3.0)
        f, f_dense = found(), found()
        check_unscale([g], scale_t, f, write=False)
        check_unscale([dense.clone()], scale_t, f_dense, write=False)
        assert f.item() == f_dense.item() == float(special)
        for adds in (None, [torch.randn(6, 700, generator=gen).to(DEVICE)]):
            out = torch.full((6, 700), 9.0, device=DEVICE)
            out_dense = out.clone()
            f, f_dense = found(), found()
            check_unscale([g], scale_t, f, dsts=[out], adds=adds)
            check_unscale([dense], scale_t, f_dense, dsts=[out_dense], adds=adds)
            assert_bitwise(out, out_dense, f"{layout} {dtype} -> fp32, adds={adds is not None}")
            assert f.item() == f_dense.item() == float(special)
        half = torch.empty(6, 700, dtype=torch.float16, device=DEVICE)
        half_dense = half.clone()
        check_unscale([g], None, None, dsts=[half])
        check_unscale([dense], None, None, dsts=[half_dense])
        assert_bitwise(half, half_dense, f"{layout} {dtype} cast copy")
        assert_bitwise(g, g_before, "the gradient itself")


@pytest.mark.parametrize("dtype", DTYPES)
def test_column_major_in_place_unscale_like_contiguous(dtype):
    """In place, a column-major (dense) gradient is its own anchor: swept as it lies."""
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(9, 500, generator=gen) * 1000).to(dtype).to(DEVICE)
    cm, _ = _layout_variants(x)["column_major"]
    contiguous = x.clone()
    cm[8, 499] = contiguous[8, 499] = math.nan
    f, f_c = found(), found()
    check_unscale([cm], scale_tensor(2.0 ** 10), f)
    check_unscale([contiguous], scale_tensor(2.0 ** 10), f_c)
    assert cm.stride() == (1, 9)
    assert_bitwise(cm, contiguous, "column-major in place")
    assert f.item() == f_c.item() == 1.0


def test_in_place_unscale_of_a_strided_view_is_copied_back():
    """A strided view (not dense, no overlap) unscaled in place goes through a dense copy
    and the result is copied back; the elements between its own stay untouched."""
    buf = (torch.randn(6, 40, generator=torch.Generator().manual_seed(8)) * 64).to(DEVICE)
    before = buf.clone()
    view = buf[:, 1::3]
    f = found()
    check_unscale([view], scale_tensor(4.0), f)
    expected = before.clone()
    check_unscale_ref([expected[:, 1::3]], scale_tensor(4.0), found())
    assert_bitwise(buf, expected, "buffer after an in-place unscale of a strided view")
    assert f.item() == 0.0
    # accumulate in place into it (the addend is the view itself, read before it is written)
    check_unscale([view], None, None, dsts=[view], adds=[view])
    expected[:, 1::3] *= 2
    assert_bitwise(buf, expected, "buffer after view += view")


def test_channels_last_destination_with_a_contiguous_source():
    """The destination is the anchor: a contiguous half gradient is read through a dense
    copy in the channels-last master gradient's layout."""
    gen = torch.Generator().manual_seed(9)
    g = (torch.randn(4, 3, 5, 5, generator=gen) * 512).half().to(DEVICE)
    g[1, 2, 3, 4] = math.inf
    dst = torch.full((4, 3, 5, 5), 7.0, device=DEVICE).to(memory_format=torch.channels_last)
    add = torch.randn(4, 3, 5, 5, generator=gen).to(DEVICE)          # contiguous too
    expected = torch.empty(4, 3, 5, 5, device=DEVICE)
    f, f_ref = found(), found()
    check_unscale([g], scale_tensor(512.0), f, dsts=[dst], adds=[add])
    check_unscale_ref([g], scale_tensor(512.0), f_ref, dsts=[expected], adds=[add])
    assert dst.is_contiguous(memory_format=torch.channels_last)
    assert_bitwise(dst, expected, "channels-last destination")
    assert f.item() == f_ref.item() == 1.0
    # and the other way round: a channels-last source into a contiguous destination
    out = torch.empty(4, 3, 5, 5, device=DEVICE)
    check_unscale([dst], None, None, dsts=[out])
    assert_bitwise(out, expected, "channels-last source, contiguous destination")


@pytest.mark.parametrize("dtype", DTYPES)
def test_aligned_and_unaligned_groups_agree(dtype):
    """The vectorised path (every address 16-byte aligned, every numel a multiple of the
    vector width: VEC > 1) and the masked path (VEC = 1: the same values one element
    into their buffers) give the same results bit for bit, in place, into fp32
    destinations and check-only."""
    gen = torch.Generator().manual_seed(10)
    numels = (8, 4096, 64, 4104)
    srcs = [(torch.randn(n, generator=gen) * 100).to(dtype).to(DEVICE) for n in numels]
    srcs[3][4100] = math.inf

    def shifted(t):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=DEVICE)
        buf[1:].copy_(t)
        return buf[1:]

    vec = 16 // torch.empty(0, dtype=dtype).element_size()
    scale_t = scale_tensor(3.0)
    results = []
    for move in (lambda t: t.clone(), shifted):
        ins = [move(s) for s in srcs]
        outs = [move(torch.zeros(n, device=DEVICE)) for n in numels]
        adds = [move(torch.randn(n, generator=torch.Generator().manual_seed(n)).to(DEVICE))
                for n in numels]
        preps = [cu_mod.check_unscale_prepare(ins, write=False),
                 cu_mod.check_unscale_prepare(ins, dsts=outs, adds=adds),
                 cu_mod.check_unscale_prepare(ins)]
        # the narrowest dtype of a group sets its vector width (fp16 -> fp32: 8)
        expected_vec = [vec] * 3 if move is not shifted else [1] * 3
        assert [[g.constexprs["VEC"] for g in p.prepared.groups] for p in preps] == \
            [[v] for v in expected_vec]
        flags = [found(), found(), found()]
        for p, f in zip(preps, flags):
            cu_mod.check_unscale_launch(p, scale=scale_t, found_inf=f)
        results.append((ins, outs, [f.item() for f in flags]))
    (ins_a, outs_a, flags_a), (ins_u, outs_u, flags_u) = results
    for i in range(len(numels)):
        assert_bitwise(outs_a[i], outs_u[i], f"dst {i}, aligned vs unaligned")
        assert_bitwise(ins_a[i], ins_u[i], f"in place {i}, aligned vs unaligned")
    assert flags_a == flags_u == [1.0, 1.0, 1.0]


def test_contiguous_views_with_an_offset():
    """Tensors that start inside a larger storage (offset data pointers)."""
    buf = torch.randn(6000, device=DEVICE)
    views = [buf[3:260], buf[1000:5100], buf[5999:]]
    expected = clones(views)
    torch_unscale_(expected, found(), inv_of(scale_tensor(3.0)))
    untouched = [buf[:3].clone(), buf[260:1000].clone(), buf[5100:5999].clone()]
    check_unscale(views, scale_tensor(3.0), found())
    for i, (v, e) in enumerate(zip(views, expected)):
        assert_bitwise(v, e, f"view {i}")
    for i, (r, u) in enumerate(zip((buf[:3], buf[260:1000], buf[5100:5999]), untouched)):
        assert_bitwise(r, u, f"gap {i} between views")


# --------------------------------------------------------------- plans and launches

def test_prepared_sweep_is_reused_and_reads_current_values(launches):
    """A prepared sweep launches again without rebuilding anything (same tables), and a
    source read through a dense copy (column-major against a contiguous destination) is
    copied again at every launch: the second launch sees the new values."""
    gen = torch.Generator().manual_seed(0)
    srcs = [torch.randn(257, generator=gen).half().to(DEVICE),
            torch.randn(40, 25, generator=gen).t().to(DEVICE),      # column-major
            (torch.randn(4097, generator=gen) * 100).half().to(DEVICE)]
    dsts = [torch.empty(s.shape, device=DEVICE) for s in srcs]
    prepared = cu_mod.check_unscale_prepare(srcs, dsts=dsts)
    tables = [(g.meta, g.blocks) for g in prepared.prepared.groups]
    assert len(tables) == 2  # one per dtype group
    scale_t = scale_tensor(3.0)
    for step in range(3):
        for s in srcs:
            s.mul_(-2.0)
        f = found()
        cu_mod.check_unscale_launch(prepared, scale=scale_t, found_inf=f)
        expected = [torch.empty_like(d) for d in dsts]
        check_unscale_ref(srcs, scale_t, found(), dsts=expected)
        for i, (d, e) in enumerate(zip(dsts, expected)):
            assert_bitwise(d, e, f"dst {i}, launch {step}")
        assert f.item() == 0.0
    assert [(g.meta, g.blocks) for g in prepared.prepared.groups] == tables
    assert len(launches.grids) == 3 * 2


def test_same_address_new_size_gets_a_new_plan():
    """A cached plan must not be reused for a tensor that starts at the same address
    but has a different size."""
    buf = torch.randn(9000, device=DEVICE)
    expected = buf.clone()
    check_unscale([buf[:100]], scale_tensor(2.0), found())
    check_unscale([buf[:8200]], scale_tensor(4.0), found())
    check_unscale_ref([expected[:100]], scale_tensor(2.0), found())
    check_unscale_ref([expected[:8200]], scale_tensor(4.0), found())
    assert_bitwise(buf, expected, "buffer after two sizes at one address")


@pytest.mark.parametrize("src_dtypes, dst_dtypes, n_launches", [
    ((torch.float16, torch.bfloat16, torch.float32, torch.float16, torch.bfloat16, torch.float32,
      torch.float16), None, 3),
    ((torch.float16, torch.bfloat16, torch.float16, torch.bfloat16), (torch.float32,) * 4, 2),
    ((torch.float16, torch.float16, torch.float16), (torch.float32, torch.float16, torch.float32), 2),
    ((torch.float32,) * 5, None, 1),
])
def test_one_launch_per_dtype_group(src_dtypes, dst_dtypes, n_launches, launches):
    sizes = (257, 1000, 7, 4097, 1, 771, 2)
    gen = torch.Generator().manual_seed(1)
    srcs = [torch.randn(sizes[i], generator=gen).to(dt).to(DEVICE) for i, dt in enumerate(src_dtypes)]
    dsts = None if dst_dtypes is None else [torch.empty(s.shape, dtype=dt, device=DEVICE)
                                            for s, dt in zip(srcs, dst_dtypes)]
    ref_srcs = clones(srcs)
    ref_dsts = None if dsts is None else clones(dsts)
    f, f_ref = found(), found()

    check_unscale(srcs, scale_tensor(8.0), f, dsts=dsts)
    check_unscale_ref(ref_srcs, scale_tensor(8.0), f_ref, dsts=ref_dsts)

    assert len(launches.grids) == n_launches
    block, _ = K.elementwise_settings(DEVICE)
    groups = {}
    for i, s in enumerate(srcs):
        key = (s.dtype, None if dsts is None else dsts[i].dtype)
        groups[key] = groups.get(key, 0) + -(-s.numel() // block)
    assert sorted(g[0] for g in launches.grids) == sorted(groups.values())
    for i, (a, r) in enumerate(zip(dsts or srcs, ref_dsts or ref_srcs)):
        assert_bitwise(a, r, f"tensor {i}")
    assert f.item() == f_ref.item() == 0.0


# ------------------------------------------------------------------------ dispatcher

def test_cpu_without_interpreter_runs_the_production_path(monkeypatch, launches):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.tensor([2.0, -6.0, math.inf, 1.5])
    assert not K.use_triton(x)
    calls = []
    real = cu_mod.check_unscale_cpu

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(cu_mod, "check_unscale_cpu", spy)
    monkeypatch.setattr(cu_mod, "check_unscale_ref",
                        lambda *a, **k: pytest.fail("the reference ran on the CPU path"))
    f = torch.zeros(())
    check_unscale([x], torch.tensor(2.0), f)
    assert len(calls) == 1 and launches.grids == []
    assert_bitwise(x, torch.tensor([1.0, -3.0, math.inf, 0.75]), "CPU path")
    assert f.item() == 1.0


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the reference path runs CPU tensors")
def test_reference_path_validates_and_handles_layouts_the_same(monkeypatch, launches):
    """Without the interpreter the production CPU path runs, after the same validation: the
    overlapping in-place unscale is refused there too; other layouts give the kernel's
    results."""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(5, 40, generator=gen) * 100).half()
    cm = x.t().contiguous().t()
    expanded = x[:1].expand(5, 40)
    kernel_out = [torch.empty(5, 40) for _ in range(2)]
    f_kernel = found()
    check_unscale([cm, expanded], scale_tensor(3.0), f_kernel, dsts=kernel_out)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not K.use_triton(x)
    ref_out = [torch.empty(5, 40) for _ in range(2)]
    f_ref = found()
    check_unscale([cm, expanded], scale_tensor(3.0), f_ref, dsts=ref_out)
    for i, (k, r) in enumerate(zip(kernel_out, ref_out)):
        assert_bitwise(k, r, f"dst {i}: kernel vs reference path")
    assert f_kernel.item() == f_ref.item() == 0.0
    before = expanded.clone()
    with pytest.raises(ValueError, match=r"srcs\[0\] of shape \(5, 40\) has strides \(0, 1\)"):
        check_unscale([expanded], scale_tensor(3.0), f_ref)
    assert_bitwise(expanded, before, "expanded gradient after a refused call")
    assert len(launches.grids) == 1  # the kernel-path call only


def test_kernel_path_does_not_call_the_reference(monkeypatch, launches):
    assert K.use_triton(torch.empty(1, device=DEVICE))
    monkeypatch.setattr(cu_mod, "check_unscale_ref",
                        lambda *a, **k: pytest.fail("the reference ran instead of the kernel"))
    x = torch.tensor([2.0, -6.0], device=DEVICE)
    check_unscale([x], scale_tensor(2.0), found())
    assert len(launches.grids) == 1
    assert_bitwise(x, torch.tensor([1.0, -3.0], device=DEVICE), "kernel path")


def test_interpreter_flag_decides_for_cpu_tensors(monkeypatch):
    x = torch.empty(1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert K.interpreter_on() and K.use_triton(x)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not K.interpreter_on() and not K.use_triton(x)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not K.use_triton(x)
    if torch.cuda.is_available():
        assert K.use_triton(torch.empty(1, device="cuda"))
