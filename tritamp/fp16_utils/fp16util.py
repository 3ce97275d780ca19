"""Apex's manual mixed-precision helpers: half models with fp32 BatchNorm, fp32 master
parameter lists, and the copies between them.

The copies run on tritamp's multi-tensor kernel (``check_unscale`` with no scale: one
launch per dtype group, casting on the way, nothing read back to the host). Beyond
Apex, the conversions take a ``dtype`` (``torch.float16`` by default, or
``torch.bfloat16``).
"""
import functools
import operator

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors
from torch.nn.modules.batchnorm import _BatchNorm

from tritamp.amp.model import applier
from tritamp.amp.model import convert_module as _amp_convert_module
from tritamp.amp.model import convert_network as _amp_convert_network
from tritamp.amp.properties import check_half_dtype
from tritamp.kernels.engine import is_dense, same_layout
from tritamp.optimizers.clip import clip_grad_norm_

from ._kept import KeptSweeps

_COPIES = KeptSweeps("fp16_utils")  # the copies between model and master tensors

__all__ = ["tofp16", "BN_convert_float", "network_to_half", "convert_module", "convert_network",
           "FP16Model", "prep_param_lists", "model_grads_to_master_grads",
           "master_params_to_model_params", "to_python_float", "clip_grad_norm"]


class tofp16(nn.Module):
    """A module whose forward casts its input to the half dtype (``input.half()``)."""

    def __init__(self, dtype=torch.float16):
        super().__init__()
        check_half_dtype(dtype)
        self.dtype = dtype

    def forward(self, input):
        return input.to(self.dtype)


def BN_convert_float(module):
    """Cast every affine BatchNorm in ``module`` back to fp32 (for :func:`network_to_half`)."""
    if isinstance(module, _BatchNorm) and module.affine is True:
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network, dtype=torch.float16):
    """``nn.Sequential(tofp16(), network in half with fp32 BatchNorm)``; prefer :class:`FP16Model`."""
    check_half_dtype(dtype)
    return nn.Sequential(tofp16(dtype), BN_convert_float(network.to(dtype)))


def convert_module(module, dtype):
    """Cast ``module``'s own floating parameters, their gradients and buffers to ``dtype``."""
    _amp_convert_module(module, dtype)


def convert_network(network, dtype):
    """Cast ``network`` to ``dtype`` in place, affine BatchNorm left in fp32."""
    return _amp_convert_network(network, dtype, keep_batchnorm_fp32=True)


class FP16Model(nn.Module):
    """``network`` in half precision (affine BatchNorm kept fp32); forward casts floating
    inputs to the half dtype. Integer inputs (token ids, labels) pass unchanged, where
    Apex's ``.half()`` turned them into floats."""

    def __init__(self, network, dtype=torch.float16):
        super().__init__()
        check_half_dtype(dtype)
        self.dtype = dtype
        self.network = convert_network(network, dtype=dtype)

    def forward(self, *inputs):
        inputs = applier(inputs, lambda t: t.to(self.dtype) if t.is_floating_point() else t)
        return self.network(*inputs)


def prep_param_lists(model, flat_master=False):
    """``(model_params, master_params)``: the model's trainable parameters and fp32 copies.

    With ``flat_master=True`` the masters are one flat fp32 Parameter (with a zeroed
    ``.grad``), which needs every parameter to have the same dtype."""
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        dtypes = {p.dtype for p in model_params}
        if len(dtypes) > 1:
            raise TypeError("Error in prep_param_lists:  model may contain a mixture of parameters "
                            f"of different types ({sorted(map(str, dtypes))}).  Use "
                            "flat_master=False, or use FP16_Optimizer.")
        if not model_params:
            raise ValueError("prep_param_lists(flat_master=True): the model has no trainable "
                             "parameters to flatten")
        flat = _flatten_dense_tensors([p.detach() for p in model_params]).float()
        master = nn.Parameter(flat)
        master.grad = torch.zeros_like(flat)
        return model_params, [master]
    master_params = [p.detach().clone().float() for p in model_params]
    for m in master_params:
        m.requires_grad = True
    return model_params, master_params


