"""Host-side promises of the norm kernels' launchers and of the launch machinery that the
other test files leave unchecked: what a kept launch keys on (16-byte alignment, the
number of runtime arguments), how the path switches nest, the LayerNorm and
SyncBatchNorm launchers' argument checks, dtypes and CPU-path arithmetic, and the
registry's tolerance lookup.

CPU only, tiny tensors; the kernels run in Triton's interpreter (``path`` fixture: also
the production CPU path); the meta device stands in for another device.
"""
import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from tritamp.kernels import engine
from tritamp.kernels import registry
from tritamp.kernels import layer_norm as LN
from tritamp.kernels import syncbn as BN
from tritamp.kernels.launch import KeptKernel, arg_key
from tritamp.testing import force_cpu_path


# --------------------------------------------------------------------------------------
# kept launches
# --------------------------------------------------------------------------------------

def test_arg_key_tells_an_8_byte_aligned_tensor_from_a_16_byte_aligned_one():
    base = torch.zeros(64)
    assert arg_key(base[2:]) == (torch.float32, False)  # 8 bytes in
    assert arg_key(base[4:]) == (torch.float32, True)   # 16 bytes in


def _two_runtime_args(a_ptr, n, BLOCK: tl.constexpr):
    pass


def test_a_kept_launch_refuses_the_wrong_number_of_runtime_arguments():
    # a JITFunction whatever TRITON_INTERPRET says: the direct launch path, refused
    # before anything reaches the driver
    kept = KeptKernel(JITFunction(_two_runtime_args))
    assert kept.direct
    x = torch.zeros(4)
    with pytest.raises(TypeError, match="3 runtime arguments given, the kernel takes 2"):
        kept.launch((1,), (x, 4, 5), dict(BLOCK=4), ())
    with pytest.raises(TypeError, match="1 runtime arguments given, the kernel takes 2"):
        kept.launch_keyed((1,), (x,), dict(BLOCK=4), ())
    assert len(kept) == 0


class _Which(KeptKernel):
    """Records which of the two launches launch_aligned chose."""

    def __init__(self):
        super().__init__(_two_runtime_args)
        self.calls = []

    def launch(self, grid, args, constexprs, constexpr_key):
        self.calls.append("computed")

    def launch_keyed(self, grid, args, constexprs, key):
        self.calls.append(("keyed", key))


def test_launch_aligned_keys_by_dtype_only_when_every_pointer_is_16_byte_aligned():
    base = torch.zeros(64)
    k = _Which()
    k.launch_aligned((1,), (base, 7), (base,), {}, "ck", (7,))
    k.launch_aligned((1,), (base[2:], 7), (base[2:],), {}, "ck", (7,))  # 8 bytes in
    k.launch_aligned((1,), (base, base[1:]), (base, base[1:]), {}, "ck", ())
    assert k.calls == [("keyed", ("ck", (7,), torch.float32)), "computed", "computed"]


# --------------------------------------------------------------------------------------
# the path switches
# --------------------------------------------------------------------------------------

def test_a_nested_force_cpu_path_leaves_the_outer_block_on_the_cpu_path():
    t = torch.zeros(2)
    outer = engine.use_triton(t)
    with force_cpu_path():
        with force_cpu_path():
            pass
        assert engine.cpu_path_forced() and not engine.use_triton(t)
    assert engine.use_triton(t) == outer and not engine.cpu_path_forced()


def test_a_nested_force_gpu_path_leaves_the_outer_block_on_the_gpu_code_path():
    cpu = torch.device("cpu")
    with engine.force_gpu_path():
        with engine.force_gpu_path():
            pass
        assert engine.gpu_path_forced() and engine.gpu_code_path(cpu)
        assert engine.sm_count(cpu) == 132  # (an H100's: the stand-in device)
    assert not engine.gpu_path_forced() and not engine.gpu_code_path(cpu)


# --------------------------------------------------------------------------------------
# LayerNorm / RMSNorm launchers
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, -4])
def test_layer_norm_refuses_a_row_width_that_is_not_positive(n, path):
    with pytest.raises(ValueError, match=f"not whole rows of {n}"):
        LN.layer_norm_fwd(torch.ones(2, 4), n)
    with pytest.raises(ValueError, match=f"not whole rows of {n}"):
        LN.layer_norm_bwd(torch.ones(2, 4), torch.ones(2, 4), n, rstd=torch.ones(2))


@pytest.mark.parametrize("name", ["weight", "bias"])
def test_layer_norm_refuses_a_parameter_on_another_device_by_name(name, path):
    x = torch.randn(2, 4)
    params = dict(weight=torch.ones(4), bias=torch.zeros(4))
    params[name] = params[name].to("meta")
    msg = f"{name} has 4 elements on meta; expected 4 \\(the normalized shape\\) on cpu"
    with pytest.raises(ValueError, match=msg):
        LN.layer_norm_fwd(x, 4, params["weight"], params["bias"])
    with pytest.raises(ValueError, match=msg):
        LN.layer_norm_bwd(torch.ones(2, 4), x, 4, params["weight"], params["bias"],
                          torch.zeros(2), torch.ones(2))


