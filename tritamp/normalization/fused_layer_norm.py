"""FusedLayerNorm / FusedRMSNorm and their functional forms (Apex's names and defaults).

The kernels are registered as the custom ops ``tritamp::fused_norm_fwd`` and
``tritamp::fused_norm_bwd`` with fake (meta) implementations and an autograd formula, so
``torch.compile`` sees one opaque op per direction and never traces into Triton.

Dtypes. Statistics and arithmetic are fp32 whatever the dtypes. The output takes the
input's dtype (``FusedLayerNorm``) or the weight's (the ``Mixed`` variants, Megatron
style); under ``torch.autocast`` it takes the autocast dtype, as Apex's casts gave. A half
input with fp32 weights is read as it is: nothing is cast on the way in, and each gradient
comes back in the dtype of the tensor it belongs to.
"""
import numbers
import operator
import warnings
from typing import Optional

import torch
from torch import nn

from ..kernels.layer_norm import layer_norm_bwd, layer_norm_bwd_prechecked, layer_norm_fwd

_EMPTY = (0,)


@torch.library.custom_op("tritamp::fused_norm_fwd", mutates_args=())
def _norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
              n: int, eps: float, rms: bool, out_dtype: torch.dtype,
              memory_efficient: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, mean, rstd = layer_norm_fwd(x, n, weight, bias, eps, rms, out_dtype)
    return y, (rstd.new_empty(_EMPTY) if mean is None else mean), rstd


@_norm_fwd.register_fake
def _norm_fwd_fake(x, weight, bias, n, eps, rms, out_dtype, memory_efficient):
    rows = x.numel() // n
    y = x.new_empty(x.shape, dtype=out_dtype)
    stat = dict(dtype=torch.float32)
    return y, x.new_empty(_EMPTY if rms else (rows,), **stat), x.new_empty((rows,), **stat)


