"""tritamp.normalization: Apex's modules and functional forms, torch checkpoints both ways,
autocast, every amp opt level, the custom ops under torch.compile."""
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import TOL
import tritamp
from tritamp import amp
from tritamp.normalization import (FusedLayerNorm, FusedLayerNormAffineFunction, FusedRMSNorm,
                                   MixedFusedLayerNorm, MixedFusedRMSNorm, fused_layer_norm,
                                   fused_layer_norm_affine, fused_rms_norm, fused_rms_norm_affine,
                                   mixed_dtype_fused_layer_norm_affine,
                                   mixed_dtype_fused_rms_norm_affine)


def _randomise(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return m


def _fwd_bwd(m, x, dy):
    x = x.detach().clone().requires_grad_()
    y = m(x)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("shape", [(4, 3, 20), (2, 5, 6, 7)])
@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("affine", [True, False])
def test_fused_layer_norm_matches_nn_layer_norm(shape, affine, memory_efficient):
    n_shape = shape[-1:] if len(shape) == 3 else shape[-2:]
    ours = _randomise(FusedLayerNorm(n_shape, elementwise_affine=affine,
                                     memory_efficient=memory_efficient))
    ref = nn.LayerNorm(n_shape, elementwise_affine=affine)
    ref.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    y, dx, grads = _fwd_bwd(ours, x, dy)
    ty, tdx, tgrads = _fwd_bwd(ref, x, dy)
    torch.testing.assert_close(y, ty, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, tdx, rtol=1e-4, atol=1e-5)
    for a, b in zip(grads, tgrads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("affine", [True, False])
def test_fused_rms_norm_matches_nn_rms_norm(affine, memory_efficient):
    ours = _randomise(FusedRMSNorm(24, elementwise_affine=affine, memory_efficient=memory_efficient))
    ref = nn.RMSNorm(24, eps=1e-5, elementwise_affine=affine)
    ref.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(3, 5, 24, generator=g), torch.randn(3, 5, 24, generator=g)
    y, dx, grads = _fwd_bwd(ours, x, dy)
    ty, tdx, tgrads = _fwd_bwd(ref, x, dy)
    torch.testing.assert_close(y, ty, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, tdx, rtol=1e-4, atol=1e-5)
    for a, b in zip(grads, tgrads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_state_dicts_load_both_ways():
    for fused, plain in ((FusedLayerNorm(10), nn.LayerNorm(10)), (FusedRMSNorm(10), nn.RMSNorm(10)),
                         (MixedFusedLayerNorm(10), nn.LayerNorm(10)),
                         (MixedFusedRMSNorm(10), nn.RMSNorm(10))):
        assert isinstance(fused, type(plain))
        assert list(fused.state_dict()) == list(plain.state_dict())
        _randomise(plain, 3)
        fused.load_state_dict(plain.state_dict())
        for a, b in zip(fused.parameters(), plain.parameters()):
            assert torch.equal(a, b)
        _randomise(fused, 4)
        plain.load_state_dict(fused.state_dict())
        for a, b in zip(fused.parameters(), plain.parameters()):
            assert torch.equal(a, b)


def test_apex_signatures_and_defaults():
    for cls in (FusedLayerNorm, FusedRMSNorm):
        params = inspect.signature(cls.__init__).parameters
        assert list(params)[1:5] == ["normalized_shape", "eps", "elementwise_affine", "memory_efficient"]
        assert params["eps"].default == 1e-5 and params["memory_efficient"].default is False
    assert FusedRMSNorm(8).eps == 1e-5
    for fn in (fused_layer_norm_affine, fused_layer_norm, mixed_dtype_fused_layer_norm_affine,
               fused_rms_norm_affine, fused_rms_norm, mixed_dtype_fused_rms_norm_affine):
        params = inspect.signature(fn).parameters
        assert params["eps"].default == 1e-6, fn.__name__
        assert params["memory_efficient"].default is False
    m = FusedLayerNorm(16)
    assert repr(m) == "FusedLayerNorm((16,), eps=1e-05, elementwise_affine=True, bias=True)"


def test_mixed_elementwise_affine_argument():
    with pytest.warns(UserWarning, match="does not support `elementwise_affine` argument"):
        MixedFusedLayerNorm(8, elementwise_affine=True)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="elementwise_affine = False"):
        MixedFusedRMSNorm(8, elementwise_affine=False)


@pytest.mark.parametrize("cls", [MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_mixed_norms_ignore_other_keywords_as_apex_does(cls):
    """Apex's Mixed* constructors drop keywords they do not know (its transformer layers
    pass sequence_parallel_enabled): ignored here too, with a warning naming them."""
    with pytest.warns(UserWarning, match=r"ignores the keyword argument\(s\) "
                                         r"\['sequence_parallel_enabled'\]"):
        m = cls(8, sequence_parallel_enabled=True)
    assert m.weight.shape == (8,) and not hasattr(m, "sequence_parallel_enabled")
    if cls is MixedFusedRMSNorm:  # (an RMSNorm has no bias: Apex's ignores the keyword)
        with pytest.warns(UserWarning, match=r"\['bias'\]"):
            assert cls(8, bias=False).weight.shape == (8,)
    else:
        assert MixedFusedLayerNorm(8, bias=False).bias is None


def test_functional_forms_match_torch():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 30, generator=g)
    w = 1 + 0.2 * torch.randn(30, generator=g)
    b = 0.2 * torch.randn(30, generator=g)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_layer_norm_affine(x, w, b, (30,)), F.layer_norm(x, (30,), w, b, 1e-6), **tol)
    torch.testing.assert_close(fused_layer_norm(x, 30), F.layer_norm(x, (30,), eps=1e-6), **tol)
    torch.testing.assert_close(fused_rms_norm_affine(x, w, (30,)), F.rms_norm(x, (30,), w, 1e-6), **tol)
    torch.testing.assert_close(fused_rms_norm(x, [30]), F.rms_norm(x, (30,), eps=1e-6), **tol)
    torch.testing.assert_close(FusedLayerNormAffineFunction.apply(x, w, b, (30,), 1e-6),
                               F.layer_norm(x, (30,), w, b, 1e-6), **tol)


def test_non_contiguous_parameters_get_gradients_in_their_layout():
    """A 2-D normalized shape with transposed weight and bias: each gradient comes back
    with its parameter's shape and values (the launchers write row-major buffers)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 5, 6, generator=g)
    dy = torch.randn(3, 5, 6, generator=g)
    w_base = (1 + 0.2 * torch.randn(6, 5, generator=g)).requires_grad_()
    b_base = (0.2 * torch.randn(6, 5, generator=g)).requires_grad_()
    w, b = w_base.t(), b_base.t()
    assert not w.is_contiguous() and not b.is_contiguous()
    grads = []
    for fn in (lambda xx: fused_layer_norm_affine(xx, w, b, (5, 6), 1e-5),
               lambda xx: F.layer_norm(xx, (5, 6), w, b, 1e-5)):
        xx = x.clone().requires_grad_()
        fn(xx).backward(dy)
        grads.append((xx.grad, w_base.grad.clone(), b_base.grad.clone()))
        w_base.grad = b_base.grad = None
    for ours, want in zip(*grads):
        torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_create_graph_gives_the_gradients_and_refuses_a_second_derivative(cls):
    """backward(create_graph=True) returns the same first-order gradients; differentiating
    them again raises, as torch's once_differentiable makes it (no silent zeros)."""
    m = _randomise(cls(16))
    g = torch.Generator().manual_seed(12)
    x = torch.randn(4, 16, generator=g)
    dy = torch.randn(4, 16, generator=g)
    _, want_dx, want_grads = _fwd_bwd(m, x, dy)
    m.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_()
    dy_leaf = dy.clone().requires_grad_()  # (a differentiable incoming gradient)
    (dx,) = torch.autograd.grad(m(xx), xx, dy_leaf, create_graph=True)
    torch.testing.assert_close(dx.detach(), want_dx, rtol=0, atol=0)
    assert dx.requires_grad
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dx.sum().backward()
    # without create_graph the gradient is a plain tensor
    m.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(m(xx), xx, dy)
    assert not dx.requires_grad
    torch.testing.assert_close(dx, want_dx, rtol=0, atol=0)


def test_mixed_output_takes_parameter_dtype():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 32, generator=g).bfloat16().requires_grad_()
    m = _randomise(MixedFusedLayerNorm(32))
    y = m(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, F.layer_norm(x.detach().float(), (32,), m.weight, m.bias, 1e-5),
                               rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and m.weight.grad.dtype == torch.float32
    r = MixedFusedRMSNorm(32).bfloat16()
    assert mixed_dtype_fused_rms_norm_affine(x.detach().float(), r.weight, (32,)).dtype == torch.bfloat16
    # the plain module keeps the input's dtype with fp32 weights
    assert FusedLayerNorm(32)(x.detach()).dtype == torch.bfloat16


def test_half_input_fp32_weights_under_autocast():
    """Apex O1 failed on a half input with fp32 LayerNorm weights; here it just works."""
    g = torch.Generator().manual_seed(7)
    m = _randomise(FusedLayerNorm(48))
    ref = nn.LayerNorm(48)
    ref.load_state_dict(m.state_dict())
    x = torch.randn(5, 48, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x.bfloat16().requires_grad_()          # half activations from an autocast matmul
        y = m(h)
        assert y.dtype == torch.bfloat16            # the autocast dtype, as Apex's casts gave
        y32 = m(x)                                  # fp32 input: also the autocast dtype
        assert y32.dtype == torch.bfloat16
    y.float().sum().backward()
    assert h.grad.dtype == torch.bfloat16 and m.weight.grad.dtype == torch.float32
    want = ref(x.bfloat16().float())
    torch.testing.assert_close(y.float(), want, rtol=1.6e-2, atol=1e-2)


def test_bad_input_errors():
    m = FusedLayerNorm(8)
    # torch's message, to the character
    with pytest.raises(RuntimeError) as theirs:
        nn.LayerNorm(8)(torch.randn(3, 7))
    with pytest.raises(RuntimeError, match=r"expected input with shape \[\*, 8\]") as ours:
        m(torch.randn(3, 7))
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(TypeError, match="got torch.int64"):
        fused_layer_norm(torch.ones(3, 8, dtype=torch.long), 8)
    with pytest.raises(TypeError, match="got torch.float8_e4m3fn"):
        m(torch.ones(3, 8).to(torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="weights; got torch.int64"):
        fused_layer_norm_affine(torch.ones(3, 8), torch.ones(8, dtype=torch.long),
                                torch.zeros(8), 8)
    for dtype in (torch.int32, torch.bool):  # used as floats before
        with pytest.raises(TypeError, match=f"bias; got {dtype}"):
            fused_layer_norm_affine(torch.ones(3, 8), torch.ones(8),
                                    torch.zeros(8, dtype=dtype), 8)
    for fn in (mixed_dtype_fused_layer_norm_affine, mixed_dtype_fused_rms_norm_affine):
        args = (None, None) if fn is mixed_dtype_fused_layer_norm_affine else (None,)
        with pytest.raises(ValueError, match="need a weight; got weight=None"):
            fn(torch.ones(3, 8), *args, (8,))


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_a_numpy_integer_normalized_shape(path, cls):
    """A width from numpy (np.prod, a config) works as torch's modules take it: it reached
    the kernels' launch settings as a numpy integer and failed at the first forward on the
    GPU code path."""
    np = pytest.importorskip("numpy")
    x = torch.randn(3, 6)
    for shape in (np.int64(6), (np.int64(6),), [np.int64(2), np.int64(3)]):
        xs = x.view(3, 2, 3) if isinstance(shape, list) else x
        m = cls(shape)
        ref = (nn.LayerNorm if cls is FusedLayerNorm else nn.RMSNorm)(shape, eps=m.eps)
        ref.load_state_dict(m.state_dict())
        torch.testing.assert_close(m(xs), ref(xs), rtol=1e-5, atol=1e-5)
    f = fused_layer_norm if cls is FusedLayerNorm else fused_rms_norm
    torch.testing.assert_close(f(x, np.int64(6)), f(x, 6), rtol=0, atol=0)


@pytest.mark.parametrize("call", ["weight", "bias", "rms weight", "numel", "empty shape",
                                  "bias alone"])
def test_parameter_and_shape_errors_are_torchs(call):
    """A weight or bias not shaped as normalized_shape is refused as torch refuses it,
    even with the right number of elements (a transposed weight would otherwise be
    applied in flattened order); an empty normalized_shape likewise."""
    x = torch.randn(2, 4, 6)
    w, b = torch.ones(4, 6), torch.zeros(4, 6)
    ours, theirs = {
        "weight": (lambda: fused_layer_norm_affine(x, w.t(), b, (4, 6)),
                   lambda: F.layer_norm(x, (4, 6), w.t(), b)),
        "bias": (lambda: fused_layer_norm_affine(x, w, b.t(), (4, 6)),
                 lambda: F.layer_norm(x, (4, 6), w, b.t())),
        "rms weight": (lambda: fused_rms_norm_affine(x, w.reshape(24), (4, 6)),
                       lambda: F.rms_norm(x, (4, 6), w.reshape(24))),
        "numel": (lambda: fused_layer_norm_affine(x, torch.ones(5), torch.zeros(5), (4, 6)),
                  lambda: F.layer_norm(x, (4, 6), torch.ones(5), torch.zeros(5))),
        "empty shape": (lambda: fused_layer_norm(x, ()), lambda: F.layer_norm(x, ())),
        # a bias shaped wrong with no weight: the modules' shortcut skipped its check
        "bias alone": (lambda: fused_layer_norm_affine(x[..., 0], None, b[0].view(2, 3), (6,)),
                       lambda: F.layer_norm(x[..., 0], (6,), None, b[0].view(2, 3))),
    }[call]
    with pytest.raises(RuntimeError) as want:
        theirs()
    with pytest.raises(RuntimeError) as got:
        ours()
    assert str(got.value) == str(want.value)


def test_zero_width_rows_give_torchs_empty_output(path):
    x = torch.randn(3, 0, requires_grad=True)
    for m in (FusedLayerNorm(0), FusedRMSNorm(0)):
        y = m(x)
        assert y.shape == (3, 0) and y.grad_fn is not None
        y.sum().backward()
        assert x.grad.shape == (3, 0) and m.weight.grad.shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_eps_none_is_torchs_machine_epsilon(path, dtype):
    """FusedRMSNorm(eps=None), torch.nn.RMSNorm's default: the machine epsilon of the
    dtype torch computes in, fp32 for half input (the half dtype's own, 0.0078 for bf16,
    shrank rows of small activations by up to 80x)."""
    x = (0.01 * torch.randn(4, 8)).to(dtype)
    ours = FusedRMSNorm(8, eps=None).to(dtype)(x)
    want = torch.nn.RMSNorm(8, eps=None).to(dtype)(x)
    torch.testing.assert_close(ours, want)
    truth = F.rms_norm(x.double(), (8,), eps=torch.finfo(torch.float32).eps)
    torch.testing.assert_close(ours.double(), truth, **TOL[dtype])


@pytest.mark.parametrize("cls,op", [(FusedLayerNorm, "layer_norm"), (FusedRMSNorm, "rms_norm")])
def test_an_eps_that_is_not_a_number_is_refused_in_torchs_words(cls, op):
    # (float() took the string "1e-5", which torch's norms refuse)
    m = cls(4)
    m.eps = "1e-5"
    with pytest.raises(TypeError, match=rf"^{op}\(\): argument 'eps' must be float, not str$"):
        m(torch.randn(2, 4))
    m.eps = torch.tensor(1e-5)  # one element, as torch takes it
    torch.testing.assert_close(m(torch.ones(2, 4)), torch.zeros(2, 4) if op == "layer_norm"
                               else torch.ones(2, 4), **TOL[torch.float32])


def test_autocast_leaves_float64_input_alone(path):
    """torch's autocast (and so Apex's casts) never cast float64: neither do the norms."""
    x = torch.randn(4, 8, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert FusedLayerNorm(8)(x).dtype == torch.float64
        assert FusedRMSNorm(8)(x).dtype == torch.float64
        assert FusedLayerNorm(8)(x.float()).dtype == torch.bfloat16


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_nothing_to_differentiate_gives_the_same_output_without_a_graph(path, cls):
    """Under no_grad, or with nothing requiring a gradient, the launcher runs without the
    autograd Function: the same values, no graph. One parameter requiring a gradient
    (the bias alone, through the functional form) still gets it."""
    m = _randomise(cls(8).bfloat16())
    x = torch.randn(3, 8).bfloat16()
    want = m(x.requires_grad_()).detach()
    x = x.detach()
    with torch.no_grad():
        got = m(x)
    assert got.grad_fn is None and torch.equal(got, want)
    m.requires_grad_(False)
    got = m(x)
    assert got.grad_fn is None and torch.equal(got, want)
    b = torch.randn(8, requires_grad=True)
    y = fused_layer_norm_affine(x.float(), None, b, (8,), 1e-5)
    y.sum().backward()
    torch.testing.assert_close(b.grad, torch.full((8,), 3.0))


def test_custom_op_registration_and_compile():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 16, generator=g, requires_grad=True)
    w = (1 + 0.1 * torch.randn(16, generator=g)).requires_grad_()
    b = (0.1 * torch.randn(16, generator=g)).requires_grad_()
    torch.library.opcheck(torch.ops.tritamp.fused_norm_fwd.default,
                          (x, w, b, 16, 1e-5, False, torch.float32, False))
    torch.library.opcheck(torch.ops.tritamp.fused_norm_fwd.default,
                          (x, w, None, 16, 1e-5, True, torch.float32, True))
    m = _randomise(FusedLayerNorm(16))
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    torch.testing.assert_close(y, m(x), rtol=0, atol=0)
    y.sum().backward()
    assert x.grad is not None and m.weight.grad is not None


class Block(nn.Module):
    """A pre-norm transformer block built with whichever LayerNorm class it is given."""

    def __init__(self, norm, d=32, heads=4):
        super().__init__()
        self.ln1, self.ln2 = norm(d), norm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        return self.head(x).mean()


def _train(norm, opt_level, steps=3):
    torch.manual_seed(0)
    model = Block(norm)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, half_dtype=torch.bfloat16,
                                verbosity=0)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(2, 6, 32, generator=g)
        loss = model(x).float()
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_drop_in_for_layer_norm_at_every_opt_level(opt_level):
    """Swapping nn.LayerNorm for FusedLayerNorm in a transformer block changes nothing else."""
    fused_losses, fused_model = _train(FusedLayerNorm, opt_level)
    plain_losses, plain_model = _train(nn.LayerNorm, opt_level)
    tol = dict(rtol=1e-5, atol=1e-6) if opt_level == "O0" else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(plain_losses), **tol)
    for (name, a), (_, b) in zip(fused_model.state_dict().items(), plain_model.state_dict().items()):
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=name)


def test_exported_from_package():
    import tritamp.normalization as norm
    assert tritamp.normalization is norm
    assert set(norm.__all__) >= {"FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm",
                                 "MixedFusedRMSNorm"}


@pytest.mark.parametrize("cpu_path", [False, True], ids=["triton", "cpu-path"])
@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
def test_the_output_takes_in_place_ops_as_torchs_does(cls, cpu_path):
    """``y.add_(1)`` or ``ReLU(inplace=True)`` after the norm, as after torch's modules (the
    CPU path returned a view, which autograd refuses to modify in place)."""
    import contextlib

    from tritamp.testing import force_cpu_path
    torch.manual_seed(0)
    for shape in ((2, 4), (2, 3, 4)):
        m = cls(4)
        x = torch.randn(*shape, requires_grad=True)
        ref_x = x.detach().clone().requires_grad_()
        with force_cpu_path() if cpu_path else contextlib.nullcontext():
            y = m(x)
            y.add_(1.0).relu_()
            y.sum().backward()
        ref = (nn.LayerNorm(4) if cls is FusedLayerNorm else nn.RMSNorm(4, eps=1e-5))(ref_x)
        ref.add_(1.0).relu_()
        ref.sum().backward()
        torch.testing.assert_close(y, ref)
        torch.testing.assert_close(x.grad, ref_x.grad)


@pytest.mark.parametrize("cpu_path", [False, True], ids=["triton", "cpu-path"])
@pytest.mark.parametrize("rms", [False, True])
def test_float64_is_normalised_in_float64(rms, cpu_path):
    """The kernels compute in float32: float64 goes to torch's own norm in float64 (it was
    computed in float32 on the Triton path, and refused with torch's mixed-dtype error on
    the CPU path)."""
    import contextlib

    from tritamp.testing import force_cpu_path
    torch.manual_seed(0)
    x = (1 + 1e-9 * torch.randn(3, 8, dtype=torch.float64)).requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    m = (FusedRMSNorm(8, eps=1e-12) if rms else FusedLayerNorm(8, eps=1e-12)).double()
    with force_cpu_path() if cpu_path else contextlib.nullcontext():
        y = m(x)
        y.sum().backward()
    if rms:
        ref = F.rms_norm(ref_x, [8], m.weight.detach(), 1e-12)
    else:
        ref = F.layer_norm(ref_x, [8], m.weight.detach(), m.bias.detach(), 1e-12)
    ref.sum().backward()
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("rms", [False, True])
def test_memory_efficient_zero_weight_with_an_eps_fp16_cannot_hold(path, rms):
    """eps = 1e-8 (BERT's 1e-12 alike) rounds to 0 in fp16, where Apex's clamp then divides
    0 by 0: the clamp is at least fp16's smallest positive number, and every gradient of
    a zero-initialised column stays finite."""
    cls = FusedRMSNorm if rms else FusedLayerNorm
    m = cls(8, eps=1e-8, memory_efficient=True).half()
    with torch.no_grad():
        m.weight[0] = 0.0
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 8, generator=g).half()
    dy = torch.randn(2, 8, generator=g).half()
    _, dx, params = _fwd_bwd(m, x, dy)
    assert torch.isfinite(dx).all() and all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("rms", [False, True])
