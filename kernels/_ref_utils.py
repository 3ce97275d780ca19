"""Helpers shared by the torch ``*_ref`` implementations."""
import torch


def f32(x):
    """A Python float as the fp32 scalar the kernel receives."""
    return torch.tensor(x, dtype=torch.float32)


def sqrt_rn(x):
    """fp32 square root rounded to nearest, as ``tl.sqrt_rn``. torch's CPU ``sqrt`` is not
    always correctly rounded (vectorised paths); through fp64 it is (53 >= 2 * 24 + 2)."""
    return x.double().sqrt().float()


def advance_steps(steps, found_inf):
    """step += 1 for every step tensor, += 0 when ``found_inf`` is non-zero (reference
    path; the kernels advance their step counts themselves)."""
    steps = [s for s in steps if s is not None]
    if not steps:
        return
    if found_inf is None:
        torch._foreach_add_(steps, 1.0)
    else:
        keep = (found_inf.reshape(()) == 0).to(steps[0].dtype)
        torch._foreach_add_(steps, keep)