@torch.library.custom_op("tritamp::fused_norm_bwd", mutates_args=())
def _norm_bwd(dy: torch.Tensor, saved: torch.Tensor, weight: Optional[torch.Tensor],
              bias: Optional[torch.Tensor], mean: torch.Tensor, rstd: torch.Tensor, n: int,
              rms: bool, from_output: bool, x_dtype: torch.dtype,
              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = layer_norm_bwd(dy, saved, n, weight, bias, None if rms or from_output else mean,
                                rstd, rms, from_output, x_dtype, eps=eps)
    return (dx, dy.new_empty(_EMPTY) if dw is None else dw,
            dy.new_empty(_EMPTY) if db is None else db)


@_norm_bwd.register_fake
def _norm_bwd_fake(dy, saved, weight, bias, mean, rstd, n, rms, from_output, x_dtype, eps):
    dx = saved.new_empty(saved.shape, dtype=x_dtype)
    dw = dy.new_empty(_EMPTY) if weight is None else torch.empty_like(weight)
    db = dy.new_empty(_EMPTY) if bias is None or rms else torch.empty_like(bias)
    return dx, dw, db


def _norm_setup_context(ctx, inputs, output):
    x, weight, bias, n, eps, rms, out_dtype, memory_efficient = inputs
    y, mean, rstd = output
    # memory_efficient keeps the output instead of the input (Apex): xhat is recomputed
    # from it as (y - bias) / weight, each weight's magnitude at least eps (Apex's clamp).
    ctx.save_for_backward(y if memory_efficient else x, weight, bias, mean, rstd)
    ctx.n, ctx.rms, ctx.from_output, ctx.x_dtype = n, rms, memory_efficient, x.dtype
    ctx.eps = eps


def _norm_backward(ctx, dy, _dmean, _drstd):
    saved, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = _norm_bwd(dy.contiguous(), saved, weight, bias, mean, rstd, ctx.n, ctx.rms,
                           ctx.from_output, ctx.x_dtype, ctx.eps)
    return _input_grads(dx, dw, db, weight, bias, ctx.rms)


def _input_grads(dx, dw, db, weight, bias, rms):
    """The gradients of the forward's eight inputs: ``dw`` / ``db`` only where there is a
    weight / a bias (the kernels hand placeholders back otherwise)."""
    return (dx, dw if weight is not None else None,
            db if bias is not None and not rms else None, None, None, None, None, None)


_norm_fwd.register_autograd(_norm_backward, setup_context=_norm_setup_context)


def _eager_grads(ctx, dy):
    saved, weight, bias, mean, rstd = ctx.saved_tensors
    n, rms, from_output, x_dtype, eps = ctx.config
    # (the forward checked saved, weight and bias)
    dx, dw, db = layer_norm_bwd_prechecked(dy.contiguous(), saved, n, weight, bias,
                                           None if rms or from_output else mean, rstd, rms,
                                           from_output, x_dtype, eps=eps)
    return _input_grads(dx, dw, db, weight, bias, rms)


# create_graph=True: the gradients are not differentiable again (torch's wrapper makes a
# second backward through them raise)
_eager_grads_once = torch.autograd.function.once_differentiable(_eager_grads)


class _EagerNorm(torch.autograd.Function):
    """The same forward and backward as the custom ops, for eager mode: a Function calls
    the launchers directly, without the custom-op dispatch (about 15 us of Python a
    call). ``torch.compile`` traces the custom ops instead (see :func:`_norm`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, n, eps, rms, out_dtype, memory_efficient):
        y, mean, rstd = layer_norm_fwd(x, n, weight, bias, eps, rms, out_dtype)
        ctx.save_for_backward(y if memory_efficient else x, weight, bias, mean, rstd)
        ctx.config = (n, rms, memory_efficient, x.dtype, eps)
        return y

    @staticmethod
    def backward(ctx, dy):
        # The usual backward runs with grad mode off: the gradients straight away, without
        # once_differentiable's no_grad block (a few microseconds a call).
        if torch.is_grad_enabled():
            return _eager_grads_once(ctx, dy)
        return _eager_grads(ctx, dy)


_is_compiling = torch.compiler.is_compiling
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)
# (torch.jit.is_tracing's own check, without its Python wrapper: ~0.03 us a call, not 0.16)
_is_tracing = getattr(torch._C, "_is_tracing", torch.jit.is_tracing)
_is_grad_enabled = torch.is_grad_enabled


_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HALF = (torch.bfloat16, torch.float16)


def _normalized_numel(input, normalized_shape, weight, bias):
    """The elements of one normalised row, after torch's checks of the normalized shape,
    the parameters' shapes and the input's trailing dimensions (its messages)."""
    if normalized_shape.__class__ is tuple and len(normalized_shape) == 1:  # the modules'
        n = normalized_shape[0]
        if n.__class__ is int and input.dim() and input.shape[-1] == n \
                and (weight is None or weight.shape == normalized_shape) \
                and (bias is None or bias.shape == normalized_shape):
            return n
    # (sizes as Python ints: a numpy integer, say, from a config, as torch.Size takes it)
    shape = ((operator.index(normalized_shape),)
             if isinstance(normalized_shape, numbers.Integral)
             else tuple(map(operator.index, normalized_shape)))
    k = len(shape)
    if k == 0:
        raise RuntimeError("Expected normalized_shape to be at least 1-dimensional, i.e., "
                           "containing at least one element, but got normalized_shape = []")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != shape:
            raise RuntimeError(f"Expected {name} to be of same shape as normalized_shape, but "
                               f"got {name} of shape {list(t.shape)} and normalized_shape = "
                               f"{list(shape)}")
    if input.dim() < k or tuple(input.shape[input.dim() - k:]) != shape:
        raise RuntimeError(
            f"Given normalized_shape={list(shape)}, expected input with shape [*, "
            f"{', '.join(str(s) for s in shape)}], but got input of size{list(input.shape)}")
    n = 1
    for s in shape:
        n *= s
    return n


def _norm(input, weight, bias, normalized_shape, eps, memory_efficient, rms, mixed):
    if rms:
        bias = None
    n = _normalized_numel(input, normalized_shape, weight, bias)
    dtype = input.dtype
    if dtype not in _FLOATS:
        raise TypeError(f"fused norms take float32, bfloat16, float16 or float64 input; got "
                        f"{dtype}")
    if weight is not None and weight.dtype not in _FLOATS:
        raise TypeError(f"fused norms take float32, bfloat16, float16 or float64 weights; "
                        f"got {weight.dtype}")
    if bias is not None and bias.dtype not in _FLOATS:
        raise TypeError(f"fused norms take a float32, bfloat16, float16 or float64 bias; "
                        f"got {bias.dtype}")
    if eps is None:
        # torch.nn.RMSNorm's default: the machine epsilon of the dtype it computes in,
        # fp32 for half input (its kernels' opmath type), not the half dtype's own
        eps = torch.finfo(torch.float32 if dtype in _HALF else dtype).eps
    elif eps.__class__ is not float and not isinstance(eps, (numbers.Real, torch.Tensor)):
        # (torch's words; float() took the string "1e-5")
        raise TypeError(f"{'rms_norm' if rms else 'layer_norm'}(): argument 'eps' must be "
                        f"float, not {type(eps).__name__}")
    device_type = input.device.type
    if torch.is_autocast_enabled(device_type) and dtype is not torch.float64:
        # (autocast's casts leave float64 alone)
        out_dtype = torch.get_autocast_dtype(device_type)
    elif mixed:
        if weight is None:
            raise ValueError("the mixed-dtype fused norms give their output in the weight's "
                             "dtype and need a weight; got weight=None. Pass the weight, or "
                             "call fused_layer_norm / fused_rms_norm (no affine parameters)")
        out_dtype = weight.dtype
    else:
        out_dtype = dtype
    if n == 0:  # zero-width rows: torch's own op gives the empty output and its graph
        return _torch_norm(input, weight, bias, eps, rms).to(out_dtype)
    if dtype is torch.float64 or (weight is not None and weight.dtype is torch.float64):
        return _norm_in_torch(input, weight, bias, n, eps, rms, torch.float64, out_dtype)
    compiling = _is_compiling()
    if compiling and not _is_exporting():
        return _norm_fwd(input, weight, bias, n, float(eps), rms, out_dtype,
                         bool(memory_efficient))[0]
    if compiling or _is_tracing():
        # torch.export and torch.onnx.export (exporting is compiling), torch.jit.trace:
        # torch's own ops (as Apex's norms do), so the graph runs, saves and converts
        # without tritamp
        return _norm_in_torch(input, weight, bias, n, eps, rms, torch.float32, out_dtype)
    if _is_grad_enabled() and (input.requires_grad
                               or (weight is not None and weight.requires_grad)
                               or (bias is not None and bias.requires_grad)):
        return _EagerNorm.apply(input, weight, bias, n, float(eps), rms, out_dtype,
                                bool(memory_efficient))
    # Nothing to differentiate (inference, frozen parameters): the launcher alone, without
    # the autograd Function's context and saved tensors.
    return layer_norm_fwd(input, n, weight, bias, float(eps), rms, out_dtype)[0]


def _torch_norm(input, weight, bias, eps, rms):
    """torch's layer_norm / rms_norm over ``input``'s trailing dimensions of the weight's
    shape (or the last one), the parameters cast to the input's dtype."""
    shape = list(weight.shape) if weight is not None else [input.shape[-1]]
    w = None if weight is None else weight.to(input.dtype)
    if rms:
        return torch.nn.functional.rms_norm(input, shape, w, eps)
    b = None if bias is None else bias.to(input.dtype)
    return torch.nn.functional.layer_norm(input, shape, w, b, eps)


def _norm_in_torch(input, weight, bias, n, eps, rms, compute, out_dtype):
    """torch's own norm over rows of ``n`` in ``compute`` (float64, which the kernels,
    computing in float32, do not take; float32 for graphs that leave Python, as the
    kernels compute), the result in the output dtype the fused norm would give."""
    x = input.reshape(-1, n).to(compute)
    w = None if weight is None else weight.reshape(-1).to(compute)
    if rms:
        y = torch.nn.functional.rms_norm(x, [n], w, eps)
    else:
        b = None if bias is None else bias.reshape(-1).to(compute)
        y = torch.nn.functional.layer_norm(x, [n], w, b, eps)
    return y.reshape(input.shape).to(out_dtype)


# Functional forms: Apex's signatures, with its functional eps default of 1e-6.

def fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False):
    return _norm(input, weight, bias, normalized_shape, eps, memory_efficient, False, False)


