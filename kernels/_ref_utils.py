"""Helpers shared by the torch ``*_ref`` implementations."""
import torch


def f32(x):
    """A Python float as the fp32 scalar the kernel receives."""
    return torch.tensor(x, dtype=torch.float32)


def sqrt_rn(x):
    """fp32 square root rounded to nearest, as ``tl.sqrt_rn``. torch's CPU ``sqrt`` is not
    always correctly rounded (vectorised paths); through fp64 it is (53 >= 2 * 24 + 2)."""
    return x.double().sqrt().float()
