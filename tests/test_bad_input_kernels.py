"""Bad or extreme input to the kernels' launchers: inputs past 2**31 elements (SyncBatchNorm's
offsets and grid, LayerNorm's row offsets) and sparse gradients (the multi-tensor engine,
check/unscale, amp at O1/O2, the fused optimizers).

Inputs past 2**31 elements are never allocated: their launch geometry is computed from the
shape, the tile arithmetic of the real kernel helper runs in the interpreter on such a
geometry, and the kernels compiled for sm_90 are checked to compute those offsets in int64.
"""
import json
import math
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from torch import nn

from conftest import assert_bits_unchanged
from tritamp import amp
from tritamp.kernels import check_unscale
from tritamp.testing import layout_key
from tritamp.testing import syncbn_geometry as _Geometry
from tritamp.testing import syncbn_tile as _syncbn_tile
from tritamp.optimizers import FusedAdam, FusedAdagrad, FusedLAMB, FusedNovoGrad, FusedSGD

INT32_MAX = 2**31 - 1
GRID_Y_MAX = 65535


# --------------------------------------------------------------------------------------
# SyncBatchNorm past 2**31 elements
# --------------------------------------------------------------------------------------

HUGE = [
    (1, 64, 2**26),        # one sample of 2**32 elements: c * B passes 2**31
    (2, 3, 2**31 + 7),     # one plane past 2**31
    (2**20, 3, 1024),      # many samples of 3 * 1024
    (1, 2**17, 2**14),     # 2**31 elements, more channels than grid axis 1 holds at BLOCK_C 1
    (2**26, 64),           # channels last, 2**32 elements
    (64, 2**26),           # channels last, 2**26 channels: r * C passes 2**31 at 64 rows
    (3, 2**31 + 5),        # channels last, more channels than int32 counts
]


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "interpreter"])
@pytest.mark.parametrize("shape", HUGE, ids=lambda s: "x".join(map(str, s)))
def test_syncbn_geometry_of_a_huge_input_covers_it_within_the_launch_limits(shape, gpu):
    geo = _Geometry(shape, gpu)
    assert geo.n_cblocks * geo.BLOCK_C >= geo.C > (geo.n_cblocks - 1) * geo.BLOCK_C
    assert geo.n_cblocks <= GRID_Y_MAX          # forward / backward_input: grid axis 1
    assert geo.n_segs <= INT32_MAX               # grid axis 0
    if geo.channels_last:
        assert geo.n_segs * geo.BLOCK_R >= geo.M > (geo.n_segs - 1) * geo.BLOCK_R
        # the int32 part of a tile's offsets: lc + r * C
        assert (geo.BLOCK_R - 1) * geo.C + geo.BLOCK_C - 1 <= INT32_MAX
    else:
        assert geo.NBB * geo.BLOCK_R >= geo.B > (geo.NBB - 1) * geo.BLOCK_R
        assert geo.n_segs == geo.M * geo.NBB
        assert geo.BLOCK_R <= INT32_MAX  # the int32 part: r within one plane