def fused_layer_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    return _norm(input, None, None, normalized_shape, eps, memory_efficient, False, False)


def mixed_dtype_fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6,
                                        memory_efficient=False):
    return _norm(input, weight, bias, normalized_shape, eps, memory_efficient, False, True)


def fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
    return _norm(input, weight, None, normalized_shape, eps, memory_efficient, True, False)


def fused_rms_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    return _norm(input, None, None, normalized_shape, eps, memory_efficient, True, False)


def mixed_dtype_fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6,
                                      memory_efficient=False):
    return _norm(input, weight, None, normalized_shape, eps, memory_efficient, True, True)


class _Apply:
    """Apex's ``*Function.apply(...)`` entry points (Megatron calls them directly)."""
    _fn = None

    @classmethod
    def apply(cls, *args, **kwargs):
        return cls._fn(*args, **kwargs)


class FusedLayerNormAffineFunction(_Apply):
    _fn = staticmethod(fused_layer_norm_affine)


class FusedLayerNormFunction(_Apply):
    _fn = staticmethod(fused_layer_norm)


class FusedLayerNormAffineMixedDtypesFunction(_Apply):
    _fn = staticmethod(mixed_dtype_fused_layer_norm_affine)


class FusedRMSNormAffineFunction(_Apply):
    _fn = staticmethod(fused_rms_norm_affine)


