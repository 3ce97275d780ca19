"""User extensions of O1's casting: ``register_*_function`` and the decorators.

O1 runs a model's forward under ``torch.autocast``, whose dispatcher already knows
which torch ops run in half precision, which in fp32 and which promote. These add user
functions (or torch functions the dispatcher leaves alone) to those lists. A wrapped
function casts only while autocast is on for its tensors' device, so it behaves as
before everywhere else, at every opt level.
"""
import functools

import torch


def _tensors(args, kwargs):
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (x for x in v if isinstance(x, torch.Tensor))


def _cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _active_device(args, kwargs):
    for t in _tensors(args, kwargs):
        device_type = t.device.type
        if torch.is_autocast_enabled(device_type):
            return device_type
        return None
    return None


def _make_wrapper(fn, target):
    """``target(device_type, floating tensors) -> dtype`` picks the dtype to run in."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device_type = _active_device(args, kwargs)
        if device_type is None:
            return fn(*args, **kwargs)
        floats = [t for t in _tensors(args, kwargs) if t.is_floating_point()]
        dtype = target(device_type, floats)
        if dtype is None:
            return fn(*args, **kwargs)
        args = tuple(_cast(a, dtype) for a in args)
        kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        with torch.autocast(device_type, enabled=False):
            return fn(*args, **kwargs)
    wrapper.__wrapped_by_tritamp__ = True
    return wrapper


def _half(device_type, floats):
    return torch.get_autocast_dtype(device_type)


def _float(device_type, floats):
    return torch.float32


def _promote(device_type, floats):
    if not floats:
        return None
    widest = floats[0].dtype
    for t in floats[1:]:
        widest = torch.promote_types(widest, t.dtype)
    return widest


def _register(module, name, target):
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")
    fn = getattr(module, name)
    if getattr(fn, "__wrapped_by_tritamp__", False):
        fn = fn.__wrapped__
    setattr(module, name, _make_wrapper(fn, target))


def register_half_function(module, name):
    """Run ``module.name`` in the half dtype inside O1 (autocast) regions."""
    _register(module, name, _half)


def register_float_function(module, name):
    """Run ``module.name`` in fp32 inside O1 (autocast) regions."""
    _register(module, name, _float)


def register_promote_function(module, name):
    """Run ``module.name`` in the widest floating dtype of its arguments."""
    _register(module, name, _promote)


def half_function(fn):
    """Decorator: ``fn`` runs in the half dtype inside O1 (autocast) regions."""
    return _make_wrapper(fn, _half)


def float_function(fn):
    """Decorator: ``fn`` runs in fp32 inside O1 (autocast) regions."""
    return _make_wrapper(fn, _float)


def promote_function(fn):
    """Decorator: ``fn`` runs in the widest floating dtype of its arguments."""
    return _make_wrapper(fn, _promote)