@triton.jit
def _tile_addresses_kernel(out_ptr, seg_id, cblock_id, M, C, B_UNITS, NBB,
                           CHANNELS_LAST: tl.constexpr, B_VEC: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The element offsets (-1 where masked) that syncbn's kernels read for tile
    ``seg_id`` of channel block ``cblock_id``: program ids widened as the kernels widen
    them, then the kernels' own tile helper."""
    B = B_UNITS * B_VEC  # as the kernels do
    seg = seg_id.to(tl.int64)
    c0 = cblock_id.to(tl.int64) * BLOCK_C
    cols = c0 + tl.arange(0, BLOCK_C)
    base, offs, mask, k = _syncbn_tile(seg, c0, cols < C, M, C, B, NBB, CHANNELS_LAST,
                                       BLOCK_R, BLOCK_C)
    addr = tl.where(mask, base + offs, -1)
    i = tl.arange(0, BLOCK_C)[:, None] * BLOCK_R + tl.arange(0, BLOCK_R)[None, :]
    tl.store(out_ptr + i, addr.to(tl.int64))


def _expected_addresses(geo, seg, cblock):
    """The same offsets from the shape, in exact int64 arithmetic."""
    c = cblock * geo.BLOCK_C + np.arange(geo.BLOCK_C, dtype=np.int64)[:, None]
    r = np.arange(geo.BLOCK_R, dtype=np.int64)[None, :]
    if geo.channels_last:
        m = seg * geo.BLOCK_R + r
        addr = m * geo.C + c
        valid = (m < geo.M) & (c < geo.C)
    else:
        n, j = divmod(seg, geo.NBB)
        b = j * geo.BLOCK_R + r
        addr = (n * geo.C + c) * geo.B + b
        valid = (b < geo.B) & (c < geo.C)
    return np.where(valid, addr, -1)


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "interpreter"])
@pytest.mark.parametrize("shape", HUGE, ids=lambda s: "x".join(map(str, s)))
def test_syncbn_tile_offsets_of_a_huge_input_do_not_wrap(shape, gpu):
    geo = _Geometry(shape, gpu)
    last_c = geo.n_cblocks - 1
    tiles = {(0, 0), (geo.n_segs - 1, last_c), (geo.n_segs // 2, last_c // 2),
             (geo.n_segs - 1, 0), (0, last_c)}
    out = torch.empty(geo.BLOCK_C * geo.BLOCK_R, dtype=torch.int64)
    for seg, cblock in sorted(tiles):
        _tile_addresses_kernel[(1,)](out, seg, cblock, *geo.args(),
                                     CHANNELS_LAST=geo.channels_last, B_VEC=geo.B_VEC,
                                     BLOCK_R=geo.BLOCK_R,
                                     BLOCK_C=geo.BLOCK_C)
        got = out.numpy().reshape(geo.BLOCK_C, geo.BLOCK_R)
        want = _expected_addresses(geo, seg, cblock)
        assert (got == want).all(), (seg, cblock, got[got != want][:4], want[got != want][:4])
        assert want.max() < np.prod(shape, dtype=np.int64)


@pytest.mark.parametrize("shape,limits", [
    ((40, 5), dict(_INT32_MAX=20)),        # channels last: BLOCK_R halved from 64 to 2
    ((40, 300), dict(_GRID_Y_MAX=1)),      # channels last: one block of 512 channels
    ((2, 6, 3000), dict(_GRID_Y_MAX=1)),   # channels first: 8 channels x 2048, ragged planes
], ids=["cl-int32", "cl-grid", "cf-grid"])
def test_syncbn_kernels_are_right_on_the_geometry_a_huge_input_gets(monkeypatch, shape,
                                                                    limits):
    # The limits lowered: a small input takes the geometry a huge one takes, and the
    # kernels launched on it agree with the references.
    from tritamp.kernels import syncbn as S
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 2.0 + 1.0
    default = _Geometry.of(x)
    for name, value in limits.items():
        monkeypatch.setattr(S, name, value)
    monkeypatch.setattr(S, "_GEOMETRIES", {})  # geometries are kept per shape: start afresh
    geo = _Geometry.of(x)
    assert (geo.BLOCK_R, geo.BLOCK_C) != (default.BLOCK_R, default.BLOCK_C)
    c = shape[1]
    w, b = torch.linspace(0.5, 1.5, c), torch.linspace(-1.0, 1.0, c)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    rows, shift = S.syncbn_stats(x)
    mean, invstd, count = S.syncbn_finalize(rows, 1e-5, shift=shift)
    want_mean, want_invstd, want_count = S.syncbn_finalize_ref(S.syncbn_stats_ref(x)[0], 1e-5)
    assert count.item() == want_count.item() == x.numel() // c
    torch.testing.assert_close(mean, want_mean, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(invstd, want_invstd, rtol=2e-6, atol=0)
    tol = dict(rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(S.syncbn_forward(x, mean, invstd, w, b),
                               S.syncbn_forward_ref(x, mean, invstd, w, b), **tol)
    sums, gw, gb = S.syncbn_backward_reduce(dy, x, mean, invstd, w, b)
    want_sums, want_gw, want_gb = S.syncbn_backward_reduce_ref(dy, x, mean, invstd, w, b)
    for got, want in ((sums, want_sums), (gw, want_gw), (gb, want_gb)):
        # sums of thousands of terms, taken in another order: four fp32 ulps of the largest
        torch.testing.assert_close(got, want, rtol=0, atol=4 * 2**-23 * want.abs().max().item())
    dx, _ = S.syncbn_backward_input(dy, x, mean, invstd, w, sums, count)
    torch.testing.assert_close(dx, S.syncbn_backward_input_ref(dy, x, mean, invstd, w, sums,
                                                               count)[0], **tol)


def test_syncbn_geometry_of_a_tensor_refuses_a_non_canonical_view():
    with pytest.raises(ValueError, match=r"contiguous \[M, C\].*\[N, C, B\].*strides"):
        _Geometry.of(torch.zeros(4, 3).t())


# The kernels compiled for sm_90 (a child process: this session interprets them).
_COMPILE_SCRIPT = textwrap.dedent("""
    import json, os, re, sys
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tritamp.testing import jit_kernels

    K = jit_kernels()
    HOPPER = GPUTarget("cuda", 90, 32)
    ADDPTR = re.compile(r"(%[\\w.]+) = tt\\.addptr (%[\\w.]+), (%[\\w.]+) : "
                        r"(\\S+), (?:tensor<[^>]*x)?(i\\d+)>?")

    def addptrs(fn, sig, consts, warps=8):
        sig = dict(sig, **{k: "constexpr" for k in consts})
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=HOPPER,
                           options={"num_warps": warps})
        return ADDPTR.findall(k.asm["ttir"])

    out = {}
    dims = {"M": "i32", "C": "i32", "B_UNITS": "i32", "NBB": "i32"}
    params = {"mean_ptr": "*fp32", "invstd_ptr": "*fp32", "w_ptr": "*fp32", "b_ptr": "*fp32"}
    for cl in (False, True):
        tiles = dict(CHANNELS_LAST=cl, B_VEC=1, EMULATE_BF16_ROUNDING=False,
                     BLOCK_R=64 if cl else 1024, BLOCK_C=64 if cl else 4)
        flags = dict(tiles, HAS_WEIGHT=True, HAS_BIAS=True, HAS_Z=False, RELU=False)
        name = "channels_last" if cl else "channels_first"
        out[f"stats/{name}"] = addptrs(K["syncbn_stats_kernel"], dict(
            {"x_ptr": "*fp16", "part_ptr": "*fp32", "shift_ptr": "*fp32"}, **dims,
            n_segs="i32", segs_per_chunk="i32", row_stride="i32"), tiles)
        out[f"forward/{name}"] = addptrs(K["syncbn_forward_kernel"], dict(
            {"x_ptr": "*fp16", "z_ptr": "*fp16", "y_ptr": "*fp16"}, **params, **dims), flags)
        out[f"backward_reduce/{name}"] = addptrs(K["syncbn_backward_reduce_kernel"], dict(
            {"dy_ptr": "*fp16", "x_ptr": "*fp16", "z_ptr": "*fp16", "part_ptr": "*fp32"},
            **params, **dims, n_segs="i32", segs_per_chunk="i32"), flags)
        out[f"backward_input/{name}"] = addptrs(K["syncbn_backward_input_kernel"], dict(
            {"dy_ptr": "*fp16", "x_ptr": "*fp16", "z_ptr": "*fp16", "dx_ptr": "*fp16",
             "dz_ptr": "*fp16"}, **params, sums_ptr="*fp32", count_ptr="*fp32", **dims),
            dict(flags, HAS_DZ=False, HAS_SUMS=True))
    for one_pass in (True, False):
        mode = dict(IS_RMS=False, HAS_WEIGHT=True, HAS_BIAS=True, ONE_PASS=one_pass,
                    EMULATE_BF16_ROUNDING=False, BLOCK=4096 if one_pass else 1024)
        out[f"layer_norm_fwd/one_pass={one_pass}"] = addptrs(K["layer_norm_fwd_kernel"], {
            "x_ptr": "*fp16", "y_ptr": "*fp16", "w_ptr": "*fp16", "b_ptr": "*fp16",
            "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "x_stride": "i32", "N": "i32",
            "eps": "fp32"}, mode)
        out[f"layer_norm_bwd/one_pass={one_pass}"] = addptrs(K["layer_norm_bwd_kernel"], {
            "dy_ptr": "*fp16", "v_ptr": "*fp16", "w_ptr": "*fp16", "b_ptr": "*fp16",
            "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "dx_ptr": "*fp16",
            "dw_part_ptr": "*fp32", "db_part_ptr": "*fp32", "stats_ptr": "*fp32",
            "v_stride": "i32", "M": "i32", "N": "i32", "rows_per_program": "i32",
            "min_w": "fp32"},
            dict(mode, FROM_OUTPUT=False))
    out["layer_norm_bwd_reduce"] = addptrs(K["layer_norm_bwd_reduce_kernel"], {
        "dw_part_ptr": "*fp32", "db_part_ptr": "*fp32", "dw_ptr": "*fp16", "db_ptr": "*fp16",
        "G": "i32", "N": "i32", "rows_per_split": "i32"},
        dict(HAS_WEIGHT=True, HAS_BIAS=True, EMULATE_BF16_ROUNDING=False, BLOCK_G=8,
             BLOCK_N=128), 4)
    json.dump(out, sys.stdout)
""")


@pytest.fixture(scope="module")
def sm90_addptrs():
    """{variant: [(result, pointer, offset, pointer type, offset int type)]}: every
    ``tt.addptr`` of the norm kernels' TTIR, compiled for sm_90 with int32 sizes."""
    pytest.importorskip("triton.backends.nvidia")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True,
                          text=True, env=env, timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr:
        pytest.skip("Triton's CUDA toolchain is not usable here:\n" + proc.stderr[-500:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("kernel", ["stats", "forward", "backward_reduce", "backward_input"])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_syncbn_tile_base_is_int64_in_the_sm90_code(sm90_addptrs, kernel, layout):
    ops = sm90_addptrs[f"{kernel}/{layout}"]
    # x_ptr + base + offs: the base holds every term that grows with the input
    bases = [op for op in ops if op[2].startswith("%base")]
    assert bases, ops
    assert {op[4] for op in bases} == {"i64"}, bases
    if layout == "channels_first":
        # one [BLOCK_C, 1] base per channel's run: c * B in int64
        assert any(op[3].startswith("tensor<4x1x") for op in bases), bases


def test_syncbn_pivot_load_is_int64_in_the_sm90_code(sm90_addptrs):
    # the stats kernel's pivot, x[0, c, 0] at c * B: past 2**31 in one sample
    pivots = [op for op in sm90_addptrs["stats/channels_first"] if op[0].startswith("%pivot")]
    assert pivots and {op[4] for op in pivots} == {"i64"}, pivots


@pytest.mark.parametrize("variant", ["layer_norm_fwd/one_pass=True",
                                     "layer_norm_fwd/one_pass=False",
                                     "layer_norm_bwd/one_pass=True",
                                     "layer_norm_bwd/one_pass=False", "layer_norm_bwd_reduce"])
def test_layer_norm_row_offsets_are_int64_in_the_sm90_code(sm90_addptrs, variant):
    # Rows x N may pass 2**31: every row offset (a scalar added to a base pointer, or the
    # partial rows of the reduction) is int64; only in-row column offsets (< N) are int32.
    ops = sm90_addptrs[variant]
    rows = [op for op in ops
            if not op[3].startswith("tensor") or op[3].startswith("tensor<8x")]  # BLOCK_G rows
    assert rows, ops
    assert {op[4] for op in rows} == {"i64"}, rows


# --------------------------------------------------------------------------------------
# Sparse gradients
# --------------------------------------------------------------------------------------

def _sparse_grad(shape=(5, 3), rows=(0, 2)):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on sparse invariant checks
        return torch.sparse_coo_tensor([list(rows)], torch.ones(len(rows), *shape[1:]), shape)


SPARSE_MSG = r"does not support sparse gradients.*sparse_coo tensor of shape \(5, 3\).*" \
             r"dense gradients, e\.g\. nn\.Embedding\(\.\.\., sparse=False\)"


@pytest.mark.parametrize("where", ["srcs", "dsts", "adds"])
def test_check_unscale_names_a_sparse_tensor_and_writes_nothing(where):
    lists = dict(srcs=[torch.randn(4), torch.randn(5, 3)],
                 dsts=[torch.randn(4), torch.randn(5, 3)],
                 adds=[torch.randn(4), torch.randn(5, 3)])
    lists[where][1] = _sparse_grad()
    dense = [t for lst in lists.values() for t in lst if t.layout == torch.strided]
    before = [t.clone() for t in dense]
    found = torch.zeros(())
    with pytest.raises(RuntimeError, match=rf"check_unscale {SPARSE_MSG}") as err:
        check_unscale(lists["srcs"], torch.tensor(4.0), found, dsts=lists["dsts"],
                      adds=lists["adds"])
    assert f"{where}[1] is a sparse_coo tensor" in str(err.value)
    assert_bits_unchanged(before, dense)
    assert found.item() == 0.0


def test_the_engine_names_a_sparse_gradient_and_its_parameter():
    from tritamp.testing import Column, Sweep
    sweep = Sweep("probe_step", [Column("params", "param"), Column("grads", "grad"),
                                 Column("exp_avgs", "state")])
    lists = dict(params=[torch.randn(4), torch.randn(5, 3)],
                 grads=[torch.randn(4), _sparse_grad()],
                 exp_avgs=[torch.zeros(4), torch.zeros(5, 3)])
    with pytest.raises(RuntimeError, match=rf"probe_step {SPARSE_MSG}") as err:
        sweep.prepare(lists)
    assert "grads[1] (for params[1]) is a sparse_coo tensor" in str(err.value)
    lists = dict(params=[_sparse_grad((4,), (1,)), torch.randn(5, 3)],
                 grads=[torch.randn(4), torch.randn(5, 3)],
                 exp_avgs=[torch.zeros(4), torch.zeros(5, 3)])
    with pytest.raises(RuntimeError, match="probe_step does not support sparse gradients: "
                       r"params\[0\] is a sparse_coo tensor of shape \(4,\)"):
        sweep.prepare(lists)


def test_layout_key_names_a_sparse_gradient():
    with pytest.raises(RuntimeError, match=rf"amp {SPARSE_MSG}") as err:
        layout_key([torch.randn(2), None, _sparse_grad()], op="amp")
    assert "gradient 2 is a sparse_coo tensor" in str(err.value)
    # dense lists: strides, element counts and dtypes (None kept in place)
    assert layout_key([torch.randn(2), None])[1] == (((1,), None), (2, 0),
                                                     (torch.float32, None))


class _EmbeddingNet(nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(5, 3, sparse=sparse)
        self.lin = nn.Linear(3, 2)

    def forward(self, idx):
        return self.lin(self.emb(idx))


def _amp_state(model, opt):
    """Everything a refused backward must leave as it was: weights, masters, optimizer
    state, the scalers' state and device tensors."""
    from tritamp.testing import amp_state
    state = amp_state()
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    tensors += [p.detach().clone() for p in amp.master_params(opt)]
    tensors += [t.clone() for st in opt.state.values() for t in st.values()
                if isinstance(t, torch.Tensor)]
    for scaler in state.loss_scalers:
        tensors += [t.clone() for t in vars(scaler).values()
                    if isinstance(t, torch.Tensor) and t.layout == torch.strided]
    return tensors, amp.state_dict(), opt.state_dict()["param_groups"]


@pytest.mark.parametrize("opt_cls", [FusedAdam, FusedSGD])
@pytest.mark.parametrize("level,half", [("O1", torch.float16), ("O2", torch.float16),
                                        ("O2", torch.bfloat16)],
                         ids=["O1-fp16", "O2-fp16", "O2-bf16"])
def test_amp_refuses_a_sparse_gradient_by_name_and_changes_nothing(level, half, opt_cls):
    model = _EmbeddingNet(sparse=True)
    opt = opt_cls(model.parameters(), lr=0.1, **({"momentum": 0.9} if opt_cls is FusedSGD
                                                  else {}))
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0)
    idx = torch.tensor([1, 3, 3])
    # one dense step first: the optimizer and scaler hold state a refusal could disturb
    model.emb.weight.requires_grad_(False)
    with amp.scale_loss(model(idx).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    model.emb.weight.requires_grad_(True)
    tensors, amp_sd, groups = _amp_state(model, opt)
    opt.zero_grad()
    with pytest.raises(RuntimeError, match=SPARSE_MSG) as err:
        with amp.scale_loss(model(idx).float().sum(), opt) as scaled:
            scaled.backward()
    # named by the parameter's module path (an index into the exit's list said less)
    assert "the gradient of emb.weight is a sparse_coo tensor of shape (5, 3)" in str(err.value)
    after, amp_after, groups_after = _amp_state(model, opt)
    assert_bits_unchanged(tensors, after)
    assert amp_after == amp_sd and groups_after == groups


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_amp_refuses_a_sparse_gradient_of_a_torch_optimizer_by_name(level):
    model = _EmbeddingNet(sparse=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    with pytest.raises(RuntimeError, match=SPARSE_MSG):
        with amp.scale_loss(model(torch.tensor([1, 3])).float().sum(), opt) as scaled:
            scaled.backward()


OPTIMIZERS = [(FusedAdam, {}), (FusedSGD, {"momentum": 0.9}), (FusedLAMB, {}),
              (FusedAdagrad, {}), (FusedNovoGrad, {})]


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=[c.__name__ for c, _ in OPTIMIZERS])
def test_fused_optimizers_refuse_a_sparse_gradient_in_torchs_words(cls, kw):
    p = nn.Parameter(torch.randn(5, 3))
    q = nn.Parameter(torch.randn(4))
    opt = cls([q, p], lr=0.1, **kw)
    q.grad = torch.randn(4)
    p.grad = _sparse_grad()
    before = [p.detach().clone(), q.detach().clone()]
    with pytest.raises(RuntimeError, match=f"{cls.__name__} does not support sparse gradients"):
        opt.step()
    assert_bits_unchanged(before, [p.detach(), q.detach()])
    assert len(opt.state) == 0


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=[c.__name__ for c, _ in OPTIMIZERS])
def test_fused_optimizers_name_the_sparse_gradient_and_the_fix(cls, kw):
    p = nn.Parameter(torch.randn(5, 3))
    opt = cls([nn.Parameter(torch.randn(4)), p], lr=0.1, **kw)
    opt.param_groups[0]["params"][0].grad = torch.randn(4)
    p.grad = _sparse_grad()
    with pytest.raises(RuntimeError, match=SPARSE_MSG) as err:
        opt.step()
    assert "param_groups[0] gradient 1 is a sparse_coo tensor" in str(err.value)
    assert len(opt.state) == 0


# --------------------------------------------------------------------------------------
# count_nonfinite (the skip warning's counts)
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad,match", [
    (lambda: torch.zeros(2, dtype=torch.int64), r"counts must be a contiguous int32 tensor "
                                                 r"of shape \(3,\)"),
    (lambda: torch.zeros(4, dtype=torch.int32), r"of shape \(3,\).*got torch.int32 \(4,\)"),
    (lambda: torch.zeros(6, dtype=torch.int32)[::2], r"contiguous int32"),
], ids=["int64", "short", "strided"])
def test_count_nonfinite_refuses_bad_counts_and_counts_nothing(bad, match):
    from tritamp.kernels.overflow import count_nonfinite
    srcs = [torch.full((5,), math.inf), torch.zeros(3), torch.full((2, 2), math.nan)]
    counts = bad()
    before = counts.clone()
    with pytest.raises(ValueError, match=match):
        count_nonfinite(srcs, counts, torch.ones(()))
    assert torch.equal(counts, before)


def test_count_nonfinite_refuses_a_non_dense_source_by_name():
    from tritamp.kernels.overflow import count_nonfinite
    counts = torch.zeros(2, dtype=torch.int32)
    expanded = torch.full((1, 4), math.inf).expand(3, 4)
    with pytest.raises(ValueError, match=r"count_nonfinite: srcs\[1\] of shape \(3, 4\) has "
                                         r"strides \(0, 1\), not a dense layout"):
        count_nonfinite([torch.zeros(4), expanded], counts, torch.ones(()))
    assert torch.equal(counts, torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("index", [[0], [0, -1], [0, 1.5]], ids=["short", "negative", "float"])
def test_count_nonfinite_refuses_a_bad_index(index):
    from tritamp.kernels.overflow import count_nonfinite
    counts = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"index must hold one int >= 0 per source \(2\)"):
        count_nonfinite([torch.full((3,), math.inf), torch.zeros(2)], counts, torch.ones(()),
                        index=index)
    assert torch.equal(counts, torch.zeros(4, dtype=torch.int32))


# -- the one-value tensors a sweep reads (a loss scale, an overflow flag) ------------------
def _value_sweeps():
    from tritamp.kernels import multi_tensor_l2norm
    from tritamp.kernels.overflow import count_nonfinite

    srcs = [torch.full((3,), 4.0), torch.full((2,), 4.0)]

    def unscale(**kw):
        check_unscale(srcs, **kw)
        assert False, "refused before this"

    def norm(**kw):
        return multi_tensor_l2norm([torch.full((3,), 4.0)], **kw)

    def count(found_inf):
        counts = torch.zeros(1, dtype=torch.int32)
        count_nonfinite([torch.tensor([math.inf, 1.0])], counts, found_inf)
        return counts

    scale, flag = torch.tensor(2.0), torch.zeros(())
    return srcs, [("check_unscale-scale", lambda v: unscale(scale=v, found_inf=flag), "scale"),
            ("check_unscale-found_inf", lambda v: unscale(scale=scale, found_inf=v),
             "found_inf"),
            ("l2norm-scale", lambda v: norm(scale=v), "scale"),
            ("l2norm-found_inf", lambda v: norm(found_inf=v), "found_inf"),
            ("count_nonfinite", count, "found_inf")]


@pytest.mark.parametrize("case", range(5), ids=[c[0] for c in _value_sweeps()[1]])
def test_a_scale_or_flag_not_one_value_on_the_tensors_device_is_refused_by_name(case, path):
    # check_unscale read one on the meta device as no scale at all (nothing unscaled, no
    # flag set) on the CPU path; two values were taken as the first in the kernels and
    # refused by torch's op ("inv_scale must be a 1-element tensor.") on the CPU path
    srcs, cases = _value_sweeps()
    _, call, name = cases[case]
    for bad, match in ((torch.tensor(1.0, device="meta"), rf"{name} is on meta but the "
                        r"tensors are on cpu; pass a tensor on cpu"),
                       (torch.zeros(2), rf"{name} must be a one-element tensor, got shape "
                        r"\(2,\); pass the (loss scale|overflow flag) as one value")):
        with pytest.raises(ValueError, match=match):
            call(bad)
    with pytest.raises(TypeError, match=rf"{name} must be a one-element tensor"):
        call(2.0)
    assert all(torch.equal(t, torch.full_like(t, 4.0)) for t in srcs), "unscaled anyway"


BAD_FACTORS = [(torch.tensor([2.0, 3.0]), ValueError, r"tensor of shape \(2,\) on cpu"),
               (torch.tensor(2.0, device="meta"), ValueError, r"tensor of shape \(\) on meta"),
               (torch.tensor(2 + 0j), ValueError, r"complex64 tensor"),
               (torch.tensor(True), ValueError, r"bool tensor"),
               ("2", TypeError, r"must be a real number, got str '2'")]


@pytest.mark.parametrize("bad,error,match", BAD_FACTORS,
                         ids=["two", "meta", "complex", "bool", "str"])
@pytest.mark.parametrize("name", ["growth_factor", "backoff_factor", "min_scale",
                                  "max_scale"])
def test_scale_update_names_a_factor_that_is_not_one_real_number(path, name, bad, error,
                                                                 match):
    # (refused in torch's words before: ".item() on meta", "more than one value"; a string
    # and a bool or complex tensor were taken through float())
    from tritamp.kernels.scale_update import STATE_SIZE, scale_update
    state = torch.zeros(STATE_SIZE)
    state[0] = 4.0
    before = state.clone()
    with pytest.raises(error, match=rf"scale_update: {name} .*{match}"):
        scale_update(state, **{name: bad})
    assert torch.equal(state, before)
    scale_update(state, **{name: torch.tensor(2.0) if "factor" in name else 1.0})


@pytest.mark.parametrize("bad,error,match", BAD_FACTORS[:2] + BAD_FACTORS[4:],
                         ids=["two", "meta", "str"])
@pytest.mark.parametrize("name", ["eps", "momentum"])
def test_syncbn_finalize_names_an_eps_or_momentum_that_is_not_one_real_number(
        path, name, bad, error, match):
    # A two-element momentum was broadcast over two channels on the CPU path (the kernels
    # took its float()): the paths disagreed
    from tritamp.kernels import syncbn as S
    x = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(0))
    rows, shift = S.syncbn_stats(x)
    running = [torch.zeros(2), torch.ones(2)]
    before = [t.clone() for t in running]
    kw = dict(eps=1e-5, momentum=0.1)
    kw[name] = bad
    with pytest.raises(error, match=rf"syncbn_finalize: {name} .*{match}"):
        S.syncbn_finalize(rows, kw.pop("eps"), *running, shift=shift, **kw)
    assert all(torch.equal(a, b) for a, b in zip(running, before))
    kw = dict(eps=1e-5, momentum=0.1)
    kw[name] = torch.tensor(kw[name])  # one element: read as the float
    mean, invstd, _ = S.syncbn_finalize(rows, kw.pop("eps"), *running, shift=shift, **kw)
    want = S.syncbn_finalize_ref(S.syncbn_stats_ref(x)[0], 1e-5)
    torch.testing.assert_close(invstd, want[1], rtol=2e-6, atol=0)


def test_the_l2_norm_of_an_empty_list_takes_a_scale_and_a_flag():
    # (an empty list has no device to check a scale or a flag against: its norm is 0)
    from tritamp.kernels import multi_tensor_l2norm
    for kw in (dict(scale=torch.ones(())), dict(found_inf=torch.zeros(()))):
        total, per_tensor = multi_tensor_l2norm([], **kw)
        assert total.item() == 0.0 and per_tensor is None


def test_scale_update_takes_whole_counts_and_kernels_take_real_scalars(path):
    # a growth_interval of 2.5 was truncated by the kernel and compared as 2.5 on the CPU
    # path (the scale grew on one path only); a complex scale lost its imaginary part on
    # the CPU path and failed inside the kernels
    from tritamp.kernels.axpby import multi_tensor_scale
    from tritamp.kernels.scale_update import STATE_SIZE, scale_update
    state = torch.zeros(STATE_SIZE)
    state[0] = 4.0
    before = state.clone()
    for kw, bad in ((dict(growth_interval=2.5), "growth_interval"),
                    (dict(growth_interval=True), "growth_interval"),
                    (dict(hysteresis=0), "hysteresis")):
        with pytest.raises(ValueError, match=rf"scale_update: {bad} must be a whole number "
                                             r"of at least 1"):
            scale_update(state, **kw)
    assert torch.equal(state, before)
    scale_update(state, growth_interval=np.int64(2), hysteresis=1)  # (any integral number)
    out = torch.zeros(2)
    with pytest.raises(ValueError, match=r"scale must be real, got a torch.complex64 tensor"):
        multi_tensor_scale([torch.ones(2)], [out], torch.tensor(2 + 1j), None)
    assert torch.equal(out, torch.zeros(2))
