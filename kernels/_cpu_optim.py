"""What the optimizers' launchers share: the request to write the unscaled gradients
back (both paths), and the production CPU paths' helpers (adam, sgd, adagrad).

torch.amp.GradScaler drives an optimizer that declares ``_step_supports_amp_scaling``
by handing it ``grad_scale`` and ``found_inf``; torch's own fused optimizers then leave
``.grad`` holding the unscaled gradient after the step (untouched on a skipped step).
tritamp's optimizers do the same when asked (:class:`GradWrites`): the kernels store the
unscaled gradient they already computed (one write per element, the one torch's fused
kernels pay too), the CPU paths let torch's fused kernels write it. tritamp's amp asks
for nothing: its gradients stay as they are.

torch's fused CPU optimizer kernels (``torch._fused_adamw_``, ``_fused_sgd_``,
``_fused_adagrad_``) take one dtype per tensor for parameter, gradient and state, skip
the whole call when ``found_inf == 1.0`` (read on the host), and write the unscaled
gradient back into the gradient when given ``grad_scale``. tritamp keeps fp32 state for
half parameters and skips on any non-zero ``found_inf``, so each op feeds them:

- fp32 working lists: the parameters themselves when fp32, else persistent fp32 scratch
  (:meth:`Prepared.buffers`) filled with ``torch._foreach_copy_`` and copied back after
  (on a skipped step the half -> fp32 -> half round trip is exact); the gradients
  themselves when fp32 and either unscaled or to be written back unscaled, else fp32
  scratch they are copied into, with ``grad_scale`` left for the fused op to apply there
  (it divides by the scale where the kernels multiply by ``1/scale`` rounded to fp32:
  the same for a power-of-two scale, an ulp apart at most otherwise;
  ``torch.ops.aten._foreach_mul.Tensor_out`` would unscale in one pass but allocates and
  copies, several times slower on the CPU); half gradients to be written back are
  copied back from their scratch after the op (exact on a skipped step, as above);
- ``skip``: 1.0 when ``found_inf`` is non-zero, else 0.0, the flag the fused ops test;
  ``keep`` (its complement) advances the step counts by 1 or 0.

Nothing here reads a tensor's value on the host.
"""
import torch

from . import rounding
from ._multi_tensor import GroupChunk, Prepared, _dense, labelled

# A group whose step goes through fp32 scratch runs in ranges of about this many elements
# (1 MiB of fp32 per scratch list: it stays in cache between its copy in, the fused op and
# its copy out). Fewer elements than this: one range, as before.
CHUNK_ELEMENTS = 1 << 18
_F32 = torch.float32


class GradWrites:
    """An optimizer's prepared sweep (a :class:`~._multi_tensor.Prepared`, or an op's
    wrapper of one) handed to its launcher with the request to store each unscaled
    gradient back into its gradient: what ``torch.amp.GradScaler`` expects of an
    optimizer it hands ``grad_scale``. Check the sweep first
    (:func:`check_grads_writable`)."""
    __slots__ = ("prepared",)

    def __init__(self, prepared):
        self.prepared = prepared


def check_grads_writable(prepared):
    """Refuse (``ValueError``) gradients that a sweep reads through a dense copy and that
    cannot take the unscaled values back: expanded or overlapping ones, where several
    elements share one address. Raise it before anything is written."""
    inner = prepared
    while not isinstance(inner, Prepared):
        inner = inner.prepared
    for original, dense in inner.staged:
        if not _dense(original):
            rows = inner._lists.get("grads") or ()
            i = next((i for i, t in enumerate(rows) if t is dense), -1)
            where = f"grads[{i}]" if i >= 0 else "a gradient"
            raise ValueError(labelled(
                f"{inner.sweep.name}: {where} of shape {tuple(original.shape)} has strides "
                f"{original.stride()}: several elements share one address, so the unscaled "
                "gradient cannot be written back into it (torch.amp.GradScaler's contract). "
                "Give the parameter a dense gradient, for example "
                "p.grad = p.grad.contiguous()", inner.labels, i))