def test_memory_efficient_fp16_weights_above_eps_are_not_clamped(path, rms):
    """fp16 holds eps=1e-5 as the subnormal 1.0014e-5 (Apex's clamp divides by that): a
    weight of 3e-5 is above it and divides as itself. The clamp was fp16's smallest
    normal number (6.1e-5), which halved that column's weight gradient."""
    cls = FusedRMSNorm if rms else FusedLayerNorm
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g).half()
    dy = torch.randn(4, 8, generator=g).half()
    grads = []
    for memory_efficient in (False, True):
        m = cls(8, memory_efficient=memory_efficient).half()
        with torch.no_grad():
            m.weight[3] = 3e-5
        grads.append(_fwd_bwd(m, x, dy)[2][0].float())
    torch.testing.assert_close(grads[1], grads[0], rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("max_block", [None, 16], ids=["one-pass", "chunked"])
@pytest.mark.parametrize("eps", [1e-3, 0.1])
@pytest.mark.parametrize("rms", [False, True])
def test_memory_efficient_weights_under_eps_leave_the_other_columns_exact(path, rms, eps,
                                                                          max_block):
    """A weight under eps is raised to eps where it divides (Apex's clamp), which makes
    its own column's xhat wrong; the row sum every column's dx needs is formed from
    (y - bias) * dy, with no division, as Apex's kernel forms it, so the other columns'
    input gradients are the ordinary backward's to fp32 precision (they took the clamped
    column's error: 1e-4 off at eps 1e-3, 8e-3 at eps 0.1)."""
    from tritamp.kernels.layer_norm import layer_norm_bwd, layer_norm_fwd
    n = 48
    g = torch.Generator().manual_seed(5)
    w = 1 + 0.3 * torch.randn(n, generator=g)
    w[:3] = eps / 5
    b = None if rms else 0.1 * torch.randn(n, generator=g)
    x = torch.randn(16, n, generator=g) * 2 + 0.5
    dy = torch.randn(16, n, generator=g)
    y, mean, rstd = layer_norm_fwd(x, n, w, b, eps, rms, max_block=max_block)
    want, _, _ = layer_norm_bwd(dy, x, n, w, b, mean, rstd, rms, max_block=max_block, eps=eps)
    got, _, _ = layer_norm_bwd(dy, y, n, w, b, None, rstd, rms, from_output=True,
                               max_block=max_block, eps=eps)
    scale = want[:, 3:].abs().max()
    assert (got[:, 3:] - want[:, 3:]).abs().max() <= 2e-6 * scale
    assert (got[:, :3] - want[:, :3]).abs().max() > 1e-3 * scale  # (the clamped columns)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_efficient_with_zero_weights_gives_apexs_finite_gradients(path, rms, dtype):
    """memory_efficient rebuilds xhat = (y - bias) / weight; as Apex, the weight divides with
    its magnitude raised to at least eps, so a column whose weight is under eps gets
    xhat * |w| / eps (0 for a zero weight). Every gradient is finite (dividing by the zero
    gave NaN); the bias gradient and the other columns' input gradients are the ordinary
    backward's; that column's weight gradient is scaled by |w| / eps; everything matches
    the oracle, which clamps the same way."""
    from tritamp.kernels.layer_norm import layer_norm_bwd_ref, layer_norm_fwd_ref
    n, eps = 40, 1e-3
    cls = FusedRMSNorm if rms else FusedLayerNorm
    g = torch.Generator().manual_seed(7)
    w = 1 + 0.3 * torch.randn(n, generator=g)
    small = [3, 11, 20]
    w[3], w[11], w[20] = 0.0, 2e-4, -2e-4         # zero, and under eps with both signs
    x = torch.randn(6, n, generator=g).to(dtype)
    dy = torch.randn(6, n, generator=g).to(dtype)
    grads = {}
    for me in (False, True):
        m = cls(n, eps=eps, memory_efficient=me).to(dtype)
        with torch.no_grad():
            m.weight.copy_(w)
            if not rms:
                m.bias.copy_(0.1 * torch.randn(n, generator=torch.Generator().manual_seed(8)))
        _, dx, params = _fwd_bwd(m, x, dy)
        grads[me] = (dx.float(), [p.float() for p in params])
    (dx0, p0), (dx1, p1) = grads[False], grads[True]
    assert torch.isfinite(dx1).all() and all(torch.isfinite(p).all() for p in p1)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    keep = torch.ones(n, dtype=torch.bool)
    keep[small] = False
    torch.testing.assert_close(dx1[:, keep], dx0[:, keep], **tol)
    if not rms:
        torch.testing.assert_close(p1[1], p0[1], **tol)  # the bias gradient
    dw0, dw1 = p0[0], p1[0]
    torch.testing.assert_close(dw1[keep], dw0[keep], **tol)
    assert dw1[3] == 0 and dw0[3] != 0
    weight = m.weight.detach()  # as the norm holds it (rounded to dtype)
    bias = None if rms else m.bias.detach()
    min_w = float(torch.tensor(eps, dtype=dtype))
    # (a bf16 output with a bias holds w * xhat = 2e-4 * xhat under the bias's rounding:
    # y - bias is noise there, whatever the divisor)
    for j in ((11, 20) if dtype == torch.float32 or rms else ()):
        torch.testing.assert_close(dw1[j], dw0[j] * weight[j].float().abs() / min_w,
                                   rtol=1e-3 if dtype == torch.float32 else 0.05, atol=1e-4)
    # the oracle, from the same output, clamping the same way
    y, _, rstd = layer_norm_fwd_ref(x, n, weight, bias, eps, rms)
    rdx, rdw, rdb = layer_norm_bwd_ref(dy, y, n, weight, bias, None, rstd, rms,
                                       from_output=True, eps=eps)
    torch.testing.assert_close(dx1, rdx.float(), **tol)
    torch.testing.assert_close(dw1, rdw.float(), **tol)


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm])
def test_export_and_trace_give_torchs_norm_ops(cls):
    """torch.export (and torch.onnx.export, which goes through it) and torch.jit.trace
    record torch's own norm op, as Apex's norms do under tracing: the graph runs, saves and
    converts without tritamp's custom op (export refused: no ONNX function for it; a trace
    failed its check and could not be saved). torch.compile keeps the fused op."""
    import io
    import warnings
    m = cls((3, 8))
    with torch.no_grad():
        for p in m.parameters():
            p.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 8)
    want = m(x)
    ep = torch.export.export(m, (x,))
    targets = {str(node.target) for node in ep.graph.nodes if node.op == "call_function"}
    assert not any("tritamp" in t for t in targets), targets
    assert any(t.startswith("aten.layer_norm" if cls is not FusedRMSNorm else "aten.rms_norm")
               for t in targets), targets
    torch.testing.assert_close(ep.module()(x), want, rtol=1e-6, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (torch.jit.trace is deprecated)
        traced = torch.jit.trace(m, (x,))
        buf = io.BytesIO()
        torch.jit.save(traced, buf)
        buf.seek(0)
        loaded = torch.jit.load(buf)
    torch.testing.assert_close(loaded(x), want, rtol=1e-6, atol=1e-6)


def test_memory_efficient_half_layer_norm_gives_a_zero_weight_column_no_rounding_noise(path):
    # A half output where the weight is 0 is the bias rounded: (y - bias) / eps turned its
    # rounding error into an xhat of thousands, and that column's weight gradient came out
    # 50.5 (the documented 0) and its input gradient 7.4 off
    # (fp32 parameters, bf16 input: the output is bf16, the bias fp32)
    torch.manual_seed(0)
    x = torch.randn(8, 32).bfloat16().requires_grad_()
    ln = FusedLayerNorm(32, memory_efficient=True)
    with torch.no_grad():
        ln.weight[3] = 0.0
        ln.bias.normal_()
    assert ln.bias[3].bfloat16().float() != ln.bias[3]  # (the bias does not round exactly)
    dy = torch.randn(8, 32)
    (ln(x).float() * dy).sum().backward()
    assert ln.weight.grad[3] == 0
    ref = torch.nn.LayerNorm(32)
    ref.load_state_dict(ln.state_dict())
    x2 = x.detach().clone().requires_grad_()
    (ref(x2).float() * dy).sum().backward()
    err = (x.grad.float() - x2.grad.float()).abs()
    assert err[:, 3].max() < 0.5  # (its xhat is unknown: 0 stands in for it)
    others = torch.ones(32, dtype=torch.bool)
    others[3] = False
    assert err[:, others].max() < 0.05
