"""SyncBatchNorm kernels (tritamp.kernels.syncbn) against float64 and their torch refs.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py), where a
program costs ~30 us whatever its size, so the tiles are large there (16384 elements) and
a reduction spreads over 4 programs per channel block: the shapes below are picked to
give several chunks per channel block, several tiles per chunk, ragged last tiles and
channel blocks, in both canonical views ([M, C] channels last, [N, C, B] channels first).
"""
import pytest
import torch

from conftest import TOL
from tritamp.kernels import syncbn as K

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (shape of the canonical view): [M, C] or [N, C, B]
VIEWS = [
    (2, 1),            # two values, one channel
    (7, 3),            # one small tile
    (20000, 3),        # 5 tiles of 4096 rows -> 3 chunks of 2 tiles (interpreter geometry)
    (37, 300),         # two channel blocks of 256, ragged
    (3, 5, 7),         # channels first, tiny planes
    (6, 3, 1000),      # 6 tiles of one plane each -> 3 chunks
    (2, 2, 17000),     # planes wider than a tile: 2 tiles per plane, ragged
]


def _x(shape, dtype, mean=0.0, std=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    offset = torch.linspace(-2.0, 3.0, c).view([1, c] + [1] * (len(shape) - 2))
    x = torch.randn(shape, generator=g) * std + mean + offset
    return x.to(dtype).to(DEVICE)


def _dims(x):
    return (0,) if x.dim() == 2 else (0, 2)


def _channels(x):
    return x.shape[1]


def _per_channel(v, x):
    return v.view(1, -1) if x.dim() == 2 else v.view(1, -1, 1)


# (view shape, dtype) for the elementwise and backward tests: ragged channel blocks, several
# chunks, and planes wider than one tile, over the three input dtypes.
CASES = [((37, 300), torch.float32), ((37, 300), torch.bfloat16), ((6, 3, 1000), torch.float32),
         ((6, 3, 1000), torch.float16), ((1, 2, 17000), torch.bfloat16)]


def _case_id(case):
    return f"{case[0]}-{str(case[1]).replace('torch.', '')}"


def _exact_stats(x):
    var, mean = torch.var_mean(x.double(), dim=_dims(x), correction=0)
    return mean, var, x.numel() // _channels(x)


@pytest.mark.parametrize("shape,dtype",
                         [(v, torch.float32) for v in VIEWS] +
                         [(v, d) for v in VIEWS[2::2] for d in (torch.float16, torch.bfloat16)],
                         ids=str)
def test_statistics_match_float64(shape, dtype):
    x = _x(shape, dtype, mean=1.0, std=2.0)
    rows, shift = K.syncbn_stats(x)
    mean, invstd, count = K.syncbn_finalize(rows, 1e-5, shift=shift)
    m64, v64, n = _exact_stats(x)
    assert count.item() == n and mean.dtype == invstd.dtype == torch.float32
    # fp32 accumulation of exactly representable inputs: a few fp32 ulps
    torch.testing.assert_close(mean.double(), m64, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(invstd.double(), (v64 + 1e-5).rsqrt(), rtol=2e-6, atol=0)
    row = K.syncbn_combine(rows, shift)
    c = _channels(x)
    assert row.shape == (2 * c + 1,) and row[2 * c].item() == n
    torch.testing.assert_close(row[:c].double(), m64, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(row[c:2 * c].double() / n, v64, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("shape", [(20000, 3), (6, 3, 1000)], ids=str)
def test_large_mean_keeps_its_digits(shape):
    """mean / std = 1e4: E[x^2] - E[x]^2 in fp32 loses every digit of the variance; the
    shifted, blockwise two-pass statistics and Chan's merge keep fp32 accuracy."""
    x = _x(shape, torch.float32, mean=1e4, std=1.0, seed=1)
    m64, v64, n = _exact_stats(x)
    xf = x.float()
    naive = (xf * xf).mean(_dims(x)) - xf.mean(_dims(x)) ** 2
    assert ((naive.double() - v64).abs() / v64).max() > 1e-2  # the failure being guarded
    rows, shift = K.syncbn_stats(x)
    mean, invstd, _ = K.syncbn_finalize(rows, 0.0, shift=shift)
    torch.testing.assert_close(mean.double(), m64, rtol=2e-7, atol=0)  # ~2 ulps at 1e4
    torch.testing.assert_close(invstd.double(), v64.rsqrt(), rtol=2e-6, atol=0)


@pytest.mark.parametrize("shape", [(150000, 3), (200, 2, 3000)], ids=str)
@pytest.mark.parametrize("data", ["blank first sample", "mean 1e4"])
def test_long_lanes_keep_fp32_accuracy(monkeypatch, shape, data):
    """The GPU geometry (32- or 2048-element runs per lane of a tile), one program per
    channel block: every lane runs Welford's update over hundreds of tiles (293 channels
    last, 400 channels first) before the lanes are merged. A first sample far from the
    rest (blank, the rest at 1e3) and mean / std = 1e4 keep fp32 accuracy."""
    from tritamp.testing import force_gpu_path
    monkeypatch.setattr(K, "_target_programs", lambda device: 1)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(shape, generator=g)
    if data == "blank first sample":
        x = x + 1e3
        x[:7 if x.dim() == 2 else 1] = 0.0
    else:
        x = x + 1e4
    x = x.to(DEVICE)
    m64, v64, n = _exact_stats(x)
    with force_gpu_path():
        rows, shift = K.syncbn_stats(x)
        assert rows.shape[0] == 1  # one program: every tile through the same lanes
        mean, invstd, count = K.syncbn_finalize(rows, 0.0, shift=shift)
    assert count.item() == n
    torch.testing.assert_close(mean.double(), m64, rtol=2e-7, atol=0)
    torch.testing.assert_close(invstd.double(), v64.rsqrt(), rtol=5e-7, atol=0)


def test_sums_near_the_float32_limit_keep_their_value(monkeypatch):
    """Two tiles through one lane whose sum is finite (2.19e38) but whose Kahan
    compensation overflows: the compensation is dropped, not carried as -inf; and a
    lane's sum that overflows stays +inf, as torch's."""
    monkeypatch.setattr(K, "_target_programs", lambda device: 1)
    big = torch.finfo(torch.float32).max
    x = torch.tensor([0.0, 1.0]).view(2, 1, 1).to(DEVICE)
    mean, invstd = torch.zeros(1, device=DEVICE), torch.ones(1, device=DEVICE)
    for first, want in ((-1.2126649e38, torch.tensor([-1.2126649e38, big]).sum().item()),
                        (big, float("inf"))):
        dy = torch.tensor([first, big]).view(2, 1, 1).to(DEVICE)
        sums, _, _ = K.syncbn_backward_reduce(dy, x, mean, invstd)
        assert sums[0].item() == want


def _rank_rows(parts):
    """Each part as one rank's packed row (syncbn_combine), stacked [world, 2C + 1]."""
    return torch.stack([K.syncbn_combine(*K.syncbn_stats(p)) for p in parts])


@pytest.mark.parametrize("counts", [(1, 6, 3), (0, 5, 2), (40000, 1)], ids=str)
def test_merge_of_uneven_ranks_matches_the_whole_batch(counts):
    """Rows of different counts (one empty) merge into the whole batch's statistics and
    update the running statistics with its unbiased variance."""
    x = _x((sum(counts), 5), torch.float32, mean=50.0, std=3.0, seed=2)
    parts = list(torch.split(x, list(counts)))
    rows = _rank_rows(parts)
    assert rows[:, -1].tolist() == [float(c) for c in counts]
    rm = torch.full((5,), 0.5, device=DEVICE)
    rv = torch.full((5,), 2.0, device=DEVICE)
    mean, invstd, count = K.syncbn_finalize(rows, 1e-3, rm, rv, momentum=0.25)
    m64, v64, n = _exact_stats(x)
    assert count.item() == n
    torch.testing.assert_close(mean.double(), m64, rtol=2e-7, atol=0)
    torch.testing.assert_close(invstd.double(), (v64 + 1e-3).rsqrt(), rtol=2e-6, atol=0)
    torch.testing.assert_close(rm.double(), 0.75 * 0.5 + 0.25 * m64, rtol=2e-7, atol=0)
    torch.testing.assert_close(rv.double(), 0.75 * 2.0 + 0.25 * v64 * n / (n - 1), rtol=2e-6,
                               atol=0)


def _rows_of_parts(parts):
    """Packed fp32 rows [P, 2C + 1] (mean, m2, count) of ``parts`` ([n_i, C] float64),
    each rounded once from float64."""
    rows = []
    for p in parts:
        n, c = p.shape
        mean = p.mean(0) if n else torch.zeros(c, dtype=torch.float64)
        m2 = ((p - mean) ** 2).sum(0)
        rows.append(torch.cat([mean, m2, torch.tensor([float(n)], dtype=torch.float64)]))
    return torch.stack(rows).float().to(DEVICE)


def _merge64(rows):
    """(mean, m2, count) of packed rows merged exactly, in float64."""
    r = rows.double()
    c = (r.shape[1] - 1) // 2
    cnt, mu, m2 = r[:, -1], r[:, :c], r[:, c:2 * c]
    n = cnt.sum()
    mean = (cnt[:, None] * mu).sum(0) / n
    return mean, m2.sum(0) + (cnt[:, None] * (mu - mean) ** 2).sum(0), n


@pytest.mark.parametrize("c", [64, 5])
@pytest.mark.parametrize("data", ["blank first rows", "mean 1e4"])
def test_many_rows_merge_through_every_lane_of_the_gpu_tile(c, data):
    """The GPU's merge tile (32 x 64 lanes at 64 channels, 256 x 8 at 5) over 700 rows of
    uneven counts, a tenth of them empty: every lane merges several rows in the loop
    (Chan's formula), then the lanes are merged. Against the same rows merged in float64:
    the finalize (mean, invstd, running variance) and the combine (the row the ranks
    exchange). With the first rows blank, the pivot (row 0's mean) is 1e3 from the rest."""
    from tritamp.testing import force_gpu_path
    g = torch.Generator().manual_seed(11)
    counts = torch.randint(1, 40, (700,), generator=g)
    counts[torch.randperm(700, generator=g)[:70]] = 0
    offset = 1e4 if data == "mean 1e4" else 1e3
    parts = [torch.randn(int(k), c, generator=g, dtype=torch.float64) + offset
             + torch.linspace(-2.0, 3.0, c, dtype=torch.float64) for k in counts]
    if data == "blank first rows":
        for p in parts[:5]:
            p.zero_()
    rows = _rows_of_parts(parts)
    m64, m2_64, n = _merge64(rows)
    var = m2_64 / n
    rm = torch.zeros(c, device=DEVICE)
    rv = torch.ones(c, device=DEVICE)
    with force_gpu_path():
        mean, invstd, count = K.syncbn_finalize(rows, 0.0, rm, rv, momentum=1.0)
        combined = K.syncbn_combine(rows)
    assert count.item() == n == sum(p.shape[0] for p in parts)
    torch.testing.assert_close(mean.double(), m64, rtol=1e-7, atol=0)
    torch.testing.assert_close(invstd.double(), var.rsqrt(), rtol=5e-7, atol=0)
    torch.testing.assert_close(rv.double(), var * n / (n - 1), rtol=1e-6, atol=0)
    torch.testing.assert_close(combined[:c].double(), m64, rtol=1e-7, atol=0)
    torch.testing.assert_close(combined[c:2 * c].double(), m2_64, rtol=1e-6, atol=0)
    assert combined[-1].item() == n
    # and against the oracles (one merge of every row at once)
    r_mean, r_invstd, r_count = K.syncbn_finalize_ref(rows, 0.0)
    assert r_count.item() == n
    torch.testing.assert_close(mean, r_mean, rtol=2e-7, atol=0)
    torch.testing.assert_close(invstd, r_invstd, rtol=1e-6, atol=0)
    torch.testing.assert_close(combined, K.syncbn_combine_ref(rows), rtol=1e-6, atol=0)


def test_an_infinite_row_mean_stays_infinite_in_its_channel():
    """A rank's row whose mean is +inf in one channel (an infinite input value): the merged
    mean of that channel is +inf (the lanes' mean is corrected by their deviations from
    it only where it is finite), the other channels' are exact."""
    g = torch.Generator().manual_seed(13)
    parts = [torch.randn(int(k), 3, generator=g, dtype=torch.float64) for k in (5, 7, 4)]
    rows = _rows_of_parts(parts)
    rows[2, 1] = float("inf")
    mean, _, count = K.syncbn_finalize(rows, 1e-5)
    assert count.item() == 16
    assert mean[1].item() == float("inf")
    m64 = _merge64(rows[:, [0, 2, 3, 5, 6]])[0]
    torch.testing.assert_close(mean[[0, 2]].double(), m64, rtol=1e-7, atol=1e-7)


def test_many_partial_sums_add_through_every_lane_of_the_gpu_tile(monkeypatch):
    """The backward's partial sums of 121 chunks (GPU geometry, 64 channels last) added in
    the merge's 32 x 64 lanes, four rows each in the lanes before the ragged end, in fp64:
    sum_dy and sum_dy_xmu as float64's, rounded once."""
    from tritamp.testing import force_gpu_path
    monkeypatch.setattr(K, "_target_programs", lambda device: 240)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(32 * 240 + 5, 64, generator=g).to(DEVICE)
    dy = (torch.randn(x.shape, generator=g) + 0.5).to(DEVICE)
    mean = x.double().mean(0).float()
    invstd = torch.ones(64, device=DEVICE)
    with force_gpu_path():
        sums, _, _ = K.syncbn_backward_reduce(dy, x, mean, invstd)
        assert K._Geometry.of(x).chunks(x.device)[0] == 121
    want_dy = dy.double().sum(0)
    want_xmu = (dy.double() * (x.double() - mean.double())).sum(0)
    scale = dy.double().abs().sum(0) * (1 + x.double().abs().max())
    for got, want in ((sums[:64], want_dy), (sums[64:], want_xmu)):
        err = (got.double() - want).abs()
        assert (err <= 1e-7 * scale).all(), (err / scale).max().item()


@pytest.mark.parametrize("running_dtype", DTYPES, ids=str)
def test_cumulative_momentum_reads_num_batches_tracked_on_the_device(running_dtype):
    x = _x((30, 4), torch.float32, seed=3)
    rows, shift = K.syncbn_stats(x)
    for nbt in (1, 3):
        rm = torch.ones(4, dtype=running_dtype, device=DEVICE)
        rv = torch.ones(4, dtype=running_dtype, device=DEVICE)
        tracked = torch.tensor(nbt, dtype=torch.long, device=DEVICE)
        K.syncbn_finalize(rows, 1e-5, rm, rv, None, tracked, shift=shift)
        m64, v64, n = _exact_stats(x)
        f = 1.0 / nbt
        expect_m = (f * m64 + (1 - f) * 1.0).to(running_dtype)
        expect_v = (f * v64 * n / (n - 1) + (1 - f) * 1.0).to(running_dtype)
        assert rm.dtype == running_dtype
        torch.testing.assert_close(rm, expect_m, **TOL[running_dtype])
        torch.testing.assert_close(rv, expect_v, **TOL[running_dtype])


def test_statistics_of_an_empty_input_count_zero():
    x = torch.empty(0, 3, device=DEVICE)
    rows, shift = K.syncbn_stats(x)
    assert rows.shape == (1, 7) and rows.abs().sum().item() == 0
    other = _x((4, 3), torch.float32)
    merged = torch.stack([K.syncbn_combine(rows, shift), K.syncbn_combine(*K.syncbn_stats(other))])
    mean, _, count = K.syncbn_finalize(merged, 1e-5)
    assert count.item() == 4
    torch.testing.assert_close(mean.double(), _exact_stats(other)[0], rtol=2e-7, atol=1e-7)


def _params(c, dtype=torch.float32, seed=4):
    g = torch.Generator().manual_seed(seed)
    w = (torch.rand(c, generator=g) + 0.5).to(dtype).to(DEVICE)
    b = torch.randn(c, generator=g).to(dtype).to(DEVICE)
    return w, b


def _forward64(x, mean, invstd, w, b, z, relu):
    y = (x.double() - _per_channel(mean.double(), x)) * _per_channel(invstd.double(), x)
    if w is not None:
        y = y * _per_channel(w.double(), x) + _per_channel(b.double(), x)
    if z is not None:
        y = y + z.double()
    return torch.relu(y) if relu else y


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("mode", ["affine", "z_relu"])
def test_forward_is_one_rounding_from_float64(case, mode):
    shape, dtype = case
    x = _x(shape, dtype)
    c = _channels(x)
    rows, shift = K.syncbn_stats(x)
    mean, invstd, _ = K.syncbn_finalize(rows, 1e-5, shift=shift)
    w, b = _params(c)
    z = _x(shape, dtype, seed=5) if mode == "z_relu" else None
    relu = mode == "z_relu"
    y = K.syncbn_forward(x, mean, invstd, w, b, z, relu)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y, _forward64(x, mean, invstd, w, b, z, relu).to(dtype),
                               **TOL[dtype])
    torch.testing.assert_close(y, K.syncbn_forward_ref(x, mean, invstd, w, b, z, relu),
                               **TOL[dtype])
    if relu:
        assert (y >= 0).all()
    out = torch.empty_like(x)
    assert K.syncbn_forward(x, mean, invstd, w, b, z, relu, out=out) is out
    assert torch.equal(out, y)


def _batchnorm64(x, w, b, z, relu, dy):
    """The whole layer in float64 with autograd: (dx, dz, dw, db)."""
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = b.double().requires_grad_()
    z64 = z.double().requires_grad_() if z is not None else None
    var, mean = torch.var_mean(x64, dim=_dims(x), correction=0, keepdim=True)
    y = (x64 - mean) * (var + 1e-5).rsqrt() * _per_channel(w64, x) + _per_channel(b64, x)
    if z64 is not None:
        y = y + z64
    if relu:
        y = torch.relu(y)
    y.backward(dy.double())
    return x64.grad, (z64.grad if z64 is not None else None), w64.grad, b64.grad


def _torch_in_dtype(x, w, b, z, relu, dy):
    """torch's own batch_norm in x's dtype (fp32 parameters): the error yardstick."""
    xt = x.clone().requires_grad_()
    wt, bt = w.clone().requires_grad_(), b.clone().requires_grad_()
    zt = z.clone().requires_grad_() if z is not None else None
    nchw = xt if x.dim() == 3 else xt.unsqueeze(-1)
    y = torch.nn.functional.batch_norm(nchw, None, None, wt, bt, True, 0.0, 1e-5).view_as(x)
    if zt is not None:
        y = y + zt
    if relu:
        y = torch.relu(y)
    y.backward(dy)
    return xt.grad, (zt.grad if zt is not None else None), wt.grad, bt.grad


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("z_relu", [False, True], ids=["affine", "z_relu"])
def test_backward_matches_float64_autograd(case, z_relu):
    """Local reductions + input gradient of a single process against float64 autograd:
    within 2x torch's own error in the same dtype, plus the table's atol."""
    shape, dtype = case
    x = _x(shape, dtype, mean=3.0)
    c = _channels(x)
    w, b = _params(c)
    z = _x(shape, dtype, seed=6) if z_relu else None
    dy = _x(shape, dtype, seed=7)
    rows, shift = K.syncbn_stats(x)
    mean, invstd, count = K.syncbn_finalize(rows, 1e-5, shift=shift)
    sums, gw, gb = K.syncbn_backward_reduce(dy, x, mean, invstd, w, b, z, z_relu)
    dx, dz = K.syncbn_backward_input(dy, x, mean, invstd, w, sums, count, b, z, z_relu,
                                     need_dz=z_relu)
    exact = _batchnorm64(x, w, b, z, z_relu, dy)
    theirs = _torch_in_dtype(x, w, b, z, z_relu, dy)
    for name, ours, t, e in zip(("dx", "dz", "dw", "db"), (dx, dz, gw, gb), theirs, exact):
        if e is None:
            assert ours is None
            continue
        assert ours.dtype == t.dtype, name
        err = (ours.double() - e).abs().max().item()
        torch_err = (t.double() - e).abs().max().item()
        assert err <= 2 * torch_err + TOL[ours.dtype]["atol"], (name, err, torch_err)


@pytest.mark.parametrize("shape,dtype", [((37, 300), torch.float32),
                                         ((6, 3, 1000), torch.bfloat16)], ids=str)
def test_kernels_agree_with_their_refs(shape, dtype):
    x = _x(shape, dtype, mean=2.0)
    c = _channels(x)
    w, b = _params(c, dtype)
    z = _x(shape, dtype, seed=8)
    dy = _x(shape, dtype, seed=9)
    rows, shift = K.syncbn_stats(x)
    r_rows, r_shift = K.syncbn_stats_ref(x)
    assert r_shift is None
    got = K.syncbn_combine(rows, shift)
    ref = K.syncbn_combine_ref(r_rows)
    torch.testing.assert_close(got[:c], ref[:c], **TOL[torch.float32])
    torch.testing.assert_close(got[c:], ref[c:], rtol=2e-6, atol=1e-5)
    rm, rv = torch.zeros(c, dtype=dtype, device=DEVICE), torch.ones(c, dtype=dtype, device=DEVICE)
    rm2, rv2 = rm.clone(), rv.clone()
    mean, invstd, count = K.syncbn_finalize(rows, 1e-5, rm, rv, 0.1, shift=shift)
    r_mean, r_invstd, r_count = K.syncbn_finalize_ref(r_rows, 1e-5, rm2, rv2, 0.1)
    torch.testing.assert_close(mean, r_mean, **TOL[torch.float32])
    torch.testing.assert_close(invstd, r_invstd, rtol=2e-6, atol=0)
    assert torch.equal(count, r_count)
    torch.testing.assert_close(rm, rm2, **TOL[dtype])
    torch.testing.assert_close(rv, rv2, **TOL[dtype])
    # from here on both sides use the same statistics
    for relu in (False, True):
        y = K.syncbn_forward(x, mean, invstd, w, b, z, relu)
        torch.testing.assert_close(y, K.syncbn_forward_ref(x, mean, invstd, w, b, z, relu),
                                   **TOL[dtype])
        sums, gw, gb = K.syncbn_backward_reduce(dy, x, mean, invstd, w, b, z, relu)
        r_sums, r_gw, r_gb = K.syncbn_backward_reduce_ref(dy, x, mean, invstd, w, b, z, relu)
        scale = K.syncbn_backward_reduce_ref(dy.abs(), x, mean, invstd)[0].abs().max().item()
        torch.testing.assert_close(sums, r_sums, rtol=0, atol=1e-6 * scale)  # fp32 sums, order
        assert gw.dtype == gb.dtype == dtype
        for ours, theirs in ((gw, r_gw), (gb, r_gb)):
            torch.testing.assert_close(ours.float(), theirs.float(),
                                       rtol=TOL[dtype]["rtol"], atol=1e-6 * scale)
        for with_sums in (True, False):
            s = sums if with_sums else None
            dx, dz = K.syncbn_backward_input(dy, x, mean, invstd, w, s, count, b, z, relu,
                                             need_dz=True)
            r_dx, r_dz = K.syncbn_backward_input_ref(dy, x, mean, invstd, w, s, count, b, z,
                                                     relu, need_dz=True)
            torch.testing.assert_close(dx, r_dx, **TOL[dtype])
            assert torch.equal(dz, r_dz)


def test_without_affine_parameters():
    x = _x((50, 4), torch.float32)
    rows, shift = K.syncbn_stats(x)
    mean, invstd, count = K.syncbn_finalize(rows, 1e-5, shift=shift)
    y = K.syncbn_forward(x, mean, invstd)
    torch.testing.assert_close(y, _forward64(x, mean, invstd, None, None, None, False).float(),
                               **TOL[torch.float32])
    dy = _x((50, 4), torch.float32, seed=1)
    sums, gw, gb = K.syncbn_backward_reduce(dy, x, mean, invstd)
    assert gw is None and gb is None
    dx, dz = K.syncbn_backward_input(dy, x, mean, invstd, None, sums, count)
    assert dz is None
    r_dx, _ = K.syncbn_backward_input_ref(dy, x, mean, invstd, None, sums, count)
    torch.testing.assert_close(dx, r_dx, **TOL[torch.float32])


def test_results_are_deterministic():
    x = _x((6, 3, 1000), torch.float16)
    dy = _x((6, 3, 1000), torch.float16, seed=3)
    w, b = _params(3)

    def run():
        rows, shift = K.syncbn_stats(x)
        mean, invstd, count = K.syncbn_finalize(rows, 1e-5, shift=shift)
        sums, gw, gb = K.syncbn_backward_reduce(dy, x, mean, invstd, w, b)
        dx, _ = K.syncbn_backward_input(dy, x, mean, invstd, w, sums, count)
        return rows, mean, invstd, sums, gw, dx

    for a, b_ in zip(run(), run()):
        assert torch.equal(a, b_)


def test_nan_input_propagates_to_its_channel_only():
    x = _x((10, 3), torch.float32)
    x[4, 1] = float("nan")
    rows, shift = K.syncbn_stats(x)
    mean, invstd, _ = K.syncbn_finalize(rows, 1e-5, shift=shift)
    assert torch.isnan(mean[1]) and torch.isfinite(mean[[0, 2]]).all()
    y = K.syncbn_forward(x, mean, invstd, relu=True)
    assert torch.isnan(y[:, 1]).all() and torch.isfinite(y[:, [0, 2]]).all()


def test_bad_arguments_name_the_fix():
    x = _x((4, 3, 5), torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        K.syncbn_stats(x.transpose(0, 2))
    with pytest.raises(ValueError, match="contiguous"):
        K.syncbn_stats(x.view(4, 3, 5, 1))
    rows, shift = K.syncbn_stats(x)
    mean, invstd, count = K.syncbn_finalize(rows, 1e-5, shift=shift)
    with pytest.raises(ValueError, match="3 channels"):
        K.syncbn_forward(x, mean, invstd, torch.ones(4, device=DEVICE))
    with pytest.raises(ValueError, match="fp32"):
        K.syncbn_forward(x, mean.half(), invstd)
    with pytest.raises(ValueError, match="z must be contiguous"):
        K.syncbn_forward(x, mean, invstd, z=torch.ones(4, 3, 6, device=DEVICE))
    with pytest.raises(ValueError, match="fp32 \\[P, 2C \\+ 1\\]"):
        K.syncbn_finalize(rows.double(), 1e-5)
    with pytest.raises(ValueError, match="contiguous rows"):  # rows must have unit columns
        K.syncbn_finalize(torch.zeros(7, 3, device=DEVICE).t(), 1e-5)
    with pytest.raises(ValueError, match="num_batches_tracked"):
        K.syncbn_finalize(rows, 1e-5, torch.zeros(3, device=DEVICE),
                          torch.ones(3, device=DEVICE), momentum=None)


@pytest.mark.parametrize("shape", [(6, 5, 7), (40, 3)])
def test_partial_rows_are_padded_and_merge_the_same_as_contiguous_rows(shape):
    """syncbn_stats' rows start at multiples of 16 elements (aligned loads in the merge);
    as a [P, 2C + 1] view they merge exactly as the same rows made contiguous."""
    torch.manual_seed(0)
    x = (torch.randn(*shape) * 3 + 1).to(DEVICE)
    rows, shift = K.syncbn_stats(x)
    c = _channels_of(x)
    assert rows.shape[1] == 2 * c + 1
    if rows.shape[0] > 1 and K.use_triton(x):
        assert rows.stride(0) % 16 == 0 and rows.stride(0) >= 2 * c + 1
    got = K.syncbn_finalize(rows, 1e-5, shift=shift)
    want = K.syncbn_finalize(rows.contiguous(), 1e-5, shift=shift)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(K.syncbn_combine(rows, shift), K.syncbn_combine(rows.contiguous(), shift))


def _channels_of(x):
    return x.shape[-1] if x.dim() == 2 else x.shape[1]


def test_counts_and_sums_read_by_element_are_checked_before_anything_is_written(path):
    # num_batches_tracked and count were read at their first element by the kernels and
    # used whole by the CPU path (a per-channel momentum or divisor there); a strided sums
    # was read as contiguous by the kernels
    torch.manual_seed(0)
    x = torch.randn(6, 3)
    rows, shift = K.syncbn_stats(x)
    rm, rv = torch.zeros(3), torch.ones(3)
    for bad, match in ((torch.tensor([2, 2, 2]), r"num_batches_tracked must be one element of "
                        r"int64/int32/float32 on cpu; got torch.int64 of shape \(3,\)"),
                       (torch.tensor(2, device="meta"), r"num_batches_tracked .* on meta")):
        with pytest.raises(ValueError, match=r"syncbn_finalize: " + match):
            K.syncbn_finalize(rows, 1e-5, rm, rv, None, bad, shift=shift)
        assert torch.equal(rm, torch.zeros(3)) and torch.equal(rv, torch.ones(3))
    mean, invstd, count = K.syncbn_finalize(rows, 1e-5, shift=shift)
    dy = torch.randn(6, 3)
    sums, _, _ = K.syncbn_backward_reduce(dy, x, mean, invstd)
    strided = torch.stack([sums, sums], 1)[:, 0]
    for kw, match in ((dict(sums=strided, count=count), r"sums must be a contiguous fp32 \[6\] "
                       r"on cpu with a count .*, not contiguous"),
                      (dict(sums=sums, count=count.expand(3)), r"count must be one element of "
                       r"float32 on cpu; got torch.float32 of shape \(3,\)"),
                      (dict(sums=sums, count=count.double()), r"count must be one element")):
        with pytest.raises(ValueError, match=r"syncbn_backward_input: " + match):
            K.syncbn_backward_input(dy, x, mean, invstd, **kw)
    dx, _ = K.syncbn_backward_input(dy, x, mean, invstd, sums=sums, count=count)
    assert dx.shape == x.shape