def take_grad_writes(prepared, write_grads=False):
    """``(prepared, write_grads)`` with a :class:`GradWrites` request unwrapped: what
    every optimizer launcher does first."""
    if type(prepared) is GradWrites:
        return prepared.prepared, True
    return prepared, bool(write_grads)


def write_staged_grads(prepared):
    """Gradients swept through dense copies (laid out unlike their parameters) receive
    what the sweep wrote into the copies: call after the launch that writes them."""
    for original, dense in prepared.staged:
        original.copy_(dense)


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


def step_parts(group, grad_scale, write_grads=False):
    """What a CPU step runs its body on, one after another: ``(group,)``, or its ranges
    (:class:`~._multi_tensor.GroupChunk`, see ``CHUNK_ELEMENTS``) when the group is big
    and goes through fp32 scratch (half parameters, half gradients or moments, or
    gradients unscaled into scratch). Ranges hold whole tensors, so every tensor sees the
    same operations as in one call; a rounded group (kernels/rounding.py) is not cut."""
    lists = group.lists
    moments = lists.get("exp_avgs")
    if not (lists["params"][0].dtype != _F32 or lists["grads"][0].dtype != _F32
            or (grad_scale is not None and not write_grads)
            or (moments is not None and moments[0].dtype != _F32)) or rounding.rounds(group):
        return (group,)
    ranges, span = group.chunks(CHUNK_ELEMENTS)
    if len(ranges) == 1:
        return (group,)
    return [GroupChunk(group, k, a, b, span) for k, (a, b) in enumerate(ranges)]


def run_in_parts(prepared, step, grad_scale, write_grads=False):
    """``prepared.run_cpu`` with ``step`` run on each group's parts (:func:`step_parts`)."""
    def each(group):
        for part in step_parts(group, grad_scale, write_grads):
            step(part)
    prepared.run_cpu(each)


def fp32_work(prepared, group, params, grads, grad_scale, write_grads=False):
    """``(work_params, work_grads, scale)``: fp32 lists a torch fused CPU op may update
    and read, and the ``grad_scale`` to hand it (with a scratch gradient list, or with
    the gradients themselves when they are to be written back unscaled). Half
    parameters are copied into their scratch here: :func:`write_back` after."""
    work_p = params
    if rounding.rounds(group):
        work_p = rounding.cpu_load(prepared, group, params)
    elif params[0].dtype != torch.float32:
        work_p = prepared.buffers(group, "params", params)
        torch._foreach_copy_(work_p, params)
    if grads[0].dtype == torch.float32 and (grad_scale is None or write_grads):
        return work_p, grads, grad_scale
    work_g = prepared.buffers(group, "grads", grads)
    torch._foreach_copy_(work_g, grads)
    return work_p, work_g, grad_scale


def write_back(params, work_p, copies, grads=None, work_g=None, rounded=None):
    """Half parameters from their fp32 scratch; ``copies`` (the half model weights of
    fp32 masters) from the updated values; ``grads`` (when written back unscaled) from
    their fp32 scratch ``work_g``, which the fused op unscaled in place. ``rounded``:
    ``(prepared, group)`` of a group whose bf16 parameters are stored stochastically or
    with compensation (see kernels/rounding.py), its step counts already advanced."""
    if rounded is not None and rounding.rounds(rounded[1]):
        prepared, group = rounded
        rounding.cpu_store(prepared, group, params, work_p,
                           rounding.step_counts(group, True)
                           if group.lists.get("keys") is not None else None)
    elif work_p is not params:
        torch._foreach_copy_(params, work_p)
    if copies is not None:
        torch._foreach_copy_(copies, work_p)
    if grads is not None and work_g is not grads:
        torch._foreach_copy_(grads, work_g)

