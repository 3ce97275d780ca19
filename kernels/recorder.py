"""See the GPU code path without a GPU: record what would be launched, and its host cost.

:func:`record_launches` runs tritamp's launchers on CPU tensors exactly as they run on a
CUDA device, down to Triton's own argument binding and specialisation, and stops at the
launch itself::

    # in a process where TRITON_INTERPRET=0 when tritamp.kernels is imported
    from tritamp.kernels.recorder import record_launches, count_torch_launches

    with record_launches() as rec:
        optimizer.step()                  # CPU tensors, the CUDA code path
    rec.launches                          # [Launch(name, grid), ...] in launch order
    rec.specialisations                   # one per compiled variant the step would need

Inside the block:

1. :func:`tritamp.kernels._dispatch.force_gpu_path` is on: CPU tensors take the CUDA
   code path (tables, GPU block sizes, no interpreter emulation).
2. A stand-in Triton driver is active (``triton.runtime.driver.set_active``): it reports
   a CUDA ``sm_90`` target (``GPUTarget("cuda", 90, 32)``), device 0 and stream 0. So
   ``JITFunction.run`` binds every argument and specialises it (dtypes, 16-byte
   alignment of pointers, integer divisibility) as on an H100, with the CUDA backend's
   rules.
3. Compilation is replaced: on a kernel-cache miss, instead of compiling, the
   specialisation is recorded (:class:`Specialisation`: kernel, signature with dtypes,
   constexprs, alignment attributes, options) and a stub is stored in the kernel's
   cache. The stub's ``run`` records the launch and returns. A second call with the same
   specialisation is a cache hit: steady-state calls pay exactly Triton's binding, its
   cache lookup and tritamp's own Python, which is what :mod:`benchmarks.host_overhead`
   times.

On exit the previous driver, every kernel cache that was swapped out and
``JITFunction._do_compile`` are restored; kernels first used inside the block get empty
caches again. Nothing is compiled, nothing touches a GPU.

Kernels defined while ``TRITON_INTERPRET=1`` are interpreted functions, not
``JITFunction``: they do not go through ``JITFunction.run``. The recorder refuses to
start in that case (the test session runs the interpreter, so its tests start a child
process with ``TRITON_INTERPRET=0``).

:func:`count_torch_launches` counts, in an untimed pass, the torch operators that would
launch a kernel on a GPU (a ``TorchDispatchMode``): views, allocations and pure metadata
operators are left out, host reads of device values (``.item()``) are counted apart.
"""
import collections
import contextlib
import dataclasses
import sys
from typing import Any, Dict, List, Tuple

import torch

from ._dispatch import force_gpu_path

__all__ = ["record_launches", "count_torch_launches", "Recording", "Specialisation",
           "Launch", "TorchLaunchCount", "StandInDriver", "HOPPER"]


def _gpu_target():
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", 90, 32)


HOPPER = ("cuda", 90, 32)


class StandInDriver:
    """A Triton driver that reports an H100 (sm_90) as device 0, stream 0, and never
    touches a GPU. Only what ``JITFunction.run`` and ``create_binder`` ask for."""

    def __init__(self, target=None):
        self.target = target if target is not None else _gpu_target()

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_device_capability(self, device=None):
        return divmod(self.target.arch, 10)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def map_python_to_cpp_type(self, ty):
        from triton.backends.nvidia.driver import ty_to_cpp
        return ty_to_cpp(ty)

    @staticmethod
    def is_active():
        return True


def _short_name(fn):
    return fn.fn.__name__ if hasattr(fn, "fn") else str(fn)


def _jsonable(value):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


