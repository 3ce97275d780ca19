"""Kept launches: a compiled Triton variant launched again without Triton's per-call binding.

``kernel[grid](*args, **constexprs)`` pays, on every call, Triton's argument binding and
specialisation, its cache-key string, option parsing and a global-value check: about
10 us of Python, more than everything else a small fused call does. :class:`KeptKernel`
pays it once per *variant* and then launches the variant Triton returned directly, the
way ``JITFunction.run`` itself launches it (same launcher, same argument list, same
stream and launch hooks).

The variant is found by a key that is at least as fine as Triton's own specialisation,
computed from the arguments in a few hundred nanoseconds:

- a tensor: its dtype and whether its data pointer is 16-byte aligned (Triton's ``D``);
- an int: whether it is 1, whether it is a multiple of 16, and its width class
  (int32 / int64 / uint64), which is everything Triton specialises an int on;
- anything else (a float, a bool, ``None``): its type;
- the caller's constexpr values (``constexpr_key``), Triton's current device and the
  identity of the kernel's per-device caches (the launch recorder swaps them: a kept
  variant never outlives the cache it came from).

Two argument lists with the same key are bound by Triton to the same variant, so a
kept launch runs exactly what ``kernel[grid](...)`` would have run; a new key goes
through ``kernel[grid](...)`` once (compiling, or recording under
:func:`tritamp.kernels.recorder.record_launches`) and keeps what it returns.

A kept variant was compiled with the Triton options in force at its first launch (the
``debug`` flag, instrumentation knobs): after changing those at run time, call
:func:`forget_all` so that every kernel is bound again.

Kernels defined while ``TRITON_INTERPRET=1`` are not ``JITFunction``s: they are called
the usual way, and so is every kernel when the environment sets
``TRITAMP_DIRECT_LAUNCH=0`` when tritamp is imported (an escape hatch should a Triton
release change how ``JITFunction.run`` launches; also how the benchmarks measure what
kept launches save). A kernel whose constexpr parameters do not all follow its runtime
parameters is also called the usual way (the direct argument list could not be built
from the two parts).
"""
import os
import weakref

import torch

__all__ = ["KeptKernel", "kept_kernel", "forget_all", "arg_key", "DIRECT_LAUNCH"]

DIRECT_LAUNCH = os.environ.get("TRITAMP_DIRECT_LAUNCH", "1") != "0"
_ALL = weakref.WeakSet()  # every KeptKernel, for forget_all

_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_I64_MAX = (1 << 63) - 1
_Tensor = torch.Tensor


def arg_key(a):
    """What Triton specialises one runtime argument on (see the module docstring)."""
    if isinstance(a, _Tensor):
        return (a.dtype, not a.data_ptr() & 15)
    if a.__class__ is int:
        width = 0 if _I32_MIN <= a <= _I32_MAX else (1 if a <= _I64_MAX else 2)
        return (a == 1, not a & 15, width)
    return a.__class__


def _is_jit_function(fn):
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - triton is a dependency
        return False
    return isinstance(fn, JITFunction)


