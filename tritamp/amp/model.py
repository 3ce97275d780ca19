"""What initialize does to models: casts, forward patches, fp32 state dicts.

Public to tritamp's packages (``tritamp.fp16_utils`` casts with the same functions)."""
import collections.abc as abc
import copy
import functools

import numpy as np
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .handle import casts_disabled
from .properties import HALF_DTYPES
from .state import warn_or_err

MASTER_ATTR = "_tritamp_master"  # a half model parameter -> its fp32 master
# (the other way, master -> model parameter, is the optimizer's tritamp.contract.MasterPairs)


def check_models(models):
    for model in models:
        parallel_type = None
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            parallel_type = "torch.nn.parallel.DistributedDataParallel"
        elif isinstance(model, torch.nn.DataParallel):
            parallel_type = "torch.nn.parallel.DataParallel"
        if parallel_type is not None:
            raise RuntimeError(f"Incoming model is an instance of {parallel_type}. Parallel wrappers "
                               "should only be applied to the model(s) AFTER \nthe model(s) have been "
                               "returned from amp.initialize.")
        if getattr(model, "_tritamp_initialized", False):
            raise RuntimeError("This model has already been through amp.initialize. Pass a fresh "
                               "model (re-create it, or load its state_dict into a new instance).")


def check_params_fp32(models):
    """Apex's check: the models come in fp32, amp casts them. Names the first tensor
    that is not (and how many others), its dtype and the fix. A float64 buffer (rotary
    frequencies, say) is accepted, as Apex accepts every buffer but a half one: O1 leaves
    it as it is, O2/O3 cast it with the model."""
    found = []
    for m, model in enumerate(models):
        where = f" (in models[{m}])" if len(models) > 1 else ""
        for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
            for name, t in named:
                if t.is_floating_point() and t.dtype != torch.float32 and not (
                        kind == "buffer" and t.dtype == torch.float64):
                    found.append((kind, name + where, t.dtype))
    if not found:
        return
    kind, name, dtype = found[0]
    others = ""
    if len(found) > 1:
        listed = ", ".join(f"{n} ({d})" for _, n, d in found[1:4])
        more = f" and {len(found) - 4} more" if len(found) > 4 else ""
        others = f" Also not torch.float32: {listed}{more}."
    warn_or_err(f"Found {kind} {name} with type {dtype}, expected torch.float32.\n"
                "When using amp.initialize, you do not need to call .half() on your "
                "model\nbefore passing it, no matter what optimization level you choose. "
                "Pass the model in float32 (call model.float() before amp.initialize); "
                f"amp casts it as the opt level asks.{others}")


def convert_module(module, dtype):
    """Cast ``module``'s own floating parameters, their gradients and buffers to ``dtype``."""
    # Assigning .data keeps every Parameter and buffer object, as Apex's cast did:
    # optimizers built on the fp32 model still hold the right tensors, and a buffer two
    # modules share stays one tensor.
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype)
            if param.grad is not None and param.grad.is_floating_point():
                param.grad = param.grad.to(dtype)
    for buf in module.buffers(recurse=False):
        if buf is not None and buf.is_floating_point():
            buf.data = buf.data.to(dtype)


def _modules_to_convert(network, keep_batchnorm_fp32):
    for module in network.modules():
        if keep_batchnorm_fp32 and isinstance(module, _BatchNorm) and module.affine:
            continue
        yield module


def planned_param_dtypes(networks, dtype, keep_batchnorm_fp32):
    """{parameter: the dtype convert_network(network, dtype, ...) gives it}, changing
    nothing: the floating parameters the cast reaches."""
    planned = {}
    for network in networks:
        for module in _modules_to_convert(network, keep_batchnorm_fp32):
            for param in module.parameters(recurse=False):
                if param.is_floating_point():
                    planned[param] = dtype
    return planned


def convert_network(network, dtype, keep_batchnorm_fp32):
    """Cast ``network`` to ``dtype`` in place, affine BatchNorm left fp32 if asked."""
    for module in _modules_to_convert(network, keep_batchnorm_fp32):
        convert_module(module, dtype)
        if isinstance(module, torch.nn.RNNBase):
            module.flatten_parameters()
    return network


def to_type(dtype, t):
    if isinstance(t, torch.Tensor):
        return t.to(dtype) if t.is_floating_point() else t
    return t.to(dtype)


def widen_type(dtype, t):
    """:func:`to_type` for O1's outputs: a half tensor (what autocast made) to ``dtype``,
    other tensors as they are (a float64 output stays float64, as Apex's O1 left it)."""
    if isinstance(t, torch.Tensor):
        return t.to(dtype) if t.dtype in HALF_DTYPES else t
    return t.to(dtype)


