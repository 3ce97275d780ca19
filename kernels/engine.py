"""The multi-tensor engine's public face: what the rest of tritamp (amp, the optimizers,
fp16_utils) and the tests build on, without reaching into the kernels' private modules.

- Keys and caches of prepared sweeps: :func:`layout_key` (addresses, and strides, element
  counts and dtypes, of a tensor list; refuses a sparse tensor by name), :class:`SweepCache` (one kept sweep per
  key), :func:`borrowed` (views a kept sweep may hold without keeping the tensors alive).
- Layout helpers: :func:`is_dense` (non-overlapping and dense), :func:`same_layout`,
  :func:`restride_like` (a copy laid out as a parameter).
- Gradient helpers: :func:`zero_grads_`, and the unscaled-gradient write-back of
  torch's GradScaler protocol (:class:`GradWrites`, :func:`check_grads_writable`,
  :func:`take_grad_writes`).
- Dispatch: :func:`use_triton`, :func:`interpreter_on`, :func:`gpu_code_path` (CUDA
  block sizes and grids), :func:`sm_count`, the launchers' host arithmetic
  (:func:`cdiv`, :func:`next_power_of_2`), and the switches tests and
  benchmarks use to take one path on any device (:func:`force_cpu_path`,
  :func:`force_gpu_path`, :func:`cpu_path_forced`, :func:`gpu_path_forced`).
- Refusals in the caller's words: :func:`row_labels` (a sweep prepared inside it names
  its row ``i`` also by the caller's label, ``param_groups[g]['params'][k]``);
  :func:`refuse_shared_rows` and its :class:`SharedMemoryError` (rows that share memory
  where one is written).
- The sweep itself, for tests of its validation: :class:`Sweep`, :class:`Column`; and
  :func:`recording_uploads`, which lists the launch tables uploaded inside a block;
  :func:`cpu_step_ranges`, the size of the ranges a big group's CPU step runs in.

See docs/multi-tensor-engine.md.
"""
import contextlib

from . import _cpu_optim, _multi_tensor
from ._cpu_optim import GradWrites, check_grads_writable, take_grad_writes
from ._dispatch import (cdiv, cpu_path_forced, force_cpu_path, force_gpu_path, gpu_code_path,
                        gpu_path_forced, interpreter_on, next_power_of_2, sm_count, use_triton)
from ._multi_tensor import (Column, KeptByLayout, SharedMemoryError, Sweep, SweepCache,
                            borrowed, check_amp_args, layout_key, list_layout, refuse_shared_rows,
                            restride_like, row_labels, same_layout, shares_memory,
                            sparse_error, zero_grads_)
from ._multi_tensor import _dense as is_dense
from ._multi_tensor import _span as memory_span

__all__ = [
    "layout_key", "list_layout", "SweepCache", "KeptByLayout", "borrowed", "is_dense",
    "same_layout", "restride_like", "row_labels", "sparse_error", "refuse_shared_rows",
    "SharedMemoryError", "shares_memory", "memory_span", "check_amp_args",
    "zero_grads_", "GradWrites", "check_grads_writable", "take_grad_writes",
    "use_triton", "interpreter_on", "force_cpu_path", "force_gpu_path", "cpu_path_forced",
    "gpu_path_forced", "gpu_code_path", "sm_count", "Sweep", "Column", "recording_uploads",
    "cpu_step_ranges", "cdiv", "next_power_of_2",
]


@contextlib.contextmanager
def recording_uploads():
    """Inside the block, every launch table a sweep uploads to the device (a host-to-device
    copy) is also appended to the yielded list: a steady training step uploads none."""
    uploads = []
    real = _multi_tensor._upload

    def upload(array, device):
        uploads.append(array)
        return real(array, device)

    _multi_tensor._upload = upload
    try:
        yield uploads
    finally:
        _multi_tensor._upload = real


@contextlib.contextmanager
def cpu_step_ranges(elements):
    """Inside the block, a fused optimizer's CPU step that goes through fp32 scratch runs
    a group of more than ``elements`` elements in ranges of about that many (whole
    tensors each), one after another; by default a range holds 2^18 elements (1 MiB of
    fp32 per scratch list). For tests: small tensors then take the path big models take."""
    if isinstance(elements, bool) or not isinstance(elements, int) or elements < 1:
        raise ValueError(f"cpu_step_ranges: elements must be a positive int (elements per "
                         f"range), got {elements!r}")
    old = _cpu_optim.CHUNK_ELEMENTS
    _cpu_optim.CHUNK_ELEMENTS = elements
    try:
        yield
    finally:
        _cpu_optim.CHUNK_ELEMENTS = old