def _check_flat(flat, params):
    total = sum(p.numel() for p in params)
    if flat.numel() != total:
        raise ValueError(f"the flat master holds {flat.numel()} elements but the model parameters "
                         f"hold {total}; pass the lists prep_param_lists(model, flat_master=True) "
                         "returned")


def _flat_views(flat, params):
    """Views of the flat master ``flat`` shaped like each of ``params``, in order."""
    if flat.dim() != 1:
        raise ValueError(f"the flat master has shape {tuple(flat.shape)}, expected one "
                         "dimension; pass the lists prep_param_lists(model, flat_master=True) "
                         "returned")
    _check_flat(flat, params)
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    return views


def _check_pairs(model_params, master_params, flat_master):
    if flat_master:
        if len(master_params) != 1:
            raise ValueError(f"flat_master=True expects one flat master parameter, got "
                             f"{len(master_params)}")
    elif len(model_params) != len(master_params):
        raise ValueError(f"{len(model_params)} model parameters but {len(master_params)} master "
                         "parameters; pass the lists prep_param_lists returned")


_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the copy sweep takes


def _copy(srcs, dsts):
    """dst = src (cast), one launch per dtype group; pairs whose layouts differ (a
    channels-last tensor against a flat view), or with a dtype the sweep does not take
    (float64), go through torch's copy."""
    fused_src, fused_dst = [], []
    for s, d in zip(srcs, dsts):
        if is_dense(s) and same_layout(s, d) and s.dtype in _FUSED_DTYPES \
                and d.dtype in _FUSED_DTYPES:
            fused_src.append(s)
            fused_dst.append(d)
        else:
            d.copy_(s)
    _COPIES.run(fused_src, fused_dst)


@torch.no_grad()
def model_grads_to_master_grads(model_params, master_params, flat_master=False):
    """Copy the model's (half) gradients into the fp32 masters' gradients.

    A model parameter without a gradient leaves its master without one (a zero slice of
    the flat gradient with ``flat_master=True``). Every gradient is checked before any
    master gradient is made or written: a sparse gradient, or one whose shape or device
    is not its master's, raises and leaves the masters as they were."""
    model_params, master_params = list(model_params), list(master_params)
    _check_pairs(model_params, master_params, flat_master)
    if flat_master:
        master = master_params[0]
        for i, p in enumerate(model_params):
            if p.grad is not None:
                _check_grad(i, p.grad, None, master.device, "the flat master")
        _check_grad_slot(master, 0)
        _check_flat(master, model_params)
        if master.grad is None:
            master.grad = torch.zeros_like(master)
        views = _flat_views(master.grad, model_params)
        srcs, dsts = [], []
        for p, v in zip(model_params, views):
            if p.grad is None:
                v.zero_()
            else:
                srcs.append(p.grad)
                dsts.append(v)
        _copy(srcs, dsts)
        return
    if not _plain_pairs(model_params, master_params):
        for i, (model, master) in enumerate(zip(model_params, master_params)):
            if model.grad is not None:
                _check_grad(i, model.grad, master.shape, master.device, f"master_params[{i}]")
                _check_grad_slot(master, i)
    srcs, dsts = [], []
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        srcs.append(model.grad)
        dsts.append(master.grad)
    _copy(srcs, dsts)


_grad_of = operator.attrgetter("grad")
_is_none = functools.partial(operator.is_, None)
_layout_of = operator.attrgetter("layout")
_device_of = operator.attrgetter("device")
_shape_of = operator.attrgetter("shape")