def test_layer_norm_reads_rows_of_a_column_strided_view_as_their_values(path):
    torch.manual_seed(0)
    base = torch.randn(3, 16)
    x = base[:, ::2]  # reshape keeps it a view: column stride 2
    w, b = torch.rand(8) + 0.5, torch.randn(8)
    y, mean, rstd = LN.layer_norm_fwd(x, 8, w, b)
    y_c, mean_c, rstd_c = LN.layer_norm_fwd(x.contiguous(), 8, w, b)
    assert torch.equal(y, y_c) and torch.equal(mean, mean_c) and torch.equal(rstd, rstd_c)
    dy = torch.randn(3, 8)
    got = LN.layer_norm_bwd(dy, x, 8, w, b, mean, rstd)
    want = LN.layer_norm_bwd(dy, x.contiguous(), 8, w, b, mean, rstd)
    for g, e in zip(got, want):
        assert torch.equal(g, e)
    assert torch.equal(base[:, 1::2], base[:, 1::2].clone())


def test_rms_norm_with_a_bias_adds_it_on_both_paths(path):
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 8), torch.rand(8) + 0.5, torch.randn(8)
    y, mean, rstd = LN.layer_norm_fwd(x, 8, w, b, rms=True)
    y_ref, _, rstd_ref = LN.layer_norm_fwd_ref(x, 8, w, b, rms=True)
    assert mean is None
    torch.testing.assert_close(y, y_ref, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(rstd, rstd_ref, rtol=1e-6, atol=0)
    y0, _, _ = LN.layer_norm_fwd(x, 8, w, None, rms=True)
    torch.testing.assert_close(y - y0, b.expand(3, 8), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_min_weight_is_eps_rounded_to_the_weights_dtype(dtype, monkeypatch):
    # a fresh cache, filled in both orders: each dtype keeps its own rounding of eps
    monkeypatch.setattr(LN, "_MIN_WEIGHT", {})
    want = float(torch.tensor(1e-5, dtype=dtype))
    others = [d for d in (torch.float32, torch.float16, torch.bfloat16) if d != dtype]
    for d in others:
        LN.min_weight(1e-5, d)
    assert LN.min_weight(1e-5, dtype) == want
    if dtype != torch.float32:
        assert want != float(torch.tensor(1e-5, dtype=torch.float32))


def test_memory_efficient_backward_divides_a_zero_fp16_weight_by_eps_in_fp16(path):
    # RMSNorm from its fp32 output with an fp16 weight whose last entry is 0: that
    # column's xhat is y / fp16(1e-5) (1.0014e-5), so its dx scales with 1 / 1.0014e-5
    torch.manual_seed(0)
    y, dy = torch.randn(2, 4), torch.randn(2, 4)
    w = torch.tensor([1.0, 0.5, 2.0, 0.0], dtype=torch.float16)
    rstd = torch.full((2,), 0.5)
    dx, dw, _ = LN.layer_norm_bwd(dy, y, 4, w, None, None, rstd, rms=True, from_output=True)
    div = float(torch.tensor(1e-5, dtype=torch.float16))
    c1 = (y * dy).mean(dim=1)
    torch.testing.assert_close(dx[:, 3], -(y[:, 3] / div) * c1 * rstd, rtol=1e-5, atol=0)


@pytest.mark.parametrize("from_output", [False, True], ids=["from_input", "from_output"])
def test_layer_norm_backward_gives_dx_in_x_dtype(from_output, path):
    # an fp16 input normalised into an fp32 output: dx takes the input's dtype even when
    # the saved tensor is the fp32 output
    torch.manual_seed(0)
    x = torch.randn(3, 8).half()
    w, b = torch.rand(8) + 0.5, torch.randn(8)
    y, mean, rstd = LN.layer_norm_fwd(x, 8, w, b, out_dtype=torch.float32)
    dy = torch.randn(3, 8)
    saved = y if from_output else x
    dx, dw, db = LN.layer_norm_bwd(dy, saved, 8, w, b, None if from_output else mean, rstd,
                                   from_output=from_output, x_dtype=torch.float16)
    assert dx.dtype == torch.float16 and dw.dtype == db.dtype == torch.float32
    want = LN.layer_norm_bwd_ref(dy, saved, 8, w, b, None if from_output else mean, rstd,
                                 from_output=from_output, x_dtype=torch.float16)
    torch.testing.assert_close(dx, want[0], rtol=1e-3, atol=1e-3)


def test_norm_settings_are_kept_apart_for_the_gpu_code_path_and_the_interpreter(monkeypatch):
    cpu = torch.device("cpu")
    n = 8192  # one pass on the GPU (up to 16384), chunks of 4096 in the interpreter
    for first_gpu in (True, False):
        monkeypatch.setattr(LN, "_SETTINGS", {})  # a fresh cache, filled in this order
        order = [True, False] if first_gpu else [False, True]
        got = {}
        for gpu in order:
            if gpu:
                with engine.force_gpu_path():
                    got[gpu] = (LN.norm_settings(n, cpu), LN.norm_settings(n, cpu, backward=True))
            else:
                got[gpu] = (LN.norm_settings(n, cpu), LN.norm_settings(n, cpu, backward=True))
        assert got[True] == ((8192, 32, True), (2048, 16, False)), first_gpu
        assert got[False] == ((4096, 16, False), (4096, 16, False)), first_gpu


# --------------------------------------------------------------------------------------
# SyncBatchNorm launchers
# --------------------------------------------------------------------------------------

def _bn_case(shape=(4, 3, 5)):
    torch.manual_seed(0)
    x = torch.randn(*shape) * 2 + 1
    rows, _ = BN.syncbn_stats_ref(x)
    mean, invstd, count = BN.syncbn_finalize_ref(rows, 1e-5)
    return x, rows, mean, invstd, count


def test_syncbn_geometry_is_kept_apart_for_the_gpu_code_path_and_the_interpreter(monkeypatch):
    x = torch.zeros(2, 3, 4096)
    for first_gpu in (True, False):
        monkeypatch.setattr(BN, "_GEOMETRIES", {})  # a fresh cache, filled in this order
        got = {}
        for gpu in ([True, False] if first_gpu else [False, True]):
            if gpu:
                with engine.force_gpu_path():
                    got[gpu] = BN._Geometry.of(x)
            else:
                got[gpu] = BN._Geometry.of(x)
        assert (got[True].BLOCK_R, got[True].emulate) == (2048, False), first_gpu
        assert (got[False].BLOCK_R, got[False].emulate) == (4096, True), first_gpu


def test_syncbn_refuses_a_non_contiguous_residual_or_output_gradient(path):
    x, _, mean, invstd, _ = _bn_case()
    bad = torch.randn(5, 3, 4).transpose(0, 2)  # x's shape, not contiguous
    assert bad.shape == x.shape and not bad.is_contiguous()
    with pytest.raises(ValueError, match="z must be contiguous with the input's shape"):
        BN.syncbn_forward(x, mean, invstd, z=bad)
    with pytest.raises(ValueError, match="dy must be contiguous with the input's shape"):
        BN.syncbn_backward_reduce(bad, x, mean, invstd)
    with pytest.raises(ValueError, match="dy must be contiguous with the input's shape"):
        BN.syncbn_backward_input(bad, x, mean, invstd)


def test_syncbn_finalize_refuses_a_running_mean_without_a_running_var_and_changes_nothing(path):
    _, rows, _, _, _ = _bn_case()
    running_mean = torch.full((3,), 0.25)
    with pytest.raises(ValueError, match="running_mean and running_var go together"):
        BN.syncbn_finalize(rows, 1e-5, running_mean, None)
    assert torch.equal(running_mean, torch.full((3,), 0.25))


def test_syncbn_forward_refuses_an_out_of_another_dtype(path):
    x, _, mean, invstd, _ = _bn_case()
    out = torch.zeros(x.shape, dtype=torch.float16)
    with pytest.raises(ValueError, match="out must be torch.float32, got torch.float16"):
        BN.syncbn_forward(x, mean, invstd, out=out)
    assert torch.equal(out, torch.zeros(x.shape, dtype=torch.float16))


def test_syncbn_parameter_gradients_take_each_parameters_dtype(path):
    x, _, mean, invstd, _ = _bn_case()
    dy = torch.randn(x.shape)
    w16, b32 = torch.ones(3, dtype=torch.float16), torch.zeros(3)
    sums, gw, gb = BN.syncbn_backward_reduce(dy, x, mean, invstd, w16, b32)
    assert gw.dtype == torch.float16 and gb.dtype == torch.float32
    torch.testing.assert_close(gb, dy.sum((0, 2)), rtol=1e-6, atol=1e-5)
    # a weight without a bias: the bias gradient is still given, in the weight's dtype
    sums, gw, gb = BN.syncbn_backward_reduce(dy, x, mean, invstd, torch.ones(3), None)
    assert gb is not None and gb.dtype == torch.float32
    torch.testing.assert_close(gb, dy.sum((0, 2)), rtol=1e-6, atol=1e-5)


def test_syncbn_residual_gradient_takes_the_residuals_dtype(path):
    x, _, mean, invstd, count = _bn_case()
    dy, z = torch.randn(x.shape), torch.randn(x.shape).half()
    sums, _, _ = BN.syncbn_backward_reduce(dy, x, mean, invstd, z=z, relu=True)
    dx, dz = BN.syncbn_backward_input(dy, x, mean, invstd, None, sums, count, z=z, relu=True,
                                      need_dz=True)
    assert dx.dtype == torch.float32 and dz.dtype == torch.float16
    y = BN.syncbn_forward_ref(x, mean, invstd, z=z)
    assert torch.equal(dz, torch.where(y <= 0, 0.0, dy).half())


# --------------------------------------------------------------------------------------
# the registry's tolerance lookup
# --------------------------------------------------------------------------------------

def test_registry_compares_dtypes_its_tables_do_not_name_exactly():
    assert registry.op("count_nonfinite").tolerance("kernel", "counts", torch.int32).exact
    l2 = registry.op("multi_tensor_l2norm")
    assert not l2.tolerance("cpu", "total", torch.float32).exact
    assert l2.tolerance("cpu", "total", torch.float16).exact


def test_registry_applies_an_outputs_override_to_its_indexed_entries():
    adam = registry.op("adam_step")
    assert not adam.tolerance("cpu", "params[1]", torch.float32).exact
    assert adam.tolerance("cpu", "steps[1]", torch.float32).exact
    assert adam.tolerance("cpu", "steps", torch.float32).exact


def test_syncbn_launchers_refuse_an_input_that_is_not_a_canonical_view_on_both_paths(path):
    """A 4-D [N, C, H, W] input (the module flattens it to [N, C, H*W] first) used to reach
    the CPU path's arithmetic, which lined the per-channel statistics up with H: with
    H == C a silently wrong output."""
    x = torch.randn(2, 3, 3, 1)
    mean, invstd = torch.tensor([10.0, 0.0, -10.0]), torch.ones(3)
    dy = torch.randn_like(x)
    with pytest.raises(ValueError, match=r"take a contiguous \[M, C\].*got shape \(2, 3, 3, 1\)"):
        BN.syncbn_forward(x, mean, invstd)
    with pytest.raises(ValueError, match=r"take a contiguous \[M, C\].*got shape \(2, 3, 3, 1\)"):
        BN.syncbn_backward_reduce(dy, x, mean, invstd)
    with pytest.raises(ValueError, match=r"take a contiguous \[M, C\].*got shape \(2, 3, 3, 1\)"):
        BN.syncbn_backward_input(dy, x, mean, invstd, None, torch.zeros(6), 12)
    # the canonical view of the same tensor normalises per channel
    y = BN.syncbn_forward(x.reshape(2, 3, 3), mean, invstd)
    assert torch.allclose((y - x.reshape(2, 3, 3))[0, :, 0], -mean)


def test_layer_norm_bwd_refuses_a_dy_or_statistics_that_do_not_match_the_rows(path):
    # dy, mean and rstd were trusted: a dy or mean of fewer rows was read past its end
    # (torch's CPU backward and the kernels index them by row without bounds), a strided
    # rstd was read as if contiguous, and mean=None went through on the kernel path
    x, w, b = torch.randn(4, 8), torch.randn(8), torch.randn(8)
    _, mean, rstd = LN.layer_norm_fwd(x, 8, w, b)
    dy = torch.ones(4, 8)
    for bad, match in ((dict(dy=torch.ones(2, 8)), r"dy is torch.float32 of shape \(2, 8\) on "
                        r"cpu; expected a float32/bfloat16/float16 tensor of the saved "
                        r"tensor's shape \(4, 8\)"),
                       (dict(dy=torch.ones(4, 8, dtype=torch.float64)), r"dy is torch.float64"),
                       (dict(mean=mean[:2].clone()), r"mean is torch.float32 of shape \(2,\) on "
                        r"cpu; pass the forward's mean: a contiguous float32 tensor of shape "
                        r"\(4,\)"),
                       (dict(mean=None), r"mean is None; pass the forward's mean"),
                       (dict(rstd=torch.stack([rstd, rstd], 1)[:, 0]), r"rstd is torch.float32 "
                        r"of shape \(4,\) on cpu, not contiguous"),
                       (dict(rstd=rstd.double()), r"rstd is torch.float64")):
        args = {"dy": dy, "mean": mean, "rstd": rstd, **bad}
        with pytest.raises(ValueError, match=r"layer_norm_bwd: " + match):
            LN.layer_norm_bwd(args["dy"], x, 8, w, b, args["mean"], args["rstd"])
    # RMSNorm and the memory-efficient backward take no mean
    _, _, rstd_rms = LN.layer_norm_fwd(x, 8, w, None, rms=True)
    assert LN.layer_norm_bwd(dy, x, 8, w, None, None, rstd_rms, rms=True)[0].shape == (4, 8)