@dataclasses.dataclass
class Specialisation:
    """One variant of one kernel, as ``JITFunction.run`` specialised it: what
    ``triton.compile(ASTSource(fn, signature, constexprs, attrs), target, options)``
    would build on a cache miss."""
    fn: Any                       # the JITFunction
    key: str                      # Triton's kernel-cache key
    signature: Dict[str, str]     # parameter -> '*fp16', 'i32', 'fp32', 'constexpr', ...
    constexprs: Dict[Tuple, Any]  # Triton's form: (param index,) -> value
    attrs: Dict[Tuple, Any]       # (param index,) -> [['tt.divisibility', 16], ...]
    options: Dict[str, Any]       # the backend options (num_warps, num_stages, ...)

    @property
    def name(self):
        return _short_name(self.fn)

    @property
    def module(self):
        return self.fn.module

    @property
    def num_warps(self):
        return self.options.get("num_warps")

    def constexpr_values(self):
        """{parameter name: value} of the constexprs."""
        names = list(self.signature)
        return {names[path[0]] if len(path) == 1 else str(path): value
                for path, value in self.constexprs.items()}

    def aligned(self):
        """Parameters Triton specialised as 16-divisible (pointers 16-byte aligned,
        integers multiples of 16)."""
        names = list(self.signature)
        out = []
        for path, attr in self.attrs.items():
            if any(a and a[0] == "tt.divisibility" for a in attr):
                out.append(names[path[0]] if len(path) == 1 else str(path))
        return out

    def label(self):
        """A short, stable description: dtypes of the pointer arguments and the
        constexprs that are not defaults of the engine."""
        cx = self.constexpr_values()
        types = ",".join(t[1:] for t in self.signature.values() if t.startswith("*"))
        flags = ",".join(f"{k}={v}" for k, v in cx.items())
        return f"{self.name}[{types}|{flags}|w{self.num_warps}]"

    def as_dict(self):
        return dict(kernel=self.name, module=self.module, key=self.key,
                    signature={k: v for k, v in self.signature.items() if v != "constexpr"},
                    constexprs={k: _jsonable(v) for k, v in self.constexpr_values().items()},
                    aligned=self.aligned(), num_warps=self.num_warps, label=self.label())

    def compile(self, target=None):
        """Compile this variant for ``target`` (default sm_90) with the recorded
        alignment attributes, so the compiler sees what it would see on the GPU. Needs
        ``TRITON_INTERPRET=0`` when the kernel's module was imported."""
        import triton
        from triton.compiler import ASTSource
        src = ASTSource(fn=self.fn, signature=dict(self.signature),
                        constexprs=dict(self.constexprs), attrs=dict(self.attrs))
        return triton.compile(src, target=target if target is not None else _gpu_target(),
                              options=dict(self.options))


@dataclasses.dataclass
class Launch:
    """One launch that would have happened: the kernel, its grid, its variant."""
    name: str
    grid: Tuple[int, int, int]
    specialisation: Specialisation


class _StubKernel:
    """Stands in for a compiled kernel in a JITFunction's cache: ``run`` records."""
    __slots__ = ("spec", "launches", "function", "packed_metadata")

    def __init__(self, spec, launches):
        self.spec = spec
        self.launches = launches
        self.function = None
        self.packed_metadata = None

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, grid_0, grid_1, grid_2, stream, function, packed_metadata, launch_metadata,
            enter_hook, exit_hook, *args):
        self.launches.append(Launch(self.spec.name, (grid_0, grid_1, grid_2), self.spec))


class Recording:
    """What :func:`record_launches` saw: ``launches`` in order, ``specialisations`` in
    order of first use (one per kernel-cache miss)."""

    def __init__(self):
        self.launches: List[Launch] = []
        self.specialisations: List[Specialisation] = []

    def clear(self):
        """Forget the launches (the specialisations stay: they are still cached)."""
        self.launches.clear()

    def counts(self):
        """{kernel name: launches}."""
        return dict(collections.Counter(l.name for l in self.launches))


def _registered_jit_functions():
    """Every ``JITFunction`` whose kernel cache the recorder swaps: Triton's registry of
    them where it keeps one (3.7 and later), else those of tritamp's kernel modules (a
    kernel defined elsewhere is still recorded; its cache is emptied on exit)."""
    from triton.runtime import jit
    registry = getattr(jit, "_triton_jit_function_registry", None)
    if registry is not None:
        found = list(registry.values())
    else:
        found = [f for name, module in list(sys.modules.items())
                 if name.startswith(__package__ + ".") and module is not None
                 for f in list(vars(module).values())]
    return {id(f): f for f in found if isinstance(f, jit.JITFunction)}


def _check_not_interpreted():
    from triton import knobs
    from triton.runtime.jit import JITFunction
    interpreted = knobs.runtime.interpret
    if not interpreted:
        try:  # the template kernel tells how tritamp's kernels were defined
            from . import adam
            interpreted = not isinstance(adam._adam_step_kernel, JITFunction)
        except Exception:
            pass
    if interpreted:
        raise RuntimeError(
            "record_launches needs compiled-mode kernels, but Triton's interpreter is on "
            "(TRITON_INTERPRET=1 when tritamp.kernels was imported): interpreted kernels do "
            "not go through JITFunction.run. Run it in a process that sets "
            "TRITON_INTERPRET=0 before importing tritamp.")


