"""User extensions of O1's casting: ``register_*_function`` and the decorators.

O1 runs a model's forward under ``torch.autocast``, whose dispatcher already knows
which torch ops run in half precision, which in fp32 and which promote. These add user
functions (or torch functions the dispatcher leaves alone) to those lists. A wrapped
function casts only while autocast is on for its tensors' device, so it behaves as
before everywhere else, at every opt level.
"""
import functools

import torch

from .handle import _autocast_on


def _is_float_arg(value):
    """A floating tensor, or a list / tuple (named tuples too) of nothing else: what
    Apex's casts touched (its ``is_fp_tensor``). A container with anything else in it (a
    PackedSequence's int64 batch sizes, a named tuple with a number) passes untouched."""
    if isinstance(value, torch.Tensor):
        return value.is_floating_point()
    if isinstance(value, (list, tuple)):
        return all(map(_is_float_arg, value))
    return False


def _float_args(args, kwargs):
    """The floating tensors the casts would touch, nested ones included."""
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            if v.is_floating_point():
                yield v
        elif isinstance(v, (list, tuple)) and _is_float_arg(v):
            yield from _float_args(v, {})


def _cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)) and _is_float_arg(value):
        items = [_cast(v, dtype) for v in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
            return type(value)(*items)
        return type(value)(items)
    return value


def _active_device(floats):
    """The device type of the first floating argument for which autocast is on, or
    None (each argument's own device decides, not the first one's)."""
    seen = set()
    for t in floats:
        device_type = t.device.type
        if device_type not in seen:
            seen.add(device_type)
            if _autocast_on(device_type):
                return device_type
    return None


def _make_wrapper(fn, target, keep_autocast=False):
    """``target(device_type, floating tensors) -> dtype`` picks the dtype to run in.
    ``fn`` then runs with autocast off for that device (its own decision for an op it
    lists does not override the registration, and the whole body runs in that dtype),
    or, with ``keep_autocast``, on: the body's ops keep autocast's lists (Apex's
    half_function, whose body's fp32-list ops still ran in fp32)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        floats = list(_float_args(args, kwargs))
        device_type = _active_device(floats)
        if device_type is None:
            return fn(*args, **kwargs)
        dtype = target(device_type, [t for t in floats if t.device.type == device_type])
        if dtype is None:
            return fn(*args, **kwargs)
        args = tuple(_cast(a, dtype) for a in args)
        kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        if keep_autocast:
            return fn(*args, **kwargs)
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
    if not callable(fn):  # (it was replaced by a wrapper that failed when called)
        raise TypeError(f"{module}.{name} is a {type(fn).__name__}, not a function; register "
                        "a function (or other callable) of the module")
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
    """Decorator: inside O1 (autocast) regions ``fn``'s floating arguments are cast to
    the half dtype, and its body runs under autocast (ops autocast keeps in fp32 stay
    there), as Apex's decorator cast the arguments and left the body to its lists."""
    return _make_wrapper(fn, _half, keep_autocast=True)


def float_function(fn):
    """Decorator: ``fn`` runs in fp32 inside O1 (autocast) regions, its whole body
    (Apex cast only the arguments)."""
    return _make_wrapper(fn, _float)


def promote_function(fn):
    """Decorator: ``fn`` runs in the widest floating dtype of its arguments, its whole
    body (Apex cast only the arguments)."""
    return _make_wrapper(fn, _promote)
