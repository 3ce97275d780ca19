"""Test helpers: the one place tritamp's tests and benchmarks (and your tests of code
built on tritamp) reach state that the public API does not hand out.

amp's process-wide state
    :func:`reset_amp` forgets the last ``amp.initialize`` (run it between tests);
    :func:`amp_state` is that state (``opt_properties``, ``loss_scalers``,
    ``verbosity``), to read; :func:`stash_of` is what ``amp.initialize`` (or
    ``FP16_Optimizer``) attached to an optimizer (masters, their model parameters, the
    pending step); :func:`master_of` is the fp32 master of a half model parameter.
Fused optimizers' caches
    :func:`plans_of` (each group's kept sweep: what a step reuses while the tensors keep
    their addresses) and :func:`generation_of` (moves when something the plans depend on
    changed: a rebuild at the next step).
Dispatch
    :func:`force_cpu_path` (the production CPU path even under ``TRITON_INTERPRET=1``),
    :func:`force_gpu_path` (CPU tensors take the CUDA code path: launchers, tables,
    constexprs; pair it with :mod:`tritamp.kernels.recorder`), :func:`cpu_path_forced`,
    :func:`gpu_path_forced`, :func:`interpreter_on`; :func:`cpu_step_ranges` (the size
    of the ranges a big group's CPU step runs in, see docs/cpu-path.md) and
    :func:`scratch_bytes` (what a prepared sweep's CPU-path scratch holds).
Kernel internals
    :func:`jit_kernels` (every ``@triton.jit`` function of the kernels, by name, for
    compiling them for a GPU target without a GPU), the multi-tensor engine's
    :class:`Sweep`, :class:`Column`, :func:`layout_key` and :func:`recording_uploads`
    (the launch tables uploaded inside a block), SyncBatchNorm's launch
    geometry (:func:`syncbn_geometry`) and tile offsets (:func:`syncbn_tile`), the
    launchers' host arithmetic (:func:`host_cdiv`, :func:`host_next_power_of_2`:
    ``triton.cdiv`` / ``triton.next_power_of_2``'s results without their host cost).

See docs/architecture.md (Testing helpers).
"""
import importlib
import pkgutil

import torch

from tritamp import kernels as _kernels
from tritamp.amp.model import master_of
from tritamp.amp.state import _amp_state
from tritamp.amp.state import reset as reset_amp
from tritamp.kernels.engine import (Column, Sweep, cpu_path_forced, cpu_step_ranges,
                                    force_cpu_path, force_gpu_path, gpu_path_forced,
                                    interpreter_on, layout_key, recording_uploads)
from tritamp.kernels.engine import cdiv as host_cdiv
from tritamp.kernels.engine import next_power_of_2 as host_next_power_of_2
from tritamp.kernels.syncbn import _Geometry as syncbn_geometry
from tritamp.kernels.syncbn import _syncbn_tile as syncbn_tile

__all__ = ["reset_amp", "amp_state", "stash_of", "master_of", "plans_of", "generation_of",
           "force_cpu_path",
           "force_gpu_path", "cpu_path_forced", "gpu_path_forced", "interpreter_on",
           "jit_kernels", "Sweep", "Column", "layout_key", "recording_uploads", "syncbn_geometry",
           "syncbn_tile", "cpu_step_ranges", "scratch_bytes", "host_cdiv",
           "host_next_power_of_2"]


def amp_state():
    """amp's process-wide state: ``opt_properties`` (None before ``amp.initialize``),
    ``loss_scalers`` and ``verbosity``. Read it; change it only through
    ``amp.initialize`` or :func:`reset_amp`."""
    return _amp_state


def scratch_bytes(prepared):
    """Bytes of the distinct buffers the production CPU path's scratch of ``prepared`` (a
    prepared sweep, or an op's wrapper of one) keeps between launches."""
    inner = prepared
    while not hasattr(inner, "scratch"):
        inner = inner.prepared
    seen = {}

    def visit(x):
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    for _, made in inner.scratch._bufs.values():
        visit(made)
    return sum(seen.values())


def stash_of(optimizer):
    """What ``amp.initialize`` or ``FP16_Optimizer`` attached to ``optimizer``
    (:class:`tritamp.amp.optimizer.AmpStash`: ``masters``, ``model_params``,
    ``plain_params``, ``found_inf``, ``grad_scale``), or None."""
    return getattr(optimizer, "_amp_stash", None)


def plans_of(optimizer):
    """``{group index: SweepCache}`` of a tritamp fused optimizer: each group's kept sweep
    (``.prepared``, None before the first step) and the key it was kept under."""
    return optimizer._plans


def generation_of(optimizer):
    """A tritamp fused optimizer's generation: it moves whenever something its kept plans
    depend on changed (hyperparameters that shape a plan, ``load_state_dict``, a replaced
    ``state``), so the next step rebuilds them."""
    return optimizer._generation


def jit_kernels():
    """``{name: JITFunction}`` for every ``@triton.jit`` function of ``tritamp.kernels``,
    named without its leading underscore (``"layer_norm_fwd_kernel"``)."""
    from triton.runtime.jit import JITFunction
    found = {}
    for info in pkgutil.iter_modules(_kernels.__path__):
        mod = importlib.import_module(f"{_kernels.__name__}.{info.name}")
        for name, value in vars(mod).items():
            if isinstance(value, JITFunction) and value.__module__ == mod.__name__:
                found[name.lstrip("_")] = value
    return found
