"""LayerNorm / RMSNorm kernels (forward and backward) against torch and an fp64 reference.

Half-precision results obey the rounding rule of STYLE.md: the error against an fp64
reference computed from the same inputs is at most twice torch's own error in that dtype,
plus a small atol. fp32 results match torch within the fp32 tolerance.
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritamp.kernels.layer_norm import (layer_norm_bwd, layer_norm_bwd_ref, layer_norm_fwd,
                                        layer_norm_fwd_ref)

HALF = (torch.float16, torch.bfloat16)
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _torch_norm(x, n_shape, w, b, eps, rms):
    if rms:
        return F.rms_norm(x, n_shape, w, eps)
    return F.layer_norm(x, n_shape, w, b, eps)


def _torch_grads(x, w, b, dy, eps, rms, n_shape):
    """Output and gradients of torch's own op, in the dtype of the inputs."""
    xs = x.detach().clone().requires_grad_()
    ws = w.detach().clone().requires_grad_() if w is not None else None
    bs = b.detach().clone().requires_grad_() if b is not None else None
    y = _torch_norm(xs, n_shape, ws, bs, eps, rms)
    y.backward(dy.to(y.dtype))
    return y.detach(), xs.grad, (ws.grad if ws is not None else None), (bs.grad if bs is not None else None)


def _ours(x, w, b, dy, eps, rms, n, memory_efficient=False, max_block=None):
    y, mean, rstd = layer_norm_fwd(x, n, w, b, eps, rms, max_block=max_block)
    saved = y if memory_efficient else x
    dx, dw, db = layer_norm_bwd(dy, saved, n, w, b, mean, rstd, rms, from_output=memory_efficient,
                                x_dtype=x.dtype, max_block=max_block)
    return y, dx, dw, db


def _check_rule(ours, theirs, ref64, dtype, name):
    """Error of ``ours`` against fp64 at most 2x torch's error in the same dtype (+atol)."""
    err = (ours.double() - ref64).abs().max().item()
    torch_err = (theirs.double() - ref64).abs().max().item()
    assert err <= 2 * torch_err + ATOL[dtype], f"{name}: error {err} vs torch's {torch_err}"


