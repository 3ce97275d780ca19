"""Where a kernel runs: one function decides (see DESIGN.md).

CUDA tensors run the compiled Triton kernel. CPU tensors run the same kernel in
Triton's interpreter when ``TRITON_INTERPRET=1`` (how the tests exercise kernels
without a GPU), and the torch ``*_ref`` implementation otherwise.
"""
import os

import torch


def interpreter_on():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernel (compiled or interpreted) should handle ``t``."""
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and interpreter_on()


def elementwise_settings(device: torch.device):
    """Block size and warps for memory-bound sweeps (one heuristic, no autotuning).

    The interpreter pays ~30 us per program whatever the block, so it gets large
    blocks; on the GPU 2048 elements over 8 warps keeps 16-byte accesses per thread.
    """
    if device.type == "cpu":
        return 4096, 4
    return 2048, 8