def _plain_pairs(model_params, master_params):
    """The common case, in C-level maps (no per-parameter Python): every model parameter
    has a dense gradient of its master's shape, all on one device, and the masters hold
    either no gradients or dense ones of their shapes. False sends the pairs through the
    per-pair checks, which name what is wrong (or pass them: some without gradients)."""
    grads = list(map(_grad_of, model_params))
    held = list(map(_grad_of, master_params))
    if any(map(_is_none, grads)):
        return False
    shapes = list(map(_shape_of, master_params))
    if all(map(_is_none, held)):
        held = []
    elif any(map(_is_none, held)) or list(map(_shape_of, held)) != shapes:
        return False
    return (set(map(_layout_of, grads + held)) == {torch.strided}
            and len(set(map(_device_of, grads + master_params))) == 1
            and list(map(_shape_of, grads)) == shapes)


def _check_grad(i, grad, shape, device, master_name):
    """model_params[i].grad can be copied into a master gradient of ``shape`` (None: a
    slice of the flat master, whose size is checked whole) on ``device``; else the error
    names it, its value and the fix."""
    op = "model_grads_to_master_grads"
    if grad.layout != torch.strided:
        raise ValueError(f"{op}: model_params[{i}].grad is a sparse tensor ({grad.layout}); the "
                         "fp32 master gradients are dense: make the gradient dense (an "
                         "nn.Embedding with sparse=False) or copy it yourself with "
                         "grad.to_dense(). Nothing was written")
    if grad.device != device:
        raise ValueError(f"{op}: model_params[{i}].grad is on {grad.device} but "
                         f"{master_name} is on {device}; keep each master on its model "
                         "parameter's device (prep_param_lists does). Nothing was written")
    if shape is not None and grad.shape != shape:
        raise ValueError(f"{op}: model_params[{i}].grad has shape {tuple(grad.shape)} but "
                         f"{master_name} has shape {tuple(shape)}; pass the lists "
                         "prep_param_lists returned. Nothing was written")


def _check_grad_slot(master, i):
    """A master's existing gradient can take the copy (dense, the master's shape)."""
    g = master.grad
    if g is not None and (g.layout != torch.strided or g.shape != master.shape):
        raise ValueError(f"model_grads_to_master_grads: master_params[{i}].grad is a "
                         f"{'sparse' if g.layout != torch.strided else 'dense'} tensor of "
                         f"shape {tuple(g.shape)}, not a dense gradient of the master's shape "
                         f"{tuple(master.shape)}; set master_params[{i}].grad = None to have "
                         "it made again. Nothing was written")


@torch.no_grad()
def master_params_to_model_params(model_params, master_params, flat_master=False):
    """Copy the fp32 masters into the model's parameters (rounded to their dtype)."""
    model_params, master_params = list(model_params), list(master_params)
    _check_pairs(model_params, master_params, flat_master)
    if flat_master:
        if not isinstance(master_params[0], torch.Tensor):
            raise TypeError(f"master_params_to_model_params: the flat master is a "
                            f"{type(master_params[0]).__name__}, expected a tensor")
        master_params = _flat_views(master_params[0].detach(), model_params)
    # Every pair before any copy: torch's copy (pairs of different layouts) would
    # broadcast a master of another shape, and ran before the sweep checked the others.
    for i, (p, m) in enumerate(zip(model_params, master_params)):
        if not isinstance(m, torch.Tensor) or m.shape != p.shape or m.device != p.device \
                or not m.is_floating_point() or m.is_meta:
            got = (f"{m.dtype} of shape {tuple(m.shape)} on {m.device}"
                   if isinstance(m, torch.Tensor) else type(m).__name__)
            raise ValueError(f"master_params_to_model_params: master_params[{i}] is {got}, "
                             f"but model_params[{i}] has shape {tuple(p.shape)} on {p.device}; "
                             "pass the lists prep_param_lists returned. Nothing was written")
    _copy([m.detach() for m in master_params], [p.detach() for p in model_params])


def to_python_float(t):
    """A Python number from a 0-d / one-element tensor (reads the device) or a sequence."""
    if hasattr(t, "item"):
        return t.item()
    return t[0]


clip_grad_norm = clip_grad_norm_
"""``torch.nn.utils.clip_grad_norm_`` on tritamp's multi-tensor kernels (L2: no host sync)."""
