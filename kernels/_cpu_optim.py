"""What the optimizers' production CPU paths share (adam, sgd, adagrad).

torch's fused CPU optimizer kernels (``torch._fused_adamw_``, ``_fused_sgd_``,
``_fused_adagrad_``) take one dtype per tensor for parameter, gradient and state, skip
the whole call when ``found_inf == 1.0`` (read on the host), and write the unscaled
gradient back into the gradient when given ``grad_scale``. tritamp keeps fp32 state for
half parameters, skips on any non-zero ``found_inf`` and never writes a user's gradient,
so each op feeds them:

- fp32 working lists: the parameters themselves when fp32, else persistent fp32 scratch
  (:meth:`Prepared.buffers`) filled with ``torch._foreach_copy_`` and copied back after
  (on a skipped step the half -> fp32 -> half round trip is exact); the gradients
  themselves when fp32 and unscaled, else fp32 scratch they are copied into, with
  ``grad_scale`` left for the fused op to apply there (it divides by the scale where the
  kernels multiply by ``1/scale`` rounded to fp32: the same for a power-of-two scale,
  an ulp apart at most otherwise; ``torch.ops.aten._foreach_mul.Tensor_out`` would
  unscale in one pass but allocates and copies, several times slower on the CPU);
- ``skip``: 1.0 when ``found_inf`` is non-zero, else 0.0, the flag the fused ops test;
  ``keep`` (its complement) advances the step counts by 1 or 0.

Nothing here reads a tensor's value on the host.
"""
import torch


def amp_flags(found_inf):
    """``(skip, keep)``: 0-d fp32 tensors, 1/0 and 0/1 as ``found_inf`` is non-zero or
    zero (NaN counts as non-zero, as in the kernels); ``(None, None)`` without it."""
    if found_inf is None:
        return None, None
    keep = found_inf.reshape(()).eq(0).float()
    return torch.rsub(keep, 1.0), keep


def advance_counts(steps, keep):
    """step += 1, or += ``keep`` (0 on a skipped step): one foreach call."""
    if keep is None:
        torch._foreach_add_(steps, 1.0)
    else:
        torch._foreach_add_(steps, keep)


def decay_factor(lr, weight_decay, skip):
    """``1 - lr * weight_decay``, what decoupled weight decay multiplies a parameter by,
    rounded once to fp32 (a float, or a 0-d fp32 tensor for a tensor ``lr``), and exactly
    1 when ``skip`` is set: a multiplication by 1 leaves every value, NaN and -0.0
    included, bitwise as it was."""
    if isinstance(lr, torch.Tensor):
        factor = torch.rsub(lr.float() * weight_decay, 1.0)
    else:
        factor = 1.0 - lr * weight_decay
        if skip is None:
            return factor
    if skip is None:
        return factor
    return torch.where(skip.bool(), 1.0, factor)


def fp32_work(prepared, group, params, grads, grad_scale):
    """``(work_params, work_grads, scale)``: fp32 lists a torch fused CPU op may update
    and read, and the ``grad_scale`` to hand it (only ever with a scratch gradient list).
    Half parameters are copied into their scratch here: :func:`write_back` after."""
    work_p = params
    if params[0].dtype != torch.float32:
        work_p = prepared.buffers(group, "params", params)
        torch._foreach_copy_(work_p, params)
    if grads[0].dtype == torch.float32 and grad_scale is None:
        return work_p, grads, None
    work_g = prepared.buffers(group, "grads", grads)
    torch._foreach_copy_(work_g, grads)
    return work_p, work_g, grad_scale


def write_back(params, work_p, copies):
    """Half parameters from their fp32 scratch; ``copies`` (the half model weights of
    fp32 masters) from the updated values."""
    if work_p is not params:
        torch._foreach_copy_(params, work_p)
    if copies is not None:
        torch._foreach_copy_(copies, work_p)