class KeptKernel:
    """One Triton kernel whose compiled variants are kept by :func:`arg_key` keys.

    ``launch(grid, args, constexprs, constexpr_key)``: ``args`` are the kernel's runtime
    arguments in parameter order (all of them, positionally), ``constexprs`` the keyword
    arguments of ``kernel[grid](...)`` (constexpr parameters and launch options such as
    ``num_warps``), ``constexpr_key`` a hashable the caller derives from them (callers
    keep it with their launch settings, so it is not rebuilt per call)."""

    __slots__ = ("fn", "direct", "_kept", "_caches", "_n_runtime", "_driver", "_knobs",
                 "__weakref__")

    def __init__(self, fn):
        self.fn = fn
        self.direct = DIRECT_LAUNCH and _is_jit_function(fn)
        self._kept = {}
        _ALL.add(self)
        self._caches = None
        self._n_runtime = None
        if self.direct:
            from triton import knobs
            from triton.runtime import driver
            self._driver, self._knobs = driver, knobs.runtime
            params = fn.params
            constexpr = [p.is_constexpr for p in params]
            first = constexpr.index(True) if True in constexpr else len(params)
            if any(not c for c in constexpr[first:]):
                self.direct = False  # runtime parameters after a constexpr one
            self._n_runtime = first

    def __repr__(self):
        return f"KeptKernel({getattr(self.fn, '__name__', self.fn)}, kept={len(self._kept)})"

    def __len__(self):
        """Variants kept."""
        return len(self._kept)

    def forget(self):
        """Drop every kept variant (the next calls go through Triton once each)."""
        self._kept.clear()

    def launch(self, grid, args, constexprs, constexpr_key):
        if not self.direct:
            return self.fn[grid](*args, **constexprs)
        if len(args) != self._n_runtime:
            raise TypeError(f"{self.fn.__name__}: {len(args)} runtime arguments given, the "
                            f"kernel takes {self._n_runtime}")
        return self._run(grid, args, constexprs, (constexpr_key, *map(arg_key, args)))

    def launch_keyed(self, grid, args, constexprs, key):
        """:meth:`launch` under the caller's ``key`` instead of one computed from ``args``,
        for a call site that knows its arguments more cheaply than :func:`arg_key` reads
        them. The key must say at least what Triton specialises on: the constexprs, every
        tensor's dtype and whether its address is 16-byte aligned, every int's value class
        (1, a multiple of 16, its width) and every other argument's type; a site keys
        only the calls it can (all pointers aligned, say) and launches the others with
        :meth:`launch`. Keyed and computed keys never meet (a marker separates them)."""
        if not self.direct:
            return self.fn[grid](*args, **constexprs)
        if len(args) != self._n_runtime:
            raise TypeError(f"{self.fn.__name__}: {len(args)} runtime arguments given, the "
                            f"kernel takes {self._n_runtime}")
        return self._run(grid, args, constexprs, (_KEYED, key))

    def launch_aligned(self, grid, args, tensors, constexprs, constexpr_key, rest_key):
        """:meth:`launch` of ``args``, keyed (:meth:`launch_keyed`) by ``constexpr_key``,
        ``rest_key`` and the dtypes of ``tensors`` when every one of them is 16-byte
        aligned, else under the computed key. ``tensors`` are the tensors among ``args``;
        ``rest_key`` says what Triton specialises every other argument on (the ints
        themselves and the types of the rest, say)."""
        ptrs = 0
        for t in tensors:
            ptrs |= t.data_ptr()
        if ptrs & 15:
            return self.launch(grid, args, constexprs, constexpr_key)
        return self.launch_keyed(grid, args, constexprs,
                                 (constexpr_key, rest_key, *[t.dtype for t in tensors]))

    def _run(self, grid, args, constexprs, key):
        drv = self._driver.active
        device = drv.get_current_device()
        caches = self.fn.device_caches
        kept = self._kept
        if caches is not self._caches:  # new caches (launch recorder in or out): start over
            kept.clear()
            self._caches = caches
        key = (device, key)
        entry = kept.get(key)
        if entry is None:
            kernel = self.fn[grid](*args, **constexprs)
            if kernel is None:
                return None
            tail = tuple(constexprs[p.name] if p.name in constexprs else p.default
                         for p in self.fn.params[self._n_runtime:])
            kept[key] = (kernel, tail)
            return kernel
        kernel, tail = entry
        stream = drv.get_current_stream(device)
        knobs = self._knobs
        enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        meta = None if enter is None else kernel.launch_metadata(grid, stream, *args, *tail)
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, meta,
                   enter, leave, *args, *tail)
        return kernel


_KEPT = {}
_KEYED = object()  # marks a caller's key (launch_keyed)


def kept_kernel(fn):
    """The :class:`KeptKernel` of ``fn``, one per kernel for the process (kept by the
    kernel's identity: hashing a ``JITFunction`` hashes its source key, ~0.3 us; the
    entry holds ``fn``, so its id is not reused while it is kept)."""
    kept = _KEPT.get(id(fn))
    if kept is None:
        kept = _KEPT[id(fn)] = KeptKernel(fn)
    return kept


def forget_all():
    """Drop every kept variant of every kernel (each is bound by Triton again at its next
    launch): after changing Triton's run-time options."""
    for kept in list(_ALL):
        kept.forget()