@contextlib.contextmanager
def record_launches(target=None):
    """Run the block on the GPU code path with a stand-in sm_90 driver, recording every
    Triton launch instead of compiling and running it (see the module docstring).
    Yields a :class:`Recording`."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
    _check_not_interpreted()
    recording = Recording()
    saved_caches = {}
    for key, fn in _registered_jit_functions().items():
        saved_caches[key] = (fn, fn.device_caches)
        fn.device_caches = collections.defaultdict(fn.create_binder)
    touched = {}
    original_do_compile = JITFunction.__dict__["_do_compile"]

    def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel_cache = self.device_caches[device][0]
        if id(self) not in saved_caches and id(self) not in touched:
            touched[id(self)] = self
        spec = Specialisation(fn=self, key=key, signature=dict(signature),
                              constexprs=dict(constexprs), attrs=dict(attrs),
                              options=dict(options.__dict__))
        recording.specialisations.append(spec)
        stub = _StubKernel(spec, recording.launches)
        kernel_cache[key] = stub
        return stub

    saved_driver = getattr(driver, "_active", None)
    driver.set_active(StandInDriver(target))
    JITFunction._do_compile = _do_compile
    try:
        with force_gpu_path():
            yield recording
    finally:
        JITFunction._do_compile = original_do_compile
        if saved_driver is None:
            driver._active = None  # reset_active() would create the default (GPU) driver
        else:
            driver.set_active(saved_driver)
        for fn, caches in saved_caches.values():
            fn.device_caches = caches
        for fn in touched.values():
            fn.device_caches = collections.defaultdict(fn.create_binder)


# --- torch kernel launches ---------------------------------------------------------------

# Operators that launch nothing on a GPU: allocation, aliasing, metadata.
_NO_LAUNCH = {
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach",
    "alias", "lift_fresh", "set_", "resize_", "resize_as_", "_reshape_alias", "_unsafe_view",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
    "_has_compatible_shallow_copy_type", "record_stream", "result_type", "view",
    "as_strided", "_local_scalar_dense_noop", "size", "stride", "dim", "is_contiguous",
    "_version", "requires_grad_", "_is_view", "_make_dep_token",
    # profiler markers (torch.optim's step wraps itself in record_function)
    "_record_function_enter", "_record_function_enter_new", "_record_function_exit",
}
# Operators that read a device value back to the host (a synchronisation on a GPU).
_HOST_READ = {"_local_scalar_dense", "is_nonzero", "equal", "item", "nonzero", "masked_select",
              "_assert_async"}


class TorchLaunchCount:
    """Counts of :func:`count_torch_launches`: ``launches`` (total), ``by_op``
    (operator -> count), ``host_reads`` (operators that read a device value on the host)."""

    def __init__(self):
        self.by_op = collections.Counter()
        self.host_reads = collections.Counter()
        self.skipped = collections.Counter()

    @property
    def launches(self):
        return sum(self.by_op.values())

    def as_dict(self):
        return dict(launches=self.launches, by_op=dict(self.by_op),
                    host_reads=dict(self.host_reads))


def _op_name(func):
    name = func.__name__  # e.g. 'add_.Tensor'
    return name.split(".")[0]


@contextlib.contextmanager
def count_torch_launches():
    """Count the torch operators run in the block that would launch a kernel on a GPU.

    Each operator counts once (a foreach operator is one launch here; on a GPU it may
    chunk into several). Views, allocations and metadata operators are not launches;
    operators that read a value back to the host (``.item()``, ``bool(t)``) are counted
    in ``host_reads`` and not as launches. Adds a dispatch layer: count in an untimed
    pass."""
    from torch.utils._python_dispatch import TorchDispatchMode

    count = TorchLaunchCount()

    class _Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = _op_name(func)
            if name in _HOST_READ:
                count.host_reads[name] += 1
            elif getattr(func, "is_view", False) or name in _NO_LAUNCH:
                count.skipped[name] += 1
            else:
                count.by_op[name] += 1
            return func(*args, **(kwargs or {}))

    with _Counter():
        yield count