def _params(n, affine, rms, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    if not affine:
        return None, None
    w = (1 + 0.5 * torch.randn(n, generator=g)).to(dtype)
    b = None if rms else (0.5 * torch.randn(n, generator=g)).to(dtype)
    return w, b


CASES = [(1, 1), (3, 7), (5, 200), (2, 1000)]


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("rows,n", CASES)
def test_fp32_matches_torch(rows, n, affine, rms):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, n, generator=g) * 2 + 0.5
    dy = torch.randn(rows, n, generator=g)
    w, b = _params(n, affine, rms)
    y, dx, dw, db = _ours(x, w, b, dy, 1e-5, rms, n)
    ty, tdx, tdw, tdb = _torch_grads(x, w, b, dy, 1e-5, rms, (n,))
    torch.testing.assert_close(y, ty, rtol=1e-5, atol=1e-5)
    # Gradients: against fp64 with the rounding rule (at width 1 torch's own dx is off by
    # rounding noise times rstd = 1/sqrt(eps), where the exact answer is 0).
    d64 = lambda t: None if t is None else t.double()  # noqa: E731
    _, rdx, rdw, rdb = _torch_grads(x.double(), d64(w), d64(b), dy.double(), 1e-5, rms, (n,))
    _check_rule(dx, tdx, rdx, torch.float32, "dx")
    if affine:
        _check_rule(dw, tdw, rdw, torch.float32, "dweight")
        if not rms:
            _check_rule(db, tdb, rdb, torch.float32, "dbias")
    else:
        assert dw is None and db is None


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("rows,n", [(4, 33), (6, 300)])
def test_half_rounding_rule(rows, n, rms, dtype):
    g = torch.Generator().manual_seed(7 + n)
    x = (torch.randn(rows, n, generator=g) * 3 + 1).to(dtype)
    dy = torch.randn(rows, n, generator=g).to(dtype)
    w, b = _params(n, True, rms, dtype)
    y, dx, dw, db = _ours(x, w, b, dy, 1e-5, rms, n)
    assert y.dtype == dx.dtype == dw.dtype == dtype
    ty, tdx, tdw, tdb = _torch_grads(x, w, b, dy, 1e-5, rms, (n,))
    ry, rdx, rdw, rdb = _torch_grads(x.double(), w.double(), None if b is None else b.double(),
                                     dy.double(), 1e-5, rms, (n,))
    _check_rule(y, ty, ry, dtype, "y")
    _check_rule(dx, tdx, rdx, dtype, "dx")
    _check_rule(dw, tdw, rdw, dtype, "dweight")
    if not rms:
        _check_rule(db, tdb, rdb, dtype, "dbias")


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_rows_match_one_pass(dtype, rms):
    """Rows wider than one block (forced with max_block) give what the one-pass path gives."""
    g = torch.Generator().manual_seed(3)
    n = 150  # not a power of two, three chunks of 64
    x = (torch.randn(5, n, generator=g) * 4 - 2).to(dtype)
    dy = torch.randn(5, n, generator=g).to(dtype)
    w, b = _params(n, True, rms, dtype)
    one = _ours(x, w, b, dy, 1e-5, rms, n)
    chunked = _ours(x, w, b, dy, 1e-5, rms, n, max_block=64)
    for a, c in zip(one, chunked):
        if a is None:
            assert c is None
            continue
        torch.testing.assert_close(c.float(), a.float(), rtol=2e-6, atol=2e-6)
    # ... and both agree with torch
    ty, tdx, _, _ = _torch_grads(x, w, b, dy, 1e-5, rms, (n,))
    if dtype == torch.float32:
        torch.testing.assert_close(chunked[0], ty, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(chunked[1], tdx, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("max_block", [None, 64], ids=["one-pass", "chunked"])
def test_memory_efficient_recomputes_from_output(max_block, dtype, rms):
    g = torch.Generator().manual_seed(11)
    n = 96
    x = (torch.randn(6, n, generator=g) * 2).to(dtype)
    dy = torch.randn(6, n, generator=g).to(dtype)
    w, b = _params(n, True, rms, dtype)
    y, dx, dw, db = _ours(x, w, b, dy, 1e-5, rms, n, memory_efficient=True, max_block=max_block)
    _, tdx, tdw, tdb = _torch_grads(x, w, b, dy, 1e-5, rms, (n,))
    ry, rdx, rdw, rdb = _torch_grads(x.double(), w.double(), None if b is None else b.double(),
                                     dy.double(), 1e-5, rms, (n,))
    if dtype == torch.float32:
        tol = dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(dx, tdx, **tol)
        torch.testing.assert_close(dw, tdw, **tol)
        if not rms:
            torch.testing.assert_close(db, tdb, **tol)
    else:
        # xhat is rebuilt from the rounded output: one more rounding than the input path,
        # so the error may be a bf16 ulp of |xhat| times |w dy| larger than torch's.
        for ours, theirs, ref in ((dx, tdx, rdx), (dw, tdw, rdw)):
            err = (ours.double() - ref).abs().max().item()
            torch_err = (theirs.double() - ref).abs().max().item()
            scale = ref.abs().max().item()
            assert err <= 2 * torch_err + 2 ** -7 * scale, (err, torch_err, scale)


def test_half_input_fp32_weight_and_output_dtype():
    """A half input with fp32 parameters (Apex O1's failure) and an fp32 output."""
    g = torch.Generator().manual_seed(5)
    n = 64
    x = torch.randn(8, n, generator=g).half()
    w, b = _params(n, True, False)
    dy = torch.randn(8, n, generator=g)
    y, mean, rstd = layer_norm_fwd(x, n, w, b, 1e-5, False, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and mean.dtype == rstd.dtype == torch.float32
    dx, dw, db = layer_norm_bwd(dy, x, n, w, b, mean, rstd, False)
    assert dx.dtype == torch.float16 and dw.dtype == db.dtype == torch.float32
    ty, tdx, tdw, tdb = _torch_grads(x.float(), w, b, dy, 1e-5, False, (n,))
    torch.testing.assert_close(y, ty, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, tdx.half(), rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(dw, tdw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db, tdb, rtol=1e-5, atol=1e-5)


def test_non_contiguous_and_strided_rows():
    g = torch.Generator().manual_seed(9)
    base = torch.randn(40, 12, generator=g)
    w, b = _params(40, True, False)
    for x in (base.t(), torch.randn(6, 70, generator=g)[:, 5:45]):
        n = x.shape[-1]
        assert not x.is_contiguous()
        dy = torch.randn(x.shape, generator=g)
        y, dx, dw, db = _ours(x, w, b, dy, 1e-5, False, n)
        ty, tdx, tdw, tdb = _torch_grads(x, w, b, dy, 1e-5, False, (n,))
        torch.testing.assert_close(y, ty, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx, tdx, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dw, tdw, rtol=1e-5, atol=1e-5)


def test_large_mean_keeps_precision():
    """Centring before squaring: a row with mean 1e4 and spread 1 keeps its variance."""
    g = torch.Generator().manual_seed(2)
    x = 1e4 + torch.randn(4, 256, generator=g)
    y, mean, rstd = layer_norm_fwd(x, 256, None, None, 1e-5, False)
    ref = F.layer_norm(x.double(), (256,), eps=1e-5)
    assert (y.double() - ref).abs().max().item() < 2e-3
    var64 = x.double().var(dim=1, unbiased=False)
    torch.testing.assert_close(rstd.double(), (var64 + 1e-5).rsqrt(), rtol=1e-3, atol=0)


def test_empty_rows():
    x = torch.empty(0, 16)
    w, b = _params(16, True, False)
    y, mean, rstd = layer_norm_fwd(x, 16, w, b)
    assert y.shape == (0, 16) and rstd.shape == (0,)
    dx, dw, db = layer_norm_bwd(torch.empty(0, 16), x, 16, w, b, mean, rstd)
    assert dx.shape == (0, 16)
    assert torch.equal(dw, torch.zeros(16)) and torch.equal(db, torch.zeros(16))


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="whole rows"):
        layer_norm_fwd(torch.randn(3, 5), 4)
    with pytest.raises(ValueError, match="weight has 3 elements"):
        layer_norm_fwd(torch.randn(3, 4), 4, torch.ones(3))


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_ref_matches_kernel(rms):
    """The torch reference (CPU without the interpreter) computes what the kernel does."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 50, generator=g).bfloat16()
    dy = torch.randn(7, 50, generator=g).bfloat16()
    w, b = _params(50, True, rms)
    y, m, r = layer_norm_fwd(x, 50, w, b, 1e-5, rms)
    yr, mr, rr = layer_norm_fwd_ref(x, 50, w, b, 1e-5, rms)
    torch.testing.assert_close(y.float(), yr.float(), rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(r, rr, rtol=1e-6, atol=0)
    got = layer_norm_bwd(dy, x, 50, w, b, m, r, rms)
    want = layer_norm_bwd_ref(dy, x, 50, w, b, mr, rr, rms)
    for a, c in zip(got, want):
        if a is not None:
            torch.testing.assert_close(a.float(), c.float(), rtol=1.6e-2, atol=1e-4)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 6), n=st.integers(1, 130), rms=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       special=st.sampled_from(["none", "inf", "nan", "big", "tiny"]))
def test_hypothesis_shapes_and_values(rows, n, rms, dtype, special):
    """Against an fp64 reference (torch's own fp32 op returns NaN for a single value of
    1e30, where the centred variance gives the right answer)."""
    g = torch.Generator().manual_seed(rows * 131 + n)
    x = torch.randn(rows, n, generator=g)
    if special == "big":
        # the largest values whose squares still sum without overflow in fp32 (1e18) or,
        # for half inputs, the top of fp16's range
        x = x * (6e4 if dtype == torch.float16 else 1e18) / x.abs().max().clamp_min(1)
    elif special == "tiny":
        x = x * 1e-6
    x = x.to(dtype)
    if special in ("inf", "nan"):
        x[0, n // 2] = float(special)
    w, b = _params(n, True, rms, torch.float32)
    y, _, _ = layer_norm_fwd(x, n, w, b, 1e-5, rms)
    ref = _torch_norm(x.double(), (n,), w.double(), None if b is None else b.double(), 1e-5, rms)
    # Non-finite rows stay non-finite in the same places as the reference's; the others match.
    fin = torch.isfinite(ref).all(1)
    assert torch.equal(torch.isfinite(y.float()).all(1), fin)
    if fin.any():
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
        torch.testing.assert_close(y[fin].double(), ref[fin].to(dtype).double(), **tol)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["from-input", "from-output"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("chunked", [False, True], ids=["one-pass", "chunked"])
def test_weight_gradients_through_a_split_reduction(chunked, rms, memory_efficient,
                                                    monkeypatch):
    """The GPU's reduction shape, here in the interpreter: the partial rows of 11 rows x
    4 programs summed in a main pass over column blocks x uneven row splits, then a final
    pass; the chunked backward's per-chunk partial sums (several rows per program). The
    weight and bias gradients are the oracle's."""
    import tritamp.kernels.layer_norm as LN
    seen = []

    def splits(programs, n, device):
        seen.append(programs)
        return 2, 64, 3, 2  # BLOCK_G 2, BLOCK_N 64, 3 splits of 2, 2 and 0..: uneven
    monkeypatch.setattr(LN, "reduce_splits", splits)
    g = torch.Generator().manual_seed(7)
    n, m = 150, 11
    x = torch.randn(m, n, generator=g) * 3 + 1
    dy = torch.randn(m, n, generator=g)
    w, b = _params(n, True, rms)
    y, mean, rstd = layer_norm_fwd(x, n, w, b, 1e-5, rms, max_block=64 if chunked else None)
    saved = y if memory_efficient else x
    dx, dw, db = layer_norm_bwd(dy, saved, n, w, b, mean, rstd, rms,
                                from_output=memory_efficient, x_dtype=x.dtype,
                                max_block=64 if chunked else None)
    assert seen == [4]
    rdx, rdw, rdb = layer_norm_bwd_ref(dy, saved, n, w, b, mean, rstd, rms,
                                       from_output=memory_efficient, x_dtype=x.dtype)
    torch.testing.assert_close(dx, rdx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, rdw, rtol=1e-5, atol=1e-5)
    if rms:
        assert db is None
    else:
        torch.testing.assert_close(db, rdb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_block", [None, 64], ids=["one-pass", "chunked"])
@pytest.mark.parametrize("eps", [1e-12, 1e-5])
def test_constant_and_near_constant_fp32_rows(max_block, eps):
    # The mean as sum / n was a few ulps off a constant row's value: x - mean was noise,
    # which rstd near 1 / sqrt(eps) scaled to O(1) (1000.1 with eps=1e-12 gave outputs of
    # +-1 where the bias is exact). The refined mean is the row's value.
    n = 300
    w, b = _params(n, True, False)
    x = torch.tensor([1000.1, 0.1, -3.0e4, 7.0]).repeat_interleave(n).view(4, n)
    y, mean, rstd = layer_norm_fwd(x, n, w, b, eps, False, max_block=max_block)
    assert torch.equal(mean, x[:, 0])
    assert torch.equal(y, b.expand(4, n))
    # one element off the constant: the fp64 result within fp32's rounding
    x[:, 5] += torch.tensor([0.01, 1e-6, 0.5, 1e-3])
    y, _, _ = layer_norm_fwd(x, n, w, b, eps, False, max_block=max_block)
    truth = F.layer_norm(x.double(), (n,), w.double(), b.double(), eps)
    torch.testing.assert_close(y.double(), truth, rtol=1e-5, atol=2e-5)


def test_memory_efficient_backward_of_a_zero_weight_column_against_the_oracle(path):
    # half input, fp32 parameters: the saved bf16 output of a zero-weight column is the
    # bias rounded; the kernels, the CPU path and the oracle all take y - bias as 0 there
    # (its weight gradient 0, as documented), and every other column matches the oracle
    g = torch.Generator().manual_seed(3)
    n = 48
    x = torch.randn(6, n, generator=g).to(torch.bfloat16)
    w = 1 + 0.3 * torch.randn(n, generator=g)
    w[[5, 17]] = 0.0
    b = torch.randn(n, generator=g)
    dy = torch.randn(6, n, generator=g).to(torch.bfloat16)
    y, mean, rstd = layer_norm_fwd(x, n, w, b, 1e-5)
    assert (y[:, 5].float() != b[5]).all()  # (the rounded bias, not the bias)
    got = layer_norm_bwd(dy, y, n, w, b, None, rstd, from_output=True, x_dtype=x.dtype)
    want = layer_norm_bwd_ref(dy, y, n, w, b, None, rstd, from_output=True, x_dtype=x.dtype)
    assert got[1][5] == 0 and got[1][17] == 0 and want[1][5] == 0
    for a, r in zip(got, want):
        torch.testing.assert_close(a.float(), r.float(), rtol=1e-2, atol=1e-2)