def _is_plain_tensor(value):
    return type(value) is torch.Tensor or type(value) is torch.nn.Parameter


def applier(value, fn):
    """Apply ``fn`` to every tensor in a (nested) container; other values pass through."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (str, bytes, np.ndarray)):
        return value
    if hasattr(value, "to") and not isinstance(value, torch.nn.Module):
        return fn(value)  # custom batch classes
    if isinstance(value, abc.Mapping):
        return _mapping_applied(value, {k: applier(v, fn) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(applier(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(applier(v, fn) for v in value)
    return value


def _mapping_applied(value, items):
    """``value`` (a Mapping) with ``items`` (its values applied): the same object when
    nothing changed, a copy of its own type for a mutable one (an ``OrderedDict``
    subclass such as a model-output class keeps its attributes), a plain dict
    otherwise (Apex's applier made a dict of every Mapping)."""
    if type(value) is dict:
        return items
    if all(items[k] is v for k, v in value.items()):
        return value
    if isinstance(value, abc.MutableMapping):
        try:
            out = copy.copy(value)
            for k, v in items.items():
                out[k] = v
            return out
        except Exception:  # a mapping that cannot be copied: Apex's plain dict
            pass
    return items


def _device_type(args, kwargs, model):
    """The device O1's autocast region is for: the first floating input's (an index,
    mask or lengths tensor on the CPU, given first, does not decide), else the model's
    parameters', else the first input's."""
    first = None
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            if v.is_floating_point():
                return v.device.type
            if first is None:
                first = v.device.type
    for p in model.parameters():
        return p.device.type
    return first or "cpu"


def patch_forward(model, input_dtype=None, output_dtype=None, autocast_dtype=None,
                  widen_outputs=False):
    """Wrap ``model.forward``: cast floating inputs, run under autocast, cast outputs
    (with ``widen_outputs`` only half ones: :func:`widen_type`)."""
    old_forward = model.forward
    input_caster = functools.partial(to_type, input_dtype) if input_dtype is not None else None
    output_caster = (None if output_dtype is None else
                     functools.partial(widen_type if widen_outputs else to_type, output_dtype))

    @functools.wraps(old_forward)
    def new_forward(*args, **kwargs):
        if input_caster is not None:
            if all(map(_is_plain_tensor, args)):  # the common call: model(x), model(x, y)
                args = tuple(map(input_caster, args))
            else:
                args = applier(args, input_caster)
            if kwargs:
                kwargs = applier(kwargs, input_caster)
        if autocast_dtype is not None and not casts_disabled():
            with torch.autocast(_device_type(args, kwargs, model), dtype=autocast_dtype):
                output = old_forward(*args, **kwargs)
        else:
            output = old_forward(*args, **kwargs)
        if output_caster is not None:
            output = (output_caster(output) if type(output) is torch.Tensor
                      else applier(output, output_caster))
        return output

    model.forward = new_forward


def master_of(param):
    """The fp32 master weight amp keeps for the half model parameter ``param`` (O2, or
    ``master_weights=True``), or None when it has none."""
    return getattr(param, MASTER_ATTR, None)


def _fp32_state_dict_hook(module, state_dict, prefix, local_metadata):
    """``state_dict()`` returns fp32: the master weight where one exists (so a checkpoint
    keeps every bit of it), the upcast half tensor otherwise. Registered on every
    module, each handling its own entries, so a submodule's state_dict is fp32 too."""
    for name, p in module.named_parameters(recurse=False):
        master = getattr(p, MASTER_ATTR, None)
        key = prefix + name
        if master is not None and key in state_dict:
            state_dict[key] = master if state_dict[key].requires_grad else master.detach()
    for name, value in module.named_buffers(recurse=False):
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(value, torch.Tensor) and value.is_floating_point() \
                and value.dtype != torch.float32:
            state_dict[key] = value.float()
    for name, p in module.named_parameters(recurse=False):
        key = prefix + name
        value = state_dict.get(key)
        if getattr(p, MASTER_ATTR, None) is None and isinstance(value, torch.Tensor) \
                and value.is_floating_point() and value.dtype != torch.float32:
            state_dict[key] = value.float()


def _load_masters_hook(module, state_dict, prefix, *args):
    """Loading fp32 values into a half parameter loads its master weight as well."""
    with torch.no_grad():
        for name, p in module.named_parameters(recurse=False):
            master = getattr(p, MASTER_ATTR, None)
            value = state_dict.get(prefix + name)
            if master is not None and isinstance(value, torch.Tensor) \
                    and value.shape == master.shape:
                master.copy_(value)


def register_fp32_state_dict(model):
    for module in model.modules():
        module.register_state_dict_post_hook(_fp32_state_dict_hook)
        module.register_load_state_dict_pre_hook(_load_masters_hook)