class FusedRMSNormFunction(_Apply):
    _fn = staticmethod(fused_rms_norm)


class FusedRMSNormAffineMixedDtypesFunction(_Apply):
    _fn = staticmethod(mixed_dtype_fused_rms_norm_affine)


class FusedLayerNorm(nn.LayerNorm):
    """Apex's ``FusedLayerNorm`` (output in the input dtype). A ``torch.nn.LayerNorm``
    subclass: same parameters, state_dict keys and ``repr``; checkpoints load both ways."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False,
                 *, bias=True, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine,
                         bias=bias, device=device, dtype=dtype)
        self.normalized_shape = tuple(map(operator.index, self.normalized_shape))
        self.memory_efficient = memory_efficient

    _mixed = False

    def forward(self, input):
        return _norm(input, self.weight, self.bias, self.normalized_shape, self.eps,
                     self.memory_efficient, False, self._mixed)


class FusedRMSNorm(nn.RMSNorm):
    """Apex's ``FusedRMSNorm`` (``eps`` defaults to 1e-5, as in Apex). A
    ``torch.nn.RMSNorm`` subclass: checkpoints load both ways."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False,
                 *, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine,
                         device=device, dtype=dtype)
        self.normalized_shape = tuple(map(operator.index, self.normalized_shape))
        self.memory_efficient = memory_efficient

    _mixed = False

    def forward(self, input):
        return _norm(input, self.weight, None, self.normalized_shape, self.eps,
                     self.memory_efficient, True, self._mixed)


def _mixed_affine(cls_name, kwargs, known=("device", "dtype")):
    if "elementwise_affine" in kwargs:
        warnings.warn(f"{cls_name} does not support `elementwise_affine` argument")
        if not kwargs.pop("elementwise_affine"):
            raise RuntimeError(f"{cls_name} does not support `elementwise_affine = False`")
    # Apex's constructors drop any other keyword (Apex's own transformer layers pass
    # sequence_parallel_enabled through them): ignored here too, said once.
    ignored = sorted(k for k in kwargs if k not in known)
    if ignored:
        warnings.warn(f"{cls_name} ignores the keyword argument(s) {ignored}, as Apex's does")
        for k in ignored:
            del kwargs[k]


class MixedFusedLayerNorm(FusedLayerNorm):
    """LayerNorm whose output takes the parameters' dtype (Megatron's mixed dtypes)."""
    _mixed = True

    def __init__(self, normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs):
        _mixed_affine("MixedFusedLayerNorm", kwargs, ("bias", "device", "dtype"))
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True,
                         memory_efficient=memory_efficient, **kwargs)


class MixedFusedRMSNorm(FusedRMSNorm):
    """RMSNorm whose output takes the parameters' dtype (Megatron's mixed dtypes)."""
    _mixed = True

    def __init__(self, normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs):
        _mixed_affine("MixedFusedRMSNorm", kwargs)
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True,
                         memory_efficient=memory_efficient, **kwargs)
