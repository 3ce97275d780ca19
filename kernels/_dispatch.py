"""Where a kernel runs: one function decides (see DESIGN.md).

CUDA tensors run the compiled Triton kernel. CPU tensors run the same kernel in
Triton's interpreter when ``TRITON_INTERPRET=1`` (how the tests exercise kernels
without a GPU), and the torch ``*_ref`` implementation otherwise.

The torch ``*_ref`` implementations are oracles for the tests, never a production path:
CPU tensors without the interpreter run each op's production CPU path (``<op>_cpu``),
built on torch's multi-tensor CPU kernels (``torch._fused_adamw_``,
``torch._amp_foreach_non_finite_check_and_unscale_``, ``torch._foreach_*``).

``force_gpu_path()`` (used by :mod:`tritamp.kernels.recorder`) sends CPU tensors down
the GPU code path, with the GPU's block sizes and no interpreter emulation, so that the
host cost and the specialisations of a real GPU step can be seen without a GPU.
``force_cpu_path()`` sends CPU tensors down the production CPU path even when the
interpreter is on: how the tests run that path beside the kernels.
"""
import contextlib
import functools
import os

import torch

_forced = [False]
_forced_cpu = [False]


def interpreter_on():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def gpu_path_forced():
    return _forced[0]


@contextlib.contextmanager
def force_gpu_path():
    """Inside the block, CPU tensors take the CUDA code path (launchers, tables, block
    sizes, constexprs) as if they were on a GPU."""
    old = _forced[0]
    _forced[0] = True
    try:
        yield
    finally:
        _forced[0] = old


def cpu_path_forced():
    return _forced_cpu[0]


@contextlib.contextmanager
def force_cpu_path():
    """Inside the block, CPU tensors take the production CPU path (torch's multi-tensor
    CPU kernels) even when ``TRITON_INTERPRET=1``. The path is chosen when a sweep is
    prepared: a prepared sweep kept by an optimizer or a scaler stays on its path."""
    old = _forced_cpu[0]
    _forced_cpu[0] = True
    try:
        yield
    finally:
        _forced_cpu[0] = old


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernel (compiled or interpreted) should handle ``t``; False
    when the production CPU path should."""
    if t.is_cuda or _forced[0]:
        return True
    if _forced_cpu[0]:
        return False
    return t.device.type == "cpu" and interpreter_on()


def gpu_code_path(device: torch.device) -> bool:
    """Whether launches for ``device`` take the CUDA code path (block sizes, warps, grids,
    no interpreter emulation): on a CUDA device, or inside :func:`force_gpu_path`."""
    return device.type == "cuda" or _forced[0]


H100_SMS = 132  # the SM count the CUDA code path assumes for CPU tensors (force_gpu_path)


@functools.lru_cache(maxsize=None)
def _cuda_sms(index):
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (read once per device); an H100's 132 for
    CPU tensors on the CUDA code path; 1 for the interpreter."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None
                         else torch.cuda.current_device())
    return H100_SMS if _forced[0] else 1


def kernel_settings(device: torch.device):
    """(block, num_warps, emulate_bf16_rounding) for memory-bound sweeps on ``device``:
    one heuristic, no autotuning.

    On the GPU 1024 elements over 4 warps gives every thread 8 elements (one or two
    16-byte accesses per tensor) and keeps the optimizers' register use low. The
    interpreter pays ~30 us per program whatever the block, so it gets large blocks,
    and emulates the GPU's bf16 rounding (see _tl_utils)."""
    if device.type == "cuda" or _forced[0]:
        return 1024, 4, False
    return 4096, 4, True


def elementwise_settings(device: torch.device):
    """(block, num_warps) of :func:`kernel_settings`."""
    block, warps, _ = kernel_settings(device)
    return block, warps


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the launchers' host arithmetic: ``triton.cdiv``'s result, without
    its cost on the host (in Triton 3.8 a ``ConstexprFunction``: about 2 us a call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0): ``triton.next_power_of_2``'s result,
    without its cost on the host (see :func:`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
